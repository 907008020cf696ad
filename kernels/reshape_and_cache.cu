// Scatters new keys (or values) into a paged cache.
//
// `reshape_and_cache_{f32|f16|bf16}[_fp8]`: token t's row of
// `num_kv_heads * head_size` elements goes to cache row `slots[t]` (that is
// block `slot / block_size`, row `slot % block_size`; the cache's rows are
// contiguous). Negative slots are padding and are skipped; so are slots at or
// past `capacity` (num_blocks * block_size), which the host validates but
// cannot see for a slot tensor it never reads back. An fp8 cache stores
// `x * inv_scale`, saturated to +-448. One program per token; 16-byte loads
// when `vec` says the rows allow them. Two tokens with one slot race: which
// one the row ends up holding is unspecified.

#include "common.cuh"

using namespace cpa;

template <typename T, typename C>
__device__ __forceinline__ void reshape_and_cache_body(const T* __restrict__ src, C* __restrict__ cache,
                                                       const int64_t* __restrict__ slots, int64_t row_elems,
                                                       int64_t capacity, float inv_scale, int vec) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slots[token];
  if (slot < 0 || slot >= capacity) return;
  const T* s = src + token * row_elems;
  C* d = cache + slot * row_elems;
  constexpr int EPV = 16 / (int)sizeof(T);  // elements per 16-byte load
  if (vec) {
    for (int64_t i = (int64_t)threadIdx.x * EPV; i < row_elems; i += (int64_t)blockDim.x * EPV) {
      const uint4 raw = *reinterpret_cast<const uint4*>(s + i);
      if constexpr (sizeof(C) == sizeof(T)) {
        *reinterpret_cast<uint4*>(d + i) = raw;
      } else {
        const T* x = reinterpret_cast<const T*>(&raw);
        C y[EPV];
#pragma unroll
        for (int e = 0; e < EPV; ++e) y[e] = from_f32<C>(to_f32(x[e]) * inv_scale);
#pragma unroll
        for (int e = 0; e < EPV; ++e) d[i + e] = y[e];
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
      if constexpr (sizeof(C) == sizeof(T)) d[i] = s[i];
      else d[i] = from_f32<C>(to_f32(s[i]) * inv_scale);
    }
  }
}

#define CPA_RC(NAME, T, C)                                                                              \
  extern "C" __global__ void NAME(const T* src, C* cache, const int64_t* slots, int64_t row_elems,     \
                                  int64_t capacity, float inv_scale, int vec) {                         \
    reshape_and_cache_body<T, C>(src, cache, slots, row_elems, capacity, inv_scale, vec);               \
  }

CPA_RC(reshape_and_cache_f32, float, float)
CPA_RC(reshape_and_cache_f16, __half, __half)
CPA_RC(reshape_and_cache_bf16, __nv_bfloat16, __nv_bfloat16)
CPA_RC(reshape_and_cache_f32_fp8, float, fp8_t)
CPA_RC(reshape_and_cache_f16_fp8, __half, fp8_t)
CPA_RC(reshape_and_cache_bf16_fp8, __nv_bfloat16, fp8_t)
