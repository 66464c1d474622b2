// Conversions between the CUDA kernels' storage types and float, shared by their .cu files:
// to_float widens exactly; from_float<T> rounds once to nearest even.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// x rounded to T and widened back: the value a T would hold.
template <typename T>
__device__ __forceinline__ float rounded(float x) { return to_float(from_float<T>(x)); }
