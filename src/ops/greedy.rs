//! The greedy token of each row of logits, with a finiteness flag per row:
//! what an engine step reads back for its greedy sequences. One kernel and
//! one read of the logits on CUDA.
//!
//! Owns `greedy_tokens` and the `GreedyTokens` op: checks on the host, then
//! the CPU or CUDA backend.

use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor};

const OP: &str = "greedy-tokens";

/// [`greedy_tokens`]' op on `(rows, vocab)` f32 logits.
#[derive(Clone, Copy, Debug)]
pub struct GreedyTokens;

fn rows_vocab(l: &Layout) -> Result<(usize, usize)> {
    let &[rows, vocab] = l.dims() else {
        bail!("{OP}: logits must be (rows, vocab), got {:?}", l.dims());
    };
    Ok((rows, vocab))
}

/// `[token, finite]` of one row: the lowest index of the largest value (NaN
/// never wins; 0 when no value qualifies) and whether every value is finite.
fn greedy_row(row: &[f32]) -> [u32; 2] {
    let mut best = f32::NEG_INFINITY;
    let mut arg = None;
    let mut finite = true;
    for (i, &v) in row.iter().enumerate() {
        finite &= v.is_finite();
        if v > best || (v == best && arg.is_none()) {
            best = v;
            arg = Some(i);
        }
    }
    [arg.unwrap_or(0) as u32, u32::from(finite)]
}

impl candle_core::CustomOp1 for GreedyTokens {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = rows_vocab(l)?;
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("{OP}: logits must be contiguous");
        };
        let logits = &s.as_slice::<f32>()?[start..end];
        let out: Vec<u32> = if vocab == 0 {
            [0, 1].repeat(rows)
        } else {
            logits.chunks(vocab).flat_map(greedy_row).collect()
        };
        Ok((CpuStorage::U32(out), Shape::from((rows, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, vocab) = rows_vocab(l)?;
        let out = crate::cuda::layer_ops::greedy_rows(OP, (s, l), rows, vocab)?;
        Ok((out, Shape::from((rows, 2))))
    }
}

/// The greedy token of each row of `logits` and whether the row is finite.
///
/// # Arguments
/// * `logits` - `(rows, vocab)` f32, `vocab >= 1`.
///
/// Returns `(rows, 2)` u32: per row the index of its largest value (the
/// lowest index among equal maxima, as candle's `argmax`; NaN never wins),
/// and 1 if every value of the row is finite (no NaN, no infinity), else 0.
pub fn greedy_tokens(logits: &Tensor) -> Result<Tensor> {
    let &[_, vocab] = logits.dims() else {
        bail!(
            "{OP}: logits must be (rows, vocab), got {:?}",
            logits.dims()
        );
    };
    if vocab == 0 {
        bail!("{OP}: logits must have a vocabulary of at least 1");
    }
    if logits.dtype() != DType::F32 {
        bail!("{OP}: logits must be f32, got {:?}", logits.dtype());
    }
    logits.contiguous()?.apply_op1_no_bwd(&GreedyTokens)
}
