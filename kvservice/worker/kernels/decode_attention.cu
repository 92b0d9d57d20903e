// decode_attention.cu -- paged decode attention over a CSR page table.
//
// One block (128 threads = 4 warps) per (row, kv head x chunk of GM q heads,
// split); cache dtype T, GM and head_dim D are template parameters, so every
// loop over head_dim, heads and stages is unrolled and every in-row index is
// a shift. Per block:
//   1. bounds: every table entry the block owns is checked before any cache
//      load (split 0 also checks the entries before the window and the
//      row-level fields), so a bad page is never dereferenced; with page
//      generations, the same pass loads each page's expected and recorded
//      generation once and compares them (stale_page), so the tile loop
//      below carries no check at all;
//   2. q of the GM heads is loaded once into registers, pre-scaled into the
//      log2 domain;
//   3. the token range is streamed in tiles of TT tokens through a STAGES-deep
//      cp.async ring in shared memory (K and V of tile t + STAGES - 1 are in
//      flight while tile t is used); each tile's copies are coalesced: 16-byte
//      pieces of a row go to consecutive threads;
//   4. a lane group of LG lanes owns one K/V row at a time: each lane holds
//      E = D / LG elements of q and of the output, the row's score is a
//      partial dot product reduced by LG-lane xor shuffles, and every lane
//      group keeps its own online-softmax state (max, sum, output) in
//      registers for all GM heads;
//   5. the NR lane-group states are merged once, in a fixed order, through
//      shared memory (deterministic) into the output or a split partial
//      (output normalised by its own sum, natural-log lse, violation flag)
//      that kv_decode_merge combines with log-sum-exp.
// Page addressing and checks go through kv_row_offset / kv_page_reason only.
// Counting is done only by the blocks with blockIdx.y == 0, each entry by
// the one split that owns it.
#include "paged.cuh"

#define KV_DEC_THREADS 128
#define KV_LOG2E 1.4426950408889634f
#define KV_LN2 0.6931471805599453f

struct KvDecodeArgs {
  const int* indptr;
  const int* indices;
  const int* last_page_len;
  long long nnz, batch, q_heads, window, pages_per_split, policy;
  float sm_scale;
  const unsigned* generations;  // uint32 [nnz] expected, or null (not checked)
  const unsigned* page_gen;     // uint32 [pages of the layer] recorded by the worker
};

// Compile-time geometry of one (dtype, heads per block, head_dim) variant.
template <typename T, int GM, int D>
struct KvDecGeom {
  static constexpr int NT = KV_DEC_THREADS;
  static constexpr int VEC = KvElem<T>::VEC;          // elements per 16-byte piece
  static constexpr int CPR = D / VEC;                 // pieces per K (or V) row
  static constexpr int LG = CPR < 32 ? CPR : 32;      // lanes per row: one lane group
  static constexpr int CH = CPR / LG;                 // pieces per lane per row
  static constexpr int E = CH * VEC;                  // elements per lane per row
  static constexpr int NR = NT / LG;                  // lane groups per block
  static constexpr int RPT = CH == 1 ? 2 : 1;         // rows per lane group per tile
  static constexpr int TT = NR * RPT;                 // tokens per tile
  static constexpr int NCH = TT * CPR / NT;           // K (and V) copies per thread per tile
  static constexpr int STAGES = NCH <= 2 ? 3 : 2;     // cp.async ring depth
  static constexpr int STAGE_PIECES = TT * CPR;       // 16-byte pieces of K (or V) per stage
  static constexpr int PIPE_FLOATS = STAGES * 2 * STAGE_PIECES * 4;
  static constexpr int MERGE_FLOATS = NR * GM * D;    // per lane group: GM x D partial outputs
  static constexpr int BUF_FLOATS = PIPE_FLOATS > MERGE_FLOATS ? PIPE_FLOATS : MERGE_FLOATS;
  // Blocks per SM asked of ptxas (__launch_bounds__ minimum), from the
  // registers that grow with the variant: q and output (2 GM E) and scores
  // (~4 GM RPT). Caps: 72 (7 blocks), 85 (6), 102 (5), 128 (4), 170 (3), 255 (2) registers.
  // The 4-heads 16-bit entries and float32 g4 d256 (REG_VAR 80-96) sit at the 128 cap: the
  // per-copy page division is all 32-bit (KvFastDiv::div31) so that no 64-bit running product
  // per copy lives across the tile loop. test_nvcc fails on any spill and on fewer blocks than
  // documented; scripts/sass_budget.py on fewer blocks than main had before issue 25.
  static constexpr int REG_VAR = 2 * GM * E + 4 * GM * RPT;
  static constexpr int MIN_BLOCKS =
      REG_VAR <= 16 ? 7 : REG_VAR <= 24 ? 6 : REG_VAR <= 48 ? 5 : REG_VAR <= 96 ? 4 : REG_VAR <= 128 ? 3 : 2;
  static_assert(D % VEC == 0 && (CPR & (CPR - 1)) == 0, "head_dim must be a power of two >= 2 pieces");
  static_assert(NCH * NT == TT * CPR, "a tile is a whole number of copies per thread");
  static_assert(GM * E <= 64, "q and output registers per lane (GM * E) capped at 64 each");
  static_assert(BUF_FLOATS * 4 + 2 * NR * GM * 4 <= 40 * 1024, "static shared memory budget");
};

// Lazy rescaling: a lane group moves its softmax reference max m only when a score exceeds it by
// more than KV_RESCALE_SLACK (log2 domain), so most tiles skip the rescale of the accumulators.
// Exact: out = sum(2^(s-m) v) / sum(2^(s-m)) for any m; every weight stays <= 2^8. m starts at
// -FLT_MAX (finite), so 2^(s - m) needs no guard for masked scores (-inf) and the first rescale's
// factor 2^(-FLT_MAX - max) is 0. (A score of -inf from inf inputs weighs 0, as in the reference.)
// KV_SASS_STEADY (scripts/sass_budget.py only, never built into a library) compiles out the two
// branches a steady-state tile skips (boundary masks, rescale), so the script can count that tile;
// KV_SASS_NO_MASK / KV_SASS_NO_RESCALE compile out one of them (sass_budget.py --rare: what each costs).
#define KV_RESCALE_SLACK 8.0f
#define KV_M0 (-3.402823466e38f)

// What one block works on, in the segment the tile loop runs over (all 32-bit: a segment holds
// fewer than 2^31 tokens; the block's token range is cut into such segments, each starting on a
// page boundary).
struct KvSegment {
  const int* pages;  // &indices[indptr[row] + first page of the segment]
  unsigned n;        // tokens from the segment start to the end of the block's range
  unsigned lo;       // first token to attend (tokens [0, lo) of the first page are masked)
};

// The tile loop over one segment. Tile t holds tokens [t TT, t TT + TT) of the segment; thread
// `tid` copies rows rk = tid / CPR + k * (NT / CPR) (k < NCH), piece tid % CPR, of K and V.
// ONE_PAGE (page_size a multiple of TT, every segment page-aligned): a tile lies in one page, so its
// page index is loaded once per tile and the page advances by a counter; otherwise each copy finds
// its page with the fast divider. Rows outside [lo, n) are zero-filled (no global read) and masked.
// Per page: one 64-bit base, page0 + p * page_bytes (page0: the address page index 0 would have,
// cache - base pages, as a wrapping 64-bit integer: p >= base for every checked page, so the sum is
// inside the buffer); every other offset is 32-bit (PageLayout.validate: a page holds fewer than
// 2^31 elements). Page indices were checked by the block's bounds pass before this runs.
template <typename T, int GM, int D, bool ONE_PAGE>
__device__ __forceinline__ void kv_decode_segment(const KvSegment S, const T* __restrict__ cache,
                                                  const unsigned long long page0, const long long page_bytes,
                                                  const unsigned ps, const KvFastDiv pdiv,
                                                  const unsigned row_stride, const unsigned kv_off,
                                                  const unsigned col, const KvSmem s_pipe,
                                                  const uint4* s_tiles, const float (&qr)[GM][KvDecGeom<T, GM, D>::E],
                                                  float (&acc)[GM][KvDecGeom<T, GM, D>::E], float (&m)[GM],
                                                  float (&l)[GM]) {
  using G = KvDecGeom<T, GM, D>;
  constexpr int NT = G::NT, VEC = G::VEC, CPR = G::CPR, LG = G::LG, CH = G::CH;
  constexpr int NR = G::NR, RPT = G::RPT, TT = G::TT, STAGES = G::STAGES, NCH = G::NCH;
  constexpr int RSTEP = NT / CPR;                          // rows between a thread's copies
  constexpr unsigned STAGE_BYTES = 2u * G::STAGE_PIECES * 16u;  // K and V of one tile
  const int tid = threadIdx.x;
  const int lane = tid % LG, grp = tid / LG;
  const unsigned r0 = (unsigned)(tid / CPR);
  const KvSmem dst0 = s_pipe + (unsigned)tid * 16u;
  const unsigned ntiles = (S.n + TT - 1) / TT;
  const unsigned span = S.n - S.lo;  // row u is attended iff u - lo < span (unsigned)
  unsigned next_page = 0, next_tok = 0;  // ONE_PAGE: page and first token of the next tile to issue

  // Queue the K and V copies of tile t into ring stage `stage`.
  auto issue = [&](unsigned t, unsigned stage) {
    const KvSmem dk = dst0 + stage * STAGE_BYTES, dv = dk + G::STAGE_PIECES * 16u;
    const unsigned u0 = t * TT;
    if constexpr (ONE_PAGE) {
      const T* const pg = reinterpret_cast<const T*>(page0 + (unsigned long long)(S.pages[next_page] * page_bytes)) + col;
#ifdef KV_SASS_PROBE_PAGE_CHECK
      // scripts/sass_budget.py --probe-page-check only (never built into a library): a stand-in
      // for a per-page generation check, one load of the page's expected value beside the index,
      // one of the generation recorded for the page, a compare; a mismatch stops the copies.
      const bool fresh = S.pages[next_page + 0x40000000u] == ((const int*)cache)[S.pages[next_page]];
#else
      const bool fresh = true;
#endif
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const unsigned u = u0 + r0 + k * RSTEP;
        const bool full = fresh && u - S.lo < span;
        const T* const src = full ? pg + (next_tok + r0 + k * RSTEP) * row_stride : cache;
        kv_cp_async16(dk + k * NT * 16u, src, full);
        kv_cp_async16(dv + k * NT * 16u, full ? src + kv_off : cache, full);
      }
      next_tok += TT;
      if (next_tok == ps) {
        next_tok = 0;
        ++next_page;
      }
    } else {
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const unsigned u = u0 + r0 + k * RSTEP;
        bool full = u - S.lo < span;
        const T* src = cache;
        if (full) {
          const unsigned pp = pdiv.div31(u), tok = u - pp * ps;
#ifdef KV_SASS_PROBE_PAGE_CHECK
          full = S.pages[pp + 0x40000000u] == ((const int*)cache)[S.pages[pp]];  // see above
#endif
          src = reinterpret_cast<const T*>(page0 + (unsigned long long)(S.pages[pp] * page_bytes)) + col +
                tok * row_stride;
        }
        kv_cp_async16(dk + k * NT * 16u, src, full);
        kv_cp_async16(dv + k * NT * 16u, full ? src + kv_off : cache, full);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if ((unsigned)s < ntiles) issue(s, s);
    kv_cp_async_commit();
  }
  int use = 0;  // ring stage of the tile in use; the next tile goes to the stage before it
  for (unsigned t = 0; t < ntiles; ++t) {
    if (t + STAGES - 1 < ntiles) issue(t + STAGES - 1, use == 0 ? STAGES - 1 : use - 1);
    kv_cp_async_commit();
    kv_cp_async_wait<STAGES - 1>();  // this thread's copies of tile t have landed
    __syncthreads();                 // and everyone else's
    const uint4* const sk = s_tiles + use * 2 * G::STAGE_PIECES;
    const uint4* const sv = sk + G::STAGE_PIECES;

    // scores of this lane group's RPT rows (rows grp + i * NR of the tile): partial dot products
    // over the lane's elements, then one LG-lane sum
    float s[RPT * GM];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = grp + i * NR;
#pragma unroll
      for (int g = 0; g < GM; ++g) s[i * GM + g] = 0.f;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        float kf[VEC];
        KvElem<T>::load(reinterpret_cast<const T*>(sk + r * CPR + lane + c * LG), kf);
#pragma unroll
        for (int g = 0; g < GM; ++g)
#pragma unroll
          for (int v = 0; v < VEC; ++v) s[i * GM + g] += qr[g][c * VEC + v] * kf[v];
      }
    }
    kv_group_allreduce<LG>(s);
    // rows outside [lo, n) were zero-filled: mask their scores (only the first and last tiles of a
    // segment have such rows)
#if !defined(KV_SASS_STEADY) && !defined(KV_SASS_NO_MASK)
    if (t * TT < S.lo || t * TT + TT > S.n) {
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const bool live = t * TT + (unsigned)(grp + i * NR) - S.lo < span;
#pragma unroll
        for (int g = 0; g < GM; ++g) s[i * GM + g] = live ? s[i * GM + g] : kv_ninf();
      }
    }
#endif
    bool need = false;
    float mx[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      mx[g] = s[g];
#pragma unroll
      for (int i = 1; i < RPT; ++i) mx[g] = fmaxf(mx[g], s[i * GM + g]);
      need = need || mx[g] > m[g] + KV_RESCALE_SLACK;
    }
#if !defined(KV_SASS_STEADY) && !defined(KV_SASS_NO_RESCALE)
    if (need) {  // rare: the reference max of some head moved up by more than the slack
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float nm = fmaxf(m[g], mx[g]);
        const float f = kv_ex2(m[g] - nm);  // m finite: 2^0 = 1 for a head whose max stayed
        m[g] = nm;
        l[g] *= f;
#pragma unroll
        for (int e = 0; e < G::E; ++e) acc[g][e] *= f;
      }
    }
#else
    (void)need;
#endif
    // weights: 2^(s - m) <= 2^slack; a masked row's 2^-inf = 0
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        s[i * GM + g] = kv_ex2(s[i * GM + g] - m[g]);
        l[g] += s[i * GM + g];
      }
    }
    // P.V for the lane group's rows (a masked row's V is zeros and its weight 0)
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = grp + i * NR;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        float vf[VEC];
        KvElem<T>::load(reinterpret_cast<const T*>(sv + r * CPR + lane + c * LG), vf);
#pragma unroll
        for (int g = 0; g < GM; ++g)
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[g][c * VEC + v] += s[i * GM + g] * vf[v];
      }
    }
    __syncthreads();  // stage `use` is free for tile t + STAGES
    use = use + 1 == STAGES ? 0 : use + 1;
  }
  kv_cp_async_wait_all();  // nothing is pending (later groups were empty)
}

template <typename T, int GM, int D>
__device__ __forceinline__ void kv_decode_block(const T* __restrict__ q, const T* __restrict__ cache,
                                                const KvLayout L, const KvDecodeArgs A,
                                                float* out, float* lse, float* part_out,
                                                float* part_lse, int* part_flag,
                                                unsigned long long* rec) {
  using G = KvDecGeom<T, GM, D>;
  constexpr int NT = G::NT, VEC = G::VEC, CPR = G::CPR, LG = G::LG, CH = G::CH, E = G::E;
  constexpr int NR = G::NR, TT = G::TT;
  // pipeline ring [STAGES][K, V][STAGE_PIECES] pieces; after the loop, the
  // lane-group partial outputs [NR][GM][D] (float).
  KV_SHARED(uint4, s_raw, [G::BUF_FLOATS / 4]);  // uint4: 16-byte aligned
  KV_SHARED(float, s_m, [NR * GM]);
  KV_SHARED(float, s_l, [NR * GM]);
  KV_SHARED(int, s_bad, );
  KV_SHARED(long long, s_ctx, [4]);  // row, split, first q head, heads: read back after the loop
  float* const s_buf = reinterpret_cast<float*>(s_raw);

  const int tid = threadIdx.x;
  const int lane = tid % LG, grp = tid / LG;  // lane in its lane group, lane group
  const long long ps = L.page_size;
  long long row = blockIdx.x, split = blockIdx.z;
  const long long Gq = A.q_heads / L.kv_heads;
  const long long gchunks = (Gq + GM - 1) / GM;
  const long long kvh = blockIdx.y / gchunks, gc = blockIdx.y % gchunks;
  int gt = (int)(Gq - gc * GM < GM ? Gq - gc * GM : GM);
  long long qh0 = kvh * Gq + gc * GM;
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
  // Every table entry this block owns is checked here, before any cache load: a per-page check
  // (bounds, lattice, and any further per-page rule such as a page generation) belongs in this
  // pass, one coalesced load per entry per block, not in the tile loop.
  for (long long pp = chk_lo + tid; pp < chk_hi; pp += NT) {
    if (kv_entry_reason(L, A.indices, A.generations, A.page_gen, a + pp) != KV_OK) {
      atomicOr(&s_bad, 1);
      if (counter) kv_note(rec, row, a + pp);
    }
  }
#endif
  __syncthreads();
  const KvFastDiv pdiv(ps);
  bool bad = s_bad != 0 || !pdiv.ok;  // !ok: a page_size the wrapper refuses anyway
  bool empty = bad || tok_lo >= tok_hi;  // block-uniform
  // What the merge needs goes through shared memory, so none of it holds a register across the
  // tile loop (the 4-heads entries sit at their 128-register cap).
  if (tid == 0) {
    s_ctx[0] = row | (bad ? 1ll << 62 : 0) | (empty ? 1ll << 61 : 0);
    s_ctx[1] = split;
    s_ctx[2] = qh0;
    s_ctx[3] = gt;
  }

  // ---- q of this lane's elements, all GM heads, in registers (log2 domain) ----
  // Lane `lane` owns pieces lane + c * LG (c < CH) of every row: elements
  // (lane + c * LG) * VEC + v, stored at [c * VEC + v].
  const float qscale = A.sm_scale * KV_LOG2E;
  float qr[GM][E], acc[GM][E], m[GM], l[GM];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = KV_M0;  // KV_M0 + slack == KV_M0: the first live score rescales
    l[g] = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const long long d = (long long)(lane + c * LG) * VEC + v;
        qr[g][c * VEC + v] = g < gt ? KvElem<T>::one(q + (row * A.q_heads + qh0 + g) * D + d) * qscale : 0.f;
        acc[g][c * VEC + v] = 0.f;
      }
  }

  if (!empty) {
    // In-page offsets are 32-bit: (kv, token, head, element) < page elements < 2^31 (checked by
    // PageLayout.validate); the page base (p - base) * page_stride stays 64-bit.
    const unsigned row_stride = (unsigned)(L.kv_heads * D), kv_off = (unsigned)(ps * L.kv_heads * D);
    const unsigned col = (unsigned)(kvh * D) + (unsigned)((tid % CPR) * VEC);
    const KvSmem s_pipe = kv_smem(s_raw);
    const long long page_bytes = L.page_stride * (long long)sizeof(T);
    const unsigned long long page0 =
        reinterpret_cast<unsigned long long>(cache) - (unsigned long long)(L.base * page_bytes);
    // The block's tokens start on a page boundary (tokens before tok_lo are masked), in segments
    // of fewer than 2^31 tokens so that in-segment token numbers are 32-bit.
    const long long first = tok_lo / ps * ps;
    const long long seg_tokens = ((1ll << 30) / ps > 1 ? (1ll << 30) / ps : 1) * ps;
    const bool one_page = (unsigned)ps % TT == 0;
    for (long long s0 = first; s0 < tok_hi; s0 += seg_tokens) {
      const long long s1 = tok_hi - s0 < seg_tokens ? tok_hi : s0 + seg_tokens;
      const KvSegment S{A.indices + a + s0 / ps, (unsigned)(s1 - s0), (unsigned)(s0 == first ? tok_lo - first : 0)};
      if (one_page)
        kv_decode_segment<T, GM, D, true>(S, cache, page0, page_bytes, (unsigned)ps, pdiv, row_stride, kv_off,
                                          col, s_pipe, s_raw, qr, acc, m, l);
      else
        kv_decode_segment<T, GM, D, false>(S, cache, page0, page_bytes, (unsigned)ps, pdiv, row_stride,
                                           kv_off, col, s_pipe, s_raw, qr, acc, m, l);
    }

    // ---- lane-group states to shared memory (the ring is no longer used) ----
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int v = 0; v < VEC; ++v) s_buf[(grp * GM + g) * D + (lane + c * LG) * VEC + v] = acc[g][c * VEC + v];
      if (lane == 0) {
        s_m[grp * GM + g] = l[g] > 0.f ? m[g] : kv_ninf();  // -inf: a lane group that saw no live token
        s_l[grp * GM + g] = l[g];
      }
    }
  }
  __syncthreads();

  // ---- merge the NR lane groups in a fixed order and write ----
  {
    const long long r0 = s_ctx[0];
    row = r0 & ((1ll << 61) - 1);
    bad = (r0 >> 62) & 1;
    empty = (r0 >> 61) & 1;
    split = s_ctx[1];
    qh0 = s_ctx[2];
    gt = (int)s_ctx[3];
  }
  const float poison = A.policy == KV_POLICY_ZEROS ? 0.f : kv_nan();
  const float poison_lse = A.policy == KV_POLICY_ZEROS ? kv_ninf() : kv_nan();
  for (int i = tid; i < gt * D; i += NT) {
    const int g = i / D, d = i % D;
    const long long qh = qh0 + g;
    float o = 0.f, lo = kv_ninf();
    if (!empty) {
      float mx = kv_ninf();
      for (int u = 0; u < NR; ++u) mx = fmaxf(mx, s_m[u * GM + g]);
      if (mx != kv_ninf()) {
        float sum = 0.f, acc_o = 0.f;
        for (int u = 0; u < NR; ++u) {
          const float mu = s_m[u * GM + g];
          if (mu == kv_ninf()) continue;  // a lane group that saw no token
          const float w = exp2f(mu - mx);
          sum += s_l[u * GM + g] * w;
          acc_o += s_buf[(u * GM + g) * D + d] * w;
        }
        o = acc_o / sum;
        lo = (mx + log2f(sum)) * KV_LN2;
      }
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
  if (part_out != nullptr && blockIdx.y == 0 && tid == 0) part_flag[split * A.batch + row] = bad ? 1 : 0;
#ifndef KV_NO_BOUNDS_CHECK
  if (kv_last_block(rec) && tid == 0)
    kv_csr_finish(rec, L, A.indptr, A.indices, A.last_page_len, A.nnz, A.batch);
#endif
}

// grid = (batch, kv_heads * ceil(G / GM), num_splits), block = 128 threads,
// G = q_heads / kv_heads, GM = the entry's heads per block, D = its head_dim
// (the layout's head_dim must equal D). q: [batch, q_heads, head_dim] (cache
// dtype); indptr: int32 [batch + 1]; indices: int32 [nnz]; last_page_len:
// int32 [batch]. generations: uint32 [nnz], the generation the table expects of each
// page, and page_gen: uint32 [pages of the layer], the generation each page was
// written under (both null: not checked). Non-split (part_* null, num_splits 1): out float32
// [batch, q_heads, head_dim], lse float32 [batch, q_heads] (natural log).
// Split: part_out float32 [splits, batch, q_heads, head_dim], part_lse
// [splits, batch, q_heads], part_flag int32 [splits, batch]; then kv_decode_merge.
#define KV_DECODE_ENTRY(NAME, T, GM, D)                                                       \
  extern "C" __global__ void __launch_bounds__(KV_DEC_THREADS,                                \
                                               KvDecGeom<T, GM, D>::MIN_BLOCKS) NAME(          \
      const T* q, const T* cache, long long page_stride, long long page_size,                 \
      long long kv_heads, long long head_dim, long long scale, long long offset,              \
      long long base, long long upper_bound, long long pool_pages, const int* indptr,         \
      const int* indices,                                                                     \
      const int* last_page_len, long long nnz, long long batch, long long q_heads,            \
      long long window, float sm_scale, long long pages_per_split, long long policy,          \
      const unsigned* generations, const unsigned* page_gen,                                  \
      float* out, float* lse, float* part_out, float* part_lse, int* part_flag,               \
      unsigned long long* rec) {                                                              \
    const KvLayout L{page_stride, page_size, kv_heads, head_dim, scale, offset, base,         \
                     upper_bound, pool_pages};                                                \
    const KvDecodeArgs A{indptr, indices, last_page_len, nnz, batch, q_heads,                 \
                         window, pages_per_split, policy, sm_scale, generations, page_gen};   \
    kv_decode_block<T, GM, D>(q, cache, L, A, out, lse, part_out, part_lse, part_flag, rec);  \
  }                                                                                           \
  KV_REGISTER(NAME)

// Entries kv_decode_<dtype>_g<GM>_d<D>: GM in {1, 4, 8} q heads per block
// (GM <= 4 at head_dim 512: q and output registers; a group of 2 or 3 runs on
// GM = 4 with idle heads, which costs arithmetic, not bytes), D in {32, ..., 512}.
#define KV_DECODE_DIMS(SUFFIX, T, GM)                            \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g##GM##_d32, T, GM, 32)   \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g##GM##_d64, T, GM, 64)   \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g##GM##_d128, T, GM, 128) \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g##GM##_d256, T, GM, 256)
#define KV_DECODE_ENTRIES(SUFFIX, T)                       \
  KV_DECODE_DIMS(SUFFIX, T, 1)                             \
  KV_DECODE_DIMS(SUFFIX, T, 4)                             \
  KV_DECODE_DIMS(SUFFIX, T, 8)                             \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g1_d512, T, 1, 512) \
  KV_DECODE_ENTRY(kv_decode_##SUFFIX##_g4_d512, T, 4, 512)
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
