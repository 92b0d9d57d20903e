"""Launch planning shared by the compiled backends: the decode entries the sources define, each entry's
compile-time geometry (mirrors ``KvDecGeom`` in kernels/decode_attention.cu), and split-KV planning."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

VEC: dict[str, int] = {"float16": 8, "bfloat16": 8, "float32": 4}  # elements per 16 bytes
HEAD_DIMS: tuple[int, ...] = (32, 64, 128, 256, 512)
THREADS = 128
GMAX = 8  # q heads per decode block
MIN_SPLIT_PAGES = 4  # pages per split at least (a split's fixed cost: checks, q, pipeline fill)
SPLIT_TARGET = 0.9  # fraction of the device's block slots a launch should keep busy


@functools.lru_cache(maxsize=4096)
def default_splits(blocks: int, max_pages: int, slots: int) -> int:
    """Pages per split for the split-KV path (0 = no split).

    ``blocks``: decode blocks without a split (batch x kv heads x q-head chunks);
    ``max_pages``: pages of the longest row (after the window); ``slots``: blocks
    the device runs at once (SMs x resident blocks per SM of the decode entry,
    from the occupancy API on a GPU). A launch of n equal blocks runs in
    ``ceil(n / slots)`` waves and keeps ``n / (ceil(n / slots) * slots)`` of the
    slot time busy; splitting multiplies n and shortens each block. The fewest
    splits that reach SPLIT_TARGET win (fewer partials to merge), else the best
    found; every split keeps >= MIN_SPLIT_PAGES pages.
    """
    if blocks <= 0 or slots <= 0 or max_pages < 2 * MIN_SPLIT_PAGES:
        return 0

    def busy(n: int) -> float:
        return n / (math.ceil(n / slots) * slots)

    best_pps, best = 0, busy(blocks)
    if best >= SPLIT_TARGET:
        return 0
    top = min(max_pages // MIN_SPLIT_PAGES, 2 * math.ceil(slots / blocks) + 2, 1024)
    for want in range(2, top + 1):
        pps = math.ceil(max_pages / want)
        u = busy(blocks * math.ceil(max_pages / pps))
        if u >= SPLIT_TARGET:
            return pps
        if u > best + 1e-12:
            best_pps, best = pps, u
    return best_pps


ENTRY = {"float32": "kv_decode_f32", "float16": "kv_decode_f16", "bfloat16": "kv_decode_bf16"}


def heads_per_block(group: int, head_dim: int) -> int:
    """Decode entry variant: q heads per block, the smallest of 1/4/8 >= min(group, cap);
    cap 8, or 4 at head_dim 512 (q and output registers per lane)."""
    cap = 4 if head_dim == 512 else GMAX
    return next(g for g in (1, 4, 8) if g >= min(group, cap))


def decode_entry(dtype: str, group: int, head_dim: int) -> str:
    """Name of the decode entry for a cache dtype, GQA group size and head_dim."""
    return f"{ENTRY[dtype]}_g{heads_per_block(group, head_dim)}_d{head_dim}"


@dataclass(frozen=True)
class DecodeGeometry:
    """Compile-time geometry of one decode entry (mirrors ``KvDecGeom`` in
    decode_attention.cu; test_nvcc checks ``smem_bytes`` against ptxas)."""

    vec: int  # elements per 16-byte piece
    lanes: int  # lanes per K/V row (a lane group)
    lane_groups: int  # per block of THREADS
    tile_tokens: int  # tokens per pipeline tile
    copies_per_thread: int  # 16-byte cp.async per thread per tile, K and V each
    stages: int  # cp.async ring depth
    smem_bytes: int  # static shared memory of the checked build

    @property
    def tile_bytes(self) -> int:
        """K + V bytes of one tile."""
        return 2 * THREADS * self.copies_per_thread * 16


def decode_geometry(dtype: str, heads: int, head_dim: int) -> DecodeGeometry:
    """Geometry of the decode entry with ``heads`` q heads per block."""
    vec = VEC[dtype]
    cpr = head_dim // vec
    lanes = min(cpr, 32)
    ch = cpr // lanes
    groups = THREADS // lanes
    rpt = 2 if ch == 1 else 1
    tt = groups * rpt
    nch = tt * cpr // THREADS
    stages = 3 if nch <= 2 else 2
    buf_floats = max(stages * 2 * tt * cpr * 4, groups * heads * head_dim)
    # ring/merge, max+sum, s_bad, then s_ctx (4 x int64: 8-byte aligned), s_last
    smem = 4 * buf_floats + 2 * 4 * groups * heads + 4
    smem = -(-smem // 8) * 8 + 4 * 8 + 4
    return DecodeGeometry(vec, lanes, groups, tt, nch, stages, smem)


OTHER_KERNELS = ("kv_append", "kv_copy_blocks", "kv_decode_merge", "kv_guard_check", "kv_guard_fill",
                 "kv_validate_page_table", "kv_widen_f16", "kv_widen_bf16")


def decode_entries() -> list[str]:
    """Every decode entry the sources define (dtype x heads per block x head_dim)."""
    return sorted({decode_entry(dt, g, d) for dt in ENTRY for g in (1, 4, 8) for d in HEAD_DIMS})


def kernel_names() -> list[str]:
    """Every ``extern "C"`` kernel of kvservice/worker/kernels/*.cu."""
    return sorted([*OTHER_KERNELS, *decode_entries()])
