"""kvservice/core/units.py: sizes as people write them, against values computed by hand from the unit table
in its docstring (KB = 1000, KiB = 1024, ..., % of the device's memory), and every refusal's whole message."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.units import parse_bytes

DECIMAL = {"B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
           "TB": 10**12}
BINARY = {"KiB": 1024, "MiB": 1024 * 1024, "GiB": 1024**3, "TiB": 1024**4}


def test_every_unit_and_spelling_against_hand_computed_bytes():
    rng = np.random.default_rng(28)
    for unit, scale in {**DECIMAL, **BINARY}.items():
        for n in [int(x) for x in rng.integers(1, 5000, 5)] + [0]:
            for text in (f"{n}{unit}", f" {n} {unit.lower()} ", f"{n}{unit.upper()}"):
                assert parse_bytes(text) == n * scale, text
    assert parse_bytes("1.5TiB") == 3 * 2**39
    assert parse_bytes("0.5KB") == 500
    assert parse_bytes("2.25GiB") == 9 * 2**28
    assert parse_bytes("123") == 123 and parse_bytes(" 77 ") == 77
    assert parse_bytes(4096) == 4096 and parse_bytes(0) == 0
    assert parse_bytes(2**63 - 1) == 2**63 - 1
    assert parse_bytes("8388607TiB") == 8388607 * 2**40          # just under 2^63


def test_percentages_of_the_device_memory():
    mem = 80 * 2**30 + 12345
    assert parse_bytes("80%", device_memory=mem) == mem * 80 // 100
    assert parse_bytes("100%", device_memory=mem) == mem
    assert parse_bytes("12.5 %", device_memory=1000) == 125
    assert parse_bytes("0%", device_memory=mem) == 0


@pytest.mark.parametrize("text, args, message", [
    (True, {}, "size: expected a size such as 40GiB, 80% or a byte count, got True"),
    ("forty", {"what": "--budget"}, "--budget: 'forty' is not a size; write e.g. 40GiB, 512MB, 80% or a byte count"),
    ("-5GiB", {}, "size: '-5GiB' is not a size; write e.g. 40GiB, 512MB, 80% or a byte count"),
    ("80%", {"what": "memory"}, "memory: '80%' is a share of the device's memory; give --device-memory too"),
    ("80%", {"device_flag": "device_memory_bytes"},
     "size: '80%' is a share of the device's memory; give device_memory_bytes too"),
    ("100.5%", {"device_memory": 1000}, "size: '100.5%' is more than all of the device's memory"),
    ("3PiB", {}, "size: unknown unit 'PiB' in '3PiB'; use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or %"),
    ("8388608TiB", {"what": "budget"}, "budget: '8388608TiB' is outside 0..2^63-1 bytes"),
    (2**63, {"what": "n"}, "n: 9223372036854775808 is outside 0..2^63-1 bytes"),
    (-1, {"what": "n"}, "n: -1 is outside 0..2^63-1 bytes"),
])
def test_refusals_say_what_and_why(text, args, message):
    with pytest.raises(InvalidArgument) as exc:
        parse_bytes(text, **args)
    assert exc.value.message == message
