// A mixed batch in one launch: the programs of its prefill part (the
// 64-row warpgroup instance, `attention_body`) and of its decode-shaped part
// (a stream-decode instance, `stream_body`) take their places in one flat
// grid, so that both kinds of work share the SMs from the first wave without
// a second stream, and a CUDA graph holds one kernel node.
//
// Each program finds its role and its place in its part's grid
// (`PartGrid`) from its block index alone:
// * `prefill_first = 0` (the default): the P prefill programs are spread
//   evenly over the P + D places, program i being a prefill one when
//   floor((i + 1) P / (P + D)) > floor(i P / (P + D)); its prefill index is
//   floor(i P / (P + D)), and a decode program's index is i minus the
//   prefill programs before it. Every wave then holds compute-bound prefill
//   tiles beside bandwidth-bound decode streams.
// * `prefill_first = 1`: the prefill programs first, then the decode ones.
// The prefill part's own order (its heaviest causal query blocks first)
// holds within its places.
//
// Both roles run 128 threads (4 warps). The launch asks for the larger of
// the two programs' shared memory; each role lays its own out from the
// start of it. Registers are the larger of the two bodies' (two programs
// per SM at head size 128). Nothing else differs from a launch per part:
// every program reads only its part's `AttnParams`, and a split decode
// part's arrival counters are indexed by its own grid.
//
// Included by kernels/unified_attention.cu for compute_90a (CPA_SM90A).
#pragma once

#include "stream_decode.cuh"

namespace cpa {

// The role and part place of launch program `i` (see the top of the file).
__device__ __forceinline__ bool mixed_role(const MixedParams& m, int64_t i, int64_t& index) {
  const int64_t P = (int64_t)m.prefill_grid[0] * m.prefill_grid[1] * m.prefill_grid[2];
  const int64_t D = (int64_t)m.decode_grid[0] * m.decode_grid[1] * m.decode_grid[2];
  if (m.prefill_first) {
    index = i < P ? i : i - P;
    return i < P;
  }
  const int64_t total = P + D;
  const int64_t before = i * P / total;  // prefill programs among places [0, i)
  const bool prefill = (i + 1) * P / total > before;
  index = prefill ? before : i - before;
  return prefill;
}

}  // namespace cpa

template <typename T, class PCF, int HEAD, int NR>
__device__ __forceinline__ void mixed_body(const MixedParams& m) {
  int64_t index;
  if (mixed_role(m, (int64_t)blockIdx.x, index)) {
    const PartGrid grid = PartGrid::of(index, m.prefill_grid[0], m.prefill_grid[1], m.prefill_grid[2]);
    attention_body<T, T, PCF, PartGrid>(m.prefill, grid);
  } else {
    const PartGrid grid = PartGrid::of(index, m.decode_grid[0], m.decode_grid[1], m.decode_grid[2]);
    stream_body<T, T, HEAD, NR, false, PartGrid>(m.decode, grid);
  }
}

// One instance per (head size, stream rows, query dtype), 16-bit caches:
// `unified_attention_h{HEAD}_mixed_{SHAPE}_{TNAME}`, SHAPE the stream
// instance's (`r8`, `r16`). PCF is the 64-row warpgroup prefill tile of
// src/cuda/tiles.rs (`wgmma_tile(head, true)`); the contract constants
// (`mixed_tile`) give the threads and the larger shared memory.
#define CPA_MIXED(HEAD, NR, SHAPE, WM, WN, KW, MT, ST, TNAME, T)                                                \
  static_assert(Cfg<HEAD, WM, WN, KW, MT, ST, true>::NT == 128 && cpa_plan_h##HEAD##_mixed_##SHAPE##_threads == 128, \
                "threads of unified_attention_h" #HEAD "_mixed_" #SHAPE " differ from src/cuda/tiles.rs");      \
  static_assert(cpa_plan_h##HEAD##_mixed_##SHAPE##_smem ==                                                     \
                    (Smem<Cfg<HEAD, WM, WN, KW, MT, ST, true>, false>::TOTAL > StreamProgram<T, T, HEAD, NR, false>::SMEM \
                         ? Smem<Cfg<HEAD, WM, WN, KW, MT, ST, true>, false>::TOTAL                               \
                         : StreamProgram<T, T, HEAD, NR, false>::SMEM),                                          \
                "shared memory of unified_attention_h" #HEAD "_mixed_" #SHAPE " differs from src/cuda/tiles.rs"); \
  extern "C" __global__ void __launch_bounds__(128, 2)                                                         \
      unified_attention_h##HEAD##_mixed_##SHAPE##_##TNAME(const MixedParams m) {                              \
    mixed_body<T, Cfg<HEAD, WM, WN, KW, MT, ST, true>, HEAD, NR>(m);                                           \
  }
