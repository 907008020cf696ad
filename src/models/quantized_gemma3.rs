//! Paged Gemma 3 (text) from a GGUF file, with quantized weights (`QMatMul`).
//!
//! The GGUF layout of llama.cpp's `gemma3` architecture (the tensor names
//! and metadata keys candle-transformers 0.11.1's `quantized_gemma3` reads),
//! run over the paged cache with Hugging Face transformers' Gemma 3
//! semantics:
//!
//! * sliding-window layers (all but every `sliding_window_pattern`-th,
//!   6 by default) keep keys with `query_pos - key_pos < sliding_window`, in
//!   prefills, prefill chunks and decodes alike, and run on the window-group
//!   caches when the [`PagedKvCache`] has them; the other layers attend
//!   globally;
//! * per-head RMS norms of q and k before the rotation; rotary embeddings
//!   over halves (`rope`, not `rope_i`) with base `rope.local_freq_base`
//!   (10000) in the sliding layers and `rope.freq_base` (1e6), divided by a
//!   linear `rope.scaling.factor` when there is one, in the global layers;
//! * the gated MLP `down(gelu_tanh(gate(x)) * up(x))`;
//! * embeddings scaled by `sqrt(hidden_size)`, pre- and post-norms around
//!   attention and MLP, a final norm and the (tied) output projection.
//!
//! candle-transformers' model differs in four places, all of which this
//! module follows Hugging Face on (see `docs/gemma3.md`): it uses SiLU in the
//! MLP, its prefill window keeps `query_pos - key_pos <= w`, its decodes
//! ignore the window, and it ignores `rope.scaling.factor`.
//!
//! GGUF norm weights already hold Gemma's `1 + weight`, so the norms
//! multiply by the stored weight.
//!
//! Activations are f32 by default, as in candle-transformers;
//! [`QuantizedGemma3::from_gguf_with_dtype`] runs them in bf16 as Hugging
//! Face runs the model in bf16 (f16 overflows its residual stream): the
//! residual stream, the matmul inputs, the rotary rows, the attention and
//! the KV cache (unless fp8) in bf16; every RMS norm computed in f32 with
//! f32 weights (the stored `1 + weight` would lose its low bits in bf16)
//! and its result cast back; the embedding table scaled by
//! `sqrt(hidden_size)` in f32 before the cast (one rounding instead of
//! two); f32 logits.
//!
//! Shapes, for `n` batch tokens, hidden size `H`, `h` query heads and `kvh`
//! KV heads of `d` elements, MLP width `I`: `token_embd` `(vocab, H)`;
//! `attn_q` `(h * d, H)`, `attn_k`/`attn_v` `(kvh * d, H)`, `attn_output`
//! `(H, h * d)`; `attn_q_norm`/`attn_k_norm` `(d,)`; `ffn_gate`/`ffn_up`
//! `(I, H)`, `ffn_down` `(H, I)`; the four layer norms and `output_norm`
//! `(H,)`. Activations are `(n, H)` in the model's dtype.

use std::io::{Read, Seek};

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{bail, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, RmsNorm};

use super::gguf::{check_activation_dtype, lm_head, GgufWeights};
use super::layers::QProjections;
use super::limits::{self, DecoderShape};
use super::rotary::{Rotary, RotaryEmbedding};
use super::{check_cache, check_input, select_rows, PagedKvCache, PagedModel, PagedOptions};
use crate::attention::{Attention, AttentionOptions};
use crate::cache::LayerKvCache;
use crate::metadata::AttentionMetadata;

const OP: &str = "quantized-gemma3";

/// The context length of a GGUF without `gemma3.context_length`: the
/// rotary table length of candle-transformers' `quantized_gemma3`.
pub const DEFAULT_CONTEXT_LENGTH: usize = 131072;
/// Every this many layers one is global when the GGUF does not say
/// (llama.cpp and candle-transformers hard-code it for Gemma 3).
pub const DEFAULT_SLIDING_WINDOW_PATTERN: usize = 6;
/// Rotary base of the global layers without `gemma3.rope.freq_base`.
pub const DEFAULT_ROPE_FREQ_BASE: f32 = 1_000_000.;
/// Rotary base of the sliding layers without `gemma3.rope.local_freq_base`.
pub const DEFAULT_ROPE_LOCAL_FREQ_BASE: f32 = 10_000.;

/// The hyper-parameters read from the GGUF metadata (`gemma3.*` keys).
#[derive(Clone, Debug, PartialEq)]
pub struct GgufGemma3Params {
    /// Decoder layers (`gemma3.block_count`).
    pub num_layers: usize,
    /// Query heads (`gemma3.attention.head_count`).
    pub num_heads: usize,
    /// KV heads (`gemma3.attention.head_count_kv`).
    pub num_kv_heads: usize,
    /// Model width (`gemma3.embedding_length`).
    pub hidden_size: usize,
    /// Elements per head (`gemma3.attention.key_length`, equal to
    /// `value_length`).
    pub head_dim: usize,
    /// RMS norm epsilon (`gemma3.attention.layer_norm_rms_epsilon`), also
    /// of the q/k norms.
    pub rms_norm_eps: f64,
    /// Window of the sliding layers (`gemma3.attention.sliding_window`).
    pub sliding_window: usize,
    /// Every `sliding_window_pattern`-th layer is global
    /// (`gemma3.attention.sliding_window_type` as candle-transformers reads
    /// it, default [`DEFAULT_SLIDING_WINDOW_PATTERN`]).
    pub sliding_window_pattern: usize,
    /// Rotary base of the global layers (`gemma3.rope.freq_base`).
    pub rope_freq_base: f32,
    /// Rotary base of the sliding layers (`gemma3.rope.local_freq_base`).
    pub rope_local_freq_base: f32,
    /// Linear position interpolation of the global layers
    /// (`gemma3.rope.scaling.factor` with `rope.scaling.type` linear or
    /// absent): their frequencies are divided by it.
    pub rope_scaling_factor: Option<f32>,
    /// Scores are scaled by `query_pre_attn_scalar^-0.5`: the head size, or
    /// `hidden_size / num_heads` for the 62-layer (27B) model, as llama.cpp
    /// derives it (GGUF has no key for it).
    pub query_pre_attn_scalar: usize,
    /// Context length the model was trained for (`gemma3.context_length`),
    /// if given; the model's [`max_seq_len`](PagedModel::max_seq_len), or
    /// [`DEFAULT_CONTEXT_LENGTH`] without it.
    pub context_length: Option<usize>,
}

impl GgufGemma3Params {
    /// Reads the parameters; fails naming a missing or invalid key, or an
    /// architecture other than `gemma3`.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let get = |key: &str| match ct.metadata.get(key) {
            Some(v) => Ok(v),
            None => bail!("{OP}: GGUF metadata has no {key}"),
        };
        let arch = get("general.architecture")?.to_string()?;
        if arch != "gemma3" {
            bail!("{OP}: GGUF architecture must be gemma3, got {arch}");
        }
        let count = |key: &str| -> Result<usize> {
            let v = get(&format!("gemma3.{key}"))?;
            match v.to_u64().ok().and_then(|n| usize::try_from(n).ok()) {
                Some(n) if n > 0 && n <= u32::MAX as usize => Ok(n),
                _ => bail!("{OP}: GGUF gemma3.{key} must be in 1..=u32::MAX, got {v:?}"),
            }
        };
        let optional_count = |key: &str| -> Result<Option<usize>> {
            match ct.metadata.contains_key(&format!("gemma3.{key}")) {
                true => count(key).map(Some),
                false => Ok(None),
            }
        };
        let float = |key: &str, default: f32| -> Result<f32> {
            match ct.metadata.get(&format!("gemma3.{key}")) {
                None => Ok(default),
                Some(v) => match v.to_f32() {
                    Ok(f) if f.is_finite() && f > 0.0 => Ok(f),
                    _ => bail!("{OP}: GGUF gemma3.{key} must be a positive f32, got {v:?}"),
                },
            }
        };
        let num_heads = count("attention.head_count")?;
        let num_kv_heads = count("attention.head_count_kv")?;
        let hidden_size = count("embedding_length")?;
        let num_layers = count("block_count")?;
        let head_dim = count("attention.key_length")?;
        let value_length = count("attention.value_length")?;
        if value_length != head_dim {
            bail!("{OP}: key_length {head_dim} and value_length {value_length} must be equal");
        }
        let scaling_type = match ct.metadata.get("gemma3.rope.scaling.type") {
            Some(t) => Some(t.to_string()?.as_str()),
            None => None,
        };
        let rope_scaling_factor = match scaling_type {
            Some("none") => None,
            None | Some("linear") => match ct.metadata.contains_key("gemma3.rope.scaling.factor") {
                true => Some(float("rope.scaling.factor", 1.0)?).filter(|&f| f != 1.0),
                false => None,
            },
            Some(other) => bail!("{OP}: only linear rope scaling is supported, got {other}"),
        };
        let eps = get("gemma3.attention.layer_norm_rms_epsilon")?;
        let rms_norm_eps = match eps.to_f32() {
            Ok(e) if e.is_finite() && e > 0.0 => e as f64,
            _ => bail!(
                "{OP}: GGUF gemma3.attention.layer_norm_rms_epsilon must be a positive f32, got {eps:?}"
            ),
        };
        let p = Self {
            num_layers,
            num_heads,
            num_kv_heads,
            hidden_size,
            head_dim,
            rms_norm_eps,
            sliding_window: count("attention.sliding_window")?,
            sliding_window_pattern: optional_count("attention.sliding_window_type")?
                .unwrap_or(DEFAULT_SLIDING_WINDOW_PATTERN),
            rope_freq_base: float("rope.freq_base", DEFAULT_ROPE_FREQ_BASE)?,
            rope_local_freq_base: float("rope.local_freq_base", DEFAULT_ROPE_LOCAL_FREQ_BASE)?,
            rope_scaling_factor,
            query_pre_attn_scalar: if num_layers == 62 {
                hidden_size / num_heads
            } else {
                head_dim
            },
            context_length: optional_count("context_length")?,
        };
        DecoderShape {
            component: OP,
            source: "GGUF gemma3.",
            hidden_size: ("embedding_length", p.hidden_size),
            num_heads: ("attention.head_count", p.num_heads),
            num_kv_heads: ("attention.head_count_kv", p.num_kv_heads),
            head_dim: ("attention.key_length", p.head_dim),
            num_layers: ("block_count", p.num_layers),
            max_layers: None,
            rope_dim: ("attention.key_length", p.head_dim),
            rms_norm_eps: ("attention.layer_norm_rms_epsilon", p.rms_norm_eps),
            rope_bases: &[
                ("rope.freq_base", p.rope_freq_base as f64),
                ("rope.local_freq_base", p.rope_local_freq_base as f64),
            ],
        }
        .check()?;
        Ok(p)
    }

    /// The sliding window of layer `i`, if it slides: all layers but every
    /// `sliding_window_pattern`-th one (layers 5, 11, 17, ... are global).
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let global = (i + 1).is_multiple_of(self.sliding_window_pattern);
        (!global).then_some(self.sliding_window)
    }
}

/// An RMS norm computed in f32 (its weight `(dim,)` f32) whatever the
/// input's dtype, the result cast to `dtype`: Hugging Face's
/// `Gemma3RMSNorm`, which normalizes and scales by `1 + weight` in f32.
#[derive(Clone, Debug)]
struct F32RmsNorm {
    norm: RmsNorm,
    dtype: DType,
    /// `(dim,)` the stored weight minus 1, f32 and in `dtype`: the CUDA
    /// kernels add the 1 back in f32 (a 16-bit dtype then rounds `w`,
    /// not `1 + w`).
    raw_f32: Tensor,
    raw: Tensor,
    eps: f32,
}

impl F32RmsNorm {
    /// A norm of the stored `weight` `(dim,)` f32 (`1 + w`), results in
    /// `dtype`.
    fn new(weight: Tensor, eps: f64, dtype: DType) -> Result<Self> {
        let raw_f32 = (&weight - 1.0)?;
        Ok(Self {
            raw: raw_f32.to_dtype(dtype)?,
            raw_f32,
            norm: RmsNorm::new(weight, eps),
            dtype,
            eps: eps as f32,
        })
    }

    /// On CUDA: the norm of `x` `(..., dim)` in x's dtype (f32, or the
    /// activation dtype), computed in f32; one kernel.
    fn fused(&self, x: &Tensor) -> Result<Tensor> {
        let w = if x.dtype() == DType::F32 {
            &self.raw_f32
        } else {
            &self.raw
        };
        crate::rms_norm(x, w, self.eps, 1.0)
    }

    /// On CUDA: `(x + delta, norm(x + delta))` for the residual stream
    /// `x` `(n, dim)` in the activation dtype and `delta` in it or f32;
    /// one kernel.
    fn fused_add(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor)> {
        crate::add_rms_norm(x, delta, &self.raw, self.eps, 1.0)
    }
}

impl Module for F32RmsNorm {
    /// `x` `(..., dim)` f32, bf16 or f16 -> the same shape in `dtype`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.to_dtype(DType::F32)?
            .apply(&self.norm)?
            .to_dtype(self.dtype)
    }
}

#[derive(Clone, Debug)]
struct Layer {
    attn_norm: F32RmsNorm,
    /// `attn_q`, `attn_k`, `attn_v`.
    wqkv: QProjections,
    /// `attn_q_norm`, `attn_k_norm`: over each head's `d` elements.
    q_norm: F32RmsNorm,
    k_norm: F32RmsNorm,
    wo: QMatMul,
    attn: Attention,
    post_attention_norm: F32RmsNorm,
    ffn_norm: F32RmsNorm,
    /// `ffn_gate`, `ffn_up`.
    w_gate_up: QProjections,
    w_down: QMatMul,
    post_ffw_norm: F32RmsNorm,
}

impl Layer {
    /// `x` `(n, H)` (normed, in the activation dtype) -> `(n, H)` (in the
    /// dtype the quantized matmul returns: the post-norm takes any).
    fn attention(
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
        let [q, k, v] = self.wqkv.forward(x)?;
        // The norms return the activation dtype; v is cast to it (quantized
        // matmuls of more than 8 rows return f32 whatever their input).
        let q = q.reshape((n, h, d))?.apply(&self.q_norm)?;
        let k = k.reshape((n, kvh, d))?.apply(&self.k_norm)?;
        let v = v.to_dtype(x.dtype())?;
        let q = rotary.apply(&q, h)?;
        let k = rotary.apply(&k, kvh)?;
        let y = self.attn.forward(&q, &k, &v, cache, metadata)?;
        self.wo.forward(&y)
    }

    /// `x` `(n, H)` (normed, in the activation dtype) -> `(n, H)` (in the
    /// dtype the quantized matmul returns).
    fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = self.w_gate_up.forward(x)?.map(|t| t.to_dtype(x.dtype()));
        self.w_down.forward(&(gate?.gelu()? * up?)?)
    }

    /// The CUDA path of [`forward`](Self::forward): the stream `x` and
    /// its input norm `normed` `(n, H)` -> the new stream and `next`'s norm
    /// of it. The q/k norms, each residual add with the norm after it, the
    /// rotation with the cache write and the gated activation run as one
    /// kernel each.
    fn forward_fused(
        &self,
        x: &Tensor,
        normed: &Tensor,
        next: &F32RmsNorm,
        rotary: &Rotary,
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<(Tensor, Tensor)> {
        let (h, kvh, d) = (
            self.attn.num_heads(),
            self.attn.num_kv_heads(),
            self.attn.head_size(),
        );
        let n = normed.dim(0)?;
        // In the matmul's output dtype (f32 past 8 rows) throughout: the
        // fused rotation takes f32 q/k/v and rounds once.
        let qkv = self.wqkv.forward_joined(normed)?;
        let q = qkv.narrow(1, 0, h * d)?.reshape((n * h, d))?;
        let k = qkv.narrow(1, h * d, kvh * d)?.reshape((n * kvh, d))?;
        let v = qkv.narrow(1, (h + kvh) * d, kvh * d)?;
        let qkv = Tensor::cat(
            &[
                &self.q_norm.fused(&q)?.reshape((n, h * d))?,
                &self.k_norm.fused(&k)?.reshape((n, kvh * d))?,
                &v,
            ],
            1,
        )?;
        let y = self
            .attn
            .forward_rotary_qkv(&qkv, rotary.rows(), cache, metadata)?;
        let a = self.wo.forward(&y)?;
        let (x, h) = self
            .ffn_norm
            .fused_add(x, &self.post_attention_norm.fused(&a)?)?;
        let gate_up = self.w_gate_up.forward_joined(&h)?;
        let act = crate::gated_activation(&gate_up, crate::GatedActivation::GeluTanh, x.dtype())?;
        let m = self.w_down.forward(&act)?;
        next.fused_add(&x, &self.post_ffw_norm.fused(&m)?)
    }

    /// `x` `(n, H)` -> `(n, H)`, in the activation dtype.
    fn forward(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let h = self.attention(&x.apply(&self.attn_norm)?, rotary, cache, metadata)?;
        let x = (x + h.apply(&self.post_attention_norm)?)?;
        let h = self
            .mlp(&x.apply(&self.ffn_norm)?)?
            .apply(&self.post_ffw_norm)?;
        x + h
    }
}

/// A paged Gemma 3 with GGUF (quantized) weights; activations are f32, or
/// bf16 ([`QuantizedGemma3::from_gguf_with_dtype`]).
#[derive(Clone, Debug)]
pub struct QuantizedGemma3 {
    dtype: DType,
    tok_embeddings: Embedding,
    /// `sqrt(hidden_size)` when the lookup table is not pre-scaled (it is
    /// shared with the tied output projection).
    embed_scale: Option<f64>,
    layers: Vec<Layer>,
    norm: F32RmsNorm,
    output: QMatMul,
    rotary_local: RotaryEmbedding,
    rotary_global: RotaryEmbedding,
    params: GgufGemma3Params,
    vocab_size: usize,
    device: Device,
}

impl QuantizedGemma3 {
    /// Loads the model from GGUF content `ct` read from `reader`.
    ///
    /// Tensors: `token_embd`, `output_norm`, `output` (the embeddings when
    /// absent, as in Gemma 3's checkpoints), and per layer
    /// `blk.{i}.{attn_norm, attn_q, attn_k, attn_v, attn_q_norm,
    /// attn_k_norm, attn_output, post_attention_norm, ffn_norm, ffn_gate,
    /// ffn_up, ffn_down, post_ffw_norm}`. The embeddings are dequantized to
    /// f32 for the lookup (as candle-transformers does); the projections
    /// stay quantized.
    pub fn from_gguf<R: Read + Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        options: PagedOptions,
    ) -> Result<Self> {
        Self::load(ct, reader, device, options, false, DType::F32)
    }

    /// Like [`from_gguf`](Self::from_gguf), with activations in `dtype`:
    /// f32 or bf16. The projections stay quantized (candle's quantized
    /// matmuls take bf16 inputs on CUDA and on the CPU, where they are
    /// widened to f32 for the dot products). The embedding table, the
    /// rotary rows and the KV cache (unless fp8) are in `dtype`; the norms
    /// run in f32 and return `dtype`; the logits are f32.
    ///
    /// f16 is refused: Gemma 3's residual stream outgrows its range (on
    /// gemma-3-270m it reaches about 1.0e5 by the middle layers, past f16's
    /// 65504, and turns infinite), as Hugging Face warns for the model.
    pub fn from_gguf_with_dtype<R: Read + Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        options: PagedOptions,
        dtype: DType,
    ) -> Result<Self> {
        check_activation_dtype(OP, dtype)?;
        if dtype == DType::F16 {
            bail!(
                "{OP}: f16 activations overflow Gemma 3's residual stream (it exceeds f16's 65504); use bf16 or f32"
            );
        }
        Self::load(ct, reader, device, options, false, dtype)
    }

    /// Like [`from_gguf`](Self::from_gguf), with every weight dequantized to
    /// f32 at load time: dense matmuls instead of quantized dot products
    /// (activations are not quantized to 8 bits, and batches share each
    /// weight read), at four bytes per weight; tied output weights share
    /// the embedding table.
    pub fn from_gguf_dequantized<R: Read + Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        options: PagedOptions,
    ) -> Result<Self> {
        Self::load(ct, reader, device, options, true, DType::F32)
    }

    fn load<R: Read + Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        options: PagedOptions,
        dequantize: bool,
        dtype: DType,
    ) -> Result<Self> {
        let p = GgufGemma3Params::from_gguf(ct)?;
        let (hs, d) = (p.hidden_size, p.head_dim);
        let mut w = GgufWeights::new(OP, ct, reader, device, dtype, dequantize)?;
        let norm = |w: &mut GgufWeights<R>, name: &str, dim: usize, out: DType| {
            F32RmsNorm::new(w.dense_f32(name, &[dim])?, p.rms_norm_eps, out)
        };
        let (embd_q, embd) = w.embeddings(hs)?;
        let vocab_size = embd.dim(0)?;
        let scale = (hs as f64).sqrt();
        let tied = !ct.tensor_infos.contains_key("output.weight");
        // Dequantized with tied weights, one dense f32 table serves the
        // lookup and the output, and the lookup is scaled at run time;
        // otherwise the lookup table is scaled in f32 before the cast.
        let (output, lookup, embed_scale) = if dequantize && tied {
            (w.output(embd_q, Some(&embd))?, embd, Some(scale))
        } else {
            let table = (embd * scale)?.to_dtype(dtype)?;
            (w.output(embd_q, None)?, table, None)
        };
        limits::check_gguf_layers(OP, "GGUF gemma3.block_count", p.num_layers, ct)?;
        let mut layers = limits::layers_vec(p.num_layers);
        for i in 0..p.num_layers {
            let name = |n: &str| format!("blk.{i}.{n}.weight");
            let names = |ns: &[&str]| ns.iter().map(|n| name(n)).collect::<Vec<_>>();
            let attn = Attention::new(
                p.num_heads,
                p.num_kv_heads,
                d,
                (p.query_pre_attn_scalar as f32).powf(-0.5),
                AttentionOptions {
                    sliding_window: p.layer_window(i),
                    block_size: options.block_size,
                    kv_cache_dtype: options.kv_cache_dtype,
                    ..Default::default()
                },
            )?;
            let mut n = |n: &str, dim: usize| norm(&mut w, &name(n), dim, dtype);
            layers.push(Layer {
                attn_norm: n("attn_norm", hs)?,
                q_norm: n("attn_q_norm", d)?,
                k_norm: n("attn_k_norm", d)?,
                post_attention_norm: n("post_attention_norm", hs)?,
                ffn_norm: n("ffn_norm", hs)?,
                post_ffw_norm: n("post_ffw_norm", hs)?,
                wqkv: w.joined(&names(&["attn_q", "attn_k", "attn_v"]))?,
                wo: w.matmul(&name("attn_output"))?,
                attn,
                w_gate_up: w.joined(&names(&["ffn_gate", "ffn_up"]))?,
                w_down: w.matmul(&name("ffn_down"))?,
            });
        }
        // Inverse frequencies in f32, as candle-transformers and Hugging
        // Face compute them.
        let table = |base: f32, factor: f32| {
            let inv: Vec<f32> = (0..d)
                .step_by(2)
                .map(|i| 1f32 / base.powf(i as f32 / d as f32) / factor)
                .collect();
            let context = p.context_length.unwrap_or(DEFAULT_CONTEXT_LENGTH);
            RotaryEmbedding::new(&inv, context, false, dtype, device)
        };
        Ok(Self {
            dtype,
            tok_embeddings: Embedding::new(lookup, hs),
            embed_scale,
            layers,
            norm: norm(&mut w, "output_norm.weight", hs, dtype)?,
            output,
            rotary_local: table(p.rope_local_freq_base, 1.0)?,
            rotary_global: table(p.rope_freq_base, p.rope_scaling_factor.unwrap_or(1.0))?,
            params: p,
            vocab_size,
            device: device.clone(),
        })
    }

    /// The hyper-parameters read from the file.
    pub fn params(&self) -> &GgufGemma3Params {
        &self.params
    }
}

impl PagedModel for QuantizedGemma3 {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().map(|l| &l.attn).collect()
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.rotary_global.max_positions()
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
        let local = self.rotary_local.at(metadata)?;
        let global = self.rotary_global.at(metadata)?;
        let mut x = self.tok_embeddings.forward(input_ids)?;
        if let Some(scale) = self.embed_scale {
            x = (x * scale)?;
        }
        let rotary = |layer: &Layer| {
            if layer.attn.options().sliding_window.is_some() {
                &local
            } else {
                &global
            }
        };
        if x.device().is_cuda() {
            let Some(first) = self.layers.first() else {
                return lm_head(OP, &x, rows, metadata, &self.norm, &self.output);
            };
            let mut normed = first.attn_norm.fused(&x)?;
            for (i, layer) in self.layers.iter().enumerate() {
                let next = self.layers.get(i + 1).map_or(&self.norm, |l| &l.attn_norm);
                (x, normed) = layer.forward_fused(
                    &x,
                    &normed,
                    next,
                    rotary(layer),
                    cache.layer(i)?,
                    metadata,
                )?;
            }
            let normed = select_rows(OP, &normed, rows, metadata)?;
            return self.output.forward(&normed)?.to_dtype(DType::F32);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, rotary(layer), cache.layer(i)?, metadata)?;
        }
        lm_head(OP, &x, rows, metadata, &self.norm, &self.output)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::io::Cursor;

    use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_nn::{VarBuilder, VarMap};

    use super::*;
    use crate::cache::Work;
    use crate::models::gemma3::{Config, Gemma3};
    use crate::models::CacheConfig;

    fn metadata() -> Vec<(&'static str, Value)> {
        vec![
            ("general.architecture", Value::String("gemma3".into())),
            ("gemma3.block_count", Value::U32(3)),
            ("gemma3.embedding_length", Value::U32(64)),
            ("gemma3.attention.head_count", Value::U32(4)),
            ("gemma3.attention.head_count_kv", Value::U32(2)),
            ("gemma3.attention.key_length", Value::U32(16)),
            ("gemma3.attention.value_length", Value::U32(16)),
            ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
            ("gemma3.attention.sliding_window", Value::U32(5)),
            ("gemma3.attention.sliding_window_type", Value::U32(2)),
            ("gemma3.rope.freq_base", Value::F32(10000.)),
            ("gemma3.rope.local_freq_base", Value::F32(100.)),
            ("gemma3.rope.scaling.type", Value::String("linear".into())),
            ("gemma3.rope.scaling.factor", Value::F32(4.)),
            ("gemma3.context_length", Value::U32(128)),
        ]
    }

    fn content(md: &[(&'static str, Value)]) -> Content {
        Content {
            magic: VersionedMagic::GgufV3,
            metadata: md.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    /// The metadata with `key` replaced by `value` (removed when `None`).
    fn with(key: &'static str, value: Option<Value>) -> Content {
        let mut md = metadata();
        md.retain(|(k, _)| *k != key);
        md.extend(value.map(|v| (key, v)));
        content(&md)
    }

    #[test]
    fn params_come_from_the_metadata() -> Result<()> {
        let p = GgufGemma3Params::from_gguf(&content(&metadata()))?;
        assert_eq!(
            p,
            GgufGemma3Params {
                num_layers: 3,
                num_heads: 4,
                num_kv_heads: 2,
                hidden_size: 64,
                head_dim: 16,
                rms_norm_eps: 1e-6f32 as f64,
                sliding_window: 5,
                sliding_window_pattern: 2,
                rope_freq_base: 10000.,
                rope_local_freq_base: 100.,
                rope_scaling_factor: Some(4.),
                query_pre_attn_scalar: 16,
                context_length: Some(128),
            }
        );
        assert_eq!(
            (0..3).map(|i| p.layer_window(i)).collect::<Vec<_>>(),
            [Some(5), None, Some(5)]
        );
        // Defaults: pattern 6, both rope bases, no scaling, no context length.
        let mut md = metadata();
        md.retain(|(k, _)| {
            !k.contains("sliding_window_type")
                && !k.contains("rope")
                && !k.contains("context_length")
        });
        let p = GgufGemma3Params::from_gguf(&content(&md))?;
        assert_eq!(
            (
                p.sliding_window_pattern,
                p.rope_freq_base,
                p.rope_local_freq_base,
                p.rope_scaling_factor,
                p.context_length
            ),
            (6, 1e6, 1e4, None, None)
        );
        // The 27B model (62 layers) scales by hidden_size / num_heads.
        let p = GgufGemma3Params::from_gguf(&with("gemma3.block_count", Some(Value::U32(62))))?;
        assert_eq!(p.query_pre_attn_scalar, 16);
        // Otherwise by the head size.
        let mut md = metadata();
        for (k, v) in md.iter_mut() {
            if k.ends_with("_length") && k.contains("attention") {
                *v = Value::U32(32);
            }
        }
        let p = GgufGemma3Params::from_gguf(&content(&md))?;
        assert_eq!((p.head_dim, p.query_pre_attn_scalar), (32, 32));
        Ok(())
    }

    #[test]
    fn bad_metadata_is_refused_by_name() {
        let cases = [
            (
                with("general.architecture", Some(Value::String("llama".into()))),
                "quantized-gemma3: GGUF architecture must be gemma3, got llama",
            ),
            (
                with("gemma3.attention.sliding_window", None),
                "quantized-gemma3: GGUF metadata has no gemma3.attention.sliding_window",
            ),
            (
                with("gemma3.block_count", Some(Value::U32(0))),
                "quantized-gemma3: GGUF gemma3.block_count must be in 1..=u32::MAX, got U32(0)",
            ),
            (
                with("gemma3.attention.value_length", Some(Value::U32(32))),
                "quantized-gemma3: key_length 16 and value_length 32 must be equal",
            ),
            (
                with("gemma3.rope.scaling.type", Some(Value::String("yarn".into()))),
                "quantized-gemma3: only linear rope scaling is supported, got yarn",
            ),
            (
                with("gemma3.rope.freq_base", Some(Value::F32(-1.))),
                "quantized-gemma3: GGUF gemma3.rope.freq_base must be a positive f32, got F32(-1.0)",
            ),
            (
                with(
                    "gemma3.attention.layer_norm_rms_epsilon",
                    Some(Value::F32(f32::NAN)),
                ),
                "quantized-gemma3: GGUF gemma3.attention.layer_norm_rms_epsilon must be a positive f32, got F32(NaN)",
            ),
        ];
        for (ct, want) in cases {
            // The message, then a backtrace when RUST_BACKTRACE is set.
            let err = GgufGemma3Params::from_gguf(&ct).unwrap_err().to_string();
            assert_eq!(err.lines().next(), Some(want), "{err}");
        }
    }

    /// The GGUF name of a Hugging Face tensor, and whether it is a norm
    /// (stored as `1 + weight`).
    fn gguf_name(hf: &str) -> Option<(String, bool)> {
        match hf {
            "model.embed_tokens.weight" => return Some(("token_embd.weight".into(), false)),
            "model.norm.weight" => return Some(("output_norm.weight".into(), true)),
            _ => {}
        }
        let (i, name) = hf.strip_prefix("model.layers.")?.split_once('.')?;
        let (gguf, is_norm) = match name {
            "self_attn.q_proj.weight" => ("attn_q", false),
            "self_attn.k_proj.weight" => ("attn_k", false),
            "self_attn.v_proj.weight" => ("attn_v", false),
            "self_attn.o_proj.weight" => ("attn_output", false),
            "self_attn.q_norm.weight" => ("attn_q_norm", true),
            "self_attn.k_norm.weight" => ("attn_k_norm", true),
            "input_layernorm.weight" => ("attn_norm", true),
            "post_attention_layernorm.weight" => ("post_attention_norm", true),
            "pre_feedforward_layernorm.weight" => ("ffn_norm", true),
            "post_feedforward_layernorm.weight" => ("post_ffw_norm", true),
            "mlp.gate_proj.weight" => ("ffn_gate", false),
            "mlp.up_proj.weight" => ("ffn_up", false),
            "mlp.down_proj.weight" => ("ffn_down", false),
            _ => return None,
        };
        Some((format!("blk.{i}.{gguf}.weight"), is_norm))
    }

    /// Two sequences (11 and 3 prompt tokens, then 3 decodes) with window
    /// groups of 8 blocks of 4: the logits of each step, `(2, vocab)`.
    fn run(model: &dyn PagedModel) -> Result<Vec<Tensor>> {
        let dev = model.device().clone();
        let cache = PagedKvCache::new(
            &model.attention_layers(),
            CacheConfig {
                window_blocks: Some(8),
                ..CacheConfig::new(16)
            },
            model.dtype(),
            &dev,
        )?;
        let mut manager = cache.block_manager()?;
        let prompts: [Vec<u32>; 2] = [(0..11).map(|i| i * 7 % 50).collect(), vec![3, 1, 4]];
        for (i, p) in prompts.iter().enumerate() {
            manager.add_sequence(i as u64, p)?;
        }
        let mut work: Vec<Work> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| Work::Prefill {
                seq_id: i as u64,
                num_tokens: p.len(),
            })
            .collect();
        let mut out = Vec::new();
        for step in 0..4u32 {
            let batch = manager.schedule(&work, &dev)?;
            let ids = Tensor::new(batch.token_ids.as_slice(), &dev)?;
            let logits = model.forward(&ids, &batch.metadata, &cache, &batch.last_rows)?;
            out.push(logits.to_device(&Device::Cpu)?);
            work = (0..2)
                .map(|i| Work::Decode {
                    seq_id: i,
                    token: 10 + step + i as u32,
                })
                .collect();
        }
        Ok(out)
    }

    fn write_gguf(
        md: &HashMap<String, Value>,
        tensors: &[(String, QTensor)],
    ) -> Result<Cursor<Vec<u8>>> {
        let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let mut file = Cursor::new(Vec::new());
        gguf_file::write(&mut file, &md, &ts)?;
        file.set_position(0);
        Ok(file)
    }

    fn max_abs(t: &Tensor) -> Result<f32> {
        t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// A small random Gemma 3 written as a GGUF file (norms shifted by one,
    /// names as llama.cpp writes them) gives the logits of the paged
    /// safetensors `Gemma3` on the same weights: the layer pattern from
    /// `sliding_window_type`, the window in prefills and decodes, the GELU
    /// MLP, both rope bases and the linear scaling of the global layers.
    #[test]
    fn random_gguf_matches_the_safetensors_model() -> Result<()> {
        let dev = Device::Cpu;
        let cfg: Config = serde_json::from_str(
            r#"{"attention_bias": false, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_local_base_freq": 100.0, "vocab_size": 50,
            "query_pre_attn_scalar": 16, "sliding_window": 5, "sliding_window_pattern": 2,
            "max_position_embeddings": 128, "rope_scaling": {"factor": 4.0}}"#,
        )
        .map_err(candle_core::Error::wrap)?;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let opts = PagedOptions {
            block_size: 4,
            ..Default::default()
        };
        Gemma3::load(vb.clone(), &cfg, opts)?;
        let mut tensors = Vec::new();
        {
            let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
            for (name, var) in data.iter() {
                let Some((gguf, is_norm)) = gguf_name(name) else {
                    bail!("unmapped tensor {name}");
                };
                let w = Tensor::randn(0f32, if is_norm { 0.2 } else { 0.15 }, var.shape(), &dev)?;
                var.set(&w)?;
                let stored = if is_norm { (w + 1.0)? } else { w };
                tensors.push((gguf, QTensor::quantize(&stored, GgmlDType::F32)?));
            }
        }
        let reference = Gemma3::load(vb, &cfg, opts)?;
        let want = run(&reference)?;

        let md = content(&metadata()).metadata;
        let mut file = write_gguf(&md, &tensors)?;
        let ct = gguf_file::Content::read(&mut file)?;
        let ours = QuantizedGemma3::from_gguf(&ct, &mut file, &dev, opts)?;
        assert_eq!((ours.max_seq_len(), ours.vocab_size()), (128, 50));
        let windows: Vec<_> = ours
            .attention_layers()
            .iter()
            .map(|a| a.options().sliding_window)
            .collect();
        assert_eq!(windows, [Some(5), None, Some(5)]);
        for (step, (a, b)) in run(&ours)?.iter().zip(&want).enumerate() {
            let (diff, scale) = (max_abs(&(a - b)?)?, max_abs(b)?);
            assert!(scale > 0.1, "step {step}: degenerate logits {scale}");
            assert!(
                diff < 1e-4 * scale.max(1.0),
                "step {step}: logits differ by {diff}"
            );
        }

        // bf16 activations (norms in f32): the logits to bf16's rounding.
        file.set_position(0);
        let ct = gguf_file::Content::read(&mut file)?;
        let bf16 = QuantizedGemma3::from_gguf_with_dtype(&ct, &mut file, &dev, opts, DType::BF16)?;
        assert_eq!(bf16.dtype(), DType::BF16);
        for (step, (a, b)) in run(&bf16)?.iter().zip(&want).enumerate() {
            let (diff, scale) = (max_abs(&(a - b)?)?, max_abs(b)?);
            println!("bf16 step {step}: {diff} of {scale}");
            assert_eq!(a.dtype(), DType::F32);
            assert!(
                diff < 3e-2 * scale.max(1.0),
                "step {step}: bf16 logits differ by {diff}"
            );
        }
        // On CUDA the fused layer kernels run (norms with the weight
        // offset, q/k norms, each residual add with the next norm, the
        // rotation with the cache write, the gated activation): both models
        // give the CPU's f32 logits, and bf16 follows within its rounding.
        #[cfg(feature = "cuda")]
        if let Ok(gpu) = Device::new_cuda(0) {
            let weights: HashMap<String, Tensor> = varmap
                .data()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
                .collect();
            let check = |what: &str, model: &dyn PagedModel, tol: f32| -> Result<()> {
                for (step, (a, b)) in run(model)?.iter().zip(&want).enumerate() {
                    let (diff, scale) = (max_abs(&(a - b)?)?, max_abs(b)?);
                    println!("{what} step {step}: {diff} of {scale}");
                    assert!(
                        diff < tol * scale.max(1.0),
                        "{what} step {step}: logits differ by {diff}"
                    );
                }
                Ok(())
            };
            for dtype in [DType::F32, DType::BF16] {
                let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
                let vb = VarBuilder::from_tensors(weights.clone(), dtype, &gpu);
                check(
                    &format!("cuda {dtype:?} safetensors"),
                    &Gemma3::load(vb, &cfg, opts)?,
                    tol,
                )?;
                file.set_position(0);
                let ct = gguf_file::Content::read(&mut file)?;
                let q = QuantizedGemma3::from_gguf_with_dtype(&ct, &mut file, &gpu, opts, dtype)?;
                check(&format!("cuda {dtype:?} gguf"), &q, tol)?;
            }
        }
        for (dtype, want) in [
            (
                DType::F16,
                "quantized-gemma3: f16 activations overflow Gemma 3's residual stream (it exceeds f16's 65504); use bf16 or f32",
            ),
            (
                DType::U8,
                "quantized-gemma3: activations must be f32, bf16 or f16, got U8",
            ),
        ] {
            file.set_position(0);
            let ct = gguf_file::Content::read(&mut file)?;
            let err = QuantizedGemma3::from_gguf_with_dtype(&ct, &mut file, &dev, opts, dtype)
                .unwrap_err()
                .to_string();
            assert_eq!(err.lines().next(), Some(want), "{err}");
        }

        // Without the scaling factor the global layer rotates differently.
        let md = with("gemma3.rope.scaling.factor", None).metadata;
        let mut file = write_gguf(&md, &tensors)?;
        let ct = gguf_file::Content::read(&mut file)?;
        let plain = QuantizedGemma3::from_gguf_dequantized(&ct, &mut file, &dev, opts)?;
        let diff = max_abs(&(&run(&plain)?[3] - &want[3])?)?;
        assert!(diff > 1e-3, "rope scaling changes nothing ({diff})");
        Ok(())
    }
}
