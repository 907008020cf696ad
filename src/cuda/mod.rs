//! The CUDA backend: embedded kernel images, kernel loading and launches.
//!
//! `kernels/*.cu` are compiled by build.rs into one fatbin each (machine
//! code for the build's target and the PTX, which the driver compiles on
//! other GPUs); each becomes one module, loaded once per device. Launches go
//! on candle's stream.
//! This is the only place in the crate with raw kernel launches.
//!
//! Imports `params` (and `batch` through it); must not import `ops` (which
//! calls it) or `cpu`.

pub(crate) mod buffers;
pub(crate) mod contract;
pub(crate) mod describe;
pub(crate) mod layer_ops;
pub(crate) mod layer_shapes;
pub(crate) mod occupancy;
pub(crate) mod paged_attention;
pub(crate) mod plan;
pub(crate) mod policy;
pub(crate) mod reshape_and_cache;
pub(crate) mod rotary_cache;
pub(crate) mod tiles;
pub(crate) mod workspace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DevicePtr, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaStorageSlice, DeviceId, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Storage, StorageRef};

/// The fatbin of each kernel file (`UNIFIED_ATTENTION`, `STREAM_DECODE`,
/// `RESHAPE_AND_CACHE`, `LAYER_OPS`) and of the warpgroup attention
/// instances, compiled for `sm_90a` whatever the build's target
/// (`UNIFIED_ATTENTION_SM90A`; see build.rs).
mod images {
    include!(concat!(env!("OUT_DIR"), "/images.rs"));
}

/// One compiled kernel file: the name its module is cached under per
/// device, and its fatbin.
#[derive(Debug)]
pub(crate) struct KernelModule {
    name: &'static str,
    image: &'static [u8],
}

/// kernels/unified_attention.cu for the build's target.
pub(crate) const ATTENTION_MODULE: KernelModule = KernelModule {
    name: "candle_paged_attention.unified_attention",
    image: images::UNIFIED_ATTENTION,
};
/// kernels/unified_attention.cu for `sm_90a`: the warpgroup instances.
const ATTENTION_SM90A_MODULE: KernelModule = KernelModule {
    name: "candle_paged_attention.unified_attention_sm90a",
    image: images::UNIFIED_ATTENTION_SM90A,
};
/// kernels/stream_decode.cu.
const STREAM_MODULE: KernelModule = KernelModule {
    name: "candle_paged_attention.stream_decode",
    image: images::STREAM_DECODE,
};
/// kernels/reshape_and_cache.cu (also the rotary cache write).
pub(crate) const CACHE_MODULE: KernelModule = KernelModule {
    name: "candle_paged_attention.reshape_and_cache",
    image: images::RESHAPE_AND_CACHE,
};
/// kernels/layer_ops.cu.
pub(crate) const LAYER_MODULE: KernelModule = KernelModule {
    name: "candle_paged_attention.layer_ops",
    image: images::LAYER_OPS,
};

/// The CUDA storage behind a tensor's storage guard.
fn cuda_storage<'a>(storage: &'a Storage, op: &str, name: &str) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        other => bail!(
            "{op}: {name} must be on a cuda device, got {:?}",
            other.device().location()
        ),
    }
}

/// Raw device address of the first element of `layout` in `storage`, with the
/// guard that records the read on `stream` when dropped (drop it after the
/// launch that reads the address).
fn device_address<'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    let off = layout.start_offset();
    macro_rules! addr {
        ($s:expr, $t:ty) => {{
            let (ptr, sync) = $s.device_ptr(stream);
            (ptr + (off * std::mem::size_of::<$t>()) as u64, sync)
        }};
    }
    match &storage.slice {
        CudaStorageSlice::U8(s) => addr!(s, u8),
        CudaStorageSlice::U32(s) => addr!(s, u32),
        CudaStorageSlice::I16(s) => addr!(s, i16),
        CudaStorageSlice::I32(s) => addr!(s, i32),
        CudaStorageSlice::I64(s) => addr!(s, i64),
        CudaStorageSlice::BF16(s) => addr!(s, half::bf16),
        CudaStorageSlice::F16(s) => addr!(s, half::f16),
        CudaStorageSlice::F32(s) => addr!(s, f32),
        CudaStorageSlice::F64(s) => addr!(s, f64),
        CudaStorageSlice::F8E4M3(s) => addr!(s, float8::F8E4M3),
        CudaStorageSlice::F6E2M3(s)
        | CudaStorageSlice::F6E3M2(s)
        | CudaStorageSlice::F4(s)
        | CudaStorageSlice::F8E8M0(s) => addr!(s, u8),
    }
}

/// Like [`device_address`] for an optional tensor's storage guard; `None`
/// stands for a null pointer.
fn optional_address<'a>(
    guard: &'a Option<(StorageRef<'_>, &Layout)>,
    op: &str,
    name: &str,
    stream: &'a CudaStream,
) -> Result<Option<(u64, SyncOnDrop<'a>)>> {
    match guard {
        Some((storage, layout)) => Ok(Some(device_address(
            cuda_storage(storage, op, name)?,
            layout,
            stream,
        ))),
        None => Ok(None),
    }
}

/// `module` loaded on `dev`'s context: once per device, then served from a
/// cache. The driver takes the image's machine code when it was built for
/// the device's architecture, and compiles its PTX otherwise (once; the
/// driver keeps the result in its compute cache).
fn load_module(dev: &CudaDevice, module: &KernelModule) -> Result<Arc<CudaModule>> {
    type Cache = HashMap<(DeviceId, &'static str), Arc<CudaModule>>;
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let lock = || {
        cache
            .lock()
            .map_err(|_| candle_core::Error::Msg("kernel module cache lock poisoned".into()))
    };
    let key = (dev.id(), module.name);
    if let Some(m) = lock()?.get(&key) {
        return Ok(m.clone());
    }
    // The driver reads the fatbin's own header for its size; the copy is
    // heap memory, aligned for it.
    let image = Ptx::from_binary(module.image.to_vec());
    let loaded = dev
        .cuda_stream()
        .context()
        .load_module(image)
        .map_err(|e| {
            candle_core::Error::Msg(format!(
                "loading the kernel module {} ({} bytes): {e}",
                module.name,
                module.image.len()
            ))
        })?;
    Ok(lock()?.entry(key).or_insert(loaded).clone())
}

/// The kernel `name` of `module` on `dev`, allowed `smem` bytes of dynamic
/// shared memory; loaded (and its shared-memory limit raised) once per
/// device, then served from a cache, so a forward does no module lookups.
fn function(
    dev: &CudaDevice,
    name: &str,
    module: &KernelModule,
    smem: usize,
) -> Result<CudaFunction> {
    type Cache = HashMap<(DeviceId, String), CudaFunction>;
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (dev.id(), name.to_string());
    if let Some(f) = cache
        .lock()
        .map_err(|_| candle_core::Error::Msg("kernel cache lock poisoned".into()))?
        .get(&key)
    {
        return Ok(f.clone());
    }
    let f = load_module(dev, module)?.load_function(name).map_err(|e| {
        candle_core::Error::Msg(format!("kernel {name} of module {}: {e}", module.name))
    })?;
    if smem > 48 * 1024 {
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
    }
    cache
        .lock()
        .map_err(|_| candle_core::Error::Msg("kernel cache lock poisoned".into()))?
        .insert(key, f.clone());
    Ok(f)
}

/// The kernel module a tensor-core attention instance lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AttnModule {
    /// kernels/unified_attention.cu for the build's target.
    Unified,
    /// kernels/unified_attention.cu for `compute_90a`: the warpgroup instances.
    Sm90a,
    /// kernels/stream_decode.cu: the stream-decode instances.
    Stream,
}

impl AttnModule {
    /// The module of the instances with tile `tile`.
    pub(crate) fn of(tile: &tiles::TileShape) -> Self {
        if tile.wgmma {
            Self::Sm90a
        } else if tile.stream {
            Self::Stream
        } else {
            Self::Unified
        }
    }
}

/// The tensor-core attention kernel `name` of `module`, allowed `smem` bytes
/// of dynamic shared memory (see [`function`]).
fn attention_function(
    dev: &CudaDevice,
    name: &str,
    module: AttnModule,
    smem: usize,
) -> Result<CudaFunction> {
    let module = match module {
        AttnModule::Sm90a => &ATTENTION_SM90A_MODULE,
        AttnModule::Stream => &STREAM_MODULE,
        AttnModule::Unified => &ATTENTION_MODULE,
    };
    function(dev, name, module, smem)
}

/// The device attributes the launch decisions read, queried once per device
/// and cached for the life of the process (they never change).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceLimits {
    /// Streaming multiprocessors.
    pub(crate) sms: usize,
    /// Most dynamic shared memory one program may opt in to (bytes).
    pub(crate) max_smem_per_block: usize,
    /// Shared memory of one SM (bytes; e.g. 228 KiB on Hopper, 164 KiB on an
    /// A100).
    pub(crate) smem_per_sm: usize,
    /// Shared memory the driver reserves per resident program (bytes; 1 KiB
    /// on Hopper).
    pub(crate) reserved_smem_per_block: usize,
    /// Compute capability 9.0 (H100, H200): the sm_90a module's warpgroup
    /// instances run here, and only here.
    pub(crate) wgmma: bool,
}

/// The cached [`DeviceLimits`] of `dev` (queried on first use).
fn device_limits(dev: &CudaDevice) -> Result<DeviceLimits> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    static CACHE: OnceLock<Mutex<HashMap<DeviceId, DeviceLimits>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let lock = || {
        cache
            .lock()
            .map_err(|_| candle_core::Error::Msg("device limits cache lock poisoned".into()))
    };
    if let Some(l) = lock()?.get(&dev.id()) {
        return Ok(*l);
    }
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let get = |a| -> Result<usize> { Ok(ctx.attribute(a).w()?.max(0) as usize) };
    let limits = DeviceLimits {
        sms: get(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1),
        max_smem_per_block: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        smem_per_sm: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
        reserved_smem_per_block: get(A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)?,
        wgmma: (
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ) == (9, 0),
    };
    lock()?.insert(dev.id(), limits);
    Ok(limits)
}

/// True when `CANDLE_PAGED_ATTENTION_POISON` is set: outputs are filled with
/// NaN before the kernels run, so that an element the kernels fail to write
/// shows up in tests. Read at every call (a `getenv`, negligible next to a
/// launch): examples/bench.rs turns it on for one checked call and off for
/// the timed ones.
fn poison_outputs() -> bool {
    std::env::var_os("CANDLE_PAGED_ATTENTION_POISON").is_some_and(|v| !v.is_empty() && v != "0")
}

/// Fills `bytes` bytes at `addr` with 0xff (NaN in f32, f16, bf16 and e4m3).
fn fill_nan(addr: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: `addr..addr + bytes` lies inside an allocation of this stream's
    // context that the caller owns; 0xff bytes are a valid (NaN) pattern for
    // every float type the ops write.
    unsafe {
        candle_core::cuda_backend::cudarc::driver::result::memset_d8_async(
            addr,
            0xff,
            bytes,
            stream.cu_stream(),
        )
    }
    .w()
}

/// Free and total memory of the device, in bytes, as the driver reports them.
pub(crate) fn memory_info(dev: &CudaDevice) -> Result<(usize, usize)> {
    dev.cuda_stream().context().mem_get_info().w()
}
