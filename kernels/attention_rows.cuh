// Row-level pieces of paged attention shared by kernels/unified_attention.cu
// and kernels/stream_decode.cu: one row's online-softmax step, the stores of a
// row's columns (the output of a whole row, or a split-KV partial) and the
// arrival protocol of the split-KV merge (see "Split KV" at the top of
// kernels/unified_attention.cu).
#pragma once

#include <stdint.h>

#include "attention_params.cuh"
#include "common.cuh"
#include "score_mods.cuh"

namespace cpa {

// One row's online-softmax step against the maximum `tile_max` of its new
// logits: moves the running maximum m_run (NaN-propagating: a NaN score
// makes it, the factor and every probability NaN) and rescales the running
// sum l_run. Returns the factor that rescales the row's accumulator; sets
// m_use, the maximum the new logits subtract (0 while it is still -inf).
__device__ __forceinline__ float online_max_step(float& m_run, float& l_run, float tile_max, float& m_use) {
  const float m_new = max_nan(m_run, tile_max);
  m_use = m_new == neg_inf() ? 0.f : m_new;
  const float alpha = exp2f(m_run - m_use);
  m_run = m_new;
  l_run *= alpha;
  return alpha;
}

// A whole row's `ncols` (<= 8) columns o, of running maximum M and sum L,
// to the output at element `oi`: normalised with the sink of `head` and
// scaled by v_scale (and out_inv_scale into an fp8 output); one 16-byte
// store when `vec` and ncols == 8.
template <typename T>
__device__ __forceinline__ void store_output_cols(const AttnParams& p, int64_t oi, int head, int ncols, float M,
                                                  float L, bool vec, const float (&o)[8]) {
  const float f = ScoreMods(p).fold_sink(head, M, L);
  // L is 0 only for a row that saw no key and has no sink mass (its o is
  // an exact 0); else >= 1, or NaN, which k carries into the row.
  const float k = L == 0.f ? 0.f : f / L * p.v_scale;
  if (p.out_fp8) {
    fp8_t* out = static_cast<fp8_t*>(p.out) + oi;
    for (int e = 0; e < ncols; ++e) out[e] = from_f32<fp8_t>(o[e] * k * p.out_inv_scale);
  } else if (ncols == 8 && vec) {
    uint4 w;
    w.x = pack2<T>(o[0] * k, o[1] * k);
    w.y = pack2<T>(o[2] * k, o[3] * k);
    w.z = pack2<T>(o[4] * k, o[5] * k);
    w.w = pack2<T>(o[6] * k, o[7] * k);
    *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + oi) = w;
  } else {
    T* out = static_cast<T*>(p.out) + oi;
    for (int e = 0; e < ncols; ++e) out[e] = from_f32<T>(o[e] * k);
  }
}

// Split KV: columns [gcol0, gcol0 + ncols) (ncols <= 8) of partial `pi`
// of a head of `hs` columns (times v_scale), 16-byte stores when `vec` and
// ncols == 8, and, from the store of column 0, the partial's (max, sum).
__device__ __forceinline__ void store_partial_cols(const AttnParams& p, int64_t pi, int hs, int gcol0, int ncols,
                                                   float M, float L, bool vec, const float (&o)[8]) {
  float* wa = p.ws_acc + pi * hs + gcol0;
  const float v = p.v_scale;
  if (ncols == 8 && vec) {
    reinterpret_cast<float4*>(wa)[0] = make_float4(o[0] * v, o[1] * v, o[2] * v, o[3] * v);
    reinterpret_cast<float4*>(wa)[1] = make_float4(o[4] * v, o[5] * v, o[6] * v, o[7] * v);
  } else {
    for (int e = 0; e < ncols; ++e) wa[e] = o[e] * v;
  }
  if (gcol0 == 0) {
    p.ws_ml[2 * pi] = M;
    p.ws_ml[2 * pi + 1] = L;
  }
}

// Counts this program into its split group, (blockIdx.x, blockIdx.y), once
// its partials are stored; true for the last of the group's gridDim.z
// programs, which then merges. Every thread of the program calls it (two
// block barriers; `tid` is the thread's index in the program).
__device__ __forceinline__ bool arrive_last(const AttnParams& p, int tid) {
  uint32_t* counter = p.ws_counters + (size_t)blockIdx.y * gridDim.x + blockIdx.x;
  __threadfence();  // release: this thread's partial stores before the count
  __syncthreads();  // every thread of the program has stored and fenced
  int last = 0;
  if (tid == 0) last = atomicAdd(counter, 1u) == gridDim.z - 1;
  if (!__syncthreads_or(last)) return false;
  __threadfence();  // acquire: the group's partials after its counts
  // Every program of the group has counted: zero for the next launch.
  if (tid == 0) atomicExch(counter, 0u);
  return true;
}

}  // namespace cpa
