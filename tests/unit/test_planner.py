"""Capacity planning figures (seed 000, 002) and backend rules (seed 003)."""

import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.backends import BACKENDS, check_backends, resolve_backend
from kvservice.core.planner import plan

LLAMA = CacheSpec.uniform(32, 32, 128, "float16", 16)


def test_seed000_fix_slots_and_bytes_per_layer():
    p = plan(LLAMA, Sizing(max_batch=8, max_seq_len=2048))
    assert p.num_slots == 8 * 128 == 1024
    assert p.bytes_per_layer == 268_435_456          # 1024 pages * 2 * 16 * 32 * 128 * 2 bytes
    assert p.bytes_per_slot == 32 * 262_144
    assert p.total_bytes == 32 * 268_435_456
    assert not p.offsets_exceed_int32


def test_larger_plan_and_offsets():
    p = plan(LLAMA, Sizing(max_batch=16, max_seq_len=4096))
    assert (p.num_slots, p.bytes_per_layer) == (4096, 1_073_741_824)
    assert p.max_byte_offset == 1_073_741_823 and not p.offsets_exceed_int32
    four_gib = plan(LLAMA, Sizing(max_batch=64, max_seq_len=4096))      # exactly 4 GiB per layer
    assert four_gib.max_byte_offset == 2**32 - 1
    assert four_gib.offsets_exceed_int32 and not four_gib.offsets_exceed_uint32
    big = plan(LLAMA, Sizing(max_batch=65, max_seq_len=4096))
    assert big.offsets_exceed_int32 and big.offsets_exceed_uint32
    assert any("64-bit" in w for w in big.warnings)
    assert not big.indices_need_int64


def test_memory_budget_and_explicit_slots():
    per_slot = plan(LLAMA, Sizing(num_slots=1)).bytes_per_slot
    p = plan(LLAMA, Sizing(memory_budget_bytes=per_slot * 100 + per_slot - 1))
    assert p.num_slots == 100
    assert plan(LLAMA, Sizing(num_slots=77)).num_slots == 77
    with pytest.raises(InvalidArgument, match="holds no slot"):
        plan(LLAMA, Sizing(memory_budget_bytes=per_slot - 1))


def test_indices_need_int64_for_huge_interleaved_spaces():
    spec = CacheSpec((LayerSpec(1, 64, "float8_e4m3"), LayerSpec(1, 64 * 8, "float8_e4m3")), 1, "interleaved")
    p = plan(spec, Sizing(num_slots=2**29, max_seq_len=16))
    assert p.indices_need_int64
    # Small pages: scale 16, range [0, 2^33) -> int64. Big pages: scale 2, 2^30 pages starting at 2^33
    # (disjoint index spaces) -> int64 as well: the cost of disjoint numbering, paid only past 2^31 pages.
    assert [(s.scale, s.base, s.index_dtype.name) for s in p.geometry.index_spaces] == \
        [(16, 0, "int64"), (2, 2**33, "int64")]


@pytest.mark.parametrize("sizing", [Sizing(), Sizing(max_batch=8), Sizing(max_seq_len=8)])
def test_missing_sizing_is_a_clear_error(sizing):
    with pytest.raises(InvalidArgument, match="say how big"):
        plan(LLAMA, sizing)


def test_sequence_longer_than_pool_is_refused():
    with pytest.raises(InvalidArgument, match="needs 128 slots in layer group 0, but the group has 10"):
        plan(LLAMA, Sizing(num_slots=10, max_seq_len=2048))


@pytest.mark.parametrize(("backend", "good", "bad", "words"), [
    ("flash-attn2", 256, 16, ["flash-attn 2", "256"]),
    ("vllm-flash-attn", 32, 8, ["vLLM", "16"]),
    ("candle-flash-attn", 64, 16, ["candle", "32"]),
    ("trtllm", 64, 48, ["TensorRT-LLM", "power of two"]),
])
def test_backend_rules_name_backend_and_rule(backend, good, bad, words):
    assert check_backends(good, [backend]) == [backend]
    with pytest.raises(FailedPrecondition) as exc:
        check_backends(bad, [backend])
    for w in words:
        assert w in exc.value.message
    assert exc.value.metadata["backend"] == backend


def test_any_page_size_backends_and_aliases():
    for ps in (1, 3, 16, 17, 1000):
        assert check_backends(ps, ["native", "flashinfer"]) == ["native", "flashinfer"]
    assert resolve_backend("FA2").name == "flash-attn2"
    with pytest.raises(InvalidArgument, match="unknown kernel backend 'cudnn'") as err:
        resolve_backend("cudnn")
    assert err.value.metadata == {"backend": "cudnn"}      # the name as given, for a client to act on
    assert set(BACKENDS) == {"native", "flashinfer", "flash-attn2", "vllm-flash-attn", "candle-flash-attn", "trtllm"}


def test_plan_checks_backends():
    with pytest.raises(FailedPrecondition, match="flash-attn 2 needs page_size % 256 == 0, got page_size 16"):
        plan(LLAMA, Sizing(max_batch=8, max_seq_len=2048), ["flash-attn2"])


def test_a_layer_the_native_kernels_cannot_serve_is_refused_with_its_own_reason_and_index():
    """A page size every backend takes, but layer 2's head_dim (96) is not one of the native kernels': the
    error's machine reason tells it from a page-size refusal and names the layer."""
    layers = [(128, "float16"), (64, "bfloat16"), (96, "float16"), (128, "float16")]
    assert check_backends(16, ["flashinfer"], layers) == ["flashinfer"]      # no per-layer rule
    with pytest.raises(FailedPrecondition) as exc:
        check_backends(16, ["native"], layers)
    assert exc.value.reason == "BACKEND_LAYER"
    assert exc.value.metadata["layer"] == "2" and exc.value.metadata["backend"] == "native"
    assert "head_dim 96" in exc.value.message
    with pytest.raises(FailedPrecondition) as exc:
        check_backends(48, ["trtllm"])
    assert exc.value.reason == "BACKEND_PAGE_SIZE"
