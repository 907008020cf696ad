//! `EngineBuilder` and `KvCacheSpec`: the cache they size and allocate, the
//! engine they make (its tokens equal the mock's exact oracle), and the
//! errors of a specification that cannot be built.

#![cfg(feature = "models")]

mod engine_mock;

use anyhow::{ensure, Result};
use candle_paged_attention::engine::{
    CacheSizing, EngineBuilder, KvCacheSpec, Request, SamplingParams, SchedulerConfig,
};
use candle_paged_attention::models::PagedModel;
use engine_mock::{oracle_next, MockModel};

const VOCAB: usize = 32;

fn expected(prompt: &[u32], n: usize, window: Option<usize>) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    for _ in 0..n {
        ctx.push(oracle_next(&ctx, window, VOCAB));
    }
    ctx[prompt.len()..].to_vec()
}

fn err_text<T>(r: candle_core::Result<T>) -> String {
    match r {
        Ok(_) => "no error".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_built_engine_has_the_cache_asked_for_and_runs_exactly() -> Result<()> {
    let window = Some(5);
    let model = MockModel::new(4, window, VOCAB, 256)?;
    let (mut engine, plan) = EngineBuilder::new(&model)
        .sizing(CacheSizing::Blocks(40))
        .window_blocks(Some(12))
        .scheduler(SchedulerConfig {
            max_batch_tokens: 7,
            max_num_seqs: 3,
        })
        .build()?;
    ensure!(
        plan.num_blocks == 40 && plan.budget_bytes.is_none(),
        "{plan:?}"
    );
    let config = engine.cache().config();
    ensure!(
        config.num_blocks == 40 && config.window_blocks == Some(12) && !config.prefix_caching,
        "{config:?}"
    );
    ensure!(
        engine.cache().memory_bytes() == plan.bytes,
        "allocated {} bytes, planned {}",
        engine.cache().memory_bytes(),
        plan.bytes
    );
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|i| (0..9 + i).map(|t| (t * 7 + i) % VOCAB as u32).collect())
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        engine.add_request(Request {
            id: i as u64,
            prompt: p.clone(),
            params: SamplingParams::greedy(6),
        })?;
    }
    let mut done = engine.run(|_| {})?;
    done.sort_by_key(|c| c.id);
    ensure!(done.len() == prompts.len(), "{} completions", done.len());
    for (c, p) in done.iter().zip(&prompts) {
        ensure!(
            c.tokens == expected(p, 6, window),
            "request {}: {:?}",
            c.id,
            c.tokens
        );
    }
    ensure!(engine.block_manager().num_used_blocks() == 0);
    Ok(())
}

#[test]
fn a_byte_budget_takes_the_most_blocks_that_fit_it() -> Result<()> {
    let model = MockModel::new(4, None, VOCAB, 256)?;
    let one = KvCacheSpec::new(CacheSizing::Blocks(1))
        .build(&model)?
        .1
        .bytes;
    let spec = KvCacheSpec {
        prefix_caching: true,
        ..KvCacheSpec::new(CacheSizing::Bytes(one * 10 + one / 2))
    };
    let (cache, plan) = spec.build(&model)?;
    ensure!(plan.num_blocks == 10, "{plan:?}");
    ensure!(plan.budget_bytes == Some(one * 10 + one / 2), "{plan:?}");
    ensure!(cache.config().prefix_caching && cache.memory_bytes() == 10 * one);
    Ok(())
}

#[test]
fn specifications_that_cannot_be_built_are_refused_with_their_values() -> Result<()> {
    let model = MockModel::new(4, Some(5), VOCAB, 256)?;
    let dyn_model: &dyn PagedModel = &model;
    let cases: [(KvCacheSpec, &str); 4] = [
        (
            KvCacheSpec {
                window_blocks: Some(0),
                ..KvCacheSpec::new(CacheSizing::Blocks(8))
            },
            "EngineBuilder: window_blocks must be at least 1, got 0",
        ),
        (
            KvCacheSpec {
                window_blocks: Some(4),
                prefix_caching: true,
                ..KvCacheSpec::new(CacheSizing::Blocks(8))
            },
            "EngineBuilder: prefix caching cannot be combined with window_blocks",
        ),
        (
            KvCacheSpec::new(CacheSizing::Blocks(0)),
            "a cache needs at least one block, got 0",
        ),
        (
            KvCacheSpec::new(CacheSizing::Bytes(1)),
            "1 bytes hold no cache block",
        ),
    ];
    for (spec, want) in cases {
        let got = err_text(spec.build(dyn_model));
        ensure!(got.contains(want), "{spec:?}: {got}");
    }
    let got = err_text(
        EngineBuilder::new(&model)
            .sizing(CacheSizing::Blocks(8))
            .scheduler(SchedulerConfig {
                max_batch_tokens: 0,
                max_num_seqs: 1,
            })
            .build(),
    );
    ensure!(
        got.contains("max_batch_tokens must be at least 1, got 0"),
        "{got}"
    );
    Ok(())
}
