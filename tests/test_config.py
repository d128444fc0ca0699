"""TOML configuration: both dispatch forms, every precision, overrides, and the error messages."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from prime_megamoe import ConfigError, DispatchConfig, MoEConfig, load_config
from prime_megamoe.config import DISPATCH_TYPES, PRECISIONS, config_from_dict, set_dotted

REPO = Path(__file__).resolve().parent.parent
CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


def write_toml(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------------------------------------------------
# The two dispatch forms


@pytest.mark.parametrize("backend", ["mega_moe", "torch"])
def test_dispatch_shorthand(tmp_path, backend):
    path = write_toml(
        tmp_path,
        f"""
        [model.moe]
        dispatch = "{backend}"
        precision = "bf16"
        """,
    )
    cfg = load_config(path)
    assert cfg.model.moe.dispatch.type == backend
    assert isinstance(cfg.model.moe.dispatch, DispatchConfig)
    # The shorthand leaves the backend options at their defaults.
    defaults = DispatchConfig()
    assert cfg.model.moe.dispatch.max_tokens_per_rank == defaults.max_tokens_per_rank
    assert cfg.model.moe.dispatch.deterministic is defaults.deterministic
    assert cfg.model.moe.precision == "bf16"


@pytest.mark.parametrize(
    "backend, max_tokens, num_sms, deterministic",
    [("mega_moe", 4096, 100, False), ("torch", 123, 1, True)],
)
def test_dispatch_table(tmp_path, backend, max_tokens, num_sms, deterministic):
    path = write_toml(
        tmp_path,
        f"""
        [model]
        name = "tiny"

        [model.moe]
        precision = "fp8"
        ep = 2

        [model.moe.dispatch]
        type = "{backend}"
        max_tokens_per_rank = {max_tokens}
        num_sms = {num_sms}
        deterministic = {str(deterministic).lower()}
        """,
    )
    cfg = load_config(path)
    d = cfg.model.moe.dispatch
    assert (d.type, d.max_tokens_per_rank, d.num_sms, d.deterministic) == (backend, max_tokens, num_sms, deterministic)
    assert cfg.model.moe.precision == "fp8"
    assert cfg.model.moe.ep == 2


def test_dispatch_forms_agree(tmp_path):
    short = load_config(write_toml(tmp_path, '[model.moe]\ndispatch = "torch"\n', "a.toml"))
    table = load_config(write_toml(tmp_path, '[model.moe.dispatch]\ntype = "torch"\n', "b.toml"))
    assert short.model.moe == table.model.moe


def test_defaults_without_moe_section(tmp_path):
    cfg = load_config(write_toml(tmp_path, "[train]\nsteps = 3\n"))
    assert cfg.train.steps == 3
    assert cfg.model.moe == MoEConfig()
    assert cfg.model.moe.dispatch.type in DISPATCH_TYPES
    assert cfg.model.moe.precision in PRECISIONS


@pytest.mark.parametrize("precision", ["bf16", "fp8", "mxfp8", "fp8_bwd"])
def test_every_precision(tmp_path, precision):
    path = write_toml(
        tmp_path,
        f"""
        [model.moe]
        dispatch = "mega_moe"
        precision = "{precision}"
        """,
    )
    assert load_config(path).model.moe.precision == precision


def test_precision_list_is_the_documented_one():
    assert set(PRECISIONS) == {"bf16", "fp8", "mxfp8", "fp8_bwd"}
    assert set(DISPATCH_TYPES) == {"torch", "mega_moe"}


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "text, key",
    [
        ('[model.moe]\ndispatch = "torch"\nprecison = "bf16"\n', "precison"),
        ('[model.moe.dispatch]\ntype = "torch"\nmax_tokens = 8\n', "max_tokens"),
        ("[train]\nstepz = 4\n", "stepz"),
        ('[modle]\nname = "tiny"\n', "modle"),
    ],
)
def test_unknown_key_names_key_and_file(tmp_path, text, key):
    path = write_toml(tmp_path, text, "typo_config.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert key in msg
    assert "unknown key" in msg
    assert str(path) in msg


@pytest.mark.parametrize(
    "text, bad, allowed",
    [
        ('[model.moe]\nprecision = "fp16"\n', "fp16", PRECISIONS),
        ('[model.moe]\ndispatch = "deepep"\n', "deepep", DISPATCH_TYPES),
        ('[model.moe.dispatch]\ntype = "alltoall"\n', "alltoall", DISPATCH_TYPES),
    ],
)
def test_bad_value_lists_allowed_values(tmp_path, text, bad, allowed):
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert bad in msg
    assert str(path) in msg
    for value in allowed:
        assert value in msg, f"allowed value {value!r} missing from: {msg}"


@pytest.mark.parametrize(
    "text, key",
    [
        ("[model.moe.dispatch]\nmax_tokens_per_rank = 0\n", "max_tokens_per_rank"),
        ("[model.moe]\nep = 0\n", "ep"),
        ('[model.moe.dispatch]\nnum_sms = "many"\n', "num_sms"),
    ],
)
def test_out_of_range_value_names_key(tmp_path, text, key):
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert key in str(info.value)
    assert str(path) in str(info.value)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(missing)


def test_invalid_toml(tmp_path):
    path = write_toml(tmp_path, "[model.moe\ndispatch = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_multiple_errors_are_all_reported(tmp_path):
    path = write_toml(tmp_path, '[model.moe]\nprecision = "int4"\nfoo = 1\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "int4" in msg and "foo" in msg


# ---------------------------------------------------------------------------------------------------------------
# Dotted overrides


def test_overrides(tmp_path):
    path = write_toml(
        tmp_path,
        """
        [train]
        steps = 100

        [model.moe]
        dispatch = "mega_moe"
        precision = "bf16"
        """,
    )
    cfg = load_config(path, overrides={"train.steps": 5, "model.moe.precision": "mxfp8", "optim.lr": 0.5})
    assert cfg.train.steps == 5
    assert cfg.model.moe.precision == "mxfp8"
    assert cfg.optim.lr == 0.5
    # The file itself is untouched.
    assert load_config(path).train.steps == 100


def test_override_widens_dispatch_shorthand(tmp_path):
    path = write_toml(tmp_path, '[model.moe]\ndispatch = "torch"\n')
    cfg = load_config(path, overrides={"model.moe.dispatch.max_tokens_per_rank": 77})
    assert cfg.model.moe.dispatch.type == "torch"
    assert cfg.model.moe.dispatch.max_tokens_per_rank == 77


def test_override_dispatch_by_name_keeps_options(tmp_path):
    path = write_toml(tmp_path, '[model.moe.dispatch]\ntype = "mega_moe"\nmax_tokens_per_rank = 64\n')
    cfg = load_config(path, overrides={"model.moe.dispatch": "torch"})
    assert cfg.model.moe.dispatch.type == "torch"
    assert cfg.model.moe.dispatch.max_tokens_per_rank == 64


def test_override_creates_missing_tables(tmp_path):
    path = write_toml(tmp_path, "")
    cfg = load_config(path, overrides={"model.moe.ep": 4})
    assert cfg.model.moe.ep == 4


def test_override_with_unknown_key_is_an_error(tmp_path):
    path = write_toml(tmp_path, "")
    with pytest.raises(ConfigError, match="stepz"):
        load_config(path, overrides={"train.stepz": 5})


def test_override_with_bad_value_is_an_error(tmp_path):
    path = write_toml(tmp_path, "")
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides={"model.moe.precision": "int8"})
    for value in PRECISIONS:
        assert value in str(info.value)


def test_set_dotted_refuses_to_descend_into_a_value():
    data = {"train": {"steps": 3}}
    with pytest.raises(ConfigError, match="not a table"):
        set_dotted(data, "train.steps.inner", 1)


def test_config_from_dict_names_source():
    with pytest.raises(ConfigError, match="my-source"):
        config_from_dict({"bogus": 1}, source="my-source")


def test_assignment_is_validated():
    moe = MoEConfig()
    with pytest.raises(ValueError):
        moe.precision = "fp4"  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------------------------
# Shipped configs


def _check_shipped_config(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.model.moe.dispatch.type in DISPATCH_TYPES
    assert cfg.model.moe.precision in PRECISIONS
    assert cfg.model.moe.ep >= 1
    assert cfg.model.moe.dispatch.max_tokens_per_rank > 0


# One case per configs/*.toml; with no files there are no cases (rather than a skipped placeholder).
if CONFIG_FILES:

    @pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
    def test_shipped_configs_load(path):
        _check_shipped_config(path)
