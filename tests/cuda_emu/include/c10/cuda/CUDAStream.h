// Stands in for c10's CUDA streams in the emulated build: launches run in order, at once.
#pragma once
#include "../../../emu.h"

namespace c10::cuda {
inline cudaStream_t getCurrentCUDAStream() {
  return nullptr;
}
}  // namespace c10::cuda
