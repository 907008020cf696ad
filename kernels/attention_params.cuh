// The parameter block of the attention kernels, passed by value. Its layout is
// mirrored field by field by `AttnParams` in src/cuda/contract.rs:
// 8-byte fields first, then 4-byte fields, no implicit padding.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace cpa {

struct AttnParams {
  const void* q;                 // [num_tokens, num_heads, head_size], the query dtype
  const void* k_cache;           // [num_blocks, block_size, num_kv_heads, head_size]
  const void* v_cache;           // same shape as k_cache
  void* out;                     // [num_tokens, num_heads, head_size], query dtype or fp8
  const uint32_t* cu_seqlens_q;  // [num_seqs + 1]
  const uint32_t* seq_lens;      // [num_seqs]
  const uint32_t* block_tables;  // [num_seqs, block_table_width]
  const uint32_t* prefix_ranges; // [num_seqs, max_ranges, 2] half-open, or null
  const float* alibi_slopes;     // [num_heads] or null
  const float* sinks;            // [num_heads] or null
  const float* qq_bias;          // [qq_rows, qq_cols] or null
  float* ws_acc;                 // split-KV partial outputs [num_tokens, num_heads, num_segments, head_size]
  float* ws_ml;                  // split-KV (max, sum) pairs [num_tokens, num_heads, num_segments, 2]
  uint32_t* ws_counters;         // split-KV arrival counters [grid_y, grid_x], zero between launches
  int64_t block_stride;          // elements between consecutive cache blocks
  int32_t num_seqs;
  int32_t num_tokens;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t block_size;
  int32_t block_table_width;
  int32_t max_ranges;
  int32_t qq_rows;
  int32_t qq_cols;
  int32_t sliding_window;   // 0: none
  int32_t num_segments;     // 1: write the output directly
  int32_t out_fp8;          // 1: out is F8E4M3
  int32_t vec_loads;        // 1: 16-byte loads are aligned and in bounds
  int32_t group_entries;    // query heads of one KV group handled by one program
  int32_t head_chunks;      // ceil(group_size / group_entries)
  int32_t q_len_min;        // programs of sequences with fewer new tokens exit
  int32_t q_len_max;        // programs of sequences with more new tokens exit
  int32_t ws_seq_rows;      // 0: split-KV partial rows are tokens; else seq * ws_seq_rows + row
  int32_t seq_programs;     // 1: program x serves sequence x (every span fits one program)
  float scale;              // score scale, times k_scale for fp8 caches
  float softcap;            // 0: off
  float v_scale;            // multiplies values (fp8 caches), else 1
  float out_inv_scale;      // 1 / output_scale for fp8 output, else 1
  int32_t seq_len_hint;     // stream decode: keys per sequence the host expects (0: none); a hint only
  int32_t decode_only;      // stream decode: 1 when every sequence has one new token (query row = sequence)
  int32_t single_segment_steps;  // stream decode with arrival counters: a sequence whose keys span at most
                                 // this many 16-key steps runs unsplit (0: the launch's segments always)
  int32_t reserved;              // 0; keeps the size a multiple of 8
};

// The layout both sides rely on. The Rust mirror asserts the same size, and
// a unit test in src/cuda/contract.rs reads these lines back and compares
// every offset with `std::mem::offset_of!` on the Rust struct.
static_assert(sizeof(AttnParams) == 232, "AttnParams size changed");
static_assert(offsetof(AttnParams, q) == 0, "AttnParams.q moved");
static_assert(offsetof(AttnParams, k_cache) == 8, "AttnParams.k_cache moved");
static_assert(offsetof(AttnParams, v_cache) == 16, "AttnParams.v_cache moved");
static_assert(offsetof(AttnParams, out) == 24, "AttnParams.out moved");
static_assert(offsetof(AttnParams, cu_seqlens_q) == 32, "AttnParams.cu_seqlens_q moved");
static_assert(offsetof(AttnParams, seq_lens) == 40, "AttnParams.seq_lens moved");
static_assert(offsetof(AttnParams, block_tables) == 48, "AttnParams.block_tables moved");
static_assert(offsetof(AttnParams, prefix_ranges) == 56, "AttnParams.prefix_ranges moved");
static_assert(offsetof(AttnParams, alibi_slopes) == 64, "AttnParams.alibi_slopes moved");
static_assert(offsetof(AttnParams, sinks) == 72, "AttnParams.sinks moved");
static_assert(offsetof(AttnParams, qq_bias) == 80, "AttnParams.qq_bias moved");
static_assert(offsetof(AttnParams, ws_acc) == 88, "AttnParams.ws_acc moved");
static_assert(offsetof(AttnParams, ws_ml) == 96, "AttnParams.ws_ml moved");
static_assert(offsetof(AttnParams, ws_counters) == 104, "AttnParams.ws_counters moved");
static_assert(offsetof(AttnParams, block_stride) == 112, "AttnParams.block_stride moved");
static_assert(offsetof(AttnParams, num_seqs) == 120, "AttnParams.num_seqs moved");
static_assert(offsetof(AttnParams, num_tokens) == 124, "AttnParams.num_tokens moved");
static_assert(offsetof(AttnParams, num_heads) == 128, "AttnParams.num_heads moved");
static_assert(offsetof(AttnParams, num_kv_heads) == 132, "AttnParams.num_kv_heads moved");
static_assert(offsetof(AttnParams, head_size) == 136, "AttnParams.head_size moved");
static_assert(offsetof(AttnParams, block_size) == 140, "AttnParams.block_size moved");
static_assert(offsetof(AttnParams, block_table_width) == 144, "AttnParams.block_table_width moved");
static_assert(offsetof(AttnParams, max_ranges) == 148, "AttnParams.max_ranges moved");
static_assert(offsetof(AttnParams, qq_rows) == 152, "AttnParams.qq_rows moved");
static_assert(offsetof(AttnParams, qq_cols) == 156, "AttnParams.qq_cols moved");
static_assert(offsetof(AttnParams, sliding_window) == 160, "AttnParams.sliding_window moved");
static_assert(offsetof(AttnParams, num_segments) == 164, "AttnParams.num_segments moved");
static_assert(offsetof(AttnParams, out_fp8) == 168, "AttnParams.out_fp8 moved");
static_assert(offsetof(AttnParams, vec_loads) == 172, "AttnParams.vec_loads moved");
static_assert(offsetof(AttnParams, group_entries) == 176, "AttnParams.group_entries moved");
static_assert(offsetof(AttnParams, head_chunks) == 180, "AttnParams.head_chunks moved");
static_assert(offsetof(AttnParams, q_len_min) == 184, "AttnParams.q_len_min moved");
static_assert(offsetof(AttnParams, q_len_max) == 188, "AttnParams.q_len_max moved");
static_assert(offsetof(AttnParams, ws_seq_rows) == 192, "AttnParams.ws_seq_rows moved");
static_assert(offsetof(AttnParams, seq_programs) == 196, "AttnParams.seq_programs moved");
static_assert(offsetof(AttnParams, scale) == 200, "AttnParams.scale moved");
static_assert(offsetof(AttnParams, softcap) == 204, "AttnParams.softcap moved");
static_assert(offsetof(AttnParams, v_scale) == 208, "AttnParams.v_scale moved");
static_assert(offsetof(AttnParams, out_inv_scale) == 212, "AttnParams.out_inv_scale moved");
static_assert(offsetof(AttnParams, seq_len_hint) == 216, "AttnParams.seq_len_hint moved");
static_assert(offsetof(AttnParams, decode_only) == 220, "AttnParams.decode_only moved");
static_assert(offsetof(AttnParams, single_segment_steps) == 224, "AttnParams.single_segment_steps moved");
static_assert(offsetof(AttnParams, reserved) == 228, "AttnParams.reserved moved");

// The parameter block of a mixed batch's one launch
// (kernels/mixed_attention.cuh): each part's `AttnParams` and the grid its
// programs would have as a launch of their own. Mirrored by `MixedParams`
// in src/cuda/contract.rs.
struct MixedParams {
  AttnParams prefill;     // the prefill part (warpgroup programs of 64 packed rows)
  AttnParams decode;      // the decode-shaped part (stream-decode programs)
  int32_t prefill_grid[3];  // (x, y, z) programs of the prefill part
  int32_t decode_grid[3];   // (x, y, z) programs of the decode part
  int32_t prefill_first;    // 1: the prefill programs take the launch's first places; 0: spread evenly
  int32_t reserved;         // 0; keeps the size a multiple of 8
};

static_assert(sizeof(MixedParams) == 496, "MixedParams size changed");
static_assert(offsetof(MixedParams, prefill) == 0, "MixedParams.prefill moved");
static_assert(offsetof(MixedParams, decode) == 232, "MixedParams.decode moved");
static_assert(offsetof(MixedParams, prefill_grid) == 464, "MixedParams.prefill_grid moved");
static_assert(offsetof(MixedParams, decode_grid) == 476, "MixedParams.decode_grid moved");
static_assert(offsetof(MixedParams, prefill_first) == 488, "MixedParams.prefill_first moved");
static_assert(offsetof(MixedParams, reserved) == 492, "MixedParams.reserved moved");

}  // namespace cpa
