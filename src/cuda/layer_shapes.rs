//! Launch shapes of the fused layer kernels (kernels/layer_ops.cu): the one
//! definition of their threads per program. build.rs includes this file and
//! writes the values into `kernel_contract.cuh`, which the kernels read, so
//! the launches and the kernels cannot disagree.

/// Threads of an `rms_norm` / `add_rms_norm` program (one program per row).
pub(crate) const NORM_THREADS: u32 = 256;

/// Threads of a gated-activation program.
pub(crate) const ACT_THREADS: u32 = 256;

/// Threads of a greedy-token program (one per row of logits).
pub(crate) const GREEDY_THREADS: u32 = 512;

/// Threads of a sampling program (`SAMPLE_CLUSTER` programs per row of
/// logits).
pub(crate) const SAMPLE_THREADS: u32 = 1024;

/// Programs per row of a sampling launch: one thread block cluster on
/// sm_90 and later (kernels/layer_ops.cu, `sample_rows_f32`), of which only
/// the first works before sm_90. At most 8 (a portable cluster).
pub(crate) const SAMPLE_CLUSTER: u32 = 8;

/// The most dynamic shared memory (bytes) a sampling program takes to keep
/// its slice's scaled logits (f32, `ceil(vocab / SAMPLE_CLUSTER)` rounded up
/// to 4): larger slices are recomputed from the logits in every pass.
pub(crate) const SAMPLE_CACHE_MAX_BYTES: usize = 160 * 1024;

/// u32 words of one row's sampling parameters (kernels/layer_ops.cu,
/// `sample_rows_f32`).
pub(crate) const SAMPLE_PARAM_WORDS: usize = 8;

/// Threads of a skinny-matmul program.
pub(crate) const SKINNY_THREADS: u32 = 128;

/// Warps of a tensor-core skinny-matmul program (`skinny_mma_*`): they
/// split the k range of the program's 16 outputs.
pub(crate) const SKINNY_MMA_WARPS: u32 = 8;

/// Outputs (rows of the weight) of a tensor-core skinny-matmul program.
pub(crate) const SKINNY_MMA_ROWS: usize = 16;

/// Outputs (rows of the weight) each warp of a skinny matmul of `m` rows
/// of x computes: more for more rows, so that each 16-byte load of x from
/// L1 serves more weight rows.
pub(crate) const fn skinny_cols_per_warp(m: usize) -> usize {
    if m <= 2 {
        2
    } else {
        4
    }
}

/// The most rows of `x` a skinny matmul takes (one kernel per count).
pub(crate) const SKINNY_MAX_ROWS: usize = 8;
