//! Launch shapes of the fused layer kernels (kernels/layer_ops.cu): the one
//! definition of their threads per program. build.rs includes this file and
//! writes the values into `kernel_contract.cuh`, which the kernels read, so
//! the launches and the kernels cannot disagree.

/// Threads of an `rms_norm` / `add_rms_norm` program (one program per row).
pub(crate) const NORM_THREADS: u32 = 256;

/// Threads of a gated-activation program.
pub(crate) const ACT_THREADS: u32 = 256;
