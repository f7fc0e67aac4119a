// Kernels with the faults the emulator exists to catch, written as CUDA: the tests hold the
// emulator to reporting each. Built into the emulated library beside csrc/mesa_kernels.cu.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <string>

namespace mesa_emu_faults {
namespace {

// The shuffle inside a branch that only some lanes of the warp take.
__global__ void divergent_shuffle_kernel(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x < 20) {
    v += __shfl_down_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = __shfl_sync(0xffffffffu, v, 0);
}

// A barrier that the threads of the upper half skip by leaving early.
__global__ void partial_barrier_kernel(float* out) {
  if (threadIdx.x >= blockDim.x / 2) {
    return;
  }
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// A shuffle among the lower half-warp that reads lanes of the upper half, outside its mask.
__global__ void masked_out_read_kernel(float* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, static_cast<float>(threadIdx.x), 8);
  }
}

// Correct: a block-wide sum through shared memory and a warp reduction.
__global__ void block_sum_kernel(const float* in, float* out, int n) {
  __shared__ float partial[32];
  float v = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    v += in[i];
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  if ((threadIdx.x & 31) == 0) {
    partial[threadIdx.x / 32] = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) {
      total += partial[w];
    }
    out[blockIdx.x] = total;
  }
}

// One element written past the end of the tensor (for the sanitizer build).
__global__ void overflow_kernel(float* out, int n) {
  out[threadIdx.x + blockIdx.x * blockDim.x + (threadIdx.x == 0 ? n : 0)] = 2.0f;
}

}  // namespace

at::Tensor run_faulty(const std::string& name, const at::Tensor& in) {
  at::Tensor out = at::zeros({64}, in.options());
  float* o = out.mutable_data_ptr<float>();
  if (name == "divergent_shuffle") {
    divergent_shuffle_kernel<<<1, 32>>>(o);
  } else if (name == "partial_barrier") {
    partial_barrier_kernel<<<1, 64>>>(o);
  } else if (name == "masked_out_read") {
    masked_out_read_kernel<<<1, 32>>>(o);
  } else if (name == "block_sum") {
    block_sum_kernel<<<2, 64>>>(in.const_data_ptr<float>(), o, static_cast<int>(in.numel()));
  } else if (name == "too_many_threads") {
    block_sum_kernel<<<1, 2048>>>(in.const_data_ptr<float>(), o, static_cast<int>(in.numel()));
  } else if (name == "overflow") {
    overflow_kernel<<<1, 32>>>(o, 64);
  } else {
    TORCH_CHECK(false, "no faulty kernel named ", name);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace mesa_emu_faults
