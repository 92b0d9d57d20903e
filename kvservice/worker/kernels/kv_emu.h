// kv_emu.h -- host emulation of the small CUDA subset used by kvservice/worker/kernels/*.cu.
//
// Lets g++ compile the SAME .cu sources into a shared library for CPU tests
// (optionally under AddressSanitizer/UBSan). Model:
//   * each 1-D block runs as an OpenMP team of blockDim.x threads; blocks run one
//     after another, or several at once (KV_EMU_BLOCKS_AT_ONCE: nested teams, in
//     reverse block order, so a kernel that depends on block order or on another
//     block's memory shows it);
//   * the block state (gridDim, blockDim, blockIdx, shuffle scratch, shared
//     memory) is a KvEmuBlock per running block, reached by every team thread
//     through a thread_local pointer (threadIdx is thread_local);
//   * __syncthreads() is an OpenMP barrier; the emulation's own exchanges use
//     kv_emu_sync(), which is not a __syncthreads() for the race checker;
//   * shared memory is declared with KV_SHARED(type, name, dims): a slot in the
//     running block's arena (each variable gets a process-wide offset on first
//     use); launches are serialised by one process-wide mutex, so two calls from
//     two threads run one after the other, never interleaved;
//   * cp.async (see the shim below): 16-byte alignment of both sides is checked
//     on every copy (a fault, as on the device); copies land at the wait
//     (default) or, in the strict mode, at issue with a shadow of every ring
//     piece that reports a read before the copy's wait, a read of another
//     thread's copy with no barrier after its wait, and a copy into a piece
//     another thread read since the last barrier (a missing end-of-tile
//     barrier), as compute-sanitizer's racecheck would;
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

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
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

template <int LG, int N>
struct KvReduce;  // paged.cuh: the lane-group reduction schedule

// Per-block state; kv_emu_cur points at the block a team thread is running.
struct KvEmuShadow;  // strict mode: cp.async targets of the block (defined with the shim)
struct KvEmuBlock {
  dim3 grid, block, idx;
  unsigned long long shfl[1024];  // warp-shuffle scratch, one word per thread
  float group[1024 * 64];         // kv_group_allreduce exchange, 64 values per thread
  unsigned char* arena = nullptr; // this block's shared memory (KV_SHARED)
  int strict = 0;                 // 1: eager cp.async with the race checker
  KvEmuShadow* shadow = nullptr;
  int* fault = nullptr;           // the launch's first fault code (0 none)
  char* fault_msg = nullptr;      // and its description
  int stop = 0;                   // the launch stops before this block (kv_emu_launch_until)
};
inline thread_local KvEmuBlock* kv_emu_cur = nullptr;
inline thread_local dim3 threadIdx;
inline thread_local long long kv_emu_epoch = 0;  // __syncthreads() this thread has passed in its block
#define gridDim (kv_emu_cur->grid)
#define blockDim (kv_emu_cur->block)
#define blockIdx (kv_emu_cur->idx)

// First fault of a launch wins; the block goes on (its threads must still reach every barrier).
inline std::mutex& kv_emu_fault_lock() {
  static std::mutex m;
  return m;
}
inline void kv_emu_fault(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
inline void kv_emu_fault(int code, const char* fmt, ...) {
  const std::lock_guard<std::mutex> hold(kv_emu_fault_lock());
  if (*kv_emu_cur->fault != 0) return;
  *kv_emu_cur->fault = code;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(kv_emu_cur->fault_msg, 512, fmt, ap);
  va_end(ap);
}

// ---- shared memory: KV_SHARED(type, name, dims) -----------------------------------------------
constexpr std::size_t KV_EMU_ARENA = 8u << 20;  // bytes of shared memory per running block (all variables)
inline std::size_t kv_emu_shared_alloc(std::size_t size) {
  static std::atomic<std::size_t> top{0};
  const std::size_t off = top.fetch_add((size + 15) & ~std::size_t(15));
  if (off + size > KV_EMU_ARENA) {
    std::fprintf(stderr, "kv_emu: shared-memory arena of %zu bytes exhausted\n", KV_EMU_ARENA);
    std::abort();
  }
  return off;
}
template <typename Tag, typename V>
inline V& kv_emu_shared() {
  static const std::size_t off = kv_emu_shared_alloc(sizeof(V));
  return *reinterpret_cast<V*>(kv_emu_cur->arena + off);
}
template <typename V>
using KvEmuRef = V&;
#define KV_SHARED(type, name, dims) \
  struct KvEmuTag_##name {};         \
  KvEmuRef<type dims> name = kv_emu_shared<KvEmuTag_##name, type dims>()

// A barrier of one block when several blocks share one OpenMP team (blocks at once).
struct KvEmuBarrier {
  std::mutex m;
  std::condition_variable cv;
  unsigned n = 0, count = 0;
  unsigned long long gen = 0;
  void wait() {
    std::unique_lock<std::mutex> lk(m);
    const unsigned long long g = gen;
    if (++count == n) {
      count = 0;
      ++gen;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return gen != g; });
    }
  }
};
inline thread_local KvEmuBarrier* kv_emu_barrier = nullptr;  // null: the block is the whole team

inline void kv_emu_sync() {  // the emulation's own exchanges
  if (kv_emu_barrier) {
    kv_emu_barrier->wait();
  } else {
    _Pragma("omp barrier")
  }
}
inline void __syncthreads() {
  kv_emu_sync();
  ++kv_emu_epoch;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }

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
  kv_emu_sync();
  const unsigned w = (unsigned)width;
  const unsigned src = (tid & ~(w - 1)) | ((tid & (w - 1)) ^ (unsigned)lane_mask);
  bits = kv_emu_cur->shfl[src < blockDim.x ? src : tid];
  kv_emu_sync();
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

// ==== cp.async shim ===========================================================================
// Each emulated thread queues its 16-byte copies; a commit closes a group and
// kv_cp_async_wait<N>() completes the oldest groups until at most N remain. Default mode: a copy
// lands at that wait (a stage read before its wait sees stale data, as on the GPU). Strict mode
// (KvEmuBlock::strict): a copy lands at issue and the shadow below checks the ordering instead,
// whatever the threads' interleaving: it does not depend on luck. Every copy checks the 16-byte
// alignment of both addresses (misaligned cp.async is a fault on the device). full = false:
// zero-fill (cp.async with src-size 0 reads nothing). ASan checks every source read.
#include <deque>
#include <unordered_map>
#include <vector>

typedef char* KvSmem;  // the device uses 32-bit shared-window addresses; the emulation a pointer
inline KvSmem kv_smem(const void* p) { return const_cast<char*>(static_cast<const char*>(p)); }

struct KvEmuPiece {
  int writer = -1;            // thread whose cp.async last targeted the piece
  bool pending = false;       // that copy's group is not waited for yet
  long long landed = -1;      // the writer's epoch at its wait
  long long read_epoch = -1;  // epoch of the last read, and by whom (-2: several threads)
  int reader = -1;
};
struct KvEmuShadow {
  std::mutex lock;
  std::unordered_map<const char*, KvEmuPiece> pieces;
};

struct KvEmuCopy {
  char* dst;
  const void* src;
  bool full;
};
struct KvEmuCpAsync {
  std::vector<KvEmuCopy> open;
  std::deque<std::vector<KvEmuCopy>> groups;
};
inline thread_local KvEmuCpAsync kv_emu_cp_async;

inline void kv_emu_land(const KvEmuCopy& c) {
  if (c.full)
    std::memcpy(c.dst, c.src, 16);
  else
    std::memset(c.dst, 0, 16);
}

inline void kv_cp_async16(KvSmem smem, const void* gmem, bool full) {
  const int tid = (int)threadIdx.x;
  if (((reinterpret_cast<std::uintptr_t>(smem) | reinterpret_cast<std::uintptr_t>(gmem)) & 15u) != 0) {
    kv_emu_fault(-4, "misaligned cp.async (16 bytes need 16-byte aligned addresses): shared %p, global %p, "
                 "thread %d of block (%u, %u, %u)", (void*)smem, gmem, tid, blockIdx.x, blockIdx.y, blockIdx.z);
    return;
  }
  const KvEmuCopy c{smem, gmem, full};
  if (kv_emu_cur->strict) {
    KvEmuShadow& sh = *kv_emu_cur->shadow;
    {
      const std::lock_guard<std::mutex> hold(sh.lock);
      KvEmuPiece& p = sh.pieces[smem];
      if (p.pending && p.writer != tid)
        kv_emu_fault(-5, "shared-memory race: cp.async of thread %d into %p while thread %d's copy there is "
                     "still in flight (block (%u, %u, %u))", tid, (void*)smem, p.writer, blockIdx.x, blockIdx.y,
                     blockIdx.z);
      else if (p.read_epoch == kv_emu_epoch && p.reader != tid)
        kv_emu_fault(-5, "shared-memory race: cp.async of thread %d overwrites %p, which thread %d read with no "
                     "__syncthreads() in between (block (%u, %u, %u))", tid, (void*)smem, p.reader, blockIdx.x,
                     blockIdx.y, blockIdx.z);
      p.writer = tid;
      p.pending = true;
    }
    kv_emu_land(c);  // eager: the bytes are there at issue, the shadow keeps the ordering honest
  }
  kv_emu_cp_async.open.push_back(c);
}
inline void kv_cp_async_commit() {
  kv_emu_cp_async.groups.push_back(std::move(kv_emu_cp_async.open));
  kv_emu_cp_async.open.clear();
}
template <int N>
inline void kv_cp_async_wait() {
  while (kv_emu_cp_async.groups.size() > (std::size_t)N) {
    for (const KvEmuCopy& c : kv_emu_cp_async.groups.front()) {
      if (!kv_emu_cur->strict) {
        kv_emu_land(c);
        continue;
      }
      KvEmuShadow& sh = *kv_emu_cur->shadow;
      const std::lock_guard<std::mutex> hold(sh.lock);
      KvEmuPiece& p = sh.pieces[c.dst];
      if (p.writer == (int)threadIdx.x) {
        p.pending = false;
        p.landed = kv_emu_epoch;
      }
    }
    kv_emu_cp_async.groups.pop_front();
  }
}
inline void kv_cp_async_wait_all() {
  kv_cp_async_commit();
  kv_cp_async_wait<0>();
}

// Strict mode: a 16-byte shared-memory read of a cp.async target (KvElem<T>::load).
inline void kv_emu_shared_read(const void* p) {
  if (kv_emu_cur == nullptr || !kv_emu_cur->strict) return;
  const char* a = static_cast<const char*>(p);
  const int tid = (int)threadIdx.x;
  KvEmuShadow& sh = *kv_emu_cur->shadow;
  const std::lock_guard<std::mutex> hold(sh.lock);
  auto it = sh.pieces.find(a);
  if (it == sh.pieces.end()) return;  // not a cp.async target
  KvEmuPiece& pc = it->second;
  if (pc.pending)
    kv_emu_fault(-5, "shared-memory race: thread %d reads %p before thread %d's cp.async there was waited for "
                 "(block (%u, %u, %u))", tid, p, pc.writer, blockIdx.x, blockIdx.y, blockIdx.z);
  else if (pc.writer != tid && pc.landed == kv_emu_epoch)
    kv_emu_fault(-5, "shared-memory race: thread %d reads %p, which thread %d's cp.async filled, with no "
                 "__syncthreads() after that thread's wait (block (%u, %u, %u))", tid, p, pc.writer, blockIdx.x,
                 blockIdx.y, blockIdx.z);
  if (pc.read_epoch == kv_emu_epoch && pc.reader != tid)
    pc.reader = -2;
  else if (pc.read_epoch != kv_emu_epoch)
    pc.reader = tid;
  pc.read_epoch = kv_emu_epoch;
}

inline float kv_ex2(float x) {  // the device's ex2.approx.ftz.f32: subnormal results flushed to 0
  const float y = std::exp2(x);
  return std::fabs(y) < 1.17549435e-38f ? 0.f : y;
}

// ==== lane-group all-reduce =====================================================================
// kv_group_allreduce<LG, N> of paged.cuh: one exchange through scratch memory between two internal
// barriers, then the device's schedule (KvReduce: butterfly, or reduce-scatter + gather) run on the
// exchanged values, so every lane gets the bit-identical sums the device computes.
template <int LG, int N>
inline void kv_group_allreduce(float (&v)[N]) {
  static_assert(N <= 64 && LG >= 1 && LG <= 32 && (LG & (LG - 1)) == 0, "LG lanes, N <= 64 values");
  using R = KvReduce<LG, N>;
  const unsigned tid = threadIdx.x, base = tid & ~(unsigned)(LG - 1);
  float* const buf = kv_emu_cur->group;
  std::memcpy(&buf[tid * 64], v, sizeof(v));
  kv_emu_sync();
  float w[LG][N], t[LG][N];
  for (int i = 0; i < LG; ++i) std::memcpy(w[i], &buf[(base + i) * 64], sizeof(v));
  if (!R::USE_SCATTER) {
    for (int m = LG / 2; m > 0; m >>= 1) {
      for (int i = 0; i < LG; ++i)
        for (int k = 0; k < N; ++k) t[i][k] = w[i][k] + w[i ^ m][k];
      std::memcpy(w, t, sizeof(w));
    }
    std::memcpy(v, w[tid - base], sizeof(v));
  } else {
    int cnt = N;
    for (int m = LG / 2; m > 0; m >>= 1) {
      if (cnt > 1) {
        const int half = cnt / 2;
        float send[LG][N];
        for (int i = 0; i < LG; ++i)
          for (int j = 0; j < half; ++j) send[i][j] = (i & m) ? w[i][j] : w[i][j + half];
        for (int i = 0; i < LG; ++i)
          for (int j = 0; j < half; ++j) t[i][j] = ((i & m) ? w[i][j + half] : w[i][j]) + send[i ^ m][j];
        for (int i = 0; i < LG; ++i)
          for (int j = 0; j < half; ++j) w[i][j] = t[i][j];
        cnt = half;
      } else {
        for (int i = 0; i < LG; ++i) t[i][0] = w[i][0] + w[i ^ m][0];
        for (int i = 0; i < LG; ++i) w[i][0] = t[i][0];
      }
    }
    for (int i = 0; i < N; ++i) v[i] = w[R::src(i)][R::slot(i)];
  }
  kv_emu_sync();
}

// ==== launcher ==================================================================================
// kv_emu_launch_mode(name, grid, block, args, strict, blocks_at_once): 0 on success, -1 unknown
// kernel, -2 bad launch shape, -3 short team, -4 misaligned cp.async, -5 shared-memory race
// (strict); kv_emu_last_fault() describes the last -4/-5. blocks_at_once > 1 runs that many blocks
// concurrently, in reverse order.
// kv_emu_launch_until(..., deadline_ns, cancel): the same, but no block starts once CLOCK_MONOTONIC
// reaches deadline_ns (0 = no deadline) or *cancel is nonzero (null = never): -6, the blocks run
// before that done (kvservice/worker/cancel.py). A launch that waits for the library's lock past
// its deadline runs no block.
inline char kv_emu_fault_text[512];

extern "C" __attribute__((weak, visibility("default"))) const char* kv_emu_last_fault() { return kv_emu_fault_text; }

inline bool kv_emu_expired(long long deadline_ns, const volatile int* cancel) {
  if (cancel != nullptr && *cancel != 0) return true;
  if (deadline_ns <= 0) return false;
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (long long)now.tv_sec * 1000000000LL + now.tv_nsec >= deadline_ns;
}

extern "C" __attribute__((weak, visibility("default"))) int kv_emu_launch_until(
    const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** args, int strict,
    int blocks_at_once, long long deadline_ns, const volatile int* cancel) {
  auto it = kv_emu_registry().find(name);
  if (it == kv_emu_registry().end()) return -1;
  if (bx == 0 || bx > 1024 || bx % 32 != 0 || gx == 0 || gy == 0 || gz == 0) return -2;
  const KvEmuKernel k = it->second;
  static std::mutex serial;  // one launch at a time per library
  const std::lock_guard<std::mutex> hold(serial);
  omp_set_dynamic(0);
  const int slots = blocks_at_once > 1 ? blocks_at_once : 1;
  static std::vector<KvEmuBlock*> pool;  // block slots, reused across launches (shared memory is not cleared)
  while ((int)pool.size() < slots) {
    KvEmuBlock* b = new KvEmuBlock();
    b->arena = static_cast<unsigned char*>(std::calloc(KV_EMU_ARENA, 1));
    pool.push_back(b);
  }
  int fault = 0, short_team = 0, stopped = 0;
  kv_emu_fault_text[0] = '\0';
  const long long total = (long long)gx * gy * gz;
  std::vector<KvEmuShadow> shadows(slots);
  std::vector<KvEmuBarrier> bars(slots);
  for (int k = 0; k < slots; ++k) {
    KvEmuBlock* b = pool[k];
    b->grid = dim3{gx, gy, gz};
    b->block = dim3{bx, 1, 1};
    b->strict = strict;
    b->fault = &fault;
    b->fault_msg = kv_emu_fault_text;
    b->shadow = &shadows[k];
    bars[k].n = bx;
  }
  // One OpenMP team of slots x bx threads; thread i runs lane i % bx of slot i / bx, whose blocks
  // are total-1-slot, total-1-slot-slots, ... (reverse order). With one slot the block barrier is
  // the team's omp barrier; with several, each slot has its own.
#pragma omp parallel num_threads(slots * bx)
  {
    if (omp_get_num_threads() != slots * (int)bx) {
#pragma omp atomic write
      short_team = 1;
    } else {
      const int slot = omp_get_thread_num() / (int)bx;
      KvEmuBlock* const b = pool[slot];
      kv_emu_barrier = slots > 1 ? &bars[slot] : nullptr;
      threadIdx = dim3{(unsigned)(omp_get_thread_num() % (int)bx), 0, 0};
      kv_emu_cur = b;
      for (long long n = slots > 1 ? total - 1 - slot : 0; slots > 1 ? n >= 0 : n < total;
           n += slots > 1 ? -slots : 1) {
        kv_emu_sync();  // everyone is done with the previous block of this slot
        if (threadIdx.x == 0) {
          b->idx = dim3{(unsigned)(n % gx), (unsigned)(n / gx % gy), (unsigned)(n / gx / gy)};
          b->shadow->pieces.clear();
          b->stop = kv_emu_expired(deadline_ns, cancel) ? 1 : 0;
        }
        kv_emu_sync();
        if (b->stop) {  // every thread of the block read it after the barrier: they all leave together
#pragma omp atomic write
          stopped = 1;
          break;
        }
        kv_emu_epoch = 0;
        k.thunk(k.fn, args);
        kv_emu_cp_async = KvEmuCpAsync{};  // a kernel that left copies pending: drop them
      }
      kv_emu_cur = nullptr;
      kv_emu_barrier = nullptr;
    }
  }
  for (int k = 0; k < slots; ++k) pool[k]->shadow = nullptr;
  if (short_team) return -3;
  if (fault == 0 && stopped) return -6;
  return fault;
}

extern "C" __attribute__((weak, visibility("default"))) int kv_emu_launch_mode(
    const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** args, int strict,
    int blocks_at_once) {
  return kv_emu_launch_until(name, gx, gy, gz, bx, args, strict, blocks_at_once, 0, nullptr);
}

extern "C" __attribute__((weak, visibility("default"))) int kv_emu_launch(const char* name, unsigned gx, unsigned gy,
                                                   unsigned gz, unsigned bx, void** args) {
  return kv_emu_launch_mode(name, gx, gy, gz, bx, args, 0, 1);
}
