//! The flags the runners share (`--device`, `--dtype`, `--kv-cache-dtype`),
//! parsed one way for all of them; every error names its flag and value.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_paged_attention::{KvCacheDtype, KvScales};

/// `--device`: `cpu`, `cuda` (device 0) or `cuda:N` (`cuda` needs the
/// `cuda` feature).
pub fn device(flag: &str) -> Result<Device> {
    let ordinal = match flag {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        d => match d.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => n,
            None => bail!("--device must be cpu, cuda or cuda:N, got {d}"),
        },
    };
    Device::new_cuda(ordinal).with_context(|| format!("--device {flag}"))
}

/// `--dtype`: `auto` is f32 on the CPU and bf16 on CUDA.
pub fn activation_dtype(flag: &str, dev: &Device) -> Result<DType> {
    Ok(match flag {
        "auto" if dev.is_cuda() => DType::BF16,
        "auto" | "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        d => bail!("--dtype must be auto, f32, bf16 or f16, got {d}"),
    })
}

/// `--kv-cache-dtype`: `auto` (the model's) or `fp8` (F8E4M3 with unit
/// scales, as vLLM's fp8 cache without calibrated scales).
#[allow(dead_code)] // not every runner has the flag
pub fn kv_cache_dtype(flag: &str) -> Result<KvCacheDtype> {
    Ok(match flag {
        "auto" => KvCacheDtype::Auto,
        "fp8" | "fp8_e4m3" => KvCacheDtype::Fp8E4M3(KvScales::default()),
        d => bail!("--kv-cache-dtype must be auto or fp8, got {d}"),
    })
}
