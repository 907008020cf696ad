//! Reports on the launch plan: `describe` (the plan of one call in words,
//! behind `cuda_launch_plan`) and the hidden per-instance report that the
//! kernel-contract GPU test compares with the driver. Both read the
//! per-device cached limits; neither launches anything.
//!
//! Imports `params` and the sibling CUDA modules; never `ops` or `cpu`.

use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result};

use super::plan::{plan, resident_programs};
use super::tiles::{instance_name, smem_bytes, tile_shape, Kind, HEAD_SIZES};
use super::{device_limits, function, ptx, ATTENTION_MODULE};
use crate::params::{AttentionDims, PagedAttentionParams};

/// How `forward` launches this call, in words: each part's tile shape and
/// its split-KV segments (e.g. `decode split-kv(10)`, `decode + prefill`).
pub(crate) fn describe(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    dev: &CudaDevice,
    q_dtype: DType,
) -> Result<String> {
    if q_dtype == DType::F32 {
        return Ok("scalar f32".to_string());
    }
    let plan = plan(params, dims, &device_limits(dev)?)?;
    let parts: Vec<String> = plan
        .parts
        .iter()
        .flatten()
        .map(|p| match p.segments {
            1 => p.kind.name().to_string(),
            s => format!("{} split-kv({s})", p.kind.name()),
        })
        .collect();
    Ok(parts.join(" + "))
}

/// One tensor-core kernel instance: what the launch plan assumes of it next
/// to what the driver reports. Not part of the API: it exists so that a GPU
/// test can check the plan's figures against the compiled kernels.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelInstanceReport {
    /// The kernel's name in the PTX module.
    pub name: String,
    /// Threads per program the launch uses.
    pub planned_threads: usize,
    /// Dynamic shared memory per program the launch requests (bytes).
    pub planned_smem: usize,
    /// Programs per SM the plan assumes (shared memory per SM and the tile
    /// table's register bound). Only decode-shaped instances' figures drive
    /// a decision (the split-KV segment count); for prefill-shaped ones it is
    /// a lower bound.
    pub planned_resident: usize,
    /// True for decode-shaped instances, whose residency the split-KV
    /// heuristic uses.
    pub drives_split_kv: bool,
    /// `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK` of the loaded kernel.
    pub driver_max_threads: usize,
    /// `CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES` (static shared memory; the
    /// kernels use dynamic shared memory only, so 0 is expected).
    pub driver_static_smem: usize,
    /// Programs per SM from the occupancy API at the planned threads and
    /// dynamic shared memory.
    pub driver_resident: usize,
}

/// Every tensor-core kernel instance (each padded head size, program shape,
/// query dtype and cache kind), loaded on `dev`, with the plan's and the
/// driver's figures. Not part of the API (see [`KernelInstanceReport`]).
#[doc(hidden)]
pub fn kernel_instance_reports(dev: &CudaDevice) -> Result<Vec<KernelInstanceReport>> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute as F;
    let limits = device_limits(dev)?;
    let mut out: Vec<KernelInstanceReport> = Vec::new();
    for &head in &HEAD_SIZES {
        for (kind, small) in [
            (Kind::Decode, false),
            (Kind::Prefill, false),
            (Kind::Prefill, true),
        ] {
            let tile = tile_shape(kind, head, small);
            for dtype_name in ["bf16", "f16"] {
                for fp8 in [false, true] {
                    let name = instance_name(head, kind, &tile, dtype_name, fp8);
                    if out.iter().any(|r| r.name == name) {
                        // Above head size 128 the small prefill tile is the default one.
                        continue;
                    }
                    let smem = smem_bytes(&tile, head, fp8);
                    let threads = tile.threads();
                    let func =
                        function(dev, &name, ATTENTION_MODULE, ptx::UNIFIED_ATTENTION, smem)?;
                    let attr =
                        |a| -> Result<usize> { Ok(func.get_attribute(a).w()?.max(0) as usize) };
                    let resident = func
                        .occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
                        .w()?;
                    out.push(KernelInstanceReport {
                        planned_threads: threads,
                        planned_smem: smem,
                        planned_resident: resident_programs(&tile, head, fp8, &limits),
                        drives_split_kv: kind == Kind::Decode,
                        driver_max_threads: attr(F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
                        driver_static_smem: attr(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
                        driver_resident: resident as usize,
                        name,
                    });
                }
            }
        }
    }
    Ok(out)
}
