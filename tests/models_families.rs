//! Mistral, Qwen2, Qwen3 and Phi-3 on the shared decoder stack against
//! candle-transformers 0.11.1's models of each family, with small random
//! weights loaded by name into both:
//!
//! * the last logits of a prompt run in chunks agree within f32 noise;
//! * greedy tokens of several prompts of different lengths, batched by the
//!   engine with chunked prefills, equal candle-transformers' greedy tokens
//!   of each prompt alone;
//! * each family loads through `models::load` from a folder (config.json,
//!   model.safetensors, tokenizer.json), through its registry row;
//! * on CUDA, the engine's steps replay CUDA graphs and give the tokens of
//!   the same engine with graphs off (exactly in f32).
//!
//! candle-transformers' Mistral masks keys `i - j > sliding_window` of a
//! prefill's own tokens only (none from its cache), so with a window the
//! reference reruns the whole sequence at offset 0 for every token, with
//! `sliding_window - 1` (Hugging Face's window keeps `i - j < window`).

use std::collections::HashMap;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use candle_paged_attention::engine::{
    Engine, EngineStats, Request, SamplingParams, SchedulerConfig,
};
use candle_paged_attention::models::{
    self, mistral, phi3, qwen2, qwen3, CacheConfig, LoadOptions, PagedKvCache, PagedModel,
    PagedOptions,
};
use candle_paged_attention::Work;
use candle_transformers::models as ct;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

const VOCAB: usize = 128;
const BLOCK_SIZE: usize = 4;
const NEW_TOKENS: usize = 10;
const PROMPT_LENS: [usize; 4] = [3, 17, 9, 24];

fn options() -> PagedOptions {
    PagedOptions {
        block_size: BLOCK_SIZE,
        ..Default::default()
    }
}

/// candle-transformers' model of a family, stepped one sequence at a time.
trait Reference {
    /// Logits of the last of `ids` `(1, len)` after `offset` cached tokens.
    fn step(&mut self, ids: &Tensor, offset: usize) -> candle_core::Result<Tensor>;
    fn clear(&mut self);
}

macro_rules! reference {
    ($t:ty) => {
        impl Reference for $t {
            fn step(&mut self, ids: &Tensor, offset: usize) -> candle_core::Result<Tensor> {
                self.forward(ids, offset)?.flatten_all()
            }
            fn clear(&mut self) {
                self.clear_kv_cache()
            }
        }
    };
}
reference!(ct::qwen2::ModelForCausalLM);
reference!(ct::qwen3::ModelForCausalLM);
reference!(ct::mistral::Model);
reference!(ct::phi3::Model);

/// A family under test: our model's loader and candle-transformers'.
struct Family {
    name: &'static str,
    /// config.json (our parser and, for the reference, candle-transformers').
    json: String,
    ours: fn(&str, VarBuilder) -> candle_core::Result<Box<dyn PagedModel>>,
    theirs: fn(&str, VarBuilder) -> candle_core::Result<Box<dyn Reference>>,
    /// The reference reruns each whole sequence (its window only holds
    /// within one prefill at offset 0).
    recompute: bool,
}

fn parse<T: serde::de::DeserializeOwned>(json: &str) -> candle_core::Result<T> {
    serde_json::from_str(json).map_err(candle_core::Error::wrap)
}

/// Weights of `family`: every variable our loader asks for, `N(0, 0.2)`
/// (norm weights around 1), by name.
fn weights(family: &Family, seed: u64) -> Result<HashMap<String, Tensor>> {
    let varmap = VarMap::new();
    (family.ours)(
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

/// Our logits `(vocab,)` after `prompt`, prefilled in chunks of 5.
fn our_logits(model: &dyn PagedModel, prompt: &[u32]) -> Result<Tensor> {
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
        last = Some(
            logits
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?,
        );
    }
    last.ok_or_else(|| anyhow::anyhow!("empty prompt"))
}

/// The reference's greedy tokens of `prompt`, its model on `dev`.
fn their_tokens(
    r: &mut dyn Reference,
    prompt: &[u32],
    recompute: bool,
    dev: &Device,
) -> Result<Vec<u32>> {
    r.clear();
    let mut seq = prompt.to_vec();
    let mut logits = r.step(&Tensor::new(prompt, dev)?.unsqueeze(0)?, 0)?;
    for _ in 0..NEW_TOKENS {
        let t = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
        seq.push(t);
        logits = if recompute {
            r.clear();
            r.step(&Tensor::new(seq.as_slice(), dev)?.unsqueeze(0)?, 0)?
        } else {
            r.step(&Tensor::new(&[[t]], dev)?, seq.len() - 1)?
        };
    }
    Ok(seq[prompt.len()..].to_vec())
}

/// Our greedy tokens of every prompt, batched in one engine with chunked
/// prefills (at most 8 tokens a step), CUDA graphs on (the default).
fn engine_tokens(model: &dyn PagedModel, prompts: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    Ok(engine_run(model, prompts, true)?.0)
}

/// [`engine_tokens`] with CUDA graphs on or off, and the engine's counters.
fn engine_run(
    model: &dyn PagedModel,
    prompts: &[Vec<u32>],
    graphs: bool,
) -> Result<(Vec<Vec<u32>>, EngineStats)> {
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
    let mut engine = Engine::new(model, cache, config)?.with_cuda_graphs(graphs);
    for (i, p) in prompts.iter().enumerate() {
        engine.add_request(Request {
            id: i as u64,
            prompt: p.clone(),
            params: SamplingParams::greedy(NEW_TOKENS),
        })?;
    }
    let mut out = vec![Vec::new(); prompts.len()];
    for c in engine.run(|_| {})? {
        out[c.id as usize] = c.tokens;
    }
    if let Some(e) = engine.cuda_graph_error() {
        anyhow::bail!("a CUDA-graph capture failed: {e}");
    }
    Ok((out, engine.stats()))
}

/// (a) and (b) of the module docs for `family` on the CPU in f32; returns
/// the largest logit difference relative to the largest logit.
fn check_family(family: &Family, seed: u64) -> Result<f32> {
    check_family_on(family, seed, &Device::Cpu, DType::F32, 1e-4)
}

/// (a) and (b) for `family` with both models on `dev` in `dtype`: logits
/// within `tolerance` of their scale; greedy tokens equal (in f32) or
/// counted (in a 16-bit dtype, where two implementations round apart and
/// a near tie can flip a token).
fn check_family_on(
    family: &Family,
    seed: u64,
    dev: &Device,
    dtype: DType,
    tolerance: f32,
) -> Result<f32> {
    let w = weights(family, seed)?;
    let vb = || VarBuilder::from_tensors(w.clone(), dtype, dev);
    let ours = (family.ours)(&family.json, vb())?;
    let mut theirs = (family.theirs)(&family.json, vb())?;
    let prompts = prompts(seed + 1);
    let mut worst = 0f32;
    for p in &prompts {
        let a = our_logits(ours.as_ref(), p)?;
        theirs.clear();
        let b = theirs
            .step(&Tensor::new(p.as_slice(), dev)?.unsqueeze(0)?, 0)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?;
        let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
        let scale = b.abs()?.max(0)?.to_scalar::<f32>()?.max(1.0);
        worst = worst.max(diff / scale);
    }
    println!(
        "{} on {dev:?} in {dtype:?}: largest last-logit difference {worst:.2e} of the logits' scale",
        family.name
    );
    ensure!(
        worst < tolerance,
        "{} on {dev:?} in {dtype:?}: logits differ by {worst} of their scale",
        family.name
    );
    let (batched, stats) = engine_run(ours.as_ref(), &prompts, true)?;
    if dev.is_cuda() {
        // The steps above replayed CUDA graphs; eagerly, the same tokens
        // (exactly in f32; counted in a 16-bit dtype, where a padded
        // batch rounds apart and may flip a near tie).
        let graph = &batched;
        let (eager, eager_stats) = engine_run(ours.as_ref(), &prompts, false)?;
        ensure!(
            stats.graph_steps > 0 && eager_stats.graph_steps == 0,
            "{}: graph steps {} with graphs on, {} off",
            family.name,
            stats.graph_steps,
            eager_stats.graph_steps
        );
        let same = graph.iter().zip(&eager).filter(|(g, e)| g == e).count();
        println!(
            "{} on {dev:?} in {dtype:?}: graph and eager tokens equal on {same} of {} prompts ({} of {} steps replayed)",
            family.name,
            prompts.len(),
            stats.graph_steps,
            stats.steps
        );
        ensure!(
            dtype != DType::F32 || same == prompts.len(),
            "{}: graph tokens {graph:?}, eager {eager:?}",
            family.name
        );
    }
    let mut equal = 0;
    for (i, p) in prompts.iter().enumerate() {
        let alone = their_tokens(theirs.as_mut(), p, family.recompute, dev)?;
        if dtype != DType::F32 {
            equal += usize::from(batched[i] == alone);
            continue;
        }
        println!(
            "{} prompt {i} ({} tokens): {:?}",
            family.name,
            p.len(),
            batched[i]
        );
        ensure!(
            batched[i] == alone,
            "{} prompt {i}: engine {:?}, candle-transformers {alone:?}",
            family.name,
            batched[i]
        );
    }
    if dtype != DType::F32 {
        println!(
            "{} on {dev:?} in {dtype:?}: greedy tokens equal on {equal} of {} prompts",
            family.name,
            prompts.len()
        );
    }
    Ok(worst)
}

const QWEN2: &str = r#"{"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "sliding_window": 4096,
    "max_window_layers": 3, "tie_word_embeddings": true, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6, "use_sliding_window": false, "hidden_act": "silu"}"#;

const QWEN3: &str = r#"{"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "attention_bias": true,
    "max_position_embeddings": 256, "sliding_window": null, "max_window_layers": 3,
    "tie_word_embeddings": false, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "use_sliding_window": false, "hidden_act": "silu"}"#;

const MISTRAL: &str = r#"{"model_type": "mistral", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "sliding_window": 6, "hidden_act": "silu"}"#;

/// Half of each head rotates; positions from 12 on take the long factors.
const PHI3: &str = r#"{"model_type": "phi3", "vocab_size": 128, "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256,
    "original_max_position_embeddings": 12, "partial_rotary_factor": 0.5,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 4.0, 6.0, 8.0]},
    "sliding_window": null, "tie_word_embeddings": false}"#;

const PHI3_PLAIN: &str = r#"{"model_type": "phi3", "vocab_size": 128, "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256, "rope_scaling": null,
    "tie_word_embeddings": true}"#;

/// `json` with `key` set to `value`.
fn with(json: &str, key: &str, value: serde_json::Value) -> String {
    let mut v: serde_json::Value = serde_json::from_str(json).expect("test json");
    v[key] = value;
    v.to_string()
}

/// `json` for the reference: a window of one key less (see the module docs).
fn narrower(json: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(json).expect("test json");
    match v["sliding_window"].as_u64() {
        Some(w) => with(json, "sliding_window", (w - 1).into()),
        None => json.to_string(),
    }
}

fn qwen2_family(json: String, recompute: bool) -> Family {
    Family {
        name: "qwen2",
        json,
        ours: |j, vb| Ok(Box::new(qwen2::load(vb, &parse(j)?, options())?)),
        theirs: |j, vb| {
            Ok(Box::new(ct::qwen2::ModelForCausalLM::new(
                &parse(&narrower(j))?,
                vb,
            )?))
        },
        recompute,
    }
}

fn qwen3_family() -> Family {
    Family {
        name: "qwen3",
        json: QWEN3.into(),
        ours: |j, vb| Ok(Box::new(qwen3::load(vb, &parse(j)?, options())?)),
        theirs: |j, vb| Ok(Box::new(ct::qwen3::ModelForCausalLM::new(&parse(j)?, vb)?)),
        recompute: false,
    }
}

fn mistral_family() -> Family {
    Family {
        name: "mistral",
        json: MISTRAL.into(),
        ours: |j, vb| Ok(Box::new(mistral::load(vb, &parse(j)?, options())?)),
        theirs: |j, vb| {
            Ok(Box::new(ct::mistral::Model::new(
                &parse(&narrower(j))?,
                vb,
            )?))
        },
        recompute: true,
    }
}

fn phi3_family(json: &str) -> Family {
    Family {
        name: "phi3",
        json: json.into(),
        ours: |j, vb| Ok(Box::new(phi3::load(vb, &parse(j)?, options())?)),
        theirs: |j, vb| Ok(Box::new(ct::phi3::Model::new(&parse(j)?, vb)?)),
        recompute: false,
    }
}

#[test]
fn qwen2_matches_candle_transformers() -> Result<()> {
    check_family(&qwen2_family(QWEN2.into(), false), 10)?;
    // Every layer slides (max_window_layers 0) through a window of 6.
    let json = with(
        &with(QWEN2, "use_sliding_window", true.into()),
        "max_window_layers",
        0.into(),
    );
    check_family(
        &qwen2_family(with(&json, "sliding_window", 6.into()), true),
        11,
    )?;
    Ok(())
}

#[test]
fn qwen3_matches_candle_transformers() -> Result<()> {
    check_family(&qwen3_family(), 20)?;
    Ok(())
}

#[test]
fn mistral_matches_candle_transformers() -> Result<()> {
    check_family(&mistral_family(), 30)?;
    // The window matters: a wider one changes the tokens.
    let wide = Family {
        json: with(MISTRAL, "sliding_window", serde_json::Value::Null),
        recompute: false,
        ..mistral_family()
    };
    let w = weights(&wide, 30)?;
    let model = |f: &Family| {
        (f.ours)(
            &f.json,
            VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu),
        )
    };
    let p = prompts(31);
    ensure!(
        engine_tokens(model(&wide)?.as_ref(), &p)?
            != engine_tokens(model(&mistral_family())?.as_ref(), &p)?
    );
    Ok(())
}

#[test]
fn phi3_matches_candle_transformers() -> Result<()> {
    check_family(&phi3_family(PHI3), 40)?;
    check_family(&phi3_family(PHI3_PLAIN), 41)?;
    Ok(())
}

/// Which layers slide: Hugging Face's `use_sliding_window`,
/// `max_window_layers` and `layer_types`; Mistral's on every layer.
#[test]
fn sliding_layers_follow_the_config() -> Result<()> {
    let windows = |model: Box<dyn PagedModel>| -> Vec<Option<usize>> {
        model
            .attention_layers()
            .iter()
            .map(|a| a.options().sliding_window)
            .collect()
    };
    let family = qwen2_family(QWEN2.into(), false);
    let w = weights(&family, 50)?;
    let load = |json: &str| {
        (family.ours)(
            json,
            VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu),
        )
    };
    let on = with(
        &with(QWEN2, "use_sliding_window", true.into()),
        "sliding_window",
        8.into(),
    );
    assert_eq!(windows(load(QWEN2)?), [None; 3]);
    assert_eq!(
        windows(load(&with(&on, "max_window_layers", 1.into()))?),
        [None, Some(8), Some(8)]
    );
    let types = serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"]);
    assert_eq!(
        windows(load(&with(&on, "layer_types", types.clone()))?),
        [Some(8), None, Some(8)]
    );
    let off = with(
        &with(QWEN2, "sliding_window", 8.into()),
        "layer_types",
        types,
    );
    assert_eq!(windows(load(&off)?), [None; 3]);
    let m = mistral_family();
    let w = weights(&m, 51)?;
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    assert_eq!(windows((m.ours)(MISTRAL, vb)?), [Some(6); 3]);
    Ok(())
}

/// What a family cannot run is refused, naming the key and the value.
#[test]
fn unsupported_configs_are_named() -> Result<()> {
    let err = |family: Family, json: String| -> Result<String> {
        let w = weights(&family, 60)?;
        let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
        match (family.ours)(&json, vb) {
            Ok(_) => anyhow::bail!("{} loaded {json}", family.name),
            Err(e) => Ok(e.to_string().lines().next().unwrap_or_default().to_string()),
        }
    };
    let yarn = serde_json::json!({"type": "yarn", "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": [1.0, 1.0, 1.0, 1.0]});
    let e = err(phi3_family(PHI3), with(PHI3, "rope_scaling", yarn))?;
    assert_eq!(
        e,
        "phi3: config.json rope_scaling.type yarn is not supported (su, longrope)"
    );
    let short = serde_json::json!({"type": "su", "short_factor": [1.0], "long_factor": [1.0, 1.0, 1.0, 1.0]});
    let e = err(phi3_family(PHI3), with(PHI3, "rope_scaling", short))?;
    assert_eq!(e, "phi3: config.json rope_scaling.short_factor must be 4 finite positive factors (rotary width / 2), got [1.0]");
    let e = err(
        phi3_family(PHI3),
        with(PHI3, "partial_rotary_factor", 1.5.into()),
    )?;
    assert_eq!(e, "phi3: config.json partial_rotary_factor x head size must be even and at most the head size 16, got 24");
    let yarn = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    let e = err(
        qwen2_family(QWEN2.into(), false),
        with(QWEN2, "rope_scaling", yarn),
    )?;
    assert!(
        e.starts_with("qwen2: config.json rope_scaling {")
            && e.ends_with("is not supported (only null)"),
        "{e}"
    );
    let e = err(qwen3_family(), with(QWEN3, "num_key_value_heads", 3.into()))?;
    assert_eq!(e, "qwen3: config.json num_attention_heads 4 must be a multiple of config.json num_key_value_heads 3");
    let e = err(
        mistral_family(),
        with(MISTRAL, "num_attention_heads", 5.into()),
    )?;
    assert_eq!(
        e,
        "mistral: config.json hidden_size 64 is not a multiple of num_attention_heads 5"
    );
    Ok(())
}

/// A tokenizer.json of a word-level vocabulary.
const TOKENIZER: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": null, "decoder": null,
    "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1, "b": 2}, "unk_token": "<unk>"}}"#;

/// Each family loads through `models::load` from a folder, through its own
/// registry row, and computes what the family's loader computes.
#[test]
fn each_family_loads_through_the_registry() -> Result<()> {
    for (family, arch) in [
        (qwen2_family(QWEN2.into(), false), "qwen2"),
        (qwen3_family(), "qwen3"),
        (mistral_family(), "mistral"),
        (phi3_family(PHI3), "phi3"),
    ] {
        let w = weights(&family, 70)?;
        let dir =
            std::env::temp_dir().join(format!("models-families-{arch}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("config.json"), &family.json)?;
        std::fs::write(dir.join("tokenizer.json"), TOKENIZER)?;
        candle_core::safetensors::save(&w, dir.join("model.safetensors"))?;
        let loaded = models::load(
            &dir,
            &Device::Cpu,
            &LoadOptions {
                paged: options(),
                ..Default::default()
            },
        );
        std::fs::remove_dir_all(&dir)?;
        let loaded = loaded?;
        ensure!(
            loaded.architecture.name == arch,
            "{arch}: loaded as {}",
            loaded.architecture.name
        );
        let direct = (family.ours)(
            &family.json,
            VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
        )?;
        let p = &prompts(71)[1];
        let (a, b) = (
            our_logits(loaded.model.as_ref(), p)?,
            our_logits(direct.as_ref(), p)?,
        );
        let diff = (a - b)?.abs()?.max(0)?.to_scalar::<f32>()?;
        ensure!(diff == 0.0, "{arch}: registry model differs by {diff}");
    }
    Ok(())
}

/// Each family with both models on the GPU: in f32 (our CUDA kernels
/// against candle-transformers' CUDA ops) exactly as on the CPU; in bf16,
/// last logits within a tenth of their scale (two implementations rounding
/// apart through 3 random layers: 2e-2 to 5e-2 measured on an H200; a wrong
/// window, rotation or norm moves them by the whole scale), tokens counted.
#[cfg(feature = "cuda")]
#[test]
fn families_match_candle_transformers_on_cuda() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let window = with(
        &with(QWEN2, "use_sliding_window", true.into()),
        "max_window_layers",
        0.into(),
    );
    let families = [
        (qwen2_family(QWEN2.into(), false), 10),
        (
            qwen2_family(with(&window, "sliding_window", 6.into()), true),
            11,
        ),
        (qwen3_family(), 20),
        (mistral_family(), 30),
        (phi3_family(PHI3), 40),
        (phi3_family(PHI3_PLAIN), 41),
    ];
    for (family, seed) in &families {
        check_family_on(family, *seed, &dev, DType::F32, 1e-4)?;
        check_family_on(family, *seed, &dev, DType::BF16, 1e-1)?;
    }
    Ok(())
}
