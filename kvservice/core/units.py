"""Byte sizes as people write them: ``40GiB``, ``512MB``, ``1.5TiB``, ``80%`` (of a device's memory), plain bytes."""

from __future__ import annotations

import re

from kvservice.contract.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*|%)\s*$")
MAX_SIZE = 2**63 - 1


def parse_bytes(text: str | int, what: str = "size", device_memory: int = 0,
                device_flag: str = "--device-memory") -> int:
    """Bytes of a size: an int, "40GiB" (binary units KiB..TiB, decimal KB..TB), or "80%" of device_memory.

    what: the flag or field named in errors; device_flag: what to say when a percentage has no device memory.
    """
    if isinstance(text, bool):
        raise InvalidArgument(f"{what}: expected a size such as 40GiB, 80% or a byte count, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        if m is None:
            raise InvalidArgument(f"{what}: {text!r} is not a size; write e.g. 40GiB, 512MB, 80% or a byte count")
        number, unit = m.group(1), m.group(2).lower()
        if unit == "%":
            if not device_memory:
                raise InvalidArgument(f"{what}: {text!r} is a share of the device's memory; give {device_flag} too")
            if float(number) > 100:
                raise InvalidArgument(f"{what}: {text!r} is more than all of the device's memory")
            return int(device_memory * float(number) / 100)
        if unit not in _UNITS:
            raise InvalidArgument(f"{what}: unknown unit {m.group(2)!r} in {text!r}; use B, KB, MB, GB, TB, KiB, MiB, "
                                  "GiB, TiB or %")
        value = int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
    if value < 0 or value > MAX_SIZE:
        raise InvalidArgument(f"{what}: {text!r} is outside 0..2^63-1 bytes")
    return value


__all__ = ["parse_bytes"]
