//! The public ops: validation and backend dispatch.
//!
//! Owns `paged_attention`, `reshape_and_cache`, the fused layer ops
//! (`rms_norm`, `add_rms_norm`, `gated_activation`), the linear layers'
//! matmul (`linear`, `skinny_matmul`), the greedy tokens of logits
//! (`greedy_tokens`) and their `CustomOp`s: each
//! checks its call on the host, then hands the validated parameters
//! ([`crate::params`]) to the backend of the query's device. The backends
//! never import this module; it is the only one that imports them.

pub(crate) mod greedy;
pub(crate) mod layer_ops;
pub(crate) mod linear;
pub(crate) mod paged_attention;
pub(crate) mod reshape_and_cache;
pub(crate) mod rotary_cache;
pub(crate) mod sample;
pub(crate) mod sample_mass;

use candle_core::Tensor;

/// Address of the storage behind `t`: equal for tensors that share one
/// allocation (views, reshapes, clones). Takes and drops a read lock.
pub(crate) fn storage_address(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref(&*storage).addr()
}
