//! Paged attention and reshape-and-cache on CUDA device 0: the CPU suite's
//! case bodies run on the GPU and are checked against the f64 oracle and
//! against the CPU path on the same inputs, plus full-size cases (32k-token
//! decodes, 32768-block caches, caches past 2^31 elements, every feature at
//! once) with the 2D and split-KV paths forced and chosen automatically.
//!
//! Outputs are filled with NaN before every launch
//! (`CANDLE_PAGED_ATTENTION_POISON=1`, set here before the first launch), so
//! an element the kernels do not write fails the finiteness check. Without a
//! CUDA device every test prints `SKIPPED` and passes.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Once;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    paged_attention, reshape_and_cache, KvScales, KvSplit, PagedAttentionParams, PagedBatch,
    SlotMapping,
};
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rstest::rstest;

const CPU: Device = Device::Cpu;

/// CUDA device 0, or `None` (with a `SKIPPED` line) when there is none.
fn gpu(test: &str) -> Option<Device> {
    static POISON: Once = Once::new();
    POISON.call_once(|| {
        if std::env::var_os("CANDLE_PAGED_ATTENTION_POISON").is_none() {
            std::env::set_var("CANDLE_PAGED_ATTENTION_POISON", "1");
        }
    });
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            None
        }
    }
}

/// The case body on the GPU: the oracle check, then the GPU output against
/// the CPU path's output on the same inputs.
fn check_on_gpu(case: &Case, dev: &Device) -> Result<()> {
    let run = run_case(case, dev).with_context(|| case.label())?;
    check_run(case, &run).with_context(|| format!("gpu vs oracle: {}", case.label()))?;
    let cpu = op_output(case, &CPU).with_context(|| case.label())?;
    let f64s: Vec<f64> = cpu.iter().map(|&x| x as f64).collect();
    compare(
        &run.actual,
        &f64s,
        case.out_dims(),
        Tolerance::for_case(case),
    )
    .with_context(|| format!("gpu vs cpu: {}", case.label()))
}

/// The CPU suite's grid (vLLM's unified-attention test, scaled down).
#[rstest]
fn grid(
    #[values(0, 1)] mix: usize,
    #[values((4, 4), (8, 2), (5, 1))] heads: (usize, usize),
    #[values(16, 32)] block_size: usize,
    #[values(None, Some(64), Some(256))] window: Option<usize>,
    #[values(None, Some(50.0))] softcap: Option<f32>,
    #[values(0, 1, 2, 3, 4, 5)] rotation: usize,
) -> Result<()> {
    let Some(dev) = gpu("grid") else {
        return Ok(());
    };
    check_on_gpu(
        &grid_case(mix, heads, block_size, window, softcap, rotation),
        &dev,
    )
}

/// Every combination of ALiBi, sinks, qq_bias, prefix ranges and fp8 output.
#[rstest]
fn feature_combinations(
    #[values(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
        25, 26, 27, 28, 29, 30, 31
    )]
    features: u32,
    #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
) -> Result<()> {
    let Some(dev) = gpu("feature_combinations") else {
        return Ok(());
    };
    check_on_gpu(&feature_case(features, dtype), &dev)
}

/// Head sizes between and at the compiled ones, odd group sizes, block
/// sizes, and both tile shapes.
#[rstest]
#[case::hs32_gqa_9_3(&[(1, 300), (5, 40), (129, 200)], (9, 3), 32, 16, DType::BF16, false)]
#[case::hs40_f16(&[(1, 300), (70, 90)], (4, 2), 40, 16, DType::F16, false)]
#[case::hs72_odd_block(&[(1, 300), (17, 90)], (6, 2), 72, 7, DType::BF16, false)]
#[case::hs36_scalar_loads(&[(1, 130), (33, 50)], (4, 2), 36, 16, DType::BF16, false)]
#[case::hs112_bf16(&[(1, 300), (5, 40), (129, 200)], (9, 3), 112, 32, DType::BF16, false)]
#[case::hs192_fp8(&[(129, 129), (1, 77), (5, 5)], (6, 3), 192, 16, DType::BF16, true)]
#[case::hs256_f16(&[(1, 700), (80, 300)], (8, 2), 256, 16, DType::F16, false)]
#[case::hs512_bf16(&[(1, 400), (5, 60), (33, 90)], (4, 1), 512, 32, DType::BF16, false)]
#[case::hs512_fp8(&[(1, 400), (5, 60)], (4, 1), 512, 16, DType::F16, true)]
#[case::hs300_f16(&[(1, 200), (40, 60)], (2, 1), 300, 16, DType::F16, false)]
#[case::hs512_f32(&[(1, 400), (33, 90)], (4, 1), 512, 16, DType::F32, false)]
#[case::mqa_32_1(&[(1, 500), (1, 9), (3, 40)], (32, 1), 128, 16, DType::BF16, false)]
#[case::mqa_40_1_prefill(&[(20, 300)], (40, 1), 64, 16, DType::BF16, false)]
#[case::mha_1_1(&[(1, 1), (2, 2), (7, 50)], (1, 1), 64, 16, DType::F16, false)]
#[case::block_size_1(&[(1, 20), (5, 9), (3, 3)], (4, 2), 32, 1, DType::BF16, false)]
#[case::block_size_64(&[(1, 700), (5, 18), (129, 463)], (8, 2), 64, 64, DType::F16, false)]
#[case::decode_only(&[(1, 1), (1, 16), (1, 17), (1, 33), (1, 900)], (8, 2), 128, 16, DType::BF16, false)]
#[case::prefill_only(&[(31, 31), (16, 16), (1, 1)], (8, 2), 128, 16, DType::F16, false)]
#[case::empty_sequences(&[(0, 17), (3, 5), (0, 0), (1, 1)], (4, 2), 64, 16, DType::BF16, false)]
fn shapes(
    #[case] seqs: &[(usize, usize)],
    #[case] heads: (usize, usize),
    #[case] head_size: usize,
    #[case] block_size: usize,
    #[case] dtype: DType,
    #[case] fp8: bool,
    #[values(KvSplit::Auto, KvSplit::Never, KvSplit::Segments(5))] split: KvSplit,
) -> Result<()> {
    let Some(dev) = gpu("shapes") else {
        return Ok(());
    };
    let case = Case::new(seqs, heads, head_size, block_size, dtype)
        .with_fp8_cache(fp8)
        .with_kv_split(split)
        .with_seed(head_size as u64 * 31 + block_size as u64);
    check_on_gpu(&case, &dev)
}

/// Batches with no query token at all return an empty output.
#[rstest]
#[case::no_sequences(&[])]
#[case::no_tokens(&[(0, 17), (0, 5)])]
fn empty_batch(#[case] seqs: &[(usize, usize)]) -> Result<()> {
    let Some(dev) = gpu("empty_batch") else {
        return Ok(());
    };
    let case = Case::new(seqs, (4, 2), 64, 16, DType::BF16);
    let out = op_output(&case, &dev)?;
    ensure!(
        out.is_empty(),
        "expected an empty output, got {} values",
        out.len()
    );
    Ok(())
}

/// Full-size cases: long contexts, large caches, every feature, each with
/// the 2D path, a forced split and the automatic choice.
#[rstest]
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
    #[case] case: Case,
    #[values(KvSplit::Auto, KvSplit::Never, KvSplit::Segments(7))] split: KvSplit,
) -> Result<()> {
    let Some(dev) = gpu("full_size") else {
        return Ok(());
    };
    check_on_gpu(&case.with_kv_split(split).with_seed(7), &dev)
}

/// Two runs on the same inputs give bit-identical outputs (no races), and
/// the split count changes the result only by rounding.
#[test]
fn deterministic_and_split_invariant() -> Result<()> {
    let Some(dev) = gpu("deterministic_and_split_invariant") else {
        return Ok(());
    };
    let case = Case::new(
        &[(1, 5000), (1, 70), (1, 3000)],
        (32, 8),
        128,
        16,
        DType::BF16,
    );
    let inputs = case.build(&dev)?;
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
    let f64s: Vec<f64> = outs[0].iter().map(|&x| x as f64).collect();
    compare(&outs[2], &f64s, case.out_dims(), Tolerance::HALF)?;
    compare(&outs[4], &f64s, case.out_dims(), Tolerance::HALF)
}

/// Caches of more than 2^31 elements: a sequence whose pages sit at the top
/// of a 70000-block cache gives the same output as the same pages at the
/// bottom of a small cache (which is checked against the CPU path). The
/// pages are written by `reshape_and_cache`, so its 64-bit offsets are
/// covered too.
#[test]
fn cache_offsets_past_2_pow_31() -> Result<()> {
    let Some(dev) = gpu("cache_offsets_past_2_pow_31") else {
        return Ok(());
    };
    let (heads, kv_heads, hs, bs) = (16usize, 8usize, 256usize, 16usize);
    let (q_len, seq_len) = (5usize, 3000usize);
    let pages = seq_len.div_ceil(bs);
    let big_blocks = 70000usize;
    assert!(big_blocks * bs * kv_heads * hs > (1usize << 31));
    let k = Tensor::randn(0f32, 1.0, (seq_len, kv_heads, hs), &dev)?.to_dtype(DType::BF16)?;
    let v = Tensor::randn(0f32, 1.0, (seq_len, kv_heads, hs), &dev)?.to_dtype(DType::BF16)?;
    let q = Tensor::randn(0f32, 1.0, (q_len, heads, hs), &dev)?.to_dtype(DType::BF16)?;
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
            .to_device(&CPU)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let small_gpu = run(pages + 3, 2, &dev)?;
    let small_cpu = run(pages + 3, 2, &CPU)?;
    let big_gpu = run(big_blocks, big_blocks - pages, &dev)?;
    let dims = [q_len, heads, hs];
    let f64s: Vec<f64> = small_cpu.iter().map(|&x| x as f64).collect();
    compare(&small_gpu, &f64s, dims, Tolerance::HALF).context("small cache, gpu vs cpu")?;
    ensure!(
        small_gpu == big_gpu,
        "the same pages at block ids past 2^31 elements give a different output"
    );
    Ok(())
}

/// `reshape_and_cache` on the GPU writes exactly what the CPU path writes,
/// skipping negative slots, for every value dtype and an fp8 cache.
#[rstest]
fn reshape_and_cache_matches_cpu(
    #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
    #[values(false, true)] fp8: bool,
    #[values(64, 36)] head_size: usize,
) -> Result<()> {
    let Some(dev) = gpu("reshape_and_cache_matches_cpu") else {
        return Ok(());
    };
    let (num_blocks, bs, kv_heads, tokens) = (40usize, 16usize, 3usize, 300usize);
    let mut rng = StdRng::seed_from_u64(head_size as u64 + fp8 as u64);
    let mut free: Vec<i64> = (0..(num_blocks * bs) as i64).collect();
    let slots: Vec<i64> = (0..tokens)
        .map(|_| {
            if rng.random_bool(0.1) {
                -1
            } else {
                let i = rng.random_range(0..free.len());
                free.swap_remove(i)
            }
        })
        .collect();
    let cache_dtype = if fp8 { DType::F8E4M3 } else { dtype };
    let scales = KvScales::new(0.5, 2.0);
    let k = (Tensor::randn(0f32, 3.0, (tokens, kv_heads, head_size), &CPU)?).to_dtype(dtype)?;
    let v = (Tensor::randn(0f32, 3.0, (tokens, kv_heads, head_size), &CPU)?).to_dtype(dtype)?;
    let mut caches = Vec::new();
    for device in [&CPU, &dev] {
        let filled = || -> Result<Tensor> {
            Ok(
                Tensor::full(7f32, (num_blocks, bs, kv_heads, head_size), &CPU)?
                    .to_dtype(cache_dtype)?
                    .to_device(device)?,
            )
        };
        let (kc, vc) = (filled()?, filled()?);
        let sm = SlotMapping::new(&slots, device)?;
        reshape_and_cache(
            &k.to_device(device)?,
            &v.to_device(device)?,
            &kc,
            &vc,
            &sm,
            scales,
        )?;
        let read = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_device(&CPU)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        caches.push((read(&kc)?, read(&vc)?));
    }
    let (cpu, gpu) = (&caches[0], &caches[1]);
    for (name, a, b) in [("key", &cpu.0, &gpu.0), ("value", &cpu.1, &gpu.1)] {
        for (i, (&x, &y)) in a.iter().zip(b.iter()).enumerate() {
            // fp8: one rounding step apart at most (ties may round differently).
            let tol = if fp8 { 0.0625 * x.abs() + 1e-6 } else { 0.0 };
            ensure!(
                (x - y).abs() <= tol,
                "{name}_cache element {i}: cpu {x}, gpu {y} ({dtype:?}, fp8 {fp8}, head_size {head_size})"
            );
        }
    }
    Ok(())
}
