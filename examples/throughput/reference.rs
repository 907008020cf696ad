//! The dense baseline: candle-transformers' own models, with their
//! concatenated (unpaged) KV caches, run greedily on the same requests one
//! at a time and, when all requests have one prompt length and one output
//! length and arrive together, in batches.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_transformers::models::{llama, quantized_gemma3, quantized_llama};

use super::stats::{RunStats, Timeline};
use super::workload::WorkItem;

/// A candle-transformers model and its dense KV cache.
pub trait Reference {
    /// Forgets the cached keys and values (a new group of sequences).
    fn reset(&mut self) -> Result<()>;

    /// Runs `(batch, seq_len)` u32 `tokens` at positions `pos..pos + seq_len`
    /// and returns the `(batch, vocab)` logits of the last position.
    fn forward(&mut self, tokens: &Tensor, pos: usize) -> Result<Tensor>;
}

/// candle-transformers' `quantized_llama` (GGUF).
pub struct QuantizedRef(pub quantized_llama::ModelWeights);

impl Reference for QuantizedRef {
    fn reset(&mut self) -> Result<()> {
        self.0.clear_kv_cache();
        Ok(())
    }

    fn forward(&mut self, tokens: &Tensor, pos: usize) -> Result<Tensor> {
        Ok(self.0.forward(tokens, pos)?)
    }
}

/// candle-transformers' `quantized_gemma3` (GGUF). Its `forward` takes a
/// batch, `(batch, seq_len)`; it has no way to clear its cache, and needs
/// none: a forward at position 0 replaces the cached keys and values.
pub struct QuantizedGemma3Ref(pub quantized_gemma3::ModelWeights);

impl Reference for QuantizedGemma3Ref {
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }

    fn forward(&mut self, tokens: &Tensor, pos: usize) -> Result<Tensor> {
        Ok(self.0.forward(tokens, pos)?)
    }
}

/// candle-transformers' `llama` (safetensors-style weights).
pub struct DenseRef {
    pub model: llama::Llama,
    pub config: llama::Config,
    pub dtype: DType,
    pub device: Device,
    pub cache: llama::Cache,
}

impl DenseRef {
    /// `model` with an empty cache.
    pub fn new(
        model: llama::Llama,
        config: llama::Config,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let cache = llama::Cache::new(true, dtype, &config, device)?;
        Ok(Self {
            model,
            config,
            dtype,
            device: device.clone(),
            cache,
        })
    }
}

impl Reference for DenseRef {
    fn reset(&mut self) -> Result<()> {
        self.cache = llama::Cache::new(true, self.dtype, &self.config, &self.device)?;
        Ok(())
    }

    fn forward(&mut self, tokens: &Tensor, pos: usize) -> Result<Tensor> {
        Ok(self.model.forward(tokens, pos, &mut self.cache)?)
    }
}

/// How a batch of prompts is prefilled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prefill {
    /// One forward over the whole prompt.
    Whole,
    /// One position per forward, because the whole-prompt forward failed
    /// for a batch (the error is kept for the report).
    PerPosition(String),
}

/// Greedy generation of `max_tokens` tokens for equal-length `prompts`
/// decoded together. Returns each sequence's tokens and, per generated
/// position, when the tokens reached the host (seconds since `t0`).
fn generate_group(
    model: &mut dyn Reference,
    prompts: &[&[u32]],
    max_tokens: usize,
    prefill: &mut Prefill,
    dev: &Device,
    t0: Instant,
) -> Result<(Vec<Vec<u32>>, Vec<f64>)> {
    let (b, p) = (prompts.len(), prompts[0].len());
    let flat: Vec<u32> = prompts.iter().flat_map(|x| x.iter().copied()).collect();
    let input = Tensor::from_vec(flat, (b, p), dev)?;
    let per_position = |model: &mut dyn Reference| -> Result<Tensor> {
        model.reset()?;
        let mut logits = None;
        for i in 0..p {
            logits = Some(model.forward(&input.narrow(1, i, 1)?.contiguous()?, i)?);
        }
        Ok(logits.expect("prompts are not empty"))
    };
    model.reset()?;
    let mut logits = match prefill {
        Prefill::Whole => match model.forward(&input, 0) {
            Ok(l) => l,
            Err(e) if b > 1 => {
                // The first line: candle appends a backtrace when one is enabled.
                let msg = e.to_string();
                *prefill = Prefill::PerPosition(msg.lines().next().unwrap_or("").to_string());
                per_position(model)?
            }
            Err(e) => return Err(e),
        },
        Prefill::PerPosition(_) => per_position(model)?,
    };
    let mut tokens = vec![Vec::with_capacity(max_tokens); b];
    let mut times = Vec::with_capacity(max_tokens);
    for step in 0..max_tokens {
        let next = logits.argmax(D::Minus1)?; // (b,) u32
        let ids: Vec<u32> = next.to_vec1()?;
        times.push(t0.elapsed().as_secs_f64());
        for (t, id) in tokens.iter_mut().zip(ids) {
            t.push(id);
        }
        if step + 1 < max_tokens {
            logits = model.forward(&next.unsqueeze(1)?, p + step)?;
        }
    }
    Ok((tokens, times))
}

/// The requests one at a time, each starting at its arrival or when the
/// previous one finished, whichever is later. Returns the figures and each
/// request's tokens.
pub fn run_sequential(
    model: &mut dyn Reference,
    work: &[WorkItem],
    dev: &Device,
) -> Result<(RunStats, Vec<Vec<u32>>)> {
    let mut timeline = Timeline::new(work.len());
    let mut outputs = Vec::with_capacity(work.len());
    let mut prefill = Prefill::Whole;
    let t0 = Instant::now();
    for (i, w) in work.iter().enumerate() {
        if let Some(wait) = w.arrival.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
        let (mut toks, times) =
            generate_group(model, &[&w.prompt], w.max_tokens, &mut prefill, dev, t0)?;
        timeline.arrivals[i] = w.arrival.as_secs_f64();
        timeline.token_times[i] = times;
        outputs.push(toks.remove(0));
    }
    let wall = t0.elapsed().as_secs_f64();
    let label = "candle-transformers, one at a time".to_string();
    Ok((RunStats::from_timeline(label, &timeline, wall, 1), outputs))
}

/// All requests (equal lengths, all arriving at t = 0) in batches of
/// `group`, one batch after another.
pub fn run_batched(
    model: &mut dyn Reference,
    work: &[WorkItem],
    group: usize,
    dev: &Device,
) -> Result<(RunStats, Vec<Vec<u32>>, Prefill)> {
    let mut timeline = Timeline::new(work.len());
    let mut outputs = Vec::with_capacity(work.len());
    let mut prefill = Prefill::Whole;
    let t0 = Instant::now();
    for (g, chunk) in work.chunks(group).enumerate() {
        let prompts: Vec<&[u32]> = chunk.iter().map(|w| w.prompt.as_slice()).collect();
        let (toks, times) =
            generate_group(model, &prompts, chunk[0].max_tokens, &mut prefill, dev, t0)?;
        for (j, t) in toks.into_iter().enumerate() {
            timeline.token_times[g * group + j] = times.clone();
            outputs.push(t);
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let label = format!("candle-transformers, batches of {}", group.min(work.len()));
    let stats = RunStats::from_timeline(label, &timeline, wall, group.min(work.len()));
    Ok((stats, outputs, prefill))
}

/// One short prompt and one decode step, so that the timed runs do not pay
/// for first-use initialisation (kernel loading, allocator growth).
pub fn warm_up(model: &mut dyn Reference, prompt: &[u32], dev: &Device) -> Result<()> {
    generate_group(
        model,
        &[prompt],
        2,
        &mut Prefill::Whole,
        dev,
        Instant::now(),
    )?;
    model.reset()
}
