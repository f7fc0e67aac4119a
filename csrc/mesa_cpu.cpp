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
#include <type_traits>
#include <vector>

namespace mmseg_mesa {
namespace {

// Elements below which one thread does the whole tensor (thread start-up costs more).
constexpr int64_t kGrainElements = 1 << 15;

// Independent lanes of channel_min_max's reduction of one run.
constexpr int kMinMaxLanes = 16;

// lo = min(lo, v), hi = max(hi, v) for a finite v; a non-finite one enters as +inf to the min
// and -inf to the max, which changes neither (branch-free, so that the loops vectorize).
template <typename scalar_t>
inline void merge_finite(scalar_t v, float& lo, float& hi) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const bool finite = is_finite_bits(v);
  const float f = static_cast<float>(v);
  const float for_lo = finite ? f : kInf;
  const float for_hi = finite ? f : -kInf;
  lo = for_lo < lo ? for_lo : lo;
  hi = for_hi > hi ? for_hi : hi;
}

// Per-channel min/max over finite values of one task's share of the tensor, merged into `lo` /
// `hi` (channels entries each). The tensor is (outer, channels, inner); the task covers rows
// [first, last) of the (outer * channels, inner) view, i.e. runs of one channel each.
template <typename scalar_t>
void channel_min_max(const scalar_t* __restrict x, const GroupLayout& layout, int64_t first,
                     int64_t last, float* __restrict lo, float* __restrict hi) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t channels = layout.channels;
  if (layout.inner == 1) {  // channels last: element-wise over whole rows of channels
    int64_t run = first;
    while (run < last) {
      const int64_t c0 = run % channels;
      const int64_t c1 = std::min<int64_t>(channels, c0 + (last - run));
      const scalar_t* row = x + run - c0;
      for (int64_t c = c0; c < c1; ++c) {
        merge_finite(row[c], lo[c], hi[c]);
      }
      run += c1 - c0;
    }
    return;
  }
  const int64_t inner = layout.inner;
  const int64_t whole = inner - inner % kMinMaxLanes;
  int64_t c = first % channels;
  for (int64_t run = first; run < last; ++run) {
    const scalar_t* values = x + run * inner;
    float l[kMinMaxLanes], h[kMinMaxLanes];
    for (int j = 0; j < kMinMaxLanes; ++j) {
      l[j] = kInf;
      h[j] = -kInf;
    }
    for (int64_t k = 0; k < whole; k += kMinMaxLanes) {
      for (int j = 0; j < kMinMaxLanes; ++j) {
        merge_finite(values[k + j], l[j], h[j]);
      }
    }
    float run_lo = lo[c];
    float run_hi = hi[c];
    for (int64_t k = whole; k < inner; ++k) {
      merge_finite(values[k], run_lo, run_hi);
    }
    for (int j = 0; j < kMinMaxLanes; ++j) {
      run_lo = l[j] < run_lo ? l[j] : run_lo;
      run_hi = h[j] > run_hi ? h[j] : run_hi;
    }
    lo[c] = run_lo;
    hi[c] = run_hi;
    if (++c == channels) {
      c = 0;
    }
  }
}

// Where the one-byte-per-code loops find each element's group (quantize without bit packing,
// dequantize of 8-bit codes): a constant run, or a repeating pattern of per-element values.
//
// With `inner` >= kMinRun each channel's run of `inner` elements is one group's, and the loop
// body sees one lower / scale. Below that (a channel-last layout has inner == 1), the per-element
// lower and scale of one (channels * inner) period are expanded once per call, repeated to at
// least kMinPattern elements, and read alongside the data. Both leave the element loops free of
// index arithmetic, so that the compiler vectorizes them; each element still goes through
// mesa_numerics.h's encode / decode.
constexpr int64_t kMinRun = 16;
constexpr int64_t kMinPattern = 1024;
// Elements per stochastic-rounding tile: the Philox draws of a tile are made before its codes.
constexpr int64_t kTile = 512;

struct GroupPattern {
  bool runs;               // one group per channel run
  int64_t period;          // pattern length (runs == false)
  std::vector<float> lower;
  std::vector<float> scale;

  GroupPattern(const GroupLayout& layout, const float* lower_g, const float* scale_g)
      : runs(layout.inner >= kMinRun), period(0) {
    if (runs) {
      return;
    }
    const int64_t base = layout.channels * layout.inner;
    const int64_t repeats = std::max<int64_t>(1, (kMinPattern + base - 1) / base);
    period = base * repeats;
    lower.resize(period);
    scale.resize(period);
    for (int64_t i = 0; i < period; ++i) {
      const int64_t group = ((i % base) / layout.inner) / layout.group_size;
      lower[i] = lower_g[group];
      scale[i] = scale_g[group];
    }
  }
};

// Calls body(position, count, lower, scale, stride) over [first, last): `count` elements from
// flat index `position` whose lower / scale are lower[j * stride], scale[j * stride].
template <typename Body>
void for_each_span(const GroupLayout& layout, const GroupPattern& pattern, const float* lower_g,
                   const float* scale_g, int64_t first, int64_t last, Body&& body) {
  int64_t position = first;
  while (position < last) {
    int64_t count;
    if (pattern.runs) {
      const int64_t run = position / layout.inner;
      const int64_t group = (run % layout.channels) / layout.group_size;
      count = std::min((run + 1) * layout.inner, last) - position;
      body(position, count, lower_g + group, scale_g + group, std::false_type{});
    } else {
      const int64_t at = position % pattern.period;
      count = std::min(pattern.period - at, last - position);
      body(position, count, pattern.lower.data() + at, pattern.scale.data() + at,
           std::true_type{});
    }
    position += count;
  }
}

// Philox blocks drawn together by tile_uniforms (philox4x32_10_lanes).
constexpr int kLanes = 4;

// noise[j] = the uniform of flat index begin + j, for j < count <= kTile; `buffer` holds
// kTile + 4 * kLanes floats. The draws are rounding_block's, kLanes blocks at a time.
inline const float* tile_uniforms(uint64_t seed, uint64_t offset, int64_t begin, int64_t count,
                                  float* buffer) {
  const uint64_t first = static_cast<uint64_t>(begin) >> 2;
  const uint64_t blocks = ((static_cast<uint64_t>(begin + count) + 3) >> 2) - first;
  const uint32_t key0 = static_cast<uint32_t>(seed);
  const uint32_t key1 = static_cast<uint32_t>(seed >> 32);
  for (uint64_t b = 0; b < blocks; b += kLanes) {
    uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t counter = offset + first + b + l;
      c0[l] = static_cast<uint32_t>(counter);
      c1[l] = static_cast<uint32_t>(counter >> 32);
      c2[l] = 0u;
      c3[l] = 0u;
    }
    philox4x32_10_lanes<kLanes>(c0, c1, c2, c3, key0, key1);
    float* out = buffer + 4 * b;
    for (int l = 0; l < kLanes; ++l) {
      out[4 * l + 0] = unit_uniform(c0[l]);
      out[4 * l + 1] = unit_uniform(c1[l]);
      out[4 * l + 2] = unit_uniform(c2[l]);
      out[4 * l + 3] = unit_uniform(c3[l]);
    }
  }
  return buffer + (begin & 3);
}

template <typename scalar_t, bool kStochastic, bool kPerElement>
void encode_span(const scalar_t* x, int64_t count, const float* lower, const float* scale,
                 float levels, const float* noise, uint8_t* out) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t g = kPerElement ? j : 0;
    out[j] = encode<kStochastic>(static_cast<float>(x[j]), lower[g], scale[g], levels,
                                 kStochastic ? noise[j] : 0.0f);
  }
}

template <typename scalar_t, bool kPerElement>
void decode_span(const uint8_t* codes, int64_t count, const float* lower, const float* scale,
                 scalar_t* out) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t g = kPerElement ? j : 0;
    out[j] = static_cast<scalar_t>(decode(codes[j], lower[g], scale[g]));
  }
}

// Codes one per byte (8-bit codes, or sub-byte ones left unpacked).
template <typename scalar_t, bool kStochastic>
void quantize_bytes(const scalar_t* x, const float* lower, const float* scale, uint8_t* out,
                    const GroupLayout& layout, float levels, uint64_t seed, uint64_t offset) {
  const GroupPattern pattern(layout, lower, scale);
  at::parallel_for(0, layout.numel, kGrainElements, [&](int64_t first, int64_t last) {
    float buffer[kTile + 4 * kLanes];
    for_each_span(layout, pattern, lower, scale, first, last,
                  [&](int64_t position, int64_t count, const float* lo, const float* sc,
                      auto per_element) {
      constexpr bool kPer = decltype(per_element)::value;
      for (int64_t t = 0; t < count; t += kTile) {
        const int64_t n = std::min(kTile, count - t);
        const float* noise =
            kStochastic ? tile_uniforms(seed, offset, position + t, n, buffer) : nullptr;
        encode_span<scalar_t, kStochastic, kPer>(x + position + t, n, kPer ? lo + t : lo,
                                                 kPer ? sc + t : sc, levels, noise,
                                                 out + position + t);
      }
    });
  });
}

// Bit-packed codes: a chunk of kChunk codes fills `bits` whole bytes.
template <typename scalar_t, bool kStochastic>
void quantize_packed(const scalar_t* x, const float* lower, const float* scale, uint8_t* out,
                     const GroupLayout& layout, int bits, float levels, uint64_t seed,
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
      uint8_t bytes[kChunk];
      pack_chunk(codes, bits, bytes);
      std::memcpy(out + chunk * bits, bytes, chunk_bytes(count, bits));
    }
  });
}

template <typename scalar_t, bool kStochastic>
void quantize_loop(const scalar_t* x, const float* lower, const float* scale, uint8_t* out,
                   const GroupLayout& layout, int bits, bool pack, float levels, uint64_t seed,
                   uint64_t offset) {
  if (!pack || bits == 8) {
    quantize_bytes<scalar_t, kStochastic>(x, lower, scale, out, layout, levels, seed, offset);
  } else {
    quantize_packed<scalar_t, kStochastic>(x, lower, scale, out, layout, bits, levels, seed,
                                           offset);
  }
}

template <typename scalar_t>
void dequantize_loop(const uint8_t* in, const float* lower, const float* scale, scalar_t* out,
                     const GroupLayout& layout, int bits) {
  if (bits == 8) {
    const GroupPattern pattern(layout, lower, scale);
    at::parallel_for(0, layout.numel, kGrainElements, [&](int64_t first, int64_t last) {
      for_each_span(layout, pattern, lower, scale, first, last,
                    [&](int64_t position, int64_t count, const float* lo, const float* sc,
                        auto per_element) {
        decode_span<scalar_t, decltype(per_element)::value>(in + position, count, lo, sc,
                                                            out + position);
      });
    });
    return;
  }
  const int64_t chunks = (layout.numel + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, kGrainElements / kChunk, [&](int64_t first, int64_t last) {
    GroupCursor cursor(layout, first * kChunk);
    for (int64_t chunk = first; chunk < last; ++chunk) {
      const int64_t begin = chunk * kChunk;
      const int count = static_cast<int>(std::min<int64_t>(kChunk, layout.numel - begin));
      uint8_t codes[kChunk] = {};
      uint8_t bytes[kChunk] = {};
      std::memcpy(bytes, in + chunk * bits, chunk_bytes(count, bits));
      unpack_chunk(bytes, bits, codes);
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
  const GroupLayout layout = check_observe_args(op, x, lower, span, seen, group_dim, group_size,
                                                decay, c10::DeviceType::CPU);
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

bool cpu_kernels_parallel() {
#ifdef INTRA_OP_PARALLEL  // defined by ATen/Parallel.h where at::parallel_for splits work
  return true;
#else
  return false;
#endif
}

}  // namespace mmseg_mesa
