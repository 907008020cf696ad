//! Programs of one tensor-core kernel instance resident per SM, as the
//! driver's occupancy API (`cuOccupancyMaxActiveBlocksPerMultiprocessor`)
//! reports them for the instance a launch uses, at the threads and dynamic
//! shared memory it launches with. Queried once per (device, instance) and
//! cached for the life of the process: the launch plans size their split-KV
//! waves and pick their prefill tile with it, so nothing assumes one GPU's
//! shared memory or register file.
//!
//! Owns `Residency` and the per-(device, instance) cache. Imports the
//! sibling CUDA modules; never `ops` or `cpu`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::{DeviceId, WrapErr};
use candle_core::{bail, CudaDevice, Result};

use super::tiles::{instance_name, smem_bytes, Kind, TileShape};
use super::{attention_function, AttnModule, DeviceLimits};

const OP: &str = "paged-attention";

/// The driver's residency figures for the instances of one call: its
/// device, query dtype (`"bf16"`/`"f16"`) and cache kind.
pub(super) struct Residency<'a> {
    pub(super) dev: &'a CudaDevice,
    pub(super) limits: &'a DeviceLimits,
    pub(super) dtype_name: &'static str,
    pub(super) fp8: bool,
}

impl Residency<'_> {
    /// Programs of the `kind` instance with tile `tile` for padded head size
    /// `head` resident on one SM, from the cache (the driver is asked on
    /// first use). Fails, naming the head size, when the instance needs more
    /// shared memory per program than the device allows.
    pub(super) fn resident(&self, kind: Kind, tile: &TileShape, head: usize) -> Result<usize> {
        type Cache = HashMap<(DeviceId, String), usize>;
        static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        let lock = || {
            cache.lock().map_err(|_| {
                candle_core::Error::Msg(format!("{OP}: occupancy cache lock poisoned"))
            })
        };
        let name = instance_name(head, kind, tile, self.dtype_name, self.fp8);
        let key = (self.dev.id(), name);
        if let Some(&r) = lock()?.get(&key) {
            return Ok(r);
        }
        let smem = smem_bytes(tile, head, self.fp8);
        if smem > self.limits.max_smem_per_block {
            bail!(
                "{OP}: head size {head} needs {smem} bytes of shared memory per program, this device allows {}",
                self.limits.max_smem_per_block
            );
        }
        // At least one: a launch runs whatever the figure, and the plans
        // divide by it.
        let r =
            driver_resident(self.dev, &key.1, AttnModule::of(tile), tile.threads(), smem)?.max(1);
        lock()?.insert(key, r);
        Ok(r)
    }
}

/// Programs of the kernel `name` of `module`
/// resident on one SM at `threads` threads and `smem` bytes of dynamic
/// shared memory per program, asked of the driver now (uncached); the
/// kernel is loaded, with its shared-memory limit raised to `smem`, as a
/// launch loads it.
pub(super) fn driver_resident(
    dev: &CudaDevice,
    name: &str,
    module: AttnModule,
    threads: usize,
    smem: usize,
) -> Result<usize> {
    let func = attention_function(dev, name, module, smem)?;
    let threads = u32::try_from(threads).map_err(|_| {
        candle_core::Error::Msg(format!("{OP}: {threads} threads per program for {name}"))
    })?;
    Ok(func
        .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
        .w()? as usize)
}
