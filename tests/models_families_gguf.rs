//! The GGUF families of `QuantizedLlama` other than `llama` (llama.cpp's
//! `qwen2`, `qwen3` and `phi3`) against candle-transformers 0.11.1's
//! `quantized_qwen2`, `quantized_qwen3` and `quantized_phi3`, from tiny
//! f32 GGUF files built
//! in memory and read by both:
//!
//! * the last logits of each prompt, prefilled in chunks, agree within f32
//!   noise;
//! * greedy tokens of several prompts of different lengths, batched by the
//!   engine with chunked prefills, equal candle-transformers' greedy tokens
//!   of each prompt alone;
//! * each family loads through `models::load` from a `.gguf` file, through
//!   its registry row, and computes what the direct load computes.

#![cfg(feature = "models")]

mod tiny_checkpoint;

use std::io::Cursor;

use anyhow::{ensure, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor, D};
use candle_paged_attention::engine::{Engine, Request, SamplingParams, SchedulerConfig};
use candle_paged_attention::models::limits::read_gguf;
use candle_paged_attention::models::quantized_llama::{GgufFamily, QuantizedLlama};
use candle_paged_attention::models::{
    self, CacheConfig, LoadOptions, PagedKvCache, PagedModel, PagedOptions,
};
use candle_paged_attention::Work;
use candle_transformers::models::{quantized_phi3, quantized_qwen2, quantized_qwen3};
use rand::{Rng, SeedableRng};

/// The tokenizer metadata's vocabulary.
const VOCAB: usize = tiny_checkpoint::VOCAB;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FF: usize = 96;
const LAYERS: usize = 3;
const CONTEXT: usize = 256;
const BLOCK_SIZE: usize = 4;
const NEW_TOKENS: usize = 10;
const PROMPT_LENS: [usize; 4] = [3, 17, 9, 24];

fn options() -> PagedOptions {
    PagedOptions {
        block_size: BLOCK_SIZE,
        ..Default::default()
    }
}

/// A family under test: its GGUF file and candle-transformers' model of it.
struct Family {
    family: GgufFamily,
    /// Elements per head (`qwen3.attention.key_length`: not the width over
    /// the heads, for qwen3).
    head_dim: usize,
    rope_base: f32,
    /// `output.weight` in the file (tied to the embeddings without).
    output: bool,
}

const QWEN2: Family = Family {
    family: GgufFamily::Qwen2,
    head_dim: HIDDEN / HEADS,
    rope_base: 10000.,
    output: false,
};

const QWEN3: Family = Family {
    family: GgufFamily::Qwen3,
    head_dim: 32,
    rope_base: 1_000_000.,
    output: true,
};

/// candle-transformers' Phi-3 rotates with base 10000 whatever the file
/// says, and needs `output.weight`.
const PHI3: Family = Family {
    family: GgufFamily::Phi3,
    head_dim: HIDDEN / HEADS,
    rope_base: 10000.,
    output: true,
};

/// Deterministic values `center + scale * u`, `u` uniform in (-1, 1).
fn random(shape: &[usize], seed: u64, center: f32, scale: f32) -> Result<QTensor> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| center + scale * rng.random_range(-1f32..1f32))
        .collect();
    let t = Tensor::from_vec(v, shape, &Device::Cpu)?;
    Ok(QTensor::quantize(&t, GgmlDType::F32)?)
}

impl Family {
    fn name(&self) -> &'static str {
        self.family.name()
    }

    /// The GGUF metadata (llama.cpp's keys, with the tokenizer's).
    fn metadata(&self) -> Vec<(String, Value)> {
        let p = self.name();
        let mut md: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(p.into())),
            ("general.name".into(), Value::String(format!("tiny-{p}"))),
            // candle-transformers' qwen3 computes its rotary table in this
            // dtype (f16 without it).
            ("general.dtype".into(), Value::U32(0)),
            (format!("{p}.block_count"), Value::U32(LAYERS as u32)),
            (format!("{p}.embedding_length"), Value::U32(HIDDEN as u32)),
            (format!("{p}.feed_forward_length"), Value::U32(FF as u32)),
            (
                format!("{p}.attention.head_count"),
                Value::U32(HEADS as u32),
            ),
            (
                format!("{p}.attention.head_count_kv"),
                Value::U32(KV_HEADS as u32),
            ),
            (format!("{p}.rope.freq_base"), Value::F32(self.rope_base)),
            (
                format!("{p}.attention.layer_norm_rms_epsilon"),
                Value::F32(1e-6),
            ),
            (format!("{p}.context_length"), Value::U32(CONTEXT as u32)),
        ];
        if self.family == GgufFamily::Phi3 {
            md.push((
                format!("{p}.rope.dimension_count"),
                Value::U32(self.head_dim as u32),
            ));
        }
        if self.family == GgufFamily::Qwen3 {
            for key in ["key_length", "value_length"] {
                md.push((
                    format!("{p}.attention.{key}"),
                    Value::U32(self.head_dim as u32),
                ));
            }
        }
        md.extend(tiny_checkpoint::tokenizer_gguf_metadata());
        md
    }

    /// The tensors, in candle's dimension order: weights around 0, norm
    /// weights around 1, biases large enough to matter.
    fn tensors(&self, seed: u64) -> Result<Vec<(String, QTensor)>> {
        let (q, kv) = (HEADS * self.head_dim, KV_HEADS * self.head_dim);
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("token_embd.weight".into(), vec![VOCAB, HIDDEN]),
            ("output_norm.weight".into(), vec![HIDDEN]),
        ];
        if self.output {
            shapes.push(("output.weight".into(), vec![VOCAB, HIDDEN]));
        }
        for i in 0..LAYERS {
            let b = |n: &str| format!("blk.{i}.{n}");
            shapes.extend([
                (b("attn_norm.weight"), vec![HIDDEN]),
                (b("attn_output.weight"), vec![HIDDEN, q]),
                (b("ffn_norm.weight"), vec![HIDDEN]),
                (b("ffn_down.weight"), vec![HIDDEN, FF]),
            ]);
            if self.family == GgufFamily::Phi3 {
                shapes.extend([
                    (b("attn_qkv.weight"), vec![q + 2 * kv, HIDDEN]),
                    (b("ffn_up.weight"), vec![2 * FF, HIDDEN]),
                ]);
            } else {
                shapes.extend([
                    (b("attn_q.weight"), vec![q, HIDDEN]),
                    (b("attn_k.weight"), vec![kv, HIDDEN]),
                    (b("attn_v.weight"), vec![kv, HIDDEN]),
                    (b("ffn_gate.weight"), vec![FF, HIDDEN]),
                    (b("ffn_up.weight"), vec![FF, HIDDEN]),
                ]);
            }
            match self.family {
                GgufFamily::Qwen2 => shapes.extend([
                    (b("attn_q.bias"), vec![q]),
                    (b("attn_k.bias"), vec![kv]),
                    (b("attn_v.bias"), vec![kv]),
                ]),
                GgufFamily::Qwen3 => shapes.extend([
                    (b("attn_q_norm.weight"), vec![self.head_dim]),
                    (b("attn_k_norm.weight"), vec![self.head_dim]),
                ]),
                GgufFamily::Llama | GgufFamily::Phi3 => {}
            }
        }
        shapes
            .into_iter()
            .enumerate()
            .map(|(k, (name, shape))| {
                let (center, scale) = match &name {
                    n if n.contains("norm") => (1.0, 0.3),
                    n if n.ends_with(".bias") => (0.0, 1.0),
                    _ => (0.0, 0.35),
                };
                let t = random(&shape, seed * 1000 + k as u64, center, scale)?;
                Ok((name, t))
            })
            .collect()
    }

    fn gguf(&self, seed: u64) -> Result<Vec<u8>> {
        tiny_checkpoint::gguf_bytes(&self.metadata(), &self.tensors(seed)?)
    }
}

/// Our model of the GGUF `bytes`, read through the checked reader.
fn ours(bytes: &[u8]) -> Result<QuantizedLlama> {
    let mut r = Cursor::new(bytes);
    let ct = read_gguf(&mut r)?;
    Ok(QuantizedLlama::from_gguf(
        &ct,
        &mut r,
        &Device::Cpu,
        options(),
    )?)
}

/// candle-transformers' model of a family, stepped one sequence at a time.
trait Reference {
    /// Logits `(vocab,)` of the last of `ids` `(1, len)` after `offset`
    /// cached tokens.
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
reference!(quantized_qwen2::ModelWeights);
reference!(quantized_qwen3::ModelWeights);

/// candle-transformers' Phi-3 has no cache reset: a step at offset 0
/// starts its cache over.
impl Reference for quantized_phi3::ModelWeights {
    fn step(&mut self, ids: &Tensor, offset: usize) -> candle_core::Result<Tensor> {
        self.forward(ids, offset)?.flatten_all()
    }
    fn clear(&mut self) {}
}

fn theirs(family: GgufFamily, bytes: &[u8]) -> Result<Box<dyn Reference>> {
    let mut r = Cursor::new(bytes);
    let ct = gguf_file::Content::read(&mut r)?;
    let dev = Device::Cpu;
    Ok(match family {
        GgufFamily::Qwen2 => Box::new(quantized_qwen2::ModelWeights::from_gguf(ct, &mut r, &dev)?),
        GgufFamily::Qwen3 => Box::new(quantized_qwen3::ModelWeights::from_gguf(ct, &mut r, &dev)?),
        GgufFamily::Phi3 => Box::new(quantized_phi3::ModelWeights::from_gguf(
            false, ct, &mut r, &dev,
        )?),
        GgufFamily::Llama => anyhow::bail!("llama is tested elsewhere"),
    })
}

fn prompts(seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    PROMPT_LENS
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..VOCAB as u32)).collect())
        .collect()
}

/// Our logits `(vocab,)` after `prompt`, prefilled in chunks of 5.
fn our_logits(model: &dyn PagedModel, prompt: &[u32]) -> Result<Tensor> {
    let dev = Device::Cpu;
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(32),
        DType::F32,
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

/// The reference's greedy tokens of `prompt`.
fn their_tokens(r: &mut dyn Reference, prompt: &[u32]) -> Result<Vec<u32>> {
    let dev = Device::Cpu;
    r.clear();
    let mut seq = prompt.to_vec();
    let mut logits = r.step(&Tensor::new(prompt, &dev)?.unsqueeze(0)?, 0)?;
    for _ in 0..NEW_TOKENS {
        let t = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
        seq.push(t);
        logits = r.step(&Tensor::new(&[[t]], &dev)?, seq.len() - 1)?;
    }
    Ok(seq[prompt.len()..].to_vec())
}

/// Our greedy tokens of every prompt, batched in one engine with chunked
/// prefills (at most 8 tokens a step).
fn engine_tokens(model: &dyn PagedModel, prompts: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(64),
        DType::F32,
        &Device::Cpu,
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
    let mut out = vec![Vec::new(); prompts.len()];
    for c in engine.run(|_| {})? {
        out[c.id as usize] = c.tokens;
    }
    Ok(out)
}

/// (a) and (b) of the module docs for `family`; returns the largest logit
/// difference relative to the largest logit.
fn check_family(family: &Family, seed: u64) -> Result<f32> {
    let name = family.name();
    let bytes = family.gguf(seed)?;
    let ours = ours(&bytes)?;
    ensure!(ours.params().family == family.family);
    ensure!(ours.params().head_dim() == family.head_dim);
    let mut theirs = theirs(family.family, &bytes)?;
    let prompts = prompts(seed + 1);
    let mut worst = 0f32;
    for p in &prompts {
        let a = our_logits(&ours, p)?;
        theirs.clear();
        let b = theirs.step(&Tensor::new(p.as_slice(), &Device::Cpu)?.unsqueeze(0)?, 0)?;
        let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
        let scale = b.abs()?.max(0)?.to_scalar::<f32>()?.max(1.0);
        worst = worst.max(diff / scale);
    }
    println!("{name}: largest last-logit difference {worst:.2e} of the logits' scale");
    ensure!(
        worst < 1e-4,
        "{name}: logits differ by {worst} of their scale"
    );
    let batched = engine_tokens(&ours, &prompts)?;
    for (i, p) in prompts.iter().enumerate() {
        let alone = their_tokens(theirs.as_mut(), p)?;
        println!("{name} prompt {i} ({} tokens): {:?}", p.len(), batched[i]);
        ensure!(
            batched[i] == alone,
            "{name} prompt {i}: engine {:?}, candle-transformers {alone:?}",
            batched[i]
        );
    }
    Ok(worst)
}

#[test]
fn qwen2_gguf_matches_candle_transformers() -> Result<()> {
    check_family(&QWEN2, 10)?;
    Ok(())
}

#[test]
fn qwen3_gguf_matches_candle_transformers() -> Result<()> {
    check_family(&QWEN3, 20)?;
    Ok(())
}

#[test]
fn phi3_gguf_matches_candle_transformers() -> Result<()> {
    check_family(&PHI3, 50)?;
    Ok(())
}

/// Each family loads through `models::load` from a `.gguf` file, through
/// its own registry row, and computes what the direct load computes.
#[test]
fn each_gguf_family_loads_through_the_registry() -> Result<()> {
    for family in [QWEN2, QWEN3, PHI3] {
        let name = family.name();
        let bytes = family.gguf(30)?;
        let dir = std::env::temp_dir().join(format!(
            "models-families-gguf-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("tiny-{name}.gguf"));
        std::fs::write(&path, &bytes)?;
        let loaded = models::load(
            &path,
            &Device::Cpu,
            &LoadOptions {
                paged: options(),
                ..Default::default()
            },
        );
        std::fs::remove_dir_all(&dir)?;
        let loaded = loaded?;
        ensure!(
            loaded.architecture.name == name,
            "{name}: loaded as {}",
            loaded.architecture.name
        );
        ensure!(loaded.name == format!("tiny-{name}"));
        let direct = ours(&bytes)?;
        let p = &prompts(31)[1];
        let (a, b) = (
            our_logits(loaded.model.as_ref(), p)?,
            our_logits(&direct, p)?,
        );
        let diff = (a - b)?.abs()?.max(0)?.to_scalar::<f32>()?;
        ensure!(diff == 0.0, "{name}: registry model differs by {diff}");
    }
    Ok(())
}

/// Declared counts of the qwen2, qwen3 and phi3 files are checked, naming
/// the key and the value, before anything is sized by them.
#[test]
fn hostile_family_metadata_is_refused_by_key() -> Result<()> {
    let load = |family: &Family, key: &str, value: Value| -> Result<String> {
        let md = tiny_checkpoint::with(&family.metadata(), key, Some(value));
        let bytes = tiny_checkpoint::gguf_bytes(&md, &family.tensors(40)?)?;
        match ours(&bytes) {
            Ok(_) => anyhow::bail!("{key} loaded"),
            // The first line: candle's errors may carry a backtrace.
            Err(e) => Ok(e.to_string().lines().next().unwrap_or("").to_string()),
        }
    };
    let e = load(&QWEN2, "qwen2.block_count", Value::U32(u32::MAX))?;
    ensure!(
        e.starts_with(
            "quantized-qwen2: GGUF qwen2.block_count is 4294967295, more layers than the"
        ),
        "{e}"
    );
    let e = load(&QWEN3, "qwen3.attention.key_length", Value::U32(u32::MAX))?;
    ensure!(
        e.starts_with("quantized-qwen3: GGUF qwen3.attention.key_length")
            && e.contains("4294967295"),
        "{e}"
    );
    let e = load(&QWEN3, "qwen3.attention.value_length", Value::U32(16))?;
    ensure!(
        e == "quantized-qwen3: GGUF qwen3.attention.value_length 16 must equal the head size 32",
        "{e}"
    );
    let e = load(&QWEN2, "qwen2.rope.dimension_count", Value::U32(u32::MAX))?;
    ensure!(
        e.starts_with("quantized-qwen2: GGUF qwen2.rope.dimension_count must be even"),
        "{e}"
    );
    let e = load(&PHI3, "phi3.attention.head_count_kv", Value::U32(4))?;
    ensure!(
        e == "quantized-phi3: blk.0.attn_qkv.weight have 128 rows, (attention.head_count + 2 * attention.head_count_kv) * head size is 192",
        "{e}"
    );
    let mut tensors = PHI3.tensors(40)?;
    tensors.push((
        "rope_factors_long.weight".into(),
        random(&[8], 1, 1.0, 0.1)?,
    ));
    let e = match ours(&tiny_checkpoint::gguf_bytes(&PHI3.metadata(), &tensors)?) {
        Ok(_) => anyhow::bail!("rope factors loaded"),
        Err(e) => e.to_string(),
    };
    ensure!(
        e.starts_with(
            "quantized-phi3: rope_factors_long.weight: LongRoPE scaling is not supported"
        ),
        "{e}"
    );
    let e = load(&QWEN3, "qwen3.attention.head_count", Value::I32(-1))?;
    ensure!(
        e.starts_with("quantized-qwen3: GGUF qwen3.attention.head_count must be in 1..=u32::MAX"),
        "{e}"
    );
    Ok(())
}

/// `phi3.attention.sliding_window` slides every layer, as Hugging Face's
/// Phi-3 does (candle-transformers' quantized Phi-3 ignores it): a prompt
/// longer than the window gets other logits than without it, a prompt
/// within it the same; a zero window is refused by name.
#[test]
fn the_phi3_gguf_sliding_window_is_applied() -> Result<()> {
    let plain = ours(&PHI3.gguf(41)?)?;
    let md = tiny_checkpoint::with(
        &PHI3.metadata(),
        "phi3.attention.sliding_window",
        Some(Value::U32(4)),
    );
    let windowed = ours(&tiny_checkpoint::gguf_bytes(&md, &PHI3.tensors(41)?)?)?;
    ensure!(windowed
        .attention_layers()
        .iter()
        .all(|a| a.options().sliding_window == Some(4)));
    let diff = |prompt: &[u32]| -> Result<f32> {
        let (a, b) = (our_logits(&plain, prompt)?, our_logits(&windowed, prompt)?);
        Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
    };
    ensure!(
        diff(&[1, 2, 3, 4])? == 0.0,
        "a prompt within the window changed"
    );
    ensure!(
        diff(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10])? > 1e-4,
        "the window changed nothing"
    );
    let md = tiny_checkpoint::with(
        &PHI3.metadata(),
        "phi3.attention.sliding_window",
        Some(Value::U32(0)),
    );
    let e = match ours(&tiny_checkpoint::gguf_bytes(&md, &PHI3.tensors(41)?)?) {
        Ok(_) => anyhow::bail!("a zero window loaded"),
        Err(e) => e.to_string(),
    };
    ensure!(
        e.starts_with("quantized-phi3: GGUF phi3.attention.sliding_window must be in 1..=u32::MAX, got U32(0)"),
        "{e}"
    );
    Ok(())
}
