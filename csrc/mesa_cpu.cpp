// CPU kernels of Mesa's activation quantizer: the arithmetic of mesa_numerics.h, spread over
// torch's intra-op threads with at::parallel_for. Compiled with -ffp-contract=off and without
// -ffast-math (setup.py), so that every operation rounds as torch's reference does.
#include "mesa_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace mmseg_mesa {
namespace {

// Elements below which one thread does the whole tensor (thread start-up costs more).
constexpr int64_t kGrainElements = 1 << 15;

// Per-channel min/max over finite values of one task's share of the tensor, merged into `lo` /
// `hi` (channels entries each). The tensor is (outer, channels, inner); the task covers rows
// [first, last) of the (outer * channels, inner) view, i.e. runs of one channel each.
template <typename scalar_t>
void channel_min_max(const scalar_t* x, const GroupLayout& layout, int64_t first, int64_t last,
                     float* lo, float* hi) {
  const int64_t channels = layout.channels;
  if (layout.inner == 1) {  // channels last: element-wise over whole rows of channels
    int64_t run = first;
    while (run < last) {
      const int64_t c0 = run % channels;
      const int64_t c1 = std::min<int64_t>(channels, c0 + (last - run));
      const scalar_t* row = x + run;
      for (int64_t c = c0; c < c1; ++c) {
        const scalar_t v = row[c - c0];
        const float f = static_cast<float>(v);
        const bool finite = is_finite_bits(v);
        lo[c] = finite && f < lo[c] ? f : lo[c];
        hi[c] = finite && f > hi[c] ? f : hi[c];
      }
      run += c1 - c0;
    }
    return;
  }
  int64_t c = first % channels;
  for (int64_t run = first; run < last; ++run) {
    const scalar_t* values = x + run * layout.inner;
    float l = lo[c];
    float h = hi[c];
    for (int64_t k = 0; k < layout.inner; ++k) {
      const scalar_t v = values[k];
      const float f = static_cast<float>(v);
      const bool finite = is_finite_bits(v);
      l = finite && f < l ? f : l;
      h = finite && f > h ? f : h;
    }
    lo[c] = l;
    hi[c] = h;
    if (++c == channels) {
      c = 0;
    }
  }
}

template <typename scalar_t, bool kStochastic>
void quantize_loop(const scalar_t* x, const float* lower, const float* scale, uint8_t* out,
                   const GroupLayout& layout, int bits, bool pack, float levels, uint64_t seed,
                   uint64_t offset) {
  const int64_t chunks = (layout.numel + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, kGrainElements / kChunk, [&](int64_t first, int64_t last) {
    GroupCursor cursor(layout, first * kChunk);
    for (int64_t chunk = first; chunk < last; ++chunk) {
      const int64_t begin = chunk * kChunk;
      const int count = static_cast<int>(std::min<int64_t>(kChunk, layout.numel - begin));
      float values[kChunk];
      for (int j = 0; j < kChunk; ++j) {
        values[j] = j < count ? static_cast<float>(x[begin + j]) : 0.0f;
      }
      uint8_t codes[kChunk];
      encode_chunk<kStochastic>(values, begin, count, cursor, layout, lower, scale, levels, seed,
                                offset, codes);
      if (!pack || bits == 8) {
        std::memcpy(out + begin, codes, count);
      } else {
        uint8_t bytes[kChunk];
        pack_chunk(codes, bits, bytes);
        std::memcpy(out + chunk * bits, bytes, chunk_bytes(count, bits));
      }
    }
  });
}

template <typename scalar_t>
void dequantize_loop(const uint8_t* in, const float* lower, const float* scale, scalar_t* out,
                     const GroupLayout& layout, int bits) {
  const int64_t chunks = (layout.numel + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, kGrainElements / kChunk, [&](int64_t first, int64_t last) {
    GroupCursor cursor(layout, first * kChunk);
    for (int64_t chunk = first; chunk < last; ++chunk) {
      const int64_t begin = chunk * kChunk;
      const int count = static_cast<int>(std::min<int64_t>(kChunk, layout.numel - begin));
      uint8_t codes[kChunk] = {};
      if (bits == 8) {
        std::memcpy(codes, in + begin, count);
      } else {
        uint8_t bytes[kChunk] = {};
        std::memcpy(bytes, in + chunk * bits, chunk_bytes(count, bits));
        unpack_chunk(bytes, bits, codes);
      }
      float values[kChunk];
      decode_chunk(codes, count, cursor, layout, lower, scale, values);
      for (int j = 0; j < count; ++j) {
        out[begin + j] = static_cast<scalar_t>(values[j]);
      }
    }
  });
}

}  // namespace

at::Tensor observe_cpu(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span,
                       const at::Tensor& seen, int64_t group_dim, int64_t group_size,
                       double decay) {
  constexpr const char* op = "mmseg_mesa::observe";
  check_activation(op, x, c10::DeviceType::CPU);
  const GroupLayout layout = group_layout(op, x.sizes(), group_dim, group_size);
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
  // Runs of one channel (inner elements each), split into one share per thread.
  const int64_t runs = layout.numel / layout.inner;
  const int64_t shares = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), layout.numel / kGrainElements));
  const int64_t channels = layout.channels;
  std::vector<float> lo(shares * channels, std::numeric_limits<float>::infinity());
  std::vector<float> hi(shares * channels, -std::numeric_limits<float>::infinity());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, shares, 1, [&](int64_t first, int64_t last) {
      for (int64_t share = first; share < last; ++share) {
        channel_min_max(data, layout, runs * share / shares, runs * (share + 1) / shares,
                        lo.data() + share * channels, hi.data() + share * channels);
      }
    });
  });

  // Python computes `decay * t` and `(1.0 - decay) * t` with the double scalars cast to fp32.
  const float decay_f = static_cast<float>(decay);
  const float keep_new = static_cast<float>(1.0 - decay);
  float* lower_p = lower.mutable_data_ptr<float>();
  float* span_p = span.mutable_data_ptr<float>();
  bool* seen_p = seen.mutable_data_ptr<bool>();
  float* cover_lower = cover.mutable_data_ptr<float>();
  float* cover_span = cover_lower + layout.groups;
  for (int64_t g = 0; g < layout.groups; ++g) {
    float group_lo = std::numeric_limits<float>::infinity();
    float group_hi = -std::numeric_limits<float>::infinity();
    const int64_t c_end = std::min(channels, (g + 1) * layout.group_size);
    for (int64_t share = 0; share < shares; ++share) {
      for (int64_t c = g * layout.group_size; c < c_end; ++c) {
        group_lo = std::min(group_lo, lo[share * channels + c]);
        group_hi = std::max(group_hi, hi[share * channels + c]);
      }
    }
    ema_group_update(group_lo, group_hi, decay_f, keep_new, lower_p[g], span_p[g], seen_p[g],
                     cover_lower[g], cover_span[g]);
  }
  return cover;
}

at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& scale,
                        int64_t bits, int64_t group_dim, int64_t group_size, bool stochastic,
                        int64_t seed, int64_t offset, bool pack) {
  constexpr const char* op = "mmseg_mesa::quantize";
  const GroupLayout layout = check_quantize_args(op, x, lower, scale, bits, group_dim,
                                                 group_size, pack, c10::DeviceType::CPU);
  at::Tensor codes = at::empty(quantized_shape(x, bits, pack), x.options().dtype(at::kByte));
  if (layout.numel == 0) {
    return codes;
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    const float* lo = lower.const_data_ptr<float>();
    const float* sc = scale.const_data_ptr<float>();
    uint8_t* out = codes.mutable_data_ptr<uint8_t>();
    const int width = static_cast<int>(bits);
    if (stochastic) {
      quantize_loop<scalar_t, true>(in, lo, sc, out, layout, width, pack, levels,
                                    static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
    } else {
      quantize_loop<scalar_t, false>(in, lo, sc, out, layout, width, pack, levels, 0, 0);
    }
  });
  return codes;
}

at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& lower,
                          const at::Tensor& scale, int64_t bits, at::IntArrayRef shape,
                          int64_t group_dim, int64_t group_size, at::ScalarType dtype) {
  constexpr const char* op = "mmseg_mesa::dequantize";
  const GroupLayout layout = check_dequantize_args(op, codes, lower, scale, bits, shape,
                                                   group_dim, group_size, dtype,
                                                   c10::DeviceType::CPU);
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  if (layout.numel == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, op, [&] {
    dequantize_loop<scalar_t>(codes.const_data_ptr<uint8_t>(), lower.const_data_ptr<float>(),
                              scale.const_data_ptr<float>(), out.mutable_data_ptr<scalar_t>(),
                              layout, static_cast<int>(bits));
  });
  return out;
}

}  // namespace mmseg_mesa
