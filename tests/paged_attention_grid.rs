//! Paged attention against the f64 reference on every device: a grid
//! modelled on vLLM's unified-attention test (scaled to CPU-sized caches),
//! odd shapes, every extra feature alone and in combination, edge cases and
//! full-size cases (32k-token decodes, 32768-block caches, every feature at
//! once), each with the 2D and split-KV paths forced and chosen
//! automatically.
//!
//! Each body runs as `NAME::cpu` and, with the `cuda` feature, as
//! `NAME::cuda` (see `common::device` for the environment a GPU run needs);
//! on the GPU every case is also compared with the CPU path on the same
//! inputs. GPU-only checks (`cuda_test!`): caches past 2^31 elements.

// Prefix ranges are `Vec<Range<u32>>` per sequence: one-range vectors are meant.
#![allow(clippy::single_range_in_vec_init)]

#[macro_use]
mod common;

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use candle_paged_attention::{paged_attention, KvSplit};
use common::*;

device_test! {
    /// 2 mixes x 3 head pairs x 2 block sizes x 3 windows x 2 softcaps x 6
    /// rotations = 432 cases; the rotation spreads head sizes 64..256, the
    /// f32/f16/bf16 x (fp8 cache or not) pairs and the split policies over them.
    fn grid(
        dev: &Device,
        #[values(0, 1)] mix: usize,
        #[values((4, 4), (8, 2), (5, 1))] heads: (usize, usize),
        #[values(16, 32)] block_size: usize,
        #[values(None, Some(64), Some(256))] window: Option<usize>,
        #[values(None, Some(50.0))] softcap: Option<f32>,
        #[values(0, 1, 2, 3, 4, 5)] rotation: usize,
    ) -> Result<()> {
        let case = grid_case(mix, heads, block_size, window, softcap, rotation);
        check_case(&case, dev)
    }
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

device_test! {
    /// Shapes outside the grid: head sizes between and at the compiled ones
    /// (32 to 512, scalar-load widths), GQA 9:3 and 6:3, MQA 4:1 to 40:1, MHA
    /// 1:1, block sizes 1 to 64, decode-only and prefill-only batches and
    /// sequences with no new token; with and without a window, and with each
    /// split policy.
    #[case::gqa_9_3_hs32(&[(1, 300), (5, 40), (129, 200)], (9, 3), 32, 16, DType::F32, false)]
    #[case::gqa_9_3_hs32_bf16(&[(1, 300), (5, 40), (129, 200)], (9, 3), 32, 16, DType::BF16, false)]
    #[case::hs36_scalar_loads(&[(1, 130), (33, 50)], (4, 2), 36, 16, DType::BF16, false)]
    #[case::hs40_f16(&[(1, 300), (70, 90)], (4, 2), 40, 16, DType::F16, false)]
    #[case::hs72_odd_block(&[(1, 300), (17, 90)], (6, 2), 72, 7, DType::BF16, false)]
    #[case::gqa_9_3_hs112_bf16(&[(1, 300), (5, 40), (129, 200)], (9, 3), 112, 32, DType::BF16, false)]
    #[case::hs192_f16(&[(129, 129), (1, 77), (5, 5)], (6, 3), 192, 16, DType::F16, false)]
    #[case::hs192_fp8(&[(129, 129), (1, 77), (5, 5)], (6, 3), 192, 16, DType::BF16, true)]
    #[case::hs256_f16(&[(1, 700), (80, 300)], (8, 2), 256, 16, DType::F16, false)]
    #[case::hs300_f16(&[(1, 200), (40, 60)], (2, 1), 300, 16, DType::F16, false)]
    #[case::hs512_f32(&[(1, 400), (5, 60), (33, 90)], (4, 1), 512, 16, DType::F32, false)]
    #[case::hs512_f32_two_seqs(&[(1, 400), (33, 90)], (4, 1), 512, 16, DType::F32, false)]
    #[case::hs512_bf16(&[(1, 400), (5, 60), (33, 90)], (4, 1), 512, 32, DType::BF16, false)]
    #[case::hs512_fp8(&[(1, 400), (5, 60)], (4, 1), 512, 16, DType::F16, true)]
    #[case::mqa_32_1(&[(1, 500), (1, 9), (3, 40)], (32, 1), 128, 16, DType::BF16, false)]
    #[case::mqa_40_1_prefill(&[(20, 300)], (40, 1), 64, 16, DType::BF16, false)]
    #[case::mha_1_1(&[(1, 1), (2, 2), (7, 50)], (1, 1), 64, 16, DType::F32, false)]
    #[case::mha_1_1_f16(&[(1, 1), (2, 2), (7, 50)], (1, 1), 64, 16, DType::F16, false)]
    #[case::block_size_1(&[(1, 20), (5, 9), (3, 3)], (4, 2), 32, 1, DType::F32, false)]
    #[case::block_size_1_bf16(&[(1, 20), (5, 9), (3, 3)], (4, 2), 32, 1, DType::BF16, false)]
    #[case::block_size_7(&[(1, 50), (5, 18), (12, 12)], (4, 4), 32, 7, DType::F32, false)]
    #[case::block_size_8(&[(1, 100), (5, 18), (17, 40)], (8, 2), 64, 8, DType::BF16, false)]
    #[case::block_size_64(&[(1, 700), (5, 18), (129, 463)], (8, 2), 64, 64, DType::F16, false)]
    #[case::decode_only(&[(1, 1), (1, 16), (1, 17), (1, 33), (1, 900)], (8, 2), 128, 16, DType::BF16, false)]
    #[case::prefill_only(&[(31, 31), (16, 16), (1, 1)], (8, 2), 128, 16, DType::F32, false)]
    #[case::prefill_only_f16(&[(31, 31), (16, 16), (1, 1)], (8, 2), 128, 16, DType::F16, false)]
    #[case::empty_sequences(&[(0, 17), (3, 5), (0, 0), (1, 1)], (4, 2), 64, 16, DType::BF16, false)]
    // Long prefills: many 128-key tiles per program, so the stages of the
    // warp-specialised instances are refilled many times; a decode beside.
    #[case::long_prefill_bf16(&[(600, 1400), (260, 260), (1, 900)], (16, 4), 128, 16, DType::BF16, false)]
    #[case::long_prefill_f16_h64(&[(520, 1100), (1, 300), (333, 333)], (8, 2), 64, 32, DType::F16, false)]
    // Blocks of 12 (not a power of two) under the same long prefills.
    #[case::long_prefill_block_size_12(&[(400, 900), (1, 77), (130, 130)], (8, 2), 128, 12, DType::BF16, false)]
    fn shapes(
        dev: &Device,
        #[case] seqs: &[(usize, usize)],
        #[case] heads: (usize, usize),
        #[case] head_size: usize,
        #[case] block_size: usize,
        #[case] dtype: DType,
        #[case] fp8_cache: bool,
        #[values(None, Some(24))] window: Option<usize>,
        #[values(
            KvSplit::Auto,
            KvSplit::Never,
            KvSplit::Segments(5),
            KvSplit::AutoUpTo(1024)
        )]
        split: KvSplit,
    ) -> Result<()> {
        let case = Case::new(seqs, heads, head_size, block_size, dtype)
            .with_fp8_cache(fp8_cache)
            .with_window(window)
            .with_kv_split(split)
            .with_seed(head_size as u64 * 31 + block_size as u64);
        check_case(&case, dev)
    }
}

device_test! {
    /// Every subset of {alibi, sinks, qq_bias, prefix ranges, fp8 output} (each
    /// alone and in every combination) for each query dtype.
    fn features(
        dev: &Device,
        #[values(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
            24, 25, 26, 27, 28, 29, 30, 31
        )]
        mask: u32,
        #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
    ) -> Result<()> {
        check_case(&feature_case(mask, dtype), dev)
    }
}

device_test! {
    /// The features on the grid's first mix, with wider heads.
    fn features_on_grid_mix(
        dev: &Device,
        #[values(
            ALIBI,
            SINKS,
            QQ_BIAS,
            PREFIX,
            FP8_OUT,
            ALIBI | SINKS | QQ_BIAS | PREFIX | FP8_OUT
        )]
        mask: u32,
        #[values(DType::F32, DType::BF16)] dtype: DType,
    ) -> Result<()> {
        let mut case = feature_case(mask, dtype);
        case.seqs = GRID_MIXES[0].to_vec();
        case.num_heads = 5;
        case.num_kv_heads = 1;
        case.head_size = 128;
        case.window = Some(256);
        check_case(&case, dev)
    }
}

device_test! {
    /// A `-inf` qq_bias at `[0][0]` leaves the first query row of every prefill
    /// with no visible key: its output is exactly zero, never NaN.
    fn qq_bias_neg_inf_leaves_rows_with_no_key(
        dev: &Device,
        #[values(DType::F32, DType::BF16)] dtype: DType,
        #[values(false, true)] sinks: bool,
    ) -> Result<()> {
        let case = Case::new(&[(6, 6), (1, 30), (4, 20), (9, 9)], (4, 2), 32, 8, dtype)
            .with_qq_bias(QqBias::WithNegInf)
            .with_sinks(sinks)
            .with_seed(7);
        let run = run_case(&case, dev)?;
        let empty = run.expected.empty_rows().iter().filter(|&&e| e).count();
        // Rows 0 of the two prefills, for all 4 heads at least.
        ensure!(
            empty >= 8,
            "expected rows with no visible key, found {empty}"
        );
        check_run(&case, &run)
    }
}

device_test! {
    /// A query inside a prefix range sees the range's keys after it; the output
    /// differs from plain causal attention.
    fn prefix_range_sees_later_keys(
        dev: &Device,
        #[values(DType::F32, DType::F16)] dtype: DType,
    ) -> Result<()> {
        let seqs = [(12, 12), (6, 30), (1, 9)];
        // Sequence 0: tokens 2..8 bidirectional; sequence 1: a range over
        // context and new tokens (24..30 are new) plus an empty range;
        // sequence 2: a range ending at seq_len.
        let ranges = vec![vec![2..8], vec![20..27, 5..5], vec![3..9]];
        let base = Case::new(&seqs, (4, 2), 32, 4, dtype).with_seed(11);
        let with_ranges = base.clone().with_prefix(Prefix::Explicit(ranges));
        check_case(&with_ranges, dev)?;
        let causal = op_output(&base, dev)?;
        let bidir = op_output(&with_ranges, dev)?;
        // Token 2 of sequence 0 (head 0) now sees keys 3..8.
        let d = base.head_size;
        let row = 2 * base.num_heads * d;
        ensure!(
            causal[row..row + d] != bidir[row..row + d],
            "the prefix range did not change query 2"
        );
        Ok(())
    }
}

device_test! {
    /// Prefix ranges override the sliding window.
    fn prefix_range_overrides_window(dev: &Device) -> Result<()> {
        let case = Case::new(&[(40, 40), (8, 64)], (2, 1), 32, 16, DType::F32)
            .with_window(Some(4))
            .with_prefix(Prefix::Explicit(vec![vec![0..30], vec![50..60]]))
            .with_seed(5);
        check_case(&case, dev)
    }
}

device_test! {
    /// Cache rows no query may see (past seq_len in the last page, outside the
    /// window, unused blocks, unused table columns) hold NaN, and the output
    /// stays finite and correct.
    fn nan_in_unreachable_cache_rows_does_not_leak(
        dev: &Device,
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
        let inputs = case.build(dev)?;
        ensure!(inputs.nan_rows > 0, "the case holds no NaN rows");
        let stored = inputs.key_cache.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        let stored = stored.flatten_all()?.to_vec1::<f32>()?;
        let stored_nans = stored.iter().filter(|x| x.is_nan()).count();
        ensure!(stored_nans > 0, "NaN did not survive the cache dtype");
        let run = CaseRun {
            actual: run_op(&case, &inputs)?,
            expected: reference(&case, &inputs)?,
        };
        check_run(&case, &run)
    }
}

device_test! {
    /// Few blocks for many pages: ids repeat within and across sequences.
    fn repeated_block_ids(dev: &Device, #[values(1, 3)] num_blocks: usize) -> Result<()> {
        let case = Case::new(&[(1, 90), (20, 50), (3, 3)], (8, 2), 64, 8, DType::F32)
            .with_num_blocks(num_blocks)
            .with_window(Some(30))
            .with_seed(num_blocks as u64);
        check_case(&case, dev)
    }
}

device_test! {
    /// KV scales are ignored for caches of the query dtype and applied to fp8
    /// caches, whatever their values.
    #[case(0.01, 3.0)]
    #[case(1.0, 1.0)]
    #[case(2.5, 0.2)]
    fn kv_scales(
        dev: &Device,
        #[case] k_scale: f32,
        #[case] v_scale: f32,
        #[values(false, true)] fp8_cache: bool,
    ) -> Result<()> {
        let case = Case::new(&[(1, 60), (5, 25)], (4, 2), 64, 16, DType::BF16)
            .with_fp8_cache(fp8_cache)
            .with_kv_scales(k_scale, v_scale)
            .with_seed(17);
        check_case(&case, dev)
    }
}

device_test! {
    /// An fp8 output saturates at +-448 * output_scale.
    fn fp8_output_saturates(dev: &Device) -> Result<()> {
        let case = Case::new(&[(1, 60), (5, 25)], (4, 2), 64, 16, DType::F32)
            .with_output_scale(Some(0.002))
            .with_seed(19);
        let run = run_case(&case, dev)?;
        let clamped = run
            .expected
            .values()
            .iter()
            .filter(|v| v.abs() >= 448.0 * 0.002 - 1e-9)
            .count();
        ensure!(clamped > 0, "no output reached the fp8 limit");
        check_run(&case, &run)
    }
}

device_test! {
    /// Softcap 0 is off (not a cap of 0 or 1), a tight cap bites.
    #[case(Some(0.0))]
    #[case(Some(0.5))]
    #[case(Some(2.0))]
    fn softcap_values(dev: &Device, #[case] softcap: Option<f32>) -> Result<()> {
        let case = Case::new(&[(1, 60), (9, 25)], (4, 2), 64, 16, DType::F32)
            .with_softcap(softcap)
            .with_seed(23);
        check_case(&case, dev)?;
        if softcap == Some(0.0) {
            let off = op_output(&case.clone().with_softcap(None), dev)?;
            ensure!(
                off == op_output(&case, dev)?,
                "softcap 0 is not the same as None"
            );
        }
        Ok(())
    }
}

device_test! {
    /// Non-positive score scales on prefills long enough for whole key
    /// tiles. A fast path that takes row maxima of unscaled scores (the
    /// warp-specialised instance's `score_full`) gives wrong maxima under
    /// -0.09 (c * max is then the minimum); scale 0 must give every visible
    /// key the same weight. The default plan sends these short prefills to
    /// the warpgroup instances; `CANDLE_PAGED_ATTENTION_WS=1` (the README's
    /// test line) runs them through the warp-specialised one.
    #[case(-0.09)]
    #[case(0.0)]
    fn non_positive_scales(
        dev: &Device,
        #[case] scale: f32,
        #[values(DType::BF16, DType::F16)] dtype: DType,
        #[values(64, 128)] head_size: usize,
    ) -> Result<()> {
        let case = Case::new(&[(300, 700), (1, 260), (270, 270)], (8, 2), head_size, 16, dtype)
            .with_score_scale(scale)
            .with_seed(31);
        check_case(&case, dev)
    }
}

device_test! {
    /// Window 1 keeps only the diagonal; a window wider than every sequence is
    /// plain causal attention.
    #[case(1)]
    #[case(2)]
    #[case(10_000)]
    fn window_extremes(dev: &Device, #[case] window: usize) -> Result<()> {
        let case = Case::new(&[(1, 60), (9, 25), (4, 4)], (4, 2), 32, 16, DType::F32)
            .with_window(Some(window))
            .with_seed(29);
        check_case(&case, dev)
    }
}

device_test! {
    /// The split-KV policy changes the result by rounding at most.
    fn kv_split_is_invisible(
        dev: &Device,
        #[values(
            KvSplit::Auto,
            KvSplit::Never,
            KvSplit::Segments(1),
            KvSplit::Segments(7)
        )]
        split: KvSplit,
    ) -> Result<()> {
        let case = Case::new(&[(1, 300), (1, 17)], (8, 2), 64, 16, DType::F32).with_seed(31);
        let reference = op_output(&case, dev)?;
        let got = op_output(&case.clone().with_kv_split(split), dev)?;
        compare(&got, &widen(&reference), case.out_dims(), Tolerance::F32)
    }
}

device_test! {
    /// Two runs on the same inputs give bit-identical outputs (no races), and
    /// the split count changes the result only by rounding.
    fn deterministic_and_split_invariant(dev: &Device) -> Result<()> {
        let case = Case::new(&[(1, 5000), (1, 70), (1, 3000)], (32, 8), 128, 16, DType::BF16);
        let inputs = case.build(dev)?;
        let mut outs = Vec::new();
        for split in [
            KvSplit::Never,
            KvSplit::Never,
            KvSplit::Segments(9),
            KvSplit::Segments(9),
            KvSplit::Auto,
        ] {
            let params = case.params(&inputs).with_kv_split(split);
            let out = paged_attention(&inputs.q, &params)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            outs.push(out);
        }
        ensure!(outs[0] == outs[1], "two 2D runs differ");
        ensure!(outs[2] == outs[3], "two split runs differ");
        let f64s = widen(&outs[0]);
        compare(&outs[2], &f64s, case.out_dims(), Tolerance::HALF)?;
        compare(&outs[4], &f64s, case.out_dims(), Tolerance::HALF)
    }
}

device_test! {
    /// A strided (non-contiguous) query gives the same result as its copy.
    fn strided_query(dev: &Device) -> Result<()> {
        let case = Case::new(&[(3, 20), (1, 9)], (4, 2), 32, 8, DType::F32).with_seed(37);
        let inputs = case.build(dev)?;
        let want = run_op(&case, &inputs)?;
        // Same values, head and token axes swapped in memory.
        let strided = inputs.q.transpose(0, 1)?.contiguous()?.transpose(0, 1)?;
        ensure!(!strided.is_contiguous(), "the query is contiguous");
        let out = paged_attention(&strided, &case.params(&inputs))?;
        let got = out.flatten_all()?.to_vec1::<f32>()?;
        ensure!(got == want, "strided query gives a different output");
        Ok(())
    }
}

device_test! {
    /// An empty batch: no sequences, or sequences with no new token.
    #[case::no_sequences(&[])]
    #[case::no_tokens(&[(0, 17), (0, 5)])]
    fn empty_batch(
        dev: &Device,
        #[case] seqs: &[(usize, usize)],
        #[values(DType::F32, DType::BF16)] dtype: DType,
        #[values(None, Some(0.5))] output_scale: Option<f32>,
        #[values(32, 64)] head_size: usize,
    ) -> Result<()> {
        let case = Case::new(seqs, (4, 2), head_size, 16, dtype)
            .with_output_scale(output_scale)
            .with_sinks(true);
        let out = run_op(&case, &case.build(dev)?)?;
        ensure!(
            out.is_empty(),
            "expected no output values, got {}",
            out.len()
        );
        check_case(&case, dev)
    }
}

device_test! {
    /// Full-size cases: long contexts, large caches, every feature, each with
    /// the 2D path, a forced split and the automatic choice.
    #[case::decode_b1_32k(Case::new(&[(1, 32768)], (32, 8), 128, 16, DType::BF16))]
    #[case::decode_b1_32k_fp8(Case::new(&[(1, 32768)], (32, 8), 128, 16, DType::BF16).with_fp8_cache(true))]
    #[case::decode_b1_32k_gqa_5_1_h256(Case::new(&[(1, 32768)], (5, 1), 256, 32, DType::F16))]
    #[case::blocks_32768_h256_gqa_5_1(
        Case::new(&[(1, 9000), (1, 17), (7, 3000), (300, 2100)], (5, 1), 256, 16, DType::BF16).with_num_blocks(32768)
    )]
    #[case::mixed_block32_window(
        Case::new(&[(1, 4000), (1, 77), (300, 1200), (64, 64), (17, 2000)], (16, 4), 128, 32, DType::BF16).with_window(Some(512))
    )]
    #[case::mixed_softcap_sinks_alibi(
        Case::new(&[(1, 3000), (250, 900), (1, 5)], (16, 4), 128, 16, DType::BF16)
            .with_softcap(Some(30.0))
            .with_sinks(true)
            .with_alibi(true)
    )]
    #[case::mixed_qq_bias_prefix(
        Case::new(&[(1, 2000), (200, 700), (64, 64), (1, 3)], (8, 2), 128, 16, DType::F16)
            .with_qq_bias(QqBias::WithNegInf)
            .with_prefix(Prefix::Random)
    )]
    #[case::mixed_fp8_kv_fp8_out(
        Case::new(&[(1, 5000), (128, 1500), (1, 40)], (32, 8), 128, 16, DType::BF16)
            .with_fp8_cache(true)
            .with_output_scale(Some(0.05))
    )]
    #[case::everything(
        Case::new(&[(1, 6000), (1, 33), (150, 800), (40, 40)], (10, 2), 256, 32, DType::BF16)
            .with_window(Some(300))
            .with_softcap(Some(20.0))
            .with_sinks(true)
            .with_alibi(true)
            .with_qq_bias(QqBias::Random)
            .with_prefix(Prefix::Random)
            .with_fp8_cache(true)
            .with_output_scale(Some(0.1))
    )]
    #[case::decode_b64_window(
        Case::new(&[(1, 2000); 64], (32, 8), 128, 16, DType::BF16).with_window(Some(1024))
    )]
    fn full_size(
        dev: &Device,
        #[case] case: Case,
        #[values(KvSplit::Auto, KvSplit::Never, KvSplit::Segments(7))] split: KvSplit,
    ) -> Result<()> {
        check_case(&case.with_kv_split(split).with_seed(7), dev)
    }
}

cuda_test! {
    /// Caches of more than 2^31 elements: a sequence whose pages sit at the top
    /// of a 70000-block cache gives the same output as the same pages at the
    /// bottom of a small cache (which is checked against the CPU path). The
    /// pages are written by `reshape_and_cache`, so its 64-bit offsets are
    /// covered too.
    fn cache_offsets_past_2_pow_31(dev: &Device) -> Result<()> {
        use anyhow::Context;
        use candle_core::Tensor;
        use candle_paged_attention::{
            reshape_and_cache, KvScales, PagedAttentionParams, PagedBatch, SlotMapping,
        };

        let (heads, kv_heads, hs, bs) = (16usize, 8usize, 256usize, 16usize);
        let (q_len, seq_len) = (5usize, 3000usize);
        let pages = seq_len.div_ceil(bs);
        let big_blocks = 70000usize;
        ensure!(big_blocks * bs * kv_heads * hs > (1usize << 31));
        let k = Tensor::randn(0f32, 1.0, (seq_len, kv_heads, hs), dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (seq_len, kv_heads, hs), dev)?.to_dtype(DType::BF16)?;
        let q = Tensor::randn(0f32, 1.0, (q_len, heads, hs), dev)?.to_dtype(DType::BF16)?;
        let run = |num_blocks: usize, first_block: usize, device: &Device| -> Result<Vec<f32>> {
            let kc = Tensor::zeros((num_blocks, bs, kv_heads, hs), DType::BF16, device)?;
            let vc = kc.zeros_like()?;
            let table: Vec<u32> = (0..pages)
                .map(|i| (first_block + pages - 1 - i) as u32)
                .collect();
            let slots: Vec<i64> = (0..seq_len)
                .map(|t| (table[t / bs] as usize * bs + t % bs) as i64)
                .collect();
            let slots = SlotMapping::new(&slots, device)?;
            reshape_and_cache(
                &k.to_device(device)?,
                &v.to_device(device)?,
                &kc,
                &vc,
                &slots,
                KvScales::default(),
            )?;
            let batch =
                PagedBatch::from_rows(&[0, q_len as u32], &[seq_len as u32], &[table], bs, device)?;
            let params = PagedAttentionParams::new(&kc, &vc, &batch, 1.0 / (hs as f32).sqrt());
            let out = paged_attention(&q.to_device(device)?, &params)?;
            Ok(out
                .to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        let small_gpu = run(pages + 3, 2, dev)?;
        let small_cpu = run(pages + 3, 2, &Device::Cpu)?;
        let big_gpu = run(big_blocks, big_blocks - pages, dev)?;
        let dims = [q_len, heads, hs];
        compare(&small_gpu, &widen(&small_cpu), dims, Tolerance::HALF)
            .context("small cache, gpu vs cpu")?;
        ensure!(
            small_gpu == big_gpu,
            "the same pages at block ids past 2^31 elements give a different output"
        );
        Ok(())
    }
}
