//! The split-KV workspace of `PagedAttention` on CUDA: per device, one f32
//! buffer that the tensor-core launches write their partial outputs and
//! (max, sum) pairs into, and one u32 buffer of arrival counters through
//! which the last program of each split group finds that it merges (see
//! "Split KV" in kernels/unified_attention.cu), together with the device
//! limits the launch plans read.
//!
//! Lifetime: one pair of buffers per candle device (`DeviceId`), created
//! (empty) on the first tensor-core launch on that device, each grown (never
//! shrunk, in powers of two) to the largest split-KV batch seen, and kept for
//! the life of the process: the map is a process-global static that is never
//! dropped, and nothing releases a buffer early (the driver reclaims the
//! memory at exit). A buffer replaced by a larger one is kept too (at most
//! the sum of a geometric series, under twice the largest): a CUDA graph
//! captured earlier still uses the address it recorded. Counters are zeroed
//! once, when their buffer is allocated; every launch leaves them zero (the
//! last program of a group resets its counter), so a graph replays with no
//! memset. The map's lock is held for the whole launch sequence of a call;
//! the launches go on that device's stream, so a later call reusing the
//! buffers runs after the earlier one.
//!
//! Owns `Workspace` and the per-device map. Imports the sibling CUDA
//! modules only; never `ops` or `cpu`.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, SyncOnDrop};
use candle_core::cuda_backend::DeviceId;
use candle_core::{CudaDevice, Result};

use super::{device_limits, DeviceLimits};

const OP: &str = "paged-attention";

/// The split-KV workspace of one device and the limits its plans use (see
/// the module doc for its lifetime).
pub(super) struct Workspace {
    /// The device's cached limits.
    pub(super) limits: DeviceLimits,
    /// Split-KV partials, `None` until a call first splits.
    buf: Option<CudaSlice<f32>>,
    /// Smaller buffers `buf` replaced, which captured graphs may still use.
    retired: Vec<CudaSlice<f32>>,
    /// Split-KV arrival counters, zero between launches; `None` until a call
    /// first splits.
    counters: Option<CudaSlice<u32>>,
    /// Smaller counter buffers `counters` replaced (zero, and kept for the
    /// graphs that recorded them).
    retired_counters: Vec<CudaSlice<u32>>,
}

/// The per-device workspaces, keyed by candle device.
pub(super) type Workspaces = HashMap<DeviceId, Workspace>;

/// The process-global map of workspaces (see the module doc).
fn workspaces() -> &'static Mutex<Workspaces> {
    static W: OnceLock<Mutex<Workspaces>> = OnceLock::new();
    W.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Locks the map of workspaces; hold the guard until the launches that use
/// a workspace are enqueued.
pub(super) fn lock() -> Result<MutexGuard<'static, Workspaces>> {
    workspaces()
        .lock()
        .map_err(|_| candle_core::Error::Msg(format!("{OP}: workspace lock poisoned")))
}

/// The workspace of `dev` in the locked map, created (with the device's
/// limits and no buffer) on first use.
pub(super) fn for_device<'m>(
    spaces: &'m mut Workspaces,
    dev: &CudaDevice,
) -> Result<&'m mut Workspace> {
    Ok(match spaces.entry(dev.id()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(Workspace {
            limits: device_limits(dev)?,
            buf: None,
            retired: Vec::new(),
            counters: None,
            retired_counters: Vec::new(),
        }),
    })
}

impl Workspace {
    /// Grows the buffer to at least `len` f32 elements, rounded up to a
    /// power of two (never shrinks it; the replaced buffer is retired, not
    /// freed); `len == 0` leaves it as it is.
    pub(super) fn grow(&mut self, dev: &CudaDevice, len: usize) -> Result<()> {
        if len > 0 && self.buf.as_ref().is_none_or(|b| b.len() < len) {
            let len = len.checked_next_power_of_two().unwrap_or(len);
            // SAFETY: the kernels write every partial they later read: the
            // merging program reads only partials of its own group, after
            // every program of the group has stored them.
            let new = unsafe { dev.alloc::<f32>(len)? };
            if let Some(old) = self.buf.replace(new) {
                self.retired.push(old);
            }
        }
        Ok(())
    }

    /// Grows the counter buffer to at least `len` counters, rounded up to a
    /// power of two and zeroed on allocation (never shrinks it; the replaced
    /// buffer is retired); `len == 0` leaves it as it is.
    pub(super) fn grow_counters(&mut self, dev: &CudaDevice, len: usize) -> Result<()> {
        if len > 0 && self.counters.as_ref().is_none_or(|b| b.len() < len) {
            let len = len.checked_next_power_of_two().unwrap_or(len);
            let new = dev.alloc_zeros::<u32>(len)?;
            if let Some(old) = self.counters.replace(new) {
                self.retired_counters.push(old);
            }
        }
        Ok(())
    }

    /// The counter buffer's device address with the guard that records its
    /// use on `stream` when dropped, or `None` when `len == 0` (no split) or
    /// no buffer exists.
    pub(super) fn counters_address<'a>(
        &'a self,
        len: usize,
        stream: &'a CudaStream,
    ) -> Option<(u64, SyncOnDrop<'a>)> {
        match (&self.counters, len > 0) {
            (Some(buf), true) => Some(buf.device_ptr(stream)),
            _ => None,
        }
    }

    /// The buffer's device address with the guard that records its use on
    /// `stream` when dropped, or `None` when `len == 0` (no split) or no
    /// buffer exists.
    pub(super) fn address<'a>(
        &'a self,
        len: usize,
        stream: &'a CudaStream,
    ) -> Option<(u64, SyncOnDrop<'a>)> {
        match (&self.buf, len > 0) {
            (Some(buf), true) => Some(buf.device_ptr(stream)),
            _ => None,
        }
    }
}
