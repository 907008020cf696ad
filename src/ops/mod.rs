//! The public ops: validation and backend dispatch.

pub mod paged_attention;
pub mod reshape_and_cache;

use candle_core::{bail, Result, Tensor};

/// Scales of an `F8E4M3` KV cache: the cache stores `k / k_scale` and
/// `v / v_scale`; attention reads `x * k_scale` and `x * v_scale`.
/// Ignored for caches of the model's own dtype.
///
/// Both must be normal, finite and positive (`f32::MIN_POSITIVE ..= f32::MAX`):
/// a subnormal scale has no finite reciprocal and would store NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScales {
    /// Keys are stored as `k / k_scale` and read as `x * k_scale`.
    pub k_scale: f32,
    /// Values are stored as `v / v_scale` and read as `x * v_scale`.
    pub v_scale: f32,
}

impl Default for KvScales {
    fn default() -> Self {
        Self {
            k_scale: 1.0,
            v_scale: 1.0,
        }
    }
}

impl KvScales {
    /// Both scales.
    pub fn new(k_scale: f32, v_scale: f32) -> Self {
        Self { k_scale, v_scale }
    }

    pub(crate) fn validate(&self, op: &str) -> Result<()> {
        check_scale(op, "k_scale", self.k_scale)?;
        check_scale(op, "v_scale", self.v_scale)
    }
}

/// Checks that a multiplicative scale is a positive, finite, normal float
/// (at least `f32::MIN_POSITIVE`), so that its reciprocal is finite too.
pub(crate) fn check_scale(op: &str, name: &str, s: f32) -> Result<()> {
    if !(s > 0.0 && s.is_finite()) {
        bail!("{op}: {name} must be finite and > 0, got {s}");
    }
    if s < f32::MIN_POSITIVE {
        bail!(
            "{op}: {name} {s:e} is subnormal; it must be at least f32::MIN_POSITIVE = {:e} so that 1 / {name} is finite",
            f32::MIN_POSITIVE
        );
    }
    Ok(())
}

/// Address of the storage behind `t`: equal for tensors that share one
/// allocation (views, reshapes, clones). Takes and drops a read lock.
pub(crate) fn storage_address(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref(&*storage).addr()
}
