// The quantizer's arithmetic, shared by the CPU kernels (mesa_cpu.cpp) and the CUDA kernels
// (mesa_kernels.cu); mmseg_mesa/reference.py is the pure-PyTorch statement of the same numerics.
//
// Every function here is plain arithmetic on scalars, compiled by the host compiler and by nvcc
// alike (MESA_HD is __host__ __device__ under nvcc and empty otherwise). What stays outside is
// the part that differs by device: launch shape, cross-thread reductions and memory movement.
//
// Each floating-point operation is rounded once, as torch rounds it:
//   observe:    per-group min/max over finite values; EMA  decay * old + (1 - decay) * new.
//   quantize:   v = (x - lower) / scale, IEEE division; round half to even, or floor(v + u);
//               NaN -> 0; clamp to [0, 2^bits - 1].
//   dequantize: code * scale, then + lower (two roundings, never a fused multiply-add).
// On the device the __f*_rn intrinsics keep nvcc from contracting or approximating; on the host
// the CPU kernels are compiled with -ffp-contract=off and without -ffast-math (setup.py).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MESA_HD __host__ __device__ __forceinline__
#else
#define MESA_HD inline
#endif

namespace mmseg_mesa {

// ---------------------------------------------------------------- layout

// A tensor seen as (outer, channels, inner) around group_dim; channel c belongs to group
// c / group_size.
struct GroupLayout {
  int64_t numel;
  int64_t inner;       // product of the sizes after group_dim
  int64_t channels;    // size of group_dim
  int64_t group_size;  // channels per group (the last group may be shorter)
  int64_t groups;      // ceil(channels / group_size)
  bool narrow;         // numel fits 32-bit index arithmetic
};

// Elements a kernel handles as one unit: two Philox blocks, and a whole number of bytes at every
// sub-byte width (8 one-bit, 4 two-bit or 2 four-bit codes per byte).
constexpr int kChunk = 8;

// Channel and group of consecutive flat indices: one division at the start, then increments.
struct GroupCursor {
  int64_t in_channel;  // position inside the current channel's run of `inner` elements
  int32_t channel;
  int32_t group;
  int32_t in_group;

  MESA_HD GroupCursor(const GroupLayout& layout, int64_t index) {
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
  MESA_HD int64_t left_in_group(const GroupLayout& layout) const {
    const int64_t first = int64_t{group} * layout.group_size;
    const int64_t size = layout.group_size < layout.channels - first ? layout.group_size
                                                                     : layout.channels - first;
    return (size - in_group) * layout.inner - in_channel;
  }

  MESA_HD void advance(const GroupLayout& layout) {
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

  // Moves n elements on, all inside the current group's run (n <= left_in_group).
  MESA_HD void skip_in_group(const GroupLayout& layout, int64_t n) {
    in_channel += n;
    while (in_channel >= layout.inner) {
      in_channel -= layout.inner;
      if (++channel == layout.channels) {
        channel = group = in_group = 0;
      } else if (++in_group == layout.group_size) {
        in_group = 0;
        ++group;
      }
    }
  }
};

// ---------------------------------------------------------------- correctly rounded fp32

MESA_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MESA_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

MESA_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MESA_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Finiteness from the bits, so that the host loop vectorizes and both compilers agree.
MESA_HD bool is_finite_bits(float v) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(v);
#else
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
#endif
  return (bits & 0x7f800000u) != 0x7f800000u;
}

MESA_HD bool is_finite_bits(double v) {
#if defined(__CUDA_ARCH__)
  const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(v));
#else
  uint64_t bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
#endif
  return (bits & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// ---------------------------------------------------------------- observe

// quantizer.ema_update for one group, given this batch's min and max over finite values (+inf /
// -inf when it had none): groups without a finite value keep their estimate. Also gives the
// running range widened to cover this batch (cover_lower, cover_span), which quantize uses.
// `keep_new` is 1 - decay, computed in double and rounded to fp32 as Python's `1.0 - decay`.
MESA_HD void ema_group_update(float lo, float hi, float decay, float keep_new, float& lower,
                              float& span, bool& seen, float& cover_lower, float& cover_span) {
  if (!(is_finite_bits(lo) && is_finite_bits(hi))) {
    cover_lower = lower;
    cover_span = span;
    return;
  }
  const float batch_span = sub_rn(hi, lo);
  float new_lower = lo;
  float new_span = batch_span;
  if (seen) {
    new_lower = add_rn(mul_rn(decay, lower), mul_rn(keep_new, lo));
    new_span = add_rn(mul_rn(decay, span), mul_rn(keep_new, batch_span));
  }
  lower = new_lower;
  span = new_span;
  seen = true;
  const float upper = add_rn(new_lower, new_span);
  const float low = new_lower < lo ? new_lower : lo;
  cover_lower = low;
  cover_span = sub_rn(upper > hi ? upper : hi, low);
}

// A value standardized by its row's moments as it is read (a row-standardized pack:
// quantizer.pack_rows_standardized): (v - mean) * rstd, two roundings.
MESA_HD float row_standardized(float v, float mean, float rstd) {
  return mul_rn(sub_rn(v, mean), rstd);
}

// The quantization step of a group whose range is `span`: span / levels, or 1 where the span
// is not positive (a constant or empty group) or NaN, as quantizer.scale_from_span.
MESA_HD float scale_of_span(float span, float levels) {
  return span > 0.0f ? div_rn(span, levels) : 1.0f;
}

// observe_quantize's step per group once the batch's range [lo, hi] is known: the EMA of the
// range (of the standardized values (v - mean) * rstd where `standardized`), the affine that
// decodes the codes (`used_*`, quantizer.pack / pack_standardized) and the one x is coded with
// (`x_*`: the used one mapped back to x's units; rstd > 0 keeps the map monotone).
struct GroupAffine {
  float used_lower;
  float used_scale;
  float x_lower;
  float x_scale;
};

MESA_HD GroupAffine pack_group_range(float lo, float hi, bool standardized, float mean,
                                     float rstd, float decay, float keep_new, float levels,
                                     float& lower, float& span, bool& seen) {
  if (standardized) {
    lo = mul_rn(sub_rn(lo, mean), rstd);
    hi = mul_rn(sub_rn(hi, mean), rstd);
  }
  GroupAffine affine;
  float cover_span;
  ema_group_update(lo, hi, decay, keep_new, lower, span, seen, affine.used_lower, cover_span);
  affine.used_scale = scale_of_span(cover_span, levels);
  affine.x_lower = affine.used_lower;
  affine.x_scale = affine.used_scale;
  if (standardized) {
    affine.x_lower = add_rn(mean, div_rn(affine.used_lower, rstd));
    affine.x_scale = scale_of_span(div_rn(cover_span, rstd), levels);
  }
  return affine;
}

// ---------------------------------------------------------------- stochastic rounding stream

// Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC11): a
// counter-based generator, so any element's draw is a pure function of (seed, offset, index).
// Element i of a call draws word i & 3 of the block at counter offset + (i >> 2) (a 64-bit
// value in the counter's two low words; the high words are 0), keyed by the 64-bit seed.
// mmseg_mesa/reference.py computes the same with int64 torch ops.
struct PhiloxBlock {
  uint32_t w[4];
};

MESA_HD void mul_hi_lo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
#endif
}

// Ten Philox rounds on N counters at once, all under one key (the seed): lane l's counter is
// (c0[l], c1[l], c2[l], c3[l]), replaced by its output block. The CUDA kernels run one lane per
// thread; the CPU kernels run several in one loop, which keeps more multiplies in flight.
template <int N>
MESA_HD void philox4x32_10_lanes(uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3,
                                 uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u;
  constexpr uint32_t kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u;
  constexpr uint32_t kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      key0 += kWeyl0;
      key1 += kWeyl1;
    }
    for (int l = 0; l < N; ++l) {
      uint32_t hi0, lo0, hi1, lo1;
      mul_hi_lo(kMul0, c0[l], hi0, lo0);
      mul_hi_lo(kMul1, c2[l], hi1, lo1);
      const uint32_t n0 = hi1 ^ c1[l] ^ key0;
      const uint32_t n2 = hi0 ^ c3[l] ^ key1;
      c0[l] = n0;
      c1[l] = lo1;
      c2[l] = n2;
      c3[l] = lo0;
    }
  }
}

MESA_HD PhiloxBlock philox4x32_10(PhiloxBlock counter, uint32_t key0, uint32_t key1) {
  uint32_t c0 = counter.w[0], c1 = counter.w[1], c2 = counter.w[2], c3 = counter.w[3];
  philox4x32_10_lanes<1>(&c0, &c1, &c2, &c3, key0, key1);
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// The block holding the draws of elements 4 * block .. 4 * block + 3 of a call.
MESA_HD PhiloxBlock rounding_block(uint64_t seed, uint64_t offset, uint64_t block) {
  const uint64_t counter = offset + block;
  return philox4x32_10(
      PhiloxBlock{{static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// u ~ U[0, 1) with 24 random bits, exactly representable in fp32.
MESA_HD float unit_uniform(uint32_t word) {
  return mul_rn(static_cast<float>(word >> 8), 0x1p-24f);
}

// The kChunk uniforms of the chunk starting at flat index `begin` (a multiple of kChunk).
MESA_HD void chunk_uniforms(uint64_t seed, uint64_t offset, int64_t begin, float* noise) {
  const uint64_t first = static_cast<uint64_t>(begin) >> 2;
  for (int b = 0; b < kChunk / 4; ++b) {
    const PhiloxBlock block = rounding_block(seed, offset, first + b);
    for (int k = 0; k < 4; ++k) {
      noise[4 * b + k] = unit_uniform(block.w[k]);
    }
  }
}

// ---------------------------------------------------------------- quantize / dequantize

// One element's code. Clamping before rounding gives the reference's round-then-clamp result
// (rounding is monotone and the bounds are integers) and keeps v in [0, 255], where adding and
// subtracting 2^23 rounds half to even and truncation is floor. NaN fails both comparisons -> 0.
template <bool kStochastic>
MESA_HD uint8_t encode(float x, float lower, float scale, float levels, float noise) {
  float v = div_rn(sub_rn(x, lower), scale);
  if (kStochastic) {
    v = add_rn(v, noise);
  }
  v = v > 0.0f ? v : 0.0f;
  v = v < levels ? v : levels;
  if (!kStochastic) {
    v = sub_rn(add_rn(v, 0x1p23f), 0x1p23f);
  }
  return static_cast<uint8_t>(static_cast<int32_t>(v));
}

// Multiply, then add: two roundings, as the reference's `codes * scale + lower`.
MESA_HD float decode(uint8_t code, float lower, float scale) {
  return add_rn(mul_rn(static_cast<float>(code), scale), lower);
}

// ---------------------------------------------------------------- refined codes

// Refined codes (quantizer.refine) are 8-bit codes and the 8-bit codes of what they miss, made
// over one coarse step either way of each group: the fine codes' step is scale / 127 and their
// lower -127 steps, the product rounded as decode rounds it, so that code 127 decodes to 0
// exactly (a constant group's codes miss nothing, and its refined codes add nothing to them);
// both rounded as the reference's torch ops round them. Rounding to nearest: the second pass
// draws nothing.
MESA_HD float fine_step(float scale) {
  return div_rn(scale, 127.0f);
}

MESA_HD float fine_lower_of(float step) {
  return -mul_rn(127.0f, step);
}

// The fine code of an element whose fp32 value is `v` and coarse code `code`.
MESA_HD uint8_t fine_code(float v, uint8_t code, float lower, float scale, float step) {
  return encode<false>(sub_rn(v, decode(code, lower, scale)), fine_lower_of(step), step, 255.0f,
                       0.0f);
}

// Both codes decoded and added in fp32, as the reference adds the two decoded tensors.
MESA_HD float decode_refined(uint8_t code, uint8_t fine, float lower, float scale,
                             float fine_lower, float fine_scale) {
  return add_rn(decode(code, lower, scale), decode(fine, fine_lower, fine_scale));
}

// ---------------------------------------------------------------- BatchNorm's backward terms

// Per channel, from the forward's 1/std `rstd` and the 1/std `decoded_invstd` of the decoded
// normalized input: the share eps takes of the variance (eps * rstd * rstd), the spread the
// normalized input had (sqrt(1 - that share) where it is at least `reliable`, else the codes'
// own), and the factor the fused backward takes as its weight (rstd * weight / spread), each
// rounded as the reference's torch ops (layers/norm.py) round them.
struct NormTerms {
  float eps_share;
  float spread;
  float scale;
};

MESA_HD NormTerms norm_terms(float rstd, float decoded_invstd, float weight, bool has_weight,
                             float eps, float reliable) {
  NormTerms t;
  t.eps_share = add_rn(0.0f, mul_rn(mul_rn(eps, rstd), rstd));
  const float target = sub_rn(1.0f, t.eps_share);
#if defined(__CUDA_ARCH__)
  const float root = __fsqrt_rn(target);
#else
  const float root = std::sqrt(target);
#endif
  t.spread = target >= reliable ? root : div_rn(1.0f, decoded_invstd);
  t.scale = div_rn(has_weight ? mul_rn(rstd, weight) : rstd, t.spread);
  return t;
}

// The codes of one chunk: `values` holds its kChunk inputs converted to fp32 (those past the
// end of the tensor are ignored), `cursor` is at `begin` and is left at the next chunk.
template <bool kStochastic>
MESA_HD void encode_chunk(const float* values, int64_t begin, int count, GroupCursor& cursor,
                          const GroupLayout& layout, const float* lower, const float* scale,
                          float levels, uint64_t seed, uint64_t offset, uint8_t* codes) {
  float noise[kChunk];
  if (kStochastic) {
    chunk_uniforms(seed, offset, begin, noise);
  } else {
    for (int j = 0; j < kChunk; ++j) {
      noise[j] = 0.0f;
    }
  }
  if (cursor.left_in_group(layout) >= kChunk) {  // the usual case: one group for the chunk
    const float lo = lower[cursor.group];
    const float sc = scale[cursor.group];
    for (int j = 0; j < kChunk; ++j) {
      codes[j] = encode<kStochastic>(values[j], lo, sc, levels, noise[j]);
    }
    cursor.skip_in_group(layout, kChunk);
  } else {
    for (int j = 0; j < count; ++j) {
      const int32_t g = cursor.group;
      codes[j] = encode<kStochastic>(values[j], lower[g], scale[g], levels, noise[j]);
      cursor.advance(layout);
    }
  }
  for (int j = count; j < kChunk; ++j) {  // bit packing pads with zero codes
    codes[j] = 0;
  }
}

// Bytes one chunk of `count` codes occupies at `bits` per code (mmseg_mesa/bitpack.py's layout).
MESA_HD int chunk_bytes(int count, int bits) {
  return bits == 8 ? count : (count * bits + 7) / 8;
}

// mmseg_mesa/bitpack.py's layout: byte i holds codes i*k .. i*k+k-1 (k = 8 / bits), code j of a
// byte in bits [j * bits, (j + 1) * bits). A chunk packs into `bits` whole bytes.
MESA_HD void pack_chunk(const uint8_t* codes, int bits, uint8_t* bytes) {
  const int per_byte = 8 / bits;
  for (int b = 0; b < bits; ++b) {
    uint32_t byte = 0;
    for (int j = 0; j < per_byte; ++j) {
      byte |= static_cast<uint32_t>(codes[b * per_byte + j]) << (j * bits);
    }
    bytes[b] = static_cast<uint8_t>(byte);
  }
}

MESA_HD void unpack_chunk(const uint8_t* bytes, int bits, uint8_t* codes) {
  const int per_byte = 8 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  for (int b = 0; b < bits; ++b) {
    for (int j = 0; j < per_byte; ++j) {
      codes[b * per_byte + j] = static_cast<uint8_t>((bytes[b] >> (j * bits)) & mask);
    }
  }
}

// The decoded fp32 values of one chunk of codes; `cursor` is at `begin` and moves to the next.
MESA_HD void decode_chunk(const uint8_t* codes, int count, GroupCursor& cursor,
                          const GroupLayout& layout, const float* lower, const float* scale,
                          float* values) {
  if (cursor.left_in_group(layout) >= kChunk) {
    const float lo = lower[cursor.group];
    const float sc = scale[cursor.group];
    for (int j = 0; j < kChunk; ++j) {
      values[j] = decode(codes[j], lo, sc);
    }
    cursor.skip_in_group(layout, kChunk);
  } else {
    for (int j = 0; j < count; ++j) {
      values[j] = decode(codes[j], lower[cursor.group], scale[cursor.group]);
      cursor.advance(layout);
    }
  }
}

}  // namespace mmseg_mesa
