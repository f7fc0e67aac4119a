"""A CUDA execution emulator on the CPU, for running ``csrc/mesa_kernels.cu`` in the tests."""
