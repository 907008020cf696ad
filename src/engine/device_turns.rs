//! Turns on a CUDA device shared by several engines.
//!
//! * **One device handle, one stream.** Candle runs all work of a device
//!   handle (a `Device` and its clones) on one stream, and a CUDA-graph
//!   capture records whatever any thread enqueues on its stream while it
//!   runs. Engines whose models share a handle therefore take turns: each
//!   step and each capture up front holds the handle's lock
//!   ([`handle_turn`]). Engines on handles of their own (`Device::new_cuda`
//!   once per model) never wait for one another's steps.
//! * **One device, one capture at a time.** Work that synchronizes the
//!   whole device (`cudaDeviceSynchronize`, which cuRAND's and cuBLAS's
//!   set-up call: creating a device handle, drawing random tensors) is
//!   illegal while any stream of the device captures, from any thread: the
//!   driver invalidates the capture. A process was seen to crash inside
//!   libcuda after that (2026-12-06: a `cudaDeviceSynchronize` refused
//!   during a capture, then the capture's frees refused as invalidated,
//!   then a segmentation fault in a driver thread; one thread was loading
//!   a model and releasing a cache while another engine captured on the
//!   handle they shared). Every capture holds the device's capture lock
//!   ([`capture_turn`]); [`hold_captures`] takes the same lock for such
//!   work, so that no engine captures while it runs.
//!
//! Both tables keep one lock per handle or device for the process: a
//! handful of them exist in a process, and a lock is a few bytes.

use std::sync::MutexGuard;

use candle_core::{Device, Result};

/// Holds a lock of the crate's engines until dropped (see the module doc),
/// or nothing on the CPU.
#[must_use = "the lock is released when this is dropped"]
pub struct Turn {
    _lock: Option<MutexGuard<'static, ()>>,
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn")
            .field("held", &self._lock.is_some())
            .finish()
    }
}

#[cfg(feature = "cuda")]
mod locks {
    use std::collections::HashMap;
    use std::hash::Hash;
    use std::sync::{Mutex, MutexGuard};

    use candle_core::Result;

    /// The lock of `key` in `table`, created on first use and kept for the
    /// process, taken (also when a panic elsewhere poisoned it: nothing
    /// behind it needs repair).
    pub(super) fn take<K: Hash + Eq>(
        table: &'static Mutex<HashMap<K, &'static Mutex<()>>>,
        key: K,
    ) -> Result<MutexGuard<'static, ()>> {
        let mut map = table.lock().map_err(|_| {
            candle_core::Error::Msg("engine: a device lock table is poisoned".into())
        })?;
        let lock: &'static Mutex<()> = map
            .entry(key)
            .or_insert_with(|| Box::leak(Box::new(Mutex::new(()))));
        drop(map);
        Ok(lock.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Takes the turn of `dev`'s handle: waits while another engine whose
/// model shares the handle steps or captures (nothing on the CPU).
pub(super) fn handle_turn(dev: &Device) -> Result<Turn> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = dev {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};

        use candle_core::cuda_backend::DeviceId;

        static HANDLES: OnceLock<Mutex<HashMap<DeviceId, &'static Mutex<()>>>> = OnceLock::new();
        let table = HANDLES.get_or_init(Default::default);
        return Ok(Turn {
            _lock: Some(locks::take(table, cuda.id())?),
        });
    }
    let _ = dev;
    Ok(Turn { _lock: None })
}

/// Takes the capture lock of `dev`'s device (its ordinal, whatever the
/// handle): held by every capture, and by [`hold_captures`].
pub(crate) fn capture_turn(dev: &Device) -> Result<Turn> {
    #[cfg(feature = "cuda")]
    if let candle_core::DeviceLocation::Cuda { gpu_id } = dev.location() {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};

        static DEVICES: OnceLock<Mutex<HashMap<usize, &'static Mutex<()>>>> = OnceLock::new();
        let table = DEVICES.get_or_init(Default::default);
        return Ok(Turn {
            _lock: Some(locks::take(table, gpu_id)?),
        });
    }
    let _ = dev;
    Ok(Turn { _lock: None })
}

/// Keeps the crate's engines from capturing CUDA graphs on `dev`'s device
/// until the returned [`Turn`] is dropped (a capture in progress is waited
/// for). Hold it around work that synchronizes the whole device while
/// engines run on other threads: loading a model (drawing random weights,
/// a new handle's cuBLAS set-up), creating a device handle. On the CPU, or
/// without the `cuda` feature, it holds nothing.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// let dev = candle_core::Device::Cpu;
/// let weights = {
///     let _no_captures = candle_paged_attention::engine::hold_captures(&dev)?;
///     candle_core::Tensor::randn(0f32, 1.0, (4, 4), &dev)?
/// };
/// # let _ = weights;
/// # Ok(())
/// # }
/// ```
pub fn hold_captures(dev: &Device) -> Result<Turn> {
    capture_turn(dev)
}
