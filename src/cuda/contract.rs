//! The Rust side of the Rust-CUDA contract: `AttnParams`, the parameter
//! block every attention kernel takes by value, and `MixedParams`, the one
//! of a mixed batch's one launch.
//!
//! kernels/attention_params.cuh holds `static_assert`s on the size and on
//! every field offset of `cpa::AttnParams`; this file asserts the size at
//! compile time and a unit test compares each offset of the header with
//! `offset_of!` here, so a field moved on one side alone fails a build or
//! a test.
//!
//! A leaf: imports nothing from this crate.

#[cfg(test)]
use std::mem::offset_of;

use candle_core::cuda_backend::cudarc::driver::DeviceRepr;

/// The kernels' parameter block; mirrors `cpa::AttnParams` in
/// kernels/attention_params.cuh field by field (8-byte fields first).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AttnParams {
    pub(crate) q: u64,
    pub(crate) k_cache: u64,
    pub(crate) v_cache: u64,
    pub(crate) out: u64,
    pub(crate) cu_seqlens_q: u64,
    pub(crate) seq_lens: u64,
    pub(crate) block_tables: u64,
    pub(crate) prefix_ranges: u64,
    pub(crate) alibi_slopes: u64,
    pub(crate) sinks: u64,
    pub(crate) qq_bias: u64,
    pub(crate) ws_acc: u64,
    pub(crate) ws_ml: u64,
    pub(crate) ws_counters: u64,
    pub(crate) block_stride: i64,
    pub(crate) num_seqs: i32,
    pub(crate) num_tokens: i32,
    pub(crate) num_heads: i32,
    pub(crate) num_kv_heads: i32,
    pub(crate) head_size: i32,
    pub(crate) block_size: i32,
    pub(crate) block_table_width: i32,
    pub(crate) max_ranges: i32,
    pub(crate) qq_rows: i32,
    pub(crate) qq_cols: i32,
    pub(crate) sliding_window: i32,
    pub(crate) num_segments: i32,
    pub(crate) out_fp8: i32,
    pub(crate) vec_loads: i32,
    pub(crate) group_entries: i32,
    pub(crate) head_chunks: i32,
    pub(crate) q_len_min: i32,
    pub(crate) q_len_max: i32,
    pub(crate) ws_seq_rows: i32,
    pub(crate) seq_programs: i32,
    pub(crate) scale: f32,
    pub(crate) softcap: f32,
    pub(crate) v_scale: f32,
    pub(crate) out_inv_scale: f32,
    /// Stream decode: the keys per sequence the host expects (0: none). A
    /// hint: programs load their first block-table entries for it before
    /// the real length arrives, and load them again when it was wrong.
    pub(crate) seq_len_hint: i32,
    /// Stream decode: 1 when every sequence has one new token (its query
    /// row is its index), so programs load queries before the lengths.
    pub(crate) decode_only: i32,
    /// Stream decode with arrival counters: a sequence whose keys span at
    /// most this many 16-key steps runs unsplit, its first segment's
    /// program writing the output and the others idle (0: every sequence
    /// takes the launch's `num_segments`).
    pub(crate) single_segment_steps: i32,
    /// 0; keeps the size a multiple of 8.
    pub(crate) reserved: i32,
}

/// Bytes of `cpa::AttnParams`; kernels/attention_params.cuh asserts the same.
pub(crate) const ATTN_PARAMS_BYTES: usize = 232;
const _: () = assert!(std::mem::size_of::<AttnParams>() == ATTN_PARAMS_BYTES);

// SAFETY: a `#[repr(C)]` block of integers and floats whose layout matches
// the kernels' `AttnParams` (checked by the size assertion above and field by field by the test
// below against the header's `offsetof` assertions); it is
// passed by value as the only kernel parameter.
unsafe impl DeviceRepr for AttnParams {}

/// The parameter block of a mixed batch's one launch
/// (`unified_attention_h{head}_mixed_r{rows}_{dtype}`); mirrors
/// `cpa::MixedParams` in kernels/attention_params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MixedParams {
    /// The prefill part's parameters.
    pub(crate) prefill: AttnParams,
    /// The decode-shaped part's parameters.
    pub(crate) decode: AttnParams,
    /// `(x, y, z)` programs of the prefill part.
    pub(crate) prefill_grid: [i32; 3],
    /// `(x, y, z)` programs of the decode-shaped part.
    pub(crate) decode_grid: [i32; 3],
    /// 1: the prefill programs take the launch's first places; 0: they are
    /// spread evenly among the decode programs.
    pub(crate) prefill_first: i32,
    /// 0; keeps the size a multiple of 8.
    pub(crate) reserved: i32,
}

/// Bytes of `cpa::MixedParams`; kernels/attention_params.cuh asserts the same.
pub(crate) const MIXED_PARAMS_BYTES: usize = 496;
const _: () = assert!(std::mem::size_of::<MixedParams>() == MIXED_PARAMS_BYTES);

// SAFETY: a `#[repr(C)]` block of two `AttnParams` and integers whose
// layout matches the kernels' `MixedParams` (the size assertion above and
// the offsets test below); passed by value as the only kernel parameter.
unsafe impl DeviceRepr for MixedParams {}

/// `(field, byte offset)` of every field of [`MixedParams`], in order.
#[cfg(test)]
pub(crate) const MIXED_PARAMS_OFFSETS: [(&str, usize); 6] = [
    ("prefill", offset_of!(MixedParams, prefill)),
    ("decode", offset_of!(MixedParams, decode)),
    ("prefill_grid", offset_of!(MixedParams, prefill_grid)),
    ("decode_grid", offset_of!(MixedParams, decode_grid)),
    ("prefill_first", offset_of!(MixedParams, prefill_first)),
    ("reserved", offset_of!(MixedParams, reserved)),
];

/// `(field, byte offset)` of every field of [`AttnParams`], in order (what
/// the header's `offsetof` assertions are compared with).
#[cfg(test)]
pub(crate) const ATTN_PARAMS_OFFSETS: [(&str, usize); 43] = [
    ("q", offset_of!(AttnParams, q)),
    ("k_cache", offset_of!(AttnParams, k_cache)),
    ("v_cache", offset_of!(AttnParams, v_cache)),
    ("out", offset_of!(AttnParams, out)),
    ("cu_seqlens_q", offset_of!(AttnParams, cu_seqlens_q)),
    ("seq_lens", offset_of!(AttnParams, seq_lens)),
    ("block_tables", offset_of!(AttnParams, block_tables)),
    ("prefix_ranges", offset_of!(AttnParams, prefix_ranges)),
    ("alibi_slopes", offset_of!(AttnParams, alibi_slopes)),
    ("sinks", offset_of!(AttnParams, sinks)),
    ("qq_bias", offset_of!(AttnParams, qq_bias)),
    ("ws_acc", offset_of!(AttnParams, ws_acc)),
    ("ws_ml", offset_of!(AttnParams, ws_ml)),
    ("ws_counters", offset_of!(AttnParams, ws_counters)),
    ("block_stride", offset_of!(AttnParams, block_stride)),
    ("num_seqs", offset_of!(AttnParams, num_seqs)),
    ("num_tokens", offset_of!(AttnParams, num_tokens)),
    ("num_heads", offset_of!(AttnParams, num_heads)),
    ("num_kv_heads", offset_of!(AttnParams, num_kv_heads)),
    ("head_size", offset_of!(AttnParams, head_size)),
    ("block_size", offset_of!(AttnParams, block_size)),
    (
        "block_table_width",
        offset_of!(AttnParams, block_table_width),
    ),
    ("max_ranges", offset_of!(AttnParams, max_ranges)),
    ("qq_rows", offset_of!(AttnParams, qq_rows)),
    ("qq_cols", offset_of!(AttnParams, qq_cols)),
    ("sliding_window", offset_of!(AttnParams, sliding_window)),
    ("num_segments", offset_of!(AttnParams, num_segments)),
    ("out_fp8", offset_of!(AttnParams, out_fp8)),
    ("vec_loads", offset_of!(AttnParams, vec_loads)),
    ("group_entries", offset_of!(AttnParams, group_entries)),
    ("head_chunks", offset_of!(AttnParams, head_chunks)),
    ("q_len_min", offset_of!(AttnParams, q_len_min)),
    ("q_len_max", offset_of!(AttnParams, q_len_max)),
    ("ws_seq_rows", offset_of!(AttnParams, ws_seq_rows)),
    ("seq_programs", offset_of!(AttnParams, seq_programs)),
    ("scale", offset_of!(AttnParams, scale)),
    ("softcap", offset_of!(AttnParams, softcap)),
    ("v_scale", offset_of!(AttnParams, v_scale)),
    ("out_inv_scale", offset_of!(AttnParams, out_inv_scale)),
    ("seq_len_hint", offset_of!(AttnParams, seq_len_hint)),
    ("decode_only", offset_of!(AttnParams, decode_only)),
    (
        "single_segment_steps",
        offset_of!(AttnParams, single_segment_steps),
    ),
    ("reserved", offset_of!(AttnParams, reserved)),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The `offsetof` assertions of `name` in the header, in order.
    fn header_offsets(name: &str) -> Result<Vec<(String, usize)>, String> {
        let header = include_str!("../../kernels/attention_params.cuh");
        let prefix = format!("static_assert(offsetof({name}, ");
        let mut seen = Vec::new();
        for line in header.lines() {
            let Some(rest) = line.trim().strip_prefix(prefix.as_str()) else {
                continue;
            };
            let malformed = || format!("a malformed offset assertion: {line}");
            let (field, rest) = rest.split_once(')').ok_or_else(malformed)?;
            let value: usize = rest
                .trim_start_matches(" == ")
                .split(',')
                .next()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(malformed)?;
            seen.push((field.to_string(), value));
        }
        Ok(seen)
    }

    fn owned(offsets: &[(&str, usize)]) -> Vec<(String, usize)> {
        offsets.iter().map(|&(n, o)| (n.to_string(), o)).collect()
    }

    /// Every `offsetof` assertion of the header agrees with the Rust
    /// structs, and every Rust field has one.
    #[test]
    fn header_offsets_match_the_rust_struct() -> Result<(), String> {
        let header = include_str!("../../kernels/attention_params.cuh");
        assert_eq!(header_offsets("AttnParams")?, owned(&ATTN_PARAMS_OFFSETS));
        assert_eq!(header_offsets("MixedParams")?, owned(&MIXED_PARAMS_OFFSETS));
        for size in [
            format!("static_assert(sizeof(AttnParams) == {ATTN_PARAMS_BYTES},"),
            format!("static_assert(sizeof(MixedParams) == {MIXED_PARAMS_BYTES},"),
        ] {
            assert!(header.contains(&size), "the header must assert {size}");
        }
        Ok(())
    }
}
