//! candle-transformers 0.11.1's `quantized_gemma3` (its
//! `src/models/quantized_gemma3.rs`, without the tracing spans), with
//! switchable patches towards Hugging Face transformers' Gemma 3.
//! Copied from candle-transformers 0.11.1 (MIT OR Apache-2.0, Copyright the candle authors); only the marked patches and the dropped tracing differ.
//!
//! With [`Patches::NONE`] the code computes what the published model does
//! (the tests check this logit for logit against
//! `candle_transformers::models::quantized_gemma3`); [`Patches::HF`] turns on:
//!
//! * `gelu` - the MLP gates with `gelu_pytorch_tanh` where the published
//!   model uses SiLU (huggingface/candle#3745);
//! * `hf_window` - the sliding layers keep keys with
//!   `query_pos - key_pos < w` (Hugging Face, llama.cpp), where the published
//!   prefill mask keeps `<= w` (one key more) and its decodes (no mask)
//!   keep every key; the mask is built at absolute positions, so it is also
//!   right for a prompt fed in several pieces.
//!
//! Each patched line is marked `PATCH`; the rotary tables are shorter
//! (same values). Rope scaling (ignored by the
//! published model) is not patched: Gemma 3 270M has none.

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, D};
use candle_nn::Embedding;
use candle_transformers::quantized_nn::RmsNorm;

/// Rotary table rows per layer: 131072 in the published code. Row `p` is
/// `p * theta` whatever the length, so a shorter table gives the same
/// values and saves 2.2 GB per model (18 layers of cos and sin).
const MAX_SEQ_LEN: usize = 4096;
const DEFAULT_SLIDING_WINDOW_TYPE: usize = 6;
const DEFAULT_ROPE_FREQUENCY: f32 = 1_000_000.;
const DEFAULT_ROPE_FREQUENCY_SLIDING: f32 = 10_000.;

/// Which deviations from the published model are switched on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Patches {
    /// GELU (tanh) instead of SiLU in the MLP.
    pub gelu: bool,
    /// Hugging Face's sliding window, in prefills and decodes.
    pub hf_window: bool,
}

impl Patches {
    /// The published model.
    pub const NONE: Self = Self {
        gelu: false,
        hf_window: false,
    };
    /// Hugging Face transformers' Gemma 3.
    pub const HF: Self = Self {
        gelu: true,
        hf_window: true,
    };
}

#[derive(Debug, Clone)]
struct Mlp {
    feed_forward_gate: QMatMul,
    feed_forward_up: QMatMul,
    feed_forward_down: QMatMul,
    gelu: bool,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let gate = self.feed_forward_gate.forward(xs)?;
        let up = self.feed_forward_up.forward(xs)?;
        // PATCH (gelu): Gemma 3's hidden_activation is gelu_pytorch_tanh.
        let act = if self.gelu {
            gate.gelu()?
        } else {
            candle_nn::ops::silu(&gate)?
        };
        let gated = (act * up)?;
        self.feed_forward_down.forward(&gated)
    }
}

#[derive(Debug, Clone)]
struct RotaryEmbedding {
    sin: Tensor,
    cos: Tensor,
}

impl RotaryEmbedding {
    fn new(head_dim: usize, rope_frequency: f32, device: &Device) -> Result<Self> {
        let theta: Vec<_> = (0..head_dim)
            .step_by(2)
            .map(|i| 1f32 / rope_frequency.powf(i as f32 / head_dim as f32))
            .collect();
        let theta = Tensor::new(theta.as_slice(), device)?;
        let idx_theta = Tensor::arange(0, MAX_SEQ_LEN as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((MAX_SEQ_LEN, 1))?
            .matmul(&theta.reshape((1, theta.elem_count()))?)?;
        let cos = idx_theta.cos()?;
        let sin = idx_theta.sin()?;
        Ok(Self { sin, cos })
    }

    fn apply_rotary_emb_qkv(
        &self,
        q: &Tensor,
        k: &Tensor,
        index_pos: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (_b_sz, _h, seq_len, _n_embd) = q.dims4()?;
        let cos = self.cos.narrow(0, index_pos, seq_len)?;
        let sin = self.sin.narrow(0, index_pos, seq_len)?;
        let q_embed = candle_nn::rotary_emb::rope(&q.contiguous()?, &cos, &sin)?;
        let k_embed = candle_nn::rotary_emb::rope(&k.contiguous()?, &cos, &sin)?;
        Ok((q_embed, k_embed))
    }
}

#[derive(Debug, Clone)]
struct LayerWeights {
    attention_wq: QMatMul,
    attention_wk: QMatMul,
    attention_wv: QMatMul,
    attention_wo: QMatMul,
    attention_q_norm: RmsNorm,
    attention_k_norm: RmsNorm,
    attention_norm: RmsNorm,
    post_attention_norm: RmsNorm,
    ffn_norm: RmsNorm,
    post_ffn_norm: RmsNorm,
    mlp: Mlp,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    q_dim: usize,
    sliding_window_size: Option<usize>,
    rotary_embedding: RotaryEmbedding,
    neg_inf: Tensor,
    kv_cache: Option<(Tensor, Tensor)>,
}

impl LayerWeights {
    fn mask(
        &self,
        b_sz: usize,
        seq_len: usize,
        index_pos: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let mask: Vec<_> = if let Some(sliding_window_size) = self.sliding_window_size {
            (0..seq_len)
                .flat_map(|i| {
                    (0..seq_len).map(move |j| {
                        if i < j || j + sliding_window_size < i {
                            0u32
                        } else {
                            1u32
                        }
                    })
                })
                .collect()
        } else {
            (0..seq_len)
                .flat_map(|i| (0..seq_len).map(move |j| if i < j { 0u32 } else { 1u32 }))
                .collect()
        };
        let mask = Tensor::from_slice(&mask, (seq_len, seq_len), device)?;
        let mask = if index_pos > 0 {
            let mask0 = Tensor::zeros((seq_len, index_pos), DType::F32, device)?;
            Tensor::cat(&[&mask0, &mask], D::Minus1)?
        } else {
            mask
        };
        mask.expand((b_sz, 1, seq_len, seq_len + index_pos))?
            .to_dtype(dtype)
    }

    /// PATCH (hf_window): the mask at absolute positions, query `index_pos
    /// + i` against keys `0..index_pos + seq_len`, keeping `key <= query`
    /// and, in sliding layers, `query - key < w`.
    fn hf_mask(
        &self,
        b_sz: usize,
        seq_len: usize,
        index_pos: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let kv_len = index_pos + seq_len;
        let window = self.sliding_window_size;
        let mask: Vec<u32> = (0..seq_len)
            .flat_map(|i| {
                let q = index_pos + i;
                (0..kv_len).map(move |j| {
                    let visible = j <= q && window.is_none_or(|w| q - j < w);
                    u32::from(visible)
                })
            })
            .collect();
        Tensor::from_slice(&mask, (seq_len, kv_len), device)?.expand((b_sz, 1, seq_len, kv_len))
    }

    fn forward_attn(
        &mut self,
        x: &Tensor,
        mask: Option<&Tensor>,
        index_pos: usize,
    ) -> Result<Tensor> {
        let (b_sz, seq_len, _) = x.dims3()?;

        let q = self.attention_wq.forward(x)?;
        let k = self.attention_wk.forward(x)?;
        let v = self.attention_wv.forward(x)?;

        let q = q
            .reshape((b_sz, seq_len, self.n_head, self.head_dim))?
            .transpose(1, 2)?;
        let k = k
            .reshape((b_sz, seq_len, self.n_kv_head, self.head_dim))?
            .transpose(1, 2)?;
        let v = v
            .reshape((b_sz, seq_len, self.n_kv_head, self.head_dim))?
            .transpose(1, 2)?;

        let q = self.attention_q_norm.forward(&q.contiguous()?)?;
        let k = self.attention_k_norm.forward(&k.contiguous()?)?;

        let (q, k) = self
            .rotary_embedding
            .apply_rotary_emb_qkv(&q, &k, index_pos)?;

        let (k, v) = match &self.kv_cache {
            None => (k, v),
            Some((k_cache, v_cache)) => {
                if index_pos == 0 {
                    (k, v)
                } else {
                    let k = Tensor::cat(&[k_cache, &k], 2)?;
                    let v = Tensor::cat(&[v_cache, &v], 2)?;
                    (k, v)
                }
            }
        };
        self.kv_cache = Some((k.clone(), v.clone()));

        let k = candle_transformers::utils::repeat_kv(k, self.n_head / self.n_kv_head)?;
        let v = candle_transformers::utils::repeat_kv(v, self.n_head / self.n_kv_head)?;

        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let mut attn_weights = (q.matmul(&k.transpose(2, 3)?)? * scale)?;

        if let Some(mask) = mask {
            let mask = mask.broadcast_as(attn_weights.shape())?;
            let neg_inf = self.neg_inf.broadcast_as(attn_weights.dims())?;
            attn_weights = mask.eq(0u32)?.where_cond(&neg_inf, &attn_weights)?;
        }

        let attn_weights = candle_nn::ops::softmax_last_dim(&attn_weights)?;
        let attn_output = attn_weights.matmul(&v)?;

        let attn_output = attn_output
            .transpose(1, 2)?
            .reshape((b_sz, seq_len, self.q_dim))?;

        self.attention_wo.forward(&attn_output)
    }
}

/// The model; `forward` returns the logits `(batch, vocab)` of the last
/// position, as the published model does.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    tok_embeddings: Embedding,
    embedding_length: usize,
    layers: Vec<LayerWeights>,
    norm: RmsNorm,
    output: QMatMul,
    patches: Patches,
}

impl ModelWeights {
    /// Loads the GGUF (the published code, `patches` aside).
    pub fn from_gguf<R: std::io::Seek + std::io::Read>(
        ct: gguf_file::Content,
        reader: &mut R,
        device: &Device,
        patches: Patches,
    ) -> Result<Self> {
        let prefix = ["gemma3", "gemma2", "gemma", "gemma-embedding"]
            .iter()
            .find(|p| {
                ct.metadata
                    .contains_key(&format!("{}.attention.head_count", p))
            })
            .copied()
            .unwrap_or("gemma3");

        let md_get = |s: &str| {
            let key = format!("{prefix}.{s}");
            match ct.metadata.get(&key) {
                None => candle_core::bail!("cannot find {key} in metadata"),
                Some(v) => Ok(v),
            }
        };

        let head_count = md_get("attention.head_count")?.to_u32()? as usize;
        let head_count_kv = md_get("attention.head_count_kv")?.to_u32()? as usize;
        let block_count = md_get("block_count")?.to_u32()? as usize;
        let embedding_length = md_get("embedding_length")?.to_u32()? as usize;
        let key_length = md_get("attention.key_length")?.to_u32()? as usize;
        let rms_norm_eps = md_get("attention.layer_norm_rms_epsilon")?.to_f32()? as f64;
        let sliding_window_size = md_get("attention.sliding_window")?.to_u32()? as usize;

        let sliding_window_type = md_get("attention.sliding_window_type")
            .and_then(|m| Ok(m.to_u32()? as usize))
            .unwrap_or(DEFAULT_SLIDING_WINDOW_TYPE);

        let rope_freq_base = md_get("rope.freq_base")
            .and_then(|m| m.to_f32())
            .unwrap_or(DEFAULT_ROPE_FREQUENCY);

        let rope_freq_base_sliding = md_get("rope.local_freq_base")
            .and_then(|m| m.to_f32())
            .unwrap_or(DEFAULT_ROPE_FREQUENCY_SLIDING);

        let q_dim = head_count * key_length;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, device)?;

        let tok_embeddings = ct.tensor(reader, "token_embd.weight", device)?;
        let tok_embeddings = tok_embeddings.dequantize(device)?;
        let norm = RmsNorm::from_qtensor(
            ct.tensor(reader, "output_norm.weight", device)?,
            rms_norm_eps,
        )?;
        let output = match ct.tensor(reader, "output.weight", device) {
            Ok(tensor) => tensor,
            Err(_) => ct.tensor(reader, "token_embd.weight", device)?,
        };

        let mut layers = Vec::with_capacity(block_count);
        for layer_idx in 0..block_count {
            let prefix = format!("blk.{layer_idx}");
            let mut get = |name: &str| -> Result<QTensor> {
                ct.tensor(reader, &format!("{prefix}.{name}.weight"), device)
            };
            let mut norm = |name: &str| RmsNorm::from_qtensor(get(name)?, rms_norm_eps);
            let attention_q_norm = norm("attn_q_norm")?;
            let attention_k_norm = norm("attn_k_norm")?;
            let attention_norm = norm("attn_norm")?;
            let post_attention_norm = norm("post_attention_norm")?;
            let ffn_norm = norm("ffn_norm")?;
            let post_ffn_norm = norm("post_ffw_norm")?;
            let mut mm = |name: &str| QMatMul::from_qtensor(get(name)?);
            let mlp = Mlp {
                feed_forward_gate: mm("ffn_gate")?,
                feed_forward_up: mm("ffn_up")?,
                feed_forward_down: mm("ffn_down")?,
                gelu: patches.gelu,
            };
            let is_sliding = (layer_idx + 1) % sliding_window_type > 0;
            let sliding_window_size = is_sliding.then_some(sliding_window_size);
            let layer_rope_frequency = if is_sliding {
                rope_freq_base_sliding
            } else {
                rope_freq_base
            };
            let rotary_embedding = RotaryEmbedding::new(key_length, layer_rope_frequency, device)?;
            layers.push(LayerWeights {
                attention_wq: mm("attn_q")?,
                attention_wk: mm("attn_k")?,
                attention_wv: mm("attn_v")?,
                attention_wo: mm("attn_output")?,
                attention_q_norm,
                attention_k_norm,
                attention_norm,
                post_attention_norm,
                ffn_norm,
                post_ffn_norm,
                mlp,
                n_head: head_count,
                n_kv_head: head_count_kv,
                head_dim: key_length,
                q_dim,
                sliding_window_size,
                rotary_embedding,
                neg_inf: neg_inf.clone(),
                kv_cache: None,
            })
        }

        Ok(Self {
            tok_embeddings: Embedding::new(tok_embeddings, embedding_length),
            embedding_length,
            layers,
            norm,
            output: QMatMul::from_qtensor(output)?,
            patches,
        })
    }

    /// `x` `(batch, seq_len)` u32 at positions `index_pos..` -> the logits
    /// `(batch, vocab)` of the last position.
    pub fn forward(&mut self, x: &Tensor, index_pos: usize) -> Result<Tensor> {
        let (b_sz, seq_len) = x.dims2()?;

        let mut layer_in = self.tok_embeddings.forward(x)?;
        layer_in = (layer_in * (self.embedding_length as f64).sqrt())?;

        for layer in self.layers.iter_mut() {
            let attention_mask = if self.patches.hf_window {
                // PATCH (hf_window): every step, decodes included.
                Some(layer.hf_mask(b_sz, seq_len, index_pos, x.device())?)
            } else if seq_len == 1 {
                None
            } else {
                Some(layer.mask(b_sz, seq_len, index_pos, x.dtype(), x.device())?)
            };

            let residual = &layer_in;
            let x = layer.attention_norm.forward(&layer_in)?;
            let x = layer.forward_attn(&x, attention_mask.as_ref(), index_pos)?;
            let x = layer.post_attention_norm.forward(&x)?;
            let x = (x + residual)?;

            let residual = &x;
            let x = layer.ffn_norm.forward(&x)?;
            let x = layer.mlp.forward(&x)?;
            let x = layer.post_ffn_norm.forward(&x)?;
            let x = (x + residual)?;

            layer_in = x;
        }

        let x = layer_in.i((.., seq_len - 1, ..))?;
        let x = self.norm.forward(&x)?;
        self.output.forward(&x)
    }
}
