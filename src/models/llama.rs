//! Paged Llama (Llama 2/3, SmolLM2, TinyLlama, ...) from safetensors.
//!
//! candle-transformers 0.11.1's `llama` with its concatenated KV cache and
//! mask tensors replaced by [`Attention`] over a [`PagedKvCache`]: GQA, tied
//! embeddings and Llama 3 rope scaling as candle-transformers supports them.
//! The q/k/v projections are concatenated into one matmul at load time, and
//! so are gate/up (Gemma 2/3 do the same).
//! The configuration types are candle-transformers' own.

use std::f32::consts::PI;

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::{Activation, Embedding, Linear, Module, VarBuilder};

pub use candle_transformers::models::llama::{
    Config, Llama3RopeConfig, Llama3RopeType, LlamaConfig, LlamaEosToks,
};

use super::layers::{FusedLinear, FusedRmsNorm, GatedMlp};
use super::limits::{self, DecoderShape};
use super::rotary::{Rotary, RotaryEmbedding};
use super::{check_cache, check_input, select_rows, PagedKvCache, PagedModel, PagedOptions};
use crate::attention::{Attention, AttentionOptions};
use crate::metadata::AttentionMetadata;

const OP: &str = "llama";

/// Llama's inverse rotary frequencies (f32, as candle-transformers computes
/// them), with Llama 3 rope scaling when the config asks for it.
pub fn inv_freq(cfg: &Config) -> Vec<f32> {
    let head_dim = cfg.hidden_size / cfg.num_attention_heads;
    let base: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / head_dim as f32))
        .collect();
    let scaling = match &cfg.rope_scaling {
        Some(s) if matches!(s.rope_type, Llama3RopeType::Llama3) => s,
        _ => return base,
    };
    let low_wavelen = scaling.original_max_position_embeddings as f32 / scaling.low_freq_factor;
    let high_wavelen = scaling.original_max_position_embeddings as f32 / scaling.high_freq_factor;
    base.into_iter()
        .map(|freq| {
            let wavelen = 2. * PI / freq;
            if wavelen < high_wavelen {
                freq
            } else if wavelen > low_wavelen {
                freq / scaling.factor
            } else {
                let smooth = (scaling.original_max_position_embeddings as f32 / wavelen
                    - scaling.low_freq_factor)
                    / (scaling.high_freq_factor - scaling.low_freq_factor);
                (1. - smooth) * freq / scaling.factor + smooth * freq
            }
        })
        .collect()
}

#[derive(Clone, Debug)]
struct SelfAttention {
    /// `q_proj`, `k_proj` and `v_proj` as one matmul.
    qkv_proj: FusedLinear,
    o_proj: Linear,
    attn: Attention,
}

impl SelfAttention {
    fn load(cfg: &Config, options: PagedOptions, vb: VarBuilder) -> Result<Self> {
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let head_dim = cfg.hidden_size / heads;
        let attn = Attention::new(
            heads,
            kv_heads,
            head_dim,
            1.0 / (head_dim as f32).sqrt(),
            AttentionOptions {
                block_size: options.block_size,
                kv_cache_dtype: options.kv_cache_dtype,
                ..Default::default()
            },
        )?;
        let qkv = [
            ("q_proj", heads * head_dim),
            ("k_proj", kv_heads * head_dim),
            ("v_proj", kv_heads * head_dim),
        ];
        Ok(Self {
            qkv_proj: FusedLinear::load(cfg.hidden_size, &qkv, false, &vb)?,
            o_proj: candle_nn::linear_no_bias(heads * head_dim, cfg.hidden_size, vb.pp("o_proj"))?,
            attn,
        })
    }

    /// `x` `(num_tokens, hidden)` -> `(num_tokens, hidden)`.
    fn forward(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        cache: &crate::cache::LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let qkv = self.qkv_proj.forward_joined(x)?;
        self.attn
            .forward_rotary_qkv(&qkv, rotary.rows(), cache, metadata)?
            .apply(&self.o_proj)
    }
}

#[derive(Clone, Debug)]
struct DecoderLayer {
    input_layernorm: FusedRmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: FusedRmsNorm,
    mlp: GatedMlp,
}

/// A paged Llama: embeddings, `num_hidden_layers` decoder layers, final
/// norm and LM head (tied to the embeddings when the config says so).
#[derive(Clone, Debug)]
pub struct Llama {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: FusedRmsNorm,
    lm_head: Linear,
    rotary: RotaryEmbedding,
    vocab_size: usize,
    device: Device,
    dtype: DType,
}

impl Llama {
    /// Loads the weights of a Hugging Face Llama checkpoint (`model.*`,
    /// `lm_head`) from `vb`; the dtype and device are `vb`'s.
    pub fn load(vb: VarBuilder, cfg: &Config, options: PagedOptions) -> Result<Self> {
        if cfg.num_attention_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads)
        {
            bail!(
                "{OP}: hidden_size {} is not a multiple of num_attention_heads {}",
                cfg.hidden_size,
                cfg.num_attention_heads
            );
        }
        let head_dim = cfg.hidden_size / cfg.num_attention_heads;
        DecoderShape {
            component: OP,
            source: "config.json ",
            hidden_size: ("hidden_size", cfg.hidden_size),
            num_heads: ("num_attention_heads", cfg.num_attention_heads),
            num_kv_heads: ("num_key_value_heads", cfg.num_key_value_heads),
            head_dim: ("hidden_size / num_attention_heads", head_dim),
            num_layers: ("num_hidden_layers", cfg.num_hidden_layers),
            max_layers: None,
            rope_dim: ("hidden_size / num_attention_heads", head_dim),
            rms_norm_eps: ("rms_norm_eps", cfg.rms_norm_eps),
            rope_bases: &[("rope_theta", cfg.rope_theta as f64)],
        }
        .check()?;
        if let Some(s) = &cfg.rope_scaling {
            let positive = |v: f32| v.is_finite() && v > 0.0;
            if !(positive(s.factor)
                && positive(s.low_freq_factor)
                && positive(s.high_freq_factor)
                && s.high_freq_factor != s.low_freq_factor
                && s.original_max_position_embeddings > 0)
            {
                bail!(
                    "{OP}: config.json rope_scaling needs a finite positive factor, low_freq_factor and high_freq_factor (the last two different) and original_max_position_embeddings > 0, got {s:?}"
                );
            }
        }
        let vb_m = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb_m.pp("embed_tokens"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_tokens.embeddings().clone(), None)
        } else {
            candle_nn::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
        };
        let norm = FusedRmsNorm::load(cfg.hidden_size, cfg.rms_norm_eps, vb_m.pp("norm"))?;
        let mut layers = limits::layers_vec(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let vb_l = vb_m.pp(format!("layers.{i}"));
            let rms = |name| FusedRmsNorm::load(cfg.hidden_size, cfg.rms_norm_eps, vb_l.pp(name));
            layers.push(DecoderLayer {
                input_layernorm: rms("input_layernorm")?,
                self_attn: SelfAttention::load(cfg, options, vb_l.pp("self_attn"))?,
                post_attention_layernorm: rms("post_attention_layernorm")?,
                mlp: GatedMlp::new(
                    cfg.hidden_size,
                    cfg.intermediate_size,
                    Activation::Silu,
                    vb_l.pp("mlp"),
                )?,
            });
        }
        let rotary = RotaryEmbedding::new(
            &inv_freq(cfg),
            cfg.max_position_embeddings,
            false,
            vb.dtype(),
            vb.device(),
        )?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
            vocab_size: cfg.vocab_size,
            device: vb.device().clone(),
            dtype: vb.dtype(),
        })
    }
}

impl PagedModel for Llama {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().map(|l| &l.self_attn.attn).collect()
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.rotary.max_positions()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> Result<Tensor> {
        check_input(OP, input_ids, metadata, self.vocab_size)?;
        check_cache(OP, cache, self.layers.len())?;
        let rotary = self.rotary.at(metadata)?;
        let mut x = self.embed_tokens.forward(input_ids)?;
        let Some(first) = self.layers.first() else {
            bail!("{OP}: the model has no layers");
        };
        // Each residual add runs with the norm after it (one kernel on CUDA);
        // the last one with the output norm, over every row (the norm is
        // per row, so selecting the rows after it changes nothing).
        let mut normed = first.input_layernorm.forward(&x)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer
                .self_attn
                .forward(&normed, &rotary, cache.layer(i)?, metadata)?;
            (x, normed) = layer.post_attention_layernorm.add_forward(&x, &h)?;
            let h = normed.apply(&layer.mlp)?;
            let next = self
                .layers
                .get(i + 1)
                .map_or(&self.norm, |l| &l.input_layernorm);
            (x, normed) = next.add_forward(&x, &h)?;
        }
        select_rows(OP, &normed, rows)?
            .apply(&self.lm_head)?
            .to_dtype(DType::F32)
    }
}
