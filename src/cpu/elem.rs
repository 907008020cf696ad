//! Element types the CPU kernels read and write, converted through f32.
//!
//! A leaf: imports nothing from this crate.

use float8::F8E4M3;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Largest finite `F8E4M3` magnitude; stores into fp8 saturate here.
pub(crate) const FP8_E4M3_MAX: f32 = 448.0;

/// A storage element with f32 conversions.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;

    /// Converts `src` into `dst` (equal lengths).
    #[inline]
    fn convert_slice(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn convert_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    /// Uses the CPU's half-precision conversions when it has them.
    #[inline]
    fn convert_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Elem for F8E4M3 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        F8E4M3::to_f32(&self)
    }
    /// Saturates to +-448 (NaN stays NaN), as the CUDA `__NV_SATFINITE` store does.
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        F8E4M3::from_f32(x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    }
}

/// Converts `src` into `dst` (equal lengths), multiplying by `scale`.
#[inline]
pub(crate) fn load_scaled<E: Elem>(dst: &mut [f32], src: &[E], scale: f32) {
    E::convert_slice(src, dst);
    if scale != 1.0 {
        dst.iter_mut().for_each(|d| *d *= scale);
    }
}

/// `a . b` with eight independent accumulators (vectorises).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
}

/// `acc += p * v`.
#[inline]
pub(crate) fn axpy(acc: &mut [f32], p: f32, v: &[f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += p * x;
    }
}

/// `[q . k[0], q . k[1], q . k[2], q . k[3]]`: one pass over `q` for four keys.
#[inline]
pub(crate) fn dot4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let mut acc = [[0f32; 8]; 4];
    let body = q.len() / 8 * 8;
    let chunks = q[..body]
        .chunks_exact(8)
        .zip(k[0][..body].chunks_exact(8))
        .zip(k[1][..body].chunks_exact(8))
        .zip(k[2][..body].chunks_exact(8))
        .zip(k[3][..body].chunks_exact(8));
    for ((((x, k0), k1), k2), k3) in chunks {
        for i in 0..8 {
            acc[0][i] += x[i] * k0[i];
            acc[1][i] += x[i] * k1[i];
            acc[2][i] += x[i] * k2[i];
            acc[3][i] += x[i] * k3[i];
        }
    }
    let mut out = [0f32; 4];
    for (j, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
        *o = (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]);
        for (x, y) in q[body..].iter().zip(&k[j][body..]) {
            *o += x * y;
        }
    }
    out
}

/// `acc += p[0] * v[0] + p[1] * v[1] + p[2] * v[2] + p[3] * v[3]`: one pass
/// over `acc` for four value rows.
#[inline]
pub(crate) fn axpy4(acc: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
    let rows = acc.iter_mut().zip(v[0]).zip(v[1]).zip(v[2]).zip(v[3]);
    for ((((a, v0), v1), v2), v3) in rows {
        *a += (p[0] * v0 + p[1] * v1) + (p[2] * v2 + p[3] * v3);
    }
}
