// The emulated CUDA entry points of csrc/mesa_kernels.cu as torch.ops.mesa_emu.*, taking CPU
// tensors, beside the emulator's settings and launch log.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "emu.h"

namespace mmseg_mesa {
at::Tensor observe_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span,
                        const at::Tensor& seen, int64_t group_dim, int64_t group_size,
                        double decay);
at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& scale,
                         int64_t bits, int64_t group_dim, int64_t group_size, bool stochastic,
                         int64_t seed, int64_t offset, bool pack);
at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& lower,
                           const at::Tensor& scale, int64_t bits, at::IntArrayRef shape,
                           int64_t group_dim, int64_t group_size, at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> observe_quantize_cuda(
    const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span, const at::Tensor& seen,
    const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& rstd,
    int64_t group_dim, int64_t group_size, double decay, int64_t bits, bool stochastic,
    int64_t seed, int64_t offset, bool pack);
const char* compiled_cuda_archs();
int compiled_cuda_version();
}  // namespace mmseg_mesa

namespace mesa_emu_faults {
at::Tensor run_faulty(const std::string& name, const at::Tensor& in);
}

namespace {

void configure(int64_t multiprocessors, int64_t workers) {
  TORCH_CHECK(multiprocessors >= 1 && workers >= 1, "configure: counts must be >= 1");
  mesa_emu::settings().multiprocessors = static_cast<int>(multiprocessors);
  mesa_emu::settings().workers = static_cast<int>(workers);
}

std::vector<std::string> launch_log() {
  return mesa_emu::launch_log();
}

void clear_launch_log() {
  mesa_emu::clear_launch_log();
}

int64_t poison_reads() {
  return mesa_emu::poison_reads();
}

std::string build_facts() {
  return std::string("archs=") + mmseg_mesa::compiled_cuda_archs() +
         " cuda_version=" + std::to_string(mmseg_mesa::compiled_cuda_version());
}

}  // namespace

TORCH_LIBRARY(mesa_emu, m) {
  m.def(
      "observe(Tensor x, Tensor(a!) lower, Tensor(b!) span, Tensor(c!) seen, int group_dim, "
      "int group_size, float decay) -> Tensor");
  m.def(
      "quantize(Tensor x, Tensor lower, Tensor scale, int bits, int group_dim, int group_size, "
      "bool stochastic, int seed, int offset, bool pack) -> Tensor");
  m.def(
      "dequantize(Tensor codes, Tensor lower, Tensor scale, int bits, int[] shape, "
      "int group_dim, int group_size, ScalarType dtype) -> Tensor");
  m.def(
      "observe_quantize(Tensor x, Tensor(a!) lower, Tensor(b!) span, Tensor(c!) seen, "
      "Tensor? mean, Tensor? rstd, int group_dim, int group_size, float decay, int bits, "
      "bool stochastic, int seed, int offset, bool pack) -> (Tensor, Tensor, Tensor)");
  m.def("faulty(str name, Tensor x) -> Tensor");
  m.def("configure(int multiprocessors, int workers) -> ()", &configure);
  m.def("launch_log() -> str[]", &launch_log);
  m.def("clear_launch_log() -> ()", &clear_launch_log);
  m.def("poison_reads() -> int", &poison_reads);
  m.def("build_facts() -> str", &build_facts);
}

TORCH_LIBRARY_IMPL(mesa_emu, CPU, m) {
  m.impl("observe", &mmseg_mesa::observe_cuda);
  m.impl("quantize", &mmseg_mesa::quantize_cuda);
  m.impl("dequantize", &mmseg_mesa::dequantize_cuda);
  m.impl("observe_quantize", &mmseg_mesa::observe_quantize_cuda);
  m.impl("faulty", &mesa_emu_faults::run_faulty);
}
