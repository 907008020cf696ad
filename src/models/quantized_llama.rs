//! Paged Llama from a GGUF file, with quantized weights (`QMatMul`), and
//! the llama.cpp architectures of the same decoder ([`GgufFamily`]).
//!
//! candle-transformers 0.11.1's `quantized_llama` (dense, `llama`
//! architecture) with the paged cache. GGUF Llama checkpoints store q and k
//! permuted for interleaved rotary embeddings, so the rotation pairs
//! `(2i, 2i + 1)` as candle-transformers does for this architecture.
//!
//! The same model reads llama.cpp's `qwen2` (q/k/v biases), `qwen3`
//! (per-head RMS norms of q and k before the rotation, head size
//! `qwen3.attention.key_length`) and `phi3` (q/k/v stored as one
//! `attn_qkv`, gate/up as one `ffn_up`), as candle-transformers'
//! `quantized_qwen2`, `quantized_qwen3` and `quantized_phi3` do: their keys
//! under the architecture's prefix, q and k stored unpermuted, so the
//! rotation pairs `(i, i + d / 2)` (NEOX).
//!
//! The q/k/v weights are joined into one `QMatMul` at load time, and so are
//! gate/up: their rows are concatenated as stored when they share a GGML
//! dtype (a step then quantizes each activation once and launches one
//! matmul instead of three or two), and kept apart otherwise.
//!
//! Activations are f32 by default, as in candle-transformers. On CUDA,
//! [`QuantizedLlama::from_gguf_with_dtype`] runs them in bf16 or f16 (the
//! quantized matmuls take them as they are; norms, embeddings, rotary rows
//! and the KV cache follow): the attention kernels then use tensor cores,
//! and every activation moves half the bytes.

use std::io::{Read, Seek};

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::{Embedding, Module};

use super::gguf::{check_activation_dtype, GgufWeights};
use super::layers::{gated, FusedRmsNorm, QProjections};
use super::limits::{self, DecoderShape};
use super::rotary::{Rotary, RotaryEmbedding};
use super::{check_cache, check_input, select_rows, PagedKvCache, PagedModel, PagedOptions};
use crate::attention::{Attention, AttentionOptions};
use crate::cache::LayerKvCache;
use crate::metadata::AttentionMetadata;
use crate::GatedActivation;

const OP: &str = "quantized-llama";

/// A GGUF architecture (`general.architecture`) of the Llama decoder: what
/// sets it apart from `llama`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufFamily {
    /// `llama`: interleaved rotary, no biases.
    Llama,
    /// `qwen2`: `blk.{i}.attn_{q,k,v}.bias`, NEOX rotary.
    Qwen2,
    /// `qwen3`: `blk.{i}.attn_{q,k}_norm` `(head_dim,)` on each head of q
    /// and k before the rotation, NEOX rotary, head size
    /// `qwen3.attention.key_length`.
    Qwen3,
    /// `phi3`: `blk.{i}.attn_qkv` `((h + 2 * kvh) * d, H)` and
    /// `blk.{i}.ffn_up` `(2 * F, H)` (gate rows first), NEOX rotary; no
    /// LongRoPE factors (`rope_factors_long`/`rope_factors_short` are
    /// refused), no sliding window (as candle-transformers).
    Phi3,
}

impl GgufFamily {
    /// Every family, in the order of [`name`](Self::name)s in messages.
    pub const ALL: [GgufFamily; 4] = [Self::Llama, Self::Qwen2, Self::Qwen3, Self::Phi3];

    /// The family of GGUF architecture `name`, if it is one.
    pub fn from_architecture(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The architecture's name: `general.architecture` and the prefix of
    /// its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Phi3 => "phi3",
        }
    }

    /// The model named in error messages.
    fn component(self) -> &'static str {
        match self {
            Self::Llama => OP,
            Self::Qwen2 => "quantized-qwen2",
            Self::Qwen3 => "quantized-qwen3",
            Self::Phi3 => "quantized-phi3",
        }
    }

    /// Whether the rotation pairs `(2i, 2i + 1)` (q and k permuted by the
    /// converter) rather than `(i, i + d / 2)`.
    fn interleaved_rotary(self) -> bool {
        self == Self::Llama
    }

    fn qkv_bias(self) -> bool {
        self == Self::Qwen2
    }

    fn qk_norm(self) -> bool {
        self == Self::Qwen3
    }

    /// The tensors (`blk.{i}.{name}.weight`) holding q, k and v, in order.
    fn qkv_names(self) -> &'static [&'static str] {
        match self {
            Self::Phi3 => &["attn_qkv"],
            _ => &["attn_q", "attn_k", "attn_v"],
        }
    }

    /// The tensors holding the gate and up projections, in order.
    fn gate_up_names(self) -> &'static [&'static str] {
        match self {
            Self::Phi3 => &["ffn_up"],
            _ => &["ffn_gate", "ffn_up"],
        }
    }
}

/// The context length of a GGUF without `llama.context_length`: the
/// rotary table length of candle-transformers' `quantized_llama`.
pub const DEFAULT_CONTEXT_LENGTH: usize = 4096;

/// The hyper-parameters read from the GGUF metadata (`llama.*` keys, or
/// those of the [`family`](Self::family)'s prefix).
#[derive(Clone, Debug, PartialEq)]
pub struct GgufLlamaParams {
    /// The architecture (`general.architecture`).
    pub family: GgufFamily,
    /// Decoder layers (`llama.block_count`).
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Model width (`llama.embedding_length`).
    pub hidden_size: usize,
    /// Elements per head when given apart from the width
    /// (`attention.key_length`, read for `qwen2` and `qwen3`); `None` is
    /// `hidden_size / num_heads`.
    pub key_length: Option<usize>,
    /// Rotary dimensions (`llama.rope.dimension_count`; for `qwen2` and
    /// `qwen3`, the head size when absent).
    pub rope_dim: usize,
    /// Rotary base (`llama.rope.freq_base`, default 10000).
    pub rope_freq_base: f32,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Context length the model was trained for (`llama.context_length`), if
    /// given; the model's [`max_seq_len`](PagedModel::max_seq_len), or
    /// [`DEFAULT_CONTEXT_LENGTH`] without it.
    pub context_length: Option<usize>,
    /// The sliding window of every layer (`phi3.attention.sliding_window`,
    /// as Hugging Face's Phi-3 applies it), if any; `None` for the other
    /// families.
    pub sliding_window: Option<usize>,
}

impl GgufLlamaParams {
    /// Reads the parameters; fails naming the missing key or an
    /// architecture other than a [`GgufFamily`].
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let get = |key: &str| match ct.metadata.get(key) {
            Some(v) => Ok(v),
            None => bail!("{OP}: GGUF metadata has no {key}"),
        };
        let arch = get("general.architecture")?.to_string()?;
        let Some(family) = GgufFamily::from_architecture(arch) else {
            bail!("{OP}: GGUF architecture must be llama, qwen2, qwen3 or phi3, got {arch}");
        };
        let (op, pre) = (family.component(), family.name());
        let get = |key: &str| match ct.metadata.get(key) {
            Some(v) => Ok(v),
            None => bail!("{op}: GGUF metadata has no {key}"),
        };
        let experts = get(&format!("{pre}.expert_count"))
            .and_then(|v| v.to_u32())
            .unwrap_or(0);
        if experts > 1 {
            bail!("{op}: mixture-of-experts GGUF models are not supported ({experts} experts)");
        }
        let value = |key: &str, v: &gguf_file::Value| -> Result<usize> {
            match v.to_u64().ok().and_then(|n| usize::try_from(n).ok()) {
                Some(n) if n > 0 && n <= u32::MAX as usize => Ok(n),
                _ => bail!("{op}: GGUF {pre}.{key} must be in 1..=u32::MAX, got {v:?}"),
            }
        };
        let count = |key: &str| -> Result<usize> { value(key, get(&format!("{pre}.{key}"))?) };
        let optional = |key: &str| -> Result<Option<usize>> {
            match ct.metadata.get(&format!("{pre}.{key}")) {
                None => Ok(None),
                Some(v) => value(key, v).map(Some),
            }
        };
        let num_heads = count("attention.head_count")?;
        let hidden_size = count("embedding_length")?;
        let sliding_window = match family {
            GgufFamily::Phi3 => optional("attention.sliding_window")?,
            _ => None,
        };
        let key_length = match family {
            GgufFamily::Llama | GgufFamily::Phi3 => None,
            GgufFamily::Qwen2 | GgufFamily::Qwen3 => optional("attention.key_length")?,
        };
        if key_length.is_none() && !hidden_size.is_multiple_of(num_heads) {
            bail!(
                "{op}: embedding_length {hidden_size} is not a multiple of head_count {num_heads}"
            );
        }
        let head_dim = key_length.unwrap_or(hidden_size / num_heads);
        let context_length = optional("context_length")?;
        let eps_key = format!("{pre}.attention.layer_norm_rms_epsilon");
        let eps = get(&eps_key)?;
        let Ok(rms_norm_eps) = eps.to_f32() else {
            bail!("{op}: GGUF {eps_key} must be an f32, got {eps:?}");
        };
        let rope_freq_base = match ct.metadata.get(&format!("{pre}.rope.freq_base")) {
            None => 10000.,
            Some(v) => match v.to_f32() {
                Ok(f) => f,
                Err(_) => bail!("{op}: GGUF {pre}.rope.freq_base must be an f32, got {v:?}"),
            },
        };
        let rope_dim = match family {
            GgufFamily::Llama | GgufFamily::Phi3 => count("rope.dimension_count")?,
            GgufFamily::Qwen2 | GgufFamily::Qwen3 => {
                optional("rope.dimension_count")?.unwrap_or(head_dim)
            }
        };
        let p = Self {
            family,
            num_layers: count("block_count")?,
            num_heads,
            num_kv_heads: count("attention.head_count_kv")?,
            hidden_size,
            key_length,
            rope_dim,
            rope_freq_base,
            rms_norm_eps: rms_norm_eps as f64,
            context_length,
            sliding_window,
        };
        // Checked before anything is sized by them (the rotary width builds
        // a frequency vector, the layer count a vector of layers).
        let source = format!("GGUF {pre}.");
        DecoderShape {
            component: op,
            source: &source,
            hidden_size: ("embedding_length", p.hidden_size),
            num_heads: ("attention.head_count", p.num_heads),
            num_kv_heads: ("attention.head_count_kv", p.num_kv_heads),
            head_dim: match key_length {
                Some(_) => ("attention.key_length", head_dim),
                None => ("embedding_length / attention.head_count", head_dim),
            },
            num_layers: ("block_count", p.num_layers),
            max_layers: None,
            rope_dim: ("rope.dimension_count", p.rope_dim),
            rms_norm_eps: ("attention.layer_norm_rms_epsilon", p.rms_norm_eps),
            rope_bases: &[("rope.freq_base", p.rope_freq_base as f64)],
        }
        .check()?;
        if key_length.is_some() {
            if let Some(v) = optional("attention.value_length")? {
                if v != head_dim {
                    bail!("{op}: GGUF {pre}.attention.value_length {v} must equal the head size {head_dim}");
                }
            }
        }
        Ok(p)
    }

    /// Elements per head: [`key_length`](Self::key_length), or
    /// `hidden_size / num_heads`.
    pub fn head_dim(&self) -> usize {
        self.key_length.unwrap_or(self.hidden_size / self.num_heads)
    }
}

#[derive(Clone, Debug)]
struct Layer {
    attn_norm: FusedRmsNorm,
    /// `attn_q`, `attn_k`, `attn_v`.
    wqkv: QProjections,
    /// `attn_q`, `attn_k`, `attn_v` biases joined, `((h + 2 * kvh) * d,)`
    /// in the activation dtype (`qwen2`).
    qkv_bias: Option<Tensor>,
    /// `attn_q_norm`, `attn_k_norm` over each head's `d` elements (`qwen3`).
    qk_norm: Option<(FusedRmsNorm, FusedRmsNorm)>,
    wo: QMatMul,
    attn: Attention,
    ffn_norm: FusedRmsNorm,
    /// `ffn_gate`, `ffn_up`.
    w_gate_up: QProjections,
    w_down: QMatMul,
}

impl Layer {
    /// `x` `(n, H)` (normed, in the activation dtype) -> `(n, H)`.
    fn attention(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let mut qkv = self.wqkv.forward_joined(x)?;
        if let Some(bias) = &self.qkv_bias {
            qkv = qkv.to_dtype(bias.dtype())?.broadcast_add(bias)?;
        }
        let y = match &self.qk_norm {
            None => self
                .attn
                .forward_rotary_qkv(&qkv, rotary.rows(), cache, metadata)?,
            Some((q_norm, k_norm)) => {
                let (h, kvh, d) = (
                    self.attn.num_heads(),
                    self.attn.num_kv_heads(),
                    self.attn.head_size(),
                );
                let n = qkv.dim(0)?;
                // Quantized matmuls of more than 8 rows return f32: the
                // norms and the attention take the activation dtype.
                let qkv = qkv.to_dtype(x.dtype())?;
                let per_head = |norm: &FusedRmsNorm, start: usize, heads: usize| {
                    let t = qkv.narrow(1, start, heads * d)?.reshape((n * heads, d))?;
                    rotary.apply(&norm.forward(&t)?.reshape((n, heads * d))?, heads)
                };
                let q = per_head(q_norm, 0, h)?;
                let k = per_head(k_norm, h * d, kvh)?;
                let v = qkv.narrow(1, (h + kvh) * d, kvh * d)?;
                self.attn.forward(&q, &k, &v, cache, metadata)?
            }
        };
        // Quantized matmuls of more than 8 rows return f32 whatever their
        // input; the residual add takes either.
        self.wo.forward(&y)
    }

    /// The feed-forward block of normalised `x`; the down projection's
    /// output in x's dtype or f32 (see `attention`).
    fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let gate_up = self.w_gate_up.forward_joined(x)?;
        self.w_down
            .forward(&gated(&gate_up, GatedActivation::Silu, x.dtype())?)
    }
}

/// A paged Llama (or another [`GgufFamily`]) with GGUF (quantized)
/// weights; activations are f32, or bf16/f16 on CUDA
/// ([`QuantizedLlama::from_gguf_with_dtype`]).
#[derive(Clone, Debug)]
pub struct QuantizedLlama {
    /// The model named in error messages.
    component: &'static str,
    dtype: DType,
    tok_embeddings: Embedding,
    layers: Vec<Layer>,
    norm: FusedRmsNorm,
    output: QMatMul,
    rotary: RotaryEmbedding,
    params: GgufLlamaParams,
    vocab_size: usize,
    device: Device,
}

impl QuantizedLlama {
    /// Loads the model from GGUF content `ct` read from `reader`; its
    /// `general.architecture` picks the [`GgufFamily`].
    ///
    /// Tensors (`H` the width, `h`/`kvh` the query/KV heads of `d`
    /// elements, `F` the MLP width): `token_embd` `(vocab, H)`,
    /// `output_norm` `(H,)`, `output` `(vocab, H)` (the embeddings when
    /// absent), and per layer `blk.{i}.{attn_q (h * d, H), attn_k, attn_v
    /// (kvh * d, H), attn_output (H, h * d), attn_norm (H,), ffn_gate,
    /// ffn_up (F, H), ffn_down (H, F), ffn_norm (H,)}`; `qwen2` adds
    /// `blk.{i}.attn_{q,k,v}.bias` `(h * d,)`, `(kvh * d,)`, `(kvh * d,)`,
    /// `qwen3` `blk.{i}.attn_{q,k}_norm.weight` `(d,)`; `phi3` has
    /// `blk.{i}.attn_qkv` `((h + 2 * kvh) * d, H)` and `blk.{i}.ffn_up`
    /// `(2 * F, H)` instead of the separate q/k/v and gate/up.
    pub fn from_gguf<R: Read + Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        options: PagedOptions,
    ) -> Result<Self> {
        Self::load(ct, reader, device, options, false, DType::F32)
    }

    /// Like [`from_gguf`](Self::from_gguf) (`dequantize` false) or
    /// [`from_gguf_dequantized`](Self::from_gguf_dequantized) (true), with
    /// activations in `dtype`: f32, or on CUDA bf16 or f16 (candle's CPU
    /// quantized matmuls take f32 only). Embeddings, norm weights, rotary
    /// rows, dequantized weights and the KV cache (unless fp8) are in
    /// `dtype`; the logits are f32.
    pub fn from_gguf_with_dtype<R: Read + Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        options: PagedOptions,
        dequantize: bool,
        dtype: DType,
    ) -> Result<Self> {
        check_activation_dtype(OP, dtype)?;
        if dtype != DType::F32 && !device.is_cuda() && !dequantize {
            bail!(
                "{OP}: {dtype:?} activations need a CUDA device or dequantized weights (candle's CPU quantized matmuls take f32)"
            );
        }
        Self::load(ct, reader, device, options, dequantize, dtype)
    }

    /// Like [`from_gguf`](Self::from_gguf), with every weight dequantized to
    /// f32 at load time: dense matmuls instead of quantized dot products
    /// (faster on CPU for formats without SIMD kernels, such as Q4_1, and
    /// batches share each weight read), at four bytes per weight.
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
        let p = GgufLlamaParams::from_gguf(ct)?;
        let family = p.family;
        let op = family.component();
        let head_dim = p.head_dim();
        let hs = p.hidden_size;
        let mut w = GgufWeights::new(op, ct, reader, device, dtype, dequantize)?;
        let norm_of = |w: &mut GgufWeights<R>, name: &str, dim: usize| -> Result<FusedRmsNorm> {
            let weight = w.dense_f32(name, &[dim])?.to_dtype(dtype)?;
            Ok(FusedRmsNorm::new(weight, p.rms_norm_eps))
        };
        let norm = |w: &mut GgufWeights<R>, name: &str| norm_of(w, name, hs);
        let (embd_q, embd) = w.embeddings(hs)?;
        let embd = embd.to_dtype(dtype)?;
        let vocab_size = embd.dim(0)?;
        let output = w.output(embd_q, Some(&embd))?;
        let block_count = format!("GGUF {}.block_count", family.name());
        limits::check_gguf_layers(op, &block_count, p.num_layers, ct)?;
        for factors in ["rope_factors_long.weight", "rope_factors_short.weight"] {
            if ct.tensor_infos.contains_key(factors) {
                bail!("{op}: {factors}: LongRoPE scaling is not supported");
            }
        }
        let qkv_rows = (p.num_heads + 2 * p.num_kv_heads) * head_dim;
        let mut layers = limits::layers_vec(p.num_layers);
        for i in 0..p.num_layers {
            let name = |n: &str| format!("blk.{i}.{n}.weight");
            let names = |ns: &[&str]| ns.iter().map(|n| name(n)).collect::<Vec<_>>();
            let qkv_names = names(family.qkv_names());
            let rows: Option<usize> = qkv_names
                .iter()
                .map(|n| {
                    ct.tensor_infos
                        .get(n)
                        .and_then(|t| t.shape.dims().first().copied())
                })
                .sum();
            if let Some(rows) = rows.filter(|&r| r != qkv_rows) {
                bail!(
                    "{op}: {} have {rows} rows, (attention.head_count + 2 * attention.head_count_kv) * head size is {qkv_rows}",
                    qkv_names.join(", ")
                );
            }
            let qkv_bias = match family.qkv_bias() {
                false => None,
                true => {
                    let (q, kv) = (p.num_heads * head_dim, p.num_kv_heads * head_dim);
                    let parts = [("attn_q", q), ("attn_k", kv), ("attn_v", kv)]
                        .map(|(n, dim)| w.dense_f32(&format!("blk.{i}.{n}.bias"), &[dim]));
                    let [bq, bk, bv] = parts;
                    Some(Tensor::cat(&[bq?, bk?, bv?], 0)?.to_dtype(dtype)?)
                }
            };
            let qk_norm = match family.qk_norm() {
                false => None,
                true => Some((
                    norm_of(&mut w, &name("attn_q_norm"), head_dim)?,
                    norm_of(&mut w, &name("attn_k_norm"), head_dim)?,
                )),
            };
            let attn = Attention::new(
                p.num_heads,
                p.num_kv_heads,
                head_dim,
                1.0 / (head_dim as f32).sqrt(),
                AttentionOptions {
                    block_size: options.block_size,
                    kv_cache_dtype: options.kv_cache_dtype,
                    sliding_window: p.sliding_window,
                    ..Default::default()
                },
            )?;
            layers.push(Layer {
                attn_norm: norm(&mut w, &name("attn_norm"))?,
                wqkv: w.joined(&qkv_names)?,
                qkv_bias,
                qk_norm,
                wo: w.matmul(&name("attn_output"))?,
                attn,
                ffn_norm: norm(&mut w, &name("ffn_norm"))?,
                w_gate_up: w.joined(&names(family.gate_up_names()))?,
                w_down: w.matmul(&name("ffn_down"))?,
            });
        }
        let inv_freq: Vec<f32> = (0..p.rope_dim)
            .step_by(2)
            .map(|i| 1f32 / p.rope_freq_base.powf(i as f32 / p.rope_dim as f32))
            .collect();
        if p.rope_dim != head_dim {
            bail!(
                "{op}: partial rotary embeddings are not supported (rope dim {} vs head dim {head_dim})",
                p.rope_dim
            );
        }
        let context = p.context_length.unwrap_or(DEFAULT_CONTEXT_LENGTH);
        let rotary = RotaryEmbedding::new(
            &inv_freq,
            context,
            family.interleaved_rotary(),
            dtype,
            device,
        )?;
        Ok(Self {
            component: op,
            dtype,
            tok_embeddings: Embedding::new(embd, p.hidden_size),
            layers,
            norm: norm(&mut w, "output_norm.weight")?,
            output,
            rotary,
            params: p,
            vocab_size,
            device: device.clone(),
        })
    }

    /// The hyper-parameters read from the file.
    pub fn params(&self) -> &GgufLlamaParams {
        &self.params
    }
}

impl PagedModel for QuantizedLlama {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().map(|l| &l.attn).collect()
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
        let op = self.component;
        check_input(op, input_ids, metadata, self.vocab_size)?;
        check_cache(op, cache, self.layers.len())?;
        let rotary = self.rotary.at(metadata)?;
        let mut x = self.tok_embeddings.forward(input_ids)?;
        let Some(first) = self.layers.first() else {
            bail!("{op}: the model has no layers");
        };
        // Each residual add runs with the norm after it (one kernel on CUDA);
        // the last one with the output norm, over every row (the norm is
        // per row, so selecting the rows after it changes nothing).
        let mut normed = first.attn_norm.forward(&x)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.attention(&normed, &rotary, cache.layer(i)?, metadata)?;
            (x, normed) = layer.ffn_norm.add_forward(&x, &h)?;
            let h = layer.mlp(&normed)?;
            let next = self.layers.get(i + 1).map_or(&self.norm, |l| &l.attn_norm);
            (x, normed) = next.add_forward(&x, &h)?;
        }
        let x = select_rows(op, &normed, rows, metadata)?;
        self.output.forward(&x)?.to_dtype(DType::F32)
    }
}
