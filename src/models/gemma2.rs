//! Paged Gemma 2.
//!
//! candle-transformers 0.11.1's `gemma2` with the paged cache, plus what it
//! leaves out: sliding-window layers (even layers by default, or
//! `layer_types`), applied in decodes as well as prefills with Hugging
//! Face's convention (a query at `p` sees keys `> p - window`), and the
//! `query_pre_attn_scalar` score scale. Attention-logit and final-logit
//! softcapping as in candle-transformers.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Activation, Embedding, Linear, VarBuilder};

use super::layers::{softcap, FusedLinear, GatedMlp, GemmaRmsNorm};
use super::limits::{self, DecoderShape};
use super::rotary::{Rotary, RotaryEmbedding};
use super::{check_cache, check_input, select_rows, PagedKvCache, PagedModel, PagedOptions};
use crate::attention::{Attention, AttentionOptions};
use crate::cache::LayerKvCache;
use crate::metadata::AttentionMetadata;
use crate::ops::linear::linear;

const OP: &str = "gemma2";

fn default_max_position_embeddings() -> usize {
    4096
}

/// Whether a layer attends globally or through the sliding window.
#[derive(serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Sliding-window attention.
    #[serde(rename = "sliding_attention")]
    Sliding,
    /// Full causal attention.
    #[serde(rename = "full_attention")]
    Full,
}

/// Gemma 2 configuration (`config.json`); candle-transformers' fields plus
/// the optional `layer_types`.
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
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary base.
    pub rope_theta: f64,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Softcap of the final logits.
    pub final_logit_softcapping: Option<f64>,
    /// Softcap of the attention scores.
    pub attn_logit_softcapping: Option<f64>,
    /// Scores are scaled by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: usize,
    /// Window of the sliding layers (none: every layer is global).
    pub sliding_window: Option<usize>,
    /// Rotary table length.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Per-layer attention type; by default even layers slide.
    #[serde(default)]
    pub layer_types: Option<Vec<LayerType>>,
}

impl Config {
    /// The sliding window of layer `i`, if it slides.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let sliding = match &self.layer_types {
            Some(types) => types.get(i) == Some(&LayerType::Sliding),
            None => i.is_multiple_of(2),
        };
        self.sliding_window.filter(|_| sliding)
    }
}

/// The q/k/v/o projections and the paged attention of one Gemma layer.
#[derive(Clone, Debug)]
pub(crate) struct GemmaAttention {
    /// `q_proj`, `k_proj` and `v_proj` as one matmul.
    pub(crate) qkv_proj: FusedLinear,
    pub(crate) o_proj: Linear,
    /// Gemma 3's per-head norms of q and k (before the rotation).
    pub(crate) qk_norms: Option<(GemmaRmsNorm, GemmaRmsNorm)>,
    pub(crate) attn: Attention,
}

/// Shapes and options of a Gemma attention layer.
pub(crate) struct GemmaAttentionSpec {
    pub(crate) hidden_size: usize,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) bias: bool,
    pub(crate) query_pre_attn_scalar: usize,
    pub(crate) softcap: Option<f64>,
    pub(crate) sliding_window: Option<usize>,
    pub(crate) qk_norm_eps: Option<f64>,
}

impl GemmaAttention {
    pub(crate) fn load(
        s: &GemmaAttentionSpec,
        options: PagedOptions,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (h, kvh, d) = (s.num_heads, s.num_kv_heads, s.head_dim);
        let qk_norms = match s.qk_norm_eps {
            Some(eps) => Some((
                GemmaRmsNorm::new(d, eps, vb.pp("q_norm"))?,
                GemmaRmsNorm::new(d, eps, vb.pp("k_norm"))?,
            )),
            None => None,
        };
        let attn = Attention::new(
            h,
            kvh,
            d,
            (s.query_pre_attn_scalar as f32).powf(-0.5),
            AttentionOptions {
                sliding_window: s.sliding_window,
                softcap: s.softcap.map(|c| c as f32),
                block_size: options.block_size,
                kv_cache_dtype: options.kv_cache_dtype,
                ..Default::default()
            },
        )?;
        let qkv = [("q_proj", h * d), ("k_proj", kvh * d), ("v_proj", kvh * d)];
        Ok(Self {
            qkv_proj: FusedLinear::load(s.hidden_size, &qkv, s.bias, &vb)?,
            o_proj: candle_nn::linear_b(h * d, s.hidden_size, s.bias, vb.pp("o_proj"))?,
            qk_norms,
            attn,
        })
    }

    /// `x` `(num_tokens, hidden)` -> `(num_tokens, hidden)`. On CUDA the
    /// rotation of q and k runs with the cache write (one kernel) after
    /// the q/k norms; elsewhere candle's ops as candle-transformers.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let (h, kvh, d) = (
            self.attn.num_heads(),
            self.attn.num_kv_heads(),
            self.attn.head_size(),
        );
        let n = x.dim(0)?;
        if x.device().is_cuda() {
            let mut qkv = self.qkv_proj.forward_joined(x)?;
            if let Some((q_norm, k_norm)) = &self.qk_norms {
                let q = qkv.narrow(1, 0, h * d)?.reshape((n * h, d))?;
                let k = qkv.narrow(1, h * d, kvh * d)?.reshape((n * kvh, d))?;
                let v = qkv.narrow(1, (h + kvh) * d, kvh * d)?;
                qkv = Tensor::cat(
                    &[
                        &q.apply(q_norm)?.reshape((n, h * d))?,
                        &k.apply(k_norm)?.reshape((n, kvh * d))?,
                        &v,
                    ],
                    1,
                )?;
            }
            let out = self
                .attn
                .forward_rotary_qkv(&qkv, rotary.rows(), cache, metadata)?;
            return linear(&out, self.o_proj.weight(), self.o_proj.bias());
        }
        let [mut q, mut k, v] = self.qkv_proj.forward(x)?;
        if let Some((q_norm, k_norm)) = &self.qk_norms {
            q = q.reshape((n, h, d))?.apply(q_norm)?;
            k = k.reshape((n, kvh, d))?.apply(k_norm)?;
        }
        let q = rotary.apply(&q, h)?;
        let k = rotary.apply(&k, kvh)?;
        let out = self.attn.forward(&q, &k, &v, cache, metadata)?;
        linear(&out, self.o_proj.weight(), self.o_proj.bias())
    }
}

/// A Gemma 2/3 decoder layer: attention and MLP, each with pre- and
/// post-norms.
#[derive(Clone, Debug)]
pub(crate) struct GemmaDecoderLayer {
    pub(crate) self_attn: GemmaAttention,
    mlp: GatedMlp,
    input_layernorm: GemmaRmsNorm,
    post_attention_layernorm: GemmaRmsNorm,
    pre_feedforward_layernorm: GemmaRmsNorm,
    post_feedforward_layernorm: GemmaRmsNorm,
}

impl GemmaDecoderLayer {
    pub(crate) fn load(
        spec: &GemmaAttentionSpec,
        intermediate_size: usize,
        act: Activation,
        eps: f64,
        options: PagedOptions,
        vb: VarBuilder,
    ) -> Result<Self> {
        let hs = spec.hidden_size;
        let norm = |name| GemmaRmsNorm::new(hs, eps, vb.pp(name));
        Ok(Self {
            self_attn: GemmaAttention::load(spec, options, vb.pp("self_attn"))?,
            mlp: GatedMlp::new(hs, intermediate_size, act, vb.pp("mlp"))?,
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
        })
    }

    /// One layer over the residual stream `x` `(num_tokens, hidden)` and
    /// its input norm `normed` (the previous layer's last add ran it):
    /// returns the new stream and `next`'s norm of it (the next layer's
    /// input norm, or the final norm). Each residual add runs with the norm
    /// after it (one kernel on CUDA; candle's ops, in candle-transformers'
    /// order, elsewhere).
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        normed: &Tensor,
        next: &GemmaRmsNorm,
        rotary: &Rotary,
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<(Tensor, Tensor)> {
        let h = self.self_attn.forward(normed, rotary, cache, metadata)?;
        let (x, h) = self
            .pre_feedforward_layernorm
            .add_forward(x, &h.apply(&self.post_attention_layernorm)?)?;
        let h = h
            .apply(&self.mlp)?
            .apply(&self.post_feedforward_layernorm)?;
        next.add_forward(&x, &h)
    }

    /// The layer's input norm of `x` (the first layer's; later layers get
    /// theirs from the previous layer's last add).
    pub(crate) fn input_norm(&self, x: &Tensor) -> Result<Tensor> {
        x.apply(&self.input_layernorm)
    }
}

/// Runs `layers` over the embeddings `x`, each layer on its `rotary(layer)`
/// rows and its cache layer; returns the final norm of the last stream.
pub(crate) fn run_layers<'r>(
    layers: &[GemmaDecoderLayer],
    final_norm: &GemmaRmsNorm,
    x: Tensor,
    rotary: impl Fn(&GemmaDecoderLayer) -> &'r Rotary,
    cache: &PagedKvCache,
    metadata: &AttentionMetadata,
) -> Result<Tensor> {
    let Some(first) = layers.first() else {
        return x.apply(final_norm);
    };
    let mut normed = first.input_norm(&x)?;
    let mut x = x;
    for (i, layer) in layers.iter().enumerate() {
        let next = layers.get(i + 1).map_or(final_norm, |l| &l.input_layernorm);
        (x, normed) = layer.forward(&x, &normed, next, rotary(layer), cache.layer(i)?, metadata)?;
    }
    Ok(normed)
}

/// Embeddings scaled by `sqrt(hidden_size)`, the final norm and the tied LM
/// head with optional final softcapping: what Gemma 2 and 3 share around
/// their decoder layers.
#[derive(Clone, Debug)]
pub(crate) struct GemmaTrunk {
    embed_tokens: Embedding,
    norm: GemmaRmsNorm,
    lm_head: Linear,
    hidden_size: usize,
    final_logit_softcapping: Option<f64>,
    pub(crate) vocab_size: usize,
    pub(crate) device: Device,
    pub(crate) dtype: DType,
}

impl GemmaTrunk {
    pub(crate) fn load(
        vocab_size: usize,
        hidden_size: usize,
        eps: f64,
        final_logit_softcapping: Option<f64>,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let vb_m = vb.pp("model");
        let embed_tokens = candle_nn::embedding(vocab_size, hidden_size, vb_m.pp("embed_tokens"))?;
        let lm_head = Linear::new(embed_tokens.embeddings().clone(), None);
        Ok(Self {
            embed_tokens,
            norm: GemmaRmsNorm::new(hidden_size, eps, vb_m.pp("norm"))?,
            lm_head,
            hidden_size,
            final_logit_softcapping,
            vocab_size,
            device: vb.device().clone(),
            dtype: vb.dtype(),
        })
    }

    /// `(num_tokens,)` u32 -> `(num_tokens, hidden)`.
    pub(crate) fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.embed_tokens.forward(input_ids)? * (self.hidden_size as f64).sqrt()
    }

    /// The final norm, run by the last layer's add ([`run_layers`]).
    pub(crate) fn norm(&self) -> &GemmaRmsNorm {
        &self.norm
    }

    /// The final norm's output `(num_tokens, hidden)` -> logits
    /// `(rows.len(), vocab)` f32.
    pub(crate) fn logits(
        &self,
        component: &str,
        normed: &Tensor,
        rows: &[usize],
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let logits = linear(
            &select_rows(component, normed, rows, metadata)?,
            self.lm_head.weight(),
            self.lm_head.bias(),
        )?;
        let logits = match self.final_logit_softcapping {
            Some(c) => softcap(&logits, c)?,
            None => logits,
        };
        logits.to_dtype(DType::F32)
    }
}

/// A paged Gemma 2.
#[derive(Clone, Debug)]
pub struct Gemma2 {
    trunk: GemmaTrunk,
    layers: Vec<GemmaDecoderLayer>,
    rotary: RotaryEmbedding,
}

impl Gemma2 {
    /// Loads a Hugging Face Gemma 2 checkpoint (`model.*`) from `vb`.
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
            rope_bases: &[("rope_theta", cfg.rope_theta)],
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
                qk_norm_eps: None,
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
        let rotary = RotaryEmbedding::new(
            &RotaryEmbedding::default_inv_freq(cfg.head_dim, cfg.rope_theta),
            cfg.max_position_embeddings,
            false,
            vb.dtype(),
            vb.device(),
        )?;
        Ok(Self {
            trunk,
            layers,
            rotary,
        })
    }
}

impl PagedModel for Gemma2 {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().map(|l| &l.self_attn.attn).collect()
    }

    fn vocab_size(&self) -> usize {
        self.trunk.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.rotary.max_positions()
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
        let rotary = self.rotary.at(metadata)?;
        let x = self.trunk.embed(input_ids)?;
        let normed = run_layers(
            &self.layers,
            self.trunk.norm(),
            x,
            |_| &rotary,
            cache,
            metadata,
        )?;
        self.trunk.logits(OP, &normed, rows, metadata)
    }
}
