//! Sampling a token from a row of logits with a counter-based random
//! stream: the definition a device sampler implements (the reference here
//! runs on the host), so that the same seed and step give the same token on
//! either side.
//!
//! For one row `x` `(vocab,)` and its [`RowSampling`]:
//! 1. `m = max(x)`; a row with a NaN or an infinity picks no token (error);
//! 2. `s_i = (x_i - m) / temperature` (f32), so `p_i ∝ exp(s_i)`;
//! 3. the kept tokens: `s_i >= ln(min_p)` (min-p: at least `min_p` times the
//!    most likely token's probability); then the `top_k` largest (every
//!    token equal to the k-th largest value is kept too); then, among those,
//!    the most likely ones whose probability mass (renormalised over the
//!    kept tokens, summed from the most likely down) first reaches `top_p`,
//!    again keeping every token equal to the last one taken; the masses are
//!    exact integers (`src/ops/sample_mass.rs`), so the cut does not depend
//!    on the order of any sum;
//! 4. the token: the kept index with the largest `s_i + g_i`, where
//!    `g_i = -ln(-ln(u_i))` is a Gumbel variate of the uniform
//!    `u_i = philox(seed, step, i)` in (0, 1) (lowest index on ties). This
//!    draws exactly from `softmax(s)` restricted to the kept tokens (the
//!    Gumbel-max trick), with no sort and no cumulative sum of the draw.

use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::sample_mass::{mass_quanta, mass_target, MASS_MAX_VOCAB};

const OP: &str = "sample";

/// u32 words of one row's parameters on the device (see [`SampleRows`]).
pub const SAMPLE_PARAM_WORDS: usize = 8;

#[cfg(feature = "cuda")]
const _: () = assert!(SAMPLE_PARAM_WORDS == crate::cuda::layer_shapes::SAMPLE_PARAM_WORDS);

/// How one row is sampled. `Default`: temperature 1, every filter off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// Softmax temperature, finite and `> 0`.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 is off.
    pub top_k: u32,
    /// Keep the most likely tokens holding `top_p` of the probability, in
    /// `(0, 1]`; 1 is off.
    pub top_p: f32,
    /// Keep the tokens at least `min_p` times as likely as the most likely
    /// one, in `[0, 1]`; 0 is off.
    pub min_p: f32,
    /// The request's seed.
    pub seed: u64,
    /// The draw's position in the request's stream (its output token index).
    pub step: u64,
}

impl Default for RowSampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            step: 0,
        }
    }
}

impl RowSampling {
    /// Checks the ranges above; the message names the parameter and value.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            bail!(
                "{OP}: temperature must be finite and > 0, got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("{OP}: top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("{OP}: min_p must be in [0, 1], got {}", self.min_p);
        }
        Ok(())
    }
}

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
/// 3", SC 2011): four 32-bit outputs of a 128-bit counter under a 64-bit key.
pub fn philox4x32_10(key: [u32; 2], ctr: [u32; 4]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut k, mut c) = (key, ctr);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [
            ((p1 >> 32) as u32) ^ c[1] ^ k[0],
            p1 as u32,
            ((p0 >> 32) as u32) ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// The uniform in (0, 1) of token `index` of draw `step` under `seed`: the
/// first Philox output of counter `(index, step lo, step hi, 0)`, as
/// `(u + 0.5) / 2^32` (never 0 or 1).
pub fn uniform(seed: u64, step: u64, index: u32) -> f64 {
    let out = philox4x32_10(
        [seed as u32, (seed >> 32) as u32],
        [index, step as u32, (step >> 32) as u32, 0],
    );
    (out[0] as f64 + 0.5) / 4_294_967_296.0
}

/// Most likely first; equal values in index order.
fn likelier(s: &[f32], a: usize, b: usize) -> std::cmp::Ordering {
    s[b].total_cmp(&s[a]).then(a.cmp(&b))
}

/// The kept tokens of `s` (logits minus their maximum, over the
/// temperature) under `p`'s filters, as a mask.
///
/// Top-p's mass, in integer quanta, is accumulated from the most likely
/// token down until it reaches `ceil(top_p * total)`; only as many of the
/// likeliest tokens are sorted as the cut needs (chunks growing 4x from
/// 64), not the whole vocabulary.
fn kept(s: &[f32], p: &RowSampling, floor: f32) -> Vec<bool> {
    let mut order: Vec<usize> = (0..s.len()).filter(|&i| s[i] >= floor).collect();
    if p.top_k > 0 && (p.top_k as usize) < order.len() {
        // 1 <= k < order.len(): `k - 1` and `order[k - 1]` are in range.
        let k = p.top_k as usize;
        order.select_nth_unstable_by(k - 1, |&a, &b| likelier(s, a, b));
        let kth = s[order[k - 1]];
        order.retain(|&i| s[i] >= kth);
        order.sort_unstable();
    }
    if p.top_p < 1.0 && order.len() > 1 {
        // At most MASS_MAX_VOCAB tokens of at most 2^40 quanta: no overflow.
        let total: u64 = order.iter().map(|&i| mass_quanta(s[i])).sum();
        let target = mass_target(p.top_p, total);
        let mut mass = 0u64;
        let mut cut = None;
        let (mut rest, mut chunk) = (order.as_mut_slice(), 64usize);
        'chunks: while !rest.is_empty() {
            let m = chunk.min(rest.len());
            if m < rest.len() {
                rest.select_nth_unstable_by(m - 1, |&a, &b| likelier(s, a, b));
            }
            let (head, tail) = rest.split_at_mut(m);
            head.sort_unstable_by(|&a, &b| likelier(s, a, b));
            for &i in head.iter() {
                mass += mass_quanta(s[i]);
                if mass >= target {
                    cut = Some(s[i]);
                    break 'chunks;
                }
            }
            rest = tail;
            chunk *= 4;
        }
        if let Some(cut) = cut {
            order.retain(|&i| s[i] >= cut);
        }
    }
    let mut keep = vec![false; s.len()];
    for i in order {
        keep[i] = true;
    }
    keep
}

/// The token [`RowSampling`] picks from `logits` (the reference of the
/// definition at the top of this module).
///
/// # Arguments
/// * `logits` - one row `(vocab,)`, `vocab >= 1`.
/// * `p` - the row's parameters (checked).
pub fn sample_row(logits: &[f32], p: &RowSampling) -> Result<u32> {
    p.validate()?;
    check_vocab(logits.len())?;
    if let Some((t, v)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        bail!(
            "{OP}: non-finite logits: token {t} of {} has logit {v}",
            logits.len()
        );
    }
    let floor = if p.min_p > 0.0 {
        p.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    sample_with_floor(logits, p, floor)
}

/// Refuses an empty vocabulary, or one too large for exact masses.
fn check_vocab(vocab: usize) -> Result<()> {
    if vocab == 0 {
        bail!("{OP}: logits must have at least one token");
    }
    if vocab > MASS_MAX_VOCAB {
        bail!(
            "{OP}: a vocabulary of {vocab} tokens is over the {MASS_MAX_VOCAB} the sampler takes"
        );
    }
    Ok(())
}

/// [`sample_row`] of finite `logits` with the min-p floor given.
fn sample_with_floor(logits: &[f32], p: &RowSampling, floor: f32) -> Result<u32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: Vec<f32> = logits.iter().map(|&x| (x - m) / p.temperature).collect();
    let keep = kept(&s, p, floor);
    let mut best: Option<(f64, usize)> = None;
    for (i, &v) in s.iter().enumerate() {
        if !keep[i] {
            continue;
        }
        let g = -(-uniform(p.seed, p.step, i as u32).ln()).ln();
        let key = v as f64 + g;
        if best.is_none_or(|(b, _)| key > b) {
            best = Some((key, i));
        }
    }
    match best {
        Some((_, i)) => Ok(i as u32),
        None => bail!("{OP}: no token is kept"),
    }
}

impl RowSampling {
    /// The row's device parameters: temperature, the min-p floor
    /// `ln(min_p)` in f32 (`-inf` when off), top_k, top_p (f32 bits), seed
    /// and step (low word first).
    fn words(&self) -> [u32; SAMPLE_PARAM_WORDS] {
        let floor = if self.min_p > 0.0 {
            self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        [
            self.temperature.to_bits(),
            floor.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.step as u32,
            (self.step >> 32) as u32,
        ]
    }

    /// The row back from its device words (`min_p` from the floor).
    fn from_words(w: &[u32]) -> Self {
        Self {
            temperature: f32::from_bits(w[0]),
            top_k: w[2],
            top_p: f32::from_bits(w[3]),
            min_p: f32::from_bits(w[1]).exp(),
            seed: w[4] as u64 | (w[5] as u64) << 32,
            step: w[6] as u64 | (w[7] as u64) << 32,
        }
    }
}

/// [`sample_rows`]' op on `(rows, vocab)` f32 logits and `(rows,
/// SAMPLE_PARAM_WORDS)` u32 parameters.
#[derive(Clone, Copy, Debug)]
pub struct SampleRows;

fn rows_vocab(logits: &Layout, params: &Layout) -> Result<(usize, usize)> {
    let &[rows, vocab] = logits.dims() else {
        bail!(
            "{OP}: logits must be (rows, vocab), got {:?}",
            logits.dims()
        );
    };
    if params.dims() != [rows, SAMPLE_PARAM_WORDS] {
        bail!(
            "{OP}: params must be ({rows}, {SAMPLE_PARAM_WORDS}), got {:?}",
            params.dims()
        );
    }
    Ok((rows, vocab))
}

impl candle_core::CustomOp2 for SampleRows {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        l: &CpuStorage,
        ll: &Layout,
        p: &CpuStorage,
        pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = rows_vocab(ll, pl)?;
        check_vocab(vocab)?;
        let (Some((ls, le)), Some((ps, pe))) = (ll.contiguous_offsets(), pl.contiguous_offsets())
        else {
            bail!("{OP}: logits and params must be contiguous");
        };
        let logits = &l.as_slice::<f32>()?[ls..le];
        let words = &p.as_slice::<u32>()?[ps..pe];
        // `rows_vocab` checked the logits' layout is (rows, vocab) and the
        // params' (rows, SAMPLE_PARAM_WORDS), and both are contiguous: the
        // slices below hold exactly rows * vocab and rows * words values, so
        // the row ranges are in bounds. Rows are independent: one rayon task each.
        let pairs: Vec<[u32; 2]> = (0..rows)
            .into_par_iter()
            .map(|r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let w = &words[r * SAMPLE_PARAM_WORDS..(r + 1) * SAMPLE_PARAM_WORDS];
                if row.iter().any(|v| !v.is_finite()) {
                    return Ok([0, 0]);
                }
                // The floor travels as ln(min_p), computed once on the host.
                let p = RowSampling::from_words(w);
                Ok([sample_with_floor(row, &p, f32::from_bits(w[1]))?, 1])
            })
            .collect::<Result<_>>()?;
        let out: Vec<u32> = pairs.into_iter().flatten().collect();
        Ok((CpuStorage::U32(out), Shape::from((rows, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        l: &candle_core::CudaStorage,
        ll: &Layout,
        p: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, vocab) = rows_vocab(ll, pl)?;
        check_vocab(vocab)?;
        let out = crate::cuda::layer_ops::sample_rows(OP, (l, ll), (p, pl), rows, vocab)?;
        Ok((out, Shape::from((rows, 2))))
    }
}

/// One token of each row of `logits`, drawn as this module defines it.
///
/// # Arguments
/// * `logits` - `(rows, vocab)` f32, `vocab >= 1`.
/// * `rows` - one [`RowSampling`] per row (checked).
///
/// Returns `(rows, 2)` u32: per row the token and 1, or 0 and 0 for a row
/// holding a NaN or an infinity (no token: the caller ends that request).
pub fn sample_rows(logits: &Tensor, rows: &[RowSampling]) -> Result<Tensor> {
    let &[n, vocab] = logits.dims() else {
        bail!(
            "{OP}: logits must be (rows, vocab), got {:?}",
            logits.dims()
        );
    };
    if n != rows.len() {
        bail!("{OP}: {n} rows of logits but {} parameter rows", rows.len());
    }
    check_vocab(vocab)?;
    if logits.dtype() != DType::F32 {
        bail!("{OP}: logits must be f32, got {:?}", logits.dtype());
    }
    for r in rows {
        r.validate()?;
    }
    let words: Vec<u32> = rows.iter().flat_map(|r| r.words()).collect();
    let params = Tensor::from_vec(words, (n, SAMPLE_PARAM_WORDS), logits.device())?;
    logits.contiguous()?.apply_op2_no_bwd(&params, &SampleRows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact probabilities of the kept tokens of `logits` under `p`.
    fn exact(logits: &[f32], p: &RowSampling) -> Vec<f64> {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: Vec<f32> = logits.iter().map(|&x| (x - m) / p.temperature).collect();
        let floor = if p.min_p > 0.0 {
            p.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        let keep = kept(&s, p, floor);
        let w: Vec<f64> = s
            .iter()
            .zip(&keep)
            .map(|(&v, &k)| if k { (v as f64).exp() } else { 0.0 })
            .collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|v| v / z).collect()
    }

    #[test]
    fn philox_matches_the_published_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(
            philox4x32_10([0, 0], [0, 0, 0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([0xffff_ffff; 2], [0xffff_ffff; 4]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0xa409_3822, 0x299f_31d0],
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    /// `kept` written the plain way: sort everything, cut, cut.
    fn kept_by_full_sort(s: &[f32], p: &RowSampling, floor: f32) -> Vec<bool> {
        let mut order: Vec<usize> = (0..s.len()).filter(|&i| s[i] >= floor).collect();
        let total_of = |order: &[usize]| -> u64 { order.iter().map(|&i| mass_quanta(s[i])).sum() };
        order.sort_by(|&a, &b| likelier(s, a, b));
        if p.top_k > 0 && (p.top_k as usize) < order.len() {
            let kth = s[order[p.top_k as usize - 1]];
            order.retain(|&i| s[i] >= kth);
        }
        if p.top_p < 1.0 && order.len() > 1 {
            let target = mass_target(p.top_p, total_of(&order));
            let mut mass = 0;
            for j in 0..order.len() {
                mass += mass_quanta(s[order[j]]);
                if mass >= target {
                    let cut = s[order[j]];
                    order.retain(|&i| s[i] >= cut);
                    break;
                }
            }
        }
        let mut keep = vec![false; s.len()];
        for i in order {
            keep[i] = true;
        }
        keep
    }

    #[test]
    fn chunked_cuts_equal_a_full_sort() {
        // Values on a coarse grid (many ties), rows longer than a few chunks.
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for case in 0..300 {
            let n = [1, 2, 63, 64, 65, 300, 5000][case % 7];
            let grid = [0.25f32, 1.0, 0.01][case % 3];
            let raw: Vec<f32> = (0..n).map(|_| (next() % 40) as f32 * -grid).collect();
            let m = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let s: Vec<f32> = raw.iter().map(|&x| x - m).collect();
            let p = RowSampling {
                top_k: [0, 1, 7, 100, 4000][case % 5],
                top_p: [1.0, 0.5, 0.9, 0.999, 0.01][(case / 5) % 5],
                ..Default::default()
            };
            let floor = if case % 4 == 0 {
                -3.0
            } else {
                f32::NEG_INFINITY
            };
            assert_eq!(
                kept(&s, &p, floor),
                kept_by_full_sort(&s, &p, floor),
                "case {case}: n {n}, {p:?}, floor {floor}"
            );
        }
    }

    #[test]
    fn filters_keep_what_they_promise() {
        let logits = [3.0f32, 1.0, 2.0, 2.0, -1.0, 0.5];
        let base = RowSampling::default();
        let k2 = exact(&logits, &RowSampling { top_k: 2, ..base });
        // The 2nd largest value (2.0) is shared by tokens 2 and 3: both kept.
        assert_eq!(
            k2.iter().map(|&q| q > 0.0).collect::<Vec<_>>(),
            [true, false, true, true, false, false]
        );
        let p = exact(&logits, &RowSampling { top_p: 0.5, ..base });
        // Token 0 alone holds 0.52 of the mass: it is the nucleus.
        assert_eq!(p.iter().filter(|&&q| q > 0.0).count(), 1);
        let mp = exact(&logits, &RowSampling { min_p: 0.3, ..base });
        // exp(2 - 3) = 0.37 >= 0.3 > exp(1 - 3): tokens 0, 2, 3.
        assert_eq!(
            mp.iter().map(|&q| q > 0.0).collect::<Vec<_>>(),
            [true, false, true, true, false, false]
        );
    }

    #[test]
    fn draws_follow_the_kept_distribution_chi_square() -> Result<()> {
        let logits: Vec<f32> = (0..12)
            .map(|i| ((i * 7) % 12) as f32 * 0.35 - 1.0)
            .collect();
        for p in [
            RowSampling {
                temperature: 0.8,
                ..Default::default()
            },
            RowSampling {
                temperature: 1.3,
                top_k: 6,
                top_p: 0.9,
                ..Default::default()
            },
            RowSampling {
                temperature: 0.7,
                min_p: 0.05,
                ..Default::default()
            },
        ] {
            let want = exact(&logits, &p);
            let draws = 40_000u64;
            let mut counts = vec![0u64; logits.len()];
            for d in 0..draws {
                let row = RowSampling {
                    seed: 1234 + d / 100,
                    step: d % 100,
                    ..p
                };
                counts[sample_row(&logits, &row)? as usize] += 1;
            }
            let mut chi2 = 0.0;
            let mut dof = 0;
            for (c, q) in counts.iter().zip(&want) {
                if *q == 0.0 {
                    assert_eq!(*c, 0, "{p:?}: a dropped token was drawn");
                    continue;
                }
                let e = q * draws as f64;
                chi2 += (*c as f64 - e).powi(2) / e;
                dof += 1;
            }
            dof -= 1;
            // The 0.999 quantile of chi-square with up to 11 degrees of
            // freedom is at most 31.3: a false alarm once in 1,000 seeds.
            assert!(chi2 < 31.3, "{p:?}: chi-square {chi2:.1} with {dof} dof");
        }
        Ok(())
    }

    #[test]
    fn sample_rows_on_the_cpu_is_sample_row_per_row() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let vocab = 300;
        let logits = Tensor::randn(0f32, 2., (4, vocab), &dev)?;
        let rows = [
            RowSampling {
                seed: 1,
                ..Default::default()
            },
            RowSampling {
                temperature: 0.6,
                top_k: 20,
                seed: 2,
                step: 9,
                ..Default::default()
            },
            RowSampling {
                top_p: 0.8,
                min_p: 0.01,
                seed: 3,
                step: 1 << 40,
                ..Default::default()
            },
            RowSampling {
                temperature: 1.7,
                top_k: 5,
                top_p: 0.5,
                seed: u64::MAX,
                ..Default::default()
            },
        ];
        let got = sample_rows(&logits, &rows)?.to_vec2::<u32>()?;
        let values = logits.to_vec2::<f32>()?;
        for (r, p) in rows.iter().enumerate() {
            assert_eq!(got[r], [sample_row(&values[r], p)?, 1], "row {r}");
        }
        let mut bad = values.clone();
        bad[2][7] = f32::INFINITY;
        let bad = Tensor::new(bad, &dev)?;
        assert_eq!(sample_rows(&bad, &rows)?.to_vec2::<u32>()?[2], [0, 0]);
        let err = sample_rows(&logits, &rows[..3]).unwrap_err().to_string();
        assert!(err.contains("4 rows of logits but 3"), "{err}");
        Ok(())
    }

    #[test]
    fn same_seed_and_step_same_token_and_bad_input_is_an_error() -> Result<()> {
        let logits = [0.1f32, 0.2, 0.3, 0.25];
        let p = RowSampling {
            seed: 7,
            step: 3,
            ..Default::default()
        };
        assert_eq!(sample_row(&logits, &p)?, sample_row(&logits, &p)?);
        let err = sample_row(&[1.0, f32::NAN], &p).unwrap_err().to_string();
        assert!(err.contains("token 1 of 2 has logit NaN"), "{err}");
        let err = sample_row(
            &logits,
            &RowSampling {
                temperature: 0.0,
                ..p
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("temperature"), "{err}");
        let err = sample_row(&logits, &RowSampling { top_p: 0.0, ..p })
            .unwrap_err()
            .to_string();
        assert!(err.contains("top_p"), "{err}");
        let huge = vec![0f32; MASS_MAX_VOCAB + 1];
        let err = sample_row(&huge, &p).unwrap_err().to_string();
        assert!(err.contains("vocabulary of 8388609 tokens"), "{err}");
        Ok(())
    }
}
