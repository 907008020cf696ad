//! Builds a paged KV cache, stores a mixed batch (a prefill, a chunked
//! prefill and a decode) with `reshape_and_cache`, runs `paged_attention` once
//! and prints the largest difference from dense causal attention computed
//! with plain tensor ops.
//!
//! `cargo run --release --example quickstart [-- --cuda]`

use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_paged_attention::{
    paged_attention, reshape_and_cache, KvScales, PagedAttentionParams, PagedBatch, SlotMapping,
};

const NUM_HEADS: usize = 8;
const NUM_KV_HEADS: usize = 2;
const HEAD_SIZE: usize = 64;
const BLOCK_SIZE: usize = 16;
const NUM_BLOCKS: usize = 64;

/// One sequence of the batch: `context` cached tokens, `new` tokens this step.
struct Sequence {
    name: &'static str,
    context: usize,
    new: usize,
}

fn device() -> Result<Device> {
    if std::env::args().any(|a| a == "--cuda") {
        Ok(Device::new_cuda(0)?)
    } else {
        Ok(Device::Cpu)
    }
}

/// Dense causal attention of one sequence: `q` `(new, heads, d)`,
/// `k`/`v` `(context + new, kv_heads, d)`.
fn dense_attention(q: &Tensor, k: &Tensor, v: &Tensor, context: usize) -> Result<Tensor> {
    let group = NUM_HEADS / NUM_KV_HEADS;
    let (new, total) = (q.dim(0)?, k.dim(0)?);
    let scale = 1.0 / (HEAD_SIZE as f64).sqrt();
    // (heads, tokens, d), repeating each KV head for its query heads.
    let q = q.to_dtype(DType::F64)?.transpose(0, 1)?.contiguous()?;
    let expand = |x: &Tensor| -> Result<Tensor> {
        let x = x.to_dtype(DType::F64)?.transpose(0, 1)?; // (kv_heads, total, d)
        let x = x
            .unsqueeze(1)?
            .expand((NUM_KV_HEADS, group, total, HEAD_SIZE))?
            .reshape((NUM_HEADS, total, HEAD_SIZE))?;
        Ok(x.contiguous()?)
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let scores = (q.matmul(&k.t()?)? * scale)?; // (heads, new, total)
    let mask: Vec<f64> = (0..new)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j <= context + i {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (1, new, total), q.device())?;
    let probs = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
    Ok(probs.matmul(&v)?.transpose(0, 1)?) // (new, heads, d)
}

fn main() -> Result<()> {
    let device = device()?;
    let seqs = [
        Sequence {
            name: "prefill",
            context: 0,
            new: 37,
        },
        Sequence {
            name: "chunked prefill",
            context: 50,
            new: 20,
        },
        Sequence {
            name: "decode",
            context: 100,
            new: 1,
        },
    ];
    let cache_shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE);
    let key_cache = Tensor::zeros(cache_shape, DType::F32, &device)?;
    let value_cache = Tensor::zeros(cache_shape, DType::F32, &device)?;

    // Give each sequence its blocks from a shuffled pool, and draw all of its
    // keys and values (context and new tokens).
    let mut pool: Vec<u32> = (0..NUM_BLOCKS as u32).rev().step_by(3).collect();
    let mut tables = Vec::new();
    let mut keys = Vec::new();
    let mut values = Vec::new();
    for s in &seqs {
        let total = s.context + s.new;
        let blocks = total.div_ceil(BLOCK_SIZE);
        tables.push(pool.drain(..blocks).collect::<Vec<u32>>());
        keys.push(Tensor::randn(
            0f32,
            1.0,
            (total, NUM_KV_HEADS, HEAD_SIZE),
            &device,
        )?);
        values.push(Tensor::randn(
            0f32,
            1.0,
            (total, NUM_KV_HEADS, HEAD_SIZE),
            &device,
        )?);
    }
    let slots_of = |table: &[u32], positions: std::ops::Range<usize>| -> Vec<i64> {
        positions
            .map(|t| (table[t / BLOCK_SIZE] as usize * BLOCK_SIZE + t % BLOCK_SIZE) as i64)
            .collect()
    };

    // Earlier steps: store every sequence's context.
    for (i, s) in seqs.iter().enumerate().filter(|(_, s)| s.context > 0) {
        let slots = SlotMapping::new(&slots_of(&tables[i], 0..s.context), &device)?;
        let (k, v) = (keys[i].i(..s.context)?, values[i].i(..s.context)?);
        reshape_and_cache(
            &k,
            &v,
            &key_cache,
            &value_cache,
            &slots,
            KvScales::default(),
        )?;
    }

    // This step: the new tokens of all sequences, flattened, with one padding slot.
    let mut slots = Vec::new();
    let mut new_k = Vec::new();
    let mut new_v = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        slots.extend(slots_of(&tables[i], s.context..s.context + s.new));
        new_k.push(keys[i].i(s.context..)?);
        new_v.push(values[i].i(s.context..)?);
    }
    slots.push(-1);
    let pad = Tensor::zeros((1, NUM_KV_HEADS, HEAD_SIZE), DType::F32, &device)?;
    new_k.push(pad.clone());
    new_v.push(pad);
    let slots = SlotMapping::new(&slots, &device)?;
    let (new_k, new_v) = (Tensor::cat(&new_k, 0)?, Tensor::cat(&new_v, 0)?);
    reshape_and_cache(
        &new_k,
        &new_v,
        &key_cache,
        &value_cache,
        &slots,
        KvScales::default(),
    )?;

    // One paged_attention call for the whole mixed batch.
    let mut cu_seqlens_q = vec![0u32];
    for s in &seqs {
        cu_seqlens_q.push(cu_seqlens_q.last().unwrap() + s.new as u32);
    }
    let seq_lens: Vec<u32> = seqs.iter().map(|s| (s.context + s.new) as u32).collect();
    let batch = PagedBatch::from_rows(&cu_seqlens_q, &seq_lens, &tables, BLOCK_SIZE, &device)?;
    let num_tokens = *cu_seqlens_q.last().unwrap() as usize;
    let q = Tensor::randn(0f32, 1.0, (num_tokens, NUM_HEADS, HEAD_SIZE), &device)?;
    let scale = 1.0 / (HEAD_SIZE as f32).sqrt();
    let params = PagedAttentionParams::new(&key_cache, &value_cache, &batch, scale);
    let out = paged_attention(&q, &params)?;
    println!(
        "paged_attention on {:?}: q {:?} -> out {:?}, cache {:?}",
        device.location(),
        q.dims(),
        out.dims(),
        key_cache.dims()
    );

    let mut worst = 0f64;
    for (i, s) in seqs.iter().enumerate() {
        let rows = cu_seqlens_q[i] as usize..cu_seqlens_q[i + 1] as usize;
        let expected = dense_attention(&q.i(rows.clone())?, &keys[i], &values[i], s.context)?;
        let got = out.i(rows)?.to_dtype(DType::F64)?;
        let err = (got - expected)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?;
        println!(
            "  {:<16} context {:>3} + new {:>2}: max |paged - dense| = {err:.2e}",
            s.name, s.context, s.new
        );
        worst = worst.max(err);
    }
    println!("max error against dense attention: {worst:.2e}");
    anyhow::ensure!(
        worst < 1e-4,
        "paged attention disagrees with dense attention"
    );
    Ok(())
}
