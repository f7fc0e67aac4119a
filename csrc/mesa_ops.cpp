// Registers the torch ops torch.ops.mmseg_mesa.{observe, quantize, dequantize, observe_quantize}
// with their CPU kernels (mesa_cpu.cpp) and, in a CUDA build (MMSEG_MESA_WITH_CUDA), their CUDA
// kernels (mesa_kernels.cu), and the CPU-only mask ops. Makes
// this library importable as the Python module mmseg_mesa._C (no pybind11: the ops are reached
// through the dispatcher, so the module only carries build facts for mmseg_mesa._backend to
// check).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

#include "mesa_ops.h"

// quantize: one code per element shaped like x, or with `pack` (and bits < 8) the flat bytes of
// bitpack.py's layout. Stochastic rounding draws Philox4x32-10 keyed by `seed` at counters
// `offset + i / 4` (mesa_numerics.h); the caller advances `offset` between calls.
// dequantize: `codes` as quantize returned them for `shape` at `bits` per code; with a divisor
// (one per row of equal consecutive runs), each value divided by its row's before the cast.
// observe_quantize: observe, then quantize over the range it returns, in one call; returns the
// codes and the lower and scale that decode them. With mean and rstd (one per group) the range
// is observed in (x - mean) * rstd, and the codes and their lower / scale are those of that
// standardized tensor (quantizer.pack_standardized). With `rows`, mean and rstd hold one value
// per row of the (rows, channels * inner) view instead (a LayerNorm's moments per token): each
// value is standardized as it is read, and the codes and their lower / scale are those of the
// standardized tensor (quantizer.pack_rows_standardized). On CUDA: a memset and two kernels.
// refine: the fine codes of x's 8-bit codes (what they miss, over one coarse step either way of
// each group, to nearest) and their lower and scale (quantizer.refine); with mean and rstd, of
// the standardized (x - mean) * rstd. dequantize_refined: both codes decoded and added in fp32.
// norm_terms: BatchNorm's per-channel backward terms from the forward's and the decoded input's
// 1/std (layers/norm.py), one op where torch's took eight.
// pack_mask / unpack_mask: a bool tensor as 1 bit per element (bitpack.py's layout); CPU only.
// pack_positive: pack_mask(x > 0) in one pass; mask_select: values where the packed mask's bit is
// set, else +0 (ReLU's forward and backward; mask_select_ in place); CPU only.
TORCH_LIBRARY(mmseg_mesa, m) {
  m.def(mmseg_mesa::schema::kObserve);
  m.def(mmseg_mesa::schema::kQuantize);
  m.def(mmseg_mesa::schema::kDequantize);
  m.def(mmseg_mesa::schema::kObserveQuantize);
  m.def(mmseg_mesa::schema::kRefine);
  m.def(mmseg_mesa::schema::kDequantizeRefined);
  m.def(mmseg_mesa::schema::kNormTerms);
  m.def("pack_mask(Tensor mask) -> Tensor");
  m.def("unpack_mask(Tensor bytes, int[] shape) -> Tensor");
  m.def("pack_positive(Tensor x) -> Tensor");
  m.def("mask_select(Tensor values, Tensor bytes) -> Tensor");
  m.def("mask_select_(Tensor(a!) values, Tensor bytes) -> ()");
}

TORCH_LIBRARY_IMPL(mmseg_mesa, CPU, m) {
  m.impl("observe", &mmseg_mesa::observe_cpu);
  m.impl("quantize", &mmseg_mesa::quantize_cpu);
  m.impl("dequantize", &mmseg_mesa::dequantize_cpu);
  m.impl("observe_quantize", &mmseg_mesa::observe_quantize_cpu);
  m.impl("refine", &mmseg_mesa::refine_cpu);
  m.impl("dequantize_refined", &mmseg_mesa::dequantize_refined_cpu);
  m.impl("norm_terms", &mmseg_mesa::norm_terms_cpu);
  m.impl("pack_mask", &mmseg_mesa::pack_mask_cpu);
  m.impl("unpack_mask", &mmseg_mesa::unpack_mask_cpu);
  m.impl("pack_positive", &mmseg_mesa::pack_positive_cpu);
  m.impl("mask_select", &mmseg_mesa::mask_select_cpu);
  m.impl("mask_select_", &mmseg_mesa::mask_select_cpu_);
}

#ifdef MMSEG_MESA_WITH_CUDA
TORCH_LIBRARY_IMPL(mmseg_mesa, CUDA, m) {
  m.impl("observe", &mmseg_mesa::observe_cuda);
  m.impl("quantize", &mmseg_mesa::quantize_cuda);
  m.impl("dequantize", &mmseg_mesa::dequantize_cuda);
  m.impl("observe_quantize", &mmseg_mesa::observe_quantize_cuda);
  m.impl("refine", &mmseg_mesa::refine_cuda);
  m.impl("dequantize_refined", &mmseg_mesa::dequantize_refined_cuda);
  m.impl("norm_terms", &mmseg_mesa::norm_terms_cuda);
}
#endif

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C",
      "Mesa's CPU (and CUDA) kernels, registered as torch.ops.mmseg_mesa.*; see "
      "mmseg_mesa.kernels.",
      -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) {
    return nullptr;
  }
#ifdef MMSEG_MESA_WITH_CUDA
  const char* archs = mmseg_mesa::compiled_cuda_archs();
  const int cuda_version = mmseg_mesa::compiled_cuda_version();
  const int cuda_kernels = 1;
#else
  const char* archs = "";
  const int cuda_version = 0;
  const int cuda_kernels = 0;
#endif
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "CPU_KERNELS", 1) < 0 ||
      PyModule_AddIntConstant(m, "CPU_PARALLEL", mmseg_mesa::cpu_kernels_parallel()) < 0 ||
      PyModule_AddIntConstant(m, "CUDA_KERNELS", cuda_kernels) < 0 ||
      PyModule_AddStringConstant(m, "CUDA_ARCHS", archs) < 0 ||
      PyModule_AddIntConstant(m, "CUDA_VERSION", cuda_version) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
