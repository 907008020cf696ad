//! The CPU backend: fast CPU kernels of both ops (every feature, f32
//! accumulation), parallel over independent pieces of work. The naive f64
//! reference they are tested against is [`crate::reference`].
//!
//! Owns the CPU forward of `paged_attention` and `reshape_and_cache`. Imports
//! `params` and `batch`; must not import `ops` (which calls it) or `cuda`.

pub(crate) mod elem;
pub(crate) mod layer_ops;
pub(crate) mod paged_attention;
pub(crate) mod reshape_and_cache;
pub(crate) mod score_mods;
