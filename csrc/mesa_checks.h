// Argument validation shared by every mmseg_mesa op, and the group layout the kernels index with.
//
// A tensor is seen as (outer, channels, inner) around `group_dim`; channel c belongs to group
// c / group_size. Every check names the op and the argument, so a failure says what to fix.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace mmseg_mesa {

struct GroupLayout {
  int64_t numel;
  int64_t inner;       // product of the sizes after group_dim
  int64_t channels;    // size of group_dim
  int64_t group_size;  // channels per group (the last group may be shorter)
  int64_t groups;      // ceil(channels / group_size)
  bool narrow;         // numel fits 32-bit index arithmetic
};

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline void check_cuda_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device(),
              " (use backend='torch' for CPU tensors)");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got sizes ", t.sizes(),
              " and strides ", t.strides(), "; call .contiguous() first");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(),
              " but the activation is on ", ref.device());
}

// The activation (or its codes) and its grouping along group_dim (non-negative or negative).
inline GroupLayout group_layout(const char* op, const at::Tensor& t, int64_t group_dim,
                                int64_t group_size) {
  const int64_t ndim = t.dim();
  TORCH_CHECK(ndim >= 1, op, ": expected a tensor with at least one dimension, got a scalar");
  TORCH_CHECK(group_dim >= -ndim && group_dim < ndim, op, ": group_dim=", group_dim,
              " is out of range for a ", ndim, "-d tensor");
  if (group_dim < 0) {
    group_dim += ndim;
  }
  TORCH_CHECK(group_size >= 1, op, ": group_size must be >= 1, got ", group_size);
  GroupLayout layout{};
  layout.numel = t.numel();
  layout.channels = t.size(group_dim);
  TORCH_CHECK(layout.channels <= std::numeric_limits<int32_t>::max(), op, ": ",
              layout.channels, " channels along group_dim exceed the kernels' 32-bit range");
  layout.inner = 1;
  for (int64_t d = group_dim + 1; d < ndim; ++d) {
    layout.inner *= t.size(d);
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
  check_cuda_contiguous(op, name, v);
  check_same_device(op, name, v, ref);
  TORCH_CHECK(v.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              v.scalar_type());
  TORCH_CHECK(v.dim() == 1 && v.numel() == layout.groups, op, ": ", name, " must have shape (",
              layout.groups, ",) for ", layout.channels, " channels in groups of ",
              layout.group_size, ", got ", v.sizes());
}

inline void check_activation(const char* op, const at::Tensor& x) {
  check_cuda_contiguous(op, "x", x);
  TORCH_CHECK(is_supported_float(x.scalar_type()), op,
              ": x must be float32, float16, bfloat16 or float64, got ", x.scalar_type());
}

}  // namespace mmseg_mesa
