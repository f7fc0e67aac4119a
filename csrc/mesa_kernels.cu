// CUDA kernels of Mesa's activation quantizer: launch shape, cross-thread reductions and memory
// movement around the arithmetic of mesa_numerics.h, which the CPU kernels (mesa_cpu.cpp) share;
// mmseg_mesa/reference.py is the reference. nvcc is run with --prec-div=true --fmad=false
// (setup.py), and mesa_numerics.h uses the __f*_rn intrinsics on the device, so nothing is
// contracted or approximated.
#include "mesa_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <tuple>

namespace mmseg_mesa {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------- indexing

// One chunk's worth of a type, for 16-byte vector loads and stores.
template <typename T>
struct alignas(16) ChunkOf {
  T val[kChunk];
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

// Unsigned keys ordered like the floats they encode, for atomicMax. A zeroed buffer holds the
// identity of both reductions (0 is below every finite value's key), so one memset prepares it:
// the maxima keep the key, the minima its complement.
__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t bits = __float_as_uint(v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The reduced min and max of a group; a group without a finite value gives +inf and -inf.
__device__ __forceinline__ float min_of(const volatile uint32_t* min_keys, int64_t g) {
  const uint32_t stored = min_keys[g];
  return stored == 0 ? INFINITY : key_value(~stored);
}

__device__ __forceinline__ float max_of(const volatile uint32_t* max_keys, int64_t g) {
  const uint32_t stored = max_keys[g];
  return stored == 0 ? -INFINITY : key_value(stored);
}

// What the last block makes of each group's range: the running estimates updated
// (quantizer.ema_update) and the range that covers this batch (observe).
struct ObserveFinish {
  float* lower;
  float* span;
  bool* seen;
  float decay;
  float keep_new;
  float* cover_lower;
  float* cover_span;

  __device__ void operator()(int64_t g, float lo, float hi) const {
    float group_lower = lower[g];
    float group_span = span[g];
    bool group_seen = seen[g];
    ema_group_update(lo, hi, decay, keep_new, group_lower, group_span, group_seen,
                     cover_lower[g], cover_span[g]);
    lower[g] = group_lower;
    span[g] = group_span;
    seen[g] = group_seen;
  }
};

// The same update, then the affines of a pack (observe_quantize, mesa_numerics.h's
// pack_group_range): the one returned with the codes (`used_*`) and the one the codes are made
// with (`coding_*`).
struct PackFinish {
  float* lower;
  float* span;
  bool* seen;
  const float* mean;  // null unless standardized
  const float* rstd;
  float decay;
  float keep_new;
  float levels;
  float* used_lower;
  float* used_scale;
  float* coding_lower;
  float* coding_scale;

  __device__ void operator()(int64_t g, float lo, float hi) const {
    float group_lower = lower[g];
    float group_span = span[g];
    bool group_seen = seen[g];
    const bool standardized = mean != nullptr;
    const GroupAffine affine = pack_group_range(
        lo, hi, standardized, standardized ? mean[g] : 0.0f, standardized ? rstd[g] : 1.0f,
        decay, keep_new, levels, group_lower, group_span, group_seen);
    lower[g] = group_lower;
    span[g] = group_span;
    seen[g] = group_seen;
    used_lower[g] = affine.used_lower;
    used_scale[g] = affine.used_scale;
    coding_lower[g] = affine.x_lower;
    coding_scale[g] = affine.x_scale;
  }
};

// The tensor as rows x row_len (row_len = channels * inner). A thread keeps the min/max of one
// column over a strided set of rows in registers; a warp then merges lanes of the same group
// (consecutive columns, so groups are non-decreasing across lanes) and one lane per group
// publishes the result atomically. The last block to finish (counted in `done`, after a fence)
// hands every group's range to `finish`: one launch for the whole observe. With `row_mean`
// (a row-standardized pack) each value is standardized by its row's moments as it is read.
template <typename scalar_t, typename Finish>
__global__ void group_min_max_kernel(const scalar_t* __restrict__ x, int64_t rows,
                                     int64_t row_len, int64_t inner, int64_t group_size,
                                     int64_t groups, const float* __restrict__ row_mean,
                                     const float* __restrict__ row_rstd,
                                     uint32_t* __restrict__ min_keys,
                                     uint32_t* __restrict__ max_keys, uint32_t* done,
                                     Finish finish) {
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
      if (row_mean != nullptr) {  // finiteness of the standardized fp32 value
        const float f = row_standardized(static_cast<float>(v), row_mean[row], row_rstd[row]);
        if (is_finite_bits(f)) {
          lo = fminf(lo, f);
          hi = fmaxf(hi, f);
        }
      } else if (is_finite_bits(v)) {  // in the input's own dtype, as the reference tests it
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
    atomicMax(min_keys + group, ~ordered_key(lo));
    atomicMax(max_keys + group, ordered_key(hi));
  }

  // Publish this block's atomics before counting it done; the last block sees every block's.
  __shared__ bool last_block;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    const unsigned blocks = gridDim.x * gridDim.y;
    last_block = atomicAdd(done, 1u) == blocks - 1;
  }
  __syncthreads();
  if (!last_block) {
    return;
  }
  __threadfence();
  const int64_t threads = int64_t{blockDim.x} * blockDim.y;
  for (int64_t g = threadIdx.y * int64_t{blockDim.x} + threadIdx.x; g < groups; g += threads) {
    finish(g, min_of(min_keys, g), max_of(max_keys, g));
  }
}

// ---------------------------------------------------------------- quantize / dequantize

// One thread per chunk of kChunk consecutive elements (grid-stride). The draws of stochastic
// rounding are a function of the element's flat index, so they depend neither on the launch
// configuration nor on alignment. With `row_mean`, each value is standardized by the moments of
// its row (row_len elements) before it is coded.
template <typename scalar_t, bool kStochastic>
__global__ void quantize_kernel(const scalar_t* __restrict__ x, const float* __restrict__ lower,
                                const float* __restrict__ scale, uint8_t* __restrict__ out,
                                GroupLayout layout, float levels, int bits, bool pack,
                                bool aligned, uint64_t seed, uint64_t offset,
                                const float* __restrict__ row_mean,
                                const float* __restrict__ row_rstd, int64_t row_len) {
  const int64_t chunks = (layout.numel + kChunk - 1) / kChunk;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t chunk = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; chunk < chunks;
       chunk += step) {
    const int64_t begin = chunk * kChunk;
    const int count = static_cast<int>(min(int64_t{kChunk}, layout.numel - begin));
    float values[kChunk];
    if (aligned && count == kChunk) {
      const ChunkOf<scalar_t> in = *reinterpret_cast<const ChunkOf<scalar_t>*>(x + begin);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        values[j] = static_cast<float>(in.val[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        values[j] = j < count ? static_cast<float>(x[begin + j]) : 0.0f;
      }
    }
    if (row_mean != nullptr) {  // one division per chunk: its values span few rows
      int64_t row = begin / row_len;
      int64_t row_end = (row + 1) * row_len;
      for (int j = 0; j < count; ++j) {
        while (begin + j >= row_end) {
          ++row;
          row_end += row_len;
        }
        values[j] = row_standardized(values[j], row_mean[row], row_rstd[row]);
      }
    }
    GroupCursor cursor(layout, begin);
    uint8_t codes[kChunk];
    encode_chunk<kStochastic>(values, begin, count, cursor, layout, lower, scale, levels, seed,
                              offset, codes);
    if (!pack || bits == 8) {
      if (aligned && count == kChunk) {
        uint2 word;
        memcpy(&word, codes, sizeof(word));
        *reinterpret_cast<uint2*>(out + begin) = word;
      } else {
        for (int j = 0; j < count; ++j) {
          out[begin + j] = codes[j];
        }
      }
    } else {
      uint8_t bytes[kChunk];
      pack_chunk(codes, bits, bytes);
      const int n = chunk_bytes(count, bits);
      for (int j = 0; j < n; ++j) {
        out[chunk * bits + j] = bytes[j];
      }
    }
  }
}

template <typename scalar_t>
__global__ void dequantize_kernel(const uint8_t* __restrict__ in,
                                  const float* __restrict__ lower,
                                  const float* __restrict__ scale,
                                  const float* __restrict__ divisor, int64_t row_len,
                                  scalar_t* __restrict__ out, GroupLayout layout, int bits,
                                  bool aligned) {
  const int64_t chunks = (layout.numel + kChunk - 1) / kChunk;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t chunk = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; chunk < chunks;
       chunk += step) {
    const int64_t begin = chunk * kChunk;
    const int count = static_cast<int>(min(int64_t{kChunk}, layout.numel - begin));
    uint8_t codes[kChunk] = {};
    if (bits == 8) {
      if (aligned && count == kChunk) {
        const uint2 word = *reinterpret_cast<const uint2*>(in + begin);
        memcpy(codes, &word, sizeof(word));
      } else {
        for (int j = 0; j < count; ++j) {
          codes[j] = in[begin + j];
        }
      }
    } else {
      uint8_t bytes[kChunk] = {};
      const int n = chunk_bytes(count, bits);
      for (int j = 0; j < n; ++j) {
        bytes[j] = in[chunk * bits + j];
      }
      unpack_chunk(bytes, bits, codes);
    }
    GroupCursor cursor(layout, begin);
    float values[kChunk];
    decode_chunk(codes, count, cursor, layout, lower, scale, values);
    if (divisor != nullptr) {  // each value divided by its row's, in fp32
      int64_t row = begin / row_len;  // one division per chunk: its values span few rows
      int64_t row_end = (row + 1) * row_len;
      for (int j = 0; j < count; ++j) {
        while (begin + j >= row_end) {
          ++row;
          row_end += row_len;
        }
        values[j] = div_rn(values[j], divisor[row]);
      }
    }
    // The cast is the c10 conversion (round to nearest even) that Tensor.to(dtype) uses.
    if (aligned && count == kChunk) {
      ChunkOf<scalar_t> result;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        result.val[j] = static_cast<scalar_t>(values[j]);
      }
      *reinterpret_cast<ChunkOf<scalar_t>*>(out + begin) = result;
    } else {
      for (int j = 0; j < count; ++j) {
        out[begin + j] = static_cast<scalar_t>(values[j]);
      }
    }
  }
}

// One thread per chunk (grid-stride). The first threads also write the fine codes' lower and
// step, which no thread reads back: each element's step is computed where it is used.
template <typename scalar_t>
__global__ void refine_kernel(const scalar_t* __restrict__ x, const uint8_t* __restrict__ codes,
                              const float* __restrict__ lower, const float* __restrict__ scale,
                              const float* __restrict__ mean, const float* __restrict__ rstd,
                              uint8_t* __restrict__ fine, float* __restrict__ fine_lower,
                              float* __restrict__ fine_scale, GroupLayout layout) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  for (int64_t g = first; g < layout.groups; g += step) {
    const float unit = fine_step(scale[g]);
    fine_scale[g] = unit;
    fine_lower[g] = fine_lower_of(unit);
  }
  const int64_t chunks = (layout.numel + kChunk - 1) / kChunk;
  for (int64_t chunk = first; chunk < chunks; chunk += step) {
    const int64_t begin = chunk * kChunk;
    const int count = static_cast<int>(min(int64_t{kChunk}, layout.numel - begin));
    GroupCursor cursor(layout, begin);
    for (int j = 0; j < count; ++j) {
      const int32_t g = cursor.group;
      float v = static_cast<float>(x[begin + j]);
      if (mean != nullptr) {
        v = mul_rn(sub_rn(v, mean[g]), rstd[g]);
      }
      fine[begin + j] = fine_code(v, codes[begin + j], lower[g], scale[g], fine_step(scale[g]));
      cursor.advance(layout);
    }
  }
}

template <typename scalar_t>
__global__ void dequantize_refined_kernel(const uint8_t* __restrict__ codes,
                                          const uint8_t* __restrict__ fine,
                                          const float* __restrict__ lower,
                                          const float* __restrict__ scale,
                                          const float* __restrict__ fine_lower,
                                          const float* __restrict__ fine_scale,
                                          scalar_t* __restrict__ out, GroupLayout layout) {
  const int64_t chunks = (layout.numel + kChunk - 1) / kChunk;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t chunk = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; chunk < chunks;
       chunk += step) {
    const int64_t begin = chunk * kChunk;
    const int count = static_cast<int>(min(int64_t{kChunk}, layout.numel - begin));
    GroupCursor cursor(layout, begin);
    for (int j = 0; j < count; ++j) {
      const int32_t g = cursor.group;
      out[begin + j] = static_cast<scalar_t>(decode_refined(
          codes[begin + j], fine[begin + j], lower[g], scale[g], fine_lower[g], fine_scale[g]));
      cursor.advance(layout);
    }
  }
}

// One thread per channel (grid-stride).
__global__ void norm_terms_kernel(const float* __restrict__ rstd,
                                  const float* __restrict__ decoded_invstd,
                                  const float* __restrict__ weight, float eps, float reliable,
                                  int64_t channels, float* __restrict__ eps_share,
                                  float* __restrict__ spread, float* __restrict__ scale) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < channels; c += step) {
    const NormTerms t = norm_terms(rstd[c], decoded_invstd[c],
                                   weight != nullptr ? weight[c] : 1.0f, weight != nullptr, eps,
                                   reliable);
    eps_share[c] = t.eps_share;
    spread[c] = t.spread;
    scale[c] = t.scale;
  }
}

// ---------------------------------------------------------------- host launches

// The keys zeroed (one memset), then group_min_max_kernel handing each group's range of x to
// `finish` in its last block. Any layout with a group, empty tensors included.
template <typename Finish>
void launch_group_range(const char* op, const at::Tensor& x, const GroupLayout& layout,
                        const Finish& finish, const float* row_mean = nullptr,
                        const float* row_rstd = nullptr) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The min keys, the max keys and the blocks-done counter.
  const at::Tensor keys = at::empty({2 * layout.groups + 1}, x.options().dtype(at::kInt));
  auto* min_keys = reinterpret_cast<uint32_t*>(keys.mutable_data_ptr<int32_t>());
  uint32_t* max_keys = min_keys + layout.groups;
  uint32_t* done = max_keys + layout.groups;
  C10_CUDA_CHECK(cudaMemsetAsync(min_keys, 0, keys.nbytes(), stream));

  const int64_t row_len = layout.channels * layout.inner;
  const int64_t rows = row_len > 0 ? layout.numel / row_len : 0;
  const int64_t warps_x = std::clamp<int64_t>((row_len + 31) / 32, 1, kThreads / 32);
  const dim3 block(static_cast<unsigned>(32 * warps_x),
                   static_cast<unsigned>(std::max<int64_t>(1, kThreads / 32 / warps_x)));
  const int64_t blocks_x = std::max<int64_t>(1, (row_len + block.x - 1) / block.x);
  const int64_t wanted = std::max<int64_t>(1, int64_t{multiprocessors(x)} * 8 / blocks_x);
  const int64_t blocks_y =
      std::clamp<int64_t>(std::min((rows + block.y - 1) / block.y, wanted), 1, 65535);
  TORCH_CHECK(blocks_x * blocks_y <= std::numeric_limits<int32_t>::max(), op,
              ": tensor too large");
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "group_min_max", [&] {
    group_min_max_kernel<scalar_t, Finish><<<grid, block, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), rows, row_len, layout.inner, layout.group_size,
        layout.groups, row_mean, row_rstd, min_keys, max_keys, done, finish);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// quantize_kernel over x into `codes`, shaped by quantized_shape.
void launch_quantize(const at::Tensor& x, const float* lower, const float* scale,
                     at::Tensor& codes, const GroupLayout& layout, int64_t bits,
                     bool stochastic, int64_t seed, int64_t offset, bool pack,
                     const float* row_mean = nullptr, const float* row_rstd = nullptr) {
  const int64_t row_len = std::max<int64_t>(1, layout.channels * layout.inner);
  const float levels = static_cast<float>((1 << bits) - 1);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto blocks =
      static_cast<unsigned>(elementwise_blocks(x, (layout.numel + kChunk - 1) / kChunk));
  const int width = static_cast<int>(bits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize", [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    uint8_t* out = codes.mutable_data_ptr<uint8_t>();
    const bool aligned = is_aligned(in, 16) && is_aligned(out, 8);
    if (stochastic) {
      quantize_kernel<scalar_t, true><<<blocks, kThreads, 0, stream>>>(
          in, lower, scale, out, layout, levels, width, pack, aligned,
          static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), row_mean, row_rstd,
          row_len);
    } else {
      quantize_kernel<scalar_t, false><<<blocks, kThreads, 0, stream>>>(
          in, lower, scale, out, layout, levels, width, pack, aligned, 0, 0, row_mean, row_rstd,
          row_len);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

// ---------------------------------------------------------------- host entry points

at::Tensor observe_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span,
                        const at::Tensor& seen, int64_t group_dim, int64_t group_size,
                        double decay) {
  constexpr const char* op = "mmseg_mesa::observe";
  const GroupLayout layout = check_observe_args(op, x, lower, span, seen, group_dim, group_size,
                                                decay, c10::DeviceType::CUDA);
  const at::Tensor cover = at::empty({2, layout.groups}, lower.options());
  if (layout.numel == 0) {  // nothing observed: the running range as it is
    cover.select(0, 0).copy_(lower);
    cover.select(0, 1).copy_(span);
    return cover;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  // Python computes `decay * t` and `(1.0 - decay) * t` with the double scalars cast to fp32.
  const ObserveFinish finish{lower.mutable_data_ptr<float>(), span.mutable_data_ptr<float>(),
                             seen.mutable_data_ptr<bool>(), static_cast<float>(decay),
                             static_cast<float>(1.0 - decay), cover.mutable_data_ptr<float>(),
                             cover.mutable_data_ptr<float>() + layout.groups};
  launch_group_range(op, x, layout, finish);
  return cover;
}

at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& scale,
                         int64_t bits, int64_t group_dim, int64_t group_size, bool stochastic,
                         int64_t seed, int64_t offset, bool pack) {
  constexpr const char* op = "mmseg_mesa::quantize";
  const GroupLayout layout = check_quantize_args(op, x, lower, scale, bits, group_dim,
                                                 group_size, pack, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor codes = at::empty(quantized_shape(x, bits, pack), x.options().dtype(at::kByte));
  if (layout.numel == 0) {
    return codes;
  }
  launch_quantize(x, lower.const_data_ptr<float>(), scale.const_data_ptr<float>(), codes,
                  layout, bits, stochastic, seed, offset, pack);
  return codes;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> observe_quantize_cuda(
    const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span, const at::Tensor& seen,
    const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& rstd,
    int64_t group_dim, int64_t group_size, double decay, int64_t bits, bool stochastic,
    int64_t seed, int64_t offset, bool pack, bool rows) {
  constexpr const char* op = "mmseg_mesa::observe_quantize";
  const GroupLayout layout =
      check_observe_quantize_args(op, x, lower, span, seen, mean, rstd, group_dim, group_size,
                                  decay, bits, pack, rows, c10::DeviceType::CUDA);
  // Row-standardized: both kernels standardize each value as they read it, and the per-group
  // affine is the plain one (no per-group moments).
  const float* row_mean = rows ? mean->const_data_ptr<float>() : nullptr;
  const float* row_rstd = rows ? rstd->const_data_ptr<float>() : nullptr;
  const bool standardized = mean.has_value() && !rows;
  const c10::cuda::CUDAGuard guard(x.device());
  // The lower and scale returned with the codes, each its own tensor as on CPU (the saved codes
  // keep them; a view of one buffer would keep all of it), and where standardized the lower and
  // scale the codes are made with.
  const int64_t groups = layout.groups;
  const at::Tensor used_lower = at::empty({groups}, lower.options());
  const at::Tensor used_scale = at::empty({groups}, lower.options());
  const at::Tensor x_affine =
      standardized ? at::empty({2, groups}, lower.options()) : at::Tensor();
  at::Tensor codes = at::empty(quantized_shape(x, bits, pack), x.options().dtype(at::kByte));
  float* coding_lower = standardized ? x_affine.mutable_data_ptr<float>()
                                     : used_lower.mutable_data_ptr<float>();
  float* coding_scale = standardized ? coding_lower + groups
                                     : used_scale.mutable_data_ptr<float>();
  if (groups > 0) {
    // Python computes `decay * t` and `(1.0 - decay) * t` with the double scalars cast to fp32.
    const PackFinish finish{lower.mutable_data_ptr<float>(), span.mutable_data_ptr<float>(),
                            seen.mutable_data_ptr<bool>(),
                            standardized ? mean->const_data_ptr<float>() : nullptr,
                            standardized ? rstd->const_data_ptr<float>() : nullptr,
                            static_cast<float>(decay), static_cast<float>(1.0 - decay),
                            static_cast<float>((1 << bits) - 1),
                            used_lower.mutable_data_ptr<float>(),
                            used_scale.mutable_data_ptr<float>(), coding_lower, coding_scale};
    launch_group_range(op, x, layout, finish, row_mean, row_rstd);
  }
  if (layout.numel > 0) {
    launch_quantize(x, coding_lower, coding_scale, codes, layout, bits, stochastic, seed, offset,
                    pack, row_mean, row_rstd);
  }
  return {codes, used_lower, used_scale};
}

at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& lower,
                           const at::Tensor& scale, int64_t bits, at::IntArrayRef shape,
                           int64_t group_dim, int64_t group_size, at::ScalarType dtype,
                           const std::optional<at::Tensor>& divisor) {
  constexpr const char* op = "mmseg_mesa::dequantize";
  const GroupLayout layout = check_dequantize_args(op, codes, lower, scale, bits, shape,
                                                   group_dim, group_size, dtype,
                                                   c10::DeviceType::CUDA);
  const int64_t row_len = check_divisor(op, divisor, codes, layout);
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  if (layout.numel == 0) {
    return out;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto blocks =
      static_cast<unsigned>(elementwise_blocks(codes, (layout.numel + kChunk - 1) / kChunk));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, op, [&] {
    const uint8_t* in = codes.const_data_ptr<uint8_t>();
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    const bool aligned = is_aligned(in, 8) && is_aligned(result, 16);
    dequantize_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        in, lower.const_data_ptr<float>(), scale.const_data_ptr<float>(),
        divisor.has_value() ? divisor->const_data_ptr<float>() : nullptr, row_len, result,
        layout, static_cast<int>(bits), aligned);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> refine_cuda(
    const at::Tensor& x, const at::Tensor& codes, const at::Tensor& lower,
    const at::Tensor& scale, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& rstd, int64_t group_dim, int64_t group_size) {
  constexpr const char* op = "mmseg_mesa::refine";
  const GroupLayout layout = check_refine_args(op, x, codes, lower, scale, mean, rstd, group_dim,
                                               group_size, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor fine_lower = at::empty({layout.groups}, lower.options());
  const at::Tensor fine_scale = at::empty({layout.groups}, lower.options());
  at::Tensor fine = at::empty(x.sizes(), x.options().dtype(at::kByte));
  if (layout.numel == 0 && layout.groups == 0) {
    return {fine, fine_lower, fine_scale};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t units = std::max((layout.numel + kChunk - 1) / kChunk, layout.groups);
  const auto blocks = static_cast<unsigned>(elementwise_blocks(x, units));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    refine_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), codes.const_data_ptr<uint8_t>(),
        lower.const_data_ptr<float>(), scale.const_data_ptr<float>(),
        mean.has_value() ? mean->const_data_ptr<float>() : nullptr,
        rstd.has_value() ? rstd->const_data_ptr<float>() : nullptr,
        fine.mutable_data_ptr<uint8_t>(), fine_lower.mutable_data_ptr<float>(),
        fine_scale.mutable_data_ptr<float>(), layout);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {fine, fine_lower, fine_scale};
}

at::Tensor dequantize_refined_cuda(const at::Tensor& codes, const at::Tensor& fine,
                                   const at::Tensor& lower, const at::Tensor& scale,
                                   const at::Tensor& fine_lower, const at::Tensor& fine_scale,
                                   at::IntArrayRef shape, int64_t group_dim, int64_t group_size,
                                   at::ScalarType dtype) {
  constexpr const char* op = "mmseg_mesa::dequantize_refined";
  const GroupLayout layout =
      check_dequantize_refined_args(op, codes, fine, lower, scale, fine_lower, fine_scale, shape,
                                    group_dim, group_size, dtype, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  if (layout.numel == 0) {
    return out;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto blocks =
      static_cast<unsigned>(elementwise_blocks(codes, (layout.numel + kChunk - 1) / kChunk));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, op, [&] {
    dequantize_refined_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        codes.const_data_ptr<uint8_t>(), fine.const_data_ptr<uint8_t>(),
        lower.const_data_ptr<float>(), scale.const_data_ptr<float>(),
        fine_lower.const_data_ptr<float>(), fine_scale.const_data_ptr<float>(),
        out.mutable_data_ptr<scalar_t>(), layout);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_terms_cuda(
    const at::Tensor& rstd, const at::Tensor& decoded_invstd,
    const std::optional<at::Tensor>& weight, double eps, double reliable) {
  const int64_t channels = check_norm_terms_args("mmseg_mesa::norm_terms", rstd, decoded_invstd,
                                                 weight, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(rstd.device());
  at::Tensor eps_share = at::empty({channels}, rstd.options());
  at::Tensor spread = at::empty({channels}, rstd.options());
  at::Tensor scale = at::empty({channels}, rstd.options());
  if (channels == 0) {
    return {eps_share, spread, scale};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto blocks = static_cast<unsigned>(elementwise_blocks(rstd, channels));
  norm_terms_kernel<<<blocks, kThreads, 0, stream>>>(
      rstd.const_data_ptr<float>(), decoded_invstd.const_data_ptr<float>(),
      weight.has_value() ? weight->const_data_ptr<float>() : nullptr, static_cast<float>(eps),
      static_cast<float>(reliable), channels, eps_share.mutable_data_ptr<float>(),
      spread.mutable_data_ptr<float>(), scale.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {eps_share, spread, scale};
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
