//! Paged Llama (Llama 2/3, SmolLM2, TinyLlama, ...) from safetensors.
//!
//! candle-transformers 0.11.1's `llama` with its concatenated KV cache and
//! mask tensors replaced by [`Attention`] over a [`PagedKvCache`]: GQA, tied
//! embeddings and Llama 3 rope scaling as candle-transformers supports them.
//! The q/k/v projections are concatenated into one matmul at load time, and
//! so are gate/up (Gemma 2/3 do the same); the layers are the shared
//! [`DecoderStack`]'s. The configuration types are candle-transformers' own.

use std::f32::consts::PI;

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::{Activation, VarBuilder};

pub use candle_transformers::models::llama::{
    Config, Llama3RopeConfig, Llama3RopeType, LlamaConfig, LlamaEosToks,
};

use super::decoder::{DecoderSpec, DecoderStack, RopeSpec, WeightNames, Windows};
use super::limits::DecoderShape;
use super::{PagedKvCache, PagedModel, PagedOptions};
use crate::attention::Attention;
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

/// A paged Llama: embeddings, `num_hidden_layers` decoder layers, final
/// norm and LM head (tied to the embeddings when the config says so), on
/// the shared [`DecoderStack`].
#[derive(Clone, Debug)]
pub struct Llama(DecoderStack);

impl Llama {
    /// Loads the weights of a Hugging Face Llama checkpoint (`model.*`,
    /// `lm_head`) from `vb`; the dtype and device are `vb`'s.
    pub fn load(vb: VarBuilder, cfg: &Config, options: PagedOptions) -> Result<Self> {
        Ok(Self(DecoderStack::load(vb, &spec(cfg)?, options)?))
    }
}

/// The decoder of a Llama config, checked: what [`Llama::load`] builds
/// (and [`TensorParallel`](crate::parallel::TensorParallel) shards).
pub fn spec(cfg: &Config) -> Result<DecoderSpec> {
    if cfg.num_attention_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
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
    let spec = DecoderSpec {
        component: OP,
        names: WeightNames::SEPARATE,
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_layers: cfg.num_hidden_layers,
        num_heads: cfg.num_attention_heads,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim,
        qkv_bias: false,
        o_bias: false,
        qk_norm_eps: None,
        windows: Windows::None,
        rope: RopeSpec {
            inv_freq: inv_freq(cfg),
            long: None,
            max_positions: cfg.max_position_embeddings,
        },
        rms_norm_eps: cfg.rms_norm_eps,
        intermediate_size: cfg.intermediate_size,
        activation: Activation::Silu,
        tie_word_embeddings: cfg.tie_word_embeddings,
    };
    Ok(spec)
}

impl PagedModel for Llama {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.0.attention_layers()
    }

    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }

    fn max_seq_len(&self) -> usize {
        self.0.max_seq_len()
    }

    fn device(&self) -> &Device {
        self.0.device()
    }

    fn dtype(&self) -> DType {
        self.0.dtype()
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> Result<Tensor> {
        self.0.forward(input_ids, metadata, cache, rows)
    }
}
