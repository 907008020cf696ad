//! Prefix caching through the `Engine`: prompts submitted together share
//! the blocks the first of them computes, in the step that computes them or
//! in a later one, whatever the step budget; the tokens are those without
//! prefix caching; every block is free at the end; a failed step that
//! registered shared blocks is rolled back and retried exactly.
//!
//! The mock model (`engine_mock`) makes a token an exact function of the
//! cache content a sequence reads, so a wrong shared block changes tokens;
//! a small random-weight Llama checks the same with real attention.

#![cfg(feature = "models")]

mod engine_mock;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_paged_attention::engine::{
    Completion, Engine, EngineStats, Request, SamplingParams, SchedulerConfig,
};
use candle_paged_attention::models::{llama, CacheConfig, PagedKvCache, PagedModel, PagedOptions};
use engine_mock::{oracle_next, Fail, MockModel, INJECTED};
use rand::{Rng, SeedableRng};

const VOCAB: usize = 32;
const BLOCK: usize = 16;
/// Tokens the three prompts share, and each prompt's own suffix.
const SHARED: usize = 300;
const SUFFIX: usize = 20;
const NEW_TOKENS: usize = 8;

/// Three prompts: `SHARED` common tokens, then `SUFFIX` tokens of their own.
fn shared_prompts(vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let shared: Vec<u32> = (0..SHARED)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    (0..3)
        .map(|i| {
            let mut p = shared.clone();
            // The first suffix token differs between prompts.
            p.push(i as u32);
            p.extend((1..SUFFIX).map(|_| rng.random_range(0..vocab as u32)));
            p
        })
        .collect()
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        id,
        prompt,
        params: SamplingParams::greedy(max_tokens),
    }
}

/// Runs `prompts` submitted together; returns the tokens by request and the
/// engine's counters, after checking that every block is free again.
fn run_engine<M: PagedModel>(
    model: &M,
    cache: PagedKvCache,
    prompts: &[Vec<u32>],
    config: SchedulerConfig,
    max_tokens: usize,
) -> Result<(Vec<Vec<u32>>, EngineStats)> {
    let mut engine = Engine::new(model, cache, config)?;
    for (i, p) in prompts.iter().enumerate() {
        engine.add_request(request(i as u64, p.clone(), max_tokens))?;
    }
    let mut done: Vec<Completion> = engine.run(|_| {})?;
    done.sort_by_key(|c| c.id);
    ensure!(done.len() == prompts.len());
    let m = engine.block_manager();
    ensure!(
        m.num_sequences() == 0 && m.num_used_blocks() == 0 && m.num_free_blocks() == m.num_blocks(),
        "blocks leaked: {} used, {} of {} free",
        m.num_used_blocks(),
        m.num_free_blocks(),
        m.num_blocks()
    );
    Ok((done.into_iter().map(|c| c.tokens).collect(), engine.stats()))
}

/// The mock's greedy tokens after `prompt`.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = oracle_next(&ctx, None, VOCAB);
        out.push(t);
        ctx.push(t);
    }
    out
}

fn config(max_batch_tokens: usize, max_num_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_tokens,
        max_num_seqs,
    }
}

/// The shared prompt's 18 whole blocks (288 tokens) are computed once: by
/// the first prompt, then taken by the two others, in the same step (a
/// budget of 512 holds the first prompt and part of the second) or later.
#[test]
fn prompts_submitted_together_compute_the_shared_blocks_once() -> Result<()> {
    let prompts = shared_prompts(VOCAB);
    let total: usize = prompts.iter().map(Vec::len).sum();
    let shared_blocks = SHARED / BLOCK; // 18: block 18 holds suffix tokens
    let hits = 2 * shared_blocks * BLOCK;
    ensure!(total == 960 && hits == 576);
    let model = MockModel::new(BLOCK, None, VOCAB, 512)?;
    for (budget, seqs) in [(512, 8), (100, 8), (64, 3), (7, 8), (512, 1)] {
        let (off, off_stats) = run_engine(
            &model,
            model.cache(64, None, false)?,
            &prompts,
            config(budget, seqs),
            NEW_TOKENS,
        )?;
        let (on, on_stats) = run_engine(
            &model,
            model.cache(64, None, true)?,
            &prompts,
            config(budget, seqs),
            NEW_TOKENS,
        )?;
        for (i, p) in prompts.iter().enumerate() {
            ensure!(
                off[i] == expected(p, NEW_TOKENS),
                "budget {budget}: request {i} without prefix caching"
            );
            ensure!(
                on[i] == off[i],
                "budget {budget}: request {i}: {:?} != {:?}",
                on[i],
                off[i]
            );
        }
        ensure!(
            (off_stats.prefill_tokens, off_stats.prefix_cache_hit_tokens) == (960, 0),
            "budget {budget}: {off_stats:?}"
        );
        ensure!(
            (on_stats.prefill_tokens, on_stats.prefix_cache_hit_tokens) == (960 - hits, hits),
            "budget {budget}: {on_stats:?}"
        );
        ensure!(
            on_stats.decode_tokens == 3 * (NEW_TOKENS - 1),
            "{on_stats:?}"
        );
        ensure!(on_stats.preemptions == 0 && off_stats.preemptions == 0);
        if budget == 512 && seqs > 1 {
            // All three at once: 21 blocks of the first prompt (328 tokens),
            // 3 of each other one beside the 18 shared blocks.
            ensure!(
                on_stats.peak_used_blocks == 27,
                "budget {budget}: {on_stats:?}"
            );
            ensure!(
                off_stats.peak_used_blocks == 63,
                "budget {budget}: {off_stats:?}"
            );
        }
        ensure!(on_stats.num_blocks == 64);
    }
    Ok(())
}

/// The first step of a budget of 512 computes the first prompt and takes
/// its blocks for the second prompt's first 288 tokens in the same step.
#[test]
fn a_prompt_takes_the_blocks_an_earlier_prompt_computes_in_the_same_step() -> Result<()> {
    let prompts = shared_prompts(VOCAB);
    let model = MockModel::new(BLOCK, None, VOCAB, 512)?;
    let mut engine = Engine::new(&model, model.cache(64, None, true)?, config(512, 8))?;
    for (i, p) in prompts.iter().enumerate() {
        engine.add_request(request(i as u64, p.clone(), NEW_TOKENS))?;
    }
    let events = engine.step()?;
    // Both finish their prompts: the third has no budget left.
    ensure!(
        events.iter().map(|e| e.id).collect::<Vec<_>>() == [0, 1],
        "{events:?}"
    );
    let stats = engine.stats();
    ensure!(
        (stats.prefill_tokens, stats.prefix_cache_hit_tokens) == (320 + 32, 288),
        "{stats:?}"
    );
    let m = engine.block_manager();
    let (a, b) = (
        m.block_table(0).unwrap_or(&[]),
        m.block_table(1).unwrap_or(&[]),
    );
    ensure!(a[..18] == b[..18] && a[18] != b[18], "{a:?} {b:?}");
    ensure!(m.block_ref_count(a[0]) == 2 && m.block_ref_count(a[18]) == 1);
    // The third prompt takes them in the next step, from the cache.
    engine.step()?;
    let stats = engine.stats();
    ensure!(
        (stats.prefill_tokens, stats.prefix_cache_hit_tokens) == (320 + 32 + 32, 576),
        "{stats:?}"
    );
    let done = engine.run(|_| {})?;
    ensure!(done.len() == 3);
    for c in &done {
        ensure!(c.tokens == expected(&prompts[c.id as usize], NEW_TOKENS));
    }
    Ok(())
}

/// A cache too small for all three: preemption and recomputation reuse
/// the cached blocks, the tokens do not change, every block comes back.
#[test]
fn preempted_sequences_reuse_cached_blocks_and_keep_their_tokens() -> Result<()> {
    let prompts = shared_prompts(VOCAB);
    let model = MockModel::new(BLOCK, None, VOCAB, 512)?;
    // 40 new tokens: 23 blocks for the first prompt, 18 shared and 5 own
    // for each other one; the cache has 26.
    let (on, stats) = run_engine(
        &model,
        model.cache(26, None, true)?,
        &prompts,
        config(512, 8),
        40,
    )?;
    for (i, p) in prompts.iter().enumerate() {
        ensure!(on[i] == expected(p, 40), "request {i}");
    }
    ensure!(stats.preemptions > 0, "{stats:?}");
    ensure!(stats.peak_used_blocks == 26, "{stats:?}");
    ensure!(stats.prefix_cache_hit_tokens >= 576, "{stats:?}");
    Ok(())
}

/// Every forward call of the shared-prefix run fails once, before and after
/// storing: the step is rolled back (its registered blocks are not shared
/// with incomplete content), the retry gives the same tokens, and the hit
/// and prefill counters equal those of a run without failures.
#[test]
fn failed_steps_with_shared_blocks_roll_back_and_retry_exactly() -> Result<()> {
    let prompts = shared_prompts(VOCAB);
    let clean = {
        let model = MockModel::new(BLOCK, None, VOCAB, 512)?;
        run_engine(
            &model,
            model.cache(64, None, true)?,
            &prompts,
            config(200, 8),
            NEW_TOKENS,
        )?
    };
    let calls = {
        let model = MockModel::new(BLOCK, None, VOCAB, 512)?;
        run_engine(
            &model,
            model.cache(64, None, true)?,
            &prompts,
            config(200, 8),
            NEW_TOKENS,
        )?;
        model.calls()
    };
    for call in 0..calls {
        for how in [Fail::BeforeStore, Fail::AfterStore] {
            let model = MockModel::new(BLOCK, None, VOCAB, 512)?;
            model.fail_at(call, how);
            let mut engine = Engine::new(&model, model.cache(64, None, true)?, config(200, 8))?;
            for (i, p) in prompts.iter().enumerate() {
                engine.add_request(request(i as u64, p.clone(), NEW_TOKENS))?;
            }
            let mut failures = 0;
            let mut done = Vec::new();
            while engine.has_work() {
                let hits = engine.block_manager().prefix_cache_hit_tokens();
                let used = engine.block_manager().num_used_blocks();
                match engine.step() {
                    Ok(_) => {}
                    Err(e) => {
                        failures += 1;
                        ensure!(e.to_string().contains(INJECTED), "{e}");
                        let m = engine.block_manager();
                        ensure!(m.prefix_cache_hit_tokens() == hits);
                        ensure!(m.num_used_blocks() == used, "call {call} {how:?}");
                    }
                }
                done.extend(engine.take_completions());
            }
            ensure!(failures == 1, "call {call}: {failures} failures");
            done.sort_by_key(|c| c.id);
            let tokens: Vec<Vec<u32>> = done.into_iter().map(|c| c.tokens).collect();
            ensure!(tokens == clean.0, "call {call} {how:?}: {tokens:?}");
            let stats = engine.stats();
            ensure!(
                (stats.prefill_tokens, stats.prefix_cache_hit_tokens)
                    == (clean.1.prefill_tokens, clean.1.prefix_cache_hit_tokens),
                "call {call} {how:?}: {stats:?} vs {:?}",
                clean.1
            );
            ensure!(engine.block_manager().num_used_blocks() == 0);
        }
    }
    Ok(())
}

/// A small Llama with random weights: greedy tokens with prefix caching
/// equal those without, and the shared blocks are computed once.
#[test]
fn llama_greedy_tokens_are_the_same_with_prefix_caching() -> Result<()> {
    let dev = Device::Cpu;
    let json = r#"{"hidden_size": 64, "intermediate_size": 96, "vocab_size": 97,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": true}"#;
    let cfg = serde_json::from_str::<llama::LlamaConfig>(json)?.into_config(false);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let options = PagedOptions {
        block_size: BLOCK,
        ..Default::default()
    };
    // The first load creates the variables; the model is loaded again once
    // they hold seeded weights, N(0, 0.2)-ish, norms around 1 (loading
    // copies the projections it concatenates).
    llama::Llama::load(vb.clone(), &cfg, options)?;
    {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for name in names {
            let var = &data[name];
            let v: Vec<f32> = (0..var.elem_count())
                .map(|_| {
                    let x = rng.random_range(-0.35f32..0.35);
                    if name.contains("norm") {
                        1.0 + x
                    } else {
                        x
                    }
                })
                .collect();
            var.set(&Tensor::from_vec(v, var.shape(), &dev)?)?;
        }
    }
    let model = llama::Llama::load(vb, &cfg, options)?;
    let prompts = shared_prompts(cfg.vocab_size);
    let layers = model.attention_layers();
    let cache = |prefix_caching| {
        PagedKvCache::new(
            &layers,
            CacheConfig {
                prefix_caching,
                ..CacheConfig::new(64)
            },
            DType::F32,
            &dev,
        )
    };
    let (off, off_stats) = run_engine(&model, cache(false)?, &prompts, config(512, 8), NEW_TOKENS)?;
    let (on, on_stats) = run_engine(&model, cache(true)?, &prompts, config(512, 8), NEW_TOKENS)?;
    ensure!(on == off, "{on:?} != {off:?}");
    // The outputs are not degenerate: the prompts do not all give one answer.
    ensure!(off[0] != off[1] || off[1] != off[2], "{off:?}");
    ensure!(off_stats.prefill_tokens == 960 && on_stats.prefill_tokens == 384);
    ensure!(on_stats.prefix_cache_hit_tokens == 576);
    Ok(())
}
