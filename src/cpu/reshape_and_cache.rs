//! CPU `reshape_and_cache`: copies (or quantises) each token's K or V row
//! into its slot.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use float8::F8E4M3;

use crate::cpu::elem::Elem;

/// Writes `new` `(num_tokens, num_kv_heads, head_size)` into `cache`
/// `(num_blocks, block_size, num_kv_heads, head_size)` at `slots`; an fp8
/// cache stores `x / scale`.
pub(crate) fn forward(
    scale: f32,
    cache: &mut CpuStorage,
    cache_layout: &Layout,
    new: &CpuStorage,
    new_layout: &Layout,
    slots: &CpuStorage,
    slots_layout: &Layout,
) -> Result<()> {
    const OP: &str = "reshape-and-cache";
    let dims = cache_layout.dims();
    let row = dims[2] * dims[3];
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
    let inv_scale = 1.0 / scale;
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

fn copy_rows<T: Copy>(cache: &mut [T], new: &[T], slots: &[i64], row: usize) {
    for (src, &slot) in new.chunks_exact(row).zip(slots) {
        if slot >= 0 {
            let dst = slot as usize * row;
            cache[dst..dst + row].copy_from_slice(src);
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
    for (src, &slot) in new.chunks_exact(row).zip(slots) {
        if slot >= 0 {
            let dst = slot as usize * row;
            for (d, x) in cache[dst..dst + row].iter_mut().zip(src) {
                *d = <F8E4M3 as Elem>::from_f32(x.to_f32() * inv_scale);
            }
        }
    }
}
