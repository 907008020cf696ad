//! The attention layer: stores a layer's new keys and values in its paged
//! cache and attends over the batch described by [`AttentionMetadata`].
//!
//! Imports `ops` (the two op calls), `params`, `cache`, `metadata` and
//! `batch`; must not import the backends (`cpu`, `cuda`) or `models`.

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::cache::LayerKvCache;
use crate::metadata::{AttentionMetadata, GraphMode};
use crate::ops::paged_attention::paged_attention;
use crate::ops::reshape_and_cache::reshape_and_cache;
use crate::ops::rotary_cache::{rotary_reshape_and_cache, rotate, RotaryRows};
use crate::params::{KvScales, KvSplit, PagedAttentionParams, MAX_HEAD_SIZE};

const OP: &str = "attention";

/// Element type of a layer's KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum KvCacheDtype {
    /// The model's dtype (the dtype of `q`, `k` and `v`).
    #[default]
    Auto,
    /// `F8E4M3`, storing `k / k_scale` and `v / v_scale`.
    Fp8E4M3(KvScales),
}

/// Per-layer options of [`Attention`]; `Default` is plain causal attention
/// with blocks of 16 tokens.
///
/// * `sliding_window` - `Some(w)` keeps keys with `query_pos - key_pos < w`;
///   the layer reads the metadata's window group for `w` when there is one.
/// * `sinks` - `(num_heads,)` logits joining each head's softmax denominator
///   (any float dtype; kept as f32; finite).
/// * `softcap` - `Some(c)`, `c > 0`: scores become `c * tanh(s / c)`.
/// * `alibi_slopes` - `(num_heads,)` ALiBi slopes (any float dtype; kept as
///   f32; finite).
/// * `attention_chunk_size` - chunked local attention: a query at position
///   `p` sees keys in `[floor(p / chunk) * chunk, p]`; a multiple of `block_size`.
/// * `kv_cache_dtype` - the cache's element type (and fp8 scales).
/// * `block_size` - tokens per cache block.
/// * `kv_split` - split-KV policy of the CUDA decode path.
#[derive(Clone, Debug)]
pub struct AttentionOptions {
    /// Keep keys with `query_pos - key_pos < window`.
    pub sliding_window: Option<usize>,
    /// `(num_heads,)` sink logits.
    pub sinks: Option<Tensor>,
    /// Softcap `c > 0` (`None` or 0 is off).
    pub softcap: Option<f32>,
    /// `(num_heads,)` ALiBi slopes.
    pub alibi_slopes: Option<Tensor>,
    /// Chunk size of chunked local attention, a multiple of `block_size`.
    pub attention_chunk_size: Option<usize>,
    /// Cache element type and fp8 scales.
    pub kv_cache_dtype: KvCacheDtype,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Split-KV policy of the CUDA path.
    pub kv_split: KvSplit,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        Self {
            sliding_window: None,
            sinks: None,
            softcap: None,
            alibi_slopes: None,
            attention_chunk_size: None,
            kv_cache_dtype: KvCacheDtype::Auto,
            block_size: 16,
            kv_split: KvSplit::Auto,
        }
    }
}

/// A vLLM-style attention layer over a paged KV cache.
///
/// [`forward`](Self::forward) takes the flat projections of a whole mixed
/// batch (prefills, prefill chunks and decodes together), stores the new keys
/// and values, and runs one paged-attention call.
///
/// # Example
/// The layer of your own model: 2 query heads share 1 KV head of size 4,
/// blocks of 4 tokens. A prompt of 3 tokens is prefilled into block 2, then
/// its 4th token is decoded; the first token sees only itself, so its
/// output is its value (for both query heads).
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_paged_attention::{
///     Attention, AttentionMetadata, AttentionOptions, PagedBatch, SlotMapping,
/// };
///
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let (heads, kv_heads, head_size, block_size) = (2, 1, 4, 4);
/// let options = AttentionOptions { block_size, ..Default::default() };
/// let layer = Attention::new(heads, kv_heads, head_size, 0.5, options)?;
/// let cache = layer.new_cache(4, DType::F32, &dev)?; // 4 blocks of 4 tokens
///
/// // Prefill: rows 0..3 of one sequence of 3 tokens, in block 2 (slots 8..11).
/// let batch = PagedBatch::from_rows(&[0, 3], &[3], &[vec![2]], block_size, &dev)?;
/// let meta = AttentionMetadata::new(batch, SlotMapping::new(&[8, 9, 10], &dev)?)?;
/// let q = Tensor::randn(0f32, 1., (3, heads * head_size), &dev)?;
/// let k = Tensor::randn(0f32, 1., (3, kv_heads * head_size), &dev)?;
/// let v = Tensor::randn(0f32, 1., (3, kv_heads * head_size), &dev)?;
/// let out = layer.forward(&q, &k, &v, &cache, &meta)?;
/// assert_eq!(out.dims(), &[3, heads * head_size]);
/// let v0 = v.get(0)?.to_vec1::<f32>()?;
/// let out0 = out.get(0)?.to_vec1::<f32>()?;
/// for (o, x) in out0.iter().zip(v0.iter().chain(v0.iter())) {
///     assert!((o - x).abs() < 1e-6);
/// }
/// // The keys are in the cache: block 2, rows 0..3.
/// let stored = cache.key().get(2)?.narrow(0, 0, 3)?.flatten_all()?;
/// assert_eq!(stored.to_vec1::<f32>()?, k.flatten_all()?.to_vec1::<f32>()?);
///
/// // Decode the 4th token (position 3, slot 11) over the 3 cached ones.
/// let batch = PagedBatch::from_rows(&[0, 1], &[4], &[vec![2]], block_size, &dev)?;
/// let meta = AttentionMetadata::new(batch, SlotMapping::new(&[11], &dev)?)?;
/// let q = Tensor::randn(0f32, 1., (1, heads * head_size), &dev)?;
/// let kv = Tensor::randn(0f32, 1., (1, kv_heads * head_size), &dev)?;
/// assert_eq!(layer.forward(&q, &kv, &kv, &cache, &meta)?.dims(), &[1, 8]);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Attention {
    num_heads: usize,
    num_kv_heads: usize,
    head_size: usize,
    scale: f32,
    options: AttentionOptions,
}

impl Attention {
    /// A layer with `num_heads` query heads sharing `num_kv_heads` KV heads
    /// of `head_size` elements; scores are `scale * q . k`.
    ///
    /// Every option is checked here, once: sinks and ALiBi slopes are read
    /// back (a device sync on CUDA) and must be finite; fp8 cache scales
    /// must be normal positive floats.
    pub fn new(
        num_heads: usize,
        num_kv_heads: usize,
        head_size: usize,
        scale: f32,
        mut options: AttentionOptions,
    ) -> Result<Self> {
        if num_heads == 0 || num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            bail!("{OP}: num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}");
        }
        if head_size == 0 || head_size > MAX_HEAD_SIZE {
            bail!("{OP}: head_size must be in 1..={MAX_HEAD_SIZE}, got {head_size}");
        }
        if num_heads.checked_mul(head_size).is_none() {
            bail!("{OP}: {num_heads} heads of size {head_size} overflow usize");
        }
        if !scale.is_finite() {
            bail!("{OP}: scale must be finite, got {scale}");
        }
        let bs = options.block_size;
        if bs == 0 {
            bail!("{OP}: block_size must be positive, got 0");
        }
        if options.sliding_window == Some(0) {
            bail!("{OP}: sliding_window must be at least 1, got 0 (use None for no window)");
        }
        if let Some(c) = options.attention_chunk_size {
            if c == 0 || !c.is_multiple_of(bs) {
                bail!(
                    "{OP}: attention_chunk_size {c} must be a positive multiple of block_size {bs}"
                );
            }
        }
        if let Some(c) = options.softcap {
            if !(c >= 0.0 && c.is_finite()) {
                bail!("{OP}: softcap must be finite and >= 0 (0 is off), got {c}");
            }
        }
        if let KvCacheDtype::Fp8E4M3(s) = options.kv_cache_dtype {
            s.validate(OP)?;
        }
        options.sinks = head_vector("sinks", options.sinks.take(), num_heads)?;
        options.alibi_slopes = head_vector("alibi_slopes", options.alibi_slopes.take(), num_heads)?;
        Ok(Self {
            num_heads,
            num_kv_heads,
            head_size,
            scale,
            options,
        })
    }

    /// Query heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// KV heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Elements per head.
    pub fn head_size(&self) -> usize {
        self.head_size
    }

    /// The options the layer was built with (sinks and slopes as f32).
    pub fn options(&self) -> &AttentionOptions {
        &self.options
    }

    /// Dequantisation scales of an fp8 cache (ones otherwise).
    pub fn kv_scales(&self) -> KvScales {
        match self.options.kv_cache_dtype {
            KvCacheDtype::Auto => KvScales::default(),
            KvCacheDtype::Fp8E4M3(s) => s,
        }
    }

    /// Allocates this layer's zeroed cache of `num_blocks` blocks for a model
    /// running in `model_dtype` (the cache is `F8E4M3` for an fp8 layer).
    pub fn new_cache(
        &self,
        num_blocks: usize,
        model_dtype: DType,
        device: &Device,
    ) -> Result<LayerKvCache> {
        LayerKvCache::new(
            num_blocks,
            self.options.block_size,
            self.num_kv_heads,
            self.head_size,
            self.cache_dtype(model_dtype),
            device,
        )
    }

    fn cache_dtype(&self, model_dtype: DType) -> DType {
        match self.options.kv_cache_dtype {
            KvCacheDtype::Auto => model_dtype,
            KvCacheDtype::Fp8E4M3(_) => DType::F8E4M3,
        }
    }

    /// Stores the batch's new keys and values in `cache` and attends.
    ///
    /// # Arguments
    /// * `q` - `(num_tokens, num_heads * head_size)`, f32/f16/bf16.
    /// * `k`, `v` - `(num_tokens, num_kv_heads * head_size)`, the dtype of `q`.
    /// * `cache` - this layer's cache (in the block-id space of the layer's
    ///   window group, when the metadata has one for its window).
    /// * `metadata` - the batch; rows of `q`, `k`, `v` follow its `cu_seqlens_q`.
    ///
    /// Returns `(num_tokens, num_heads * head_size)` in the dtype of `q`.
    pub fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let n = metadata.num_tokens();
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_size);
        for (name, t, heads) in [("q", q, h), ("k", k, kvh), ("v", v, kvh)] {
            if t.dims() != [n, heads * d] {
                bail!(
                    "{OP}: {name} must be [num_tokens = {n}, {heads} heads x {d}], got shape {:?}",
                    t.dims()
                );
            }
            if t.dtype() != q.dtype() {
                bail!("{OP}: {name} is {:?} but q is {:?}", t.dtype(), q.dtype());
            }
        }
        let k = k.reshape((n, kvh, d))?;
        let v = v.reshape((n, kvh, d))?;
        if cache.is_empty() {
            // vLLM's attention layer shortcut: one token attending to itself outputs its
            // value (a one-element softmax is 1), so no cache is needed.
            if metadata.is_single_token_prefill() && self.options.sinks.is_none() {
                return self.single_token_output(&v);
            }
            bail!(
                "{OP}: the layer cache has no blocks; only a single-token prefill without sinks runs without one (got {n} tokens in {} sequences)",
                metadata.num_seqs()
            );
        }
        self.check_cache(cache, q.dtype())?;
        let layer = metadata.for_layer(
            self.options.sliding_window,
            self.options.attention_chunk_size,
        )?;
        let scales = self.kv_scales();
        reshape_and_cache(
            &k,
            &v,
            cache.key(),
            cache.value(),
            layer.slot_mapping,
            scales,
        )?;
        self.attend(q, cache, &layer.batch, metadata)
    }

    /// Like [`forward`](Self::forward) for a joined q/k/v projection whose
    /// queries and keys still need their rotary embedding: rotates them,
    /// stores the keys and values and attends. On CUDA the rotation and the
    /// cache write are one kernel ([`rotary_reshape_and_cache`]); elsewhere
    /// (and for a layer without cache blocks) it runs candle's rotary ops and
    /// [`forward`](Self::forward), with the same results as before fusing.
    ///
    /// # Arguments
    /// * `qkv` - `(num_tokens, (num_heads + 2 * num_kv_heads) * head_size)`:
    ///   query, key, then value heads; in `rows`' dtype or f32 (rounded to
    ///   it first).
    /// * `rows` - the tokens' rotary rows, `(num_tokens, head_size / 2)`,
    ///   in the model's dtype.
    /// * `cache`, `metadata` - as in [`forward`](Self::forward).
    ///
    /// Returns `(num_tokens, num_heads * head_size)` in `rows`' dtype.
    pub fn forward_rotary_qkv(
        &self,
        qkv: &Tensor,
        rows: RotaryRows<'_>,
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_size);
        let n = metadata.num_tokens();
        if qkv.dims() != [n, (h + 2 * kvh) * d] {
            bail!(
                "{OP}: qkv must be [num_tokens = {n}, ({h} + 2 x {kvh} heads) x {d}], got shape {:?}",
                qkv.dims()
            );
        }
        for (name, t) in [("cos", rows.cos), ("sin", rows.sin)] {
            if t.dims() != [n, d / 2] {
                bail!(
                    "{OP}: rotary {name} must be (num_tokens = {n}, head_size / 2 = {}), got shape {:?}: {} rows for {n} tokens",
                    d / 2,
                    t.dims(),
                    t.dims().first().copied().unwrap_or(0)
                );
            }
        }
        if rows.sin.dtype() != rows.cos.dtype() {
            bail!(
                "{OP}: rotary sin is {:?} but cos is {:?}; they must match",
                rows.sin.dtype(),
                rows.cos.dtype()
            );
        }
        if !qkv.device().is_cuda() || cache.is_empty() {
            let qkv = qkv.to_dtype(rows.cos.dtype())?;
            let q = rotate(&qkv.narrow(1, 0, h * d)?, rows, h)?;
            let k = rotate(&qkv.narrow(1, h * d, kvh * d)?, rows, kvh)?;
            let v = qkv.narrow(1, (h + kvh) * d, kvh * d)?;
            return self.forward(&q, &k, &v, cache, metadata);
        }
        self.check_cache(cache, rows.cos.dtype())?;
        let layer = metadata.for_layer(
            self.options.sliding_window,
            self.options.attention_chunk_size,
        )?;
        let q = rotary_reshape_and_cache(
            qkv,
            rows,
            h,
            cache.key(),
            cache.value(),
            layer.slot_mapping,
            self.kv_scales(),
        )?;
        self.attend(&q, cache, &layer.batch, metadata)
    }

    /// Attends `q` `(num_tokens, num_heads * head_size)` over `cache`, whose
    /// new keys and values are stored, for the layer's batch `batch`.
    fn attend(
        &self,
        q: &Tensor,
        cache: &LayerKvCache,
        batch: &crate::batch::PagedBatch,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let (n, h, d) = (metadata.num_tokens(), self.num_heads, self.head_size);
        let scales = self.kv_scales();
        let params = PagedAttentionParams::new(cache.key(), cache.value(), batch, self.scale)
            .with_sliding_window(self.options.sliding_window)
            .with_softcap(self.options.softcap)
            .with_alibi_slopes(self.options.alibi_slopes.clone())
            .with_sinks(self.options.sinks.clone())
            .with_kv_scales(scales)
            .with_kv_split(match (self.options.kv_split, metadata.graph_mode()) {
                (KvSplit::Auto, GraphMode::Replayable { plan_keys }) => {
                    KvSplit::AutoUpTo(u32::try_from(plan_keys).unwrap_or(u32::MAX))
                }
                (split, _) => split,
            });
        let q = q.reshape((n, h, d))?;
        paged_attention(&q, &params)?.reshape((n, h * d))
    }

    /// `v` `(1, num_kv_heads, head_size)` repeated for each query head of a group.
    fn single_token_output(&self, v: &Tensor) -> Result<Tensor> {
        let (kvh, d) = (self.num_kv_heads, self.head_size);
        let group = self.num_heads / kvh;
        v.reshape((1, kvh, 1, d))?
            .broadcast_as((1, kvh, group, d))?
            .reshape((1, self.num_heads * d))
    }

    fn check_cache(&self, cache: &LayerKvCache, q_dtype: DType) -> Result<()> {
        let expected = (self.options.block_size, self.num_kv_heads, self.head_size);
        let got = (cache.block_size(), cache.num_kv_heads(), cache.head_size());
        if got != expected {
            bail!(
                "{OP}: cache has (block_size, num_kv_heads, head_size) = {got:?} but the layer expects {expected:?}"
            );
        }
        let dtype = self.cache_dtype(q_dtype);
        if cache.dtype() != dtype {
            bail!(
                "{OP}: cache is {:?} but the layer's kv_cache_dtype needs {dtype:?}",
                cache.dtype()
            );
        }
        Ok(())
    }
}

/// A per-head vector converted to f32 and checked to be finite, once, when
/// the layer is built (the op itself does not read it back from the device;
/// there a NaN would only turn the rows it touches into NaN).
fn head_vector(name: &str, t: Option<Tensor>, num_heads: usize) -> Result<Option<Tensor>> {
    let Some(t) = t else { return Ok(None) };
    if t.dims() != [num_heads] {
        bail!(
            "{OP}: {name} must have shape [num_heads = {num_heads}], got {:?}",
            t.dims()
        );
    }
    let t = t.to_dtype(DType::F32)?;
    let values = t.to_vec1::<f32>()?;
    if let Some((h, x)) = values.iter().enumerate().find(|(_, x)| !x.is_finite()) {
        bail!("{OP}: {name}[{h}] is {x}; {name} must be finite");
    }
    Ok(Some(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{PagedBatch, SlotMapping};

    #[test]
    fn rejects_bad_options() {
        let err = Attention::new(6, 4, 8, 1.0, AttentionOptions::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("num_heads 6 must be a positive multiple of num_kv_heads 4"),
            "{err}"
        );
        let opts = AttentionOptions {
            attention_chunk_size: Some(20),
            ..Default::default()
        };
        let err = Attention::new(4, 4, 8, 1.0, opts).unwrap_err();
        assert!(err.to_string().contains("attention_chunk_size 20"), "{err}");
        let opts = AttentionOptions {
            sinks: Some(Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap()),
            ..Default::default()
        };
        assert!(Attention::new(4, 4, 8, 1.0, opts).is_err());
    }

    #[test]
    fn single_token_prefill_without_cache_outputs_values() {
        let dev = Device::Cpu;
        let layer = Attention::new(4, 2, 3, 0.5, AttentionOptions::default()).unwrap();
        let cache = layer.new_cache(0, DType::F32, &dev).unwrap();
        let batch = PagedBatch::from_rows(&[0, 1], &[1], &[vec![0]], 16, &dev).unwrap();
        let meta = AttentionMetadata::new(batch, SlotMapping::new(&[-1], &dev).unwrap()).unwrap();
        let q = Tensor::ones((1, 12), DType::F32, &dev).unwrap();
        let k = Tensor::ones((1, 6), DType::F32, &dev).unwrap();
        let v = Tensor::arange(0f32, 6., &dev)
            .unwrap()
            .reshape((1, 6))
            .unwrap();
        let out = layer.forward(&q, &k, &v, &cache, &meta).unwrap();
        assert_eq!(
            out.to_vec2::<f32>().unwrap(),
            [[0., 1., 2., 0., 1., 2., 3., 4., 5., 3., 4., 5.]]
        );
    }
}
