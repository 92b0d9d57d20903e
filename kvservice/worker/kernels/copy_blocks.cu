// copy_blocks.cu -- copy whole pages (src -> dst) in every layer of a group,
// e.g. for copy-on-write. Dtype-agnostic (bytes).
#include "paged.cuh"

// grid = (n_pairs, num_layers), block = 128.
// layer_ptrs: uint64 [num_layers] base addresses, all layers sharing one index
// space and page geometry. pairs: int64 [n_pairs, 2] = (src_page, dst_page)
// in that index space; destinations pairwise distinct and never a source (the
// wrapper refuses anything else: the order of the copies is undefined). A pair
// with an offending entry is skipped entirely; each offending entry is noted
// once (row = pair, position = 0 src / 1 dst). With generations (pair_gens uint32
// [n_pairs, 2], gen_ptrs uint64 [num_layers]: each layer's page_gen array; both
// null = not checked), in each layer a source whose recorded generation is not its
// pair's, or a destination holding a newer one than its pair's, is stale_page
// (noted once per layer it is stale in; the pair is skipped in that layer), and a
// copied destination records its generation.
extern "C" __global__ void kv_copy_blocks(const unsigned long long* layer_ptrs,
                                          const long long* pairs, long long n_pairs,
                                          long long page_bytes, long long page_stride_bytes,
                                          long long scale, long long offset, long long base,
                                          long long upper_bound, long long pool_pages,
                                          const unsigned* pair_gens, const unsigned long long* gen_ptrs,
                                          unsigned long long* rec) {
  // Byte addressing: a "page" of page_stride_bytes elements of one byte.
  const KvLayout L{page_stride_bytes, 1, 1, 1, scale, offset, base, upper_bound, pool_pages};
  const long long i = blockIdx.x, layer = blockIdx.y;
  const long long tid = threadIdx.x;
  if (i < n_pairs) {
    const long long src = pairs[2 * i], dst = pairs[2 * i + 1];
    const int rs = kv_page_reason(L, src), rd = kv_page_reason(L, dst);
    int gs = KV_OK, gd = KV_OK;  // generation reasons (this layer)
    unsigned* page_gen = nullptr;
    if (rs == KV_OK && rd == KV_OK && pair_gens != nullptr) {
      page_gen = reinterpret_cast<unsigned*>(gen_ptrs[layer]);
      gs = kv_gen_reason(L, page_gen, src, pair_gens[2 * i]);
#ifndef KV_NO_BOUNDS_CHECK
      const unsigned want = pair_gens[2 * i + 1], held = page_gen[kv_gen_index(L, dst)];
      if (held != want && !kv_gen_newer(want, held)) gd = KV_STALE_PAGE;
#endif
    }
    __syncthreads();  // every thread has read dst's generation before thread 0 records it
    if (rs == KV_OK && rd == KV_OK && gs == KV_OK && gd == KV_OK) {
      char* buf = reinterpret_cast<char*>(layer_ptrs[layer]);
      kv_copy_bytes(buf + kv_row_offset(L, dst, 0, 0, 0), buf + kv_row_offset(L, src, 0, 0, 0),
                    page_bytes, tid, blockDim.x);
      if (page_gen != nullptr && tid == 0) page_gen[kv_gen_index(L, dst)] = pair_gens[2 * i + 1];
    } else if (tid == 0) {
      if (layer == 0 && rs != KV_OK) kv_note(rec, i, 0);
      if (layer == 0 && rd != KV_OK) kv_note(rec, i, 1);
      if (gs != KV_OK) kv_note(rec, i, 0);
      if (gd != KV_OK) kv_note(rec, i, 1);
    }
  }
#ifndef KV_NO_BOUNDS_CHECK
  if (kv_last_block(rec) && tid == 0) {
    long long row, pos;
    if (kv_first_key(rec, &row, &pos)) {
      const long long value = pairs[2 * row + pos];
      const int reason = kv_page_reason(L, value);  // noted with a valid page: for its generation
      kv_set_first(rec, row, pos, value, reason == KV_OK ? KV_STALE_PAGE : reason);
    }
  }
#endif
}
KV_REGISTER(kv_copy_blocks)
