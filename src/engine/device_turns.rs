//! Turns on a shared CUDA device handle.
//!
//! Candle runs all work of a device handle (a `Device` and its clones) on
//! one stream, and a CUDA-graph capture records whatever any thread
//! enqueues on its stream while it runs: another engine's kernels,
//! allocations and frees would enter the graph. Engines whose models share
//! a handle therefore take turns: each step and each capture up front holds
//! the handle's lock ([`turn`]). Engines on handles of their own
//! (`Device::new_cuda` called once per model) have a lock each and never
//! wait for one another.
//!
//! Work outside an engine's steps on a shared handle (loading a model,
//! allocating a cache, the caller's own tensors) takes no turn: it must not
//! run while another engine on that handle captures. Capture up front
//! ([`Engine::capture_cuda_graphs`](super::Engine::capture_cuda_graphs)), or
//! give each engine a handle of its own.

use std::sync::MutexGuard;

use candle_core::{Device, Result};

/// Holds `dev`'s turn until dropped: the lock of its stream for a CUDA
/// handle (waiting while another engine on the same handle steps or
/// captures), nothing on the CPU.
pub(super) struct Turn {
    _lock: Option<MutexGuard<'static, ()>>,
}

/// Takes `dev`'s turn (see the module doc).
pub(super) fn turn(dev: &Device) -> Result<Turn> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = dev {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};

        use candle_core::cuda_backend::DeviceId;

        // One lock per handle, kept for the process: a handful of handles
        // run engines in a process, and a lock is a few bytes.
        type Locks = HashMap<DeviceId, &'static Mutex<()>>;
        static LOCKS: OnceLock<Mutex<Locks>> = OnceLock::new();
        let mut locks = LOCKS.get_or_init(Default::default).lock().map_err(|_| {
            candle_core::Error::Msg("engine: the device turn table is poisoned".into())
        })?;
        let lock: &'static Mutex<()> = locks
            .entry(cuda.id())
            .or_insert_with(|| Box::leak(Box::new(Mutex::new(()))));
        drop(locks);
        // A panic in another engine's step leaves nothing behind the lock
        // to repair: take it anyway.
        return Ok(Turn {
            _lock: Some(lock.lock().unwrap_or_else(|e| e.into_inner())),
        });
    }
    let _ = dev;
    Ok(Turn { _lock: None })
}
