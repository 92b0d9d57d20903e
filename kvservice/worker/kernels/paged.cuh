// paged.cuh -- the ONE place that owns paged-KV addressing, bounds checks and
// the violation record, for both layouts (per_layer and interleaved).
//
// A layer sees its buffer as an array of pages; buffer page i starts at element
// i * page_stride of its base address. Inside a page (NHD):
//     page = [2 (K, V), page_size, kv_heads, head_dim]
// Index space of the layer (docs NUMBERING): the pool numbers pages [0, pool_pages);
// the layer's space owns [base, upper_bound) of that range, on the lattice
// base + offset + k * scale. Page index p lives at buffer page p - base.
//   per_layer:   scale 1, offset 0, upper_bound = base + num_slots
//   interleaved: page = base + slot * scale + offset, upper_bound = base + num_slots * scale
// A page index is checked (kv_page_reason) in this order: out_of_bounds
// (p < 0 or p >= pool_pages), wrong_index_space (outside [base, upper_bound)),
// off_lattice. The CSR rules (kv_csr_row_reason) are kvservice/contract/pagetable.py's.
// A page that passes them is then checked in time (kv_gen_reason, "page generations"
// below): stale_page when the generation the worker recorded for it is not the one
// the table expects. All address arithmetic is 64-bit (long long); strides are in elements.
//
// Build knobs: -DKV_HOST_EMU (g++ host emulation, see kv_emu.h);
//              -DKV_NO_BOUNDS_CHECK (benchmark-only: compiles every check out).
#pragma once

#ifdef KV_HOST_EMU
#include "kv_emu.h"
#else
// No CUDA headers needed (NVRTC-friendly): half -> float through PTX.
#define KV_REGISTER(fn)
// Shared memory: KV_SHARED(type, name, dims) (the host emulation gives each running block its own).
#define KV_SHARED(type, name, dims) __shared__ type name dims
__device__ __forceinline__ float kv_f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
#endif

// Storage types of the 16-bit cache dtypes (raw bits).
struct kv_half {
  unsigned short bits;
};
struct kv_bf16 {
  unsigned short bits;
};

// Reason codes; kvservice/worker/kernel_api.py maps them to the strings of the contract.
#define KV_OK 0
#define KV_OUT_OF_BOUNDS 1
#define KV_OFF_LATTICE 2
#define KV_BAD_LAST_PAGE_LEN 3
#define KV_BAD_INDPTR 4
#define KV_WRONG_INDEX_SPACE 5
#define KV_STALE_PAGE 6

// Policy for a row that hit a violation (error == NaN on the device; the
// Python wrapper raises after the call).
#define KV_POLICY_NAN 0
#define KV_POLICY_ZEROS 1
#define KV_POLICY_ERROR 2

#define KV_NO_KEY 0xffffffffffffffffull

struct KvLayout {
  long long page_stride;  // elements between consecutive buffer pages
  long long page_size;    // tokens per page
  long long kv_heads;
  long long head_dim;
  long long scale, offset;  // the lattice of the layer's index space (0 <= offset < scale)
  long long base;           // first page index of the space; page p is buffer page p - base
  long long upper_bound;    // exclusive end of the space's page range
  long long pool_pages;     // exclusive end of the pool's page numbering (>= upper_bound)
};

// Row offset (elements) of token `tok` of head `h` in the K (kv=0) or V (kv=1)
// half of page p. The caller has checked p.
__device__ __forceinline__ long long kv_row_offset(const KvLayout& L, long long p, long long kv,
                                                   long long tok, long long h) {
  return (p - L.base) * L.page_stride + ((kv * L.page_size + tok) * L.kv_heads + h) * L.head_dim;
}

// KV_OK, KV_OUT_OF_BOUNDS, KV_WRONG_INDEX_SPACE or KV_OFF_LATTICE (in that order).
__device__ __forceinline__ int kv_page_reason(const KvLayout& L, long long p) {
#ifdef KV_NO_BOUNDS_CHECK
  (void)L;
  (void)p;
  return KV_OK;
#else
  if (p < 0 || p >= L.pool_pages) return KV_OUT_OF_BOUNDS;
  if (p < L.base || p >= L.upper_bound) return KV_WRONG_INDEX_SPACE;
  if (L.scale > 1 && (p - L.base - L.offset) % L.scale != 0) return KV_OFF_LATTICE;
  return KV_OK;
#endif
}

// ---- page generations (docs/KERNELS.md, "Page generations") ------------------
// The manager hands out a slot with a new generation each time the slot passes to
// a new owner; a table carries the generation it expects beside every page
// (uint32 [nnz], parallel to indices; a slot mapping: uint32 [n]). The worker
// records, per layer, the generation each page was last written under:
//     page_gen[kv_gen_index(L, p)]   uint32, one per buffer page of the layer (0 = never written)
// A reader compares the two once per page (kv_gen_reason); a writer may write a page
// that holds its generation, or open it with a newer one (kv_gen_newer). A null
// generation pointer means "not checked" (a table from elsewhere).
__device__ __forceinline__ long long kv_gen_index(const KvLayout& L, long long p) { return p - L.base; }

// May a page holding generation r be opened by a write of generation g? Yes if the
// page was never written (r == 0: no generation is ever 0), or if g follows r by 1 to
// KV_GEN_AHEAD allocations of the slot (generations wrap at 2^32). A write of an older
// generation (a table that outlived the page) is refused; so is one of another pool
// incarnation, whose generations start at an unrelated seed (the odds it lands within
// KV_GEN_AHEAD ahead are 2^-16 per page, and a page so written then reads stale_page for
// its owner, never a silent change).
#define KV_GEN_AHEAD 65536u
__device__ __forceinline__ bool kv_gen_newer(unsigned g, unsigned r) {
  return r == 0u || g - r - 1u < KV_GEN_AHEAD;
}

// KV_OK or KV_STALE_PAGE for a page p that passed kv_page_reason, read through a table
// that expects generation `expect`.
__device__ __forceinline__ int kv_gen_reason(const KvLayout& L, const unsigned* page_gen, long long p,
                                             unsigned expect) {
#ifdef KV_NO_BOUNDS_CHECK
  (void)L; (void)page_gen; (void)p; (void)expect;
  return KV_OK;
#else
  return page_gen[kv_gen_index(L, p)] == expect ? KV_OK : KV_STALE_PAGE;
#endif
}

// Reason of table entry `pos`: bounds and lattice first, then (gens non-null) its generation.
__device__ __forceinline__ int kv_entry_reason(const KvLayout& L, const int* indices, const unsigned* gens,
                                               const unsigned* page_gen, long long pos) {
  const long long p = indices[pos];
  const int r = kv_page_reason(L, p);
  return r == KV_OK && gens != nullptr ? kv_gen_reason(L, page_gen, p, gens[pos]) : r;
}

// CSR row check (kvservice/contract/pagetable.py rules 1-2): a = indptr[row], b = indptr[row+1]
// with 0 <= a <= b <= nnz, indptr[0] == 0 and indptr[batch] == nnz; for a non-empty
// row last_page_len in (0, page_size] (an empty row's value is ignored). Writes the
// offending value (a if a broke a rule, else b; or last_page_len).
__device__ __forceinline__ int kv_csr_row_reason(const int* indptr, const int* last_page_len,
                                                 long long nnz, long long batch, long long page_size,
                                                 long long row, long long* value) {
  const long long a = indptr[row], b = indptr[row + 1];
  *value = 0;
#ifndef KV_NO_BOUNDS_CHECK
  if (a < 0 || a > nnz || (row == 0 && a != 0)) { *value = a; return KV_BAD_INDPTR; }
  if (b < a || b > nnz || (row == batch - 1 && b != nnz)) { *value = b; return KV_BAD_INDPTR; }
  if (b > a) {
    const long long l = last_page_len[row];
    if (l <= 0 || l > page_size) { *value = l; return KV_BAD_LAST_PAGE_LEN; }
  }
#else
  (void)last_page_len; (void)nnz; (void)batch; (void)page_size; (void)a; (void)b;
#endif
  return KV_OK;
}

// ---- violation record: 8 x uint64, mirrored by kvservice/worker/kernel_api.py ---------
// [0] count  [1] first key = (row << 32) | (pos + 1), KV_NO_KEY if none
// [2] row    [3] position   [4] value   [5] reason    (filled by the last block)
// [6] blocks-done ticket (internal; reset to 0 by the last block)  [7] unused
// The host zeroes it and sets [1] = KV_NO_KEY before every launch.
// Position -1 means a row-level entry (indptr / last_page_len).
__device__ __forceinline__ unsigned long long kv_key(long long row, long long pos) {
  return ((unsigned long long)row << 32) | (unsigned long long)(pos + 1);
}

__device__ __forceinline__ void kv_note(unsigned long long* rec, long long row, long long pos) {
  atomicAdd(&rec[0], 1ull);
  atomicMin(&rec[1], kv_key(row, pos));
}

// Called by every thread of every block after the block's kv_note calls.
// True (uniformly) in the last block of the grid to get here; that block
// then decodes the first key and fills row/position/value/reason.
__device__ __forceinline__ bool kv_last_block(unsigned long long* rec) {
  KV_SHARED(int, s_last, );
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long total =
        (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    s_last = atomicAdd(&rec[6], 1ull) == total - 1;
  }
  __syncthreads();
  return s_last != 0;
}

// Thread 0 of the last block: read the first key back (row, pos) or false.
__device__ __forceinline__ bool kv_first_key(unsigned long long* rec, long long* row,
                                             long long* pos) {
  rec[6] = 0;
  const unsigned long long key = atomicAdd(&rec[1], 0ull);
  if (key == KV_NO_KEY) return false;
  *row = (long long)(key >> 32);
  *pos = (long long)(key & 0xffffffffull) - 1;
  return true;
}

__device__ __forceinline__ void kv_set_first(unsigned long long* rec, long long row,
                                             long long pos, long long value, int reason) {
  rec[2] = (unsigned long long)row;
  rec[3] = (unsigned long long)pos;
  rec[4] = (unsigned long long)value;
  rec[5] = (unsigned long long)reason;
}

// Describe the first violation of a CSR table (shared by decode + validate). An entry
// noted with a page that passes the bounds was noted for its generation: stale_page.
__device__ __forceinline__ void kv_csr_finish(unsigned long long* rec, const KvLayout& L,
                                              const int* indptr, const int* indices,
                                              const int* last_page_len, long long nnz,
                                              long long batch) {
  long long row, pos, value;
  if (!kv_first_key(rec, &row, &pos)) return;
  int reason;
  if (pos < 0) {
    reason = kv_csr_row_reason(indptr, last_page_len, nnz, batch, L.page_size, row, &value);
  } else {
    value = indices[pos];
    reason = kv_page_reason(L, value);
    if (reason == KV_OK) reason = KV_STALE_PAGE;
  }
  kv_set_first(rec, row, pos, value, reason);
}

__device__ __forceinline__ float kv_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ float kv_ninf() { return __int_as_float((int)0xff800000u); }

// ---- element loads: 16 bytes -> float[VEC] ----------------------------------
// (the host emulation's strict mode checks each 16-byte read of a cp.async target)
#ifdef KV_HOST_EMU
#define KV_EMU_SHARED_READ(p) kv_emu_shared_read(p)
#else
#define KV_EMU_SHARED_READ(p)
#endif
template <typename T> struct KvElem;
template <> struct KvElem<float> {
  static constexpr int VEC = 4;
  __device__ static __forceinline__ void load(const float* p, float* o) {
    KV_EMU_SHARED_READ(p);
    const float4 v = *reinterpret_cast<const float4*>(p);
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
  }
  __device__ static __forceinline__ float one(const float* p) { return *p; }
};
template <> struct KvElem<kv_half> {
  static constexpr int VEC = 8;
  __device__ static __forceinline__ void load(const kv_half* p, float* o) {
    KV_EMU_SHARED_READ(p);
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = kv_f16_to_f32((unsigned short)(w[i] & 0xffffu));
      o[2 * i + 1] = kv_f16_to_f32((unsigned short)(w[i] >> 16));
    }
  }
  __device__ static __forceinline__ float one(const kv_half* p) { return kv_f16_to_f32(p->bits); }
};
template <> struct KvElem<kv_bf16> {
  static constexpr int VEC = 8;
  __device__ static __forceinline__ void load(const kv_bf16* p, float* o) {
    KV_EMU_SHARED_READ(p);
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = __uint_as_float(w[i] << 16);
      o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static __forceinline__ float one(const kv_bf16* p) {
    return __uint_as_float((unsigned)p->bits << 16);
  }
};

// Byte copy of n bytes, 16 bytes at a time when both sides allow it; all
// threads of the block cooperate (tid/nthreads).
__device__ __forceinline__ void kv_copy_bytes(char* dst, const char* src, long long n, long long tid,
                                              long long nthreads) {
  const bool vec = ((reinterpret_cast<unsigned long long>(dst) |
                     reinterpret_cast<unsigned long long>(src) | (unsigned long long)n) & 15ull) == 0;
  if (vec) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (long long i = tid; i < n / 16; i += nthreads) d[i] = s[i];
  } else {
    for (long long i = tid; i < n; i += nthreads) dst[i] = src[i];
  }
}

// ==== decode helpers (issue #15): fast division and cp.async ================
// Additions only; nothing above depends on them.

// Division of n < 2^32 by a run-time invariant d (1 <= d < 2^31) with one
// 32x32->64 multiply and a shift (Granlund & Montgomery 1994, fig. 4.1:
// l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1, q = (mulhi(m, n) + n) >> l).
// Built once per block; `ok` is false when d is outside the range (callers
// then divide with `/`).
struct KvFastDiv {
  unsigned mul, shift;
  bool ok;
  __device__ __forceinline__ explicit KvFastDiv(long long d) : mul(1), shift(0), ok(d >= 1 && d < (1ll << 31)) {
    if (!ok) return;
    while ((1ull << shift) < (unsigned long long)d) ++shift;
    mul = (unsigned)((((1ull << shift) - (unsigned long long)d) << 32) / (unsigned long long)d + 1ull);
  }
  __device__ __forceinline__ unsigned div(unsigned n) const {
    const unsigned long long hi = ((unsigned long long)n * mul) >> 32;
    return (unsigned)((hi + n) >> shift);
  }
  // n < 2^31: mulhi(m, n) <= n, so the sum fits 32 bits (all-32-bit: no 64-bit product the
  // compiler could strength-reduce into a running 64-bit value per copy)
  __device__ __forceinline__ unsigned div31(unsigned n) const { return (__umulhi(n, mul) + n) >> shift; }
};

// Asynchronous 16-byte global -> shared copies (sm_80+), grouped by commit;
// kv_cp_async_wait<N>() returns once at most N most recent groups of this
// thread are still in flight. A shared-memory destination is a KvSmem: the
// 32-bit shared-window address on the device (kv_smem() converts a pointer
// once; offsets are then plain 32-bit adds), a pointer in the host emulation.
// kv_cp_async16(dst, src, full): full = false copies nothing from `src` and
// zero-fills the 16 bytes (cp.async's src-size operand 0: no global read).
// The host emulation (kv_emu.h) asserts 16-byte alignment of both sides and
// performs the copies at the wait (or eagerly at issue, or never before a
// barrier, in its strict modes), so a stage read before its wait, or
// overwritten before everyone has read it, gives wrong data in CPU tests.
#ifndef KV_HOST_EMU
typedef unsigned KvSmem;
__device__ __forceinline__ KvSmem kv_smem(const void* p) {
  unsigned s;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
  return s;
}
__device__ __forceinline__ void kv_cp_async16(KvSmem smem, const void* gmem, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(full ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void kv_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kv_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void kv_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// 2^x for the softmax: one MUFU.EX2 (ex2.approx.ftz: relative error ~2^-22, subnormal results
// flushed to 0; 2^-inf = 0). exp2f without fast math is ~6 instructions.
__device__ __forceinline__ float kv_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// ---- lane-group sums --------------------------------------------------------------------------
// Sum of N values across each aligned group of LG lanes (LG a power of two <= 32), result in every
// lane of the group. Two schedules, chosen at compile time by instruction count:
//   butterfly: lane i adds lane i ^ m for m = LG/2 .. 1, all N values each step
//              (N log2(LG) SHFL + N log2(LG) FADD);
//   reduce-scatter + gather: while a lane holds more than one value, a step halves them (the lane
//              whose bit m is set keeps the upper half and sends the lower: 2 FSEL + SHFL + FADD per
//              pair), then plain butterfly steps; finally each value is fetched from a lane that
//              holds it (N indexed SHFL). For N = 16, LG = 16: 76 instructions instead of 128.
// Both are deterministic: every lane of a group ends with the same bits for each value, whatever
// lane it reads them from (x + y == y + x in IEEE arithmetic).
// KvReduce<LG, N>::src(i), ::slot(i): lane (within the group) and register holding value i after
// the reduce-scatter. The host emulation runs the same schedule on values exchanged once.
__host__ __device__ constexpr int kv_log2(int x) { return x <= 1 ? 0 : 1 + kv_log2(x / 2); }
__host__ __device__ constexpr int kv_rs_cost(int lg, int n) {
  // instructions of reduce-scatter + gather over lg lanes, n values
  return lg <= 1 ? 0 : (n > 1 ? (n / 2) * 4 + kv_rs_cost(lg / 2, n / 2) : 2 + kv_rs_cost(lg / 2, 1));
}
template <int LG, int N>
struct KvReduce {
  static constexpr int STEPS = kv_log2(LG);
  static constexpr int BUTTERFLY = 2 * N * STEPS;
  static constexpr int SCATTER = kv_rs_cost(LG, N) + N;  // + the gather
  static constexpr bool USE_SCATTER = LG > 1 && N > 1 && (N & (N - 1)) == 0 && SCATTER < BUTTERFLY;
  static constexpr int FINAL = N / LG > 1 ? N / LG : 1;  // values per lane after the reduce-scatter
  // lane bits chosen by value i during the halving steps; its register index afterwards
  __host__ __device__ static constexpr int src(int i) {
    int lane = 0, start = 0, cnt = N;
    for (int m = LG / 2; m > 0 && cnt > 1; m /= 2) {
      const int half = cnt / 2;
      if (i - start >= half) {
        lane |= m;
        start += half;
      }
      cnt = half;
    }
    return lane;
  }
  __host__ __device__ static constexpr int slot(int i) {
    int start = 0, cnt = N;
    for (int m = LG / 2; m > 0 && cnt > 1; m /= 2) {
      const int half = cnt / 2;
      if (i - start >= half) start += half;
      cnt = half;
    }
    return i - start;
  }
};

#ifndef KV_HOST_EMU
// One halving step of the reduce-scatter per mask M while CNT values are live, then butterfly steps;
// templates, so every register index is a compile-time constant (a run-time index would put the
// values on the stack).
template <int N, int M, int CNT>
__device__ __forceinline__ void kv_rs_steps(float (&w)[N], unsigned lane) {
  if constexpr (M > 0) {
    if constexpr (CNT > 1) {
      constexpr int HALF = CNT / 2;
      const bool hi = (lane & M) != 0;
#pragma unroll
      for (int j = 0; j < HALF; ++j) {
        const float keep = hi ? w[j + HALF] : w[j];
        const float send = hi ? w[j] : w[j + HALF];
        w[j] = keep + __shfl_xor_sync(0xffffffffu, send, M);
      }
      kv_rs_steps<N, M / 2, HALF>(w, lane);
    } else {
      w[0] += __shfl_xor_sync(0xffffffffu, w[0], M);
      kv_rs_steps<N, M / 2, 1>(w, lane);
    }
  }
}
template <int LG, int N, int I>
__device__ __forceinline__ void kv_gather(float (&v)[N], const float (&w)[N]) {
  if constexpr (I < N) {
    constexpr int SLOT = KvReduce<LG, N>::slot(I), SRC = KvReduce<LG, N>::src(I);
    v[I] = __shfl_sync(0xffffffffu, w[SLOT], SRC, LG);
    kv_gather<LG, N, I + 1>(v, w);
  }
}

template <int LG, int N>
__device__ __forceinline__ void kv_group_allreduce(float (&v)[N]) {
  using R = KvReduce<LG, N>;
  if constexpr (!R::USE_SCATTER) {
#pragma unroll
    for (int m = LG / 2; m > 0; m >>= 1)
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], m);
  } else {
    float w[N];
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = v[k];
    kv_rs_steps<N, LG / 2, N>(w, threadIdx.x & (LG - 1));
    kv_gather<LG, N, 0>(v, w);
  }
}
#endif
