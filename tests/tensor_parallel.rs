//! Tensor parallelism on the CPU: decoders sharded over 1, 2 and 4 ranks
//! of an in-process group ([`LocalGroup`]) against the unsharded model,
//! with small random weights loaded by name into both:
//!
//! * the last logits of prompts prefilled in chunks agree within f32 noise
//!   (exactly with one rank);
//! * greedy tokens of several prompts, batched by the engine with chunked
//!   prefills, are identical;
//! * a rank that fails (an error, a panic, or a stall past the collective
//!   timeout) fails the step for every rank, without hanging, and the
//!   engine rolls the step back and finishes with the same tokens.
//!
//! Shapes: 8 query heads with 8, 4, 2 or 1 KV heads (fewer KV heads than
//! ranks are replicated), a vocabulary of 130 (not a multiple of 4: the
//! last rank's logits are padded before the gather), tied and untied heads,
//! q/k/v and o biases (Qwen3), q/k norms (Qwen3), joined projections and a
//! partial rotary (Phi-3), a sliding window (Mistral).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_paged_attention::engine::{Engine, Request, SamplingParams, SchedulerConfig};
use candle_paged_attention::models::decoder::DecoderSpec;
use candle_paged_attention::models::{
    llama, mistral, phi3, qwen2, qwen3, CacheConfig, PagedKvCache, PagedModel, PagedOptions,
};
use candle_paged_attention::parallel::{Communicator, LocalGroup, TensorParallel};
use candle_paged_attention::Work;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

const VOCAB: usize = 130;
const BLOCK_SIZE: usize = 4;
const NEW_TOKENS: usize = 8;
const PROMPT_LENS: [usize; 4] = [3, 17, 9, 24];
const WORLD_SIZES: [usize; 3] = [1, 2, 4];

fn options() -> PagedOptions {
    PagedOptions {
        block_size: BLOCK_SIZE,
        ..Default::default()
    }
}

fn parse<T: serde::de::DeserializeOwned>(json: &str) -> candle_core::Result<T> {
    serde_json::from_str(json).map_err(candle_core::Error::wrap)
}

/// A family under test: its config, the unsharded loader and its decoder.
struct Family {
    name: String,
    json: String,
    whole: fn(&str, VarBuilder) -> candle_core::Result<Box<dyn PagedModel>>,
    spec: fn(&str) -> candle_core::Result<DecoderSpec>,
}

fn llama_json(kv_heads: usize, tied: bool) -> String {
    format!(
        r#"{{"hidden_size": 64, "intermediate_size": 96, "vocab_size": {VOCAB},
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": {kv_heads},
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": {tied}}}"#
    )
}

fn llama_family(kv_heads: usize, tied: bool) -> Family {
    Family {
        name: format!("llama (8 heads, {kv_heads} kv heads, tied {tied})"),
        json: llama_json(kv_heads, tied),
        whole: |j, vb| {
            let cfg: llama::LlamaConfig = parse(j)?;
            Ok(Box::new(llama::Llama::load(
                vb,
                &cfg.into_config(false),
                options(),
            )?))
        },
        spec: |j| {
            let cfg: llama::LlamaConfig = parse(j)?;
            llama::spec(&cfg.into_config(false))
        },
    }
}

fn qwen2_family() -> Family {
    Family {
        name: "qwen2 (q/k/v biases, tied, 2 kv heads)".into(),
        json: format!(
            r#"{{"vocab_size": {VOCAB}, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "sliding_window": 4096, "max_window_layers": 2,
            "tie_word_embeddings": true, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "use_sliding_window": false, "hidden_act": "silu"}}"#
        ),
        whole: |j, vb| Ok(Box::new(qwen2::load(vb, &parse(j)?, options())?)),
        spec: |j| qwen2::spec(&parse(j)?),
    }
}

fn qwen3_family() -> Family {
    Family {
        name: "qwen3 (q/k/v/o biases, q/k norms, head_dim 16, 4 kv heads)".into(),
        json: format!(
            r#"{{"vocab_size": {VOCAB}, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 16, "attention_bias": true, "max_position_embeddings": 256,
            "sliding_window": null, "max_window_layers": 2, "tie_word_embeddings": false,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": false,
            "hidden_act": "silu"}}"#
        ),
        whole: |j, vb| Ok(Box::new(qwen3::load(vb, &parse(j)?, options())?)),
        spec: |j| qwen3::spec(&parse(j)?),
    }
}

fn mistral_family() -> Family {
    Family {
        name: "mistral (sliding window 6, 2 kv heads)".into(),
        json: format!(
            r#"{{"vocab_size": {VOCAB}, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "sliding_window": 6, "hidden_act": "silu"}}"#
        ),
        whole: |j, vb| Ok(Box::new(mistral::load(vb, &parse(j)?, options())?)),
        spec: |j| mistral::spec(&parse(j)?),
    }
}

fn phi3_family() -> Family {
    Family {
        name: "phi3 (joined projections, half-width rotary, 4 kv heads)".into(),
        json: format!(
            r#"{{"vocab_size": {VOCAB}, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "partial_rotary_factor": 0.5,
            "rope_scaling": null, "tie_word_embeddings": false}}"#
        ),
        whole: |j, vb| Ok(Box::new(phi3::load(vb, &parse(j)?, options())?)),
        spec: |j| phi3::spec(&parse(j)?),
    }
}

/// Weights of `family`: every variable the unsharded loader asks for,
/// `N(0, 0.2)` (norm weights around 1), by name.
fn weights(family: &Family, seed: u64) -> Result<HashMap<String, Tensor>> {
    let varmap = VarMap::new();
    (family.whole)(
        &family.json,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0, 1.0)?;
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut out = HashMap::new();
    for name in names {
        let t = data[name].as_tensor();
        let center = if name.contains("norm") { 1.0 } else { 0.0 };
        let v: Vec<f32> = (0..t.elem_count())
            .map(|_| (center + 0.2 * normal.sample(&mut rng)) as f32)
            .collect();
        out.insert(name.clone(), Tensor::from_vec(v, t.shape(), &Device::Cpu)?);
    }
    Ok(out)
}

fn prompts(seed: u64) -> Vec<Vec<u32>> {
    use rand::Rng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    PROMPT_LENS
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..VOCAB as u32)).collect())
        .collect()
}

/// The unsharded model and the model sharded over `world_size` ranks of
/// a [`LocalGroup`], from the same weights.
fn models(
    family: &Family,
    w: &HashMap<String, Tensor>,
    world_size: usize,
) -> Result<(Box<dyn PagedModel>, TensorParallel)> {
    let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
    let whole = (family.whole)(&family.json, vb.clone())?;
    let sharded = TensorParallel::local(vb, &(family.spec)(&family.json)?, options(), world_size)?;
    Ok((whole, sharded))
}

/// The logits `(vocab,)` after `prompt`, prefilled in chunks of 5.
fn last_logits(model: &dyn PagedModel, prompt: &[u32]) -> Result<Tensor> {
    let dev = model.device().clone();
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(32),
        model.dtype(),
        &dev,
    )?;
    let mut manager = cache.block_manager()?;
    manager.add_sequence(0, prompt)?;
    let mut last = None;
    while manager.num_computed(0).unwrap_or(0) < prompt.len() {
        let left = prompt.len() - manager.num_computed(0).unwrap_or(0);
        let work = vec![Work::Prefill {
            seq_id: 0,
            num_tokens: left.min(5),
        }];
        let batch = manager.schedule(&work, &dev)?;
        let ids = Tensor::new(batch.token_ids.as_slice(), &dev)?;
        let logits = model.forward(&ids, &batch.metadata, &cache, &[batch.last_rows[0]])?;
        last = Some(logits.flatten_all()?);
    }
    last.ok_or_else(|| anyhow::anyhow!("empty prompt"))
}

/// What an engine run gave.
struct EngineRun {
    /// Greedy tokens of each prompt.
    tokens: Vec<Vec<u32>>,
    /// The error of each step that failed, and how long the step took.
    errors: Vec<(String, Duration)>,
    /// Blocks still used at the end.
    used: usize,
}

/// Greedy tokens of every prompt, batched in one engine with chunked
/// prefills (at most 8 tokens a step).
fn engine_run(model: &dyn PagedModel, prompts: &[Vec<u32>]) -> Result<EngineRun> {
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(64),
        model.dtype(),
        model.device(),
    )?;
    let config = SchedulerConfig {
        max_batch_tokens: 8,
        max_num_seqs: 16,
    };
    let mut engine = Engine::new(model, cache, config)?;
    for (i, p) in prompts.iter().enumerate() {
        engine.add_request(Request {
            id: i as u64,
            prompt: p.clone(),
            params: SamplingParams::greedy(NEW_TOKENS),
        })?;
    }
    let mut errors = Vec::new();
    while engine.has_work() {
        let start = Instant::now();
        if let Err(e) = engine.step() {
            errors.push((messages(&e), start.elapsed()));
            ensure!(errors.len() <= 3, "the engine keeps failing: {errors:?}");
        }
    }
    let mut out = vec![Vec::new(); prompts.len()];
    for c in engine.take_completions() {
        out[c.id as usize] = c.tokens;
    }
    Ok(EngineRun {
        tokens: out,
        errors,
        used: engine.block_manager().num_used_blocks(),
    })
}

/// An error's message and those of the errors it wraps, outermost first,
/// without backtraces.
fn messages(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::Context { inner, context } => {
            format!("{context}: {}", messages(inner))
        }
        candle_core::Error::WithBacktrace { inner, .. } => messages(inner),
        e => e.to_string().lines().next().unwrap_or_default().to_string(),
    }
}

/// Largest absolute difference of two tensors.
fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

/// For each world size: the sharded logits against the unsharded model's
/// (within f32 noise; bit for bit on one rank) and the engine's greedy
/// tokens (identical). Returns the largest logit difference per world
/// size.
fn check_family(family: &Family, seed: u64) -> Result<Vec<(usize, f32)>> {
    let w = weights(family, seed)?;
    let prompts = prompts(seed + 1);
    let mut report = Vec::new();
    let mut reference: Option<(Vec<Tensor>, Vec<Vec<u32>>)> = None;
    for n in WORLD_SIZES {
        let (whole, sharded) = models(family, &w, n)?;
        ensure!(sharded.world_size() == n);
        let (want, want_tokens) = match &reference {
            Some(r) => r.clone(),
            None => {
                let logits = prompts[..2]
                    .iter()
                    .map(|p| last_logits(whole.as_ref(), p))
                    .collect::<Result<Vec<_>>>()?;
                let run = engine_run(whole.as_ref(), &prompts)?;
                ensure!(run.errors.is_empty(), "{:?}", run.errors);
                reference.insert((logits, run.tokens)).clone()
            }
        };
        let mut worst = 0f32;
        for (p, want) in prompts[..2].iter().zip(&want) {
            let got = last_logits(&sharded, p)?;
            ensure!(got.dims() == [VOCAB], "logits of shape {:?}", got.dims());
            worst = worst.max(max_diff(&got, want)?);
        }
        let scale = want[0].abs()?.max_all()?.to_scalar::<f32>()?;
        println!(
            "{}: world size {n}: largest last-logit difference {worst:.2e} (logits up to {scale:.2})",
            family.name
        );
        if n == 1 {
            ensure!(
                worst == 0.0,
                "one rank must be the unsharded model: {worst}"
            );
        }
        ensure!(
            worst <= 1e-4 * scale.max(1.0),
            "{}: world size {n}: logits differ by {worst}",
            family.name
        );
        let EngineRun {
            tokens,
            errors,
            used,
        } = engine_run(&sharded, &prompts)?;
        ensure!(errors.is_empty(), "{errors:?}");
        ensure!(used == 0, "{used} blocks still used");
        ensure!(
            tokens == want_tokens,
            "{}: world size {n}: greedy tokens {tokens:?}, unsharded {want_tokens:?}",
            family.name
        );
        ensure!(tokens.iter().all(|t| t.len() == NEW_TOKENS));
        report.push((n, worst));
    }
    Ok(report)
}

#[test]
fn llama_sharded_over_1_2_4_ranks_matches_the_unsharded_model() -> Result<()> {
    // 4 KV heads split; 2 KV heads split on 2 ranks, replicated on 4; one
    // KV head replicated on every rank.
    for (kv_heads, tied, seed) in [(4, false, 1), (2, true, 2), (1, false, 3), (8, true, 4)] {
        check_family(&llama_family(kv_heads, tied), seed)?;
    }
    Ok(())
}

#[test]
fn qwen2_qwen3_mistral_phi3_sharded_match_their_unsharded_models() -> Result<()> {
    for (family, seed) in [
        (qwen2_family(), 10),
        (qwen3_family(), 20),
        (mistral_family(), 30),
        (phi3_family(), 40),
    ] {
        check_family(&family, seed)?;
    }
    Ok(())
}

/// How a rank fails on one of its collectives.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The collective returns an error.
    Error,
    /// The rank panics.
    Panic,
    /// The rank sleeps this long before it enters the collective.
    Stall(Duration),
}

/// A rank's communicator that fails its `at`-th collective (counted from 0
/// over the communicator's life) once.
#[derive(Debug)]
struct Faulty {
    inner: LocalGroup,
    fault: Fault,
    at: usize,
    calls: AtomicUsize,
}

impl Faulty {
    fn before_collective(&self) -> candle_core::Result<()> {
        let k = self.calls.fetch_add(1, Ordering::SeqCst);
        if k != self.at {
            return Ok(());
        }
        match self.fault {
            Fault::Error => candle_core::bail!("injected failure at collective {k}"),
            Fault::Panic => panic!("injected panic at collective {k}"),
            Fault::Stall(d) => {
                std::thread::sleep(d);
                Ok(())
            }
        }
    }
}

impl Communicator for Faulty {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        self.before_collective()?;
        self.inner.all_reduce_sum(t)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
        self.before_collective()?;
        self.inner.all_gather(t, dim)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn failure(&self) -> Option<String> {
        self.inner.failure()
    }
    fn reset(&self) -> candle_core::Result<()> {
        self.inner.reset()
    }
}

/// Rank `bad` of `world_size` fails with `fault` at its collective `at`.
fn faulty_model(
    family: &Family,
    w: &HashMap<String, Tensor>,
    world_size: usize,
    bad: usize,
    fault: Fault,
    at: usize,
    timeout: Duration,
) -> Result<TensorParallel> {
    let comms = LocalGroup::new(world_size, timeout)?
        .into_iter()
        .map(|c| -> Arc<dyn Communicator> {
            if c.rank() == bad {
                Arc::new(Faulty {
                    inner: c,
                    fault,
                    at,
                    calls: AtomicUsize::new(0),
                })
            } else {
                Arc::new(c)
            }
        })
        .collect();
    let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
    Ok(TensorParallel::load(
        &[vb],
        &(family.spec)(&family.json)?,
        options(),
        comms,
    )?)
}

#[test]
fn a_failing_rank_fails_the_step_for_every_rank_and_the_engine_rolls_back() -> Result<()> {
    let family = llama_family(2, false);
    let w = weights(&family, 5)?;
    let prompts = prompts(6);
    let reference = engine_run(models(&family, &w, 1)?.0.as_ref(), &prompts)?;
    ensure!(reference.errors.is_empty(), "{:?}", reference.errors);
    let want = reference.tokens;
    // A forward pass of 2 layers runs 6 collectives (embedding, o and down
    // of each layer, LM head): collective 9 is in the second step.
    let long = Duration::from_secs(30);
    let stall = Duration::from_secs(1);
    for (world_size, bad, fault, timeout, want_msg) in [
        (
            2,
            1,
            Fault::Error,
            long,
            "tensor-parallel: the step failed on every rank of 2: rank 1 failed: injected failure at collective 9",
        ),
        (
            4,
            3,
            Fault::Panic,
            long,
            "tensor-parallel: the step failed on every rank of 4: rank 3 failed: panicked: injected panic at collective 9",
        ),
        (
            4,
            2,
            Fault::Stall(stall * 3),
            stall,
            "timed out after 1s waiting for ranks [2] in collective 9",
        ),
    ] {
        let model = faulty_model(&family, &w, world_size, bad, fault, 9, timeout)?;
        let EngineRun {
            tokens,
            errors,
            used,
        } = engine_run(&model, &prompts)?;
        println!("{fault:?} on rank {bad} of {world_size}: {errors:?}");
        ensure!(errors.len() == 1, "{fault:?}: step errors {errors:?}");
        let (msg, took) = &errors[0];
        // The engine's rollback, then the group's failure.
        ensure!(
            msg.starts_with("engine: the forward pass of a batch")
                && msg.contains("the step was rolled back and can be retried: ")
                && msg.contains(want_msg),
            "{fault:?}: {msg}"
        );
        match fault {
            // The abort wakes the other ranks at once, not at the timeout.
            Fault::Error | Fault::Panic => ensure!(*took < Duration::from_secs(10), "{took:?}"),
            // The others give up after the timeout, not after the stall.
            Fault::Stall(_) => {
                ensure!(msg.contains("timed out after 1s"), "{msg}");
                ensure!(*took >= stall && *took < Duration::from_secs(10), "{took:?}");
            }
        }
        // The step was rolled back and retried: the same tokens, every
        // block freed.
        ensure!(tokens == want, "{fault:?}: tokens {tokens:?}, want {want:?}");
        ensure!(used == 0, "{used} blocks still used");
    }
    Ok(())
}

#[test]
fn sharding_errors_name_the_argument_and_the_value() -> Result<()> {
    let family = llama_family(2, false);
    let w = weights(&family, 7)?;
    let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
    let spec = (family.spec)(&family.json)?;
    let err = TensorParallel::local(vb.clone(), &spec, options(), 3)
        .unwrap_err()
        .to_string();
    ensure!(
        err.starts_with("tensor-parallel: num_attention_heads 8 is not a multiple of world_size 3"),
        "{err}"
    );
    let err = TensorParallel::local(vb.clone(), &spec, options(), 0)
        .unwrap_err()
        .to_string();
    ensure!(
        err.starts_with("tensor-parallel: world_size must be at least 1, got 0"),
        "{err}"
    );
    // Communicators out of rank order.
    let mut comms: Vec<Arc<dyn Communicator>> = LocalGroup::new(2, Duration::from_secs(5))?
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect();
    comms.swap(0, 1);
    let err = TensorParallel::load(std::slice::from_ref(&vb), &spec, options(), comms)
        .unwrap_err()
        .to_string();
    ensure!(
        err.starts_with("tensor-parallel: communicator 0 is rank 1 of 2, expected rank 0 of 2"),
        "{err}"
    );
    // A cache of one rank's layers is not the group's.
    let sharded = TensorParallel::local(vb, &spec, options(), 2)?;
    let rank0 = sharded.rank(0).expect("rank 0");
    ensure!(rank0.attention_layers()[0].num_kv_heads() == 1);
    ensure!(sharded.attention_layers().len() == 4);
    let cache = PagedKvCache::new(
        &rank0.attention_layers(),
        CacheConfig::new(8),
        DType::F32,
        &Device::Cpu,
    )?;
    let mut manager = cache.block_manager()?;
    manager.add_sequence(0, &[1, 2, 3])?;
    let work = [Work::Prefill {
        seq_id: 0,
        num_tokens: 3,
    }];
    let batch = manager.schedule(&work, &Device::Cpu)?;
    let ids = Tensor::new(batch.token_ids.as_slice(), &Device::Cpu)?;
    let err = sharded
        .forward(&ids, &batch.metadata, &cache, &[2])
        .unwrap_err()
        .to_string();
    ensure!(
        err.starts_with("tensor-parallel: the cache has 2 layers but 2 ranks of 2 layers need 4"),
        "{err}"
    );
    // A token outside the vocabulary fails every rank, without a hang.
    let cache = PagedKvCache::new(
        &sharded.attention_layers(),
        CacheConfig::new(8),
        DType::F32,
        &Device::Cpu,
    )?;
    let bad = Tensor::new(&[1u32, VOCAB as u32, 3], &Device::Cpu)?;
    let err = sharded
        .forward(&bad, &batch.metadata, &cache, &[2])
        .unwrap_err()
        .to_string();
    ensure!(
        err.starts_with("tensor-parallel: the step failed on every rank of 2: rank ")
            && err.contains("outside the vocabulary of 130"),
        "{err}"
    );
    // The group was reset: the next step runs.
    let logits = sharded.forward(&ids, &batch.metadata, &cache, &[2])?;
    ensure!(logits.dims() == [1, VOCAB]);
    Ok(())
}
