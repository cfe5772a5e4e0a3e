#pragma once
// Emulated CUDA runtime (see cuda_runtime_api.h).
#include "cuda_runtime_api.h"
