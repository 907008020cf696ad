//! The public ops: validation and backend dispatch.

pub mod paged_attention;
pub mod reshape_and_cache;

use candle_core::{bail, Result};

/// Scales of an `F8E4M3` KV cache: the cache stores `k / k_scale` and
/// `v / v_scale`; attention reads `x * k_scale` and `x * v_scale`.
/// Ignored for caches of the model's own dtype.
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
        for (name, s) in [("k_scale", self.k_scale), ("v_scale", self.v_scale)] {
            if !(s > 0.0 && s.is_finite()) {
                bail!("{op}: {name} must be finite and > 0, got {s}");
            }
        }
        Ok(())
    }
}
