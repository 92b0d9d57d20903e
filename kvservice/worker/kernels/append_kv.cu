// append_kv.cu -- write new K/V tokens into paged caches through slot_mapping.
#include "paged.cuh"

#define KV_SKIP_SLOT (-1ll)

// Reason for slot value s (page = s / page_size must be a valid page).
__device__ __forceinline__ int kv_slot_reason(const KvLayout& L, long long s) {
#ifndef KV_NO_BOUNDS_CHECK
  if (s < 0) return KV_OUT_OF_BOUNDS;
#endif
  return kv_page_reason(L, s / L.page_size);
}

// grid.x = n_tokens, block = any multiple of 32 (128 used).
// k, v: [n_tokens, kv_heads, head_dim] contiguous, same dtype as the cache
// (elt_bytes bytes each). v == nullptr: a K-only layer (a multi-head latent attention
// latent cache, pages of [1, page_size, kv_heads, head_dim]): only k is written. slot_mapping: int64 [n_tokens], value =
// page * page_size + offset, pairwise distinct (the wrapper refuses duplicates:
// their order of writes is undefined), or KV_SKIP_SLOT (-1): a token this layer does
// not hold (a prefix hit's tokens before a sliding window), written nowhere and not a
// violation (vLLM's padding slot). An offending token is never written; each one is
// noted once (row = position = token index).
extern "C" __global__ void kv_append(const char* k, const char* v, const long long* slot_mapping,
                                     long long n_tokens, char* cache, long long elt_bytes,
                                     long long page_stride, long long page_size, long long kv_heads,
                                     long long head_dim, long long scale, long long offset,
                                     long long base, long long upper_bound, long long pool_pages,
                                     unsigned long long* rec) {
  const KvLayout L{page_stride, page_size, kv_heads, head_dim, scale, offset, base, upper_bound,
                   pool_pages};
  const long long i = blockIdx.x;
  const long long tid = threadIdx.x;
  if (i < n_tokens) {
    const long long s = slot_mapping[i];
    const int reason = s == KV_SKIP_SLOT ? KV_OK : kv_slot_reason(L, s);
    if (s == KV_SKIP_SLOT) {
      // nothing to write
    } else if (reason == KV_OK) {
      const long long page = s / page_size, tok = s - page * page_size;
      const long long row_bytes = kv_heads * head_dim * elt_bytes;
      char* dk = cache + kv_row_offset(L, page, 0, tok, 0) * elt_bytes;
      kv_copy_bytes(dk, k + i * row_bytes, row_bytes, tid, blockDim.x);
      if (v != nullptr) {
        char* dv = cache + kv_row_offset(L, page, 1, tok, 0) * elt_bytes;
        kv_copy_bytes(dv, v + i * row_bytes, row_bytes, tid, blockDim.x);
      }
    } else if (tid == 0) {
      kv_note(rec, i, i);
    }
  }
#ifndef KV_NO_BOUNDS_CHECK
  if (kv_last_block(rec) && tid == 0) {
    long long row, pos;
    if (kv_first_key(rec, &row, &pos)) {
      const long long s = slot_mapping[row];
      kv_set_first(rec, row, pos, s, kv_slot_reason(L, s));
    }
  }
#endif
}
KV_REGISTER(kv_append)
