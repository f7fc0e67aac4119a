// CPU kernels of Mesa's activation quantizer: the arithmetic of mesa_numerics.h, spread over
// torch's intra-op threads with at::parallel_for. Compiled with -ffp-contract=off and without
// -ffast-math (setup.py), so that every operation rounds as torch's reference does.
#include "mesa_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MESA_X86_SIMD 1
#include <immintrin.h>
#endif

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
__attribute__((always_inline)) inline void channel_min_max_loops(
    const scalar_t* __restrict x, const GroupLayout& layout, int64_t first, int64_t last,
    float* __restrict lo, float* __restrict hi) {
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

#ifdef MESA_X86_SIMD
bool runs_avx2();

template <typename scalar_t>
__attribute__((target("avx2"))) void channel_min_max_avx2(
    const scalar_t* __restrict x, const GroupLayout& layout, int64_t first, int64_t last,
    float* __restrict lo, float* __restrict hi) {
  channel_min_max_loops(x, layout, first, last, lo, hi);
}
#endif

// channel_min_max_loops in the widest build runs_avx2 allows (min and max round nothing: the
// same result in every build).
template <typename scalar_t>
void channel_min_max(const scalar_t* x, const GroupLayout& layout, int64_t first, int64_t last,
                     float* lo, float* hi) {
#ifdef MESA_X86_SIMD
  if (runs_avx2()) {
    channel_min_max_avx2(x, layout, first, last, lo, hi);
    return;
  }
#endif
  channel_min_max_loops(x, layout, first, last, lo, hi);
}

// Where the one-byte-per-code loops find each element's group (quantize without bit packing,
// dequantize of 8-bit codes): a constant run, or a repeating pattern of per-element values.
//
// With `inner` >= kMinRun each channel's run of `inner` elements is one group's, and the loop
// body sees one lower / scale. Below that (a channel-last layout has inner == 1), the per-element
// lower and scale of one (channels * inner) period are expanded once per call, repeated to at
// least kMinPattern elements (or the whole tensor), and read alongside the data. Both leave the element loops free of
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
    // One period of (channels * inner) elements, channel by channel, then copies of it: no
    // index arithmetic per element (which cost more than coding a small tensor). Not longer
    // than the tensor needs.
    const int64_t base = layout.channels * layout.inner;
    const int64_t wanted = std::min(kMinPattern, layout.numel);
    const int64_t repeats = std::max<int64_t>(1, (wanted + base - 1) / base);
    period = base * repeats;
    lower.resize(period);
    scale.resize(period);
    for (int64_t c = 0; c < layout.channels; ++c) {
      const int64_t group = c / layout.group_size;
      std::fill_n(lower.begin() + c * layout.inner, layout.inner, lower_g[group]);
      std::fill_n(scale.begin() + c * layout.inner, layout.inner, scale_g[group]);
    }
    for (int64_t r = 1; r < repeats; ++r) {
      std::copy_n(lower.begin(), base, lower.begin() + r * base);
      std::copy_n(scale.begin(), base, scale.begin() + r * base);
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

// Philox blocks drawn together by the portable tile_uniforms (philox4x32_10_lanes).
constexpr int kLanes = 4;

#ifdef MESA_X86_SIMD
// Philox blocks one pass of the AVX2 generator draws: four sets of eight, so that the
// multiplies of independent sets overlap.
constexpr int kSimdSets = 4;
constexpr int kSimdBlocks = 8 * kSimdSets;

// mul_hi_lo of eight lanes: the 32-bit halves of a * m, each lane's 64-bit product.
__attribute__((target("avx2"))) inline void mul_hi_lo_avx2(__m256i a, __m256i m, __m256i& hi,
                                                           __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// The uniforms of `blocks` consecutive Philox blocks from counter `counter` (rounded up to a
// multiple of kSimdBlocks; `out` holds 4 floats per block): rounding_block and unit_uniform
// computed eight lanes at a time. Integer arithmetic and the same exact fp32 multiply, so the
// values are bit-identical to the portable loop's.
__attribute__((target("avx2"))) void philox_uniforms_avx2(uint64_t seed, uint64_t counter,
                                                          uint64_t blocks, float* out) {
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256 unit = _mm256_set1_ps(0x1p-24f);
  for (uint64_t b = 0; b < blocks; b += kSimdBlocks) {
    __m256i c0[kSimdSets], c1[kSimdSets], c2[kSimdSets], c3[kSimdSets];
    for (int s = 0; s < kSimdSets; ++s) {
      // 64-bit counters base + lane as low and high words: the high word takes a carry in the
      // lanes whose low word wrapped (unsigned low < base_low, compared with the sign flipped)
      const uint64_t base = counter + b + 8 * s;
      const __m256i base_low = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base)));
      c0[s] = _mm256_add_epi32(base_low, lanes);
      const __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(base_low, sign),
                                                 _mm256_xor_si256(c0[s], sign));
      c1[s] = _mm256_sub_epi32(
          _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32))), wrapped);
      c2[s] = _mm256_setzero_si256();
      c3[s] = _mm256_setzero_si256();
    }
    uint32_t key0 = static_cast<uint32_t>(seed);
    uint32_t key1 = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r) {  // philox4x32_10_lanes' rounds
      if (r > 0) {
        key0 += 0x9E3779B9u;
        key1 += 0xBB67AE85u;
      }
      const __m256i k0 = _mm256_set1_epi32(static_cast<int>(key0));
      const __m256i k1 = _mm256_set1_epi32(static_cast<int>(key1));
      for (int s = 0; s < kSimdSets; ++s) {
        __m256i hi0, lo0, hi1, lo1;
        mul_hi_lo_avx2(c0[s], mul0, hi0, lo0);
        mul_hi_lo_avx2(c2[s], mul1, hi1, lo1);
        c0[s] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[s]), k0);
        c2[s] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[s]), k1);
        c1[s] = lo1;
        c3[s] = lo0;
      }
    }
    for (int s = 0; s < kSimdSets; ++s) {
      // unit_uniform of each word, then word k of block l to out[4 * l + k]
      __m256 u[4];
      const __m256i words[4] = {c0[s], c1[s], c2[s], c3[s]};
      for (int k = 0; k < 4; ++k) {
        u[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(words[k], 8)), unit);
      }
      const __m256 t0 = _mm256_unpacklo_ps(u[0], u[1]);
      const __m256 t1 = _mm256_unpackhi_ps(u[0], u[1]);
      const __m256 t2 = _mm256_unpacklo_ps(u[2], u[3]);
      const __m256 t3 = _mm256_unpackhi_ps(u[2], u[3]);
      const __m256 v0 = _mm256_shuffle_ps(t0, t2, 0x44);  // blocks 0 and 4
      const __m256 v1 = _mm256_shuffle_ps(t0, t2, 0xEE);  // blocks 1 and 5
      const __m256 v2 = _mm256_shuffle_ps(t1, t3, 0x44);  // blocks 2 and 6
      const __m256 v3 = _mm256_shuffle_ps(t1, t3, 0xEE);  // blocks 3 and 7
      float* o = out + 4 * (b + 8 * s);
      _mm256_storeu_ps(o + 0, _mm256_permute2f128_ps(v0, v1, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(v2, v3, 0x20));
      _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(v0, v1, 0x31));
      _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(v2, v3, 0x31));
    }
  }
}

// Philox blocks one pass of the AVX-512 generator draws: four sets of sixteen.
constexpr int kWideBlocks = 16 * kSimdSets;

// philox_uniforms_avx2 sixteen lanes at a time (the same integer arithmetic and fp32 multiply,
// so the same values); `blocks` is rounded up to a multiple of kWideBlocks.
__attribute__((target("avx512f"))) void philox_uniforms_avx512(uint64_t seed, uint64_t counter,
                                                               uint64_t blocks, float* out) {
  const __m512i mul0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i mul1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 unit = _mm512_set1_ps(0x1p-24f);
  const __m512i hi_words = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                             15, 31);
  const __m512i lo_words = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                             14, 30);
  for (uint64_t b = 0; b < blocks; b += kWideBlocks) {
    __m512i c0[kSimdSets], c1[kSimdSets], c2[kSimdSets], c3[kSimdSets];
    for (int s = 0; s < kSimdSets; ++s) {
      const uint64_t base = counter + b + 16 * s;
      const __m512i base_low = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base)));
      c0[s] = _mm512_add_epi32(base_low, lanes);
      const __mmask16 wrapped = _mm512_cmplt_epu32_mask(c0[s], base_low);
      const __m512i high = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32)));
      c1[s] = _mm512_mask_add_epi32(high, wrapped, high, one);
      c2[s] = _mm512_setzero_si512();
      c3[s] = _mm512_setzero_si512();
    }
    uint32_t key0 = static_cast<uint32_t>(seed);
    uint32_t key1 = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      if (r > 0) {
        key0 += 0x9E3779B9u;
        key1 += 0xBB67AE85u;
      }
      const __m512i k0 = _mm512_set1_epi32(static_cast<int>(key0));
      const __m512i k1 = _mm512_set1_epi32(static_cast<int>(key1));
      for (int s = 0; s < kSimdSets; ++s) {
        // 64-bit products of the even and the odd lanes, split into 32-bit halves
        const __m512i even0 = _mm512_mul_epu32(c0[s], mul0);
        const __m512i odd0 = _mm512_mul_epu32(_mm512_srli_epi64(c0[s], 32), mul0);
        const __m512i even1 = _mm512_mul_epu32(c2[s], mul1);
        const __m512i odd1 = _mm512_mul_epu32(_mm512_srli_epi64(c2[s], 32), mul1);
        const __m512i hi0 = _mm512_permutex2var_epi32(even0, hi_words, odd0);
        const __m512i lo0 = _mm512_permutex2var_epi32(even0, lo_words, odd0);
        const __m512i hi1 = _mm512_permutex2var_epi32(even1, hi_words, odd1);
        const __m512i lo1 = _mm512_permutex2var_epi32(even1, lo_words, odd1);
        c0[s] = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[s]), k0);
        c2[s] = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[s]), k1);
        c1[s] = lo1;
        c3[s] = lo0;
      }
    }
    for (int s = 0; s < kSimdSets; ++s) {
      // unit_uniform of each word, then word k of block l to out[4 * l + k]: blocks 4j + i
      // gathered in 128-bit lane j of v[i], then those lanes transposed
      __m512 u[4];
      const __m512i words[4] = {c0[s], c1[s], c2[s], c3[s]};
      for (int k = 0; k < 4; ++k) {
        u[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(words[k], 8)), unit);
      }
      const __m512 t0 = _mm512_unpacklo_ps(u[0], u[1]);
      const __m512 t1 = _mm512_unpackhi_ps(u[0], u[1]);
      const __m512 t2 = _mm512_unpacklo_ps(u[2], u[3]);
      const __m512 t3 = _mm512_unpackhi_ps(u[2], u[3]);
      const __m512 v0 = _mm512_shuffle_ps(t0, t2, 0x44);
      const __m512 v1 = _mm512_shuffle_ps(t0, t2, 0xEE);
      const __m512 v2 = _mm512_shuffle_ps(t1, t3, 0x44);
      const __m512 v3 = _mm512_shuffle_ps(t1, t3, 0xEE);
      const __m512 a = _mm512_shuffle_f32x4(v0, v1, 0x44);
      const __m512 b2 = _mm512_shuffle_f32x4(v2, v3, 0x44);
      const __m512 c = _mm512_shuffle_f32x4(v0, v1, 0xEE);
      const __m512 d = _mm512_shuffle_f32x4(v2, v3, 0xEE);
      float* o = out + 4 * (b + 16 * s);
      _mm512_storeu_ps(o + 0, _mm512_shuffle_f32x4(a, b2, 0x88));
      _mm512_storeu_ps(o + 16, _mm512_shuffle_f32x4(a, b2, 0xDD));
      _mm512_storeu_ps(o + 32, _mm512_shuffle_f32x4(c, d, 0x88));
      _mm512_storeu_ps(o + 48, _mm512_shuffle_f32x4(c, d, 0xDD));
    }
  }
}

// Whether the AVX-512 loops run (stochastic rounding's draws, the code loops): torch's CPU
// capability is AVX512 (ATEN_CPU_CAPABILITY lowers it) and the CPU has the AVX-512 F, BW, VL
// and DQ sets they are built for (those torch's AVX512 capability asks for too).
bool runs_avx512() {
  static const bool avx512 = [] {
    return at::get_cpu_capability() == "AVX512" && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return avx512;
}

// Whether the AVX2 loops run (stochastic rounding's draws, the code loops, pack_positive):
// torch's CPU capability (which honours ATEN_CPU_CAPABILITY, so CI can run the portable loops
// too) is AVX2 or above.
bool runs_avx2() {
  static const bool avx2 = [] {
    const std::string capability = at::get_cpu_capability();
    return (capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2");
  }();
  return avx2;
}
#else
constexpr int kSimdBlocks = kLanes;
#endif

// The most blocks one pass of any generator draws.
#ifdef MESA_X86_SIMD
constexpr int kPassBlocks = kWideBlocks;
#else
constexpr int kPassBlocks = kSimdBlocks;
#endif

// Floats tile_uniforms writes for one tile: its blocks (one more when it starts inside a
// block), rounded up to a whole number of passes of either generator.
constexpr int64_t kTileBuffer =
    4 * ((kTile / 4 + 1 + kPassBlocks - 1) / kPassBlocks) * kPassBlocks;
static_assert(kSimdBlocks % kLanes == 0, "a pass of the AVX2 generator covers whole lanes");

// noise[j] = the uniform of flat index begin + j, for j < count <= kTile; `buffer` holds
// kTileBuffer floats. The draws are rounding_block's, kLanes (or kSimdBlocks) blocks at a time.
inline const float* tile_uniforms(uint64_t seed, uint64_t offset, int64_t begin, int64_t count,
                                  float* buffer) {
  const uint64_t first = static_cast<uint64_t>(begin) >> 2;
  const uint64_t blocks = ((static_cast<uint64_t>(begin + count) + 3) >> 2) - first;
#ifdef MESA_X86_SIMD
  if (runs_avx512()) {
    philox_uniforms_avx512(seed, offset + first, blocks, buffer);
    return buffer + (begin & 3);
  }
  if (runs_avx2()) {
    philox_uniforms_avx2(seed, offset + first, blocks, buffer);
    return buffer + (begin & 3);
  }
#endif
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

// The element loops of quantize and dequantize. The compiler vectorizes them for the instruction
// set of the function they are inlined into, so each runs in three builds: the compiler's
// baseline (SSE2 on x86-64), AVX2 where runs_avx2() and AVX-512 where runs_avx512() (two and
// four times the lanes). The operations and their roundings are the same in all three (no FMA:
// -ffp-contract=off), and so are the results.
template <typename scalar_t, bool kStochastic, bool kPerElement>
__attribute__((always_inline)) inline void encode_elements(
    const scalar_t* x, int64_t count, const float* lower, const float* scale, float levels,
    const float* noise, uint8_t* out) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t g = kPerElement ? j : 0;
    out[j] = encode<kStochastic>(static_cast<float>(x[j]), lower[g], scale[g], levels,
                                 kStochastic ? noise[j] : 0.0f);
  }
}

template <typename scalar_t, bool kPerElement>
__attribute__((always_inline)) inline void decode_elements(
    const uint8_t* codes, int64_t count, const float* lower, const float* scale, scalar_t* out) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t g = kPerElement ? j : 0;
    out[j] = static_cast<scalar_t>(decode(codes[j], lower[g], scale[g]));
  }
}

#ifdef MESA_X86_SIMD
template <typename scalar_t, bool kStochastic, bool kPerElement>
__attribute__((target("avx2"))) void encode_elements_avx2(
    const scalar_t* x, int64_t count, const float* lower, const float* scale, float levels,
    const float* noise, uint8_t* out) {
  encode_elements<scalar_t, kStochastic, kPerElement>(x, count, lower, scale, levels, noise, out);
}

template <typename scalar_t, bool kPerElement>
__attribute__((target("avx2"))) void decode_elements_avx2(
    const uint8_t* codes, int64_t count, const float* lower, const float* scale, scalar_t* out) {
  decode_elements<scalar_t, kPerElement>(codes, count, lower, scale, out);
}

template <typename scalar_t, bool kStochastic, bool kPerElement>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void encode_elements_avx512(
    const scalar_t* x, int64_t count, const float* lower, const float* scale, float levels,
    const float* noise, uint8_t* out) {
  encode_elements<scalar_t, kStochastic, kPerElement>(x, count, lower, scale, levels, noise, out);
}

template <typename scalar_t, bool kPerElement>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void decode_elements_avx512(
    const uint8_t* codes, int64_t count, const float* lower, const float* scale, scalar_t* out) {
  decode_elements<scalar_t, kPerElement>(codes, count, lower, scale, out);
}
#endif

template <typename scalar_t, bool kStochastic, bool kPerElement>
void encode_span(const scalar_t* x, int64_t count, const float* lower, const float* scale,
                 float levels, const float* noise, uint8_t* out) {
#ifdef MESA_X86_SIMD
  if (runs_avx512()) {
    encode_elements_avx512<scalar_t, kStochastic, kPerElement>(x, count, lower, scale, levels,
                                                               noise, out);
    return;
  }
  if (runs_avx2()) {
    encode_elements_avx2<scalar_t, kStochastic, kPerElement>(x, count, lower, scale, levels,
                                                             noise, out);
    return;
  }
#endif
  encode_elements<scalar_t, kStochastic, kPerElement>(x, count, lower, scale, levels, noise, out);
}

template <typename scalar_t, bool kPerElement>
void decode_span(const uint8_t* codes, int64_t count, const float* lower, const float* scale,
                 scalar_t* out) {
#ifdef MESA_X86_SIMD
  if (runs_avx512()) {
    decode_elements_avx512<scalar_t, kPerElement>(codes, count, lower, scale, out);
    return;
  }
  if (runs_avx2()) {
    decode_elements_avx2<scalar_t, kPerElement>(codes, count, lower, scale, out);
    return;
  }
#endif
  decode_elements<scalar_t, kPerElement>(codes, count, lower, scale, out);
}

// The moments of a row-standardized pack: element i is coded as row_standardized(x[i],
// mean[i / row_len], rstd[i / row_len]). No mean: x as it is.
struct RowStats {
  const float* mean = nullptr;
  const float* rstd = nullptr;
  int64_t row_len = 1;
};

// row_standardized values of x[position, position + n) into out.
template <typename scalar_t>
void standardize_rows(const scalar_t* x, int64_t position, int64_t n, const RowStats& rows,
                      float* __restrict out) {
  int64_t row = position / rows.row_len;
  int64_t j = 0;
  while (j < n) {
    const int64_t stop = std::min(n, (row + 1) * rows.row_len - position);
    const float m = rows.mean[row];
    const float r = rows.rstd[row];
    for (; j < stop; ++j) {
      out[j] = row_standardized(static_cast<float>(x[position + j]), m, r);
    }
    ++row;
  }
}

// Codes one per byte (8-bit codes, or sub-byte ones left unpacked).
template <typename scalar_t, bool kStochastic>
void quantize_bytes(const scalar_t* x, const float* lower, const float* scale, uint8_t* out,
                    const GroupLayout& layout, float levels, uint64_t seed, uint64_t offset,
                    const RowStats& rows) {
  const GroupPattern pattern(layout, lower, scale);
  at::parallel_for(0, layout.numel, kGrainElements, [&](int64_t first, int64_t last) {
    float buffer[kTileBuffer];
    float standardized[kTile];
    for_each_span(layout, pattern, lower, scale, first, last,
                  [&](int64_t position, int64_t count, const float* lo, const float* sc,
                      auto per_element) {
      constexpr bool kPer = decltype(per_element)::value;
      for (int64_t t = 0; t < count; t += kTile) {
        const int64_t n = std::min(kTile, count - t);
        const float* noise =
            kStochastic ? tile_uniforms(seed, offset, position + t, n, buffer) : nullptr;
        if (rows.mean != nullptr) {
          standardize_rows(x, position + t, n, rows, standardized);
          encode_span<float, kStochastic, kPer>(standardized, n, kPer ? lo + t : lo,
                                                kPer ? sc + t : sc, levels, noise,
                                                out + position + t);
        } else {
          encode_span<scalar_t, kStochastic, kPer>(x + position + t, n, kPer ? lo + t : lo,
                                                   kPer ? sc + t : sc, levels, noise,
                                                   out + position + t);
        }
      }
    });
  });
}

// Bit-packed codes: a chunk of kChunk codes fills `bits` whole bytes.
template <typename scalar_t, bool kStochastic>
void quantize_packed(const scalar_t* x, const float* lower, const float* scale, uint8_t* out,
                     const GroupLayout& layout, int bits, float levels, uint64_t seed,
                     uint64_t offset, const RowStats& rows) {
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
      if (rows.mean != nullptr) {
        standardize_rows(x, begin, count, rows, values);
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
                   uint64_t offset, const RowStats& rows) {
  if (!pack || bits == 8) {
    quantize_bytes<scalar_t, kStochastic>(x, lower, scale, out, layout, levels, seed, offset,
                                          rows);
  } else {
    quantize_packed<scalar_t, kStochastic>(x, lower, scale, out, layout, bits, levels, seed,
                                           offset, rows);
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

// This batch's min and max over the finite values of each group, +inf / -inf where a group has
// none (an empty tensor has none anywhere). Runs of one channel (inner elements each) are split
// into one share per thread; the shares' per-channel ranges are merged per group.
void batch_group_range(const at::Tensor& x, const GroupLayout& layout,
                       float* group_lo, float* group_hi, const RowStats& rows = {}) {
  std::fill(group_lo, group_lo + layout.groups, std::numeric_limits<float>::infinity());
  std::fill(group_hi, group_hi + layout.groups, -std::numeric_limits<float>::infinity());
  if (layout.numel == 0) {
    return;
  }
  const int64_t runs = layout.numel / layout.inner;
  const int64_t shares = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), layout.numel / kGrainElements));
  const int64_t channels = layout.channels;
  std::vector<float> lo(shares * channels, std::numeric_limits<float>::infinity());
  std::vector<float> hi(shares * channels, -std::numeric_limits<float>::infinity());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "observe", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    if (rows.mean != nullptr) {
      // Row by row (channels * inner elements, one mean and rstd): standardized into a buffer,
      // whose channel ranges merge as those of a tensor of one row would.
      const int64_t row_len = rows.row_len;
      const int64_t row_count = layout.numel / row_len;
      GroupLayout one_row = layout;
      one_row.numel = row_len;
      at::parallel_for(0, shares, 1, [&](int64_t first, int64_t last) {
        std::vector<float> buffer(row_len);
        for (int64_t share = first; share < last; ++share) {
          for (int64_t row = row_count * share / shares; row < row_count * (share + 1) / shares;
               ++row) {
            standardize_rows(data, row * row_len, row_len, rows, buffer.data());
            channel_min_max(buffer.data(), one_row, 0, channels, lo.data() + share * channels,
                            hi.data() + share * channels);
          }
        }
      });
      return;
    }
    at::parallel_for(0, shares, 1, [&](int64_t first, int64_t last) {
      for (int64_t share = first; share < last; ++share) {
        channel_min_max(data, layout, runs * share / shares, runs * (share + 1) / shares,
                        lo.data() + share * channels, hi.data() + share * channels);
      }
    });
  });
  for (int64_t g = 0; g < layout.groups; ++g) {
    const int64_t c_end = std::min(channels, (g + 1) * layout.group_size);
    for (int64_t share = 0; share < shares; ++share) {
      for (int64_t c = g * layout.group_size; c < c_end; ++c) {
        group_lo[g] = std::min(group_lo[g], lo[share * channels + c]);
        group_hi[g] = std::max(group_hi[g], hi[share * channels + c]);
      }
    }
  }
}

// ema_group_update on the running estimates held by three tensors, one group at a time.
class EmaUpdate {
 public:
  EmaUpdate(const at::Tensor& lower, const at::Tensor& span, const at::Tensor& seen,
            double decay)
      : lower_(lower.mutable_data_ptr<float>()),
        span_(span.mutable_data_ptr<float>()),
        seen_(seen.mutable_data_ptr<bool>()),
        // Python computes `decay * t` and `(1.0 - decay) * t` with the double scalars cast to
        // fp32.
        decay_(static_cast<float>(decay)),
        keep_new_(static_cast<float>(1.0 - decay)) {}

  void operator()(int64_t g, float lo, float hi, float& cover_lower, float& cover_span) const {
    ema_group_update(lo, hi, decay_, keep_new_, lower_[g], span_[g], seen_[g], cover_lower,
                     cover_span);
  }

 private:
  float* lower_;
  float* span_;
  bool* seen_;
  float decay_;
  float keep_new_;
};

// quantize_loop for x's dtype and the rounding mode.
void quantize_dispatch(const at::Tensor& x, const float* lower,
                       const float* scale, const at::Tensor& codes, const GroupLayout& layout,
                       int64_t bits, bool stochastic, int64_t seed, int64_t offset, bool pack,
                       const RowStats& rows = {}) {
  const float levels = static_cast<float>((1 << bits) - 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize", [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    uint8_t* out = codes.mutable_data_ptr<uint8_t>();
    const int width = static_cast<int>(bits);
    if (stochastic) {
      quantize_loop<scalar_t, true>(in, lower, scale, out, layout, width, pack, levels,
                                    static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                                    rows);
    } else {
      quantize_loop<scalar_t, false>(in, lower, scale, out, layout, width, pack, levels, 0, 0,
                                     rows);
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
  std::vector<float> lo(layout.groups), hi(layout.groups);
  batch_group_range(x, layout, lo.data(), hi.data());
  const at::Tensor cover = at::empty({2, layout.groups}, lower.options());
  float* cover_lower = cover.mutable_data_ptr<float>();
  EmaUpdate ema(lower, span, seen, decay);
  for (int64_t g = 0; g < layout.groups; ++g) {
    ema(g, lo[g], hi[g], cover_lower[g], cover_lower[layout.groups + g]);
  }
  return cover;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> observe_quantize_cpu(
    const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span, const at::Tensor& seen,
    const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& rstd,
    int64_t group_dim, int64_t group_size, double decay, int64_t bits, bool stochastic,
    int64_t seed, int64_t offset, bool pack, bool rows) {
  constexpr const char* op = "mmseg_mesa::observe_quantize";
  const GroupLayout layout =
      check_observe_quantize_args(op, x, lower, span, seen, mean, rstd, group_dim, group_size,
                                  decay, bits, pack, rows, c10::DeviceType::CPU);
  const int64_t groups = layout.groups;
  // Row-standardized: every value standardized as it is read, in both passes.
  RowStats row_stats;
  if (rows) {
    row_stats = RowStats{mean->const_data_ptr<float>(), rstd->const_data_ptr<float>(),
                         std::max<int64_t>(1, layout.channels * layout.inner)};
  }
  std::vector<float> lo(groups), hi(groups);
  batch_group_range(x, layout, lo.data(), hi.data(), row_stats);
  const at::Tensor used_lower = at::empty({groups}, lower.options());
  const at::Tensor used_scale = at::empty({groups}, lower.options());
  float* out_lower = used_lower.mutable_data_ptr<float>();
  float* out_scale = used_scale.mutable_data_ptr<float>();
  const float levels = static_cast<float>((1 << bits) - 1);
  // Standardized: the range is observed in (x - mean) * rstd, x is coded over that range mapped
  // back (quantizer.pack_standardized; rstd > 0 keeps the map monotone).
  const float* m = mean.has_value() && !rows ? mean->const_data_ptr<float>() : nullptr;
  const float* r = rstd.has_value() && !rows ? rstd->const_data_ptr<float>() : nullptr;
  std::vector<float> x_lower(m != nullptr ? groups : 0), x_scale(m != nullptr ? groups : 0);
  float* running_lower = lower.mutable_data_ptr<float>();
  float* running_span = span.mutable_data_ptr<float>();
  bool* running_seen = seen.mutable_data_ptr<bool>();
  // Python computes `decay * t` and `(1.0 - decay) * t` with the double scalars cast to fp32.
  const float decay_f = static_cast<float>(decay);
  const float keep_new = static_cast<float>(1.0 - decay);
  for (int64_t g = 0; g < groups; ++g) {
    const GroupAffine affine = pack_group_range(
        lo[g], hi[g], m != nullptr, m != nullptr ? m[g] : 0.0f, r != nullptr ? r[g] : 1.0f,
        decay_f, keep_new, levels, running_lower[g], running_span[g], running_seen[g]);
    out_lower[g] = affine.used_lower;
    out_scale[g] = affine.used_scale;
    if (m != nullptr) {
      x_lower[g] = affine.x_lower;
      x_scale[g] = affine.x_scale;
    }
  }
  at::Tensor codes = at::empty(quantized_shape(x, bits, pack), x.options().dtype(at::kByte));
  if (layout.numel > 0) {
    quantize_dispatch(x, m != nullptr ? x_lower.data() : out_lower,
                      m != nullptr ? x_scale.data() : out_scale, codes, layout, bits, stochastic,
                      seed, offset, pack, row_stats);
  }
  return {codes, used_lower, used_scale};
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
  quantize_dispatch(x, lower.const_data_ptr<float>(), scale.const_data_ptr<float>(), codes,
                    layout, bits, stochastic, seed, offset, pack);
  return codes;
}

at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& lower,
                          const at::Tensor& scale, int64_t bits, at::IntArrayRef shape,
                          int64_t group_dim, int64_t group_size, at::ScalarType dtype,
                          const std::optional<at::Tensor>& divisor) {
  constexpr const char* op = "mmseg_mesa::dequantize";
  const GroupLayout layout = check_dequantize_args(op, codes, lower, scale, bits, shape,
                                                   group_dim, group_size, dtype,
                                                   c10::DeviceType::CPU);
  const int64_t row_len = check_divisor(op, divisor, codes, layout);
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  if (layout.numel == 0) {
    return out;
  }
  // With a divisor the fp32 values are divided by their row's before the cast: decoded into
  // fp32 (the output itself where it is fp32), then divided in a second pass.
  const at::Tensor decoded =
      row_len > 0 && dtype != at::kFloat ? at::empty(shape, codes.options().dtype(at::kFloat))
                                         : out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, decoded.scalar_type(), op, [&] {
    dequantize_loop<scalar_t>(codes.const_data_ptr<uint8_t>(), lower.const_data_ptr<float>(),
                              scale.const_data_ptr<float>(),
                              decoded.mutable_data_ptr<scalar_t>(), layout,
                              static_cast<int>(bits));
  });
  if (row_len == 0) {
    return out;
  }
  const float* values = decoded.const_data_ptr<float>();
  const float* d = divisor->const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, op, [&] {
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, layout.numel / row_len, std::max<int64_t>(1, kGrainElements / row_len),
                     [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const float by = d[row];
        for (int64_t i = row * row_len; i < (row + 1) * row_len; ++i) {
          result[i] = static_cast<scalar_t>(div_rn(values[i], by));
        }
      }
    });
  });
  return out;
}

// Bytes [first, last) of mmseg_mesa/bitpack.py's 1-bit layout: bit j of byte i is flag(8 * i + j)
// for the `numel` flags, the last byte padded with zero bits.
template <typename Flag>
void pack_flags(int64_t numel, int64_t first, int64_t last, uint8_t* out, Flag&& flag) {
  for (int64_t i = first; i < last; ++i) {
    uint32_t byte = 0;
    if (8 * i + 8 <= numel) {  // a constant trip count: unrolled
      for (int j = 0; j < 8; ++j) {
        byte |= static_cast<uint32_t>(flag(8 * i + j)) << j;
      }
    } else {
      for (int64_t j = 0; j < numel - 8 * i; ++j) {
        byte |= static_cast<uint32_t>(flag(8 * i + j)) << j;
      }
    }
    out[i] = static_cast<uint8_t>(byte);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> refine_cpu(
    const at::Tensor& x, const at::Tensor& codes, const at::Tensor& lower,
    const at::Tensor& scale, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& rstd, int64_t group_dim, int64_t group_size) {
  constexpr const char* op = "mmseg_mesa::refine";
  const GroupLayout layout = check_refine_args(op, x, codes, lower, scale, mean, rstd, group_dim,
                                               group_size, c10::DeviceType::CPU);
  const at::Tensor fine_lower = at::empty({layout.groups}, lower.options());
  const at::Tensor fine_scale = at::empty({layout.groups}, lower.options());
  const float* lo = lower.const_data_ptr<float>();
  const float* sc = scale.const_data_ptr<float>();
  float* fine_lo = fine_lower.mutable_data_ptr<float>();
  float* fine_sc = fine_scale.mutable_data_ptr<float>();
  for (int64_t g = 0; g < layout.groups; ++g) {
    fine_sc[g] = fine_step(sc[g]);
    fine_lo[g] = fine_lower_of(fine_sc[g]);
  }
  at::Tensor fine = at::empty(x.sizes(), x.options().dtype(at::kByte));
  // Standardized: the codes are those of (x - mean) * rstd (quantizer.pack_standardized).
  const float* m = mean.has_value() ? mean->const_data_ptr<float>() : nullptr;
  const float* r = rstd.has_value() ? rstd->const_data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    const uint8_t* coarse = codes.const_data_ptr<uint8_t>();
    uint8_t* out = fine.mutable_data_ptr<uint8_t>();
    at::parallel_for(0, layout.numel, kGrainElements, [&](int64_t first, int64_t last) {
      GroupCursor cursor(layout, first);
      for (int64_t i = first; i < last; ++i) {
        const int32_t g = cursor.group;
        float v = static_cast<float>(in[i]);
        if (m != nullptr) {
          v = mul_rn(sub_rn(v, m[g]), r[g]);
        }
        out[i] = fine_code(v, coarse[i], lo[g], sc[g], fine_sc[g]);
        cursor.advance(layout);
      }
    });
  });
  return {fine, fine_lower, fine_scale};
}

at::Tensor dequantize_refined_cpu(const at::Tensor& codes, const at::Tensor& fine,
                                  const at::Tensor& lower, const at::Tensor& scale,
                                  const at::Tensor& fine_lower, const at::Tensor& fine_scale,
                                  at::IntArrayRef shape, int64_t group_dim, int64_t group_size,
                                  at::ScalarType dtype) {
  constexpr const char* op = "mmseg_mesa::dequantize_refined";
  const GroupLayout layout =
      check_dequantize_refined_args(op, codes, fine, lower, scale, fine_lower, fine_scale, shape,
                                    group_dim, group_size, dtype, c10::DeviceType::CPU);
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  const uint8_t* coarse = codes.const_data_ptr<uint8_t>();
  const uint8_t* fine_codes = fine.const_data_ptr<uint8_t>();
  const float* lo = lower.const_data_ptr<float>();
  const float* sc = scale.const_data_ptr<float>();
  const float* fine_lo = fine_lower.const_data_ptr<float>();
  const float* fine_sc = fine_scale.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, op, [&] {
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, layout.numel, kGrainElements, [&](int64_t first, int64_t last) {
      GroupCursor cursor(layout, first);
      for (int64_t i = first; i < last; ++i) {
        const int32_t g = cursor.group;
        // The cast is the c10 conversion (round to nearest even) that Tensor.to(dtype) uses.
        result[i] = static_cast<scalar_t>(
            decode_refined(coarse[i], fine_codes[i], lo[g], sc[g], fine_lo[g], fine_sc[g]));
        cursor.advance(layout);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_terms_cpu(
    const at::Tensor& rstd, const at::Tensor& decoded_invstd,
    const std::optional<at::Tensor>& weight, double eps, double reliable) {
  const int64_t channels = check_norm_terms_args("mmseg_mesa::norm_terms", rstd, decoded_invstd,
                                                 weight, c10::DeviceType::CPU);
  at::Tensor eps_share = at::empty({channels}, rstd.options());
  at::Tensor spread = at::empty({channels}, rstd.options());
  at::Tensor scale = at::empty({channels}, rstd.options());
  const float* r = rstd.const_data_ptr<float>();
  const float* d = decoded_invstd.const_data_ptr<float>();
  const float* w = weight.has_value() ? weight->const_data_ptr<float>() : nullptr;
  float* out_share = eps_share.mutable_data_ptr<float>();
  float* out_spread = spread.mutable_data_ptr<float>();
  float* out_scale = scale.mutable_data_ptr<float>();
  for (int64_t c = 0; c < channels; ++c) {
    const NormTerms t = norm_terms(r[c], d[c], w != nullptr ? w[c] : 1.0f, w != nullptr,
                                   static_cast<float>(eps), static_cast<float>(reliable));
    out_share[c] = t.eps_share;
    out_spread[c] = t.spread;
    out_scale[c] = t.scale;
  }
  return {eps_share, spread, scale};
}

at::Tensor pack_mask_cpu(const at::Tensor& mask) {
  constexpr const char* op = "mmseg_mesa::pack_mask";
  check_contiguous(op, "mask", mask, c10::DeviceType::CPU);
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be bool, got ",
              mask.scalar_type());
  const int64_t numel = mask.numel();
  at::Tensor bytes = at::empty({(numel + 7) / 8}, mask.options().dtype(at::kByte));
  const bool* in = mask.const_data_ptr<bool>();
  uint8_t* out = bytes.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, bytes.numel(), kGrainElements / 8, [&](int64_t first, int64_t last) {
    pack_flags(numel, first, last, out, [&](int64_t k) { return in[k]; });
  });
  return bytes;
}

at::Tensor unpack_mask_cpu(const at::Tensor& bytes, at::IntArrayRef shape) {
  constexpr const char* op = "mmseg_mesa::unpack_mask";
  check_contiguous(op, "bytes", bytes, c10::DeviceType::CPU);
  TORCH_CHECK(bytes.scalar_type() == at::kByte, op, ": bytes must be uint8, got ",
              bytes.scalar_type());
  int64_t numel = 1;
  for (const int64_t size : shape) {
    TORCH_CHECK(size >= 0, op, ": negative size in shape ", shape);
    numel *= size;
  }
  TORCH_CHECK(bytes.numel() == (numel + 7) / 8, op, ": bytes hold ", bytes.numel(),
              " bytes, but a mask of shape ", shape, " takes ", (numel + 7) / 8);
  at::Tensor mask = at::empty(shape, bytes.options().dtype(at::kBool));
  const uint8_t* in = bytes.const_data_ptr<uint8_t>();
  bool* out = mask.mutable_data_ptr<bool>();
  at::parallel_for(0, bytes.numel(), kGrainElements / 8, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t count = std::min<int64_t>(8, numel - 8 * i);
      const uint32_t byte = in[i];
      for (int64_t j = 0; j < count; ++j) {
        out[8 * i + j] = ((byte >> j) & 1u) != 0;
      }
    }
  });
  return mask;
}

#ifdef MESA_X86_SIMD
// Bytes [first, last) of pack_positive for float32, all of them whole: one compare and one
// movemask per byte (bit j of the movemask is lane j, bitpack's order).
__attribute__((target("avx2"))) void pack_positive_avx2(const float* in, uint8_t* out,
                                                         int64_t first, int64_t last) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = first; i < last; ++i) {
    const __m256 lane = _mm256_loadu_ps(in + 8 * i);
    out[i] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(lane, zero, _CMP_GT_OQ)));
  }
}
#endif

// pack_mask of `x > 0` for a floating-point x, without the bool tensor in between (ReLU's mask
// of its output). NaN is not positive.
at::Tensor pack_positive_cpu(const at::Tensor& x) {
  constexpr const char* op = "mmseg_mesa::pack_positive";
  check_activation(op, x, c10::DeviceType::CPU);
  const int64_t numel = x.numel();
  at::Tensor bytes = at::empty({(numel + 7) / 8}, x.options().dtype(at::kByte));
  uint8_t* out = bytes.mutable_data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    const scalar_t zero(0);
    at::parallel_for(0, bytes.numel(), kGrainElements / 8, [&](int64_t first, int64_t last) {
#ifdef MESA_X86_SIMD
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (runs_avx2()) {
          const int64_t whole = std::min(last, numel / 8);
          pack_positive_avx2(reinterpret_cast<const float*>(in), out, first,
                             std::max(first, whole));
          first = std::max(first, whole);
        }
      }
#endif
      pack_flags(numel, first, last, out, [&](int64_t k) { return in[k] > zero; });
    });
  });
  return bytes;
}

// For each byte value, the 8 element-wide masks its bits stand for: all ones where bit j is set.
template <typename bits_t>
const bits_t* select_table() {
  static const std::vector<bits_t> table = [] {
    std::vector<bits_t> t(256 * 8);
    for (int byte = 0; byte < 256; ++byte) {
      for (int j = 0; j < 8; ++j) {
        t[byte * 8 + j] = ((byte >> j) & 1) != 0 ? static_cast<bits_t>(~bits_t(0)) : bits_t(0);
      }
    }
    return t;
  }();
  return table.data();
}

// out[i] = bit i of `bytes` set ? values[i] : +0, on the elements' bit patterns (an AND with a
// table's mask, so a kept value is copied bit for bit, NaN included).
template <typename bits_t>
void select_by_bits(const uint8_t* bytes, const bits_t* values, bits_t* out, int64_t numel) {
  const bits_t* table = select_table<bits_t>();
  at::parallel_for(0, (numel + 7) / 8, kGrainElements / 8, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const bits_t* m = table + 8 * static_cast<int64_t>(bytes[i]);
      const bits_t* v = values + 8 * i;
      bits_t* o = out + 8 * i;
      if (8 * i + 8 <= numel) {
        for (int j = 0; j < 8; ++j) {
          o[j] = v[j] & m[j];
        }
      } else {
        for (int64_t j = 0; j < numel - 8 * i; ++j) {
          o[j] = v[j] & m[j];
        }
      }
    }
  });
}

namespace {

// `out` (values' shape; values itself, in place) as values where the packed bit is set, else +0.
void select_into(const char* op, const at::Tensor& values, const at::Tensor& bytes,
                 const at::Tensor& out) {
  check_contiguous(op, "values", values, c10::DeviceType::CPU);
  check_contiguous(op, "bytes", bytes, c10::DeviceType::CPU);
  TORCH_CHECK(is_supported_float(values.scalar_type()), op,
              ": values must be float32, float16, bfloat16 or float64, got ",
              values.scalar_type());
  TORCH_CHECK(bytes.scalar_type() == at::kByte, op, ": bytes must be uint8, got ",
              bytes.scalar_type());
  const int64_t numel = values.numel();
  TORCH_CHECK(bytes.numel() == (numel + 7) / 8, op, ": bytes hold ", bytes.numel(),
              " bytes, but values of shape ", values.sizes(), " take ", (numel + 7) / 8);
  if (numel == 0) {
    return;
  }
  // The bit patterns, not the values: the same loop serves every width (element by element,
  // so out may be values).
  const void* in = values.const_data_ptr();
  void* dst = out.mutable_data_ptr();
  switch (values.element_size()) {
    case 2:
      select_by_bits(bytes.const_data_ptr<uint8_t>(), static_cast<const uint16_t*>(in),
                     static_cast<uint16_t*>(dst), numel);
      break;
    case 4:
      select_by_bits(bytes.const_data_ptr<uint8_t>(), static_cast<const uint32_t*>(in),
                     static_cast<uint32_t*>(dst), numel);
      break;
    default:
      select_by_bits(bytes.const_data_ptr<uint8_t>(), static_cast<const uint64_t*>(in),
                     static_cast<uint64_t*>(dst), numel);
  }
}

}  // namespace

at::Tensor mask_select_cpu(const at::Tensor& values, const at::Tensor& bytes) {
  at::Tensor out = at::empty(values.sizes(), values.options());
  select_into("mmseg_mesa::mask_select", values, bytes, out);
  return out;
}

void mask_select_cpu_(const at::Tensor& values, const at::Tensor& bytes) {
  select_into("mmseg_mesa::mask_select_", values, bytes, values);
}

bool cpu_kernels_parallel() {
#ifdef INTRA_OP_PARALLEL  // defined by ATen/Parallel.h where at::parallel_for splits work
  return true;
#else
  return false;
#endif
}

}  // namespace mmseg_mesa
