// guard.cu -- canary zones around a cache buffer: fill and check.
// Layout of a guarded buffer of total_bytes: [guard | payload | guard], each
// guard guard_bytes long; byte i of either guard zone holds kv_guard_byte(i).
#include "paged.cuh"

__device__ __forceinline__ unsigned char kv_guard_byte(long long i) {
  return (unsigned char)(0xA5u ^ (unsigned)((i * 29) & 0xff));
}

// Offset (from the buffer start) of byte k of the two zones, k in [0, 2G).
__device__ __forceinline__ long long kv_guard_pos(long long k, long long total, long long g) {
  return k < g ? k : total - 2 * g + k;
}

// grid-stride over the 2 * guard_bytes canary bytes.
extern "C" __global__ void kv_guard_fill(unsigned char* buf, long long total_bytes,
                                         long long guard_bytes) {
  const long long n = 2 * guard_bytes;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
       k += (long long)gridDim.x * blockDim.x)
    buf[kv_guard_pos(k, total_bytes, guard_bytes)] = kv_guard_byte(k % guard_bytes);
}
KV_REGISTER(kv_guard_fill)

// result: uint64 [2] = (corrupted byte count, first corrupted offset from the
// buffer start or ~0). The host zeroes [0] and sets [1] = ~0 before the call.
extern "C" __global__ void kv_guard_check(const unsigned char* buf, long long total_bytes,
                                          long long guard_bytes, unsigned long long* result) {
  const long long n = 2 * guard_bytes;
  unsigned long long bad = 0, first = KV_NO_KEY;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
       k += (long long)gridDim.x * blockDim.x) {
    const long long p = kv_guard_pos(k, total_bytes, guard_bytes);
    if (buf[p] != kv_guard_byte(k % guard_bytes)) {
      ++bad;
      if ((unsigned long long)p < first) first = (unsigned long long)p;
    }
  }
  if (bad) {
    atomicAdd(&result[0], bad);
    atomicMin(&result[1], first);
  }
}
KV_REGISTER(kv_guard_check)
