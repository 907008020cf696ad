//! Element types the CPU kernels read and write, converted through f32.

use float8::F8E4M3;
use half::{bf16, f16};

/// Largest finite `F8E4M3` magnitude; stores into fp8 saturate here.
pub(crate) const FP8_E4M3_MAX: f32 = 448.0;

/// A storage element with f32 conversions.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
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
    if scale == 1.0 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32() * scale;
        }
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
