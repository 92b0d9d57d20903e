// copy_blocks.cu -- copy whole pages (src -> dst) in every layer of a group,
// e.g. for copy-on-write. Dtype-agnostic (bytes).
#include "paged.cuh"

// grid = (n_pairs, num_layers), block = 128.
// layer_ptrs: uint64 [num_layers] base addresses, all layers sharing one index
// space and page geometry. pairs: int64 [n_pairs, 2] = (src_page, dst_page)
// in that index space; destinations pairwise distinct and never a source (the
// wrapper refuses anything else: the order of the copies is undefined). A pair
// with an offending entry is skipped entirely; each offending entry is noted
// once (row = pair, position = 0 src / 1 dst).
extern "C" __global__ void kv_copy_blocks(const unsigned long long* layer_ptrs,
                                          const long long* pairs, long long n_pairs,
                                          long long page_bytes, long long page_stride_bytes,
                                          long long scale, long long offset, long long base,
                                          long long upper_bound, long long pool_pages,
                                          unsigned long long* rec) {
  // Byte addressing: a "page" of page_stride_bytes elements of one byte.
  const KvLayout L{page_stride_bytes, 1, 1, 1, scale, offset, base, upper_bound, pool_pages};
  const long long i = blockIdx.x, layer = blockIdx.y;
  const long long tid = threadIdx.x;
  if (i < n_pairs) {
    const long long src = pairs[2 * i], dst = pairs[2 * i + 1];
    const int rs = kv_page_reason(L, src), rd = kv_page_reason(L, dst);
    if (rs == KV_OK && rd == KV_OK) {
      char* buf = reinterpret_cast<char*>(layer_ptrs[layer]);
      kv_copy_bytes(buf + kv_row_offset(L, dst, 0, 0, 0), buf + kv_row_offset(L, src, 0, 0, 0),
                    page_bytes, tid, blockDim.x);
    } else if (layer == 0 && tid == 0) {
      if (rs != KV_OK) kv_note(rec, i, 0);
      if (rd != KV_OK) kv_note(rec, i, 1);
    }
  }
#ifndef KV_NO_BOUNDS_CHECK
  if (kv_last_block(rec) && tid == 0) {
    long long row, pos;
    if (kv_first_key(rec, &row, &pos)) {
      const long long value = pairs[2 * row + pos];
      kv_set_first(rec, row, pos, value, kv_page_reason(L, value));
    }
  }
#endif
}
KV_REGISTER(kv_copy_blocks)
