//! Reports on the launch plan: `describe` (the plan of one call in words,
//! behind `cuda_launch_plan`), the hidden per-launch residency report of one
//! call (behind `cuda_launch_residency`, which tests/launch_plan_cuda.rs
//! compares with the driver) and the hidden per-instance report that the
//! kernel-contract GPU test compares with the driver. They read the
//! per-device cached limits and occupancies; none launches anything.
//!
//! Imports `params` and the sibling CUDA modules; never `ops` or `cpu`.

use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result};

use super::occupancy::{driver_resident, Residency};
use super::plan::{plan, resident_programs, Instance, Merge, Plan};
use super::policy::LaunchPolicy;
use super::tiles::{
    instance_name, instances, mixed_instances, smem_bytes, Kind, TileInstance, QUERY_DTYPES,
};
use super::{attention_function, device_limits, AttnModule};
use crate::params::{AttentionDims, PagedAttentionParams};

/// How `forward` launches this call, in words: each part's tile shape
/// (`prefill-wgmma` for the warpgroup instance, `prefill-wgmma-ws` for its
/// warp-specialised one, `stream` for stream decode,
/// `stream-wide` for its wide instance)
/// and its split-KV segments and who merges them (e.g. `stream
/// split-kv(16)`, `decode split-kv(8) + reduce`, `stream + prefill-wgmma`),
/// then ` (one launch)` when both parts run in one launch.
pub(crate) fn describe(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    dev: &CudaDevice,
    q_dtype: DType,
) -> Result<String> {
    let Some(dtype_name) = tensor_core_dtype(q_dtype) else {
        return Ok("scalar f32".to_string());
    };
    let plan = call_plan(params, dims, dev, dtype_name)?;
    let parts: Vec<String> = plan
        .parts
        .iter()
        .flatten()
        .map(|p| {
            let shape = if p.tile.is_warp_specialized() {
                format!("{}-wgmma-ws", p.kind.name())
            } else if p.tile.wgmma {
                format!("{}-wgmma", p.kind.name())
            } else if p.tile.is_stream_wide() {
                format!("{}-wide", p.kind.name())
            } else {
                p.kind.name().to_string()
            };
            match (p.segments, p.merge) {
                (1, _) => shape,
                (s, Merge::InLaunch) => format!("{shape} split-kv({s})"),
                (s, Merge::Reduce) => format!("{shape} split-kv({s}) + reduce"),
            }
        })
        .collect();
    let one_launch = if plan.one_launch.is_some() {
        " (one launch)"
    } else {
        ""
    };
    Ok(format!("{}{one_launch}", parts.join(" + ")))
}

/// The kernel-name dtype of the tensor-core path for `q_dtype` (`None`: f32,
/// the scalar path, which has no plan).
fn tensor_core_dtype(q_dtype: DType) -> Option<&'static str> {
    match q_dtype {
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        _ => None,
    }
}

/// The plan `forward` makes for this call on `dev` (the driver's occupancy
/// of each instance, cached).
fn call_plan(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    dev: &CudaDevice,
    dtype_name: &'static str,
) -> Result<Plan> {
    let limits = device_limits(dev)?;
    let residency = Residency {
        dev,
        limits: &limits,
        dtype_name,
        fp8: params.key_cache.dtype() == DType::F8E4M3,
    };
    // Tensors as candle allocates them: starting on 16 bytes.
    plan(
        params,
        dims,
        &limits,
        true,
        &|kind, tile, head| residency.resident(kind, tile, head),
        LaunchPolicy::current(),
    )
}

/// One launch of a call's plan: the programs per SM the plan sized its
/// split-KV waves with, next to the driver's occupancy of the kernel the
/// launch runs. Not part of the API: it exists so that a GPU test can check
/// that every launch decision rests on the device's own figures.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchResidency {
    /// The kernel the launch runs.
    pub name: String,
    /// Threads per program of the launch.
    pub threads: usize,
    /// Dynamic shared memory per program of the launch (bytes).
    pub smem: usize,
    /// Split-KV segments of the launch (1: no split).
    pub segments: usize,
    /// Programs per SM the plan assumed for this launch.
    pub planned_resident: usize,
    /// Programs per SM from the occupancy API, asked now (uncached) for the
    /// launched kernel at `threads` and `smem`.
    pub driver_resident: usize,
    /// Programs per SM by shared memory alone: the device's shared memory
    /// per SM over `smem` plus its reservation per program (an upper bound
    /// of the driver's figure).
    pub smem_resident: usize,
    /// Streaming multiprocessors of the device.
    pub sms: usize,
}

/// The launches of `forward`'s plan for this call (one, or two for a mixed
/// batch; none for f32 queries, which run the scalar kernel), each with the
/// plan's and the driver's residency. A mixed batch in one launch reports
/// its two parts' own instances: their residency is what the plan sizes
/// the parts with. Not part of the API (see [`LaunchResidency`]).
pub(crate) fn launch_residency(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    dev: &CudaDevice,
    q_dtype: DType,
) -> Result<Vec<LaunchResidency>> {
    let Some(dtype_name) = tensor_core_dtype(q_dtype) else {
        return Ok(Vec::new());
    };
    let limits = device_limits(dev)?;
    let fp8 = params.key_cache.dtype() == DType::F8E4M3;
    let plan = call_plan(params, dims, dev, dtype_name)?;
    plan.parts
        .iter()
        .flatten()
        .map(|part| {
            let Instance {
                name,
                threads,
                smem,
                module,
            } = plan.instance(part, dtype_name, fp8);
            Ok(LaunchResidency {
                driver_resident: driver_resident(dev, &name, module, threads, smem)?,
                smem_resident: limits.smem_per_sm / (smem + limits.reserved_smem_per_block),
                planned_resident: part.resident,
                segments: part.segments,
                sms: limits.sms,
                name,
                threads,
                smem,
            })
        })
        .collect()
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
    /// The host-side estimate of the programs per SM (shared memory per SM
    /// and the tile table's register bound), which the host tests plan
    /// with; the launches plan with the driver's occupancy instead (see
    /// [`LaunchResidency`]). For decode-shaped instances it is expected to
    /// equal the driver's figure; for prefill-shaped ones it is a lower
    /// bound.
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
/// query dtype and cache kind; the warpgroup ones too on a device that runs
/// them), loaded on `dev`, with the plan's and the driver's figures. Not
/// part of the API (see [`KernelInstanceReport`]).
#[doc(hidden)]
pub fn kernel_instance_reports(dev: &CudaDevice) -> Result<Vec<KernelInstanceReport>> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute as F;
    let limits = device_limits(dev)?;
    let mut out: Vec<KernelInstanceReport> = Vec::new();
    // The warpgroup instances only on a device that runs them.
    for TileInstance { head, kind, tile } in instances()
        .into_iter()
        .filter(|i| limits.wgmma || !i.tile.wgmma)
    {
        for (dtype_name, _) in QUERY_DTYPES {
            for &fp8 in tile.cache_kinds() {
                let name = instance_name(head, kind, &tile, dtype_name, fp8);
                let smem = smem_bytes(&tile, head, fp8);
                let threads = tile.threads();
                let func = attention_function(dev, &name, AttnModule::of(&tile), smem)?;
                let attr = |a| -> Result<usize> { Ok(func.get_attribute(a).w()?.max(0) as usize) };
                let resident = func
                    .occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
                    .w()?;
                out.push(KernelInstanceReport {
                    planned_threads: threads,
                    planned_smem: smem,
                    planned_resident: resident_programs(&tile, head, fp8, &limits),
                    drives_split_kv: matches!(kind, Kind::Decode | Kind::Stream),
                    driver_max_threads: attr(F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
                    driver_static_smem: attr(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
                    driver_resident: resident as usize,
                    name,
                });
            }
        }
    }
    // The one-launch mixed instances (16-bit caches), on a device that runs
    // the warpgroup ones: compiled for two programs per SM, so the plan's
    // lower bound is the smaller of 2 and what shared memory allows.
    for mixed in mixed_instances().into_iter().filter(|_| limits.wgmma) {
        for (dtype_name, _) in QUERY_DTYPES {
            let name = mixed.name(dtype_name);
            let (smem, threads) = (mixed.smem(), mixed.threads());
            let func = attention_function(dev, &name, AttnModule::Sm90a, smem)?;
            let attr = |a| -> Result<usize> { Ok(func.get_attribute(a).w()?.max(0) as usize) };
            let resident = func
                .occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
                .w()?;
            let by_smem = limits.smem_per_sm / (smem + limits.reserved_smem_per_block);
            out.push(KernelInstanceReport {
                planned_threads: threads,
                planned_smem: smem,
                planned_resident: by_smem.clamp(1, 2),
                drives_split_kv: false,
                driver_max_threads: attr(F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
                driver_static_smem: attr(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
                driver_resident: resident as usize,
                name,
            });
        }
    }
    Ok(out)
}
