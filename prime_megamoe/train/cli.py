"""Command line: ``python -m prime_megamoe.train CONFIG.toml [--key value ...]``.

Every config key is an option, named by its dotted path (``--train.steps 50``, ``--model.moe.dispatch torch``,
``--output-dir DIR``; ``-`` and ``_`` are interchangeable). Values are read as TOML values (``50``, ``1e-3``,
``true``, ``[0.9, 0.99]``), falling back to a plain string. A boolean option given without a value means true.
``--help`` lists the options, generated from the pydantic models.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..config import Config, ConfigError, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

USAGE = "usage: python -m prime_megamoe.train CONFIG.toml [--key value ...]   (or torchrun ... -m prime_megamoe.train)"


def _model_of(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        return str(annotation).replace("typing.", "")
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def options(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, Any, BaseModel | None]]:
    """(dotted key, annotation, field info) of every leaf option, in declaration order."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_of(field.annotation)
        if sub is not None:
            out.append((key, None, field))  # a table; its shorthand (dispatch = "torch") is an option too
            out.extend(options(sub, key + "."))
        else:
            out.append((key, field.annotation, field))
    return out


def _default(field) -> Any:
    if field.default_factory is not None:
        value = field.default_factory()
        return value.model_dump() if isinstance(value, BaseModel) else value
    return field.default


def help_text() -> str:
    lines = [USAGE, "", "Options (any config key; defaults in brackets):", "  --help  show this and exit"]
    for key, annotation, field in options():
        if annotation is None:
            if key.endswith("dispatch"):
                lines.append(f"  --{key} NAME  shorthand for --{key}.type NAME")
            continue
        flag = "--output-dir" if key == "output_dir" else f"--{key}"
        default = _default(field)
        desc = f"  {field.description}" if field.description else ""
        suffix = ".KEY" if typing.get_origin(annotation) is dict else ""
        lines.append(f"  {flag}{suffix} <{_type_name(annotation)}> [{default!r}]{desc}")
    return "\n".join(lines)


def _known_key(dotted: str) -> bool:
    known = {key for key, _, _ in options()}
    if dotted in known:
        return True
    # dict-valued options take arbitrary sub-keys: --model.overrides.num_hidden_layers 4
    return any(
        typing.get_origin(annotation) is dict and dotted.startswith(key + ".") for key, annotation, _ in options()
    )


def _bool_option(dotted: str) -> bool:
    return any(key == dotted and annotation is bool for key, annotation, _ in options())


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, Any], bool]:
    """(config path, dotted overrides, wants help)."""
    path = None
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            return path, overrides, True
        if arg.startswith("--"):
            body = arg[2:]
            value: str | None = None
            if "=" in body:
                body, value = body.split("=", 1)
            dotted = ".".join(part.replace("-", "_") for part in body.split("."))
            if not _known_key(dotted):
                raise ConfigError(f"unknown option --{body}; see --help for the options (every config key)")
            if value is None:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if nxt is None or (nxt.startswith("--") and _bool_option(dotted)):
                    if not _bool_option(dotted):
                        raise ConfigError(f"option --{body} needs a value")
                    value = "true"
                else:
                    value = nxt
                    i += 1
            overrides[dotted] = parse_value(value)
        elif path is None:
            path = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}; {USAGE}")
        i += 1
    return path, overrides, False


def config_from_argv(argv: list[str]) -> Config | None:
    """The Config for these arguments, or None after printing --help."""
    path, overrides, wants_help = parse_args(argv)
    if wants_help:
        print(help_text())
        return None
    if path is None:
        raise ConfigError(f"no config file given; {USAGE}")
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    return load_config(path, overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = config_from_argv(argv)
        if cfg is None:
            return 0
        from .trainer import train

        train(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0
