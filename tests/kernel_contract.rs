//! The launch plan's figures for every tensor-core kernel instance (each
//! padded head size, program shape, query dtype and cache kind) against what
//! the driver reports for the compiled kernel: threads per program, static
//! shared memory and programs resident per SM (occupancy API at the planned
//! threads and dynamic shared memory). GPU only: without the `cuda`
//! feature this binary is empty.
#![cfg(feature = "cuda")]

#[macro_use]
mod common;

use anyhow::{ensure, Result};
use candle_core::Device;

cuda_test! {
    /// Threads and shared memory of the plan equal the driver's; residency
    /// equals the driver's occupancy for decode-shaped instances (it sets
    /// the split-KV segment count) and never exceeds it for prefill-shaped
    /// ones (where the plan's figure is a lower bound that drives nothing:
    /// the driver fits 3-4 of the 64-row head-32/64 programs per SM where
    /// the tile table says 2).
    fn plan_matches_the_driver(dev: &Device) -> Result<()> {
        let Device::Cuda(cuda) = dev else {
            anyhow::bail!("a cuda device expected, got {:?}", dev.location());
        };
        let reports = candle_paged_attention::kernel_instance_reports(cuda)?;
        // 5 head sizes x (decode + prefill) + 3 head sizes with a 64-row
        // prefill tile, each for bf16/f16 queries and plain/fp8 caches; on a
        // device of compute capability 9.0 also the two warpgroup prefill
        // instances of head sizes 64, 128 and 256, for each query dtype and
        // cache kind; and the stream-decode instances.
        let wgmma = reports.iter().filter(|r| r.name.contains("_prefill_wg_")).count();
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        let major = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let expected_wgmma = if (major, minor) == (9, 0) { 3 * 2 * 4 } else { 0 };
        ensure!(wgmma == expected_wgmma, "{wgmma} warpgroup instances on sm_{major}{minor}");
        // The warp-specialised ones: head sizes 64 and 128, each query
        // dtype, 16-bit caches only.
        let ws = reports.iter().filter(|r| r.name.contains("_prefill_ws_")).count();
        let expected_ws = if (major, minor) == (9, 0) { 2 * 2 } else { 0 };
        ensure!(ws == expected_ws, "{ws} warp-specialised instances on sm_{major}{minor}");
        // The stream-decode instances: 8 rows at head sizes 64, 128, 256,
        // 16 rows at 64 and 128, and the wide 8-row one at 128, on every
        // device.
        let stream = reports.iter().filter(|r| r.name.contains("_stream_r")).count();
        ensure!(stream == 6 * 4, "{stream} stream-decode instances");
        // The one-launch mixed instances: head sizes 64 and 128, 8- and
        // 16-row stream tiles, each query dtype, 16-bit caches.
        let mixed = reports.iter().filter(|r| r.name.contains("_mixed_")).count();
        let expected_mixed = if (major, minor) == (9, 0) { 2 * 2 * 2 } else { 0 };
        ensure!(mixed == expected_mixed, "{mixed} one-launch mixed instances on sm_{major}{minor}");
        ensure!(
            reports.len() == (5 * 2 + 3) * 4 + wgmma + ws + stream + mixed,
            "{} instances",
            reports.len()
        );
        let mut bad = Vec::new();
        for r in &reports {
            let resident_ok = if r.drives_split_kv {
                r.planned_resident == r.driver_resident
            } else {
                r.planned_resident <= r.driver_resident
            };
            if r.planned_threads != r.driver_max_threads || r.driver_static_smem != 0 || !resident_ok
            {
                bad.push(format!("{r:?}"));
            }
        }
        ensure!(bad.is_empty(), "plan and driver disagree:\n{}", bad.join("\n"));
        Ok(())
    }
}
