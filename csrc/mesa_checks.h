// Argument validation shared by every mmseg_mesa op (CPU and CUDA), and the group layout the
// kernels index with (mesa_numerics.h). Every check names the op and the argument, so a failure
// says what to fix.
#pragma once

#include "mesa_numerics.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace mmseg_mesa {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// `device` is the kernels' device type: each op's CPU and CUDA implementations check their own.
inline void check_contiguous(const char* op, const char* name, const at::Tensor& t,
                             c10::DeviceType device) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().type() == device, op, ": ", name, " must be a ",
              device == c10::DeviceType::CUDA ? "CUDA" : "CPU", " tensor, got one on ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got sizes ", t.sizes(),
              " and strides ", t.strides(), "; call .contiguous() first");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(),
              " but the activation is on ", ref.device());
}

// The activation (or its codes) and its grouping along group_dim (non-negative or negative).
inline GroupLayout group_layout(const char* op, at::IntArrayRef sizes, int64_t group_dim,
                                int64_t group_size) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(ndim >= 1, op, ": expected a tensor with at least one dimension, got a scalar");
  TORCH_CHECK(group_dim >= -ndim && group_dim < ndim, op, ": group_dim=", group_dim,
              " is out of range for a ", ndim, "-d tensor");
  if (group_dim < 0) {
    group_dim += ndim;
  }
  TORCH_CHECK(group_size >= 1, op, ": group_size must be >= 1, got ", group_size);
  GroupLayout layout{};
  layout.numel = 1;
  for (const int64_t size : sizes) {
    TORCH_CHECK(size >= 0, op, ": negative size in shape ", sizes);
    layout.numel *= size;
  }
  layout.channels = sizes[group_dim];
  TORCH_CHECK(layout.channels <= std::numeric_limits<int32_t>::max(), op, ": ",
              layout.channels, " channels along group_dim exceed the kernels' 32-bit range");
  layout.inner = 1;
  for (int64_t d = group_dim + 1; d < ndim; ++d) {
    layout.inner *= sizes[d];
  }
  layout.groups = layout.channels == 0 ? 0 : (layout.channels - 1) / group_size + 1;
  // A group wider than the tensor is one group of all channels; clamping keeps the kernels'
  // channel arithmetic in 32 bits.
  layout.group_size = std::min(group_size, std::max<int64_t>(layout.channels, 1));
  layout.narrow = layout.numel < std::numeric_limits<int32_t>::max();
  return layout;
}

// A per-group fp32 (or bool) vector such as lower, scale, span or seen.
inline void check_group_vector(const char* op, const char* name, const at::Tensor& v,
                               const at::Tensor& ref, const GroupLayout& layout,
                               at::ScalarType dtype) {
  check_contiguous(op, name, v, ref.device().type());
  check_same_device(op, name, v, ref);
  TORCH_CHECK(v.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              v.scalar_type());
  TORCH_CHECK(v.dim() == 1 && v.numel() == layout.groups, op, ": ", name, " must have shape (",
              layout.groups, ",) for ", layout.channels, " channels in groups of ",
              layout.group_size, ", got ", v.sizes());
}

inline void check_activation(const char* op, const at::Tensor& x, c10::DeviceType device) {
  check_contiguous(op, "x", x, device);
  TORCH_CHECK(is_supported_float(x.scalar_type()), op,
              ": x must be float32, float16, bfloat16 or float64, got ", x.scalar_type());
}

}  // namespace mmseg_mesa

namespace mmseg_mesa {

// The optional per-group mean and rstd of a standardized pack: both or neither, fp32 vectors.
inline void check_standardization(const char* op, const std::optional<at::Tensor>& mean,
                                  const std::optional<at::Tensor>& rstd, const at::Tensor& x,
                                  const GroupLayout& layout) {
  TORCH_CHECK(mean.has_value() == rstd.has_value(), op,
              ": mean and rstd are given together or not at all");
  if (mean.has_value()) {
    check_group_vector(op, "mean", *mean, x, layout, at::kFloat);
    check_group_vector(op, "rstd", *rstd, x, layout, at::kFloat);
  }
}

// Validates observe's arguments and returns the layout of x.
inline GroupLayout check_observe_args(const char* op, const at::Tensor& x,
                                      const at::Tensor& lower, const at::Tensor& span,
                                      const at::Tensor& seen, int64_t group_dim,
                                      int64_t group_size, double decay, c10::DeviceType device) {
  check_activation(op, x, device);
  const GroupLayout layout = group_layout(op, x.sizes(), group_dim, group_size);
  check_group_vector(op, "lower", lower, x, layout, at::kFloat);
  check_group_vector(op, "span", span, x, layout, at::kFloat);
  check_group_vector(op, "seen", seen, x, layout, at::kBool);
  TORCH_CHECK(decay >= 0.0 && decay <= 1.0, op, ": decay must be in [0, 1], got ", decay);
  return layout;
}

// Codes of any width up to 8 bits fit one per byte; packing needs a width that divides 8.
inline void check_code_width(const char* op, int64_t bits, bool pack) {
  TORCH_CHECK(bits >= 1 && bits <= 8, op, ": bits must be in [1, 8], got ", bits);
  TORCH_CHECK(!pack || bits == 1 || bits == 2 || bits == 4 || bits == 8, op,
              ": only 1, 2, 4 or 8-bit codes can be packed, got bits=", bits);
}

// Validates observe_quantize's arguments (observe's, quantize's code width, and the optional
// per-group mean and rstd of a standardized pack) and returns the layout of x.
inline GroupLayout check_observe_quantize_args(const char* op, const at::Tensor& x,
                                               const at::Tensor& lower, const at::Tensor& span,
                                               const at::Tensor& seen,
                                               const std::optional<at::Tensor>& mean,
                                               const std::optional<at::Tensor>& rstd,
                                               int64_t group_dim, int64_t group_size,
                                               double decay, int64_t bits, bool pack,
                                               bool rows, c10::DeviceType device) {
  const GroupLayout layout =
      check_observe_args(op, x, lower, span, seen, group_dim, group_size, decay, device);
  check_code_width(op, bits, pack);
  if (!rows) {
    check_standardization(op, mean, rstd, x, layout);
    return layout;
  }
  // One mean and rstd per row of the (rows, channels * inner) view.
  TORCH_CHECK(mean.has_value() && rstd.has_value(), op,
              ": rows=True needs a mean and an rstd per row");
  const int64_t row_len = layout.channels * layout.inner;
  const int64_t rows_count = row_len > 0 ? layout.numel / row_len : 0;
  for (const auto& [name, v] : {std::pair{"mean", &*mean}, std::pair{"rstd", &*rstd}}) {
    check_contiguous(op, name, *v, device);
    check_same_device(op, name, *v, x);
    TORCH_CHECK(v->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
                v->scalar_type());
    TORCH_CHECK(v->dim() == 1 && v->numel() == rows_count, op, ": ", name,
                " must have one value per row: shape (", rows_count, ",), got ", v->sizes());
  }
  return layout;
}

// Validates quantize's arguments and returns the layout of x.
inline GroupLayout check_quantize_args(const char* op, const at::Tensor& x,
                                       const at::Tensor& lower, const at::Tensor& scale,
                                       int64_t bits, int64_t group_dim, int64_t group_size,
                                       bool pack, c10::DeviceType device) {
  check_activation(op, x, device);
  const GroupLayout layout = group_layout(op, x.sizes(), group_dim, group_size);
  check_group_vector(op, "lower", lower, x, layout, at::kFloat);
  check_group_vector(op, "scale", scale, x, layout, at::kFloat);
  check_code_width(op, bits, pack);
  return layout;
}

// Validates dequantize's arguments: `codes` holds one code per byte (bits == 8, any shape with
// as many elements as `shape`) or the bit-packed codes of `shape` (bitpack.py's layout).
inline GroupLayout check_dequantize_args(const char* op, const at::Tensor& codes,
                                         const at::Tensor& lower, const at::Tensor& scale,
                                         int64_t bits, at::IntArrayRef shape, int64_t group_dim,
                                         int64_t group_size, at::ScalarType dtype,
                                         c10::DeviceType device) {
  check_contiguous(op, "codes", codes, device);
  TORCH_CHECK(codes.scalar_type() == at::kByte, op, ": codes must be uint8, got ",
              codes.scalar_type());
  TORCH_CHECK(is_supported_float(dtype), op,
              ": dtype must be float32, float16, bfloat16 or float64, got ", dtype);
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, op,
              ": bits must be in (1, 2, 4, 8), got ", bits);
  const GroupLayout layout = group_layout(op, shape, group_dim, group_size);
  const int64_t bytes = bits == 8 ? layout.numel : (layout.numel * bits + 7) / 8;
  TORCH_CHECK(codes.numel() == bytes, op, ": codes hold ", codes.numel(), " bytes, but ",
              layout.numel, " codes of ", bits, " bits take ", bytes);
  check_group_vector(op, "lower", lower, codes, layout, at::kFloat);
  check_group_vector(op, "scale", scale, codes, layout, at::kFloat);
  return layout;
}

// Validates refine's arguments: x, its 8-bit codes (one per element) with their per-group lower
// and scale, and the optional per-group mean and rstd of a standardized pack; returns x's layout.
inline GroupLayout check_refine_args(const char* op, const at::Tensor& x,
                                     const at::Tensor& codes, const at::Tensor& lower,
                                     const at::Tensor& scale,
                                     const std::optional<at::Tensor>& mean,
                                     const std::optional<at::Tensor>& rstd, int64_t group_dim,
                                     int64_t group_size, c10::DeviceType device) {
  check_activation(op, x, device);
  const GroupLayout layout = group_layout(op, x.sizes(), group_dim, group_size);
  check_contiguous(op, "codes", codes, device);
  check_same_device(op, "codes", codes, x);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.numel() == layout.numel, op,
              ": codes must be uint8 with one code per element of x (", layout.numel,
              "), got ", codes.scalar_type(), " with ", codes.numel());
  check_group_vector(op, "lower", lower, x, layout, at::kFloat);
  check_group_vector(op, "scale", scale, x, layout, at::kFloat);
  check_standardization(op, mean, rstd, x, layout);
  return layout;
}

// Validates dequantize_refined's arguments: two 8-bit codes per element of `shape` and the
// per-group lower and scale of each.
inline GroupLayout check_dequantize_refined_args(
    const char* op, const at::Tensor& codes, const at::Tensor& fine, const at::Tensor& lower,
    const at::Tensor& scale, const at::Tensor& fine_lower, const at::Tensor& fine_scale,
    at::IntArrayRef shape, int64_t group_dim, int64_t group_size, at::ScalarType dtype,
    c10::DeviceType device) {
  const GroupLayout layout = check_dequantize_args(op, codes, lower, scale, 8, shape, group_dim,
                                                   group_size, dtype, device);
  check_contiguous(op, "fine", fine, device);
  check_same_device(op, "fine", fine, codes);
  TORCH_CHECK(fine.scalar_type() == at::kByte && fine.numel() == layout.numel, op,
              ": fine must be uint8 with one code per element (", layout.numel, "), got ",
              fine.scalar_type(), " with ", fine.numel());
  check_group_vector(op, "fine_lower", fine_lower, codes, layout, at::kFloat);
  check_group_vector(op, "fine_scale", fine_scale, codes, layout, at::kFloat);
  return layout;
}

// Validates norm_terms' arguments: fp32 vectors of one value per channel.
inline int64_t check_norm_terms_args(const char* op, const at::Tensor& rstd,
                                     const at::Tensor& decoded_invstd,
                                     const std::optional<at::Tensor>& weight,
                                     c10::DeviceType device) {
  const int64_t channels = rstd.numel();
  const auto check = [&](const char* name, const at::Tensor& t) {
    check_contiguous(op, name, t, device);
    check_same_device(op, name, t, rstd);
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == channels, op,
                ": ", name, " must be a float32 vector of ", channels, " channels, got ",
                t.scalar_type(), " of shape ", t.sizes());
  };
  check("rstd", rstd);
  check("decoded_invstd", decoded_invstd);
  if (weight.has_value()) {
    check("weight", *weight);
  }
  return channels;
}

// Validates dequantize's optional divisor: one fp32 value per row of the output, rows being
// equal consecutive runs of its elements; returns the row length (0 without a divisor).
inline int64_t check_divisor(const char* op, const std::optional<at::Tensor>& divisor,
                             const at::Tensor& codes, const GroupLayout& layout) {
  if (!divisor.has_value()) {
    return 0;
  }
  check_contiguous(op, "divisor", *divisor, codes.device().type());
  check_same_device(op, "divisor", *divisor, codes);
  const int64_t rows = divisor->numel();
  TORCH_CHECK(divisor->scalar_type() == at::kFloat && rows > 0 && layout.numel % rows == 0, op,
              ": divisor must be float32 with one value per row of the ", layout.numel,
              " values, got ", divisor->scalar_type(), " with ", rows);
  return layout.numel / rows;
}

// What quantize returns: one code per element shaped like x, or the packed bytes (flat) when
// `pack` and bits < 8.
inline std::vector<int64_t> quantized_shape(const at::Tensor& x, int64_t bits, bool pack) {
  if (!pack || bits == 8) {
    return x.sizes().vec();
  }
  return {(x.numel() * bits + 7) / 8};
}

}  // namespace mmseg_mesa
