//! Picks a step's tokens on the logits' device: the penalties as one
//! gather and one scatter over the touched logits, the greedy rows' argmax
//! and finiteness in one kernel, the sampled rows' draws in another
//! ([`crate::ops::sample`]), and one copy of `2 * rows` integers back.
//! Nothing the size of a vocabulary row comes to the host.
//!
//! On a CUDA device, [`DevicePicking`] says which rows the crate's own
//! picking kernels take: by default every row (penalties, the greedy
//! kernel and the sampling kernel); `Greedy` only the plain greedy rows,
//! every other row (a penalty or a draw) coming to the host in one copy,
//! where the same definition picks its token; `Off` none of them
//! (candle's argmax for the plain greedy rows). The tokens are the same in
//! all three. An engine takes it from
//! [`Engine::with_device_picking`](super::Engine::with_device_picking), or
//! from `CANDLE_PAGED_ATTENTION_DEVICE_SAMPLING` when it is built.

use candle_core::{bail, DType, Result, Tensor, D};

use super::OP;
use crate::ops::sample::{sample_rows, RowSampling};

/// The penalties of one logit row: `(token, factor, subtract)` per token
/// they touch, ascending by token. The new logit of `token` is
/// `(x >= 0 ? x / factor : x * factor) - subtract`.
pub(crate) type RowPenalties = Vec<(u32, f32, f32)>;

/// What one logit row of a step needs to pick its token: its penalties and
/// its draw (`None`: the argmax).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RowPick {
    pub(crate) penalties: RowPenalties,
    pub(crate) draw: Option<RowSampling>,
}

/// Rows `idx` of `(rows, vocab)` `logits`: a view of all of them when `idx`
/// lists every row in order, else one gather on the logits' device.
pub(super) fn pick_rows(logits: &Tensor, idx: &[usize]) -> Result<Tensor> {
    if idx.iter().copied().eq(0..logits.dim(0)?) {
        return Ok(logits.clone());
    }
    let ids: Vec<u32> = idx.iter().map(|&r| r as u32).collect();
    logits.index_select(&Tensor::new(ids, logits.device())?, 0)
}

/// The first NaN or infinity of `logits` (any shape, any float dtype,
/// read flattened) in words, `"token 3 of 32 has logit NaN"`; `None` when
/// every value is finite. Copies the values to the host: for a row that
/// picked no token, or a single row.
pub(super) fn first_non_finite(logits: &Tensor) -> Result<Option<String>> {
    let values = logits
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(values
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite())
        .map(|(t, v)| format!("token {t} of {} has logit {v}", values.len())))
}

/// Which rows of a step's CUDA logits the crate's picking kernels take
/// (the tokens are the same in every mode; logits on the CPU are always
/// picked on the CPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DevicePicking {
    /// None: candle's argmax for plain greedy rows, one copy to the host
    /// for the others.
    Off,
    /// The greedy kernel for plain greedy rows, one copy to the host for
    /// the others (a penalty or a draw).
    Greedy,
    /// Every row: penalties, the greedy and the sampling kernel (the
    /// default).
    #[default]
    All,
}

impl DevicePicking {
    /// From `CANDLE_PAGED_ATTENTION_DEVICE_SAMPLING`: `0` is
    /// [`Off`](Self::Off), `greedy` [`Greedy`](Self::Greedy), unset or any
    /// other value [`All`](Self::All).
    pub fn from_env() -> Self {
        match std::env::var("CANDLE_PAGED_ATTENTION_DEVICE_SAMPLING").as_deref() {
            Ok("0") => Self::Off,
            Ok("greedy") => Self::Greedy,
            _ => Self::All,
        }
    }
}

/// `(rows, 2)` u32 of `[argmax, finite]` per row of `(rows, vocab)`
/// `logits` (finite is 1 when the row holds no NaN and no infinity),
/// computed on the logits' device (by the crate's kernel on CUDA f32
/// logits unless `picking` is [`DevicePicking::Off`]).
pub(super) fn greedy_pairs(logits: &Tensor, picking: DevicePicking) -> Result<Tensor> {
    if logits.device().is_cuda() && logits.dtype() == DType::F32 && picking != DevicePicking::Off {
        // One kernel and one read of the logits for both answers.
        return crate::ops::greedy::greedy_tokens(logits);
    }
    let tokens = logits.argmax(D::Minus1)?;
    // x - x is 0 for a finite logit and NaN for NaN or +-inf, so a row sums
    // to exactly 0 when every logit is finite, and to NaN otherwise.
    let finite = logits
        .sub(logits)?
        .sum(D::Minus1)?
        .eq(0f64)?
        .to_dtype(DType::U32)?;
    Tensor::stack(&[&tokens, &finite], 1)
}

/// `(rows, vocab)` `logits` with each row's penalties applied (f32; the
/// logits themselves when no row has one). A penalty's token outside the
/// vocabulary touches nothing (as in candle-transformers).
pub(super) fn apply_penalties(logits: &Tensor, picks: &[RowPick]) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let (mut idx, mut factor, mut subtract) = (Vec::new(), Vec::new(), Vec::new());
    for (r, pick) in picks.iter().enumerate() {
        for &(token, f, s) in &pick.penalties {
            if (token as usize) < vocab {
                let Ok(i) = u32::try_from(r * vocab + token as usize) else {
                    bail!("{OP}: a penalty at row {r} of {rows} rows of {vocab} logits does not fit 32-bit indices");
                };
                idx.push(i);
                factor.push(f);
                subtract.push(s);
            }
        }
    }
    if idx.is_empty() {
        return Ok(logits.clone());
    }
    let dev = logits.device();
    let flat = logits.to_dtype(DType::F32)?.flatten_all()?;
    let idx = Tensor::new(idx, dev)?;
    let x = flat.index_select(&idx, 0)?;
    let factor = Tensor::new(factor, dev)?;
    let y = x
        .ge(0f64)?
        .where_cond(&x.div(&factor)?, &x.mul(&factor)?)?
        .sub(&Tensor::new(subtract, dev)?)?;
    flat.scatter(&idx, &y, 0)?.reshape((rows, vocab))
}

/// The token of each row of `(rows, vocab)` `logits` as its [`RowPick`]
/// says (penalties, then the argmax or a draw), or `None` for a row whose
/// (penalised) logits hold a NaN or an infinity. Runs on the logits'
/// device and reads back `2 * rows` integers; on a CUDA device `picking`
/// says which rows the crate's kernels take.
pub(crate) fn pick_tokens(
    logits: &Tensor,
    picks: &[RowPick],
    picking: DevicePicking,
) -> Result<Vec<Option<u32>>> {
    let (rows, _) = logits.dims2()?;
    if rows != picks.len() {
        bail!(
            "{OP}: {rows} rows of logits but {} rows to pick",
            picks.len()
        );
    }
    if logits.device().is_cuda() && picking != DevicePicking::All {
        return pick_on_host(logits, picks, picking);
    }
    let logits = apply_penalties(logits, picks)?;
    let (greedy, drawn): (Vec<usize>, Vec<usize>) =
        (0..rows).partition(|&r| picks[r].draw.is_none());
    let mut parts = Vec::with_capacity(2);
    if !greedy.is_empty() {
        parts.push(greedy_pairs(&pick_rows(&logits, &greedy)?, picking)?);
    }
    if !drawn.is_empty() {
        let draws: Vec<RowSampling> = drawn.iter().filter_map(|&r| picks[r].draw).collect();
        let rows = pick_rows(&logits, &drawn)?.to_dtype(DType::F32)?;
        parts.push(sample_rows(&rows, &draws)?);
    }
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    let pairs: Vec<Vec<u32>> = Tensor::cat(&parts, 0)?.to_vec2()?;
    let mut tokens = vec![None; rows];
    for (pair, &r) in pairs.iter().zip(greedy.iter().chain(&drawn)) {
        tokens[r] = (pair[1] == 1).then_some(pair[0]);
    }
    Ok(tokens)
}

/// [`pick_tokens`] of CUDA `logits` without the sampling kernel: the plain
/// greedy rows on the device ([`greedy_pairs`]), the others (a penalty or a
/// draw) copied to the host in one copy and picked there.
fn pick_on_host(
    logits: &Tensor,
    picks: &[RowPick],
    picking: DevicePicking,
) -> Result<Vec<Option<u32>>> {
    let (plain, other): (Vec<usize>, Vec<usize>) =
        (0..picks.len()).partition(|&r| picks[r].draw.is_none() && picks[r].penalties.is_empty());
    let mut tokens = vec![None; picks.len()];
    if !plain.is_empty() {
        let pairs: Vec<Vec<u32>> = greedy_pairs(&pick_rows(logits, &plain)?, picking)?.to_vec2()?;
        for (pair, &r) in pairs.iter().zip(&plain) {
            tokens[r] = (pair[1] == 1).then_some(pair[0]);
        }
    }
    if !other.is_empty() {
        let host = pick_rows(logits, &other)?.to_device(&candle_core::Device::Cpu)?;
        let host_picks: Vec<RowPick> = other.iter().map(|&r| picks[r].clone()).collect();
        for (t, &r) in pick_tokens(&host, &host_picks, picking)?
            .into_iter()
            .zip(&other)
        {
            tokens[r] = t;
        }
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::ops::sample::sample_row;

    #[test]
    fn greedy_pairs_flag_non_finite_rows_and_keep_the_tokens_of_finite_ones() -> Result<()> {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let rows: [[f32; 5]; 6] = [
            [0.0, 1.0, 3.0, -2.0, 2.5],
            [nan; 5],
            [1.0, 2.0, nan, 0.0, 0.0],
            [1.0, inf, 2.0, 0.0, 0.0],
            [-inf, 1.0, 2.0, 0.0, 0.0],
            // Large finite logits: x - x is still exactly 0.
            [1e38, -1e38, 0.0, 0.0, 1.0],
        ];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let logits = Tensor::from_vec(flat.clone(), (6, 5), &Device::Cpu)?.to_dtype(dtype)?;
            let pairs: Vec<Vec<u32>> = greedy_pairs(&logits, DevicePicking::All)?.to_vec2()?;
            let finite: Vec<bool> = pairs.iter().map(|p| p[1] == 1).collect();
            // 1e38 is infinite in f16: that row is flagged there.
            let last = dtype != DType::F16;
            assert_eq!(
                finite,
                [true, false, false, false, false, last],
                "{dtype:?}"
            );
            // The argmax of the finite rows is candle's, unchanged.
            let want: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
            let tokens: Vec<u32> = pairs.iter().map(|p| p[0]).collect();
            assert_eq!(tokens, want, "{dtype:?}");
            assert_eq!((tokens[0], tokens[5]), (2, 0), "{dtype:?}");
            // A gather of some rows, as for a batch of greedy and sampled rows.
            let pairs: Vec<Vec<u32>> =
                greedy_pairs(&pick_rows(&logits, &[3, 0])?, DevicePicking::All)?.to_vec2()?;
            assert_eq!(pairs, [[1, 0], [2, 1]], "{dtype:?}");
        }
        Ok(())
    }

    #[test]
    fn penalties_match_their_definition_entry_by_entry() -> Result<()> {
        let rows = [[2.0f32, -1.0, 0.0, 4.0, -0.5], [1.0, 1.0, 1.0, 1.0, 1.0]];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (2, 5), &Device::Cpu)?;
        let picks = [
            RowPick {
                // 2 / 2; -1 * 2 - 0.5; 0 / 2 (zero counts as positive); token 9 is outside.
                penalties: vec![(0, 2.0, 0.0), (1, 2.0, 0.5), (2, 2.0, 0.0), (9, 3.0, 1.0)],
                draw: None,
            },
            RowPick {
                penalties: vec![(4, 1.0, 0.25)],
                draw: None,
            },
        ];
        let got: Vec<Vec<f32>> = apply_penalties(&logits, &picks)?.to_vec2()?;
        assert_eq!(
            got,
            [[1.0, -2.5, 0.0, 4.0, -0.5], [1.0, 1.0, 1.0, 1.0, 0.75]]
        );
        // No penalty: the logits themselves.
        let none = [RowPick {
            penalties: Vec::new(),
            draw: None,
        }];
        let one = logits.narrow(0, 0, 1)?;
        assert_eq!(
            apply_penalties(&one, &none)?.to_vec2::<f32>()?,
            one.to_vec2::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn a_mixed_batch_picks_each_row_as_its_own_pick_says() -> Result<()> {
        let vocab = 37;
        let rows: Vec<Vec<f32>> = (0..4)
            .map(|r| {
                (0..vocab)
                    .map(|i| ((i * 7 + r * 3) % 11) as f32 * 0.3)
                    .collect()
            })
            .collect();
        let mut rows = rows;
        rows[3][2] = 5.0;
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (4, vocab), &Device::Cpu)?;
        let draw = |seed, step| RowSampling {
            temperature: 0.7,
            top_p: 0.9,
            seed,
            step,
            ..Default::default()
        };
        let picks = [
            RowPick {
                penalties: Vec::new(),
                draw: Some(draw(5, 3)),
            },
            RowPick {
                penalties: Vec::new(),
                draw: None,
            },
            RowPick {
                penalties: vec![(2, 1.0, 100.0)],
                draw: Some(draw(6, 0)),
            },
            RowPick {
                penalties: vec![(2, 1.0, 100.0)],
                draw: None,
            },
        ];
        let got = pick_tokens(&logits, &picks, DevicePicking::All)?;
        let argmax = |r: &[f32]| {
            let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            r.iter().position(|&v| v == m).map(|i| i as u32)
        };
        let mut penalised2 = rows[2].clone();
        penalised2[2] -= 100.0;
        let mut penalised3 = rows[3].clone();
        penalised3[2] -= 100.0;
        let want = [
            Some(sample_row(&rows[0], &draw(5, 3))?),
            argmax(&rows[1]),
            Some(sample_row(&penalised2, &draw(6, 0))?),
            argmax(&penalised3),
        ];
        assert_eq!(got, want);
        // Token 2 is the argmax of row 3 before its penalty only.
        assert_eq!(argmax(&rows[3]), Some(2));
        assert_ne!(got[3], Some(2));
        Ok(())
    }
}
