// widen.cu -- a cache-dtype array to float32 through the SAME element loads the
// attention kernels use (KvElem<T>::load for 16-byte vectors, ::one for the
// tail), so a test can check those conversions bit for bit, and a caller can read
// a page back as float32.
#include "paged.cuh"

template <typename T>
__device__ __forceinline__ void kv_widen_body(const T* in, float* out, long long n) {
  constexpr int VEC = KvElem<T>::VEC;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long nvec = n / VEC;
  for (long long i = first; i < nvec; i += stride) {
    float f[VEC];
    KvElem<T>::load(in + i * VEC, f);
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[i * VEC + v] = f[v];
  }
  for (long long i = nvec * VEC + first; i < n; i += stride) out[i] = KvElem<T>::one(in + i);
}

// grid-stride, any grid/block. in: [n] of the cache dtype, 16-byte aligned;
// out: float32 [n].
extern "C" __global__ void kv_widen_f16(const kv_half* in, float* out, long long n) {
  kv_widen_body<kv_half>(in, out, n);
}
KV_REGISTER(kv_widen_f16)

extern "C" __global__ void kv_widen_bf16(const kv_bf16* in, float* out, long long n) {
  kv_widen_body<kv_bf16>(in, out, n);
}
KV_REGISTER(kv_widen_bf16)
