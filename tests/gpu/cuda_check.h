#pragma once
// CUDA_OK(expr): the GPU test and benchmark programs stop with the error's name and place
// on any CUDA failure (they have no Status plumbing of their own).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_OK(expr)                                                                       \
  do {                                                                                      \
    cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                  #expr);                                                                   \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
