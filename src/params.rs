//! The parameters of the two ops and the facts derived from them, shared by
//! the validation in `ops` and by both backends.
//!
//! Owns [`PagedAttentionParams`], [`AttentionDims`], [`KvSplit`],
//! [`KvScales`] (with the one rule of which scales a cache uses,
//! [`PagedAttentionParams::effective_kv_scales`]), [`MAX_HEAD_SIZE`] and the
//! backends' view of a cache write (`CacheWrite`).
//!
//! A leaf below `ops`, `cpu` and `cuda`: it imports only `batch` from this
//! crate, never `ops`, `cpu`, `cuda` or anything above them.

use candle_core::{bail, DType, Result, Tensor};

use crate::batch::PagedBatch;

/// Largest head size the kernels accept.
pub const MAX_HEAD_SIZE: usize = 512;

/// How the CUDA path splits the keys of the decode-shaped programs across
/// segments (their partials merged by the last program of each group, in
/// the same launch, for the stream-decode instances; by a reduce launch for
/// the unified kernel's).
/// The CPU path computes the same function whatever the choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvSplit {
    /// Split-KV (segments + reduction) for the decode-shaped programs of a
    /// batch (a decode-only batch, or the decode part of a mixed one) when
    /// they are too few to fill the GPU; the segment count follows the SM
    /// count and the context lengths. Prefill-shaped programs never split.
    #[default]
    Auto,
    /// Always the single-pass (2D) kernel.
    Never,
    /// Always the split-KV path with this many segments per sequence (at
    /// least 1), whatever the batch (prefill-shaped launches then merge
    /// their partials in a second, reduction launch).
    Segments(u32),
    /// As [`Auto`](Self::Auto), but planned for sequences of up to this
    /// many keys instead of the batch's own lengths, so the launches depend
    /// only on the batch's shape (sequences, tokens, table width): what a
    /// CUDA graph replayed with new lengths needs. Empty segments of a
    /// shorter sequence exit at once. A batch with prefills (not every
    /// sequence one new token) launches both parts of a mixed batch, the
    /// decode-shaped one and the prefill one, whichever sequences it has
    /// (a program of a part without sequences exits at once), the prefill
    /// tile chosen for the token count.
    AutoUpTo(u32),
}

/// Everything `paged_attention` needs besides the query.
///
/// # Tensors
/// * `key_cache`, `value_cache` - `(num_blocks, block_size, num_kv_heads, head_size)`,
///   contiguous, the query's dtype or `F8E4M3` (then read as `x * k_scale` / `x * v_scale`).
/// * `alibi_slopes` - `(num_heads,)` f32: adds `slope[h] * (key - context_len)`.
/// * `sinks` - `(num_heads,)` f32: one logit per head that joins the softmax
///   denominator and carries no value.
/// * `qq_bias` - `(rows, cols)` f32 with `rows >= max q_len`: adds
///   `qq_bias[q_rel][key - context_len]` for keys among the new tokens
///   (`0 <= key - context_len < cols`).
///
/// # Scalars
/// * `scale` - multiplies `q . k` (usually `1 / sqrt(head_size)`).
/// * `sliding_window` - `Some(w)` keeps keys with `query_pos - key_pos < w`.
/// * `softcap` - `Some(c)` with `c > 0` maps scores to `c * tanh(s / c)`;
///   `None` or `Some(0.0)` is off.
/// * `kv_scales` - dequantisation scales of an `F8E4M3` cache; normal
///   positive floats.
/// * `output_scale` - `Some(s)` returns `F8E4M3` holding `clamp(out / s)`;
///   `s` a normal positive float.
/// * `kv_split` - split-KV policy of the CUDA path.
///
/// The op does not read `alibi_slopes`, `sinks` or `qq_bias` back to check
/// their values (on CUDA that would be a device sync per call); a NaN there,
/// like a NaN or +inf sink, makes the rows it touches NaN.
/// [`Attention::new`](crate::Attention::new) rejects non-finite slopes and
/// sinks once, when a layer is built.
#[derive(Clone, Debug)]
pub struct PagedAttentionParams {
    /// `(num_blocks, block_size, num_kv_heads, head_size)`, the query's dtype or `F8E4M3`.
    pub key_cache: Tensor,
    /// Same shape and dtype as `key_cache`.
    pub value_cache: Tensor,
    /// The sequences: query spans, key counts, block tables, prefix ranges.
    pub batch: PagedBatch,
    /// Multiplies `q . k`.
    pub scale: f32,
    /// `Some(w)` keeps keys with `query_pos - key_pos < w`.
    pub sliding_window: Option<usize>,
    /// `Some(c)`, `c > 0`: scores become `c * tanh(s / c)`; `None` or 0 is off.
    pub softcap: Option<f32>,
    /// `(num_heads,)` f32 ALiBi slopes.
    pub alibi_slopes: Option<Tensor>,
    /// `(num_heads,)` f32 sink logits.
    pub sinks: Option<Tensor>,
    /// `(rows, cols)` f32 query-query bias, `rows >= max q_len`.
    pub qq_bias: Option<Tensor>,
    /// Dequantisation scales of an `F8E4M3` cache (ignored otherwise).
    pub kv_scales: KvScales,
    /// `Some(s)`: `F8E4M3` output holding `clamp(out / s, -448, 448)`.
    pub output_scale: Option<f32>,
    /// Split-KV policy of the CUDA path.
    pub kv_split: KvSplit,
}

impl PagedAttentionParams {
    /// Causal attention over `batch` with the given caches and score scale;
    /// every optional feature off.
    pub fn new(key_cache: &Tensor, value_cache: &Tensor, batch: &PagedBatch, scale: f32) -> Self {
        Self {
            key_cache: key_cache.clone(),
            value_cache: value_cache.clone(),
            batch: batch.clone(),
            scale,
            sliding_window: None,
            softcap: None,
            alibi_slopes: None,
            sinks: None,
            qq_bias: None,
            kv_scales: KvScales::default(),
            output_scale: None,
            kv_split: KvSplit::Auto,
        }
    }

    /// Keeps keys with `query_pos - key_pos < window`.
    pub fn with_sliding_window(mut self, window: Option<usize>) -> Self {
        self.sliding_window = window;
        self
    }

    /// Soft-caps scores at `cap` (`None` or 0 is off).
    pub fn with_softcap(mut self, cap: Option<f32>) -> Self {
        self.softcap = cap;
        self
    }

    /// ALiBi slopes, `(num_heads,)` f32.
    pub fn with_alibi_slopes(mut self, slopes: Option<Tensor>) -> Self {
        self.alibi_slopes = slopes;
        self
    }

    /// Attention sinks, `(num_heads,)` f32 logits.
    pub fn with_sinks(mut self, sinks: Option<Tensor>) -> Self {
        self.sinks = sinks;
        self
    }

    /// Query-query bias, `(rows, cols)` f32.
    pub fn with_qq_bias(mut self, bias: Option<Tensor>) -> Self {
        self.qq_bias = bias;
        self
    }

    /// Dequantisation scales for an `F8E4M3` cache.
    pub fn with_kv_scales(mut self, scales: KvScales) -> Self {
        self.kv_scales = scales;
        self
    }

    /// Returns `F8E4M3` output holding `clamp(out / scale, -448, 448)`.
    pub fn with_output_scale(mut self, scale: Option<f32>) -> Self {
        self.output_scale = scale;
        self
    }

    /// Split-KV policy of the CUDA path.
    pub fn with_kv_split(mut self, split: KvSplit) -> Self {
        self.kv_split = split;
        self
    }

    /// Softcap value when it is on.
    pub fn active_softcap(&self) -> Option<f32> {
        self.softcap.filter(|&c| c > 0.0)
    }

    /// The scales attention reads the caches with: `kv_scales` for an
    /// `F8E4M3` cache, 1 for a cache of the model's own dtype (whose values
    /// are stored unscaled). The one place of this rule for both backends.
    pub fn effective_kv_scales(&self) -> KvScales {
        if self.key_cache.dtype() == DType::F8E4M3 {
            self.kv_scales
        } else {
            KvScales::default()
        }
    }

    /// The output dtype for a query of dtype `q_dtype`.
    pub fn output_dtype(&self, q_dtype: DType) -> DType {
        if self.output_scale.is_some() {
            DType::F8E4M3
        } else {
            q_dtype
        }
    }
}

/// Sizes of one validated call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Query rows (dimension 0 of `q`).
    pub num_tokens: usize,
    /// Query heads (dimension 1 of `q`).
    pub num_heads: usize,
    /// KV heads (dimension 2 of the caches).
    pub num_kv_heads: usize,
    /// Head size (dimension 2 of `q`, 3 of the caches).
    pub head_size: usize,
    /// Cache blocks (dimension 0 of the caches).
    pub num_blocks: usize,
    /// Tokens per block (dimension 1 of the caches).
    pub block_size: usize,
}

impl AttentionDims {
    /// Query heads per KV head (0 when `num_kv_heads` is 0, which validated
    /// dimensions never are).
    pub fn group_size(&self) -> usize {
        self.num_heads.checked_div(self.num_kv_heads).unwrap_or(0)
    }
}

/// Scales of an `F8E4M3` KV cache: the cache stores `k / k_scale` and
/// `v / v_scale`; attention reads `x * k_scale` and `x * v_scale`.
/// Ignored for caches of the model's own dtype.
///
/// Both must be normal, finite and positive (`f32::MIN_POSITIVE ..= f32::MAX`):
/// a subnormal scale has no finite reciprocal and would store NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScales {
    /// Keys are stored as `k / k_scale` and read as `x * k_scale`.
    pub k_scale: f32,
    /// Values are stored as `v / v_scale` and read as `x * v_scale`.
    pub v_scale: f32,
}

impl Default for KvScales {
    fn default() -> Self {
        Self {
            k_scale: 1.0,
            v_scale: 1.0,
        }
    }
}

impl KvScales {
    /// Both scales.
    pub fn new(k_scale: f32, v_scale: f32) -> Self {
        Self { k_scale, v_scale }
    }

    pub(crate) fn validate(&self, op: &str) -> Result<()> {
        check_scale(op, "k_scale", self.k_scale)?;
        check_scale(op, "v_scale", self.v_scale)
    }
}

/// Checks that a multiplicative scale is a positive, finite, normal float
/// (at least `f32::MIN_POSITIVE`), so that its reciprocal is finite too.
pub(crate) fn check_scale(op: &str, name: &str, s: f32) -> Result<()> {
    if !(s > 0.0 && s.is_finite()) {
        bail!("{op}: {name} must be finite and > 0, got {s}");
    }
    if s < f32::MIN_POSITIVE {
        bail!(
            "{op}: {name} {s:e} is subnormal; it must be at least f32::MIN_POSITIVE = {:e} so that 1 / {name} is finite",
            f32::MIN_POSITIVE
        );
    }
    Ok(())
}

/// What a validated call writes: `num_tokens` rows of `row` elements into a
/// cache of `capacity` rows, multiplied by `inv_scale` for an fp8 cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CacheWrite {
    /// Tokens (rows of `new`, entries of the slot mapping).
    pub num_tokens: usize,
    /// Elements per token: `num_kv_heads * head_size`.
    pub row: usize,
    /// Cache rows: `num_blocks * block_size`; valid slots are `0..capacity`.
    pub capacity: usize,
    /// `1 / scale` for an `F8E4M3` cache (finite: the scale is normal), else 1.
    pub inv_scale: f32,
}

/// The activation of a gated MLP, `act(gate) * up`
/// ([`gated_activation`](crate::gated_activation)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatedActivation {
    /// `x * sigmoid(x)` (Llama's SwiGLU).
    Silu,
    /// The tanh approximation of GELU (Gemma's GeGLU,
    /// `gelu_pytorch_tanh`).
    GeluTanh,
}
