//! Shared test support for the paged-attention suites.
//!
//! * An independent oracle: dense attention in f64 over keys and values
//!   gathered page by page through the block table, with the visibility
//!   masks built as explicit boolean matrices. It never calls the crate's CPU
//!   path; it only reads the same stored values (after any dtype rounding).
//! * [`Case`]: a seeded description of one call (sequence mix, head shapes,
//!   dtypes, features) that builds fresh random inputs on any device. Cache
//!   rows that no query may see are filled with NaN, so a masked key that
//!   leaks into an output shows up as a non-finite value.
//! * Case bodies that take the device: [`check_case`] runs the op and checks
//!   it against the oracle; [`op_output`] and [`compare`] let another suite
//!   compare two devices on the same case.
//!
//! Each test binary uses a different subset of this module.
#![allow(dead_code)]

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    paged_attention, KvScales, KvSplit, PagedAttentionParams, PagedBatch,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// Largest finite `F8E4M3` magnitude.
pub const FP8_MAX: f64 = 448.0;

/// How a case builds its query-query bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QqBias {
    /// No bias.
    Off,
    /// Finite random entries; the column count is random, so some new
    /// tokens may lie past the last column and get no bias.
    Random,
    /// Random entries plus `-inf` at `[0][0]` (the first query row of a
    /// prefill sees only key 0, so that row has no visible key at all) and
    /// at a few random places.
    WithNegInf,
}

/// How a case builds its bidirectional prefix ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prefix {
    /// No ranges.
    Off,
    /// One or two random half-open ranges per sequence (one of them reaching
    /// into the new tokens, so queries see keys after themselves; sometimes
    /// an empty one).
    Random,
    /// These ranges, one list per sequence.
    Explicit(Vec<Vec<Range<u32>>>),
}

/// One paged-attention call, described by its shapes and features; the data
/// comes from a RNG seeded with `seed`.
#[derive(Clone, Debug)]
pub struct Case {
    /// `(q_len, seq_len)` per sequence.
    pub seqs: Vec<(usize, usize)>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub block_size: usize,
    /// Cache blocks; `None` picks the number of blocks the batch needs plus
    /// three (block ids are drawn with replacement, so they still repeat).
    pub num_blocks: Option<usize>,
    /// Query dtype (and cache dtype unless `fp8_cache`).
    pub dtype: DType,
    /// `F8E4M3` caches read as `x * k_scale` / `x * v_scale`.
    pub fp8_cache: bool,
    /// Always passed to the op; it must ignore them for non-fp8 caches.
    pub kv_scales: KvScales,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    pub alibi: bool,
    pub sinks: bool,
    pub qq_bias: QqBias,
    pub prefix: Prefix,
    pub output_scale: Option<f32>,
    pub kv_split: KvSplit,
    /// Fill cache rows that no query may see with NaN.
    pub nan_garbage: bool,
    pub seed: u64,
}

impl Case {
    /// Causal attention, every feature off, caches of the query dtype.
    pub fn new(
        seqs: &[(usize, usize)],
        (num_heads, num_kv_heads): (usize, usize),
        head_size: usize,
        block_size: usize,
        dtype: DType,
    ) -> Self {
        Self {
            seqs: seqs.to_vec(),
            num_heads,
            num_kv_heads,
            head_size,
            block_size,
            num_blocks: None,
            dtype,
            fp8_cache: false,
            kv_scales: KvScales::new(0.75, 1.25),
            window: None,
            softcap: None,
            alibi: false,
            sinks: false,
            qq_bias: QqBias::Off,
            prefix: Prefix::Off,
            output_scale: None,
            kv_split: KvSplit::Auto,
            nan_garbage: true,
            seed: 0,
        }
    }

    pub fn with_fp8_cache(mut self, on: bool) -> Self {
        self.fp8_cache = on;
        self
    }
    pub fn with_kv_scales(mut self, k_scale: f32, v_scale: f32) -> Self {
        self.kv_scales = KvScales::new(k_scale, v_scale);
        self
    }
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }
    pub fn with_alibi(mut self, on: bool) -> Self {
        self.alibi = on;
        self
    }
    pub fn with_sinks(mut self, on: bool) -> Self {
        self.sinks = on;
        self
    }
    pub fn with_qq_bias(mut self, bias: QqBias) -> Self {
        self.qq_bias = bias;
        self
    }
    pub fn with_prefix(mut self, prefix: Prefix) -> Self {
        self.prefix = prefix;
        self
    }
    pub fn with_output_scale(mut self, scale: Option<f32>) -> Self {
        self.output_scale = scale;
        self
    }
    pub fn with_kv_split(mut self, split: KvSplit) -> Self {
        self.kv_split = split;
        self
    }
    pub fn with_num_blocks(mut self, num_blocks: usize) -> Self {
        self.num_blocks = Some(num_blocks);
        self
    }
    pub fn with_nan_garbage(mut self, on: bool) -> Self {
        self.nan_garbage = on;
        self
    }
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|&(q, _)| q).sum()
    }
    pub fn max_q_len(&self) -> usize {
        self.seqs.iter().map(|&(q, _)| q).max().unwrap_or(0)
    }
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_size as f32).sqrt()
    }
    pub fn cache_dtype(&self) -> DType {
        if self.fp8_cache {
            DType::F8E4M3
        } else {
            self.dtype
        }
    }
    /// `[num_tokens, num_heads, head_size]`.
    pub fn out_dims(&self) -> [usize; 3] {
        [self.num_tokens(), self.num_heads, self.head_size]
    }
    fn blocks_needed(&self) -> usize {
        self.seqs
            .iter()
            .map(|&(_, l)| l.div_ceil(self.block_size))
            .sum()
    }

    /// Short one-line description for failure messages.
    pub fn label(&self) -> String {
        format!(
            "seqs {:?} heads {}:{} head_size {} block_size {} {:?}{} window {:?} softcap {:?} alibi {} sinks {} qq {:?} prefix {} out_scale {:?} split {:?} seed {}",
            self.seqs,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.block_size,
            self.dtype,
            if self.fp8_cache { " fp8-cache" } else { "" },
            self.window,
            self.softcap,
            self.alibi,
            self.sinks,
            self.qq_bias,
            !matches!(self.prefix, Prefix::Off),
            self.output_scale,
            self.kv_split,
            self.seed
        )
    }
}

/// A dense row-major f32 matrix.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn at(&self, r: usize, c: usize) -> f32 {
        self.data[r * self.cols + c]
    }
}

/// Host copies of a case's inputs, as the op sees them (after rounding to
/// the tensor dtypes), for the oracle.
#[derive(Clone, Debug)]
pub struct Host {
    /// `[num_tokens, num_heads, head_size]`.
    pub q: Vec<f32>,
    /// `[num_blocks, block_size, num_kv_heads, head_size]`, raw stored values
    /// (fp8 caches not yet multiplied by their scale).
    pub key_cache: Vec<f32>,
    pub value_cache: Vec<f32>,
    pub num_blocks: usize,
    /// Full block-table rows (the tail past a sequence's pages is padding).
    pub block_tables: Vec<Vec<u32>>,
    pub alibi_slopes: Option<Vec<f32>>,
    pub sinks: Option<Vec<f32>>,
    pub qq_bias: Option<Matrix>,
    /// Per sequence (empty lists when the case has none).
    pub prefix_ranges: Vec<Vec<Range<u32>>>,
    /// Cache rows `(block, row)` filled with NaN.
    pub nan_rows: usize,
}

/// A case's inputs on its device, plus the host copies.
pub struct Inputs {
    pub q: Tensor,
    pub key_cache: Tensor,
    pub value_cache: Tensor,
    pub batch: PagedBatch,
    pub alibi_slopes: Option<Tensor>,
    pub sinks: Option<Tensor>,
    pub qq_bias: Option<Tensor>,
    pub host: Host,
}

impl fmt::Debug for Inputs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inputs")
            .field("q", &self.q.shape())
            .field("key_cache", &self.key_cache.shape())
            .finish()
    }
}

fn normals(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| std * rng.sample::<f32, _>(StandardNormal))
        .collect()
}

/// Moves `data` to a tensor of `dtype` on `device` and reads back the stored
/// values as f32 (through f32: candle-core 0.11.1 hangs converting F8E4M3
/// to F64).
fn upload(
    data: Vec<f32>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Vec<f32>)> {
    let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)?;
    let host = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok((t.to_device(device)?, host))
}

/// Visibility of key `t` (columns, `0..seq_len`) for query row `j` (rows,
/// `0..q_len`) of one sequence, as three explicit boolean matrices combined
/// elementwise: `(causal AND window) OR prefix`.
pub fn visibility(
    q_len: usize,
    seq_len: usize,
    window: Option<usize>,
    ranges: &[Range<u32>],
) -> Vec<Vec<bool>> {
    let ctx = seq_len - q_len;
    let causal: Vec<Vec<bool>> = (0..q_len)
        .map(|j| (0..seq_len).map(|t| t <= ctx + j).collect())
        .collect();
    let in_window: Vec<Vec<bool>> = (0..q_len)
        .map(|j| {
            (0..seq_len)
                .map(|t| match window {
                    // Only meaningful where causal holds (t <= query).
                    Some(w) => t > ctx + j || ctx + j - t < w,
                    None => true,
                })
                .collect()
        })
        .collect();
    let prefix: Vec<Vec<bool>> = (0..q_len)
        .map(|j| {
            (0..seq_len)
                .map(|t| {
                    ranges.iter().any(|r| {
                        let r = r.start as usize..r.end as usize;
                        r.contains(&(ctx + j)) && r.contains(&t)
                    })
                })
                .collect()
        })
        .collect();
    (0..q_len)
        .map(|j| {
            (0..seq_len)
                .map(|t| (causal[j][t] && in_window[j][t]) || prefix[j][t])
                .collect()
        })
        .collect()
}

fn random_prefix_ranges(rng: &mut StdRng, seqs: &[(usize, usize)]) -> Vec<Vec<Range<u32>>> {
    seqs.iter()
        .map(|&(q_len, seq_len)| {
            let mut ranges = Vec::new();
            if seq_len == 0 {
                return ranges;
            }
            let ctx = seq_len - q_len;
            // A range reaching into the new tokens (when there are any), so
            // that some queries see keys after themselves.
            let start = rng.random_range(ctx.saturating_sub(4)..seq_len);
            let end = rng.random_range(start + 1..=seq_len);
            ranges.push(start as u32..end as u32);
            match rng.random_range(0..3) {
                0 => {
                    let s = rng.random_range(0..seq_len);
                    let e = rng.random_range(s + 1..=seq_len);
                    ranges.push(s as u32..e as u32);
                }
                1 => {
                    // Empty: ignored.
                    let s = rng.random_range(0..=seq_len) as u32;
                    ranges.push(s..s);
                }
                _ => {}
            }
            ranges
        })
        .collect()
}

impl Case {
    /// Builds fresh random inputs on `device` (deterministic in `seed`).
    pub fn build(&self, device: &Device) -> Result<Inputs> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x9e37_79b9_7f4a_7c15);
        let (h, kvh, d, bs) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.block_size,
        );
        let n = self.num_tokens();
        let num_blocks = self.num_blocks.unwrap_or(self.blocks_needed() + 3);
        ensure!(num_blocks > 0, "a case needs at least one cache block");

        // Block tables: ids drawn with replacement (they repeat), plus a few
        // padding columns past the longest sequence.
        let width = self
            .seqs
            .iter()
            .map(|&(_, l)| l.div_ceil(bs))
            .max()
            .unwrap_or(0)
            + rng.random_range(0..3);
        let block_tables: Vec<Vec<u32>> = self
            .seqs
            .iter()
            .map(|_| {
                (0..width)
                    .map(|_| rng.random_range(0..num_blocks) as u32)
                    .collect()
            })
            .collect();

        let prefix_ranges = match &self.prefix {
            Prefix::Off => vec![Vec::new(); self.num_seqs()],
            Prefix::Random => random_prefix_ranges(&mut rng, &self.seqs),
            Prefix::Explicit(r) => r.clone(),
        };

        // Cache rows some query may see; every other row holds NaN.
        let mut reachable = HashSet::new();
        for (i, &(q_len, seq_len)) in self.seqs.iter().enumerate() {
            let vis = visibility(q_len, seq_len, self.window, &prefix_ranges[i]);
            for t in 0..seq_len {
                if vis.iter().any(|row| row[t]) {
                    reachable.insert((block_tables[i][t / bs] as usize, t % bs));
                }
            }
        }
        let row_len = kvh * d;
        let cache_len = num_blocks * bs * row_len;
        let mut k_data = normals(&mut rng, cache_len, 1.0);
        let mut v_data = normals(&mut rng, cache_len, 1.0);
        let mut nan_rows = 0;
        if self.nan_garbage {
            for block in 0..num_blocks {
                for row in 0..bs {
                    if !reachable.contains(&(block, row)) {
                        nan_rows += 1;
                        let off = (block * bs + row) * row_len;
                        k_data[off..off + row_len].fill(f32::NAN);
                        v_data[off..off + row_len].fill(f32::NAN);
                    }
                }
            }
        }
        let cache_shape = [num_blocks, bs, kvh, d];
        let (key_cache, key_host) = upload(k_data, &cache_shape, self.cache_dtype(), device)?;
        let (value_cache, value_host) = upload(v_data, &cache_shape, self.cache_dtype(), device)?;
        let (q, q_host) = upload(
            normals(&mut rng, n * h * d, 1.0),
            &[n, h, d],
            self.dtype,
            device,
        )?;

        let (alibi_slopes, alibi_host) = if self.alibi {
            // The usual geometric ALiBi slopes.
            let slopes: Vec<f32> = (0..h)
                .map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32))
                .collect();
            let (t, v) = upload(slopes, &[h], DType::F32, device)?;
            (Some(t), Some(v))
        } else {
            (None, None)
        };
        let (sinks, sinks_host) = if self.sinks {
            let (t, v) = upload(normals(&mut rng, h, 2.0), &[h], DType::F32, device)?;
            (Some(t), Some(v))
        } else {
            (None, None)
        };
        let (qq_bias, qq_host) = if self.qq_bias == QqBias::Off {
            (None, None)
        } else {
            let max_q = self.max_q_len().max(1);
            let rows = max_q + rng.random_range(0..2);
            let cols = rng.random_range(1..=max_q + 2);
            let mut data = normals(&mut rng, rows * cols, 0.5);
            if self.qq_bias == QqBias::WithNegInf {
                data[0] = f32::NEG_INFINITY;
                for _ in 0..2 {
                    let i = rng.random_range(0..data.len());
                    data[i] = f32::NEG_INFINITY;
                }
            }
            let (t, v) = upload(data, &[rows, cols], DType::F32, device)?;
            (
                Some(t),
                Some(Matrix {
                    rows,
                    cols,
                    data: v,
                }),
            )
        };

        let mut cu = vec![0u32];
        for &(q_len, _) in &self.seqs {
            cu.push(cu.last().unwrap() + q_len as u32);
        }
        let seq_lens: Vec<u32> = self.seqs.iter().map(|&(_, l)| l as u32).collect();
        let flat: Vec<u32> = block_tables.concat();
        let mut batch = PagedBatch::new(&cu, &seq_lens, &flat, width, bs, device)?;
        if self.prefix != Prefix::Off {
            batch = batch.with_prefix_ranges(&prefix_ranges)?;
        }

        Ok(Inputs {
            q,
            key_cache,
            value_cache,
            batch,
            alibi_slopes,
            sinks,
            qq_bias,
            host: Host {
                q: q_host,
                key_cache: key_host,
                value_cache: value_host,
                num_blocks,
                block_tables,
                alibi_slopes: alibi_host,
                sinks: sinks_host,
                qq_bias: qq_host,
                prefix_ranges,
                nan_rows,
            },
        })
    }

    /// The op's parameters for `inputs`.
    pub fn params(&self, inputs: &Inputs) -> PagedAttentionParams {
        PagedAttentionParams::new(
            &inputs.key_cache,
            &inputs.value_cache,
            &inputs.batch,
            self.scale(),
        )
        .with_sliding_window(self.window)
        .with_softcap(self.softcap)
        .with_alibi_slopes(inputs.alibi_slopes.clone())
        .with_sinks(inputs.sinks.clone())
        .with_qq_bias(inputs.qq_bias.clone())
        .with_kv_scales(self.kv_scales)
        .with_output_scale(self.output_scale)
        .with_kv_split(self.kv_split)
    }
}

/// The oracle's answer: `[num_tokens, num_heads, head_size]` values in f64
/// (fp8 output already clamped and rescaled: `clamp(o / s) * s`), and per
/// `(token, head)` whether the row had no visible key.
#[derive(Clone, Debug)]
pub struct Expected {
    pub values: Vec<f64>,
    pub empty_rows: Vec<bool>,
}

/// Dense attention in f64, one sequence and one query head at a time, over
/// keys and values gathered from the pages through the block table.
pub fn oracle(case: &Case, host: &Host) -> Expected {
    let (h, kvh, d, bs) = (
        case.num_heads,
        case.num_kv_heads,
        case.head_size,
        case.block_size,
    );
    let group = h / kvh;
    let n = case.num_tokens();
    let (k_mul, v_mul) = if case.fp8_cache {
        (case.kv_scales.k_scale as f64, case.kv_scales.v_scale as f64)
    } else {
        (1.0, 1.0)
    };
    let softcap = case.softcap.filter(|&c| c > 0.0).map(f64::from);
    let scale = case.scale() as f64;
    let mut values = vec![0f64; n * h * d];
    let mut empty_rows = vec![false; n * h];

    let mut token0 = 0;
    for (i, &(q_len, seq_len)) in case.seqs.iter().enumerate() {
        let ctx = seq_len - q_len;
        let vis = visibility(q_len, seq_len, case.window, &host.prefix_ranges[i]);
        for g in 0..kvh {
            // Gather this sequence's keys and values for KV head g.
            let mut keys = vec![0f64; seq_len * d];
            let mut vals = vec![0f64; seq_len * d];
            for t in 0..seq_len {
                let block = host.block_tables[i][t / bs] as usize;
                let off = ((block * bs + t % bs) * kvh + g) * d;
                for x in 0..d {
                    keys[t * d + x] = host.key_cache[off + x] as f64 * k_mul;
                    vals[t * d + x] = host.value_cache[off + x] as f64 * v_mul;
                }
            }
            for head in g * group..(g + 1) * group {
                for (j, visible) in vis.iter().enumerate() {
                    let token = token0 + j;
                    let qoff = (token * h + head) * d;
                    let qrow: Vec<f64> = host.q[qoff..qoff + d].iter().map(|&x| x as f64).collect();
                    let scores: Vec<f64> = (0..seq_len)
                        .map(|t| {
                            if !visible[t] {
                                return f64::NEG_INFINITY;
                            }
                            let dot: f64 = (0..d).map(|x| qrow[x] * keys[t * d + x]).sum();
                            let mut s = scale * dot;
                            if let Some(c) = softcap {
                                s = c * (s / c).tanh();
                            }
                            let rel = t as i64 - ctx as i64;
                            if let Some(slopes) = &host.alibi_slopes {
                                s += slopes[head] as f64 * rel as f64;
                            }
                            if let Some(bias) = &host.qq_bias {
                                if rel >= 0 && (rel as usize) < bias.cols {
                                    s += bias.at(j, rel as usize) as f64;
                                }
                            }
                            s
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    if max == f64::NEG_INFINITY {
                        // No visible key: zeros (already there).
                        empty_rows[token * h + head] = true;
                        continue;
                    }
                    let sink = host.sinks.as_ref().map(|s| s[head] as f64);
                    let m = sink.map_or(max, |s| s.max(max));
                    let mut denom = sink.map_or(0.0, |s| (s - m).exp());
                    let out = &mut values[qoff..qoff + d];
                    for (t, &s) in scores.iter().enumerate() {
                        if s == f64::NEG_INFINITY {
                            continue;
                        }
                        let p = (s - m).exp();
                        denom += p;
                        for x in 0..d {
                            out[x] += p * vals[t * d + x];
                        }
                    }
                    for o in out.iter_mut() {
                        *o /= denom;
                    }
                }
            }
        }
        token0 += q_len;
    }

    if let Some(s) = case.output_scale {
        let s = s as f64;
        for v in values.iter_mut() {
            *v = (*v / s).clamp(-FP8_MAX, FP8_MAX) * s;
        }
    }
    Expected { values, empty_rows }
}

/// Absolute and relative tolerance: `|a - e| <= atol + rtol * |e|`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
}

impl Tolerance {
    pub const F32: Self = Self {
        atol: 1e-4,
        rtol: 1e-4,
    };
    pub const HALF: Self = Self {
        atol: 1.5e-2,
        rtol: 1e-2,
    };
    pub const FP8: Self = Self {
        atol: 1.5e-1,
        rtol: 1.5e-1,
    };

    /// By dtype: f32 1e-4; f16/bf16 atol 1.5e-2, rtol 1e-2; an fp8 cache or
    /// an fp8 output 1.5e-1.
    pub fn for_case(case: &Case) -> Self {
        if case.fp8_cache || case.output_scale.is_some() {
            Self::FP8
        } else if case.dtype == DType::F32 {
            Self::F32
        } else {
            Self::HALF
        }
    }
}

/// Checks that every `actual` value is finite and within `tol` of
/// `expected`; the error names the worst element by (token, head, dim).
pub fn compare(actual: &[f32], expected: &[f64], dims: [usize; 3], tol: Tolerance) -> Result<()> {
    let [n, h, d] = dims;
    ensure!(
        actual.len() == n * h * d && expected.len() == n * h * d,
        "length mismatch: actual {}, expected {}, dims {dims:?}",
        actual.len(),
        expected.len()
    );
    let at = |i: usize| (i / (h * d), (i / d) % h, i % d);
    if let Some(i) = actual.iter().position(|a| !a.is_finite()) {
        bail!(
            "output at (token, head, dim) {:?} is {} (expected {}); {} non-finite values in all",
            at(i),
            actual[i],
            expected[i],
            actual.iter().filter(|a| !a.is_finite()).count()
        );
    }
    if let Some(i) = expected.iter().position(|e| !e.is_finite()) {
        bail!("oracle value at {:?} is {}", at(i), expected[i]);
    }
    let mut bad = 0usize;
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let err = (a as f64 - e).abs();
        let ratio = err / (tol.atol + tol.rtol * e.abs());
        if ratio > 1.0 {
            bad += 1;
            if worst.is_none_or(|(_, r)| ratio > r) {
                worst = Some((i, ratio));
            }
        }
    }
    if let Some((i, _)) = worst {
        bail!(
            "{bad} of {} values differ beyond atol {} rtol {}; worst at (token, head, dim) {:?}: got {}, expected {}",
            actual.len(),
            tol.atol,
            tol.rtol,
            at(i),
            actual[i],
            expected[i]
        );
    }
    Ok(())
}

/// Runs the op on `inputs` and returns its output as f32 values in the
/// attention domain (an fp8 output multiplied back by its scale), after
/// checking the output's shape and dtype.
pub fn run_op(case: &Case, inputs: &Inputs) -> Result<Vec<f32>> {
    let params = case.params(inputs);
    let out = paged_attention(&inputs.q, &params)?;
    let want_dtype = case.output_scale.map_or(case.dtype, |_| DType::F8E4M3);
    ensure!(
        out.dims() == case.out_dims(),
        "output shape {:?}, expected {:?}",
        out.dims(),
        case.out_dims()
    );
    ensure!(
        out.dtype() == want_dtype,
        "output dtype {:?}, expected {want_dtype:?}",
        out.dtype()
    );
    ensure!(
        out.device().same_device(inputs.q.device()),
        "output on {:?}, query on {:?}",
        out.device().location(),
        inputs.q.device().location()
    );
    let mut values = out
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if let Some(s) = case.output_scale {
        values.iter_mut().for_each(|v| *v *= s);
    }
    Ok(values)
}

/// The op's output for `case` on `device` (f32, attention domain).
pub fn op_output(case: &Case, device: &Device) -> Result<Vec<f32>> {
    let inputs = case.build(device)?;
    run_op(case, &inputs)
}

/// One run of a case: the op's output and the oracle's.
pub struct CaseRun {
    pub actual: Vec<f32>,
    pub expected: Expected,
    pub host: Host,
}

/// Runs `case` on `device` and computes the oracle on the same inputs.
pub fn run_case(case: &Case, device: &Device) -> Result<CaseRun> {
    let inputs = case.build(device)?;
    let actual = run_op(case, &inputs)?;
    let expected = oracle(case, &inputs.host);
    Ok(CaseRun {
        actual,
        expected,
        host: inputs.host,
    })
}

/// Checks a finished run: finite everywhere, within the case's tolerance of
/// the oracle, and exactly zero on rows with no visible key.
pub fn check_run(case: &Case, run: &CaseRun) -> Result<()> {
    let dims = case.out_dims();
    compare(
        &run.actual,
        &run.expected.values,
        dims,
        Tolerance::for_case(case),
    )?;
    let d = case.head_size;
    for (row, _) in run
        .expected
        .empty_rows
        .iter()
        .enumerate()
        .filter(|(_, &e)| e)
    {
        let got = &run.actual[row * d..(row + 1) * d];
        ensure!(
            got.iter().all(|&x| x == 0.0),
            "(token {}, head {}) has no visible key but its output is not zero: {:?}",
            row / case.num_heads,
            row % case.num_heads,
            &got[..got.len().min(4)]
        );
    }
    Ok(())
}

/// The case body: runs the op on `device` and checks it against the oracle.
pub fn check_case(case: &Case, device: &Device) -> Result<()> {
    let run = run_case(case, device).with_context(|| case.label())?;
    check_run(case, &run).with_context(|| case.label())
}

/// The two sequence mixes of vLLM's unified-attention test, as
/// `(q_len, seq_len)`: a decode, a chunked prefill and a prefill-sized
/// chunk; then three decodes.
pub const GRID_MIXES: [&[(usize, usize)]; 2] = [
    &[(1, 1328), (5, 18), (129, 463)],
    &[(1, 523), (1, 37), (1, 2011)],
];
pub const GRID_HEADS: [(usize, usize); 3] = [(4, 4), (8, 2), (5, 1)];
pub const GRID_HEAD_SIZES: [usize; 5] = [64, 80, 96, 128, 256];
pub const GRID_BLOCK_SIZES: [usize; 2] = [16, 32];
pub const GRID_WINDOWS: [Option<usize>; 3] = [None, Some(64), Some(256)];
pub const GRID_SOFTCAPS: [Option<f32>; 2] = [None, Some(50.0)];
/// `(query dtype, fp8 cache)`.
pub const GRID_DTYPES: [(DType, bool); 6] = [
    (DType::F32, false),
    (DType::F16, false),
    (DType::BF16, false),
    (DType::F32, true),
    (DType::F16, true),
    (DType::BF16, true),
];
pub const GRID_ROTATIONS: usize = 6;

fn position<T: PartialEq + fmt::Debug>(list: &[T], value: &T) -> usize {
    list.iter()
        .position(|x| x == value)
        .unwrap_or_else(|| panic!("{value:?} is not one of {list:?}"))
}

/// A case of the grid: a full product over mix x heads x block size x window
/// x softcap x rotation; the case's index in that product picks the head
/// size, the dtype pair and the split policy, so every value of those
/// dimensions appears many times and meets every value of the others.
pub fn grid_case(
    mix: usize,
    heads: (usize, usize),
    block_size: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    rotation: usize,
) -> Case {
    assert!(rotation < GRID_ROTATIONS);
    let mut k = mix;
    k = k * GRID_HEADS.len() + position(&GRID_HEADS, &heads);
    k = k * GRID_BLOCK_SIZES.len() + position(&GRID_BLOCK_SIZES, &block_size);
    k = k * GRID_WINDOWS.len() + position(&GRID_WINDOWS, &window);
    k = k * GRID_SOFTCAPS.len() + position(&GRID_SOFTCAPS, &softcap);
    k = k * GRID_ROTATIONS + rotation;
    let head_size = GRID_HEAD_SIZES[k % GRID_HEAD_SIZES.len()];
    let (dtype, fp8) = GRID_DTYPES[(k / GRID_HEAD_SIZES.len()) % GRID_DTYPES.len()];
    let split = [KvSplit::Auto, KvSplit::Never, KvSplit::Segments(3)][(k / 7) % 3];
    Case::new(GRID_MIXES[mix], heads, head_size, block_size, dtype)
        .with_fp8_cache(fp8)
        .with_window(window)
        .with_softcap(softcap)
        .with_kv_split(split)
        .with_seed(k as u64)
}

/// Feature bits of [`feature_case`].
pub const ALIBI: u32 = 1;
pub const SINKS: u32 = 2;
pub const QQ_BIAS: u32 = 4;
pub const PREFIX: u32 = 8;
pub const FP8_OUT: u32 = 16;

/// A small mixed batch (decodes, prefills, chunked prefills, a sequence
/// with no new token) with the features in `features` switched on; the
/// window, softcap and cache dtype rotate with the feature set.
pub fn feature_case(features: u32, dtype: DType) -> Case {
    let seqs = [
        (1, 57),
        (9, 9),
        (16, 80),
        (1, 1),
        (3, 20),
        (0, 12),
        (24, 24),
    ];
    let rot = features as usize + position(&[DType::F32, DType::F16, DType::BF16], &dtype);
    let qq = if features & QQ_BIAS == 0 {
        QqBias::Off
    } else if rot.is_multiple_of(2) {
        QqBias::WithNegInf
    } else {
        QqBias::Random
    };
    Case::new(&seqs, (8, 2), 64, 16, dtype)
        .with_alibi(features & ALIBI != 0)
        .with_sinks(features & SINKS != 0)
        .with_qq_bias(qq)
        .with_prefix(if features & PREFIX != 0 {
            Prefix::Random
        } else {
            Prefix::Off
        })
        .with_output_scale((features & FP8_OUT != 0).then_some(0.05))
        .with_window([None, Some(10), None, Some(33)][rot % 4])
        .with_softcap([None, Some(3.0), Some(0.0)][rot % 3])
        .with_fp8_cache(rot % 5 == 4)
        .with_kv_split([KvSplit::Auto, KvSplit::Never, KvSplit::Segments(2)][rot % 3])
        .with_seed(1000 + features as u64 * 3 + rot as u64)
}
