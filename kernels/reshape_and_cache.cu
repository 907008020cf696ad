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

// ---- rotary embedding fused with the cache write --------------------------
//
// `rotary_cache_{ti}_{t}[_fp8]`: a joined q/k/v projection row `qkv[t]` =
// `heads` query heads, `kv_heads` key heads, then `kv_heads` value heads of
// `head_size` elements (input dtype TI: the model's dtype T, or f32 from a
// quantized matmul). One program per (token t = blockIdx.x, head slot
// blockIdx.y of the row's heads + 2 kv_heads), so that a one-token step
// runs one short program per head instead of one program looping over
// every head (a chain of dependent loads per thread). Each input element
// is first rounded to T (as a cast of the projection would), then
// - query and key heads are rotated by the token's rotary row (`cos[t]`,
//   `sin[t]`, `head_size / 2` values each, dtype T): pairs `(2i, 2i + 1)`
//   when `interleaved`, else `(i, i + head_size / 2)`; computed in f32 and
//   rounded once to T;
// - the rotated queries go to `q_out[t]` (`heads * head_size`, dtype T), for
//   every token;
// - the rotated keys and the values go to cache row `slots[t]` as
//   `reshape_and_cache` stores them (skipped for a slot outside
//   `0..capacity`; an fp8 cache stores `x * inv_scale`, saturated).

template <typename C, typename T>
__device__ __forceinline__ C to_cache(T x, float inv_scale) {
  if constexpr (std::is_same<C, T>::value) {
    return x;
  } else {
    return from_f32<C>(to_f32(x) * inv_scale);
  }
}

template <typename TI, typename T, typename C>
__device__ __forceinline__ void rotary_cache_body(const TI* __restrict__ qkv, const T* __restrict__ cos,
                                                  const T* __restrict__ sin, T* __restrict__ q_out,
                                                  C* __restrict__ key_cache, C* __restrict__ value_cache,
                                                  const int64_t* __restrict__ slots, int heads, int kv_heads,
                                                  int head_size, int interleaved, int64_t capacity,
                                                  float k_inv_scale, float v_inv_scale) {
  const int64_t token = blockIdx.x;
  const int h = blockIdx.y;  // head slot: query, key, then value heads
  const int half = head_size / 2;
  const int64_t kv_row = (int64_t)kv_heads * head_size;
  const TI* row = qkv + token * ((int64_t)heads * head_size + 2 * kv_row);
  const int64_t slot = slots[token];
  const bool store = slot >= 0 && slot < capacity;
  if (h >= heads + kv_heads) {
    // A value head: stored as it is (rounded to T, then to the cache).
    if (!store) return;
    const int vh = h - heads - kv_heads;
    const TI* v = row + (int64_t)(heads + kv_heads + vh) * head_size;
    C* dst = value_cache + slot * kv_row + (int64_t)vh * head_size;
    for (int e = threadIdx.x; e < head_size; e += blockDim.x) {
      dst[e] = to_cache<C>(from_f32<T>(to_f32(v[e])), v_inv_scale);
    }
    return;
  }
  if (h >= heads && !store) return;  // a key head of a padding token
  const T* c_row = cos + token * half;
  const T* s_row = sin + token * half;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const float x0 = to_f32(from_f32<T>(to_f32(row[h * head_size + a])));
    const float x1 = to_f32(from_f32<T>(to_f32(row[h * head_size + b])));
    const float c = to_f32(c_row[i]), s = to_f32(s_row[i]);
    const T y0 = from_f32<T>(x0 * c - x1 * s);
    const T y1 = from_f32<T>(x0 * s + x1 * c);
    if (h < heads) {
      T* q = q_out + (token * heads + h) * head_size;
      q[a] = y0;
      q[b] = y1;
    } else {
      C* k = key_cache + slot * kv_row + (int64_t)(h - heads) * head_size;
      k[a] = to_cache<C>(y0, k_inv_scale);
      k[b] = to_cache<C>(y1, k_inv_scale);
    }
  }
}

#define CPA_ROT(NAME, TI, T, C)                                                                          \
  extern "C" __global__ void NAME(const TI* qkv, const T* cos, const T* sin, T* q_out, C* key_cache,     \
                                  C* value_cache, const int64_t* slots, int heads, int kv_heads,        \
                                  int head_size, int interleaved, int64_t capacity, float k_inv_scale,  \
                                  float v_inv_scale) {                                                  \
    rotary_cache_body<TI, T, C>(qkv, cos, sin, q_out, key_cache, value_cache, slots, heads, kv_heads,   \
                                head_size, interleaved, capacity, k_inv_scale, v_inv_scale);            \
  }

CPA_ROT(rotary_cache_f32_f32, float, float, float)
CPA_ROT(rotary_cache_f16_f16, __half, __half, __half)
CPA_ROT(rotary_cache_bf16_bf16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16)
CPA_ROT(rotary_cache_f32_f16, float, __half, __half)
CPA_ROT(rotary_cache_f32_bf16, float, __nv_bfloat16, __nv_bfloat16)
CPA_ROT(rotary_cache_f32_f32_fp8, float, float, fp8_t)
CPA_ROT(rotary_cache_f16_f16_fp8, __half, __half, fp8_t)
CPA_ROT(rotary_cache_bf16_bf16_fp8, __nv_bfloat16, __nv_bfloat16, fp8_t)
CPA_ROT(rotary_cache_f32_f16_fp8, float, __half, fp8_t)
CPA_ROT(rotary_cache_f32_bf16_fp8, float, __nv_bfloat16, fp8_t)
