// kv_emu.h -- host emulation of the small CUDA subset used by kvservice/worker/kernels/*.cu.
//
// Lets g++ compile the SAME .cu sources into a shared library for CPU tests
// (optionally under AddressSanitizer/UBSan). Model:
//   * one 1-D block at a time, run as an OpenMP team of blockDim.x threads;
//   * the launch state (gridDim, blockDim, blockIdx, shuffle scratch) is per
//     call: a KvEmuLaunch on the launching thread's stack, reached by every
//     team thread through a thread_local pointer (threadIdx is thread_local);
//   * __syncthreads() is an OpenMP barrier;
//   * __shared__ is a function-local static (blocks run one after another), so
//     launches are serialised by one process-wide mutex: two calls from two
//     threads run one after the other, never interleaved;
//   * warp shuffles go through a per-block scratch array between two barriers,
//     so every thread of the block must reach every shuffle (the kernels keep
//     control flow block-uniform around shuffles and barriers);
//   * atomics are GCC __atomic builtins; half -> float in software.
// Kernels are registered by name with a type signature and launched through
// kv_emu_launch(name, grid, block, void** args), like cuLaunchKernel.
#pragma once
#ifndef KV_HOST_EMU
#error "kv_emu.h is only for the host-emulation build (-DKV_HOST_EMU)"
#endif

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

// Per-launch state; kv_emu_cur points at the launch a team thread is running.
struct KvEmuLaunch {
  dim3 grid, block, idx;
  unsigned long long shfl[1024];  // warp-shuffle scratch, one word per thread
};
inline thread_local KvEmuLaunch* kv_emu_cur = nullptr;
inline thread_local dim3 threadIdx;
#define gridDim (kv_emu_cur->grid)
#define blockDim (kv_emu_cur->block)
#define blockIdx (kv_emu_cur->idx)

inline void __syncthreads() { _Pragma("omp barrier") }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }

// IEEE half bits -> float (the device build uses cvt.f32.f16).
inline float kv_f16_to_f32(unsigned short h) {
  const unsigned sign = (unsigned)(h >> 15) << 31;
  const unsigned exp = (h >> 10) & 0x1f;
  unsigned mant = h & 0x3ff;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return __uint_as_float(sign);
    int e = -1;  // subnormal: normalise
    do { ++e; mant <<= 1; } while ((mant & 0x400) == 0);
    return __uint_as_float(sign | ((unsigned)(112 - e) << 23) | ((mant & 0x3ff) << 13));
  }
  return __uint_as_float(sign | ((exp + 112) << 23) | (mant << 13));
}

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }

// Warp shuffle through scratch memory; every thread of the block must call it.
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  const unsigned tid = threadIdx.x;
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  kv_emu_cur->shfl[tid] = bits;
  __syncthreads();
  const unsigned w = (unsigned)width;
  const unsigned src = (tid & ~(w - 1)) | ((tid & (w - 1)) ^ (unsigned)lane_mask);
  bits = kv_emu_cur->shfl[src < blockDim.x ? src : tid];
  __syncthreads();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// ---- kernel registry and launcher -------------------------------------------
template <typename T> struct KvEmuSig;
template <typename T> struct KvEmuSig<T*> { static constexpr char c = 'p'; };
template <> struct KvEmuSig<long long> { static constexpr char c = 'q'; };
template <> struct KvEmuSig<int> { static constexpr char c = 'i'; };
template <> struct KvEmuSig<float> { static constexpr char c = 'f'; };

using KvEmuFn = void (*)();
using KvEmuThunk = void (*)(KvEmuFn, void**);
struct KvEmuKernel {
  KvEmuFn fn;
  KvEmuThunk thunk;
  const char* sig;
};

inline std::map<std::string, KvEmuKernel>& kv_emu_registry() {
  static std::map<std::string, KvEmuKernel> reg;
  return reg;
}

template <typename... A, std::size_t... I>
inline void kv_emu_invoke(void (*fn)(A...), void** args, std::index_sequence<I...>) {
  fn(*static_cast<A*>(args[I])...);
}
template <typename... A>
inline void kv_emu_thunk(KvEmuFn fn, void** args) {
  kv_emu_invoke(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
}
template <typename... A>
inline bool kv_emu_register(const char* name, void (*fn)(A...)) {
  static const char sig[] = {KvEmuSig<A>::c..., '\0'};
  kv_emu_registry()[name] = KvEmuKernel{reinterpret_cast<KvEmuFn>(fn), &kv_emu_thunk<A...>, sig};
  return true;
}

#define KV_REGISTER(fn) static const bool kv_emu_registered_##fn = kv_emu_register(#fn, &fn);

extern "C" __attribute__((weak, visibility("default"))) const char* kv_emu_signature(const char* name) {
  auto it = kv_emu_registry().find(name);
  return it == kv_emu_registry().end() ? nullptr : it->second.sig;
}

// Returns 0 on success, -1 unknown kernel, -2 bad launch shape, -3 short team.
extern "C" __attribute__((weak, visibility("default"))) int kv_emu_launch(const char* name, unsigned gx, unsigned gy,
                                                   unsigned gz, unsigned bx, void** args) {
  auto it = kv_emu_registry().find(name);
  if (it == kv_emu_registry().end()) return -1;
  if (bx == 0 || bx > 1024 || bx % 32 != 0 || gx == 0 || gy == 0 || gz == 0) return -2;
  const KvEmuKernel k = it->second;
  static std::mutex serial;  // __shared__ statics: one launch at a time per library
  const std::lock_guard<std::mutex> hold(serial);
  omp_set_dynamic(0);
  KvEmuLaunch launch{};
  launch.grid = dim3{gx, gy, gz};
  launch.block = dim3{bx, 1, 1};
  int short_team = 0;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        launch.idx = dim3{x, y, z};
#pragma omp parallel num_threads(bx) shared(launch, short_team)
        {
          if (omp_get_num_threads() != (int)bx) {
#pragma omp atomic write
            short_team = 1;
          } else {
            kv_emu_cur = &launch;
            threadIdx = dim3{(unsigned)omp_get_thread_num(), 0, 0};
            k.thunk(k.fn, args);
            kv_emu_cur = nullptr;
          }
        }
        if (short_team) return -3;
      }
  return 0;
}

// ==== cp.async shim (issue #15) ================================================
// Additions only. Each emulated thread queues its 16-byte copies; a commit
// closes a group and kv_cp_async_wait<N>() performs the oldest groups until at
// most N remain, as the device would have completed them. Reading a stage
// before waiting for it therefore sees stale data here as on the GPU, and
// ASan checks every source read when it happens.
#include <deque>
#include <vector>

struct KvEmuCopy {
  void* dst;
  const void* src;
};
struct KvEmuCpAsync {
  std::vector<KvEmuCopy> open;
  std::deque<std::vector<KvEmuCopy>> groups;
  void run_oldest() {
    for (const KvEmuCopy& c : groups.front()) std::memcpy(c.dst, c.src, 16);
    groups.pop_front();
  }
};
inline thread_local KvEmuCpAsync kv_emu_cp_async;

inline void kv_cp_async16(void* smem, const void* gmem) { kv_emu_cp_async.open.push_back({smem, gmem}); }
inline void kv_cp_async_commit() {
  kv_emu_cp_async.groups.push_back(std::move(kv_emu_cp_async.open));
  kv_emu_cp_async.open.clear();
}
template <int N>
inline void kv_cp_async_wait() {
  while (kv_emu_cp_async.groups.size() > (std::size_t)N) kv_emu_cp_async.run_oldest();
}
inline void kv_cp_async_wait_all() {
  kv_cp_async_commit();
  kv_cp_async_wait<0>();
}

// ==== lane-group all-reduce (issue #15) =========================================
// kv_group_allreduce<LG, N> of paged.cuh: one exchange through scratch memory
// between two barriers (instead of two barriers per shuffle), then the device's
// xor butterfly on the exchanged values, so every lane gets the bit-identical
// sum the device computes (lane i adds lane i ^ m, m = LG/2 .. 1).
inline float kv_emu_group_buf[1024 * 64];
template <int LG, int N>
inline void kv_group_allreduce(float (&v)[N]) {
  static_assert(N <= 64 && LG >= 1 && LG <= 32 && (LG & (LG - 1)) == 0, "LG lanes, N <= 64 values");
  const unsigned tid = threadIdx.x, base = tid & ~(unsigned)(LG - 1);
  std::memcpy(&kv_emu_group_buf[tid * 64], v, sizeof(v));
  __syncthreads();
  float w[LG][N], t[LG][N];
  for (int i = 0; i < LG; ++i) std::memcpy(w[i], &kv_emu_group_buf[(base + i) * 64], sizeof(v));
  for (int m = LG / 2; m > 0; m >>= 1) {
    for (int i = 0; i < LG; ++i)
      for (int k = 0; k < N; ++k) t[i][k] = w[i][k] + w[i ^ m][k];
    std::memcpy(w, t, sizeof(w));
  }
  std::memcpy(v, w[tid - base], sizeof(v));
  __syncthreads();
}
