//! The engine's sampling options, on a model whose logits are known: every
//! row is `32 - t` for token `t` (all positive, token 0 the most likely), so
//! the tokens a repeat penalty and top-k give are known exactly.

#![cfg(feature = "models")]

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::engine::{Engine, Request, SamplingParams, SchedulerConfig};
use candle_paged_attention::models::{CacheConfig, PagedKvCache, PagedModel};
use candle_paged_attention::{Attention, AttentionMetadata, AttentionOptions};

const VOCAB: usize = 32;

/// Fixed logits `32 - t`; one attention layer sizes the cache, which the
/// model never reads.
struct FixedLogits {
    layers: Vec<Attention>,
    device: Device,
}

impl FixedLogits {
    fn new() -> Result<Self> {
        let options = AttentionOptions {
            block_size: 4,
            ..Default::default()
        };
        Ok(Self {
            layers: vec![Attention::new(1, 1, 4, 1.0, options)?],
            device: Device::Cpu,
        })
    }
}

impl PagedModel for FixedLogits {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().collect()
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn max_seq_len(&self) -> usize {
        256
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn forward(
        &self,
        _input_ids: &Tensor,
        _metadata: &AttentionMetadata,
        _cache: &PagedKvCache,
        rows: &[usize],
    ) -> candle_core::Result<Tensor> {
        let row: Vec<f32> = (0..VOCAB).map(|t| (VOCAB - t) as f32).collect();
        Tensor::new(row.as_slice(), &self.device)?
            .unsqueeze(0)?
            .repeat((rows.len(), 1))
    }
}

fn request(id: u64, prompt: Vec<u32>, params: SamplingParams) -> Request {
    Request { id, prompt, params }
}

#[test]
fn repeat_penalty_and_top_k_pick_the_expected_tokens_in_one_batch() -> Result<()> {
    let model = FixedLogits::new()?;
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(64),
        DType::F32,
        &Device::Cpu,
    )?;
    let mut engine = Engine::new(&model, cache, SchedulerConfig::default())?;
    let penalty = |last_n| SamplingParams {
        // 32 / 100 < 1, the smallest unpenalised logit: a recent token loses.
        repeat_penalty: 100.0,
        repeat_last_n: last_n,
        ..SamplingParams::greedy(6)
    };
    // Plain greedy: always token 0.
    engine.add_request(request(0, vec![31], SamplingParams::greedy(6)))?;
    // Greedy with a penalty over the last 2 tokens (prompt included): the
    // best token not among them.
    engine.add_request(request(1, vec![31], penalty(2)))?;
    engine.add_request(request(2, vec![0], penalty(2)))?;
    // A window longer than everything: every token is new.
    engine.add_request(request(3, vec![5, 0], penalty(100)))?;
    // Sampled, top-k 1: the argmax whatever the seed.
    engine.add_request(request(
        4,
        vec![31],
        SamplingParams {
            temperature: 1.5,
            top_k: Some(1),
            ..SamplingParams::greedy(6)
        },
    ))?;
    let mut done = engine.run(|_| {})?;
    done.sort_by_key(|c| c.id);
    let tokens: Vec<Vec<u32>> = done.iter().map(|c| c.tokens.clone()).collect();
    ensure!(
        tokens
            == [
                vec![0, 0, 0, 0, 0, 0],
                vec![0, 1, 2, 0, 1, 2],
                vec![1, 2, 0, 1, 2, 0],
                vec![1, 2, 3, 4, 6, 7],
                vec![0, 0, 0, 0, 0, 0],
            ],
        "{tokens:?}"
    );
    Ok(())
}

#[test]
fn invalid_top_k_and_repeat_penalty_are_refused_by_add_request() -> Result<()> {
    let model = FixedLogits::new()?;
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(8),
        DType::F32,
        &Device::Cpu,
    )?;
    let mut engine = Engine::new(&model, cache, SchedulerConfig::default())?;
    let err = engine
        .add_request(request(
            7,
            vec![1],
            SamplingParams {
                top_k: Some(0),
                ..SamplingParams::greedy(2)
            },
        ))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.starts_with("engine: request 7: sampling: top_k must be at least 1, got 0"),
        "{err}"
    );
    let err = engine
        .add_request(request(
            8,
            vec![1],
            SamplingParams {
                repeat_penalty: -1.0,
                ..SamplingParams::greedy(2)
            },
        ))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.starts_with(
            "engine: request 8: sampling: repeat_penalty must be finite and positive, got -1"
        ),
        "{err}"
    );
    Ok(())
}

#[test]
fn frequency_and_presence_penalties_count_the_generated_tokens_only() -> Result<()> {
    let done = run_all(vec![
        // 2 per earlier occurrence: 0 (32), 1 (31 > 30), 0 (30 = token 2's
        // 30, lowest index), 2, 1 (29 = token 3's, lowest index), 3.
        request(
            0,
            vec![1, 1, 1],
            SamplingParams {
                frequency_penalty: 2.0,
                ..SamplingParams::greedy(6)
            },
        ),
        // 5 for any earlier occurrence: a new token each time, until token
        // 0 (32 - 5) ties token 5 (27) and wins on its index.
        request(
            1,
            vec![0],
            SamplingParams {
                presence_penalty: 5.0,
                ..SamplingParams::greedy(6)
            },
        ),
    ])?;
    let tokens: Vec<Vec<u32>> = done.into_iter().map(|(_, t)| t).collect();
    ensure!(
        tokens == [vec![0, 1, 0, 2, 1, 3], vec![0, 1, 2, 3, 4, 0]],
        "{tokens:?}"
    );
    Ok(())
}

/// Runs `requests` to completion on a fresh engine; the tokens by id.
fn run_all(requests: Vec<Request>) -> Result<Vec<(u64, Vec<u32>)>> {
    let model = FixedLogits::new()?;
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(64),
        DType::F32,
        &Device::Cpu,
    )?;
    let mut engine = Engine::new(&model, cache, SchedulerConfig::default())?;
    for r in requests {
        engine.add_request(r)?;
    }
    let mut done: Vec<(u64, Vec<u32>)> = engine
        .run(|_| {})?
        .into_iter()
        .map(|c| (c.id, c.tokens))
        .collect();
    done.sort_by_key(|c| c.0);
    Ok(done)
}

#[test]
fn a_seeded_draw_is_the_same_alone_or_in_a_batch_and_seeds_differ() -> Result<()> {
    let sampled = |seed| SamplingParams {
        temperature: 2.0,
        top_p: Some(0.95),
        seed,
        ..SamplingParams::greedy(24)
    };
    let alone = run_all(vec![request(3, vec![4, 5], sampled(11))])?;
    let batch = run_all(vec![
        request(1, vec![9], sampled(12)),
        request(2, vec![1, 2, 3], SamplingParams::greedy(10)),
        request(3, vec![4, 5], sampled(11)),
        request(4, vec![7], sampled(11)),
    ])?;
    ensure!(alone[0] == batch[2], "{alone:?} vs {batch:?}");
    // The draw depends on the seed and the position, not on the prompt: the
    // same seed gives the same tokens; another seed others.
    ensure!(batch[2].1 == batch[3].1, "{batch:?}");
    ensure!(batch[0].1 != batch[2].1, "{batch:?}");
    // At temperature 2 over 32 tokens, 24 draws are not all the argmax.
    ensure!(batch[2].1.iter().any(|&t| t != 0), "{batch:?}");
    Ok(())
}

#[test]
fn min_p_keeps_only_tokens_near_the_most_likely_one() -> Result<()> {
    // min_p = e^-1.5: at temperature 1 the kept tokens are within 1.5 of
    // the largest logit (32, 31: 30 is 2 below); both appear over 40 draws.
    let done = run_all(vec![request(
        0,
        vec![3],
        SamplingParams {
            temperature: 1.0,
            min_p: Some((-1.5f64).exp()),
            seed: 5,
            ..SamplingParams::greedy(40)
        },
    )])?;
    let tokens = &done[0].1;
    ensure!(tokens.iter().all(|&t| t <= 1), "{tokens:?}");
    ensure!(tokens.contains(&0) && tokens.contains(&1), "{tokens:?}");
    Ok(())
}
