// decode_attention.cu -- paged decode attention over a CSR page table.
//
// One block per (row, kv head x q-head chunk, split). The block owns up to
// KV_DEC_GMAX query heads that share one kv head (GQA), walks its token range
// in tiles of KV_DEC_THREADS tokens with an online softmax (float32, log2
// domain), and writes either the final output (no split) or a partial
// (output normalised by its own sum, natural-log lse, violation flag) that
// kv_decode_merge combines with log-sum-exp.
//
// Bounds: before any cache load the block checks every table entry it will
// read (and split 0 also the entries before the window and the row-level
// fields), so a bad page is never dereferenced. Counting is done only by the
// blocks with blockIdx.y == 0, each entry by the one split that owns it.
#include "paged.cuh"

#define KV_DEC_THREADS 128
#define KV_DEC_GMAX 8
#define KV_DEC_DMAX 512
#define KV_DEC_RED 8192  // floats of shared scratch (>= 128 * GMAX * VEC)
#define KV_LOG2E 1.4426950408889634f
#define KV_LN2 0.6931471805599453f
static_assert(KV_DEC_THREADS == 16 * KV_DEC_GMAX, "phase B maps 16 threads per head");

struct KvDecodeArgs {
  const int* indptr;
  const int* indices;
  const int* last_page_len;
  long long nnz, batch, q_heads, window, pages_per_split, policy;
  float sm_scale;
};

template <typename T, int GM>
__device__ __forceinline__ void kv_decode_block(const T* __restrict__ q, const T* __restrict__ cache,
                                                const KvLayout L, const KvDecodeArgs A,
                                                float* out, float* lse, float* part_out,
                                                float* part_lse, int* part_flag,
                                                unsigned long long* rec) {
  constexpr int VEC = KvElem<T>::VEC;
  constexpr int NT = KV_DEC_THREADS;
  __shared__ float s_buf[KV_DEC_RED];  // q [GMAX][D] | p [GMAX][NT]; later reduction
  __shared__ long long s_off[NT];
  __shared__ float s_m[KV_DEC_GMAX], s_scale[KV_DEC_GMAX], s_l[NT * KV_DEC_GMAX / 4];
  __shared__ int s_bad;
  float* s_q = s_buf;
  float* s_p = s_buf + KV_DEC_GMAX * KV_DEC_DMAX;

  const int tid = threadIdx.x;
  const long long D = L.head_dim, ps = L.page_size;
  const long long row = blockIdx.x, split = blockIdx.z;
  const long long G = A.q_heads / L.kv_heads;
  const long long gchunks = (G + GM - 1) / GM;
  const long long kvh = blockIdx.y / gchunks, gc = blockIdx.y % gchunks;
  const int gt = (int)(G - gc * GM < GM ? G - gc * GM : GM);
  const long long qh0 = kvh * G + gc * GM;
  const bool counter = blockIdx.y == 0;
  const bool split_mode = part_out != nullptr;
  const long long nsplit = gridDim.z;

  // ---- row-level fields and this block's token range ----
  long long rvalue;
  const int rreason = kv_csr_row_reason(A.indptr, A.last_page_len, A.nnz, A.batch, ps, row, &rvalue);
  long long a = 0, npages = 0, seq_len = 0;
  long long tok_lo = 0, tok_hi = 0, chk_lo = 0, chk_hi = 0;
  if (rreason == KV_OK) {
    a = A.indptr[row];
    npages = A.indptr[row + 1] - a;
    seq_len = npages > 0 ? (npages - 1) * ps + A.last_page_len[row] : 0;
    const long long w_lo = (A.window > 0 && seq_len > A.window) ? seq_len - A.window : 0;
    const long long first_pp = w_lo / ps;
    long long pp_lo = first_pp, pp_hi = npages;
    if (A.pages_per_split > 0) {
      pp_lo = first_pp + split * A.pages_per_split;
      if (pp_lo > npages) pp_lo = npages;
      if (split + 1 < nsplit && pp_lo + A.pages_per_split < npages) pp_hi = pp_lo + A.pages_per_split;
    }
    tok_lo = pp_lo * ps > w_lo ? pp_lo * ps : w_lo;
    tok_hi = pp_hi * ps < seq_len ? pp_hi * ps : seq_len;
    chk_lo = split == 0 ? 0 : pp_lo;  // split 0 also owns the entries before the window
    chk_hi = pp_hi;
  } else if (rreason == KV_BAD_LAST_PAGE_LEN && split == 0) {
    a = A.indptr[row];
    chk_hi = A.indptr[row + 1] - a;  // nothing is read; split 0 checks every entry
  }
  if (tid == 0) {
    s_bad = rreason != KV_OK;
    if (rreason != KV_OK && counter && split == 0) kv_note(rec, row, -1);
  }
  __syncthreads();
#ifndef KV_NO_BOUNDS_CHECK
  for (long long pp = chk_lo + tid; pp < chk_hi; pp += NT) {
    if (kv_page_reason(L, A.indices[a + pp]) != KV_OK) {
      atomicOr(&s_bad, 1);
      if (counter) kv_note(rec, row, a + pp);
    }
  }
#endif
  __syncthreads();
  const bool bad = s_bad != 0;
  const bool empty = bad || tok_lo >= tok_hi;

  // ---- q (pre-scaled into the log2 domain) ----
  const float qscale = A.sm_scale * KV_LOG2E;
  for (long long i = tid; i < KV_DEC_GMAX * D; i += NT) {
    const long long g = i / D, d = i - g * D;
    s_q[i] = g < gt ? KvElem<T>::one(q + (row * A.q_heads + qh0 + g) * D + d) * qscale : 0.f;
  }
  if (tid < KV_DEC_GMAX) s_m[tid] = kv_ninf();
  __syncthreads();

  // PV mapping: LD lanes cover head_dim in VEC chunks, NSUB token subsets.
  const int LD = (int)(D / VEC), NSUB = NT / LD;
  const int dl = tid % LD, ts = tid / LD;
  float acc[GM][VEC], lsum[GM];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    lsum[g] = 0.f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[g][v] = 0.f;
  }
  const long long vshift = ps * L.kv_heads * D;  // V half of a page

  for (long long t0 = tok_lo; !empty && t0 < tok_hi; t0 += NT) {
    const int n = (int)(tok_hi - t0 < NT ? tok_hi - t0 : NT);
    // A: one thread per token computes the scores of all heads of the chunk.
    if (tid < n) {
      const long long j = t0 + tid, pp = j / ps;
      const long long off = kv_row_offset(L, A.indices[a + pp], 0, j - pp * ps, kvh);
      s_off[tid] = off;
      float sc[GM];
#pragma unroll
      for (int g = 0; g < GM; ++g) sc[g] = 0.f;
      for (long long c = 0; c < D; c += VEC) {
        float kf[VEC];
        KvElem<T>::load(cache + off + c, kf);
#pragma unroll
        for (int g = 0; g < GM; ++g)
#pragma unroll
          for (int v = 0; v < VEC; ++v) sc[g] += s_q[g * D + c + v] * kf[v];
      }
#pragma unroll
      for (int g = 0; g < GM; ++g) s_p[g * NT + tid] = sc[g];
    } else {
#pragma unroll
      for (int g = 0; g < GM; ++g) s_p[g * NT + tid] = kv_ninf();
    }
    __syncthreads();
    // B: tile max per head, 16 threads per head.
    {
      const int g = tid / 16, l = tid % 16;
      float mx = kv_ninf();
#pragma unroll
      for (int k = 0; k < NT / 16; ++k) mx = fmaxf(mx, s_p[g * NT + l * (NT / 16) + k]);
#pragma unroll
      for (int m = 8; m > 0; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
      if (l == 0 && g < GM) {
        const float mo = s_m[g], mn = fmaxf(mo, mx);
        s_scale[g] = mn == kv_ninf() ? 1.f : exp2f(mo - mn);
        s_m[g] = mn;
      }
    }
    __syncthreads();
    if (tid < n) {
#pragma unroll
      for (int g = 0; g < GM; ++g) s_p[g * NT + tid] = exp2f(s_p[g * NT + tid] - s_m[g]);
    }
    __syncthreads();
    // C: rescale and accumulate P.V for this thread's dims and token subset.
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      const float f = s_scale[g];
      lsum[g] *= f;
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[g][v] *= f;
    }
    for (int t = ts; t < n; t += NSUB) {
      float vf[VEC];
      KvElem<T>::load(cache + s_off[t] + vshift + dl * VEC, vf);
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float p = s_p[g * NT + t];
        lsum[g] += p;
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[g][v] += p * vf[v];
      }
    }
    __syncthreads();
  }

  // ---- reduce the token subsets (fixed order: deterministic) ----
  if (!empty) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) s_buf[(ts * KV_DEC_GMAX + g) * D + dl * VEC + v] = acc[g][v];
      if (dl == 0) s_l[ts * KV_DEC_GMAX + g] = lsum[g];
    }
  }
  __syncthreads();
  const float poison = A.policy == KV_POLICY_ZEROS ? 0.f : kv_nan();
  const float poison_lse = A.policy == KV_POLICY_ZEROS ? kv_ninf() : kv_nan();
  for (long long i = tid; i < gt * D; i += NT) {
    const int g = (int)(i / D);
    const long long d = i - g * D, qh = qh0 + g;
    float o = 0.f, lo = kv_ninf();
    if (!empty) {
      float s = 0.f, l = 0.f;
      for (int u = 0; u < NSUB; ++u) {
        s += s_buf[(u * KV_DEC_GMAX + g) * D + d];
        l += s_l[u * KV_DEC_GMAX + g];
      }
      o = s / l;
      lo = (s_m[g] + log2f(l)) * KV_LN2;
    }
    if (split_mode) {
      const long long base = split * A.batch + row;
      part_out[(base * A.q_heads + qh) * D + d] = o;
      if (d == 0) part_lse[base * A.q_heads + qh] = lo;
    } else {
      out[(row * A.q_heads + qh) * D + d] = bad ? poison : o;
      if (d == 0) lse[row * A.q_heads + qh] = bad ? poison_lse : lo;
    }
  }
  if (split_mode && counter && tid == 0) part_flag[split * A.batch + row] = bad ? 1 : 0;
#ifndef KV_NO_BOUNDS_CHECK
  if (kv_last_block(rec) && tid == 0)
    kv_csr_finish(rec, L, A.indptr, A.indices, A.last_page_len, A.nnz, A.batch);
#endif
}

// grid = (batch, kv_heads * ceil(G / GM), num_splits), block = 128 threads,
// G = q_heads / kv_heads, GM = the entry's heads per block (>= min(G, 8)).
// q: [batch, q_heads, head_dim] (cache dtype); indptr: int32 [batch + 1];
// indices: int32 [nnz]; last_page_len: int32 [batch]. Non-split (part_* null,
// num_splits 1): out float32 [batch, q_heads, head_dim], lse float32
// [batch, q_heads] (natural log). Split: part_out float32
// [splits, batch, q_heads, head_dim], part_lse [splits, batch, q_heads],
// part_flag int32 [splits, batch]; then kv_decode_merge.
#define KV_DECODE_ENTRY(NAME, T, GM)                                                          \
  extern "C" __global__ void __launch_bounds__(KV_DEC_THREADS) NAME(                          \
      const T* q, const T* cache, long long page_stride, long long page_size,                 \
      long long kv_heads, long long head_dim, long long scale, long long offset,              \
      long long base, long long upper_bound, long long pool_pages, const int* indptr,         \
      const int* indices,                                                                     \
      const int* last_page_len, long long nnz, long long batch, long long q_heads,            \
      long long window, float sm_scale, long long pages_per_split, long long policy,          \
      float* out, float* lse, float* part_out, float* part_lse, int* part_flag,               \
      unsigned long long* rec) {                                                              \
    const KvLayout L{page_stride, page_size, kv_heads, head_dim, scale, offset, base,         \
                     upper_bound, pool_pages};                                                \
    const KvDecodeArgs A{indptr, indices, last_page_len, nnz, batch, q_heads,                 \
                         window, pages_per_split, policy, sm_scale};                          \
    kv_decode_block<T, GM>(q, cache, L, A, out, lse, part_out, part_lse, part_flag, rec);     \
  }                                                                                           \
  KV_REGISTER(NAME)

// One entry per (dtype, GM = q heads per block in {1, 2, 4, 8}).
#define KV_DECODE_ENTRIES(SUFFIX, T)                \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g1, T, 1)    \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g2, T, 2)    \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g4, T, 4)    \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g8, T, 8)
KV_DECODE_ENTRIES(f32, float)
KV_DECODE_ENTRIES(f16, kv_half)
KV_DECODE_ENTRIES(bf16, kv_bf16)

// grid = (batch, q_heads), block = 128. Combines the splits of one (row,
// head) with log-sum-exp in a fixed order; a row flagged by any split gets
// the policy's poison.
extern "C" __global__ void __launch_bounds__(KV_DEC_THREADS) kv_decode_merge(
    const float* part_out, const float* part_lse, const int* part_flag, long long num_splits,
    long long batch, long long q_heads, long long head_dim, long long policy, float* out,
    float* lse) {
  const long long row = blockIdx.x, qh = blockIdx.y;
  bool bad = false;
  float m = kv_ninf();
  for (long long s = 0; s < num_splits; ++s) {
    bad = bad || part_flag[s * batch + row] != 0;
    m = fmaxf(m, part_lse[(s * batch + row) * q_heads + qh]);
  }
  const float poison = policy == KV_POLICY_ZEROS ? 0.f : kv_nan();
  float wsum = 0.f;
  for (long long s = 0; s < num_splits && !bad && m != kv_ninf(); ++s)
    wsum += expf(part_lse[(s * batch + row) * q_heads + qh] - m);
  for (long long d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    if (bad) {
      o = poison;
    } else if (m != kv_ninf()) {
      for (long long s = 0; s < num_splits; ++s) {
        const long long b = (s * batch + row) * q_heads + qh;
        o += expf(part_lse[b] - m) * part_out[b * head_dim + d];
      }
      o /= wsum;
    }
    out[(row * q_heads + qh) * head_dim + d] = o;
  }
  if (threadIdx.x == 0)
    lse[row * q_heads + qh] =
        bad ? (policy == KV_POLICY_ZEROS ? kv_ninf() : kv_nan())
            : (m == kv_ninf() ? kv_ninf() : m + logf(wsum));
}
KV_REGISTER(kv_decode_merge)
