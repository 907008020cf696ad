//! Paged Phi-3 from safetensors, on the shared [`DecoderStack`].
//!
//! candle-transformers 0.11.1's `phi3`: the checkpoint's joined `qkv_proj`
//! and `gate_up_proj` loaded as they are, a partial rotary width
//! (`partial_rotary_factor`), and `su` / `longrope` scaling as
//! candle-transformers applies it: positions below
//! `original_max_position_embeddings` rotate by `short_factor`, the others
//! by `long_factor` (all by `short_factor` without that key), with no
//! attention scaling factor. `sliding_window` applies to every layer as in
//! Hugging Face's model (candle-transformers ignores it).

use candle_core::{bail, Result};
use candle_nn::{Activation, VarBuilder};

use super::decoder::{self, DecoderSpec, DecoderStack, RopeSpec, WeightNames, Windows};
use super::limits::DecoderShape;
use super::PagedOptions;

const OP: &str = "phi3";

/// A paged Phi-3.
pub type Phi3 = DecoderStack;

/// `rope_scaling` of the long-context checkpoints.
#[derive(serde::Deserialize, Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// Per-frequency divisors of the short positions, `rotary_dim / 2`.
    pub short_factor: Vec<f32>,
    /// Per-frequency divisors of the long positions, `rotary_dim / 2`.
    pub long_factor: Vec<f32>,
    /// `su` or `longrope`.
    #[serde(rename = "type", alias = "rope_type")]
    pub kind: String,
}

/// Phi-3 configuration (`config.json`, `model_type` `phi3`).
#[derive(serde::Deserialize, Debug, Clone)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// MLP activation.
    #[serde(default = "decoder::default_hidden_act")]
    pub hidden_act: Activation,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (`num_attention_heads` when absent).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary base.
    #[serde(default = "decoder::default_rope_theta")]
    pub rope_theta: f64,
    /// Long-context rotary scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Rotary table length.
    pub max_position_embeddings: usize,
    /// Where the long factors start.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// The rotated share of each head.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Window of every layer (`null`: global attention).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// The LM head is the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// Loads a Hugging Face Phi-3 checkpoint (`model.*`, `lm_head` unless
/// tied) from `vb`; the dtype and device are `vb`'s.
pub fn load(vb: VarBuilder, cfg: &Config, options: PagedOptions) -> Result<Phi3> {
    DecoderStack::load(vb, &spec(cfg)?, options)
}

/// The decoder of a config, checked: what [`load`] builds (and
/// [`TensorParallel`](crate::parallel::TensorParallel) shards).
pub fn spec(cfg: &Config) -> Result<DecoderSpec> {
    let heads = cfg.num_attention_heads;
    let head_dim = decoder::head_dim_of(OP, cfg.hidden_size, heads)?;
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    let rot = cfg
        .partial_rotary_factor
        .map_or(head_dim, |f| (f * head_dim as f64) as usize);
    DecoderShape {
        component: OP,
        source: "config.json ",
        hidden_size: ("hidden_size", cfg.hidden_size),
        num_heads: ("num_attention_heads", heads),
        num_kv_heads: ("num_key_value_heads", kv_heads),
        head_dim: ("hidden_size / num_attention_heads", head_dim),
        num_layers: ("num_hidden_layers", cfg.num_hidden_layers),
        max_layers: None,
        rope_dim: ("partial_rotary_factor x head size", rot),
        rms_norm_eps: ("rms_norm_eps", cfg.rms_norm_eps),
        rope_bases: &[("rope_theta", cfg.rope_theta)],
    }
    .check()?;
    let freqs = |factors: &[f32]| -> Vec<f32> {
        (0..rot)
            .step_by(2)
            .zip(factors)
            .map(|(i, &f)| f / cfg.rope_theta.powf(i as f64 / rot as f64) as f32)
            .collect()
    };
    let (inv_freq, long) = match &cfg.rope_scaling {
        None => (freqs(&vec![1.0; rot / 2]), None),
        Some(s) => {
            if s.kind != "su" && s.kind != "longrope" {
                bail!(
                    "{OP}: config.json rope_scaling.type {} is not supported (su, longrope)",
                    s.kind
                );
            }
            for (key, f) in [
                ("short_factor", &s.short_factor),
                ("long_factor", &s.long_factor),
            ] {
                if f.len() != rot / 2 || f.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                    bail!("{OP}: config.json rope_scaling.{key} must be {} finite positive factors (rotary width / 2), got {f:?}", rot / 2);
                }
            }
            let long = cfg
                .original_max_position_embeddings
                .map(|from| (freqs(&s.long_factor), from));
            (freqs(&s.short_factor), long)
        }
    };
    let spec = DecoderSpec {
        component: OP,
        names: WeightNames::JOINED,
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_layers: cfg.num_hidden_layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        qkv_bias: false,
        o_bias: false,
        qk_norm_eps: None,
        windows: cfg.sliding_window.map_or(Windows::None, Windows::All),
        rope: RopeSpec {
            inv_freq,
            long,
            max_positions: cfg.max_position_embeddings,
        },
        rms_norm_eps: cfg.rms_norm_eps,
        intermediate_size: cfg.intermediate_size,
        activation: cfg.hidden_act,
        tie_word_embeddings: cfg.tie_word_embeddings,
    };
    Ok(spec)
}
