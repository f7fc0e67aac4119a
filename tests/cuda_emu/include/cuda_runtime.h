// Stands in for the CUDA runtime's header in the emulated build (tests/cuda_emu/emu.h).
#pragma once
#include "../emu.h"
