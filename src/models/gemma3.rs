//! Paged Gemma 3 (text).
//!
//! candle-transformers 0.11.1's `gemma3` with the paged cache: q/k norms,
//! sliding-window layers (all but every `sliding_window_pattern`-th, or
//! `layer_types`) whose rotary base is `rope_local_base_freq`, global layers
//! on `rope_theta` (with optional linear `rope_scaling`, which
//! candle-transformers ignores), and optional softcapping. Scores are scaled
//! by `query_pre_attn_scalar^-0.5` as in Hugging Face's model.

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Activation, VarBuilder};

pub use super::gemma2::LayerType;
use super::gemma2::{run_layers, GemmaAttentionSpec, GemmaDecoderLayer, GemmaTrunk};
use super::limits::{self, DecoderShape};
use super::rotary::RotaryEmbedding;
use super::{check_cache, check_input, PagedKvCache, PagedModel, PagedOptions};
use crate::attention::Attention;
use crate::metadata::AttentionMetadata;

const OP: &str = "gemma3";

fn default_sliding_window_pattern() -> usize {
    6
}

fn default_max_position_embeddings() -> usize {
    32768
}

/// Linear rotary scaling of the global layers: frequencies divided by `factor`.
#[derive(serde::Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    /// Position interpolation factor.
    pub factor: f64,
}

/// Gemma 3 text configuration (`config.json` of `Gemma3ForCausalLM`);
/// candle-transformers' fields plus `layer_types` and `rope_scaling`.
#[derive(serde::Deserialize, Debug, Clone)]
pub struct Config {
    /// Biases on q/k/v/o.
    pub attention_bias: bool,
    /// Elements per head.
    pub head_dim: usize,
    /// MLP activation (`gelu_pytorch_tanh`).
    #[serde(alias = "hidden_act")]
    pub hidden_activation: Activation,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// KV heads.
    pub num_key_value_heads: usize,
    /// RMS norm epsilon (also of the q/k norms).
    pub rms_norm_eps: f64,
    /// Rotary base of the global layers.
    pub rope_theta: f64,
    /// Rotary base of the sliding-window layers.
    pub rope_local_base_freq: f64,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Softcap of the final logits.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Softcap of the attention scores.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Scores are scaled by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: usize,
    /// Window of the sliding layers.
    pub sliding_window: usize,
    /// Every `sliding_window_pattern`-th layer is global.
    #[serde(default = "default_sliding_window_pattern")]
    pub sliding_window_pattern: usize,
    /// Rotary table length.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Per-layer attention type (overrides the pattern).
    #[serde(default)]
    pub layer_types: Option<Vec<LayerType>>,
    /// Linear rotary scaling of the global layers.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
}

impl Config {
    /// The sliding window of layer `i`, if it slides.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let sliding = match &self.layer_types {
            Some(types) => types.get(i) == Some(&LayerType::Sliding),
            None => !(i + 1).is_multiple_of(self.sliding_window_pattern.max(1)),
        };
        sliding.then_some(self.sliding_window)
    }
}

/// A paged Gemma 3.
#[derive(Clone, Debug)]
pub struct Gemma3 {
    trunk: GemmaTrunk,
    layers: Vec<GemmaDecoderLayer>,
    rotary_local: RotaryEmbedding,
    rotary_global: RotaryEmbedding,
}

impl Gemma3 {
    /// Loads a Hugging Face Gemma 3 text checkpoint (`model.*`) from `vb`.
    pub fn load(vb: VarBuilder, cfg: &Config, options: PagedOptions) -> Result<Self> {
        DecoderShape {
            component: OP,
            source: "config.json ",
            hidden_size: ("hidden_size", cfg.hidden_size),
            num_heads: ("num_attention_heads", cfg.num_attention_heads),
            num_kv_heads: ("num_key_value_heads", cfg.num_key_value_heads),
            head_dim: ("head_dim", cfg.head_dim),
            num_layers: ("num_hidden_layers", cfg.num_hidden_layers),
            max_layers: None,
            rope_dim: ("head_dim", cfg.head_dim),
            rms_norm_eps: ("rms_norm_eps", cfg.rms_norm_eps),
            rope_bases: &[
                ("rope_theta", cfg.rope_theta),
                ("rope_local_base_freq", cfg.rope_local_base_freq),
            ],
        }
        .check()?;
        let trunk = GemmaTrunk::load(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.rms_norm_eps,
            cfg.final_logit_softcapping,
            &vb,
        )?;
        let vb_l = vb.pp("model.layers");
        let mut layers = limits::layers_vec(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let spec = GemmaAttentionSpec {
                hidden_size: cfg.hidden_size,
                num_heads: cfg.num_attention_heads,
                num_kv_heads: cfg.num_key_value_heads,
                head_dim: cfg.head_dim,
                bias: cfg.attention_bias,
                query_pre_attn_scalar: cfg.query_pre_attn_scalar,
                softcap: cfg.attn_logit_softcapping,
                sliding_window: cfg.layer_window(i),
                qk_norm_eps: Some(cfg.rms_norm_eps),
            };
            layers.push(GemmaDecoderLayer::load(
                &spec,
                cfg.intermediate_size,
                cfg.hidden_activation,
                cfg.rms_norm_eps,
                options,
                vb_l.pp(i),
            )?);
        }
        let table = |base: f64, factor: f64| {
            let inv: Vec<f32> = RotaryEmbedding::default_inv_freq(cfg.head_dim, base)
                .into_iter()
                .map(|f| (f as f64 / factor) as f32)
                .collect();
            RotaryEmbedding::new(
                &inv,
                cfg.max_position_embeddings,
                false,
                vb.dtype(),
                vb.device(),
            )
        };
        let factor = cfg.rope_scaling.map_or(1.0, |s| s.factor);
        Ok(Self {
            trunk,
            layers,
            rotary_local: table(cfg.rope_local_base_freq, 1.0)?,
            rotary_global: table(cfg.rope_theta, factor)?,
        })
    }
}

impl PagedModel for Gemma3 {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().map(|l| &l.self_attn.attn).collect()
    }

    fn vocab_size(&self) -> usize {
        self.trunk.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.rotary_global.max_positions()
    }

    fn device(&self) -> &Device {
        &self.trunk.device
    }

    fn dtype(&self) -> DType {
        self.trunk.dtype
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> Result<Tensor> {
        check_input(OP, input_ids, metadata, self.trunk.vocab_size)?;
        check_cache(OP, cache, self.layers.len())?;
        let local = self.rotary_local.at(metadata)?;
        let global = self.rotary_global.at(metadata)?;
        let x = self.trunk.embed(input_ids)?;
        let rotary = |layer: &GemmaDecoderLayer| {
            if layer.self_attn.attn.options().sliding_window.is_some() {
                &local
            } else {
                &global
            }
        };
        let normed = run_layers(&self.layers, self.trunk.norm(), x, rotary, cache, metadata)?;
        self.trunk.logits(OP, &normed, rows, metadata)
    }
}
