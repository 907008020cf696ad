//! A Llama with seeded random weights, of any shape: the runners' stand-in
//! for Llama 3 8B (no checkpoint to download).

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::models::llama;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// The sizes of a random Llama (Llama 3 8B's by default in the runners).
#[derive(Clone, Copy, Debug)]
pub struct LlamaShape {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
}

impl LlamaShape {
    /// Llama 3 8B's configuration (rope theta 500,000, context 8192,
    /// untied head) with these sizes.
    pub fn config(&self) -> llama::Config {
        llama::Config {
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            vocab_size: self.vocab,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            use_flash_attn: false,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            bos_token_id: None,
            eos_token_id: None,
            rope_scaling: None,
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
        }
    }
}

/// Name, shape and "is a norm weight" of every tensor a Hugging Face Llama
/// checkpoint of `cfg` holds (what both loaders ask their VarBuilder for).
pub fn tensor_shapes(cfg: &llama::Config) -> Vec<(String, Vec<usize>, bool)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let kv = cfg.num_key_value_heads * (h / cfg.num_attention_heads);
    let mut v = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![cfg.vocab_size, h],
            false,
        ),
        ("model.norm.weight".into(), vec![h], true),
    ];
    if !cfg.tie_word_embeddings {
        v.push(("lm_head.weight".into(), vec![cfg.vocab_size, h], false));
    }
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        v.extend([
            (format!("{p}.input_layernorm.weight"), vec![h], true),
            (
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                true,
            ),
            (format!("{p}.self_attn.q_proj.weight"), vec![h, h], false),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h], false),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h], false),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, h], false),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, h], false),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h], false),
            (format!("{p}.mlp.down_proj.weight"), vec![h, i], false),
        ]);
    }
    v
}

/// Seeded random weights: normal with standard deviation `std` for
/// matrices, ones for norms. On CUDA the device's generator draws them
/// (seeded once); on the CPU a seeded host generator does.
pub fn random_weights(
    cfg: &llama::Config,
    std: f64,
    dtype: DType,
    seed: u64,
    dev: &Device,
) -> Result<HashMap<String, Tensor>> {
    if dev.is_cuda() {
        dev.set_seed(seed)?;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = Normal::new(0f32, std as f32)?;
    let mut out = HashMap::new();
    for (name, shape, norm) in tensor_shapes(cfg) {
        let t = if norm {
            Tensor::ones(shape, dtype, dev)?
        } else if dev.is_cuda() {
            Tensor::randn(0f32, std as f32, shape, dev)?.to_dtype(dtype)?
        } else {
            let n = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
            Tensor::from_vec(data, shape, dev)?.to_dtype(dtype)?
        };
        out.insert(name, t);
    }
    Ok(out)
}
