//! NaN is never hidden: NaN or +-inf in a query row, or NaN in a key, a
//! value, an ALiBi slope, a sink or the query-query bias that a row sees,
//! makes that row NaN (values: the columns holding the NaN), as dense
//! attention does; every other row still matches the f64 oracle, rows with
//! no visible key stay exactly zero, and keys a row does not see (the cases
//! fill every cache row no query sees with NaN) never reach it.
//!
//! Each body takes the device: the `cpu` module runs the cases on the CPU,
//! the `cuda` module (feature `cuda`) on CUDA device 0 over the kernels'
//! paths (f32 scalar, decode and prefill tiles, mixed launches, split-KV
//! with its reduction, fp8 caches and output); without a GPU the CUDA tests
//! fail unless `CANDLE_PAGED_ATTENTION_SKIP_GPU=1`.

#[macro_use]
mod common;

use std::collections::HashSet;
use std::ops::Range;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::reference::{self, visibility};
use candle_paged_attention::KvSplit;
use common::*;

/// What a test poisons.
#[derive(Clone, Copy, Debug)]
enum Poison {
    /// NaN, +inf and -inf in three query rows.
    Query,
    /// NaN in one element of the keys of one cache row and KV head: a row
    /// some queries see and others mask (where the batch has such a row).
    Key,
    /// NaN in one column of the values of one cache row and KV head that
    /// every query row of its sequence sees (and no other sequence reads).
    Value,
    /// NaN in one column of the values of a cache row that some rows of a
    /// sequence see and others mask. Exact on the CPU, which skips masked
    /// keys; on CUDA the P.V product may also carry it into the masking rows
    /// of the same tile (0 * NaN), as dense attention with an additive mask.
    ValueMaskedForSome,
    /// A NaN ALiBi slope for one head.
    Slope,
    /// NaN and +inf sinks for two heads (their rows are NaN, even rows that
    /// see no key) and a -inf sink (no mass: same as no sink).
    Sink,
    /// A NaN at `qq_bias[0][0]`.
    QqBias,
}

/// Uploads `data` as `dtype` on `dev` (exact: the values came from tensors
/// of that dtype, or are NaN/inf).
fn upload(data: &[f32], shape: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(data, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)?)
}

/// Host copies of a case's inputs as f32 (exact: every value came from a
/// tensor of the case's dtypes), to poison and upload again.
struct Host {
    q: Vec<f32>,
    key_cache: Vec<f32>,
    value_cache: Vec<f32>,
    num_blocks: usize,
    block_tables: Vec<Vec<u32>>,
    prefix_ranges: Vec<Vec<Range<u32>>>,
    alibi_slopes: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
    /// Row-major data and `(rows, cols)`.
    qq_bias: Option<(Vec<f32>, (usize, usize))>,
}

/// The elements of `t` as f32 on the host.
fn host_values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

impl Host {
    fn of(inputs: &Inputs) -> Result<Self> {
        let batch = inputs.batch.host();
        let num_seqs = batch.num_seqs();
        let optional = |t: &Option<Tensor>| t.as_ref().map(host_values).transpose();
        Ok(Self {
            q: host_values(&inputs.q)?,
            key_cache: host_values(&inputs.key_cache)?,
            value_cache: host_values(&inputs.value_cache)?,
            num_blocks: inputs.key_cache.dim(0)?,
            block_tables: (0..num_seqs)
                .map(|i| batch.block_table(i).to_vec())
                .collect(),
            prefix_ranges: (0..num_seqs)
                .map(|i| batch.prefix_ranges().get(i).cloned().unwrap_or_default())
                .collect(),
            alibi_slopes: optional(&inputs.alibi_slopes)?,
            sinks: optional(&inputs.sinks)?,
            qq_bias: match &inputs.qq_bias {
                Some(t) => Some((host_values(t)?, t.dims2()?)),
                None => None,
            },
        })
    }
}

/// The physical cache row `(block, row)` of key `t` of sequence `i`.
fn physical(host: &Host, bs: usize, i: usize, t: usize) -> (usize, usize) {
    (host.block_tables[i][t / bs] as usize, t % bs)
}

/// Poisons `inputs` (device tensors and host copies) and returns the
/// (token, head) rows that must come out all NaN.
fn poison(
    case: &Case,
    inputs: &mut Inputs,
    what: Poison,
    dev: &Device,
) -> Result<HashSet<(usize, usize)>> {
    let (h, kvh, d, bs) = (
        case.num_heads,
        case.num_kv_heads,
        case.head_size,
        case.block_size,
    );
    let group = h / kvh;
    let n = case.num_tokens();
    let mut host_copy = Host::of(inputs)?;
    let host = &mut host_copy;
    let cache_shape = [host.num_blocks, bs, kvh, d];
    // (sequence, first token) of each sequence, and its visibility matrix.
    let mut seqs = Vec::new();
    let mut token0 = 0;
    for (i, &(q_len, seq_len)) in case.seqs.iter().enumerate() {
        let vis = visibility(q_len, seq_len, case.window, &host.prefix_ranges[i]);
        seqs.push((i, token0, q_len, seq_len, vis));
        token0 += q_len;
    }
    let mut nan_rows = HashSet::new();
    match what {
        Poison::Query => {
            let picks = [
                (0, 0, 1, f32::NAN),
                (n / 2, h - 1, d - 1, f32::INFINITY),
                (n - 1, h / 2, 0, f32::NEG_INFINITY),
            ];
            for (token, head, dim, x) in picks {
                host.q[(token * h + head) * d + dim] = x;
                // Every query row sees at least its own key.
                nan_rows.insert((token, head));
            }
            inputs.q = upload(&host.q, &[n, h, d], case.dtype, dev)?;
        }
        Poison::Key => {
            // A key that some rows of its sequence see and others mask
            // (the latest such key), else any key a row sees (decode-only
            // batches). Sequences sharing the cache row see it too.
            let seen_by_some =
                |(i, _, _, seq_len, vis): &(usize, usize, usize, usize, Vec<Vec<bool>>),
                 partly: bool| {
                    (0..*seq_len)
                        .rev()
                        .find(|&t| {
                            vis.iter().any(|row| row[t])
                                && (!partly || vis.iter().any(|row| !row[t]))
                        })
                        .map(|t| physical(host, bs, *i, t))
                };
            let (block, row) = seqs
                .iter()
                .find_map(|s| seen_by_some(s, true))
                .or_else(|| seqs.iter().find_map(|s| seen_by_some(s, false)))
                .context("no key is seen")?;
            let g = kvh - 1;
            host.key_cache[((block * bs + row) * kvh + g) * d + d / 2] = f32::NAN;
            inputs.key_cache = upload(&host.key_cache, &cache_shape, case.cache_dtype(), dev)?;
            for (i, token0, _, seq_len, vis) in &seqs {
                for (j, visible) in vis.iter().enumerate() {
                    let sees = (0..*seq_len)
                        .any(|t| visible[t] && physical(host, bs, *i, t) == (block, row));
                    if sees {
                        nan_rows.extend((g * group..(g + 1) * group).map(|hd| (token0 + j, hd)));
                    }
                }
            }
        }
        Poison::Value => {
            // A key every row of its sequence sees, in a cache row that no
            // other (sequence, key) maps to. The oracle carries the NaN into
            // exactly the columns it reaches.
            let mut users = std::collections::HashMap::new();
            for &(i, _, _, seq_len, _) in &seqs {
                for t in 0..seq_len {
                    *users.entry(physical(host, bs, i, t)).or_insert(0) += 1;
                }
            }
            let pick = seqs.iter().find_map(|(i, _, q_len, seq_len, vis)| {
                (*q_len > 0).then_some(())?;
                (0..*seq_len)
                    .find(|&t| {
                        vis.iter().all(|row| row[t]) && users[&physical(host, bs, *i, t)] == 1
                    })
                    .map(|t| physical(host, bs, *i, t))
            });
            let (block, row) = pick.context("no key seen by a whole sequence alone")?;
            host.value_cache[(block * bs + row) * kvh * d + 3] = f32::NAN;
            inputs.value_cache = upload(&host.value_cache, &cache_shape, case.cache_dtype(), dev)?;
        }
        Poison::ValueMaskedForSome => {
            let pick = seqs.iter().find_map(|(i, _, _, seq_len, vis)| {
                (0..*seq_len)
                    .rev()
                    .find(|&t| vis.iter().any(|row| row[t]) && vis.iter().any(|row| !row[t]))
                    .map(|t| physical(host, bs, *i, t))
            });
            let (block, row) = pick.context("no key masked for some rows")?;
            host.value_cache[(block * bs + row) * kvh * d + 3] = f32::NAN;
            inputs.value_cache = upload(&host.value_cache, &cache_shape, case.cache_dtype(), dev)?;
        }
        Poison::Slope => {
            let slopes = host.alibi_slopes.as_mut().context("a case with alibi")?;
            slopes[1] = f32::NAN;
            inputs.alibi_slopes = Some(upload(slopes, &[h], DType::F32, dev)?);
            nan_rows.extend((0..n).map(|token| (token, 1)));
        }
        Poison::Sink => {
            let sinks = host.sinks.as_mut().context("a case with sinks")?;
            sinks[0] = f32::NAN;
            sinks[h - 1] = f32::INFINITY;
            sinks[1] = f32::NEG_INFINITY;
            inputs.sinks = Some(upload(sinks, &[h], DType::F32, dev)?);
            nan_rows.extend((0..n).flat_map(|token| [(token, 0), (token, h - 1)]));
        }
        Poison::QqBias => {
            let (bias, (rows, cols)) = host.qq_bias.as_mut().context("a case with qq_bias")?;
            // bias[0][0] is added to the score of each sequence's first new
            // token against itself, which it always sees.
            bias[0] = f32::NAN;
            inputs.qq_bias = Some(upload(bias, &[*rows, *cols], DType::F32, dev)?);
            for (_, token0, q_len, _, _) in &seqs {
                if *q_len > 0 {
                    nan_rows.extend((0..h).map(|hd| (*token0, hd)));
                }
            }
        }
    }
    Ok(nan_rows)
}

/// Runs `case` on `dev` with `what` poisoned and checks every output
/// element: NaN exactly where expected, exact zeros for rows with no visible
/// key, the oracle's value within the case's tolerance elsewhere.
fn check_poisoned(case: &Case, what: Poison, dev: &Device) -> Result<()> {
    let label = format!("{what:?}: {}", case.label());
    let mut inputs = case.build(dev).context(label.clone())?;
    let nan_rows = poison(case, &mut inputs, what, dev).context(label.clone())?;
    let actual = run_op(case, &inputs).context(label.clone())?;
    let expected = reference::paged_attention_f64(&inputs.q, &case.params(&inputs))?;
    let (h, d) = (case.num_heads, case.head_size);
    let tol = Tolerance::for_case(case);
    let (mut nan_seen, mut finite_checked) = (0, 0);
    for (i, (&a, &e)) in actual.iter().zip(expected.values()).enumerate() {
        let (token, head, dim) = (i / (h * d), (i / d) % h, i % d);
        let at = format!("{label}: (token {token}, head {head}, dim {dim})");
        if nan_rows.contains(&(token, head)) || e.is_nan() {
            ensure!(a.is_nan(), "{at}: got {a}, expected NaN");
            nan_seen += 1;
        } else if expected.empty_rows()[token * h + head] {
            ensure!(a == 0.0, "{at}: a row with no visible key gave {a}");
        } else {
            ensure!(
                a.is_finite() && (a as f64 - e).abs() <= tol.atol + tol.rtol * e.abs(),
                "{at}: got {a}, expected {e}"
            );
            finite_checked += 1;
        }
    }
    ensure!(nan_seen > 0, "{label}: no NaN was expected");
    ensure!(finite_checked > 0, "{label}: no finite row was checked");
    Ok(())
}

/// Cases covering the CPU path and every CUDA kernel path: f32 (scalar
/// kernel), decode-only with split-KV (segments + reduction), a mixed batch
/// (decode and prefill launches), prefill tiles with a window and softcap,
/// fp8 caches with sinks and ALiBi, head size 256, fp8 output, prefix ranges.
fn cases() -> Vec<Case> {
    vec![
        Case::new(&[(1, 50), (7, 30), (12, 12)], (4, 2), 32, 16, DType::F32)
            .with_kv_split(KvSplit::Never)
            .with_seed(1),
        Case::new(
            &[(1, 700), (1, 33), (1, 1000), (1, 64)],
            (8, 2),
            128,
            16,
            DType::BF16,
        )
        .with_kv_split(KvSplit::Segments(3))
        .with_seed(2),
        Case::new(
            &[(1, 300), (5, 40), (40, 90), (1, 17)],
            (8, 2),
            64,
            16,
            DType::F16,
        )
        .with_seed(3),
        Case::new(
            &[(70, 70), (33, 80), (1, 200)],
            (4, 2),
            128,
            16,
            DType::BF16,
        )
        .with_window(Some(32))
        .with_softcap(Some(30.0))
        .with_kv_split(KvSplit::Never)
        .with_seed(4),
        Case::new(&[(1, 200), (20, 60), (1, 90)], (6, 3), 64, 16, DType::F16)
            .with_fp8_cache(true)
            .with_sinks(true)
            .with_alibi(true)
            .with_kv_split(KvSplit::Segments(2))
            .with_seed(5),
        Case::new(&[(1, 100), (3, 50), (9, 9)], (4, 1), 256, 32, DType::BF16)
            .with_output_scale(Some(0.05))
            .with_seed(6),
        Case::new(&[(1, 80), (16, 40), (5, 5)], (4, 2), 64, 16, DType::F32)
            .with_fp8_cache(true)
            .with_prefix(Prefix::Random)
            .with_seed(7),
        Case::new(&[(1, 120), (24, 24), (6, 30)], (4, 2), 64, 16, DType::BF16)
            .with_prefix(Prefix::Random)
            .with_seed(8),
    ]
}

fn nan_in_queries(dev: &Device) -> Result<()> {
    cases()
        .iter()
        .try_for_each(|c| check_poisoned(c, Poison::Query, dev))
}

fn nan_in_a_key(dev: &Device) -> Result<()> {
    cases()
        .iter()
        .try_for_each(|c| check_poisoned(c, Poison::Key, dev))
}

fn nan_in_a_value(dev: &Device) -> Result<()> {
    cases()
        .iter()
        .try_for_each(|c| check_poisoned(c, Poison::Value, dev))
}

/// On the CPU a value NaN stays out of the rows that mask its key.
#[test]
fn nan_value_masked_for_some_rows_on_cpu() -> Result<()> {
    let masked_somewhere = cases().into_iter().filter(|c| c.max_q_len() > 1);
    let mut n = 0;
    for c in masked_somewhere {
        check_poisoned(&c, Poison::ValueMaskedForSome, &Device::Cpu)?;
        n += 1;
    }
    ensure!(n >= 5, "only {n} cases");
    Ok(())
}

/// NaN slopes, NaN or +inf sinks and NaN bias entries: cases that carry
/// the feature, on each kernel path (the bias only where some sequence
/// has more than one new token: it applies among new tokens).
fn nan_in_slopes_sinks_and_bias(dev: &Device) -> Result<()> {
    for (i, c) in cases().into_iter().enumerate() {
        let split = [KvSplit::Auto, KvSplit::Segments(3), KvSplit::Never][i % 3];
        let c = c.with_kv_split(split);
        check_poisoned(&c.clone().with_alibi(true), Poison::Slope, dev)?;
        check_poisoned(&c.clone().with_sinks(true), Poison::Sink, dev)?;
        if c.max_q_len() > 1 {
            check_poisoned(&c.with_qq_bias(QqBias::Random), Poison::QqBias, dev)?;
        }
    }
    Ok(())
}

device_test!(
    nan_in_queries,
    nan_in_a_key,
    nan_in_a_value,
    nan_in_slopes_sinks_and_bias,
);
