//! The GPU side of the harness: which device a GPU test runs on and what
//! its environment must say.
//!
//! A build with the `cuda` feature runs every `NAME::cuda` test on CUDA
//! device 0, and the run's environment must set:
//! * `CANDLE_PAGED_ATTENTION_POISON=1`: the CUDA path fills its outputs and
//!   workspaces with NaN before every launch, so an element the kernels do not
//!   write fails the finiteness checks. A GPU test fails when it is not set
//!   (tests never set environment variables themselves).
//! * `CANDLE_PAGED_ATTENTION_SKIP_GPU=1`, only where there is no GPU (a
//!   compile check, say): GPU tests then print `SKIPPED <test>` and pass.
//!   Without it, a GPU test with no CUDA device fails.
//! * optionally `CANDLE_PAGED_ATTENTION_PREFILL_ROWS=64` or `128`, which
//!   forces the prefill tile's row count: run the suite once with each to
//!   cover both prefill instances.
//! * optionally `CANDLE_PAGED_ATTENTION_WGMMA=0`, which keeps prefill
//!   launches on the mma.sync instances on a device of compute capability
//!   9.0 (where they take the warpgroup ones by default): run the suite
//!   once with it there to cover both.
//! * optionally `CANDLE_PAGED_ATTENTION_SPLIT_MERGE=launch` or `reduce`,
//!   which forces who merges the partials of split decode launches (by
//!   default the reduce launch for the unified kernel's decode instances,
//!   the launch itself for the stream-decode ones): run the split tests once
//!   with each to cover both merges of both kernels.
//! * optionally `CANDLE_PAGED_ATTENTION_OVERLAP=0`, which runs a mixed
//!   batch's two launches on candle's stream one after the other (by
//!   default the prefill launch runs on a second stream beside the decode
//!   launch; `decode-first` enqueues it after the decode launch): run the
//!   mixed-batch tests once with it.
//! * optionally `CANDLE_PAGED_ATTENTION_STREAM=0`, which keeps decode
//!   launches on the unified kernel's decode instances (by default decodes
//!   of padded head size 64, 128 or 256 over blocks of a multiple of 16 take
//!   the stream-decode ones): run the suite once with it to cover both;
//!   `=wide` puts every head-128 8-row decode on the wide stream-decode
//!   instance (by default only batches that fill one wave of it): run the
//!   suite once with it too.

use anyhow::{bail, Result};
use candle_core::Device;

/// Lets GPU tests pass (printing `SKIPPED`) when there is no CUDA device.
pub const SKIP_GPU_VAR: &str = "CANDLE_PAGED_ATTENTION_SKIP_GPU";
/// Read by the CUDA path: fill outputs with NaN before every launch.
pub const POISON_VAR: &str = "CANDLE_PAGED_ATTENTION_POISON";

/// True when `var` is set to something other than empty or `0` (the rule
/// the library applies to `CANDLE_PAGED_ATTENTION_POISON`).
fn flag(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The running test's name (libtest names each test's thread after it).
fn test_name() -> String {
    std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("this test")
        .to_string()
}

/// CUDA device 0 for a GPU test, `Ok(None)` when the test is to be skipped
/// (no device and `CANDLE_PAGED_ATTENTION_SKIP_GPU=1`, with a `SKIPPED`
/// line), or an error naming the test and the variable to set: no device
/// without the skip variable, or a device without
/// `CANDLE_PAGED_ATTENTION_POISON=1`.
pub fn cuda_device() -> Result<Option<Device>> {
    let test = test_name();
    match Device::new_cuda(0) {
        Ok(dev) if flag(POISON_VAR) => Ok(Some(dev)),
        Ok(_) => bail!(
            "{test}: GPU tests need {POISON_VAR}=1 in their environment (the CUDA path then \
             fills outputs with NaN before every launch, so unwritten elements fail the checks)"
        ),
        Err(e) if flag(SKIP_GPU_VAR) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e}); {SKIP_GPU_VAR} is set");
            Ok(None)
        }
        Err(e) => bail!(
            "{test}: no CUDA device ({e}); GPU tests run on CUDA device 0 \
             (set {SKIP_GPU_VAR}=1 to skip them where there is none)"
        ),
    }
}

/// The devices of a test that loops over them itself: the CPU and, with the
/// `cuda` feature, CUDA device 0 unless [`cuda_device`] says to skip it
/// (an error when the environment is not what a GPU run needs).
pub fn devices() -> Result<Vec<Device>> {
    #[cfg(feature = "cuda")]
    let gpu = cuda_device()?;
    #[cfg(not(feature = "cuda"))]
    let gpu = None;
    Ok(std::iter::once(Device::Cpu).chain(gpu).collect())
}
