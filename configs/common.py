"""Helpers shared by the config files (big_vision style `get_config(arg)`)."""

from __future__ import annotations

from typing import Any

import ml_collections


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """Parses `"k=v,k2=v2,flag"` into a ConfigDict typed like `defaults`.

    Keys not in `defaults` raise `ValueError` naming the key, so a typo in
    `--config=configs/pretrain.py:sise=base` fails before anything is built. A bare key sets a
    boolean default to True.
    """
    result = ml_collections.ConfigDict(defaults)
    if not arg:
        return result
    for item in arg.split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in defaults:
            raise ValueError(f"unknown config arg key {key!r}; known keys: {sorted(defaults)}")
        default = defaults[key]
        if not sep:
            if not isinstance(default, bool):
                raise ValueError(f"config arg {key!r} needs a value ({key}=...)")
            result[key] = True
            continue
        result[key] = _coerce(key, value.strip(), default)
    return result


def _coerce(key: str, value: str, default: Any) -> Any:
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"config arg {key}={value!r} is not a boolean")
    if isinstance(default, int):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"config arg {key}={value!r} is not an integer") from None
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"config arg {key}={value!r} is not a number") from None
    return value
