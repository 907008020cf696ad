//! CPU `reshape_and_cache`: copies (or quantises) each token's K or V row
//! into its slot.
//!
//! Imports `params`; never `ops` or `cuda`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use float8::F8E4M3;

use crate::cpu::elem::Elem;
use crate::params::CacheWrite;

const OP: &str = "reshape-and-cache";

/// Writes `new` `(num_tokens, num_kv_heads, head_size)` into `cache`
/// `(num_blocks, block_size, num_kv_heads, head_size)` at `slots`; an fp8
/// cache stores `x * write.inv_scale`. `write` comes from the op's checks; every slot
/// is checked against the capacity before anything is written. Tokens are
/// stored in order, so of two tokens with one slot the last one wins.
pub(crate) fn forward(
    write: &CacheWrite,
    cache: &mut CpuStorage,
    cache_layout: &Layout,
    new: &CpuStorage,
    new_layout: &Layout,
    slots: &CpuStorage,
    slots_layout: &Layout,
) -> Result<()> {
    let row = write.row;
    let (Some((c0, c1)), Some((n0, n1)), Some((s0, s1))) = (
        cache_layout.contiguous_offsets(),
        new_layout.contiguous_offsets(),
        slots_layout.contiguous_offsets(),
    ) else {
        bail!("{OP}: cache, new values and slot_mapping must be contiguous");
    };
    let CpuStorage::I64(slots) = slots else {
        bail!("{OP}: slot_mapping must be i64, got {:?}", slots.dtype());
    };
    let slots = &slots[s0..s1];
    if slots.len() != write.num_tokens || write.num_tokens.checked_mul(row) != Some(n1 - n0) {
        bail!(
            "{OP}: {} slots and {} new elements do not describe {} tokens of {row} elements",
            slots.len(),
            n1 - n0,
            write.num_tokens
        );
    }
    if write.capacity.checked_mul(row) != Some(c1 - c0) {
        bail!(
            "{OP}: the cache holds {} elements, not {} rows of {row}",
            c1 - c0,
            write.capacity
        );
    }
    if let Some((t, &slot)) = slots
        .iter()
        .enumerate()
        .find(|&(_, &s)| s >= 0 && !usize::try_from(s).is_ok_and(|s| s < write.capacity))
    {
        bail!(
            "{OP}: slot_mapping[{t}] = {slot} >= num_blocks * block_size = {}",
            write.capacity
        );
    }
    let inv_scale = write.inv_scale;
    match (cache, new) {
        (CpuStorage::F32(c), CpuStorage::F32(n)) => {
            copy_rows(&mut c[c0..c1], &n[n0..n1], slots, row)
        }
        (CpuStorage::F16(c), CpuStorage::F16(n)) => {
            copy_rows(&mut c[c0..c1], &n[n0..n1], slots, row)
        }
        (CpuStorage::BF16(c), CpuStorage::BF16(n)) => {
            copy_rows(&mut c[c0..c1], &n[n0..n1], slots, row)
        }
        (CpuStorage::F8E4M3(c), CpuStorage::F32(n)) => {
            quantise_rows(&mut c[c0..c1], &n[n0..n1], slots, row, inv_scale)
        }
        (CpuStorage::F8E4M3(c), CpuStorage::F16(n)) => {
            quantise_rows(&mut c[c0..c1], &n[n0..n1], slots, row, inv_scale)
        }
        (CpuStorage::F8E4M3(c), CpuStorage::BF16(n)) => {
            quantise_rows(&mut c[c0..c1], &n[n0..n1], slots, row, inv_scale)
        }
        (c, n) => bail!(
            "{OP}: cannot store {:?} values into a {:?} cache",
            n.dtype(),
            c.dtype()
        ),
    }
    Ok(())
}

/// The cache rows of the non-negative slots, as element ranges. The caller
/// checked every slot against the cache's rows, so `slot * row + row` is
/// within the cache slice (whose length, `capacity * row`, fits usize).
fn targets(slots: &[i64], row: usize) -> impl Iterator<Item = (usize, Option<usize>)> + '_ {
    slots
        .iter()
        .enumerate()
        .map(move |(t, &s)| (t, usize::try_from(s).ok().map(|s| s * row)))
}

fn copy_rows<T: Copy>(cache: &mut [T], new: &[T], slots: &[i64], row: usize) {
    for (t, dst) in targets(slots, row) {
        if let Some(dst) = dst {
            cache[dst..dst + row].copy_from_slice(&new[t * row..(t + 1) * row]);
        }
    }
}

fn quantise_rows<N: Elem>(
    cache: &mut [F8E4M3],
    new: &[N],
    slots: &[i64],
    row: usize,
    inv_scale: f32,
) {
    for (t, dst) in targets(slots, row) {
        if let Some(dst) = dst {
            let src = &new[t * row..(t + 1) * row];
            for (d, x) in cache[dst..dst + row].iter_mut().zip(src) {
                *d = <F8E4M3 as Elem>::from_f32(x.to_f32() * inv_scale);
            }
        }
    }
}
