// validate_page_table.cu -- device-side check of a CSR page table that comes
// from elsewhere, with the same rules and the same record as the attention
// kernels (a window-less decode over this table notes exactly the same).
#include "paged.cuh"

// grid = (batch), block = 128. indptr int32 [batch + 1], indices int32 [nnz],
// last_page_len int32 [batch]. generations uint32 [nnz] (the table's) and page_gen
// uint32 [pages of the layer] (the worker's record), both null = generations not
// checked. row_status int32 [batch]: bit (reason - 1) set for every reason seen in
// the row, 0 = clean (written for every row).
extern "C" __global__ void kv_validate_page_table(const int* indptr, const int* indices,
                                                  const int* last_page_len, long long batch,
                                                  long long nnz, long long page_size,
                                                  long long scale, long long offset,
                                                  long long base, long long upper_bound,
                                                  long long pool_pages, const unsigned* generations,
                                                  const unsigned* page_gen, int* row_status,
                                                  unsigned long long* rec) {
  const KvLayout L{0, page_size, 1, 1, scale, offset, base, upper_bound, pool_pages};
  KV_SHARED(int, s_mask, );
  const long long row = blockIdx.x;
  const long long tid = threadIdx.x;
  long long value;
  const int rreason = kv_csr_row_reason(indptr, last_page_len, nnz, batch, page_size, row, &value);
  if (tid == 0) {
    s_mask = rreason != KV_OK ? 1 << (rreason - 1) : 0;
    if (rreason != KV_OK) kv_note(rec, row, -1);
  }
  __syncthreads();
  if (row < batch && rreason != KV_BAD_INDPTR) {
    const long long a = indptr[row], b = indptr[row + 1];
    for (long long pos = a + tid; pos < b; pos += blockDim.x) {
      const int r = kv_entry_reason(L, indices, generations, page_gen, pos);
      if (r != KV_OK) {
        atomicOr(&s_mask, 1 << (r - 1));
        kv_note(rec, row, pos);
      }
    }
  }
  __syncthreads();
  if (tid == 0) row_status[row] = s_mask;
  if (kv_last_block(rec) && tid == 0) kv_csr_finish(rec, L, indptr, indices, last_page_len, nnz, batch);
}
KV_REGISTER(kv_validate_page_table)
