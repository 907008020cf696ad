//! Paged attention on the CPU against the f64 oracle: a grid modelled on
//! vLLM's unified-attention test (scaled to CPU-sized caches), odd shapes,
//! every extra feature alone and in combination, and edge cases.

// Prefix ranges are `Vec<Range<u32>>` per sequence: one-range vectors are meant.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use candle_paged_attention::{paged_attention, KvSplit};
use common::*;
use rstest::rstest;

const CPU: Device = Device::Cpu;

/// 2 mixes x 3 head pairs x 2 block sizes x 3 windows x 2 softcaps x 6
/// rotations = 432 cases; the rotation spreads head sizes 64..256, the
/// f32/f16/bf16 x (fp8 cache or not) pairs and the split policies over them.
#[rstest]
fn grid(
    #[values(0, 1)] mix: usize,
    #[values((4, 4), (8, 2), (5, 1))] heads: (usize, usize),
    #[values(16, 32)] block_size: usize,
    #[values(None, Some(64), Some(256))] window: Option<usize>,
    #[values(None, Some(50.0))] softcap: Option<f32>,
    #[values(0, 1, 2, 3, 4, 5)] rotation: usize,
) -> Result<()> {
    let case = grid_case(mix, heads, block_size, window, softcap, rotation);
    check_case(&case, &CPU)
}

/// Every grid value of the rotated dimensions is covered several times.
#[test]
fn grid_covers_every_rotated_value() {
    let mut cases = Vec::new();
    for mix in 0..GRID_MIXES.len() {
        for heads in GRID_HEADS {
            for bs in GRID_BLOCK_SIZES {
                for window in GRID_WINDOWS {
                    for softcap in GRID_SOFTCAPS {
                        for rotation in 0..GRID_ROTATIONS {
                            cases.push(grid_case(mix, heads, bs, window, softcap, rotation));
                        }
                    }
                }
            }
        }
    }
    for hs in GRID_HEAD_SIZES {
        for (dtype, fp8) in GRID_DTYPES {
            let n = cases
                .iter()
                .filter(|c| c.head_size == hs && c.dtype == dtype && c.fp8_cache == fp8)
                .count();
            assert!(n >= 4, "head size {hs} with {dtype:?} fp8 {fp8}: {n} cases");
        }
        for heads in GRID_HEADS {
            let n = cases
                .iter()
                .filter(|c| c.head_size == hs && (c.num_heads, c.num_kv_heads) == heads)
                .count();
            assert!(n >= 4, "head size {hs} with heads {heads:?}: {n} cases");
        }
    }
}

/// Shapes outside the grid: q_len 1/5/129, head sizes 32/112/192/512,
/// GQA 9:3 and 6:3, MQA 4:1, MHA 1:1, other block sizes.
#[rstest]
#[case::gqa_9_3_hs32(&[(1, 300), (5, 40), (129, 200)], (9, 3), 32, 16, DType::F32, false)]
#[case::gqa_9_3_hs112_bf16(&[(1, 300), (5, 40), (129, 200)], (9, 3), 112, 32, DType::BF16, false)]
#[case::hs192_f16(&[(129, 129), (1, 77), (5, 5)], (6, 3), 192, 16, DType::F16, false)]
#[case::hs192_fp8(&[(129, 129), (1, 77), (5, 5)], (6, 3), 192, 16, DType::BF16, true)]
#[case::hs512_f32(&[(1, 400), (5, 60), (33, 90)], (4, 1), 512, 16, DType::F32, false)]
#[case::hs512_bf16(&[(1, 400), (5, 60), (33, 90)], (4, 1), 512, 32, DType::BF16, false)]
#[case::hs512_fp8(&[(1, 400), (5, 60)], (4, 1), 512, 16, DType::F16, true)]
#[case::mha_1_1(&[(1, 1), (2, 2), (7, 50)], (1, 1), 64, 16, DType::F32, false)]
#[case::block_size_1(&[(1, 20), (5, 9), (3, 3)], (4, 2), 32, 1, DType::F32, false)]
#[case::block_size_8(&[(1, 100), (5, 18), (17, 40)], (8, 2), 64, 8, DType::BF16, false)]
#[case::block_size_64(&[(1, 700), (5, 18), (129, 463)], (8, 2), 64, 64, DType::F16, false)]
#[case::block_size_7(&[(1, 50), (5, 18), (12, 12)], (4, 4), 32, 7, DType::F32, false)]
#[case::decode_only(&[(1, 1), (1, 16), (1, 17), (1, 33), (1, 900)], (8, 2), 128, 16, DType::BF16, false)]
#[case::prefill_only(&[(31, 31), (16, 16), (1, 1)], (8, 2), 128, 16, DType::F32, false)]
fn odd_shapes(
    #[case] seqs: &[(usize, usize)],
    #[case] heads: (usize, usize),
    #[case] head_size: usize,
    #[case] block_size: usize,
    #[case] dtype: DType,
    #[case] fp8_cache: bool,
    #[values(None, Some(24))] window: Option<usize>,
) -> Result<()> {
    let case = Case::new(seqs, heads, head_size, block_size, dtype)
        .with_fp8_cache(fp8_cache)
        .with_window(window)
        .with_seed(head_size as u64 * 31 + block_size as u64);
    check_case(&case, &CPU)
}

/// Every subset of {alibi, sinks, qq_bias, prefix ranges, fp8 output} (each
/// alone and in every combination) for each query dtype.
#[rstest]
fn features(
    #[values(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
        25, 26, 27, 28, 29, 30, 31
    )]
    mask: u32,
    #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
) -> Result<()> {
    check_case(&feature_case(mask, dtype), &CPU)
}

/// The features on the grid's first mix, with wider heads.
#[rstest]
fn features_on_grid_mix(
    #[values(ALIBI, SINKS, QQ_BIAS, PREFIX, FP8_OUT, ALIBI | SINKS | QQ_BIAS | PREFIX | FP8_OUT)]
    mask: u32,
    #[values(DType::F32, DType::BF16)] dtype: DType,
) -> Result<()> {
    let mut case = feature_case(mask, dtype);
    case.seqs = GRID_MIXES[0].to_vec();
    case.num_heads = 5;
    case.num_kv_heads = 1;
    case.head_size = 128;
    case.window = Some(256);
    check_case(&case, &CPU)
}

/// A `-inf` qq_bias at `[0][0]` leaves the first query row of every prefill
/// with no visible key: its output is exactly zero, never NaN.
#[rstest]
fn qq_bias_neg_inf_leaves_rows_with_no_key(
    #[values(DType::F32, DType::BF16)] dtype: DType,
    #[values(false, true)] sinks: bool,
) -> Result<()> {
    let case = Case::new(&[(6, 6), (1, 30), (4, 20), (9, 9)], (4, 2), 32, 8, dtype)
        .with_qq_bias(QqBias::WithNegInf)
        .with_sinks(sinks)
        .with_seed(7);
    let run = run_case(&case, &CPU)?;
    let empty = run.expected.empty_rows.iter().filter(|&&e| e).count();
    // Rows 0 of the two prefills, for all 4 heads at least.
    ensure!(
        empty >= 8,
        "expected rows with no visible key, found {empty}"
    );
    check_run(&case, &run)
}

/// A query inside a prefix range sees the range's keys after it; the output
/// differs from plain causal attention.
#[rstest]
fn prefix_range_sees_later_keys(#[values(DType::F32, DType::F16)] dtype: DType) -> Result<()> {
    let seqs = [(12, 12), (6, 30), (1, 9)];
    // Sequence 0: tokens 2..8 bidirectional; sequence 1: a range over
    // context and new tokens (24..30 are new) plus an empty range;
    // sequence 2: a range ending at seq_len.
    let ranges = vec![vec![2..8], vec![20..27, 5..5], vec![3..9]];
    let base = Case::new(&seqs, (4, 2), 32, 4, dtype).with_seed(11);
    let with_ranges = base.clone().with_prefix(Prefix::Explicit(ranges));
    check_case(&with_ranges, &CPU)?;
    let causal = op_output(&base, &CPU)?;
    let bidir = op_output(&with_ranges, &CPU)?;
    // Token 2 of sequence 0 (head 0) now sees keys 3..8.
    let d = base.head_size;
    let row = 2 * base.num_heads * d;
    ensure!(
        causal[row..row + d] != bidir[row..row + d],
        "the prefix range did not change query 2"
    );
    Ok(())
}

/// Prefix ranges override the sliding window.
#[test]
fn prefix_range_overrides_window() -> Result<()> {
    let case = Case::new(&[(40, 40), (8, 64)], (2, 1), 32, 16, DType::F32)
        .with_window(Some(4))
        .with_prefix(Prefix::Explicit(vec![vec![0..30], vec![50..60]]))
        .with_seed(5);
    check_case(&case, &CPU)
}

/// Cache rows no query may see (past seq_len in the last page, outside the
/// window, unused blocks, unused table columns) hold NaN, and the output
/// stays finite and correct.
#[rstest]
fn nan_in_unreachable_cache_rows_does_not_leak(
    #[values(DType::F32, DType::BF16)] dtype: DType,
    #[values(false, true)] fp8_cache: bool,
    #[values(None, Some(20))] window: Option<usize>,
) -> Result<()> {
    let case = Case::new(&[(1, 45), (7, 7), (5, 70), (1, 3)], (4, 2), 64, 16, dtype)
        .with_fp8_cache(fp8_cache)
        .with_window(window)
        .with_alibi(true)
        .with_sinks(true)
        .with_num_blocks(12)
        .with_seed(3);
    let inputs = case.build(&CPU)?;
    ensure!(inputs.host.nan_rows > 0, "the case holds no NaN rows");
    let stored_nans = inputs.host.key_cache.iter().filter(|x| x.is_nan()).count();
    ensure!(stored_nans > 0, "NaN did not survive the cache dtype");
    let actual = run_op(&case, &inputs)?;
    let run = CaseRun {
        actual,
        expected: oracle(&case, &inputs.host),
        host: inputs.host,
    };
    check_run(&case, &run)
}

/// Few blocks for many pages: ids repeat within and across sequences.
#[rstest]
fn repeated_block_ids(#[values(1, 3)] num_blocks: usize) -> Result<()> {
    let case = Case::new(&[(1, 90), (20, 50), (3, 3)], (8, 2), 64, 8, DType::F32)
        .with_num_blocks(num_blocks)
        .with_window(Some(30))
        .with_seed(num_blocks as u64);
    check_case(&case, &CPU)
}

/// KV scales are ignored for caches of the query dtype and applied to fp8
/// caches, whatever their values.
#[rstest]
#[case(0.01, 3.0)]
#[case(1.0, 1.0)]
#[case(2.5, 0.2)]
fn kv_scales(
    #[case] k_scale: f32,
    #[case] v_scale: f32,
    #[values(false, true)] fp8_cache: bool,
) -> Result<()> {
    let case = Case::new(&[(1, 60), (5, 25)], (4, 2), 64, 16, DType::BF16)
        .with_fp8_cache(fp8_cache)
        .with_kv_scales(k_scale, v_scale)
        .with_seed(17);
    check_case(&case, &CPU)
}

/// An fp8 output saturates at +-448 * output_scale.
#[test]
fn fp8_output_saturates() -> Result<()> {
    let case = Case::new(&[(1, 60), (5, 25)], (4, 2), 64, 16, DType::F32)
        .with_output_scale(Some(0.002))
        .with_seed(19);
    let run = run_case(&case, &CPU)?;
    let clamped = run
        .expected
        .values
        .iter()
        .filter(|v| v.abs() >= 448.0 * 0.002 - 1e-9)
        .count();
    ensure!(clamped > 0, "no output reached the fp8 limit");
    check_run(&case, &run)
}

/// Softcap 0 is off (not a cap of 0 or 1), a tight cap bites.
#[rstest]
#[case(Some(0.0))]
#[case(Some(0.5))]
#[case(Some(2.0))]
fn softcap_values(#[case] softcap: Option<f32>) -> Result<()> {
    let case = Case::new(&[(1, 60), (9, 25)], (4, 2), 64, 16, DType::F32)
        .with_softcap(softcap)
        .with_seed(23);
    check_case(&case, &CPU)?;
    if softcap == Some(0.0) {
        let off = op_output(&case.clone().with_softcap(None), &CPU)?;
        ensure!(
            off == op_output(&case, &CPU)?,
            "softcap 0 is not the same as None"
        );
    }
    Ok(())
}

/// Window 1 keeps only the diagonal; a window wider than every sequence is
/// plain causal attention.
#[rstest]
#[case(1)]
#[case(2)]
#[case(10_000)]
fn window_extremes(#[case] window: usize) -> Result<()> {
    let case = Case::new(&[(1, 60), (9, 25), (4, 4)], (4, 2), 32, 16, DType::F32)
        .with_window(Some(window))
        .with_seed(29);
    check_case(&case, &CPU)
}

/// The split-KV policy does not change the CPU result.
#[rstest]
fn kv_split_is_invisible(
    #[values(
        KvSplit::Auto,
        KvSplit::Never,
        KvSplit::Segments(1),
        KvSplit::Segments(7)
    )]
    split: KvSplit,
) -> Result<()> {
    let case = Case::new(&[(1, 300), (1, 17)], (8, 2), 64, 16, DType::F32).with_seed(31);
    let reference = op_output(&case, &CPU)?;
    let got = op_output(&case.clone().with_kv_split(split), &CPU)?;
    compare(
        &got,
        &reference.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        case.out_dims(),
        Tolerance::F32,
    )
}

/// A strided (non-contiguous) query gives the same result as its copy.
#[test]
fn strided_query() -> Result<()> {
    let case = Case::new(&[(3, 20), (1, 9)], (4, 2), 32, 8, DType::F32).with_seed(37);
    let inputs = case.build(&CPU)?;
    let want = run_op(&case, &inputs)?;
    // Same values, head and token axes swapped in memory.
    let strided = inputs.q.transpose(0, 1)?.contiguous()?.transpose(0, 1)?;
    assert!(!strided.is_contiguous());
    let out = paged_attention(&strided, &case.params(&inputs))?;
    let got = out.flatten_all()?.to_vec1::<f32>()?;
    ensure!(got == want, "strided query gives a different output");
    Ok(())
}

/// An empty batch: no sequences, or sequences with no new token.
#[rstest]
#[case::no_sequences(&[])]
#[case::no_tokens(&[(0, 17), (0, 5)])]
fn empty_batch(
    #[case] seqs: &[(usize, usize)],
    #[values(DType::F32, DType::BF16)] dtype: DType,
    #[values(None, Some(0.5))] output_scale: Option<f32>,
) -> Result<()> {
    let case = Case::new(seqs, (4, 2), 32, 16, dtype)
        .with_output_scale(output_scale)
        .with_sinks(true);
    let out = run_op(&case, &case.build(&CPU)?)?;
    ensure!(
        out.is_empty(),
        "expected no output values, got {}",
        out.len()
    );
    check_case(&case, &CPU)
}
