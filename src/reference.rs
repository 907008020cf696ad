//! A naive paged attention in f64: the executable specification of
//! [`paged_attention`](crate::paged_attention) and the oracle its tests
//! compare every backend with.
//!
//! [`paged_attention_f64`] computes dense attention one sequence and one query
//! head at a time, over keys and values gathered page by page through the
//! block table, with the visibility of each (query, key) pair built as
//! explicit boolean matrices ([`visibility`]). It covers every feature of the
//! op: causal masking, sliding windows, bidirectional prefix ranges
//! (half-open), softcapping, ALiBi, attention sinks, the query-query bias,
//! `F8E4M3` caches with their k/v scales, GQA/MQA and an fp8 output scale.
//!
//! It is written to be read, not to be fast: it copies the query and both
//! caches to the host, gathers a sequence's keys per KV head and accumulates
//! in f64, so it suits test-sized calls. It shares no code with the CPU
//! kernel (`src/cpu`); it only reads the same tensors, after the op's own
//! validation ([`PagedAttentionParams::validate`]).
//!
//! # Indexing
//! Every index below stays in range, and no slice is chunked by zero,
//! because validation succeeded: query rows lie below `num_tokens`
//! (`cu_seqlens_q` ends there), `head_size` is at least 1, heads lie below
//! `num_heads`, KV heads below `num_kv_heads` (`num_heads` is a multiple of
//! it), the block ids of a sequence's pages below `num_blocks`, block tables
//! are wide enough for every `seq_len`, `q_len <= seq_len`, head vectors
//! hold `num_heads` entries and `qq_bias` has at least `max q_len` rows.
//!
//! # Example
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_paged_attention::{reference, PagedAttentionParams, PagedBatch};
//!
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let cache = Tensor::randn(0f32, 1., (2, 4, 1, 8), &dev)?;
//! // One prefill of 3 tokens in block 1, 2 query heads over 1 KV head.
//! let batch = PagedBatch::from_rows(&[0, 3], &[3], &[vec![1]], 4, &dev)?;
//! let params = PagedAttentionParams::new(&cache, &cache, &batch, 0.35);
//! let q = Tensor::randn(0f32, 1., (3, 2, 8), &dev)?;
//! let expected = reference::paged_attention_f64(&q, &params)?;
//! assert_eq!(expected.dims(), [3, 2, 8]);
//! assert_eq!(expected.to_tensor()?.dtype(), DType::F64);
//! # Ok(())
//! # }
//! ```
//!
//! Imports nothing from this crate (it links to the op in docs only); the
//! library code must not call it: it is an oracle, not a backend.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};

use crate::{AttentionDims, PagedAttentionParams};

/// Largest finite `F8E4M3` magnitude.
const FP8_MAX: f64 = 448.0;

/// The reference's answer for one call.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceOutput {
    dims: [usize; 3],
    values: Vec<f64>,
    empty_rows: Vec<bool>,
}

impl ReferenceOutput {
    fn zeros(dims: &AttentionDims) -> Self {
        let (n, h, d) = (dims.num_tokens, dims.num_heads, dims.head_size);
        Self {
            dims: [n, h, d],
            values: vec![0.0; n * h * d],
            empty_rows: vec![false; n * h],
        }
    }

    /// `[num_tokens, num_heads, head_size]`.
    pub fn dims(&self) -> [usize; 3] {
        self.dims
    }

    /// The output, row-major `(num_tokens, num_heads, head_size)`, in the
    /// attention domain: with an output scale `s` the op returns `F8E4M3`
    /// holding `clamp(o / s, -448, 448)`, and this holds that value times `s`
    /// (before fp8 rounding).
    pub fn values(&self) -> &[f64] {
        &self.values
    }

    /// Row-major `(num_tokens, num_heads)`: true where the query row sees no
    /// key at all (every score masked or `-inf`); its output is zero.
    pub fn empty_rows(&self) -> &[bool] {
        &self.empty_rows
    }

    /// The values as an f64 tensor `(num_tokens, num_heads, head_size)` on
    /// the CPU.
    pub fn to_tensor(&self) -> Result<Tensor> {
        Tensor::from_slice(&self.values, &self.dims, &Device::Cpu)
    }
}

/// Paged attention computed naively in f64 on the host.
///
/// # Arguments
/// * `q` - query, `(num_tokens, num_heads, head_size)`, f32/f16/bf16, on any
///   device.
/// * `params` - the caches, batch and options exactly as
///   [`paged_attention`](crate::paged_attention) takes them; `kv_split` has no
///   effect on the result.
///
/// Returns the output `(num_tokens, num_heads, head_size)` in f64 and the
/// rows that see no key; see [`ReferenceOutput`]. Fails with the op's own
/// validation errors.
pub fn paged_attention_f64(q: &Tensor, params: &PagedAttentionParams) -> Result<ReferenceOutput> {
    let dims = params.validate(q.dtype(), q.shape(), q.device())?;
    let call = HostCall::read(q, params, dims)?;
    let mut out = ReferenceOutput::zeros(&dims);
    for seq in 0..params.batch.num_seqs() {
        call.attend_sequence(seq, &mut out);
    }
    if let Some(s) = params.output_scale {
        saturate_fp8(&mut out.values, s as f64);
    }
    Ok(out)
}

/// Which keys each query row of one sequence sees: `vis[j][t]` for query row
/// `j` (absolute position `seq_len - q_len + j`) and key `t < seq_len`.
///
/// Three explicit masks combined elementwise: `(causal AND window) OR
/// prefix`, where `window` keeps `query - key < w` and `prefix` holds where
/// query and key lie in one half-open range of `ranges` (so a query inside a
/// range also sees the range's keys after it).
pub fn visibility(
    q_len: usize,
    seq_len: usize,
    window: Option<usize>,
    ranges: &[Range<u32>],
) -> Vec<Vec<bool>> {
    let context = seq_len.saturating_sub(q_len);
    let causal = mask(q_len, seq_len, |query, key| key <= query, context);
    let in_window = mask(
        q_len,
        seq_len,
        |query, key| within_window(query, key, window),
        context,
    );
    let prefix = mask(
        q_len,
        seq_len,
        |query, key| in_one_range(query, key, ranges),
        context,
    );
    causal
        .iter()
        .zip(&in_window)
        .zip(&prefix)
        .map(|((c, w), p)| {
            c.iter()
                .zip(w)
                .zip(p)
                .map(|((&c, &w), &p)| (c && w) || p)
                .collect()
        })
        .collect()
}

/// A `q_len x seq_len` boolean matrix: `rule(query position, key position)`.
fn mask(
    q_len: usize,
    seq_len: usize,
    rule: impl Fn(usize, usize) -> bool,
    context: usize,
) -> Vec<Vec<bool>> {
    (0..q_len)
        .map(|j| (0..seq_len).map(|t| rule(context + j, t)).collect())
        .collect()
}

/// The window keeps `query - key < w`; it says nothing about keys after the
/// query (the causal mask does).
fn within_window(query: usize, key: usize, window: Option<usize>) -> bool {
    match window {
        Some(w) => key > query || query - key < w,
        None => true,
    }
}

fn in_one_range(query: usize, key: usize, ranges: &[Range<u32>]) -> bool {
    ranges.iter().any(|r| {
        let r = r.start as usize..r.end as usize;
        r.contains(&query) && r.contains(&key)
    })
}

/// `clamp(v / s, -448, 448) * s`: what an fp8 output with scale `s` can hold.
fn saturate_fp8(values: &mut [f64], s: f64) {
    for v in values {
        *v = (*v / s).clamp(-FP8_MAX, FP8_MAX) * s;
    }
}

/// Copies a tensor's stored values to the host as f32 (exact for every
/// dtype the op takes; through f32 because candle-core 0.11.1 hangs
/// converting `F8E4M3` to f64).
fn host_values(t: &Tensor) -> Result<Vec<f32>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}

fn host_option(t: &Option<Tensor>) -> Result<Option<Vec<f32>>> {
    t.as_ref().map(host_values).transpose()
}

/// One validated call with every input copied to the host.
struct HostCall<'a> {
    params: &'a PagedAttentionParams,
    dims: AttentionDims,
    /// `(num_tokens, num_heads, head_size)`.
    q: Vec<f32>,
    /// `(num_blocks, block_size, num_kv_heads, head_size)`, as stored.
    key_cache: Vec<f32>,
    value_cache: Vec<f32>,
    /// Multipliers of stored keys and values: the k/v scales for an `F8E4M3`
    /// cache, 1 otherwise.
    key_mul: f64,
    value_mul: f64,
    alibi_slopes: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
    /// Row-major `(rows, cols)` bias and `cols`.
    qq_bias: Option<(Vec<f32>, usize)>,
}

impl<'a> HostCall<'a> {
    fn read(q: &Tensor, params: &'a PagedAttentionParams, dims: AttentionDims) -> Result<Self> {
        let (key_mul, value_mul) = if params.key_cache.dtype() == DType::F8E4M3 {
            (
                params.kv_scales.k_scale as f64,
                params.kv_scales.v_scale as f64,
            )
        } else {
            (1.0, 1.0)
        };
        let qq_bias = match &params.qq_bias {
            Some(b) => Some((host_values(b)?, b.dim(1)?)),
            None => None,
        };
        Ok(Self {
            params,
            dims,
            q: host_values(q)?,
            key_cache: host_values(&params.key_cache)?,
            value_cache: host_values(&params.value_cache)?,
            key_mul,
            value_mul,
            alibi_slopes: host_option(&params.alibi_slopes)?,
            sinks: host_option(&params.sinks)?,
            qq_bias,
        })
    }

    /// Attends every query row of sequence `seq`, writing its rows of `out`.
    fn attend_sequence(&self, seq: usize, out: &mut ReferenceOutput) {
        let host = self.params.batch.host();
        let first_row = host.cu_seqlens_q()[seq] as usize;
        let q_len = host.q_len(seq).unwrap_or(0);
        let seq_len = host.seq_lens()[seq] as usize;
        let ranges = host.prefix_ranges().get(seq).map_or(&[][..], Vec::as_slice);
        let vis = visibility(q_len, seq_len, self.params.sliding_window, ranges);
        let span = Span {
            first_row,
            context: seq_len - q_len,
        };
        let (h, d) = (self.dims.num_heads, self.dims.head_size);
        let group = self.dims.group_size();
        for kv_head in 0..self.dims.num_kv_heads {
            let pages = self.gather(seq, kv_head, seq_len);
            for head in kv_head * group..(kv_head + 1) * group {
                for (j, visible) in vis.iter().enumerate() {
                    let row = (span.first_row + j) * h + head;
                    let scores = self.scores(&span, head, j, &pages.keys, visible);
                    match self.weighted_values(&scores, &pages.values, head) {
                        Some(o) => out.values[row * d..(row + 1) * d].copy_from_slice(&o),
                        None => out.empty_rows[row] = true,
                    }
                }
            }
        }
    }

    /// Keys and values `0..seq_len` of KV head `kv_head` of sequence `seq`,
    /// gathered page by page through its block table and dequantised.
    fn gather(&self, seq: usize, kv_head: usize, seq_len: usize) -> Pages {
        let host = self.params.batch.host();
        let table = host.block_table(seq);
        let (bs, kvh, d) = (
            host.block_size(),
            self.dims.num_kv_heads,
            self.dims.head_size,
        );
        let mut pages = Pages {
            keys: Vec::with_capacity(seq_len * d),
            values: Vec::with_capacity(seq_len * d),
        };
        for t in 0..seq_len {
            let block = table[t / bs] as usize;
            let off = ((block * bs + t % bs) * kvh + kv_head) * d;
            let key = &self.key_cache[off..off + d];
            let value = &self.value_cache[off..off + d];
            pages
                .keys
                .extend(key.iter().map(|&x| x as f64 * self.key_mul));
            pages
                .values
                .extend(value.iter().map(|&x| x as f64 * self.value_mul));
        }
        pages
    }

    /// Scores of query row `j` of `span` (head `head`) against every key:
    /// `scale * q.k`, softcapped, plus ALiBi and the qq bias; `-inf` where
    /// the key is not visible.
    fn scores(
        &self,
        span: &Span,
        head: usize,
        j: usize,
        keys: &[f64],
        visible: &[bool],
    ) -> Vec<f64> {
        let (h, d) = (self.dims.num_heads, self.dims.head_size);
        let q_off = ((span.first_row + j) * h + head) * d;
        let q: Vec<f64> = self.q[q_off..q_off + d].iter().map(|&x| x as f64).collect();
        let softcap = self.params.softcap.filter(|&c| c > 0.0).map(f64::from);
        let scale = self.params.scale as f64;
        keys.chunks_exact(d)
            .zip(visible)
            .enumerate()
            .map(|(t, (key, &visible))| {
                if !visible {
                    return f64::NEG_INFINITY;
                }
                let mut s = scale * q.iter().zip(key).map(|(a, b)| a * b).sum::<f64>();
                if let Some(c) = softcap {
                    s = c * (s / c).tanh();
                }
                self.add_bias(s, span, head, j, t)
            })
            .collect()
    }

    /// Adds the ALiBi and qq-bias terms for key `t` of query row `j` to `s`:
    /// both are indexed by the key's position among the new tokens,
    /// `t - context` (ALiBi is negative over the context).
    fn add_bias(&self, mut s: f64, span: &Span, head: usize, j: usize, t: usize) -> f64 {
        let rel = t as i64 - span.context as i64;
        if let Some(slopes) = &self.alibi_slopes {
            s += slopes[head] as f64 * rel as f64;
        }
        if let Some((bias, cols)) = &self.qq_bias {
            if rel >= 0 && (rel as usize) < *cols {
                s += bias[j * cols + rel as usize] as f64;
            }
        }
        s
    }

    /// Softmax of `scores` (with head `head`'s sink logit, if any, in the
    /// denominator only) applied to `values`; `None` when every score is
    /// `-inf` (the row sees no key).
    fn weighted_values(&self, scores: &[f64], values: &[f64], head: usize) -> Option<Vec<f64>> {
        let d = self.dims.head_size;
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return None;
        }
        let sink = self.sinks.as_ref().map(|s| s[head] as f64);
        let m = sink.map_or(max, |s| s.max(max));
        let mut denom = sink.map_or(0.0, |s| (s - m).exp());
        let mut out = vec![0f64; d];
        for (&s, value) in scores.iter().zip(values.chunks_exact(d)) {
            if s == f64::NEG_INFINITY {
                continue;
            }
            let p = (s - m).exp();
            denom += p;
            for (o, &v) in out.iter_mut().zip(value) {
                *o += p * v;
            }
        }
        out.iter_mut().for_each(|o| *o /= denom);
        Some(out)
    }
}

/// Where one sequence's rows sit.
struct Span {
    /// Its first row of the flat query.
    first_row: usize,
    /// Keys before its first new token.
    context: usize,
}

/// One sequence's keys and values for one KV head, `(seq_len, head_size)`.
struct Pages {
    keys: Vec<f64>,
    values: Vec<f64>,
}
