// Registers the torch ops torch.ops.mmseg_mesa.{observe, quantize, dequantize} and makes this
// library importable as the Python module mmseg_mesa._C (no pybind11: the ops are reached through
// the dispatcher, so the module only carries build facts for mmseg_mesa._backend to check).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

#include <optional>

namespace mmseg_mesa {

at::Tensor observe_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& span,
                        const at::Tensor& seen, int64_t group_dim, int64_t group_size,
                        double decay);
at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& lower, const at::Tensor& scale,
                         int64_t bits, int64_t group_dim, int64_t group_size, bool stochastic,
                         std::optional<at::Generator> generator);
at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& lower,
                           const at::Tensor& scale, int64_t group_dim, int64_t group_size,
                           at::ScalarType dtype);
const char* compiled_cuda_archs();
int compiled_cuda_version();

}  // namespace mmseg_mesa

TORCH_LIBRARY(mmseg_mesa, m) {
  m.def(
      "observe(Tensor x, Tensor(a!) lower, Tensor(b!) span, Tensor(c!) seen, int group_dim, "
      "int group_size, float decay) -> Tensor");
  m.def(
      "quantize(Tensor x, Tensor lower, Tensor scale, int bits, int group_dim, int group_size, "
      "bool stochastic, Generator? generator=None) -> Tensor");
  m.def(
      "dequantize(Tensor codes, Tensor lower, Tensor scale, int group_dim, int group_size, "
      "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmseg_mesa, CUDA, m) {
  m.impl("observe", &mmseg_mesa::observe_cuda);
  m.impl("quantize", &mmseg_mesa::quantize_cuda);
  m.impl("dequantize", &mmseg_mesa::dequantize_cuda);
}

// CPU tensors reach the same entry points so that the device check explains the problem,
// instead of the dispatcher's generic "could not run ... with arguments from the 'CPU' backend".
TORCH_LIBRARY_IMPL(mmseg_mesa, CPU, m) {
  m.impl("observe", &mmseg_mesa::observe_cuda);
  m.impl("quantize", &mmseg_mesa::quantize_cuda);
  m.impl("dequantize", &mmseg_mesa::dequantize_cuda);
}

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C",
      "Mesa's CUDA kernels, registered as torch.ops.mmseg_mesa.*; see mmseg_mesa.kernels.",
      -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) {
    return nullptr;
  }
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", TORCH_VERSION) < 0 ||
      PyModule_AddStringConstant(m, "CUDA_ARCHS", mmseg_mesa::compiled_cuda_archs()) < 0 ||
      PyModule_AddIntConstant(m, "CUDA_VERSION", mmseg_mesa::compiled_cuda_version()) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
