"""Per-request caps (kvservice/server/limits.py, docs/SECURITY.md#limits) against a plain count of each request.

A Step's caps, in the order they are checked: each extend_num_tokens entry and each admit_num_tokens entry at most
max_step_tokens, the ids of the step (free + extend + admit + fork children) at most max_step_sequences, its new
tokens (the sum of both count arrays) at most max_step_tokens; 0 = no cap. An over-cap request is InvalidArgument,
reason LIMIT_EXCEEDED, naming the value, the limit and the server flag, with ErrorInfo metadata value and limit.
A CreatePool is refused at max_pools pools (ResourceExhausted), over max_pool_slots slots x layer groups
(InvalidArgument) and over max_total_slots slot units of all pools (ResourceExhausted with needed, held, limit).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.client.codec import step_request
from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.manager.step_input import decode_step
from kvservice.server.limits import Limits
from kvservice.state.startup import create_request


def _over(what: str, value: int, limit: int, unit: str, flag: str) -> str:
    return (f"{what}: {value} {unit} is over this server's limit of {limit} (server flag {flag}); split the "
            "request")


def test_step_caps_refuse_the_first_count_over_them_in_the_documented_order() -> None:
    rng = np.random.default_rng(81)
    m = BlockManager()
    refused = {"extend": 0, "admit": 0, "sequences": 0, "tokens": 0, None: 0}
    for _ in range(300):
        n_free, n_ext, n_adm, n_fork = (int(x) for x in rng.integers(0, 6, 4))
        ext = rng.integers(1, 60, n_ext).tolist()
        adm = rng.integers(1, 60, n_adm).tolist()
        base = int(rng.integers(1, 1 << 40))
        ids = iter(range(base, base + 100))
        free = [next(ids) for _ in range(n_free)]
        ext_ids = [next(ids) for _ in range(n_ext)]
        adm_ids = [next(ids) for _ in range(n_adm)]
        fork = [(ext_ids[0] if ext_ids else base - 1, next(ids)) for _ in range(n_fork)]
        req = step_request("p", free=free or None, extend=ext_ids or None, extend_tokens=ext or None,
                           admit=adm_ids or None, admit_tokens=adm or None, fork=fork or None)
        sequences, new_tokens = n_free + n_ext + n_adm + n_fork, sum(ext) + sum(adm)
        top_ext, top_adm = max(ext, default=0), max(adm, default=0)
        max_tokens = int(rng.choice([0, max(1, new_tokens - 1), new_tokens, max(1, top_ext - 1),
                                     max(1, top_adm - 1), 10_000]))
        max_seqs = int(rng.choice([0, max(1, sequences - 1), sequences, 1000]))
        lim = Limits(max_step_sequences=max_seqs, max_step_tokens=max_tokens)
        if max_tokens and top_ext > max_tokens:
            want = ("extend", _over("extend_num_tokens entry", top_ext, max_tokens, "tokens", "--max-step-tokens"),
                    top_ext, max_tokens)
        elif max_tokens and top_adm > max_tokens:
            want = ("admit", _over("admit_num_tokens entry", top_adm, max_tokens, "tokens", "--max-step-tokens"),
                    top_adm, max_tokens)
        elif max_seqs and sequences > max_seqs:
            want = ("sequences", _over("sequences in one Step", sequences, max_seqs, "ids", "--max-step-sequences"),
                    sequences, max_seqs)
        elif max_tokens and new_tokens > max_tokens:
            want = ("tokens", _over("new tokens in one Step", new_tokens, max_tokens, "tokens", "--max-step-tokens"),
                    new_tokens, max_tokens)
        else:
            want = (None, "", 0, 0)
        for step in (None, decode_step(req)):                   # decoded here, or by the caller and passed on
            if want[0] is None:
                lim.check("Step", req, m, step)
                continue
            with pytest.raises(InvalidArgument) as err:
                lim.check("Step", req, m, step)
            assert err.value.reason == "LIMIT_EXCEEDED"
            assert (err.value.message, err.value.metadata) == (want[1], {"value": str(want[2]),
                                                                         "limit": str(want[3])})
        refused[want[0]] += 1
    assert all(n >= 10 for n in refused.values()), refused       # every branch was taken, often


def test_request_id_length_is_capped_for_every_method() -> None:
    rng = np.random.default_rng(83)
    m = BlockManager()
    for _ in range(20):
        cap = int(rng.integers(1, 200))
        lim = Limits(max_request_id=cap)
        for method in ("Step", "DeletePool", "Heartbeat"):
            ok = step_request("p", admit=[1], admit_tokens=[1], request_id="r" * cap)
            lim.check(method, ok, m)
            long = step_request("p", admit=[1], admit_tokens=[1], request_id="r" * (cap + 1))
            with pytest.raises(InvalidArgument) as err:
                lim.check(method, long, m)
            assert err.value.message == (f"request_id: {cap + 1} characters is over this server's limit of {cap}; "
                                         "split the request")
            assert err.value.metadata == {"value": str(cap + 1), "limit": str(cap)}
        Limits(max_request_id=0).check("Step", step_request("p", request_id="r" * 5000), m)


def test_create_pool_caps_name_what_the_pools_hold_and_need() -> None:
    """Slots x layer groups by hand: a full-attention plus a sliding group with num_slots each (equal sizing)."""
    rng = np.random.default_rng(87)
    two_groups = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=32)), 16)
    n = [int(x) for x in rng.integers(50, 400, 3)]
    total_cap = 2 * (n[0] + n[1]) + int(rng.integers(1, 2 * n[2]))      # the third pool does not fit
    lim = Limits(max_pool_slots=2 * max(n), max_total_slots=total_cap, max_pools=3)
    m = BlockManager()
    for i in range(2):
        lim.check("CreatePool", create_request(f"p{i}", two_groups, Sizing(num_slots=n[i]), ()), m)
        m.create_pool(f"p{i}", two_groups, Sizing(num_slots=n[i]))
    held = 2 * (n[0] + n[1])
    assert m.total_slots() == held
    with pytest.raises(ResourceExhausted) as err:
        lim.check("CreatePool", create_request("p2", two_groups, Sizing(num_slots=n[2]), ()), m)
    assert err.value.reason == "LIMIT_EXCEEDED"
    assert err.value.metadata == {"needed": str(2 * n[2]), "held": str(held), "limit": str(total_cap)}
    assert err.value.message == (
        f"pool 'p2' needs {2 * n[2]} slot units ({2 * n[2]} slots x layer groups); the manager's pools hold {held} "
        f"of its {total_cap} (max_total_slots, which bounds their memory at 56 bytes a unit); delete a pool or plan "
        "a smaller one (docs/SECURITY.md#limits)")                # 56 bytes a slot unit: docs/SECURITY.md
    big = 2 * max(n) // 2 + 1                                              # slots x 2 groups over max_pool_slots
    with pytest.raises(InvalidArgument) as err:
        lim.check("CreatePool", create_request("huge", two_groups, Sizing(num_slots=big), ()), m)
    assert err.value.message == _over("pool 'huge': slots x layer groups", 2 * big, 2 * max(n), "slots",
                                      "--max-pool-slots")
    assert err.value.metadata == {"value": str(2 * big), "limit": str(2 * max(n))}
    fits = (total_cap - held) // 2
    lim.check("CreatePool", create_request("p2", two_groups, Sizing(num_slots=fits), ()), m)
    m.create_pool("p2", two_groups, Sizing(num_slots=fits))
    with pytest.raises(ResourceExhausted) as err:                          # three pools: the max_pools cap first
        lim.check("CreatePool", create_request("p3", two_groups, Sizing(num_slots=1), ()), m)
    assert err.value.message == "the manager holds 3 pools, its limit (--max-pools); delete one first"
    assert err.value.metadata == {"limit": "3"} and err.value.reason == "LIMIT_EXCEEDED"
    Limits(max_pools=0, max_pool_slots=0, max_total_slots=0).check(
        "CreatePool", create_request("p3", two_groups, Sizing(num_slots=10**6), ()), m)


def test_only_a_plan_request_is_planned_with_its_backends() -> None:
    """check("Plan") plans the request as sent (a backend's page-size rule refuses it: flash-attn 2 wants page_size
    % 256 == 0, core/backends.py); the same bytes under another method name are not planned."""
    from kvservice.client.codec import plan_request
    from kvservice.contract.errors import FailedPrecondition

    m = BlockManager()
    r = plan_request(CacheSpec.uniform(2, 4, 64, page_size=16), Sizing(num_slots=64, max_seq_len=1024), ("fa2",))
    with pytest.raises(FailedPrecondition):
        Limits().check("Plan", r, m)
    for method in ("GetPool", "ListPools", "plan", "PLAN"):
        Limits().check(method, r, m)


def test_the_default_caps_are_the_documented_ones() -> None:
    """docs/SECURITY.md#limits, its table of limits: each server flag's default is what Limits() holds."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "SECURITY.md").read_text()
    rows = dict(re.findall(r"^\| `(--max-[a-z-]+|Limits\.max_total_slots)` \| ([\d,]+) \|", doc, re.M))
    want = {k: int(v.replace(",", "")) for k, v in rows.items()}
    d = Limits()
    got = {"--max-step-sequences": d.max_step_sequences, "--max-step-tokens": d.max_step_tokens,
           "--max-pool-slots": d.max_pool_slots, "Limits.max_total_slots": d.max_total_slots,
           "--max-pools": d.max_pools}
    assert want == got
