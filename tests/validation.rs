//! One test per validation error of `PagedBatch`, `paged_attention` and
//! `reshape_and_cache`, asserting the message names the op, the argument and
//! the bad value; and that empty batches are valid.
//!
//! Device mismatches need a second device and are covered by the GPU suite.

// Prefix ranges are `Vec<Range<u32>>` per sequence: one-range vectors are meant.
#![allow(clippy::single_range_in_vec_init)]

use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    paged_attention, reshape_and_cache, KvScales, KvSplit, PagedAttentionParams, PagedBatch,
    SlotMapping,
};
use rstest::rstest;

const CPU: Device = Device::Cpu;
const PA: &str = "paged-attention: ";
const RC: &str = "reshape-and-cache: ";

// A valid call: 4 query heads over 2 KV heads of size 8, 4 blocks of 4
// tokens; a prefill of 3 tokens (block 1) and a decode after 4 cached tokens
// (blocks 2, 3).
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_SIZE: usize = 8;
const NUM_BLOCKS: usize = 4;
const BLOCK_SIZE: usize = 4;

fn cache(dtype: DType) -> Tensor {
    Tensor::ones(
        (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE),
        DType::F32,
        &CPU,
    )
    .unwrap()
    .to_dtype(dtype)
    .unwrap()
}

fn query(tokens: usize, heads: usize, head_size: usize, dtype: DType) -> Tensor {
    Tensor::ones((tokens, heads, head_size), dtype, &CPU).unwrap()
}

fn batch() -> PagedBatch {
    PagedBatch::new(&[0, 3, 4], &[3, 5], &[1, 0, 2, 3], 2, BLOCK_SIZE, &CPU).unwrap()
}

fn params() -> PagedAttentionParams {
    PagedAttentionParams::new(&cache(DType::F32), &cache(DType::F32), &batch(), 0.35)
}

fn q() -> Tensor {
    query(4, HEADS, HEAD_SIZE, DType::F32)
}

/// Asserts `r` failed with a message starting with `prefix` and containing
/// every one of `parts`.
#[track_caller]
fn expect_err<T: std::fmt::Debug>(r: candle_core::Result<T>, prefix: &str, parts: &[&str]) {
    let msg = match r {
        Ok(v) => panic!("expected an error containing {parts:?}, got Ok({v:?})"),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.starts_with(prefix),
        "message {msg:?} does not start with {prefix:?}"
    );
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} does not contain {p:?}");
    }
}

#[track_caller]
fn expect_pa_err(p: &PagedAttentionParams, q: &Tensor, parts: &[&str]) {
    expect_err(paged_attention(q, p).map(|t| t.dims().to_vec()), PA, parts);
}

#[test]
fn valid_call_succeeds() {
    let out = paged_attention(&q(), &params()).unwrap();
    assert_eq!(out.dims(), &[4, HEADS, HEAD_SIZE]);
}

// ---- the query -------------------------------------------------------------

#[rstest]
#[case::rank_2(vec![4, HEADS * HEAD_SIZE], "[4, 32]")]
#[case::rank_4(vec![4, HEADS, HEAD_SIZE, 1], "[4, 4, 8, 1]")]
fn q_wrong_rank(#[case] shape: Vec<usize>, #[case] shown: &str) {
    let q = Tensor::ones(shape, DType::F32, &CPU).unwrap();
    expect_pa_err(&params(), &q, &["q must have rank 3", shown]);
}

#[rstest]
#[case(DType::F64, "F64")]
#[case(DType::U32, "U32")]
#[case(DType::F8E4M3, "F8E4M3")]
fn q_wrong_dtype(#[case] dtype: DType, #[case] shown: &str) {
    let q = Tensor::ones((4, HEADS, HEAD_SIZE), DType::F32, &CPU)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    expect_pa_err(&params(), &q, &["q must be f32, f16 or bf16", shown]);
}

#[test]
fn q_head_size_differs_from_cache() {
    let q = query(4, HEADS, 16, DType::F32);
    expect_pa_err(
        &params(),
        &q,
        &["q has head_size 16", "key_cache has head_size 8"],
    );
}

#[test]
fn head_size_too_large() {
    let c = Tensor::zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 520), DType::F32, &CPU).unwrap();
    let p = PagedAttentionParams::new(&c, &c, &batch(), 0.1);
    expect_pa_err(&p, &query(4, HEADS, 520, DType::F32), &["head_size", "520"]);
}

#[rstest]
#[case(5, "num_heads 5 is not a multiple of num_kv_heads 2")]
#[case(3, "num_heads 3 is not a multiple of num_kv_heads 2")]
#[case(1, "num_heads 1 is not a multiple of num_kv_heads 2")]
fn heads_not_divisible(#[case] heads: usize, #[case] msg: &str) {
    expect_pa_err(&params(), &query(4, heads, HEAD_SIZE, DType::F32), &[msg]);
}

#[test]
fn num_tokens_differs_from_cu_seqlens_q() {
    let q = query(5, HEADS, HEAD_SIZE, DType::F32);
    expect_pa_err(&params(), &q, &["cu_seqlens_q ends at 4", "q has 5 tokens"]);
}

// ---- the caches ------------------------------------------------------------

#[test]
fn key_cache_wrong_rank() {
    let c = Tensor::zeros(
        (NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_SIZE),
        DType::F32,
        &CPU,
    )
    .unwrap();
    let p = PagedAttentionParams::new(&c, &c, &batch(), 0.35);
    expect_pa_err(&p, &q(), &["key_cache must have rank 4", "[16, 2, 8]"]);
}

#[test]
fn value_cache_shape_differs() {
    let vc = Tensor::zeros(
        (NUM_BLOCKS + 1, BLOCK_SIZE, KV_HEADS, HEAD_SIZE),
        DType::F32,
        &CPU,
    )
    .unwrap();
    let p = PagedAttentionParams::new(&cache(DType::F32), &vc, &batch(), 0.35);
    expect_pa_err(
        &p,
        &q(),
        &[
            "value_cache shape [5, 4, 2, 8]",
            "key_cache shape [4, 4, 2, 8]",
        ],
    );
}

#[test]
fn key_and_value_cache_dtypes_differ() {
    let p = PagedAttentionParams::new(&cache(DType::F32), &cache(DType::F8E4M3), &batch(), 0.35);
    expect_pa_err(&p, &q(), &["key_cache is F32", "value_cache is F8E4M3"]);
}

#[rstest]
#[case(
    DType::F32,
    DType::F16,
    "key_cache must be F32 (the query dtype) or F8E4M3, got F16"
)]
#[case(
    DType::BF16,
    DType::F32,
    "key_cache must be BF16 (the query dtype) or F8E4M3, got F32"
)]
fn cache_dtype_not_query_dtype(#[case] q_dtype: DType, #[case] c_dtype: DType, #[case] msg: &str) {
    let p = PagedAttentionParams::new(&cache(c_dtype), &cache(c_dtype), &batch(), 0.35);
    expect_pa_err(&p, &query(4, HEADS, HEAD_SIZE, q_dtype), &[msg]);
}

#[test]
fn cache_not_contiguous() {
    // Same shape, transposed storage.
    let c = Tensor::zeros(
        (NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE, KV_HEADS),
        DType::F32,
        &CPU,
    )
    .unwrap()
    .transpose(2, 3)
    .unwrap();
    let p = PagedAttentionParams::new(&c, &c, &batch(), 0.35);
    expect_pa_err(&p, &q(), &["must be contiguous"]);
}

#[test]
fn block_size_of_batch_differs_from_cache() {
    let b = PagedBatch::new(&[0, 3, 4], &[3, 5], &[1, 2], 1, 8, &CPU).unwrap();
    let p = PagedAttentionParams::new(&cache(DType::F32), &cache(DType::F32), &b, 0.35);
    expect_pa_err(&p, &q(), &["block_size 8", "block_size 4"]);
}

#[test]
fn block_id_not_below_num_blocks() {
    let b = PagedBatch::new(&[0, 3, 4], &[3, 5], &[1, 0, 2, 4], 2, BLOCK_SIZE, &CPU).unwrap();
    let p = PagedAttentionParams::new(&cache(DType::F32), &cache(DType::F32), &b, 0.35);
    expect_pa_err(&p, &q(), &["block id 4 >= num_blocks 4"]);
}

#[test]
fn block_ids_past_a_sequence_are_not_checked() {
    // Sequence 0 needs one block; its second column is padding.
    let b = PagedBatch::new(&[0, 3, 4], &[3, 5], &[1, 99, 2, 3], 2, BLOCK_SIZE, &CPU).unwrap();
    let p = PagedAttentionParams::new(&cache(DType::F32), &cache(DType::F32), &b, 0.35);
    paged_attention(&q(), &p).unwrap();
}

// ---- the batch -------------------------------------------------------------

#[test]
fn cu_seqlens_q_not_starting_at_0() {
    let r = PagedBatch::new(&[1, 3, 4], &[3, 5], &[1, 0, 2, 3], 2, BLOCK_SIZE, &CPU);
    expect_err(r, PA, &["cu_seqlens_q must start at 0, got 1"]);
}

#[test]
fn cu_seqlens_q_decreasing() {
    let r = PagedBatch::new(&[0, 3, 2], &[3, 5], &[1, 0, 2, 3], 2, BLOCK_SIZE, &CPU);
    expect_err(
        r,
        PA,
        &[
            "cu_seqlens_q must be non-decreasing",
            "cu_seqlens_q[1] = 3 > cu_seqlens_q[2] = 2",
        ],
    );
}

#[test]
fn cu_seqlens_q_length_differs_from_seq_lens() {
    let r = PagedBatch::new(&[0, 3], &[3, 5], &[1, 0, 2, 3], 2, BLOCK_SIZE, &CPU);
    expect_err(r, PA, &["cu_seqlens_q has 2 entries but seq_lens has 2"]);
}

#[test]
fn q_len_longer_than_seq_len() {
    let r = PagedBatch::new(&[0, 3, 5], &[3, 1], &[1, 0, 2, 3], 2, BLOCK_SIZE, &CPU);
    expect_err(r, PA, &["sequence 1 has q_len 2 > seq_len 1"]);
}

#[test]
fn block_table_too_narrow() {
    let r = PagedBatch::new(&[0, 3, 4], &[3, 9], &[1, 0, 2, 3], 2, BLOCK_SIZE, &CPU);
    expect_err(
        r,
        PA,
        &[
            "block_tables has width 2",
            "sequence 1 with seq_len 9 needs 3 blocks",
        ],
    );
}

#[test]
fn block_table_length_differs_from_width() {
    let r = PagedBatch::new(&[0, 3, 4], &[3, 5], &[1, 0, 2], 2, BLOCK_SIZE, &CPU);
    expect_err(
        r,
        PA,
        &["block_tables holds 3 ids", "2 sequences x width 2 need 4"],
    );
}

#[test]
fn block_table_rows_differ_from_seq_lens() {
    let r = PagedBatch::from_rows(&[0, 3, 4], &[3, 5], &[vec![1]], BLOCK_SIZE, &CPU);
    expect_err(
        r,
        PA,
        &["block_tables has 1 rows", "seq_lens describes 2 sequences"],
    );
}

#[test]
fn block_size_zero() {
    let r = PagedBatch::new(&[0, 3, 4], &[3, 5], &[1, 0, 2, 3], 2, 0, &CPU);
    expect_err(r, PA, &["block_size must be positive, got 0"]);
}

#[test]
fn prefix_ranges_count_differs_from_sequences() {
    let r = batch().with_prefix_ranges(&[vec![0..2]]);
    expect_err(
        r,
        PA,
        &["prefix_ranges has 1 entries", "batch has 2 sequences"],
    );
}

#[test]
fn prefix_range_start_after_end() {
    #[allow(clippy::reversed_empty_ranges)]
    let r = batch().with_prefix_ranges(&[vec![], vec![3..1]]);
    expect_err(r, PA, &["prefix_ranges[1] = 3..1 has start > end"]);
}

#[test]
fn prefix_range_past_seq_len() {
    let r = batch().with_prefix_ranges(&[vec![0..4], vec![]]);
    expect_err(r, PA, &["prefix_ranges[0] = 0..4 ends past seq_len 3"]);
}

// ---- scalars ---------------------------------------------------------------

#[rstest]
#[case(f32::NAN, "NaN")]
#[case(f32::INFINITY, "inf")]
fn scale_not_finite(#[case] scale: f32, #[case] shown: &str) {
    let mut p = params();
    p.scale = scale;
    expect_pa_err(&p, &q(), &["scale must be finite", shown]);
}

#[test]
fn sliding_window_zero() {
    let p = params().with_sliding_window(Some(0));
    expect_pa_err(&p, &q(), &["sliding_window must be at least 1, got 0"]);
}

#[rstest]
#[case(-1.0, "-1")]
#[case(f32::NAN, "NaN")]
#[case(f32::INFINITY, "inf")]
fn softcap_invalid(#[case] cap: f32, #[case] shown: &str) {
    let p = params().with_softcap(Some(cap));
    expect_pa_err(&p, &q(), &["softcap must be finite and >= 0", shown]);
}

#[rstest]
#[case(KvScales::new(0.0, 1.0), "k_scale must be finite and > 0, got 0")]
#[case(KvScales::new(-2.0, 1.0), "k_scale must be finite and > 0, got -2")]
#[case(
    KvScales::new(1.0, f32::NAN),
    "v_scale must be finite and > 0, got NaN"
)]
#[case(
    KvScales::new(1.0, f32::INFINITY),
    "v_scale must be finite and > 0, got inf"
)]
fn kv_scales_invalid_for_fp8_cache(#[case] scales: KvScales, #[case] msg: &str) {
    let c = cache(DType::F8E4M3);
    let p = PagedAttentionParams::new(&c, &c, &batch(), 0.35).with_kv_scales(scales);
    expect_pa_err(&p, &q(), &[msg]);
}

#[test]
fn kv_scales_ignored_for_plain_cache() {
    let p = params().with_kv_scales(KvScales::new(0.0, -1.0));
    paged_attention(&q(), &p).unwrap();
}

#[rstest]
#[case(0.0, "got 0")]
#[case(-0.5, "got -0.5")]
#[case(f32::NAN, "got NaN")]
#[case(f32::INFINITY, "got inf")]
fn output_scale_invalid(#[case] scale: f32, #[case] shown: &str) {
    let p = params().with_output_scale(Some(scale));
    expect_pa_err(&p, &q(), &["output_scale must be finite and > 0", shown]);
}

#[test]
fn kv_split_zero_segments() {
    let p = params().with_kv_split(KvSplit::Segments(0));
    expect_pa_err(&p, &q(), &["kv_split Segments(0)"]);
}

// ---- per-head vectors and qq_bias ------------------------------------------

#[rstest]
#[case::alibi("alibi_slopes")]
#[case::sinks("sinks")]
fn head_vector_wrong_shape(#[case] name: &str) {
    let v = Tensor::zeros(HEADS + 1, DType::F32, &CPU).unwrap();
    let p = match name {
        "sinks" => params().with_sinks(Some(v)),
        _ => params().with_alibi_slopes(Some(v)),
    };
    expect_pa_err(
        &p,
        &q(),
        &[&format!("{name} must have shape [num_heads = 4], got [5]")],
    );
}

#[rstest]
#[case::alibi("alibi_slopes")]
#[case::sinks("sinks")]
fn head_vector_wrong_dtype(#[case] name: &str) {
    let v = Tensor::zeros(HEADS, DType::F16, &CPU).unwrap();
    let p = match name {
        "sinks" => params().with_sinks(Some(v)),
        _ => params().with_alibi_slopes(Some(v)),
    };
    expect_pa_err(&p, &q(), &[&format!("{name} must be f32, got F16")]);
}

#[test]
fn qq_bias_too_few_rows() {
    let b = Tensor::zeros((2, 3), DType::F32, &CPU).unwrap();
    let p = params().with_qq_bias(Some(b));
    expect_pa_err(&p, &q(), &["qq_bias has 2 rows", "longest query span is 3"]);
}

#[test]
fn qq_bias_wrong_rank() {
    let b = Tensor::zeros(3, DType::F32, &CPU).unwrap();
    let p = params().with_qq_bias(Some(b));
    expect_pa_err(&p, &q(), &["qq_bias must have rank 2", "[3]"]);
}

#[test]
fn qq_bias_wrong_dtype() {
    let b = Tensor::zeros((3, 3), DType::BF16, &CPU).unwrap();
    let p = params().with_qq_bias(Some(b));
    expect_pa_err(&p, &q(), &["qq_bias must be f32, got BF16"]);
}

// ---- empty batches ---------------------------------------------------------

#[rstest]
#[case::no_sequences(&[0], &[])]
#[case::no_new_tokens(&[0, 0, 0], &[3, 5])]
fn empty_batch_is_valid(#[case] cu: &[u32], #[case] seq_lens: &[u32]) {
    let width = if seq_lens.is_empty() { 0 } else { 2 };
    let table = vec![1u32; seq_lens.len() * width];
    let b = PagedBatch::new(cu, seq_lens, &table, width, BLOCK_SIZE, &CPU).unwrap();
    let p = PagedAttentionParams::new(&cache(DType::BF16), &cache(DType::BF16), &b, 0.35);
    let out = paged_attention(&query(0, HEADS, HEAD_SIZE, DType::BF16), &p).unwrap();
    assert_eq!(out.dims(), &[0, HEADS, HEAD_SIZE]);
    assert_eq!(out.dtype(), DType::BF16);
}

// ---- reshape_and_cache -----------------------------------------------------

fn kv(tokens: usize, dtype: DType) -> Tensor {
    Tensor::ones((tokens, KV_HEADS, HEAD_SIZE), dtype, &CPU).unwrap()
}

fn slots(n: usize) -> SlotMapping {
    SlotMapping::new(&(0..n as i64).collect::<Vec<_>>(), &CPU).unwrap()
}

#[test]
fn rc_valid_call_succeeds() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &kc,
        &vc,
        &slots(3),
        KvScales::default(),
    )
    .unwrap();
}

#[test]
fn rc_key_and_value_shapes_differ() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(2, DType::F32),
        &kc,
        &vc,
        &slots(3),
        KvScales::default(),
    );
    expect_err(
        r,
        RC,
        &["key shape [3, 2, 8] differs from value shape [2, 2, 8]"],
    );
}

#[test]
fn rc_cache_shapes_differ() {
    let kc = cache(DType::F32);
    let vc = Tensor::zeros(
        (NUM_BLOCKS, BLOCK_SIZE + 1, KV_HEADS, HEAD_SIZE),
        DType::F32,
        &CPU,
    )
    .unwrap();
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &kc,
        &vc,
        &slots(3),
        KvScales::default(),
    );
    expect_err(
        r,
        RC,
        &["key_cache shape [4, 4, 2, 8] differs from value_cache shape [4, 5, 2, 8]"],
    );
}

#[test]
fn rc_key_wrong_rank() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    let k = Tensor::ones((3, KV_HEADS * HEAD_SIZE), DType::F32, &CPU).unwrap();
    let r = reshape_and_cache(&k, &k, &kc, &vc, &slots(3), KvScales::default());
    expect_err(r, RC, &["key must have rank 3", "[3, 16]"]);
}

#[test]
fn rc_cache_wrong_rank() {
    let c = Tensor::zeros(
        (NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_SIZE),
        DType::F32,
        &CPU,
    )
    .unwrap();
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &c,
        &c,
        &slots(3),
        KvScales::default(),
    );
    expect_err(r, RC, &["key_cache must have rank 4", "[16, 2, 8]"]);
}

#[test]
fn rc_key_wrong_dtype() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    let k = kv(3, DType::F64);
    let r = reshape_and_cache(&k, &k, &kc, &vc, &slots(3), KvScales::default());
    expect_err(r, RC, &["key must be f32, f16 or bf16, got F64"]);
}

#[test]
fn rc_cache_dtype_mismatch() {
    let (kc, vc) = (cache(DType::F16), cache(DType::F16));
    let r = reshape_and_cache(
        &kv(3, DType::BF16),
        &kv(3, DType::BF16),
        &kc,
        &vc,
        &slots(3),
        KvScales::default(),
    );
    expect_err(
        r,
        RC,
        &["key_cache must be BF16 (the key dtype) or F8E4M3, got F16"],
    );
}

#[test]
fn rc_value_cache_dtype_mismatch() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F16));
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &kc,
        &vc,
        &slots(3),
        KvScales::default(),
    );
    expect_err(
        r,
        RC,
        &["value_cache must be F32 (the value dtype) or F8E4M3, got F16"],
    );
}

#[test]
fn rc_heads_mismatch() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    let k = Tensor::ones((3, KV_HEADS, HEAD_SIZE * 2), DType::F32, &CPU).unwrap();
    let r = reshape_and_cache(&k, &k, &kc, &vc, &slots(3), KvScales::default());
    expect_err(
        r,
        RC,
        &[
            "key has 2 heads of size 16",
            "key_cache has 2 heads of size 8",
        ],
    );
}

#[test]
fn rc_slot_mapping_length() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &kc,
        &vc,
        &slots(4),
        KvScales::default(),
    );
    expect_err(r, RC, &["slot_mapping has 4 entries", "key has 3 tokens"]);
}

#[test]
fn rc_slot_past_capacity() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    let s = SlotMapping::new(&[0, 16, -1], &CPU).unwrap();
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &kc,
        &vc,
        &s,
        KvScales::default(),
    );
    expect_err(
        r,
        RC,
        &["slot_mapping holds slot 16 >= num_blocks * block_size = 16"],
    );
}

#[rstest]
#[case(KvScales::new(0.0, 1.0), "k_scale must be finite and > 0, got 0")]
#[case(KvScales::new(1.0, -1.0), "v_scale must be finite and > 0, got -1")]
#[case(
    KvScales::new(f32::NAN, 1.0),
    "k_scale must be finite and > 0, got NaN"
)]
fn rc_fp8_scales_invalid(#[case] scales: KvScales, #[case] msg: &str) {
    let (kc, vc) = (cache(DType::F8E4M3), cache(DType::F8E4M3));
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &kc,
        &vc,
        &slots(3),
        scales,
    );
    expect_err(r, RC, &[msg]);
}

#[test]
fn rc_cache_not_contiguous() {
    let c = Tensor::zeros(
        (NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE, KV_HEADS),
        DType::F32,
        &CPU,
    )
    .unwrap()
    .transpose(2, 3)
    .unwrap();
    let r = reshape_and_cache(
        &kv(3, DType::F32),
        &kv(3, DType::F32),
        &c,
        &c,
        &slots(3),
        KvScales::default(),
    );
    expect_err(r, RC, &["key_cache must be contiguous"]);
}

#[test]
fn rc_no_tokens_is_valid() {
    let (kc, vc) = (cache(DType::F32), cache(DType::F32));
    reshape_and_cache(
        &kv(0, DType::F32),
        &kv(0, DType::F32),
        &kc,
        &vc,
        &slots(0),
        KvScales::default(),
    )
    .unwrap();
}
