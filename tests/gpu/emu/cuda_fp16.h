/* The CUDA half-precision header, as the emulation provides it. */
#pragma once
#include "emu_cuda.h"
