//! Hostile checkpoints: GGUF metadata and tensor shapes, `config.json`
//! values. Each is refused before anything is allocated from it, with an
//! error that names the key (or tensor) and the value, quickly and without
//! a panic or an abort.

#![cfg(feature = "models")]

#[macro_use]
mod common;
mod tiny_checkpoint;

use std::io::Cursor;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_paged_attention::models::limits::read_gguf;
use candle_paged_attention::models::quantized_gemma3::QuantizedGemma3;
use candle_paged_attention::models::quantized_llama::QuantizedLlama;
use candle_paged_attention::models::PagedOptions;
use tiny_checkpoint::*;

/// The allocator refuses single allocations over 256 MiB: a loader that
/// reserves memory for a declared count aborts this binary.
#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// The first line of an error (candle appends a backtrace when
/// `RUST_BACKTRACE` is set).
fn first_line(e: impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Loads a GGUF Llama from `bytes` through the checked reader; the error's
/// first line, and the time it took.
fn llama_gguf_error(bytes: Vec<u8>) -> Result<(String, Duration)> {
    let start = Instant::now();
    let mut r = Cursor::new(bytes);
    let result = read_gguf(&mut r).and_then(|ct| {
        QuantizedLlama::from_gguf(&ct, &mut r, &Device::Cpu, PagedOptions::default())
    });
    match result {
        Ok(_) => anyhow::bail!("the GGUF loaded"),
        Err(e) => Ok((first_line(e), start.elapsed())),
    }
}

fn tiny_llama_with(key: &str, value: Value) -> Result<Vec<u8>> {
    gguf_bytes(
        &with(&llama_gguf_metadata(), key, Some(value)),
        &llama_gguf_tensors()?,
    )
}

#[test]
fn the_tiny_llama_gguf_loads_and_runs() -> Result<()> {
    let bytes = gguf_bytes(&llama_gguf_metadata(), &llama_gguf_tensors()?)?;
    let mut r = Cursor::new(bytes);
    let ct = read_gguf(&mut r)?;
    let model = QuantizedLlama::from_gguf(&ct, &mut r, &Device::Cpu, PagedOptions::default())?;
    let logits = forward_prompt(&model, &[1, 2, 3, 4, 5])?;
    ensure!(logits.dims() == [1, VOCAB]);
    Ok(())
}

#[test]
fn a_block_count_of_u32_max_is_refused_before_layers_are_reserved() -> Result<()> {
    let (e, took) = llama_gguf_error(tiny_llama_with("llama.block_count", Value::U32(u32::MAX))?)?;
    let tensors = 2 + 9 * LAYERS;
    ensure!(
        e == format!("quantized-llama: GGUF llama.block_count is 4294967295, more layers than the {tensors} tensors of the file can hold"),
        "{e}"
    );
    ensure!(took < Duration::from_secs(2), "{took:?}");
    Ok(())
}

#[test]
fn a_gemma3_block_count_of_u32_max_is_refused_before_layers_are_reserved() -> Result<()> {
    let md: Vec<(String, Value)> = [
        ("general.architecture", Value::String("gemma3".into())),
        ("gemma3.block_count", Value::U32(u32::MAX)),
        ("gemma3.embedding_length", Value::U32(16)),
        ("gemma3.attention.head_count", Value::U32(2)),
        ("gemma3.attention.head_count_kv", Value::U32(1)),
        ("gemma3.attention.key_length", Value::U32(8)),
        ("gemma3.attention.value_length", Value::U32(8)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("gemma3.attention.sliding_window", Value::U32(4)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut r = Cursor::new(gguf_bytes(&md, &llama_gguf_tensors()?)?);
    let ct = read_gguf(&mut r)?;
    let e = first_line(
        QuantizedGemma3::from_gguf(&ct, &mut r, &Device::Cpu, PagedOptions::default())
            .err()
            .ok_or_else(|| anyhow::anyhow!("loaded"))?,
    );
    ensure!(
        e == "quantized-gemma3: GGUF gemma3.block_count is 4294967295, more layers than the 20 tensors of the file can hold",
        "{e}"
    );
    Ok(())
}

#[test]
fn a_rope_dimension_of_u32_max_is_refused_before_its_frequencies_are_built() -> Result<()> {
    let (e, took) = llama_gguf_error(tiny_llama_with(
        "llama.rope.dimension_count",
        Value::U32(u32::MAX),
    )?)?;
    ensure!(
        e == "quantized-llama: GGUF llama.rope.dimension_count must be even and at most the head size 8, got 4294967295",
        "{e}"
    );
    ensure!(took < Duration::from_secs(2), "{took:?}");
    Ok(())
}

#[test]
fn a_zero_alignment_is_refused_before_candle_divides_by_it() -> Result<()> {
    let (e, _) = llama_gguf_error(tiny_llama_with("general.alignment", Value::U32(0))?)?;
    ensure!(
        e == "gguf: general.alignment must be a power of two in 1..=1048576, got 0",
        "{e}"
    );
    Ok(())
}

/// The byte offset of tensor `name`'s first dimension in a GGUF v2/v3
/// header (after its u64 name length, its name and its u32 dimension count).
fn first_dim_offset(bytes: &[u8], name: &str) -> Option<usize> {
    let mut pattern = (name.len() as u64).to_le_bytes().to_vec();
    pattern.extend_from_slice(name.as_bytes());
    let at = bytes.windows(pattern.len()).position(|w| w == pattern)?;
    Some(at + pattern.len() + 4)
}

#[test]
fn a_tensor_of_2_pow_60_by_16_elements_is_refused_not_loaded_empty() -> Result<()> {
    let mut bytes = gguf_bytes(&llama_gguf_metadata(), &llama_gguf_tensors()?)?;
    // token_embd is (vocab, hidden): stored as [hidden, vocab]; the vocab
    // becomes 2^60, the element count 2^64.
    let at = first_dim_offset(&bytes, "token_embd.weight")
        .ok_or_else(|| anyhow::anyhow!("no tensor"))?;
    bytes[at..at + 8].copy_from_slice(&16u64.to_le_bytes());
    bytes[at + 8..at + 16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let (e, _) = llama_gguf_error(bytes.clone())?;
    ensure!(
        e == "gguf: tensor token_embd.weight of shape [1152921504606846976, 16] has more elements than fit in 64 bits",
        "{e}"
    );
    // Content from candle's own reader is checked again when a tensor loads.
    let mut r = Cursor::new(bytes);
    let ct = gguf_file::Content::read(&mut r)?;
    let e = first_line(
        QuantizedLlama::from_gguf(&ct, &mut r, &Device::Cpu, PagedOptions::default())
            .err()
            .ok_or_else(|| anyhow::anyhow!("loaded"))?,
    );
    ensure!(
        e == "gguf: tensor token_embd.weight of shape [1152921504606846976, 16] has more elements than fit in 64 bits",
        "{e}"
    );
    Ok(())
}

#[test]
fn a_nan_zero_or_negative_norm_epsilon_is_refused_by_every_loader() -> Result<()> {
    for (eps, shown) in [
        (f32::NAN, "NaN"),
        (0.0, "0"),
        (-1e-5, "-0.000009999999747378752"),
    ] {
        let (e, _) = llama_gguf_error(tiny_llama_with(
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(eps),
        )?)?;
        ensure!(
            e == format!("quantized-llama: GGUF llama.attention.layer_norm_rms_epsilon must be finite and positive, got {shown}"),
            "{e}"
        );
    }
    for (config, component) in [
        (llama_config_json(), "llama"),
        (gemma2_config_json(), "gemma2"),
        (gemma3_config_json(), "gemma3"),
    ] {
        let weights = weights_for(&config)?;
        for eps in ["-1e-6", "0.0"] {
            let bad = config
                .replace(
                    "\"rms_norm_eps\": 1e-5",
                    &format!("\"rms_norm_eps\": {eps}"),
                )
                .replace(
                    "\"rms_norm_eps\": 1e-6",
                    &format!("\"rms_norm_eps\": {eps}"),
                );
            let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
            let e = first_line(
                load_config(&bad, vb)
                    .err()
                    .ok_or_else(|| anyhow::anyhow!("loaded {bad}"))?,
            );
            let shown = if eps == "0.0" { "0" } else { "-0.000001" };
            ensure!(
                e == format!("{component}: config.json rms_norm_eps must be finite and positive, got {shown}"),
                "{e}"
            );
        }
    }
    Ok(())
}

#[test]
fn a_config_with_u32_max_layers_fails_at_the_first_missing_layer() -> Result<()> {
    for config in [
        llama_config_json(),
        gemma2_config_json(),
        gemma3_config_json(),
    ] {
        let weights = weights_for(&config)?;
        let bad = config.replace(
            &format!("\"num_hidden_layers\": {LAYERS}"),
            "\"num_hidden_layers\": 4294967295",
        );
        let start = Instant::now();
        let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
        let e = first_line(
            load_config(&bad, vb)
                .err()
                .ok_or_else(|| anyhow::anyhow!("loaded"))?,
        );
        ensure!(e.contains(&format!("model.layers.{LAYERS}.")), "{e}");
        ensure!(start.elapsed() < Duration::from_secs(2));
        let huge = config.replace(
            &format!("\"num_hidden_layers\": {LAYERS}"),
            "\"num_hidden_layers\": 4294967296",
        );
        let vb = VarBuilder::from_tensors(weights_for(&config)?, DType::F32, &Device::Cpu);
        let e = first_line(
            load_config(&huge, vb)
                .err()
                .ok_or_else(|| anyhow::anyhow!("loaded"))?,
        );
        ensure!(
            e.ends_with("config.json num_hidden_layers must be in 1..=4294967295, got 4294967296"),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn heads_that_do_not_divide_are_named_with_their_key() -> Result<()> {
    let config = llama_config_json();
    let weights = weights_for(&config)?;
    let bad = config.replace(
        &format!("\"num_key_value_heads\": {KV_HEADS}"),
        "\"num_key_value_heads\": 0",
    );
    let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let e = first_line(
        load_config(&bad, vb)
            .err()
            .ok_or_else(|| anyhow::anyhow!("loaded"))?,
    );
    ensure!(
        e == "llama: config.json num_key_value_heads must be in 1..=4294967295, got 0",
        "{e}"
    );
    Ok(())
}

#[test]
fn the_tiny_safetensors_models_load_and_run() -> Result<()> {
    for config in [
        llama_config_json(),
        gemma2_config_json(),
        gemma3_config_json(),
    ] {
        let vb = VarBuilder::from_tensors(weights_for(&config)?, DType::F32, &Device::Cpu);
        let model = load_config(&config, vb)?;
        let logits = forward_prompt(model.as_ref(), &[3, 1, 4, 1, 5, 9])?;
        ensure!(logits.dims() == [1, VOCAB]);
    }
    Ok(())
}

/// A tiny Llama whose embedding of token 7 is NaN, in the engine (greedy
/// through the device argmax, with and without CUDA graphs, and sampled):
/// a request ends with a non-finite-logits error exactly when token 7 was
/// fed to the model (in its prompt, or generated and fed back), never with
/// a token picked from NaN logits; the others finish; every block is freed.
fn nan_logits_end_their_requests(dev: &Device) -> Result<()> {
    use candle_paged_attention::engine::{
        Engine, FinishReason, Request, SamplingParams, SchedulerConfig,
    };
    use candle_paged_attention::models::{CacheConfig, PagedKvCache};
    const POISON: u32 = 7;
    let config = llama_config_json();
    let mut weights = weights_for(&config)?;
    let embed = weights["model.embed_tokens.weight"].clone();
    let mut rows: Vec<Vec<f32>> = embed.to_vec2()?;
    rows[POISON as usize] = vec![f32::NAN; HIDDEN];
    weights.insert(
        "model.embed_tokens.weight".into(),
        Tensor::new(rows, &Device::Cpu)?,
    );
    let weights = weights
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_device(dev)?)))
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
    let model = load_config(&config, VarBuilder::from_tensors(weights, DType::F32, dev))?;
    let prompts: [&[u32]; 4] = [
        &[1, 2, POISON, 3],
        &[4, 5, 6],
        &[POISON],
        &[8, 9, 10, 11, 12],
    ];
    for (graphs, temperature) in [(false, 0.0), (true, 0.0), (false, 0.8)] {
        let cache = PagedKvCache::new(
            &model.attention_layers(),
            CacheConfig::new(32),
            DType::F32,
            dev,
        )?;
        let mut engine = Engine::new(model.as_ref(), cache, SchedulerConfig::default())?
            .with_cuda_graphs(graphs);
        for (i, p) in prompts.iter().enumerate() {
            engine.add_request(Request {
                id: i as u64,
                prompt: p.to_vec(),
                params: SamplingParams {
                    temperature,
                    seed: i as u64,
                    ..SamplingParams::greedy(6)
                },
            })?;
        }
        let mut done = engine.run(|_| {})?;
        done.sort_by_key(|c| c.id);
        ensure!(done.len() == prompts.len());
        for (c, p) in done.iter().zip(prompts) {
            let fed: Vec<u32> = match &c.finish {
                FinishReason::Error(_) => p.iter().chain(&c.tokens).copied().collect(),
                _ => p
                    .iter()
                    .chain(&c.tokens[..c.tokens.len().saturating_sub(1)])
                    .copied()
                    .collect(),
            };
            let poisoned = fed.contains(&POISON);
            match &c.finish {
                FinishReason::Error(e) => ensure!(
                    poisoned && e.contains("non-finite logits"),
                    "request {} (graphs {graphs}, temperature {temperature}): {e}",
                    c.id
                ),
                FinishReason::Length => ensure!(
                    !poisoned && c.tokens.len() == 6,
                    "request {} finished after token {POISON} was fed: {:?}",
                    c.id,
                    c.tokens
                ),
                f => anyhow::bail!("request {}: {f:?}", c.id),
            }
        }
        ensure!(done[0].error().is_some() && done[2].error().is_some());
        ensure!(done[0].tokens.is_empty() && done[2].tokens.is_empty());
        ensure!(engine.block_manager().num_used_blocks() == 0);
    }
    Ok(())
}

device_test!(nan_logits_end_their_requests);
