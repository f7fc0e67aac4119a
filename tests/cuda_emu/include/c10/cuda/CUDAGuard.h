// Stands in for c10's device guard in the emulated build: there is one emulated device.
#pragma once
#include <c10/core/Device.h>

namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace c10::cuda
