//! With the `cuda` feature, compiles `kernels/*.cu` to PTX (through cudaforge,
//! as candle-kernels does) and writes `$OUT_DIR/ptx.rs`, which embeds one
//! `&str` constant per kernel file. Without the feature it does nothing.
//!
//! * `CUDA_COMPUTE_CAP` - target compute capability (`80`, `90`, `90a`, ...);
//!   when unset, the first visible GPU's, else 80 (PTX that every sm_80+ GPU
//!   can load).
//! * `CUDA_NVCC_FLAGS` - extra nvcc arguments, split on whitespace.

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build()?;
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::PathBuf;

    const HEADERS: [&str; 2] = ["kernels/common.cuh", "kernels/attention_params.cuh"];

    pub fn build() -> anyhow::Result<()> {
        println!("cargo:rerun-if-changed=kernels");
        println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
        println!("cargo:rerun-if-env-changed=CUDA_NVCC_FLAGS");
        for h in HEADERS {
            println!("cargo:rerun-if-changed={h}");
        }
        let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
        // CUDA_COMPUTE_CAP first, then nvidia-smi, then sm_80.
        let arch = cudaforge::detect_compute_cap()
            .map(|a| a.to_nvcc_arch())
            .unwrap_or_else(|_| "sm_80".to_string());
        let arch = arch.trim_start_matches("sm_").to_string();
        let mut builder = cudaforge::KernelBuilder::new()
            .source_dir("kernels")
            .watch(HEADERS)
            .compute_cap_arch(&arch)
            .arg("--expt-relaxed-constexpr")
            .arg("-std=c++17")
            .arg("-O3");
        if let Ok(flags) = std::env::var("CUDA_NVCC_FLAGS") {
            for flag in flags.split_whitespace() {
                builder = builder.arg(flag);
            }
        }
        builder
            .build_ptx()
            .map_err(|e| anyhow::anyhow!("compiling kernels/*.cu for sm_{arch}: {e}"))?
            .write(out_dir.join("ptx.rs"))
            .map_err(|e| anyhow::anyhow!("writing ptx.rs: {e}"))?;
        Ok(())
    }
}
