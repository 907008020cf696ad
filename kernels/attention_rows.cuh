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

// A program's place in the grid of its part: `LaunchGrid` reads the
// launch's own (blockIdx, gridDim), what a launch of one part uses;
// `PartGrid` holds a place given by the caller, for the programs of a
// mixed batch's one launch (kernels/mixed_attention.cuh), whose own grid
// is flat. The programs read x(), y(), z() and the sizes nx(), ny(), nz().
struct LaunchGrid {
  __device__ __forceinline__ unsigned x() const { return blockIdx.x; }
  __device__ __forceinline__ unsigned y() const { return blockIdx.y; }
  __device__ __forceinline__ unsigned z() const { return blockIdx.z; }
  __device__ __forceinline__ unsigned nx() const { return gridDim.x; }
  __device__ __forceinline__ unsigned ny() const { return gridDim.y; }
  __device__ __forceinline__ unsigned nz() const { return gridDim.z; }
};

// Unsigned like blockIdx and gridDim, so that the programs' index
// arithmetic is the same for both grids.
struct PartGrid {
  unsigned px, py, pz, sx, sy, sz;
  // Place `i` of a grid of sx x sy x sz programs, x fastest (the order in
  // which a launch numbers its blocks).
  __device__ __forceinline__ static PartGrid of(int64_t i, int sx, int sy, int sz) {
    const int64_t plane = (int64_t)sx * sy;
    return {(unsigned)(i % sx), (unsigned)((i / sx) % sy), (unsigned)(i / plane), (unsigned)sx, (unsigned)sy,
            (unsigned)sz};
  }
  __device__ __forceinline__ unsigned x() const { return px; }
  __device__ __forceinline__ unsigned y() const { return py; }
  __device__ __forceinline__ unsigned z() const { return pz; }
  __device__ __forceinline__ unsigned nx() const { return sx; }
  __device__ __forceinline__ unsigned ny() const { return sy; }
  __device__ __forceinline__ unsigned nz() const { return sz; }
};

// Counts this program into its split group, (x, y) of its part's grid, once
// its partials are stored; true for the last of the group's nz programs,
// which then merges. Every thread of the program calls it (two block
// barriers; `tid` is the thread's index in the program).
template <class G>
__device__ __forceinline__ bool arrive_last(const AttnParams& p, int tid, const G& grid) {
  uint32_t* counter = p.ws_counters + (size_t)grid.y() * grid.nx() + grid.x();
  __threadfence();  // release: this thread's partial stores before the count
  __syncthreads();  // every thread of the program has stored and fenced
  int last = 0;
  if (tid == 0) last = atomicAdd(counter, 1u) == grid.nz() - 1;
  if (!__syncthreads_or(last)) return false;
  __threadfence();  // acquire: the group's partials after its counts
  // Every program of the group has counted: zero for the next launch.
  if (tid == 0) atomicExch(counter, 0u);
  return true;
}

}  // namespace cpa
