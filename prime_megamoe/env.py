"""Environment variables the host reads on every layer call (each kernel launch reads two)."""

from __future__ import annotations

import os
import sys

# ``os.environ`` encodes the key and decodes the value in Python on every read (~1.5-2 us a read); on POSIX CPython
# it keeps the environment in a dict of bytes that its writes (``os.environ[k] = v``, ``del``, pytest's setenv)
# update, so reading that dict gives the same current value. Elsewhere: os.environ itself.
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENCODING = sys.getfilesystemencoding()
_KEYS: dict[str, bytes] = {}


def env_get(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, at a fraction of its host time."""
    if _ENVIRON_BYTES is None:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = name.encode(_ENCODING, "surrogateescape")
    value = _ENVIRON_BYTES.get(key)
    return default if value is None else value.decode(_ENCODING, "surrogateescape")
