// The ops' kernels, declared once for the op registrations (mesa_ops.cpp) and the tests' emulated
// CUDA build (tests/cuda_emu/ops.cpp), with the schemas both register.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace mmseg_mesa {

at::Tensor observe_cpu(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span,
                       const at::Tensor& seen, int64_t group_dim, int64_t group_size,
                       double decay);
at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& scale,
                        int64_t bits, int64_t group_dim, int64_t group_size, bool stochastic,
                        int64_t seed, int64_t offset, bool pack);
at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& lower,
                          const at::Tensor& scale, int64_t bits, at::IntArrayRef shape,
                          int64_t group_dim, int64_t group_size, at::ScalarType dtype,
                          const std::optional<at::Tensor>& divisor);
std::tuple<at::Tensor, at::Tensor, at::Tensor> observe_quantize_cpu(
    const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span, const at::Tensor& seen,
    const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& rstd,
    int64_t group_dim, int64_t group_size, double decay, int64_t bits, bool stochastic,
    int64_t seed, int64_t offset, bool pack, bool rows);
std::tuple<at::Tensor, at::Tensor, at::Tensor> refine_cpu(
    const at::Tensor& x, const at::Tensor& codes, const at::Tensor& lower,
    const at::Tensor& scale, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& rstd, int64_t group_dim, int64_t group_size);
at::Tensor dequantize_refined_cpu(const at::Tensor& codes, const at::Tensor& fine,
                                  const at::Tensor& lower, const at::Tensor& scale,
                                  const at::Tensor& fine_lower, const at::Tensor& fine_scale,
                                  at::IntArrayRef shape, int64_t group_dim, int64_t group_size,
                                  at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_terms_cpu(
    const at::Tensor& rstd, const at::Tensor& decoded_invstd,
    const std::optional<at::Tensor>& weight, double eps, double reliable);
at::Tensor pack_mask_cpu(const at::Tensor& mask);
at::Tensor unpack_mask_cpu(const at::Tensor& bytes, at::IntArrayRef shape);
at::Tensor pack_positive_cpu(const at::Tensor& x);
at::Tensor mask_select_cpu(const at::Tensor& values, const at::Tensor& bytes);
void mask_select_cpu_(const at::Tensor& values, const at::Tensor& bytes);
// Whether the CPU kernels' at::parallel_for uses torch's threads (OpenMP builds need -fopenmp).
bool cpu_kernels_parallel();

// Defined in a CUDA build only (mesa_kernels.cu; the tests' emulated build of it).
at::Tensor observe_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span,
                        const at::Tensor& seen, int64_t group_dim, int64_t group_size,
                        double decay);
at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& scale,
                         int64_t bits, int64_t group_dim, int64_t group_size, bool stochastic,
                         int64_t seed, int64_t offset, bool pack);
at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& lower,
                           const at::Tensor& scale, int64_t bits, at::IntArrayRef shape,
                           int64_t group_dim, int64_t group_size, at::ScalarType dtype,
                           const std::optional<at::Tensor>& divisor);
std::tuple<at::Tensor, at::Tensor, at::Tensor> observe_quantize_cuda(
    const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span, const at::Tensor& seen,
    const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& rstd,
    int64_t group_dim, int64_t group_size, double decay, int64_t bits, bool stochastic,
    int64_t seed, int64_t offset, bool pack, bool rows);
std::tuple<at::Tensor, at::Tensor, at::Tensor> refine_cuda(
    const at::Tensor& x, const at::Tensor& codes, const at::Tensor& lower,
    const at::Tensor& scale, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& rstd, int64_t group_dim, int64_t group_size);
at::Tensor dequantize_refined_cuda(const at::Tensor& codes, const at::Tensor& fine,
                                   const at::Tensor& lower, const at::Tensor& scale,
                                   const at::Tensor& fine_lower, const at::Tensor& fine_scale,
                                   at::IntArrayRef shape, int64_t group_dim, int64_t group_size,
                                   at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_terms_cuda(
    const at::Tensor& rstd, const at::Tensor& decoded_invstd,
    const std::optional<at::Tensor>& weight, double eps, double reliable);
const char* compiled_cuda_archs();
int compiled_cuda_version();

}  // namespace mmseg_mesa

// The schemas of the ops with CPU and CUDA kernels (what each does: mesa_ops.cpp).
namespace mmseg_mesa::schema {
inline constexpr const char* kObserve =
    "observe(Tensor x, Tensor(a!) lower, Tensor(b!) span, Tensor(c!) seen, int group_dim, "
    "int group_size, float decay) -> Tensor";
inline constexpr const char* kQuantize =
    "quantize(Tensor x, Tensor lower, Tensor scale, int bits, int group_dim, int group_size, "
    "bool stochastic, int seed, int offset, bool pack) -> Tensor";
inline constexpr const char* kDequantize =
    "dequantize(Tensor codes, Tensor lower, Tensor scale, int bits, int[] shape, "
    "int group_dim, int group_size, ScalarType dtype, Tensor? divisor=None) -> Tensor";
inline constexpr const char* kObserveQuantize =
    "observe_quantize(Tensor x, Tensor(a!) lower, Tensor(b!) span, Tensor(c!) seen, "
    "Tensor? mean, Tensor? rstd, int group_dim, int group_size, float decay, int bits, "
    "bool stochastic, int seed, int offset, bool pack, bool rows=False) "
    "-> (Tensor, Tensor, Tensor)";
inline constexpr const char* kRefine =
    "refine(Tensor x, Tensor codes, Tensor lower, Tensor scale, Tensor? mean, Tensor? rstd, "
    "int group_dim, int group_size) -> (Tensor, Tensor, Tensor)";
inline constexpr const char* kDequantizeRefined =
    "dequantize_refined(Tensor codes, Tensor fine, Tensor lower, Tensor scale, "
    "Tensor fine_lower, Tensor fine_scale, int[] shape, int group_dim, int group_size, "
    "ScalarType dtype) -> Tensor";
inline constexpr const char* kNormTerms =
    "norm_terms(Tensor rstd, Tensor decoded_invstd, Tensor? weight, float eps, "
    "float reliable) -> (Tensor, Tensor, Tensor)";
}  // namespace mmseg_mesa::schema
