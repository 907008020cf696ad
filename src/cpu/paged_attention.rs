//! CPU paged attention: the fast CPU kernel of the op (the naive f64
//! specification is [`crate::reference`]).
//!
//! Work is split into items of (sequence, KV head, block of query rows); each
//! item walks its visible keys in tiles, converts a K and a V tile to f32 once,
//! and runs an online softmax for every (query row, query head of the group)
//! it owns. Items run in parallel on rayon; each returns its rows, which are
//! then scattered into the output.
//!
//! Imports `params` and `batch`; never `ops` or `cuda`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result, Shape, Storage, WithDType};
use float8::F8E4M3;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::batch::BatchHost;
use crate::cpu::elem::{axpy, axpy4, dot, dot4, load_scaled, Elem};
use crate::cpu::score_mods::ScoreMods;
use crate::params::{AttentionDims, PagedAttentionParams};

/// Query rows per work item (times the GQA group size in query vectors).
const ROWS_PER_ITEM: usize = 16;
/// Keys converted to f32 and scored together.
const KEY_TILE: usize = 32;

/// Per-call constants shared by all work items.
struct Problem<'a, Q, C> {
    q: &'a [Q],
    k: &'a [C],
    v: &'a [C],
    host: &'a BatchHost,
    dims: AttentionDims,
    opts: &'a Options,
}

/// The options of the call, read into host vectors.
struct Options {
    scale: f32,
    k_scale: f32,
    v_scale: f32,
    /// The mask, the score modifiers and the sinks.
    mods: ScoreMods,
}

/// One (sequence, KV head, query rows `row_start..row_end` of the sequence).
#[derive(Clone, Copy, Debug)]
struct WorkItem {
    seq: usize,
    kv_head: usize,
    row_start: usize,
    row_end: usize,
}

/// Per-thread buffers, reused across items.
#[derive(Default)]
struct Scratch {
    queries: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    scores: Vec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
}

fn cpu_slice<'a, T: WithDType>(
    storage: &'a Storage,
    layout: &Layout,
    name: &str,
) -> Result<&'a [T]> {
    let Storage::Cpu(cpu) = storage else {
        bail!("paged-attention: {name} is not on the cpu");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("paged-attention: {name} must be contiguous");
    };
    Ok(&cpu.as_slice::<T>()?[start..end])
}

/// Runs the op on CPU storage; `dims` comes from validation.
pub(crate) fn forward(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    q: &CpuStorage,
    q_layout: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let Some((q_start, q_end)) = q_layout.contiguous_offsets() else {
        bail!("paged-attention: q must be contiguous");
    };
    let cache_is_fp8 = params.key_cache.dtype() == candle_core::DType::F8E4M3;
    let kv_scales = params.effective_kv_scales();
    let opts = Options {
        scale: params.scale,
        k_scale: kv_scales.k_scale,
        v_scale: kv_scales.v_scale,
        mods: ScoreMods::new(params)?,
    };
    let (k_guard, k_layout) = params.key_cache.storage_and_layout();
    let (v_guard, v_layout) = params.value_cache.storage_and_layout();
    macro_rules! run {
        ($q:ty, $c:ty, $qs:expr) => {{
            let problem = Problem::<$q, $c> {
                q: &$qs[q_start..q_end],
                k: cpu_slice::<$c>(&k_guard, k_layout, "key_cache")?,
                v: cpu_slice::<$c>(&v_guard, v_layout, "value_cache")?,
                host: params.batch.host(),
                dims: *dims,
                opts: &opts,
            };
            match params.output_scale {
                Some(s) => store::<F8E4M3>(&problem, 1.0 / s),
                None => store::<$q>(&problem, 1.0),
            }
        }};
    }
    let out = match (q, cache_is_fp8) {
        (CpuStorage::F32(qs), false) => run!(f32, f32, qs),
        (CpuStorage::F16(qs), false) => run!(f16, f16, qs),
        (CpuStorage::BF16(qs), false) => run!(bf16, bf16, qs),
        (CpuStorage::F32(qs), true) => run!(f32, F8E4M3, qs),
        (CpuStorage::F16(qs), true) => run!(f16, F8E4M3, qs),
        (CpuStorage::BF16(qs), true) => run!(bf16, F8E4M3, qs),
        (other, _) => bail!(
            "paged-attention: q must be f32, f16 or bf16, got {:?}",
            other.dtype()
        ),
    };
    let shape = Shape::from((dims.num_tokens, dims.num_heads, dims.head_size));
    Ok((out, shape))
}

/// Computes every item and writes the output as `O`, multiplied by `out_mul`
/// (saturating for fp8).
fn store<O: Elem + WithDType>(
    problem: &Problem<'_, impl Elem, impl Elem>,
    out_mul: f32,
) -> CpuStorage {
    let AttentionDims {
        num_tokens,
        num_heads,
        head_size,
        ..
    } = problem.dims;
    let group = problem.dims.group_size();
    let items = work_items(problem.host, problem.dims.num_kv_heads);
    let results: Vec<Vec<f32>> = items
        .par_iter()
        .map_init(Scratch::default, |scratch, item| {
            attend(problem, item, scratch)
        })
        .collect();
    let mut out = vec![O::from_f32(0.0); num_tokens * num_heads * head_size];
    for (item, rows) in items.iter().zip(&results) {
        let first_token = problem.host.cu_seqlens_q()[item.seq] as usize + item.row_start;
        for (r, row) in rows.chunks_exact(group * head_size).enumerate() {
            let base = ((first_token + r) * num_heads + item.kv_head * group) * head_size;
            for (dst, &x) in out[base..base + row.len()].iter_mut().zip(row) {
                *dst = O::from_f32(x * out_mul);
            }
        }
    }
    O::to_cpu_storage_owned(out)
}

fn work_items(host: &BatchHost, num_kv_heads: usize) -> Vec<WorkItem> {
    let mut items = Vec::new();
    for seq in 0..host.num_seqs() {
        let q_len = host.q_len(seq).unwrap_or(0);
        for row_start in (0..q_len).step_by(ROWS_PER_ITEM) {
            let row_end = (row_start + ROWS_PER_ITEM).min(q_len);
            for kv_head in 0..num_kv_heads {
                items.push(WorkItem {
                    seq,
                    kv_head,
                    row_start,
                    row_end,
                });
            }
        }
    }
    items
}

/// Attention for one work item; returns `(row_end - row_start) * group * head_size`
/// outputs, row-major by (row, head of the group, dim).
fn attend<Q: Elem, C: Elem>(p: &Problem<'_, Q, C>, item: &WorkItem, s: &mut Scratch) -> Vec<f32> {
    let host = p.host;
    let o = p.opts;
    let d = p.dims.head_size;
    let group = p.dims.group_size();
    let num_heads = p.dims.num_heads;
    let kv_row = p.dims.num_kv_heads * d;
    let block_size = p.dims.block_size;
    let seq_len = host.seq_lens()[item.seq] as usize;
    let q_len = host.q_len(item.seq).unwrap_or(0);
    let context_len = seq_len - q_len;
    let first_token = host.cu_seqlens_q()[item.seq] as usize + item.row_start;
    let rows = item.row_end - item.row_start;
    let nq = rows * group;
    let table = host.block_table(item.seq);
    let ranges: &[std::ops::Range<u32>] = host
        .prefix_ranges()
        .get(item.seq)
        .map_or(&[], |r| r.as_slice());

    // Queries of this item, pre-multiplied by the score scale. A query
    // holding NaN or +-inf becomes all NaN, so that every score it makes is
    // NaN (an infinite query can otherwise score -inf against every key and
    // pass for a row that sees nothing).
    s.queries.resize(nq * d, 0.0);
    for r in 0..rows {
        let src = (first_token + r) * num_heads * d + item.kv_head * group * d;
        load_scaled(
            &mut s.queries[r * group * d..(r + 1) * group * d],
            &p.q[src..src + group * d],
            o.scale,
        );
    }
    for qv in s.queries[..nq * d].chunks_exact_mut(d) {
        if !qv.iter().all(|x| x.is_finite()) {
            qv.fill(f32::NAN);
        }
    }
    // Online-softmax state: the running max and sum start at the sink
    // (`ScoreMods::softmax_start`).
    s.row_max.clear();
    s.row_sum.clear();
    for i in 0..nq {
        let (max, sum) = o.mods.softmax_start(item.kv_head * group + i % group);
        s.row_max.push(max);
        s.row_sum.push(sum);
    }
    let mut acc = vec![0f32; nq * d];

    // Keys any query of the item can see.
    let first_abs = context_len + item.row_start;
    let last_abs = context_len + item.row_end - 1;
    let (lo, hi) = if ranges.iter().any(|r| r.start < r.end) {
        (0, seq_len)
    } else {
        let lo = o
            .mods
            .window()
            .map_or(0, |w| (first_abs + 1).saturating_sub(w));
        (lo, last_abs + 1)
    };

    s.keys.resize(KEY_TILE * d, 0.0);
    s.values.resize(KEY_TILE * d, 0.0);
    s.scores.resize(KEY_TILE, 0.0);
    let mut tile_start = lo;
    while tile_start < hi {
        let n = KEY_TILE.min(hi - tile_start);
        // Gather and dequantise this tile's keys and values from their pages.
        for t in 0..n {
            let key = tile_start + t;
            let block = table[key / block_size] as usize;
            let off = (block * block_size + key % block_size) * kv_row + item.kv_head * d;
            load_scaled(
                &mut s.keys[t * d..(t + 1) * d],
                &p.k[off..off + d],
                o.k_scale,
            );
            load_scaled(
                &mut s.values[t * d..(t + 1) * d],
                &p.v[off..off + d],
                o.v_scale,
            );
        }
        for i in 0..nq {
            let q_rel = item.row_start + i / group;
            let q_abs = context_len + q_rel;
            let h = item.kv_head * group + i % group;
            let qv = &s.queries[i * d..(i + 1) * d];
            // Raw dot products, four keys per pass over the query.
            let keys = &s.keys;
            let key_row = |t: usize| &keys[t * d..(t + 1) * d];
            let mut t = 0;
            while t + 4 <= n {
                let dots = dot4(
                    qv,
                    [key_row(t), key_row(t + 1), key_row(t + 2), key_row(t + 3)],
                );
                s.scores[t..t + 4].copy_from_slice(&dots);
                t += 4;
            }
            for t in t..n {
                s.scores[t] = dot(qv, key_row(t));
            }
            // Scores (scale * q.k, folded into the queries) through `ScoreMods`:
            // mask, softcap, ALiBi, qq_bias.
            let mut tile_max = f32::NEG_INFINITY;
            for t in 0..n {
                let key = tile_start + t;
                let sc = if o.mods.visible(q_abs, key, ranges) {
                    o.mods.logit(s.scores[t], h, key, context_len, q_rel)
                } else {
                    f32::NEG_INFINITY
                };
                s.scores[t] = sc;
                tile_max = max_nan(tile_max, sc);
            }
            if tile_max == f32::NEG_INFINITY {
                continue;
            }
            // A NaN score (NaN in the query, a visible key, a slope or the
            // bias) makes the maximum NaN, and with it every probability,
            // the sum and the accumulator: the row comes out NaN.
            let old_max = s.row_max[i];
            let new_max = max_nan(old_max, tile_max);
            let acc_i = &mut acc[i * d..(i + 1) * d];
            if old_max != new_max {
                let alpha = (old_max - new_max).exp();
                s.row_sum[i] *= alpha;
                acc_i.iter_mut().for_each(|a| *a *= alpha);
            }
            // Masked keys (score -inf) are skipped, never multiplied by zero:
            // their values may be garbage (unwritten pages). Four unmasked
            // keys at a time take one pass over the accumulator.
            let values = &s.values;
            let value_row = |t: usize| &values[t * d..(t + 1) * d];
            let mut t = 0;
            while t < n {
                let quad = &s.scores[t..(t + 4).min(n)];
                if quad.len() == 4 && quad.iter().all(|&sc| sc != f32::NEG_INFINITY) {
                    let p = [0, 1, 2, 3].map(|j| (quad[j] - new_max).exp());
                    s.row_sum[i] += (p[0] + p[1]) + (p[2] + p[3]);
                    let rows = [
                        value_row(t),
                        value_row(t + 1),
                        value_row(t + 2),
                        value_row(t + 3),
                    ];
                    axpy4(acc_i, p, rows);
                } else {
                    for (j, &sc) in quad.iter().enumerate() {
                        if sc != f32::NEG_INFINITY {
                            let prob = (sc - new_max).exp();
                            s.row_sum[i] += prob;
                            axpy(acc_i, prob, value_row(t + j));
                        }
                    }
                }
                t += quad.len();
            }
            s.row_max[i] = new_max;
        }
        tile_start += n;
    }
    // The sum is 0 only for a row that saw no key and has no sink mass: it
    // is zero. Otherwise it is at least 1 (the maximum's own term), or NaN,
    // which the division carries into the row.
    for i in 0..nq {
        let sum = s.row_sum[i];
        let acc_i = &mut acc[i * d..(i + 1) * d];
        if sum == 0.0 {
            acc_i.fill(0.0);
        } else {
            let inv = 1.0 / sum;
            acc_i.iter_mut().for_each(|a| *a *= inv);
        }
    }
    acc
}

/// `max(acc, x)` that propagates NaN: once either is NaN the result is NaN
/// (`f32::max` would drop it).
#[inline(always)]
fn max_nan(acc: f32, x: f32) -> f32 {
    if x > acc || x.is_nan() {
        x
    } else {
        acc
    }
}
