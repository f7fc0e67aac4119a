// CUDA kernels of Mesa's activation quantizer; mmseg_mesa/reference.py is the reference.
//
// Numerics follow the reference operation by operation, each rounded once as torch rounds it:
//   observe:    per-group min/max over finite values; EMA  decay * old + (1 - decay) * new.
//   quantize:   v = (x - lower) / scale, IEEE division; round half to even, or floor(v + u);
//               NaN -> 0; clamp to [0, 2^bits - 1].
//   dequantize: code * scale, then + lower (two roundings, never a fused multiply-add).
// The explicit __f*_rn intrinsics keep nvcc from contracting or approximating any of them.
#include "mesa_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <curand_kernel.h>

#include <algorithm>
#include <mutex>
#include <optional>

namespace mmseg_mesa {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;
// Random 32-bit values one chunk of elements may draw from its Philox subsequence.
constexpr uint64_t kPhiloxValuesPerChunk = 8;

// ---------------------------------------------------------------- indexing

// Elements per thread: one 16-byte load of the floating-point side.
template <typename scalar_t>
constexpr int vec_size() {
  return 16 / static_cast<int>(sizeof(scalar_t));
}

template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedArray {
  T val[N];
};

// Channel and group of consecutive flat indices: one division at the start, then increments.
struct GroupCursor {
  int64_t in_channel;  // position inside the current channel's run of `inner` elements
  int32_t channel;
  int32_t group;
  int32_t in_group;

  __host__ __device__ GroupCursor(const GroupLayout& layout, int64_t index) {
    int64_t outer_channel;
    if (layout.narrow) {
      const uint32_t i = static_cast<uint32_t>(index);
      const uint32_t q = i / static_cast<uint32_t>(layout.inner);
      in_channel = i - q * static_cast<uint32_t>(layout.inner);
      outer_channel = q;
    } else {
      outer_channel = index / layout.inner;
      in_channel = index - outer_channel * layout.inner;
    }
    // (i / inner) % channels, as for any contiguous tensor.
    channel = static_cast<int32_t>(outer_channel % layout.channels);
    group = channel / static_cast<int32_t>(layout.group_size);
    in_group = channel - group * static_cast<int32_t>(layout.group_size);
  }

  // Elements from here to the end of the current group's run (a run ends at the last channel of
  // the group, or at the last channel of the tensor, where the next outer index starts).
  __host__ __device__ int64_t left_in_group(const GroupLayout& layout) const {
    const int64_t first = int64_t{group} * layout.group_size;
    const int64_t size = layout.group_size < layout.channels - first ? layout.group_size
                                                                     : layout.channels - first;
    return (size - in_group) * layout.inner - in_channel;
  }

  __host__ __device__ void advance(const GroupLayout& layout) {
    if (++in_channel < layout.inner) {
      return;
    }
    in_channel = 0;
    if (++channel == layout.channels) {
      channel = group = in_group = 0;
    } else if (++in_group == layout.group_size) {
      in_group = 0;
      ++group;
    }
  }
};

int multiprocessors(const at::Tensor& t) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, t.get_device()));
  return std::max(count, 1);
}

int64_t elementwise_blocks(const at::Tensor& t, int64_t chunks) {
  const int64_t needed = (chunks + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min<int64_t>(needed, int64_t{multiprocessors(t)} * 16));
}

bool is_aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// ---------------------------------------------------------------- observe

// Unsigned keys ordered like the floats they encode, for atomicMin/atomicMax.
__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t bits = __float_as_uint(v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Finiteness in the input's own dtype, as the reference tests it before converting to fp32.
template <typename scalar_t>
__device__ __forceinline__ bool is_finite_value(scalar_t v) {
  return isfinite(static_cast<float>(v));
}

template <>
__device__ __forceinline__ bool is_finite_value<double>(double v) {
  return isfinite(v);
}

__global__ void init_keys_kernel(uint32_t* min_keys, uint32_t* max_keys, int64_t groups) {
  const int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (g < groups) {
    min_keys[g] = ordered_key(INFINITY);
    max_keys[g] = ordered_key(-INFINITY);
  }
}

// The tensor as rows x row_len (row_len = channels * inner). A thread keeps the min/max of one
// column over a strided set of rows in registers; a warp then merges lanes of the same group
// (consecutive columns, so groups are non-decreasing across lanes) and one lane per group
// publishes the result atomically.
template <typename scalar_t>
__global__ void group_min_max_kernel(const scalar_t* __restrict__ x, int64_t rows,
                                     int64_t row_len, int64_t inner, int64_t group_size,
                                     uint32_t* __restrict__ min_keys,
                                     uint32_t* __restrict__ max_keys) {
  const int64_t col = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const bool active = col < row_len;
  float lo = INFINITY;
  float hi = -INFINITY;
  if (active) {
    const int64_t row_step = int64_t{gridDim.y} * blockDim.y;
#pragma unroll 4
    for (int64_t row = blockIdx.y * int64_t{blockDim.y} + threadIdx.y; row < rows;
         row += row_step) {
      const scalar_t v = x[row * row_len + col];
      if (is_finite_value(v)) {
        const float f = static_cast<float>(v);
        lo = fminf(lo, f);
        hi = fmaxf(hi, f);
      }
    }
  }
  const int32_t group = active ? static_cast<int32_t>(col / inner / group_size) : -1;
  const unsigned lane = threadIdx.x & 31u;
  // Segmented tree reduction: after the step with offset o, lane i holds its group's values
  // over lanes [i, i + 2o).
  for (unsigned offset = 1; offset < 32; offset <<= 1) {
    const float lo_other = __shfl_down_sync(kFullMask, lo, offset);
    const float hi_other = __shfl_down_sync(kFullMask, hi, offset);
    const int32_t group_other = __shfl_down_sync(kFullMask, group, offset);
    if (lane + offset < 32 && group_other == group) {
      lo = fminf(lo, lo_other);
      hi = fmaxf(hi, hi_other);
    }
  }
  const int32_t group_before = __shfl_up_sync(kFullMask, group, 1);
  const bool first_of_group = lane == 0 || group_before != group;
  if (active && first_of_group && lo <= hi) {
    atomicMin(min_keys + group, ordered_key(lo));
    atomicMax(max_keys + group, ordered_key(hi));
  }
}

// quantizer.ema_update: groups without a finite value keep their estimate. Also writes the
// running range widened to cover this batch (cover_lower, cover_span), which quantize uses.
__global__ void ema_update_kernel(const uint32_t* __restrict__ min_keys,
                                  const uint32_t* __restrict__ max_keys, int64_t groups,
                                  float* __restrict__ lower, float* __restrict__ span,
                                  bool* __restrict__ seen, float decay, float keep_new,
                                  float* __restrict__ cover_lower,
                                  float* __restrict__ cover_span) {
  const int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (g >= groups) {
    return;
  }
  const float lo = key_value(min_keys[g]);
  const float hi = key_value(max_keys[g]);
  if (!(isfinite(lo) && isfinite(hi))) {
    cover_lower[g] = lower[g];
    cover_span[g] = span[g];
    return;
  }
  const float batch_span = __fsub_rn(hi, lo);
  float new_lower = lo;
  float new_span = batch_span;
  if (seen[g]) {
    new_lower = __fadd_rn(__fmul_rn(decay, lower[g]), __fmul_rn(keep_new, lo));
    new_span = __fadd_rn(__fmul_rn(decay, span[g]), __fmul_rn(keep_new, batch_span));
  }
  lower[g] = new_lower;
  span[g] = new_span;
  seen[g] = true;
  const float upper = __fadd_rn(new_lower, new_span);
  const float low = fminf(new_lower, lo);
  cover_lower[g] = low;
  cover_span[g] = __fsub_rn(fmaxf(upper, hi), low);
}

// ---------------------------------------------------------------- quantize / dequantize

__device__ __forceinline__ uint8_t encode(float x, float lower, float scale, float levels,
                                          float noise, bool stochastic) {
  float v = __fdiv_rn(__fsub_rn(x, lower), scale);
  v = stochastic ? floorf(__fadd_rn(v, noise)) : rintf(v);
  if (isnan(v)) {
    v = 0.0f;
  }
  return static_cast<uint8_t>(fminf(fmaxf(v, 0.0f), levels));
}

template <typename scalar_t>
__device__ __forceinline__ scalar_t decode(uint8_t code, float lower, float scale) {
  // Multiply, then add: two roundings, as the reference's `codes * scale + lower`. The cast is
  // the c10 conversion (round to nearest even) that Tensor.to(dtype) uses.
  return static_cast<scalar_t>(__fadd_rn(__fmul_rn(static_cast<float>(code), scale), lower));
}

// u ~ U[0, 1) with 24 random bits, exactly representable in fp32.
__device__ __forceinline__ float unit_uniform(uint32_t bits) {
  return static_cast<float>(bits >> 8) * 0x1p-24f;
}

// Each thread handles chunks of vec_size() consecutive elements; the Philox subsequence is the
// chunk index, so the draws do not depend on the launch configuration or on alignment.
template <typename scalar_t, bool kStochastic>
__global__ void quantize_kernel(const scalar_t* __restrict__ x, const float* __restrict__ lower,
                                const float* __restrict__ scale, uint8_t* __restrict__ codes,
                                GroupLayout layout, float levels, bool aligned,
                                at::PhiloxCudaState philox) {
  constexpr int kVec = vec_size<scalar_t>();
  uint64_t seed = 0;
  uint64_t offset = 0;
  if constexpr (kStochastic) {
    const auto unpacked = at::cuda::philox::unpack(philox);
    seed = std::get<0>(unpacked);
    offset = std::get<1>(unpacked);
  }
  const int64_t chunks = (layout.numel + kVec - 1) / kVec;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t chunk = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; chunk < chunks;
       chunk += step) {
    const int64_t begin = chunk * kVec;
    const bool full = aligned && begin + kVec <= layout.numel;
    AlignedArray<scalar_t, kVec> in;
    if (full) {
      in = *reinterpret_cast<const AlignedArray<scalar_t, kVec>*>(x + begin);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        in.val[j] = begin + j < layout.numel ? x[begin + j] : static_cast<scalar_t>(0.0f);
      }
    }
    float noise[kVec];
    if constexpr (kStochastic) {
      curandStatePhilox4_32_10_t state;
      curand_init(seed, static_cast<uint64_t>(chunk), offset, &state);
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        const uint4 bits = curand4(&state);
        const uint32_t draws[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
        for (int k = 0; k < 4 && j + k < kVec; ++k) {
          noise[j + k] = unit_uniform(draws[k]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        noise[j] = 0.0f;
      }
    }
    GroupCursor cursor(layout, begin);
    AlignedArray<uint8_t, kVec> out;
    if (cursor.left_in_group(layout) >= kVec) {  // the usual case: one group for the chunk
      const float lo = lower[cursor.group];
      const float sc = scale[cursor.group];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        out.val[j] = encode(static_cast<float>(in.val[j]), lo, sc, levels, noise[j], kStochastic);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int32_t g = cursor.group;
        out.val[j] = encode(static_cast<float>(in.val[j]), lower[g], scale[g], levels, noise[j],
                            kStochastic);
        cursor.advance(layout);
      }
    }
    if (full) {
      *reinterpret_cast<AlignedArray<uint8_t, kVec>*>(codes + begin) = out;
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (begin + j < layout.numel) {
          codes[begin + j] = out.val[j];
        }
      }
    }
  }
}

template <typename scalar_t>
__global__ void dequantize_kernel(const uint8_t* __restrict__ codes,
                                  const float* __restrict__ lower,
                                  const float* __restrict__ scale, scalar_t* __restrict__ out,
                                  GroupLayout layout, bool aligned) {
  constexpr int kVec = vec_size<scalar_t>();
  const int64_t chunks = (layout.numel + kVec - 1) / kVec;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t chunk = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; chunk < chunks;
       chunk += step) {
    const int64_t begin = chunk * kVec;
    const bool full = aligned && begin + kVec <= layout.numel;
    AlignedArray<uint8_t, kVec> in;
    if (full) {
      in = *reinterpret_cast<const AlignedArray<uint8_t, kVec>*>(codes + begin);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        in.val[j] = begin + j < layout.numel ? codes[begin + j] : uint8_t(0);
      }
    }
    GroupCursor cursor(layout, begin);
    AlignedArray<scalar_t, kVec> result;
    if (cursor.left_in_group(layout) >= kVec) {  // the usual case: one group for the chunk
      const float lo = lower[cursor.group];
      const float sc = scale[cursor.group];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        result.val[j] = decode<scalar_t>(in.val[j], lo, sc);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        result.val[j] = decode<scalar_t>(in.val[j], lower[cursor.group], scale[cursor.group]);
        cursor.advance(layout);
      }
    }
    if (full) {
      *reinterpret_cast<AlignedArray<scalar_t, kVec>*>(out + begin) = result;
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (begin + j < layout.numel) {
          out[begin + j] = result.val[j];
        }
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- host entry points

at::Tensor observe_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span,
                        const at::Tensor& seen, int64_t group_dim, int64_t group_size,
                        double decay) {
  constexpr const char* op = "mmseg_mesa::observe";
  check_activation(op, x);
  const GroupLayout layout = group_layout(op, x, group_dim, group_size);
  check_group_vector(op, "lower", lower, x, layout, at::kFloat);
  check_group_vector(op, "span", span, x, layout, at::kFloat);
  check_group_vector(op, "seen", seen, x, layout, at::kBool);
  TORCH_CHECK(decay >= 0.0 && decay <= 1.0, op, ": decay must be in [0, 1], got ", decay);
  const at::Tensor cover = at::empty({2, layout.groups}, lower.options());
  if (layout.numel == 0) {  // nothing observed: the running range as it is
    cover.select(0, 0).copy_(lower);
    cover.select(0, 1).copy_(span);
    return cover;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor keys = at::empty({2, layout.groups}, x.options().dtype(at::kInt));
  auto* min_keys = reinterpret_cast<uint32_t*>(keys.mutable_data_ptr<int32_t>());
  uint32_t* max_keys = min_keys + layout.groups;
  const auto group_blocks = static_cast<unsigned>((layout.groups + kThreads - 1) / kThreads);
  init_keys_kernel<<<group_blocks, kThreads, 0, stream>>>(min_keys, max_keys, layout.groups);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const int64_t row_len = layout.channels * layout.inner;
  const int64_t rows = layout.numel / row_len;
  const int64_t warps_x = std::min<int64_t>(kThreads / 32, (row_len + 31) / 32);
  const dim3 block(static_cast<unsigned>(32 * warps_x),
                   static_cast<unsigned>(std::max<int64_t>(1, kThreads / 32 / warps_x)));
  const int64_t blocks_x = (row_len + block.x - 1) / block.x;
  TORCH_CHECK(blocks_x <= std::numeric_limits<int32_t>::max(), op, ": tensor too large");
  const int64_t wanted = std::max<int64_t>(1, int64_t{multiprocessors(x)} * 8 / blocks_x);
  const int64_t blocks_y =
      std::min<int64_t>({(rows + block.y - 1) / block.y, wanted, int64_t{65535}});
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    group_min_max_kernel<scalar_t><<<grid, block, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), rows, row_len, layout.inner, layout.group_size, min_keys,
        max_keys);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  // Python computes `decay * t` and `(1.0 - decay) * t` with the double scalars cast to fp32.
  ema_update_kernel<<<group_blocks, kThreads, 0, stream>>>(
      min_keys, max_keys, layout.groups, lower.mutable_data_ptr<float>(),
      span.mutable_data_ptr<float>(), seen.mutable_data_ptr<bool>(), static_cast<float>(decay),
      static_cast<float>(1.0 - decay), cover.mutable_data_ptr<float>(),
      cover.mutable_data_ptr<float>() + layout.groups);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return cover;
}

at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& scale,
                         int64_t bits, int64_t group_dim, int64_t group_size, bool stochastic,
                         std::optional<at::Generator> generator) {
  constexpr const char* op = "mmseg_mesa::quantize";
  check_activation(op, x);
  const GroupLayout layout = group_layout(op, x, group_dim, group_size);
  check_group_vector(op, "lower", lower, x, layout, at::kFloat);
  check_group_vector(op, "scale", scale, x, layout, at::kFloat);
  TORCH_CHECK(bits >= 1 && bits <= 8, op, ": bits must be in [1, 8], got ", bits);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  if (layout.numel == 0) {
    return codes;
  }
  at::PhiloxCudaState philox;
  if (stochastic) {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        generator, at::cuda::detail::getDefaultCUDAGenerator(x.get_device()));
    TORCH_CHECK(gen->device() == x.device(), op, ": the generator is on ", gen->device(),
                " but x is on ", x.device());
    const std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(kPhiloxValuesPerChunk);
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    constexpr int kVec = vec_size<scalar_t>();
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    uint8_t* out = codes.mutable_data_ptr<uint8_t>();
    const bool aligned = is_aligned(in, 16) && is_aligned(out, kVec);
    const auto blocks = static_cast<unsigned>(
        elementwise_blocks(x, (layout.numel + kVec - 1) / kVec));
    if (stochastic) {
      quantize_kernel<scalar_t, true><<<blocks, kThreads, 0, stream>>>(
          in, lower.const_data_ptr<float>(), scale.const_data_ptr<float>(), out, layout, levels,
          aligned, philox);
    } else {
      quantize_kernel<scalar_t, false><<<blocks, kThreads, 0, stream>>>(
          in, lower.const_data_ptr<float>(), scale.const_data_ptr<float>(), out, layout, levels,
          aligned, philox);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return codes;
}

at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& lower,
                           const at::Tensor& scale, int64_t group_dim, int64_t group_size,
                           at::ScalarType dtype) {
  constexpr const char* op = "mmseg_mesa::dequantize";
  check_cuda_contiguous(op, "codes", codes);
  TORCH_CHECK(codes.scalar_type() == at::kByte, op, ": codes must be uint8, got ",
              codes.scalar_type());
  TORCH_CHECK(is_supported_float(dtype), op,
              ": dtype must be float32, float16, bfloat16 or float64, got ", dtype);
  const GroupLayout layout = group_layout(op, codes, group_dim, group_size);
  check_group_vector(op, "lower", lower, codes, layout, at::kFloat);
  check_group_vector(op, "scale", scale, codes, layout, at::kFloat);
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(dtype));
  if (layout.numel == 0) {
    return out;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, op, [&] {
    constexpr int kVec = vec_size<scalar_t>();
    const uint8_t* in = codes.const_data_ptr<uint8_t>();
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    const bool aligned = is_aligned(in, kVec) && is_aligned(result, 16);
    const auto blocks = static_cast<unsigned>(
        elementwise_blocks(codes, (layout.numel + kVec - 1) / kVec));
    dequantize_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        in, lower.const_data_ptr<float>(), scale.const_data_ptr<float>(), result, layout,
        aligned);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// The architectures this file was compiled for (nvcc's __CUDA_ARCH_LIST__, e.g. "900").
#define MMSEG_MESA_STR_(x) #x
#define MMSEG_MESA_STR(x) MMSEG_MESA_STR_(x)
const char* compiled_cuda_archs() {
#ifdef __CUDA_ARCH_LIST__
  return MMSEG_MESA_STR(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

int compiled_cuda_version() {
  return CUDART_VERSION;
}

}  // namespace mmseg_mesa
