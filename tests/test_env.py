"""``env.env_get``: the same values as ``os.environ.get`` as the environment changes within a process."""

from __future__ import annotations

import os

import pytest

from prime_megamoe import env

NAME = "PRIME_MEGAMOE_TEST_ENV_GET"


@pytest.mark.parametrize("fast", [True, False], ids=["environ-bytes", "os.environ"])
def test_env_get_follows_os_environ_through_writes_and_deletes(monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(env, "_ENVIRON_BYTES", None)
    elif env._ENVIRON_BYTES is None:
        pytest.skip("not POSIX CPython: env_get reads os.environ itself")
    monkeypatch.delenv(NAME, raising=False)
    assert env.env_get(NAME, "dflt") == "dflt"
    for value in ("1", "0", "", "caf\u00e9 \udcff"):  # a value os.environ round-trips with surrogateescape
        monkeypatch.setenv(NAME, value)
        assert env.env_get(NAME, "dflt") == os.environ.get(NAME, "dflt") == value
    os.environ[NAME] = "direct"
    assert env.env_get(NAME, "dflt") == "direct"
    del os.environ[NAME]
    assert env.env_get(NAME, "dflt") == "dflt"
    assert env.env_get("PATH", "") == os.environ.get("PATH", "")
