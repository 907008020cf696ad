//! The device's token pickers on CUDA: `sample_rows` (temperature, top-k,
//! top-p, Gumbel-max draw) and `greedy_tokens`, timed on random logits.
//!
//! ```text
//! cargo run --release --features cuda --example sampling_bench -- [--vocab 128256,262144] [--rows 1,64]
//! ```
//!
//! For each vocabulary, row count and logit spread (`--spreads`: the
//! standard deviation of the normal logits; small spreads are flat rows in
//! which top-p keeps most of the vocabulary, as a random-weight model's
//! are; large ones are peaked, as a trained model's usually are): after a
//! warm-up, `--iters` calls back to back between two synchronisations.
//! Reported: µs per call of greedy, of temperature-only sampling, of
//! top-p 0.95 and of top-k 50 with top-p 0.95 (all at temperature 0.8).

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_paged_attention::{greedy_tokens, sample_rows, RowSampling};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "the device's token pickers on random logits")]
struct Args {
    /// Vocabulary sizes.
    #[arg(long, value_delimiter = ',', default_value = "128256,262144")]
    vocab: Vec<usize>,
    /// Rows per call.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    rows: Vec<usize>,
    /// Standard deviations of the logits.
    #[arg(long, value_delimiter = ',', default_value = "0.05,1,4")]
    spreads: Vec<f64>,
    /// Timed calls per measurement.
    #[arg(long, default_value_t = 50)]
    iters: usize,
}

/// Mean µs per call of `f` over `iters` calls, after 3 untimed ones.
fn time_us(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e6 / iters as f64)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0)?;
    println!("| vocab | rows | spread | greedy µs | temperature µs | top-p µs | top-k+top-p µs |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for &vocab in &args.vocab {
        for &rows in &args.rows {
            for &spread in &args.spreads {
                let logits = Tensor::randn(0f32, spread as f32, (rows, vocab), &dev)?;
                let base = RowSampling {
                    temperature: 0.8,
                    seed: 7,
                    ..RowSampling::default()
                };
                let row_params = |p: RowSampling| -> Vec<RowSampling> {
                    (0..rows)
                        .map(|r| RowSampling {
                            seed: p.seed + r as u64,
                            ..p
                        })
                        .collect()
                };
                let plain = row_params(base);
                let top_p = row_params(RowSampling {
                    top_p: 0.95,
                    ..base
                });
                let top_kp = row_params(RowSampling {
                    top_k: 50,
                    top_p: 0.95,
                    ..base
                });
                let g = time_us(&dev, args.iters, || Ok(greedy_tokens(&logits)?))?;
                let t = time_us(&dev, args.iters, || Ok(sample_rows(&logits, &plain)?))?;
                let p = time_us(&dev, args.iters, || Ok(sample_rows(&logits, &top_p)?))?;
                let kp = time_us(&dev, args.iters, || Ok(sample_rows(&logits, &top_kp)?))?;
                println!("| {vocab} | {rows} | {spread} | {g:.1} | {t:.1} | {p:.1} | {kp:.1} |");
            }
        }
    }
    Ok(())
}
