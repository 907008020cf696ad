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
//! Each workspace also holds the device's side stream, on which a mixed
//! batch's prefill launch runs beside its decode launch unless
//! `CANDLE_PAGED_ATTENTION_OVERLAP=0` (see the module doc of
//! src/cuda/paged_attention.rs).
//!
//! Owns `Workspace` and the per-device map. Imports the sibling CUDA
//! modules only; never `ops` or `cpu`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use candle_core::cuda_backend::cudarc::driver::result;
use candle_core::cuda_backend::cudarc::driver::sys::{
    CUevent, CUevent_flags, CUevent_wait_flags, CUstream,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, SyncOnDrop};
use candle_core::cuda_backend::{DeviceId, WrapErr};
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
    /// The stream a mixed batch's prefill launch runs on beside its decode
    /// launch (`None` until a mixed batch first needs it; kept for the
    /// process, like the buffers).
    side: Option<Arc<SideStream>>,
}

/// A second stream of the device and the events that order it against the
/// device's stream: `fork` (recorded on the device's stream, waited on by
/// the side stream) and `join` (the other way). The events are reused by
/// every call (the workspace lock is held for a call's whole launch
/// sequence); each wait orders against the record just before it.
///
/// The three are raw driver handles, not cudarc's `CudaStream` and
/// `CudaEvent`: a stream made by cudarc (`CudaContext::new_stream`) puts
/// the whole context into cudarc's multi-stream mode, in which every later
/// use of every buffer records and waits on events; a CUDA graph captured
/// with that tracking on then waits, inside the capture, on events recorded
/// before it, which the driver refuses (CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
/// docs/perf.md, versions 9 and 10). The fork and join events already order
/// every access of the side stream's launch, so nothing else needs them.
pub(super) struct SideStream {
    stream: CUstream,
    fork: CUevent,
    join: CUevent,
}

// SAFETY: driver stream and event handles may be used from any thread bound
// to their context; every use goes through `&self` methods that bind it, and
// the workspace map's lock serialises the calls that use them.
unsafe impl Send for SideStream {}
// SAFETY: as for `Send`: the handles are plain driver objects, and the
// driver's stream and event calls are thread-safe.
unsafe impl Sync for SideStream {}

impl SideStream {
    /// A non-blocking stream of `main`'s context and two events without
    /// timing.
    fn new(main: &CudaStream) -> Result<Self> {
        main.context().bind_to_thread().w()?;
        let flags = CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).w()?;
        // Destroys what was created so far when a later creation fails.
        let undo = |events: &[CUevent]| {
            // SAFETY: the handles were created just above and are used by
            // nothing else.
            unsafe {
                for &e in events {
                    let _ = result::event::destroy(e);
                }
                let _ = result::stream::destroy(stream);
            }
        };
        let fork = result::event::create(flags)
            .inspect_err(|_| undo(&[]))
            .w()?;
        let join = result::event::create(flags)
            .inspect_err(|_| undo(&[fork]))
            .w()?;
        Ok(Self { stream, fork, join })
    }

    /// The raw stream the prefill launch goes on.
    pub(super) fn raw(&self) -> CUstream {
        self.stream
    }

    /// The side stream starts after the work enqueued on `main` so far.
    pub(super) fn fork_from(&self, main: &CudaStream) -> Result<()> {
        main.context().bind_to_thread().w()?;
        // SAFETY: both handles are live (owned by `self`, destroyed only on
        // drop); `main` is a live stream of the same context.
        unsafe {
            result::event::record(self.fork, main.cu_stream()).w()?;
            result::stream::wait_event(
                self.stream,
                self.fork,
                CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .w()
        }
    }

    /// `main` continues after the work enqueued on the side stream so far.
    pub(super) fn join_into(&self, main: &CudaStream) -> Result<()> {
        main.context().bind_to_thread().w()?;
        // SAFETY: as in `fork_from`.
        unsafe {
            result::event::record(self.join, self.stream).w()?;
            result::stream::wait_event(
                main.cu_stream(),
                self.join,
                CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .w()
        }
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        // SAFETY: the handles are owned by `self` and used by nothing after
        // it; the driver defers destroying a stream with work in flight
        // until that work completes. (Workspaces live for the process, so
        // this runs only if one is ever dropped.)
        unsafe {
            let _ = result::event::destroy(self.fork);
            let _ = result::event::destroy(self.join);
            let _ = result::stream::destroy(self.stream);
        }
    }
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
            side: None,
        }),
    })
}

impl Workspace {
    /// The device's side stream and its two events, created on first use
    /// beside `main` (the device's stream; a non-blocking stream of its
    /// context).
    pub(super) fn side_stream(&mut self, main: &CudaStream) -> Result<Arc<SideStream>> {
        if let Some(side) = &self.side {
            return Ok(side.clone());
        }
        let side = Arc::new(SideStream::new(main)?);
        self.side = Some(side.clone());
        Ok(side)
    }

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
