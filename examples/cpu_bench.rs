//! CPU benchmark of `paged_attention` at the Llama-3-8B head shape
//! (32 query heads, 8 KV heads, head size 128), beside candle-nn's own CPU
//! flash attention on the same shapes with contiguous K/V.
//!
//! `cargo run --release --example cpu_bench [-- --reps 5]`
//!
//! Reports the median time, GB/s of K/V read (each visible key read once)
//! and GFLOP/s (4 * visible (q, k) pairs * heads * head_size).

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::attention::{flash_attn, AttnMask};
use candle_paged_attention::{paged_attention, PagedAttentionParams, PagedBatch};
use clap::Parser;

const NUM_HEADS: usize = 32;
const NUM_KV_HEADS: usize = 8;
const HEAD_SIZE: usize = 128;
const BLOCK_SIZE: usize = 16;

#[derive(Parser)]
struct Args {
    /// Timed repetitions per case (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

/// `num_seqs` sequences of `q_len` new tokens over `seq_len` keys.
struct Case {
    name: &'static str,
    num_seqs: usize,
    q_len: usize,
    seq_len: usize,
}

impl Case {
    fn visible_pairs(&self) -> f64 {
        let context = self.seq_len - self.q_len;
        let per_seq: usize = (0..self.q_len).map(|j| context + j + 1).sum();
        (per_seq * self.num_seqs) as f64
    }

    fn kv_bytes(&self, elem: usize) -> f64 {
        (2 * self.num_seqs * self.seq_len * NUM_KV_HEADS * HEAD_SIZE * elem) as f64
    }
}

fn median_secs(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[reps / 2])
}

fn report(case: &Case, what: &str, dtype: DType, secs: f64) {
    let gbs = case.kv_bytes(dtype.size_in_bytes()) / secs / 1e9;
    let gflops = 4.0 * case.visible_pairs() * (NUM_HEADS * HEAD_SIZE) as f64 / secs / 1e9;
    println!(
        "| {:<24} | {:<28} | {:>9.2} | {:>8.2} | {:>9.2} |",
        case.name,
        format!("{what} {dtype:?}"),
        secs * 1e3,
        gbs,
        gflops
    );
}

/// Times the paged op on a shuffled cache holding exactly the batch's keys.
fn bench_paged(case: &Case, dtype: DType, reps: usize) -> Result<f64> {
    let dev = Device::Cpu;
    let blocks_per_seq = case.seq_len.div_ceil(BLOCK_SIZE);
    let num_blocks = blocks_per_seq * case.num_seqs;
    let cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE);
    let key_cache = Tensor::randn(0f32, 1.0, cache_shape, &dev)?.to_dtype(dtype)?;
    let value_cache = Tensor::randn(0f32, 1.0, cache_shape, &dev)?.to_dtype(dtype)?;
    // A fixed stride permutation of the blocks stands in for a shuffled pool.
    let stride = (1..)
        .map(|s| 7919 * s)
        .find(|s| gcd(*s, num_blocks) == 1)
        .unwrap();
    let table: Vec<u32> = (0..num_blocks)
        .map(|i| ((i * stride) % num_blocks) as u32)
        .collect();
    let cu_seqlens_q: Vec<u32> = (0..=case.num_seqs)
        .map(|i| (i * case.q_len) as u32)
        .collect();
    let seq_lens = vec![case.seq_len as u32; case.num_seqs];
    let batch = PagedBatch::new(
        &cu_seqlens_q,
        &seq_lens,
        &table,
        blocks_per_seq,
        BLOCK_SIZE,
        &dev,
    )?;
    let q = Tensor::randn(
        0f32,
        1.0,
        (case.num_seqs * case.q_len, NUM_HEADS, HEAD_SIZE),
        &dev,
    )?
    .to_dtype(dtype)?;
    let params = PagedAttentionParams::new(&key_cache, &value_cache, &batch, scale());
    median_secs(reps, || {
        paged_attention(&q, &params)?;
        Ok(())
    })
}

/// Times candle-nn's CPU flash attention on contiguous `(B, S, H, D)` tensors.
fn bench_candle_flash(case: &Case, dtype: DType, reps: usize) -> Result<f64> {
    let dev = Device::Cpu;
    let q = Tensor::randn(
        0f32,
        1.0,
        (case.num_seqs, case.q_len, NUM_HEADS, HEAD_SIZE),
        &dev,
    )?
    .to_dtype(dtype)?;
    let kv_shape = (case.num_seqs, case.seq_len, NUM_KV_HEADS, HEAD_SIZE);
    let k = Tensor::randn(0f32, 1.0, kv_shape, &dev)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1.0, kv_shape, &dev)?.to_dtype(dtype)?;
    let mask = if case.q_len == 1 {
        AttnMask::None
    } else {
        AttnMask::causal_with_offset(case.seq_len - case.q_len)
    };
    median_secs(reps, || {
        match dtype {
            DType::F16 => flash_attn::<half::f16>(&q, &k, &v, scale(), mask.clone(), None, None)?,
            _ => flash_attn::<f32>(&q, &k, &v, scale(), mask.clone(), None, None)?,
        };
        Ok(())
    })
}

fn scale() -> f32 {
    1.0 / (HEAD_SIZE as f32).sqrt()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    println!(
        "threads: {}, heads {NUM_HEADS}/{NUM_KV_HEADS}, head_size {HEAD_SIZE}, block_size {BLOCK_SIZE}",
        rayon::current_num_threads()
    );
    println!("| case | implementation | ms (median) | KV GB/s | GFLOP/s |");
    println!("|---|---|---:|---:|---:|");
    let cases = [
        Case {
            name: "decode 64 x 2048",
            num_seqs: 64,
            q_len: 1,
            seq_len: 2048,
        },
        Case {
            name: "prefill 1 x 2048",
            num_seqs: 1,
            q_len: 2048,
            seq_len: 2048,
        },
    ];
    for case in &cases {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            report(
                case,
                "paged_attention",
                dtype,
                bench_paged(case, dtype, args.reps)?,
            );
        }
        for dtype in [DType::F16, DType::F32] {
            let secs = bench_candle_flash(case, dtype, args.reps)?;
            report(case, "candle-nn flash_attn", dtype, secs);
        }
    }
    Ok(())
}
