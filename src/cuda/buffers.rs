//! What the CUDA launches share about element types and output buffers:
//! the kernel-name suffix of a float dtype, and an uninitialised device
//! buffer of a dtype (NaN-filled first when poisoning is on, for the
//! callers that ask for it).
//!
//! Imports the device helpers of `super` only.

use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

use super::{device_address, fill_nan, poison_outputs};

/// The kernel-name suffix of a float dtype: `"f32"`, `"f16"` or `"bf16"`;
/// `None` for any other dtype (each caller words its own error).
pub(crate) fn float_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// An uninitialised buffer of `max(n, 1)` elements of `dtype` (f32, f16,
/// bf16 or F8E4M3) on `dev`, for a kernel that writes every element before
/// anything reads it; `op` names the caller in the error for other dtypes.
pub(crate) fn alloc_uninit(
    op: &str,
    dev: &CudaDevice,
    dtype: DType,
    n: usize,
) -> Result<CudaStorage> {
    fn alloc<T: CudaDType + DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaStorage> {
        // SAFETY: `alloc_uninit`'s callers launch a kernel that writes every
        // element before anything reads it.
        let slice = unsafe { dev.alloc::<T>(n)? };
        Ok(CudaStorage::wrap_cuda_slice(slice, dev.clone()))
    }
    // At least one element: a zero-byte allocation is not portable.
    let n = n.max(1);
    match dtype {
        DType::F32 => alloc::<f32>(dev, n),
        DType::F16 => alloc::<half::f16>(dev, n),
        DType::BF16 => alloc::<half::bf16>(dev, n),
        DType::F8E4M3 => alloc::<float8::F8E4M3>(dev, n),
        DType::U32 => alloc::<u32>(dev, n),
        dt => bail!("{op}: cannot allocate a {dt:?} output"),
    }
}

/// `alloc_uninit`, then filled with NaN when poisoning is on, so an element
/// the kernel does not write fails the tests' checks.
pub(crate) fn alloc_poisoned(
    op: &str,
    dev: &CudaDevice,
    dtype: DType,
    n: usize,
) -> Result<CudaStorage> {
    let out = alloc_uninit(op, dev, dtype, n)?;
    if poison_outputs() {
        let n = n.max(1);
        let stream = dev.cuda_stream();
        let (addr, _sync) = device_address(&out, &Layout::contiguous(n), &stream);
        fill_nan(addr, n * dtype.size_in_bytes(), &stream)?;
    }
    Ok(out)
}
