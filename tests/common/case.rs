//! [`Case`]: a seeded description of one paged-attention call (sequence mix,
//! head shapes, dtypes, features) that builds fresh random inputs on any
//! device. Cache rows that no query may see are filled with NaN, so a masked
//! key that leaks into an output shows up as a non-finite value.

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::reference::visibility;
use candle_paged_attention::{KvScales, KvSplit, PagedAttentionParams, PagedBatch};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

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
    /// The score scale; `None`: `1 / sqrt(head_size)`.
    pub score_scale: Option<f32>,
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
            score_scale: None,
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
    pub fn with_score_scale(mut self, scale: f32) -> Self {
        self.score_scale = Some(scale);
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
        self.score_scale
            .unwrap_or(1.0 / (self.head_size as f32).sqrt())
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
            "seqs {:?} heads {}:{} head_size {} block_size {} {:?}{} window {:?} softcap {:?} alibi {} sinks {} qq {:?} prefix {} out_scale {:?} scale {} split {:?} seed {}",
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
            self.scale(),
            self.kv_split,
            self.seed
        )
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

/// A case's inputs on its device.
pub struct Inputs {
    /// `[num_tokens, num_heads, head_size]`, the case's dtype.
    pub q: Tensor,
    /// `[num_blocks, block_size, num_kv_heads, head_size]`.
    pub key_cache: Tensor,
    pub value_cache: Tensor,
    pub batch: PagedBatch,
    pub alibi_slopes: Option<Tensor>,
    pub sinks: Option<Tensor>,
    pub qq_bias: Option<Tensor>,
    /// Cache rows `(block, row)` filled with NaN.
    pub nan_rows: usize,
}

impl fmt::Debug for Inputs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inputs")
            .field("q", &self.q.shape())
            .field("key_cache", &self.key_cache.shape())
            .finish()
    }
}

/// Block tables: one row per sequence, `width` ids each (the tail past a
/// sequence's pages is padding).
struct BlockTables {
    rows: Vec<Vec<u32>>,
    width: usize,
}

/// Both caches' data, `[num_blocks, block_size, num_kv_heads, head_size]`.
struct CacheData {
    keys: Vec<f32>,
    values: Vec<f32>,
    nan_rows: usize,
}

fn normals(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| std * rng.sample::<f32, _>(StandardNormal))
        .collect()
}

/// Moves `data` to a tensor of `dtype` on `device` (converted on the CPU:
/// candle's CUDA backend has no f32 to `F8E4M3` cast).
fn upload(data: Vec<f32>, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)?;
    Ok(t.to_device(device)?)
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
        let num_blocks = self.num_blocks.unwrap_or(self.blocks_needed() + 3);
        ensure!(num_blocks > 0, "a case needs at least one cache block");
        let tables = self.block_tables(&mut rng, num_blocks);
        let ranges = self.prefix_ranges(&mut rng);
        let caches = self.cache_data(&mut rng, num_blocks, &tables, &ranges);
        let (h, kvh, d, bs) = self.shape();
        let cache_shape = [num_blocks, bs, kvh, d];
        let q_data = normals(&mut rng, self.num_tokens() * h * d, 1.0);
        Ok(Inputs {
            key_cache: upload(caches.keys, &cache_shape, self.cache_dtype(), device)?,
            value_cache: upload(caches.values, &cache_shape, self.cache_dtype(), device)?,
            q: upload(q_data, &[self.num_tokens(), h, d], self.dtype, device)?,
            alibi_slopes: self.alibi_slopes(device)?,
            sinks: self.sinks(&mut rng, device)?,
            qq_bias: self.qq_bias(&mut rng, device)?,
            batch: self.batch(&tables, &ranges, device)?,
            nan_rows: caches.nan_rows,
        })
    }

    /// `(num_heads, num_kv_heads, head_size, block_size)`.
    fn shape(&self) -> (usize, usize, usize, usize) {
        (
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.block_size,
        )
    }

    /// Block ids drawn with replacement (they repeat), plus a few padding
    /// columns past the longest sequence.
    fn block_tables(&self, rng: &mut StdRng, num_blocks: usize) -> BlockTables {
        let longest = self.seqs.iter().map(|&(_, l)| l.div_ceil(self.block_size));
        let width = longest.max().unwrap_or(0) + rng.random_range(0..3);
        let rows = self
            .seqs
            .iter()
            .map(|_| {
                (0..width)
                    .map(|_| rng.random_range(0..num_blocks) as u32)
                    .collect()
            })
            .collect();
        BlockTables { rows, width }
    }

    fn prefix_ranges(&self, rng: &mut StdRng) -> Vec<Vec<Range<u32>>> {
        match &self.prefix {
            Prefix::Off => vec![Vec::new(); self.num_seqs()],
            Prefix::Random => random_prefix_ranges(rng, &self.seqs),
            Prefix::Explicit(r) => r.clone(),
        }
    }

    /// Cache rows `(block, row)` that some query may see.
    fn reachable_rows(
        &self,
        tables: &BlockTables,
        ranges: &[Vec<Range<u32>>],
    ) -> HashSet<(usize, usize)> {
        let bs = self.block_size;
        let mut reachable = HashSet::new();
        for (i, &(q_len, seq_len)) in self.seqs.iter().enumerate() {
            let vis = visibility(q_len, seq_len, self.window, &ranges[i]);
            for t in (0..seq_len).filter(|&t| vis.iter().any(|row| row[t])) {
                reachable.insert((tables.rows[i][t / bs] as usize, t % bs));
            }
        }
        reachable
    }

    /// Random keys and values; with `nan_garbage`, every row no query may
    /// see holds NaN.
    fn cache_data(
        &self,
        rng: &mut StdRng,
        num_blocks: usize,
        tables: &BlockTables,
        ranges: &[Vec<Range<u32>>],
    ) -> CacheData {
        let reachable = self.reachable_rows(tables, ranges);
        let (_, kvh, d, bs) = self.shape();
        let row_len = kvh * d;
        let cache_len = num_blocks * bs * row_len;
        let mut data = CacheData {
            keys: normals(rng, cache_len, 1.0),
            values: normals(rng, cache_len, 1.0),
            nan_rows: 0,
        };
        if !self.nan_garbage {
            return data;
        }
        for block in 0..num_blocks {
            for row in (0..bs).filter(|&row| !reachable.contains(&(block, row))) {
                data.nan_rows += 1;
                let off = (block * bs + row) * row_len;
                data.keys[off..off + row_len].fill(f32::NAN);
                data.values[off..off + row_len].fill(f32::NAN);
            }
        }
        data
    }

    /// The usual geometric ALiBi slopes.
    fn alibi_slopes(&self, device: &Device) -> Result<Option<Tensor>> {
        if !self.alibi {
            return Ok(None);
        }
        let h = self.num_heads;
        let slopes: Vec<f32> = (0..h)
            .map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32))
            .collect();
        Ok(Some(upload(slopes, &[h], DType::F32, device)?))
    }

    fn sinks(&self, rng: &mut StdRng, device: &Device) -> Result<Option<Tensor>> {
        if !self.sinks {
            return Ok(None);
        }
        let h = self.num_heads;
        Ok(Some(upload(
            normals(rng, h, 2.0),
            &[h],
            DType::F32,
            device,
        )?))
    }

    /// `(max q_len + 0 or 1, random cols)` entries, some `-inf` with
    /// [`QqBias::WithNegInf`].
    fn qq_bias(&self, rng: &mut StdRng, device: &Device) -> Result<Option<Tensor>> {
        if self.qq_bias == QqBias::Off {
            return Ok(None);
        }
        let max_q = self.max_q_len().max(1);
        let rows = max_q + rng.random_range(0..2);
        let cols = rng.random_range(1..=max_q + 2);
        let mut data = normals(rng, rows * cols, 0.5);
        if self.qq_bias == QqBias::WithNegInf {
            data[0] = f32::NEG_INFINITY;
            for _ in 0..2 {
                let i = rng.random_range(0..data.len());
                data[i] = f32::NEG_INFINITY;
            }
        }
        Ok(Some(upload(data, &[rows, cols], DType::F32, device)?))
    }

    fn batch(
        &self,
        tables: &BlockTables,
        ranges: &[Vec<Range<u32>>],
        device: &Device,
    ) -> Result<PagedBatch> {
        let mut cu = vec![0u32];
        for &(q_len, _) in &self.seqs {
            cu.push(cu[cu.len() - 1] + q_len as u32);
        }
        let seq_lens: Vec<u32> = self.seqs.iter().map(|&(_, l)| l as u32).collect();
        let flat: Vec<u32> = tables.rows.concat();
        let batch = PagedBatch::new(&cu, &seq_lens, &flat, tables.width, self.block_size, device)?;
        if self.prefix == Prefix::Off {
            return Ok(batch);
        }
        Ok(batch.with_prefix_ranges(ranges)?)
    }
}
