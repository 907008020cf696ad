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
    /// The device whose capture lock this thread holds through this turn.
    capture_of: Option<usize>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(gpu) = self.capture_of {
            held::leave(gpu);
        }
    }
}

/// The capture locks the current thread holds, by device ordinal: taking
/// one again on the same thread (stepping an engine inside
/// [`hold_captures`], say) would wait for itself forever, so it is an
/// error instead.
mod held {
    use std::cell::RefCell;

    use candle_core::{bail, Result};

    thread_local! {
        static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    }

    /// Records that this thread takes device `gpu`'s capture lock; an error
    /// when it already holds it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn enter(gpu: usize) -> Result<()> {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if h.contains(&gpu) {
                bail!(
                    "engine: CUDA device {gpu}'s capture lock is already held by this thread \
                     (an engine stepped or captured inside hold_captures?)"
                );
            }
            h.push(gpu);
            Ok(())
        })
    }

    /// Records that this thread released device `gpu`'s capture lock.
    pub(super) fn leave(gpu: usize) {
        HELD.with(|h| h.borrow_mut().retain(|&g| g != gpu));
    }
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn")
            .field("held", &self._lock.is_some())
            .field("capture_of", &self.capture_of)
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
            capture_of: None,
        });
    }
    let _ = dev;
    Ok(Turn {
        _lock: None,
        capture_of: None,
    })
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
        held::enter(gpu_id)?;
        return match locks::take(table, gpu_id) {
            Ok(lock) => Ok(Turn {
                _lock: Some(lock),
                capture_of: Some(gpu_id),
            }),
            Err(e) => {
                held::leave(gpu_id);
                Err(e)
            }
        };
    }
    let _ = dev;
    Ok(Turn {
        _lock: None,
        capture_of: None,
    })
}

/// Keeps the crate's engines from capturing CUDA graphs on `dev`'s device
/// until the returned [`Turn`] is dropped (a capture in progress is waited
/// for). Hold it around work that synchronizes the whole device while
/// engines run on other threads: loading a model (drawing random weights,
/// a new handle's cuBLAS set-up), creating a device handle. On the CPU, or
/// without the `cuda` feature, it holds nothing.
///
/// Fails (instead of waiting for itself) when this thread already holds
/// it; an engine step that needs a capture while its thread holds it fails
/// the same way (the step is rolled back and can be retried after).
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

#[cfg(test)]
mod tests {
    use super::held;

    #[test]
    fn a_capture_lock_taken_twice_on_one_thread_is_an_error_not_a_wait() -> candle_core::Result<()>
    {
        held::enter(7)?;
        let again = held::enter(7).err().map(|e| e.to_string());
        assert!(
            again
                .as_deref()
                .is_some_and(|m| m.contains("device 7") && m.contains("hold_captures")),
            "{again:?}"
        );
        // Another device, or another thread, is free to take its own.
        held::enter(8)?;
        let other_thread = std::thread::spawn(|| held::enter(7)).join();
        assert!(matches!(other_thread, Ok(Ok(()))), "{other_thread:?}");
        held::leave(7);
        held::leave(8);
        held::enter(7)?;
        held::leave(7);
        Ok(())
    }
}
