// The parameter block of the attention kernels, passed by value. Its layout is
// mirrored field by field by `AttnParams` in src/cuda/paged_attention.rs:
// 8-byte fields first, then 4-byte fields, no implicit padding.
#pragma once

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
};

}  // namespace cpa
