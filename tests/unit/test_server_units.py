"""kvservice.server pieces without a gRPC server: budget refusals, pools YAML messages, stream sessions, metrics.

Each test pins a documented rule (docs/SECURITY.md, docs/operations.md, the modules' docstrings) with
hand-written expected values; written for mutants the package's selection let through (issue 28).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.server.budget import BudgetExceeded, BudgetLimits, MemoryBudget
from kvservice.server.config import load_pools

MIB = 1 << 20


def test_a_budget_refusal_names_what_the_tenant_already_holds() -> None:
    """docs/SECURITY.md: a MEMORY_BUDGET refusal's ErrorInfo carries needed, held (the tenant's bytes), the
    tenant limit, what all tenants hold and the total limit; nothing is charged by it."""
    rng = np.random.default_rng(41)
    tenant_limit, total = 40 * MIB, 100 * MIB
    first = int(rng.integers(20 * MIB, 30 * MIB))
    second = int(rng.integers(1, 5 * MIB))
    other = int(rng.integers(1 * MIB, 9 * MIB))
    b = MemoryBudget(BudgetLimits(total, tenant_limit))
    b.charge("t", first, "Step request")
    b.charge("t", second, "Step reply")
    b.charge("u", other, "Step request")
    grow = tenant_limit - (first + second) + 1 + int(rng.integers(0, MIB))    # just past the tenant limit
    with pytest.raises(BudgetExceeded) as err:
        b.charge("t", grow, "StepStream session")
    assert err.value.reason == "MEMORY_BUDGET"
    assert err.value.metadata == {"needed": str(grow), "held": str(first + second),
                                  "tenant_limit": str(tenant_limit), "charged": str(first + second + other),
                                  "limit": str(total)}
    assert b.tenant_bytes("t") == first + second and b.charged_bytes == first + second + other


LAYERS = "layers: [{kv_heads: 2, head_dim: 64}]"


@pytest.mark.parametrize("key", ["tp: 2", "allow_unknown_keys: true"])
def test_model_config_only_keys_without_model_config_are_refused(key: str) -> None:
    """tp and allow_unknown_keys only mean something with model_config: a pool with layers naming them is a
    mistake, refused naming the key and its line (README's pools file reference)."""
    text = f"pools:\n  - name: a\n    {LAYERS}\n    {key}\n"
    name = key.split(":")[0]
    with pytest.raises(InvalidArgument) as err:
        load_pools(text, "p.yaml")
    assert err.value.message == f"p.yaml: pools[0]: {name!r} (line 4) goes with model_config"


@pytest.mark.parametrize(("value", "shown"), [("''", "''"), ("7", "7"), ("[a]", "['a']")])
def test_a_string_key_of_the_wrong_type_says_a_non_empty_string_was_expected(value: str, shown: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        load_pools(f"pools:\n  - name: a\n    {LAYERS}\n    layout: {value}\n", "p.yaml")
    assert err.value.message == f"p.yaml: pools[0].layout (line 4): expected a non-empty string, got {shown}"


def test_pools_text_without_a_source_is_named_pools_in_messages() -> None:
    """load_pools(text) names its document "<pools>" in every message when no file name is given."""
    with pytest.raises(InvalidArgument) as err:
        load_pools("pools: [{page_size: 16}]")
    assert err.value.message.startswith("<pools>: pools[0]") and "each pool needs a name" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        load_pools("pools: [")
    assert err.value.message.startswith("<pools>: not valid YAML")


def test_a_session_keeps_its_stream_id_and_its_tenant() -> None:
    from kvservice.server.stream import StreamRegistry

    reg = StreamRegistry()
    s = reg.session("stream-9f3", "tenant-a")
    assert (s.stream_id, s.tenant) == ("stream-9f3", "tenant-a")
    other = reg.session("stream-9f3", "tenant-b")               # same id, another tenant: a session of its own
    assert other is not s and (other.stream_id, other.tenant) == ("stream-9f3", "tenant-b")
    assert reg.session("stream-9f3", "tenant-a") is s


def test_a_stream_step_over_the_servers_step_limits_is_refused_like_a_unary_one() -> None:
    """Limits (max_step_sequences) apply to StepStream requests too: refused LIMIT_EXCEEDED, nothing admitted."""
    from kvservice.server.limits import Limits

    from .test_stream_sessions import _served

    m, sv, send, _, _ = _served()
    sv.limits = Limits(max_step_sequences=2)
    r = send(1, admit=[4, 5, 6], admit_tokens=[3, 1, 2])
    assert r.HasField("error") and r.error.reason == "LIMIT_EXCEEDED"
    assert "sequences in one Step: 3 ids is over this server's limit of 2" in r.error.message
    assert m.pool_and_lock("p")[0].num_sequences == 0
    assert not send(2, admit=[4, 5], admit_tokens=[3, 1]).HasField("error")
    assert m.pool_and_lock("p")[0].num_sequences == 2


#: The error model's codes (docs/DESIGN.md); docs/operations.md: every series a dashboard or an alert reads
#: exists from the first scrape, at 0, kvservice_requests_refused_total{method,code,reason} among them.
DOC_REFUSAL_CODES = ("INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                     "UNAVAILABLE")


def test_step_refusal_series_exist_at_zero_from_the_first_scrape() -> None:
    from kvservice.manager.pools import BlockManager
    from kvservice.server.metrics import ManagerMetrics

    mm = ManagerMetrics(BlockManager())
    for code in DOC_REFUSAL_CODES:
        assert mm.registry.get_sample_value("kvservice_requests_refused_total",
                                            {"method": "Step", "code": code, "reason": code}) == 0.0
    mm.observe("Step", 0.001, "NOT_FOUND", "UNKNOWN_SEQUENCE")
    assert mm.registry.get_sample_value("kvservice_requests_refused_total", {
        "method": "Step", "code": "NOT_FOUND", "reason": "UNKNOWN_SEQUENCE"}) == 1.0
