// The emulated CUDA entry points of csrc/mesa_kernels.cu as torch.ops.mesa_emu.*, taking CPU
// tensors, beside the emulator's settings and launch log.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "emu.h"
#include "mesa_ops.h"

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
  m.def(mmseg_mesa::schema::kObserve);
  m.def(mmseg_mesa::schema::kQuantize);
  m.def(mmseg_mesa::schema::kDequantize);
  m.def(mmseg_mesa::schema::kObserveQuantize);
  m.def(mmseg_mesa::schema::kRefine);
  m.def(mmseg_mesa::schema::kDequantizeRefined);
  m.def(mmseg_mesa::schema::kNormTerms);
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
  m.impl("refine", &mmseg_mesa::refine_cuda);
  m.impl("dequantize_refined", &mmseg_mesa::dequantize_refined_cuda);
  m.impl("norm_terms", &mmseg_mesa::norm_terms_cuda);
  m.impl("faulty", &mesa_emu_faults::run_faulty);
}
