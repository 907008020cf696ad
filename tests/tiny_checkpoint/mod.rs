//! Tiny checkpoints for the hostile-input tests: a Llama and a Gemma 3 as
//! GGUF bytes, and Llama / Gemma 2 / Gemma 3 `config.json` texts with
//! matching safetensors-style weights (by name), all with random weights.
//!
//! Also a global allocator for the fuzz targets that refuses any single
//! allocation above [`ALLOCATION_CAP`]: an input that makes the loaders
//! reserve memory out of proportion to its size aborts the test binary
//! (so the run fails) instead of passing unnoticed.

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::io::Cursor;

use anyhow::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_paged_attention::models::{CacheConfig, PagedKvCache, PagedModel, PagedOptions};
use candle_paged_attention::{AttentionMetadata, PagedBatch, SlotMapping};

/// The largest single allocation the capped allocator grants (256 MiB):
/// far above anything a tiny checkpoint needs.
pub const ALLOCATION_CAP: usize = 256 << 20;

/// The system allocator, refusing single allocations above
/// [`ALLOCATION_CAP`] (Rust then aborts with "memory allocation of N bytes
/// failed").
pub struct CappedAlloc;

// SAFETY: every call is forwarded to the system allocator unchanged, or
// answered with null (allocation failure), which GlobalAlloc allows.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Width, heads, KV heads, head size, MLP width, vocabulary, layers.
pub const HIDDEN: usize = 16;
pub const HEADS: usize = 2;
pub const KV_HEADS: usize = 1;
pub const HEAD_DIM: usize = 8;
pub const FF: usize = 24;
pub const VOCAB: usize = 32;
pub const LAYERS: usize = 2;

fn random(shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    // A small LCG: deterministic weights in (-0.5, 0.5).
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// The metadata of a tiny GGUF Llama.
pub fn llama_gguf_metadata() -> Vec<(String, Value)> {
    [
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("tiny".into())),
        ("llama.block_count", Value::U32(LAYERS as u32)),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Value::U32(FF as u32)),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.rope.dimension_count", Value::U32(HEAD_DIM as u32)),
        ("llama.rope.freq_base", Value::F32(10000.)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(64)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The tensors of a tiny GGUF Llama (f32), in candle's dimension order.
pub fn llama_gguf_tensors() -> Result<Vec<(String, QTensor)>> {
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("token_embd.weight".into(), vec![VOCAB, HIDDEN]),
        ("output_norm.weight".into(), vec![HIDDEN]),
    ];
    for i in 0..LAYERS {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        shapes.extend([
            (b("attn_norm"), vec![HIDDEN]),
            (b("attn_q"), vec![HEADS * HEAD_DIM, HIDDEN]),
            (b("attn_k"), vec![KV_HEADS * HEAD_DIM, HIDDEN]),
            (b("attn_v"), vec![KV_HEADS * HEAD_DIM, HIDDEN]),
            (b("attn_output"), vec![HIDDEN, HEADS * HEAD_DIM]),
            (b("ffn_norm"), vec![HIDDEN]),
            (b("ffn_gate"), vec![FF, HIDDEN]),
            (b("ffn_up"), vec![FF, HIDDEN]),
            (b("ffn_down"), vec![HIDDEN, FF]),
        ]);
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let t = random(&shape, k as u64)?;
            Ok((name, QTensor::quantize(&t, GgmlDType::F32)?))
        })
        .collect()
}

/// The bytes of a GGUF file with `metadata` and `tensors`.
pub fn gguf_bytes(metadata: &[(String, Value)], tensors: &[(String, QTensor)]) -> Result<Vec<u8>> {
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &md, &ts)?;
    Ok(out.into_inner())
}

/// `metadata` with `key` set to `value` (added when missing, removed when
/// `None`).
pub fn with(metadata: &[(String, Value)], key: &str, value: Option<Value>) -> Vec<(String, Value)> {
    let mut md: Vec<(String, Value)> = metadata
        .iter()
        .filter(|(k, _)| k != key)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some(v) = value {
        md.push((key.to_string(), v));
    }
    md
}

/// `config.json` of a tiny Hugging Face Llama.
pub fn llama_config_json() -> String {
    format!(
        r#"{{"model_type": "llama", "hidden_size": {HIDDEN}, "intermediate_size": {FF}, "vocab_size": {VOCAB},
  "num_hidden_layers": {LAYERS}, "num_attention_heads": {HEADS}, "num_key_value_heads": {KV_HEADS},
  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
  "tie_word_embeddings": false}}"#
    )
}

/// `config.json` of a tiny Gemma 2.
pub fn gemma2_config_json() -> String {
    format!(
        r#"{{"model_type": "gemma2", "attention_bias": false, "head_dim": {HEAD_DIM}, "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": {HIDDEN}, "intermediate_size": {FF}, "num_attention_heads": {HEADS}, "num_hidden_layers": {LAYERS},
  "num_key_value_heads": {KV_HEADS}, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": {VOCAB},
  "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": {HEAD_DIM},
  "sliding_window": 4, "max_position_embeddings": 64}}"#
    )
}

/// `config.json` of a tiny Gemma 3 (text).
pub fn gemma3_config_json() -> String {
    format!(
        r#"{{"model_type": "gemma3_text", "attention_bias": false, "head_dim": {HEAD_DIM}, "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": {HIDDEN}, "intermediate_size": {FF}, "num_attention_heads": {HEADS}, "num_hidden_layers": {LAYERS},
  "num_key_value_heads": {KV_HEADS}, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
  "vocab_size": {VOCAB}, "query_pre_attn_scalar": {HEAD_DIM}, "sliding_window": 4, "sliding_window_pattern": 2,
  "max_position_embeddings": 64}}"#
    )
}

/// Loads the model that `config` (a `config.json` text) describes from
/// `vb`, through the registry's row of its `model_type`.
pub fn load_config(config: &str, vb: VarBuilder) -> Result<Box<dyn PagedModel>> {
    let opts = PagedOptions {
        block_size: 4,
        ..Default::default()
    };
    Ok(candle_paged_attention::models::registry::load_config(config, vb, opts)?.0)
}

/// `config.json` of a tiny Qwen2 (q/k/v biases, tied embeddings).
pub fn qwen2_config_json() -> String {
    format!(
        r#"{{"model_type": "qwen2", "hidden_size": {HIDDEN}, "intermediate_size": {FF}, "vocab_size": {VOCAB},
  "num_hidden_layers": {LAYERS}, "num_attention_heads": {HEADS}, "num_key_value_heads": {KV_HEADS},
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64, "sliding_window": 4,
  "use_sliding_window": false, "max_window_layers": 1, "tie_word_embeddings": true, "hidden_act": "silu"}}"#
    )
}

/// `config.json` of a tiny Qwen3 (QK-norm).
pub fn qwen3_config_json() -> String {
    format!(
        r#"{{"model_type": "qwen3", "hidden_size": {HIDDEN}, "intermediate_size": {FF}, "vocab_size": {VOCAB},
  "num_hidden_layers": {LAYERS}, "num_attention_heads": {HEADS}, "num_key_value_heads": {KV_HEADS},
  "head_dim": {HEAD_DIM}, "attention_bias": false, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
  "max_position_embeddings": 64, "tie_word_embeddings": false, "hidden_act": "silu"}}"#
    )
}

/// `config.json` of a tiny Mistral (a sliding window of 4).
pub fn mistral_config_json() -> String {
    format!(
        r#"{{"model_type": "mistral", "hidden_size": {HIDDEN}, "intermediate_size": {FF}, "vocab_size": {VOCAB},
  "num_hidden_layers": {LAYERS}, "num_attention_heads": {HEADS}, "num_key_value_heads": {KV_HEADS},
  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64, "sliding_window": 4,
  "hidden_act": "silu", "tie_word_embeddings": false}}"#
    )
}

/// `config.json` of a tiny Phi-3 (joined qkv and gate/up).
pub fn phi3_config_json() -> String {
    format!(
        r#"{{"model_type": "phi3", "hidden_size": {HIDDEN}, "intermediate_size": {FF}, "vocab_size": {VOCAB},
  "num_hidden_layers": {LAYERS}, "num_attention_heads": {HEADS}, "num_key_value_heads": {KV_HEADS},
  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
  "original_max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": false,
  "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": null, "sliding_window": null}}"#
    )
}

/// The weights (by name) of the model `config` describes: random, as
/// created by loading it over a `VarMap`.
pub fn weights_for(config: &str) -> Result<HashMap<String, Tensor>> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    load_config(config, vb)?;
    let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(data
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect())
}

/// Runs `ids` as one prompt through `model` and returns the last row's
/// logits, `(1, vocab)`.
pub fn forward_prompt(model: &dyn PagedModel, ids: &[u32]) -> candle_core::Result<Tensor> {
    let dev = Device::Cpu;
    let block = model
        .attention_layers()
        .first()
        .map_or(16, |a| a.options().block_size);
    let blocks = ids.len().div_ceil(block).max(1);
    let cache = PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(blocks),
        model.dtype(),
        &dev,
    )?;
    let n = ids.len() as u32;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let batch = PagedBatch::from_rows(&[0, n], &[n], &[table], block, &dev)?;
    let slots: Vec<i64> = (0..n as i64).collect();
    let meta = AttentionMetadata::new(batch, SlotMapping::new(&slots, &dev)?)?;
    model.forward(&Tensor::new(ids, &dev)?, &meta, &cache, &[ids.len() - 1])
}

/// The tokenizer metadata of the tiny GGUFs: a GPT-2 BPE vocabulary of
/// [`VOCAB`] tokens with merges, BOS/EOS and a ChatML template.
pub fn tokenizer_gguf_metadata() -> Vec<(String, Value)> {
    let mut tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc", "Ġ", "Ġa"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    tokens.extend(["<|im_start|>", "<|im_end|>", "<s>", "</s>"].map(String::from));
    while tokens.len() < VOCAB {
        tokens.push(format!("t{}", tokens.len()));
    }
    let merges = ["a b", "b c", "ab c", "Ġ a"];
    [
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(merges.iter().map(|m| Value::String(m.to_string())).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(10)),
        ("tokenizer.ggml.eos_token_id", Value::U32(9)),
        (
            "tokenizer.chat_template",
            Value::String(
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into(),
            ),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The metadata of a tiny GGUF Gemma 3 (layer 1 of 2 global).
pub fn gemma3_gguf_metadata() -> Vec<(String, Value)> {
    [
        ("general.architecture", Value::String("gemma3".into())),
        ("gemma3.block_count", Value::U32(LAYERS as u32)),
        ("gemma3.embedding_length", Value::U32(HIDDEN as u32)),
        ("gemma3.feed_forward_length", Value::U32(FF as u32)),
        ("gemma3.attention.head_count", Value::U32(HEADS as u32)),
        (
            "gemma3.attention.head_count_kv",
            Value::U32(KV_HEADS as u32),
        ),
        ("gemma3.attention.key_length", Value::U32(HEAD_DIM as u32)),
        ("gemma3.attention.value_length", Value::U32(HEAD_DIM as u32)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("gemma3.attention.sliding_window", Value::U32(4)),
        ("gemma3.attention.sliding_window_type", Value::U32(2)),
        ("gemma3.rope.freq_base", Value::F32(1e6)),
        ("gemma3.rope.local_freq_base", Value::F32(1e4)),
        ("gemma3.context_length", Value::U32(64)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The tensors of a tiny GGUF Gemma 3 (f32), in candle's dimension order.
pub fn gemma3_gguf_tensors() -> Result<Vec<(String, QTensor)>> {
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("token_embd.weight".into(), vec![VOCAB, HIDDEN]),
        ("output_norm.weight".into(), vec![HIDDEN]),
    ];
    for i in 0..LAYERS {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        shapes.extend([
            (b("attn_norm"), vec![HIDDEN]),
            (b("attn_q"), vec![HEADS * HEAD_DIM, HIDDEN]),
            (b("attn_k"), vec![KV_HEADS * HEAD_DIM, HIDDEN]),
            (b("attn_v"), vec![KV_HEADS * HEAD_DIM, HIDDEN]),
            (b("attn_q_norm"), vec![HEAD_DIM]),
            (b("attn_k_norm"), vec![HEAD_DIM]),
            (b("attn_output"), vec![HIDDEN, HEADS * HEAD_DIM]),
            (b("post_attention_norm"), vec![HIDDEN]),
            (b("ffn_norm"), vec![HIDDEN]),
            (b("ffn_gate"), vec![FF, HIDDEN]),
            (b("ffn_up"), vec![FF, HIDDEN]),
            (b("ffn_down"), vec![HIDDEN, FF]),
            (b("post_ffw_norm"), vec![HIDDEN]),
        ]);
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let t = random(&shape, 100 + k as u64)?;
            Ok((name, QTensor::quantize(&t, GgmlDType::F32)?))
        })
        .collect()
}

/// The proptest configuration of the fuzz targets: `cases` cases (or
/// `$FUZZ_CASES`), from a fixed seed so that CI runs the same cases every
/// time (`$FUZZ_SEED` explores others), no regression files, and a bounded
/// shrink.
pub fn fuzz_config(cases: u32) -> proptest::test_runner::Config {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    proptest::test_runner::Config {
        cases: env("FUZZ_CASES").map_or(cases, |c| c as u32),
        rng_seed: proptest::test_runner::RngSeed::Fixed(env("FUZZ_SEED").unwrap_or(0x5eed_cafe)),
        failure_persistence: None,
        max_shrink_iters: 256,
        ..proptest::test_runner::Config::default()
    }
}
