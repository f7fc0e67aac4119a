// A CUDA execution model on the CPU, for running csrc/mesa_kernels.cu (host code included) in the
// tests. Each CUDA thread of a block is a ucontext fiber; one OS thread runs one block at a time
// and blocks are spread over several OS threads, so atomics really race. A fiber stops only at a
// warp shuffle, at __syncthreads and at its exit; the block's scheduler then settles each warp:
// shuffles exchange values among the lanes of their mask, and what CUDA leaves undefined or
// hangs on (lanes of a warp at different intrinsics, a barrier some thread never reaches, a
// source lane outside the mask or gone) is an error or a poison value, never a guess.
//
// What it cannot check: the device branch of mesa_numerics.h (it takes the host one), speed,
// memory ordering weaker than sequential consistency, and 32-bit overflow of large indices.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Shared memory belongs to the block, and an OS thread runs one block at a time.
#define __shared__ static thread_local

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(8) uint2 {
  unsigned x, y;
};

using cudaStream_t = struct CUstream_emu*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9, cudaErrorLaunchFailure = 4 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
#define CUDART_VERSION 13000
constexpr int warpSize = 32;

namespace mesa_emu {

// What a fiber is stopped at.
enum class Stop : int { kNone, kShflIdx, kShflUp, kShflDown, kShflXor, kSyncthreads };

struct Fiber;
extern thread_local Fiber* current_fiber;
extern thread_local uint3 current_block;
extern thread_local dim3 current_block_dim;
extern thread_local dim3 current_grid_dim;
const uint3& thread_index();

// The settle point of the calling fiber; returns the value it receives (shuffles).
uint64_t stop_at(Stop kind, unsigned mask, uint64_t value, int arg, int width,
                 const std::source_location& where);

struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t shared_bytes;
};

inline LaunchConfig config(dim3 grid, dim3 block, size_t shared_bytes = 0,
                           cudaStream_t /*stream*/ = nullptr) {
  return {grid, block, shared_bytes};
}

// Runs `body` once per thread of every block; a failure is kept for the next launch check.
void run_grid(const char* name, const LaunchConfig& cfg, const std::function<void()>& body);

template <typename... Params, typename... Args>
void launch(const char* name, const LaunchConfig& cfg, void (*kernel)(Params...),
            Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "kernel argument count");
  // Converted once, as a launch copies its arguments; every thread calls with the same copy.
  const std::tuple<std::decay_t<Params>...> params(
      static_cast<std::decay_t<Params>>(std::forward<Args>(args))...);
  run_grid(name, cfg, [&] { std::apply(kernel, params); });
}

// Stream operations that are not kernels, recorded beside the launches.
void record_operation(const char* name);

// The error of the last launch (empty when none), cleared by reading it, as cudaGetLastError.
std::string take_error();

struct Settings {
  int multiprocessors = 8;
  int workers = 2;
};
Settings& settings();

// Everything launched since the last clear, in order ("group_min_max_kernel<float>", ...).
std::vector<std::string> launch_log();
void clear_launch_log();
// How often a shuffle read a lane outside its mask, gone or missing (the value is poison).
int64_t poison_reads();

template <typename T>
uint64_t to_bits(T value) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a 1-8 byte value");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}

template <typename T>
T from_bits(uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

template <typename T, typename Update>
T atomic_update(T* address, Update update) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (!ref.compare_exchange_weak(old, update(old))) {
  }
  return old;
}

}  // namespace mesa_emu

#define threadIdx (::mesa_emu::thread_index())
#define blockIdx (::mesa_emu::current_block)
#define blockDim (::mesa_emu::current_block_dim)
#define gridDim (::mesa_emu::current_grid_dim)

// ---------------------------------------------------------------- intrinsics

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              std::source_location where = std::source_location::current()) {
  return mesa_emu::from_bits<T>(mesa_emu::stop_at(mesa_emu::Stop::kShflIdx, mask,
                                                  mesa_emu::to_bits(var), src_lane, width, where));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 std::source_location where = std::source_location::current()) {
  return mesa_emu::from_bits<T>(mesa_emu::stop_at(mesa_emu::Stop::kShflUp, mask,
                                                  mesa_emu::to_bits(var),
                                                  static_cast<int>(delta), width, where));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   std::source_location where = std::source_location::current()) {
  return mesa_emu::from_bits<T>(mesa_emu::stop_at(mesa_emu::Stop::kShflDown, mask,
                                                  mesa_emu::to_bits(var),
                                                  static_cast<int>(delta), width, where));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  std::source_location where = std::source_location::current()) {
  return mesa_emu::from_bits<T>(mesa_emu::stop_at(mesa_emu::Stop::kShflXor, mask,
                                                  mesa_emu::to_bits(var), lane_mask, width,
                                                  where));
}
inline void __syncthreads(std::source_location where = std::source_location::current()) {
  mesa_emu::stop_at(mesa_emu::Stop::kSyncthreads, 0, 0, 0, 0, where);
}
inline void __threadfence() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

inline unsigned atomicMin(unsigned* a, unsigned v) {
  return mesa_emu::atomic_update(a, [v](unsigned old) { return std::min(old, v); });
}
inline unsigned atomicMax(unsigned* a, unsigned v) {
  return mesa_emu::atomic_update(a, [v](unsigned old) { return std::max(old, v); });
}
inline int atomicMin(int* a, int v) {
  return mesa_emu::atomic_update(a, [v](int old) { return std::min(old, v); });
}
inline int atomicMax(int* a, int v) {
  return mesa_emu::atomic_update(a, [v](int old) { return std::max(old, v); });
}
inline unsigned atomicAdd(unsigned* a, unsigned v) {
  return mesa_emu::atomic_update(a, [v](unsigned old) { return old + v; });
}
inline int atomicAdd(int* a, int v) {
  return mesa_emu::atomic_update(a, [v](int old) { return old + v; });
}
inline float atomicAdd(float* a, float v) {
  return mesa_emu::atomic_update(a, [v](float old) { return old + v; });
}
inline unsigned atomicExch(unsigned* a, unsigned v) {
  return std::atomic_ref<unsigned>(*a).exchange(v);
}

inline unsigned __float_as_uint(float v) {
  return mesa_emu::from_bits<unsigned>(mesa_emu::to_bits(v));
}
inline float __uint_as_float(unsigned v) {
  return mesa_emu::from_bits<float>(mesa_emu::to_bits(v));
}

// CUDA's overloads of min / max for device code.
inline int min(int a, int b) { return std::min(a, b); }
inline unsigned min(unsigned a, unsigned b) { return std::min(a, b); }
inline long min(long a, long b) { return std::min(a, b); }
inline long long min(long long a, long long b) { return std::min(a, b); }
inline int max(int a, int b) { return std::max(a, b); }
inline unsigned max(unsigned a, unsigned b) { return std::max(a, b); }
inline long max(long a, long b) { return std::max(a, b); }
inline long long max(long long a, long long b) { return std::max(a, b); }

// ---------------------------------------------------------------- runtime

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t error);
