//! Shared test support: one device-parameterised harness and the
//! paged-attention cases every suite runs.
//!
//! * [`device_test!`] and [`cuda_test!`] (here) instantiate a test body
//!   written once on the CPU and, with the `cuda` feature, on CUDA device 0;
//!   [`device::cuda_device`] says what a GPU test needs from its environment.
//! * [`case`]: a seeded description of one paged-attention call that builds
//!   fresh random inputs on any device; cache rows no query may see hold NaN.
//! * [`check`]: the case bodies: run the op, compare with the f64 reference
//!   (`candle_paged_attention::reference`) and, on a GPU, with the CPU path.
//! * [`grid`]: the grid and feature-set cases.
//!
//! A suite declares `#[macro_use] mod common;`. Each test binary uses a
//! different subset of this module.
#![allow(dead_code, unused_imports, unused_macros)]

/// Instantiates a test body on every device: as `NAME::cpu` and, with the
/// `cuda` feature, as `NAME::cuda` (on CUDA device 0; see
/// [`device::cuda_device`] for the environment a GPU run needs).
///
/// Two forms:
/// * Around a body whose first parameter is the device and which returns
///   `anyhow::Result<()>`; the function is an `rstest` function, so `#[case]`/`#[values]` attributes work as usual and
///   every case runs on both devices:
///   ```ignore
///   device_test! {
///       /// Docs.
///       #[case(16)]
///       #[case(32)]
///       fn grid(dev: &Device, #[case] block_size: usize, #[values(1, 2)] seed: u64) -> Result<()> {
///           check_case(&Case::new(..).with_seed(seed), dev)
///       }
///   }
///   ```
/// * With the names of body functions `fn NAME(dev: &Device) -> anyhow::Result<()>`
///   defined in the file: `device_test!(first_body, second_body);`.
macro_rules! device_test {
    (
        $(#[$attr:meta])*
        fn $name:ident(
            $dev:ident: &Device
            $(, $(#[$param_attr:meta])* $param:ident: $ty:ty)* $(,)?
        ) -> $ret:ty $body:block
    ) => {
        mod $name {
            // One rstest parameter per axis of a grid.
            #![allow(clippy::too_many_arguments)]
            #[allow(unused_imports)]
            use super::*;

            #[::rstest::rstest]
            $(#[$attr])*
            fn cpu($($(#[$param_attr])* $param: $ty),*) -> $ret {
                let $dev: &::candle_core::Device = &::candle_core::Device::Cpu;
                $body
            }

            #[cfg(feature = "cuda")]
            #[::rstest::rstest]
            $(#[$attr])*
            fn cuda($($(#[$param_attr])* $param: $ty),*) -> $ret {
                let Some(gpu) = $crate::common::device::cuda_device()? else {
                    return Ok(());
                };
                let $dev: &::candle_core::Device = &gpu;
                $body
            }
        }
    };
    ($($name:ident),+ $(,)?) => {
        $(
            mod $name {
                #[test]
                fn cpu() -> ::anyhow::Result<()> {
                    super::$name(&::candle_core::Device::Cpu)
                }

                #[cfg(feature = "cuda")]
                #[test]
                fn cuda() -> ::anyhow::Result<()> {
                    match $crate::common::device::cuda_device()? {
                        Some(dev) => super::$name(&dev),
                        None => Ok(()),
                    }
                }
            }
        )+
    };
}

/// A GPU-only test (checks with no CPU counterpart, such as comparing the
/// CUDA path with the CPU path): like the first form of [`device_test!`],
/// instantiated only as `NAME::cuda`, with the `cuda` feature.
macro_rules! cuda_test {
    (
        $(#[$attr:meta])*
        fn $name:ident(
            $dev:ident: &Device
            $(, $(#[$param_attr:meta])* $param:ident: $ty:ty)* $(,)?
        ) -> $ret:ty $body:block
    ) => {
        #[cfg(feature = "cuda")]
        mod $name {
            // One rstest parameter per axis of a grid.
            #![allow(clippy::too_many_arguments)]
            #[allow(unused_imports)]
            use super::*;

            #[::rstest::rstest]
            $(#[$attr])*
            fn cuda($($(#[$param_attr])* $param: $ty),*) -> $ret {
                let Some(gpu) = $crate::common::device::cuda_device()? else {
                    return Ok(());
                };
                let $dev: &::candle_core::Device = &gpu;
                $body
            }
        }
    };
}

pub mod case;
pub mod check;
pub mod device;
pub mod grid;

pub use case::*;
pub use check::*;
pub use device::*;
pub use grid::*;
