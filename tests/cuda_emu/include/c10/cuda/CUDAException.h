// Stands in for c10's CUDA error checks in the emulated build: a failed launch raises as c10 does.
#pragma once
#include <c10/util/Exception.h>

#include "../../../emu.h"

namespace mesa_emu {
void check_last_launch();
}

#define C10_CUDA_CHECK(EXPR)                                                                  \
  do {                                                                                        \
    const cudaError_t mesa_emu_error = (EXPR);                                                \
    TORCH_CHECK(mesa_emu_error == cudaSuccess, "CUDA error: ", cudaGetErrorString(mesa_emu_error)); \
  } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ::mesa_emu::check_last_launch()
