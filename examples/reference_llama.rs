//! Throughput baseline: greedy generation with candle-transformers' own
//! `quantized_llama` (its concatenated, unpaged KV cache) for a batch of
//! identical prompts, timed the same way as the `generate` runner.
//!
//! `cargo run --release --features models --example reference_llama -- [MODEL.gguf] --batch 32`

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor, D};
use candle_paged_attention::text::{chat, tokenizer};
use candle_transformers::models::quantized_llama::ModelWeights;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// A GGUF Llama; default: SmolLM2-135M-Instruct via scripts/fetch-smollm2.sh.
    model: Option<std::path::PathBuf>,
    /// The user message (wrapped in the ChatML template).
    #[arg(long, default_value = "Write a short story about a lighthouse keeper.")]
    prompt: String,
    /// Copies of the prompt decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// New tokens per sequence.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn model_path(arg: Option<std::path::PathBuf>) -> Result<std::path::PathBuf> {
    if let Some(p) = arg {
        return Ok(p);
    }
    Ok(candle_paged_attention::text::fetch::fetch_model(
        "fetch-smollm2.sh",
    )?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        other => anyhow::bail!("unknown device {other}"),
    };
    let path = model_path(args.model)?;
    let mut file = std::fs::File::open(&path).with_context(|| format!("opening {path:?}"))?;
    let content = candle_paged_attention::models::limits::read_gguf(&mut file)?;
    let tok = tokenizer::tokenizer_from_gguf(&content)?;
    let mut model = ModelWeights::from_gguf(content, &mut file, &device)?;
    let prompt = tokenizer::encode(&tok, &chat::smollm2_chat_prompt(&args.prompt))?;

    let start = Instant::now();
    // quantized_llama cannot take a multi-token prompt for a batch of more
    // than one (its last-row slice feeds a non-contiguous tensor to QMatMul),
    // so a batch prefills one position per forward.
    let chunk = if args.batch == 1 { prompt.len() } else { 1 };
    let mut logits = Tensor::zeros(1, candle_core::DType::F32, &device)?;
    for (i, piece) in prompt.chunks(chunk).enumerate() {
        let input = Tensor::new(piece, &device)?
            .unsqueeze(0)?
            .repeat((args.batch, 1))?;
        logits = model.forward(&input, i * chunk)?; // (batch, vocab)
    }
    let mut next = logits.argmax(D::Minus1)?; // (batch,)
    let first: Vec<u32> = next.to_vec1()?;
    let ttft = start.elapsed();
    let mut generated = vec![first];
    for step in 1..args.max_tokens {
        logits = model.forward(&next.unsqueeze(1)?, prompt.len() + step - 1)?;
        next = logits.argmax(D::Minus1)?;
        generated.push(next.to_vec1()?);
    }
    let secs = start.elapsed().as_secs_f64();
    let decode_secs = secs - ttft.as_secs_f64();
    let text: Vec<u32> = generated.iter().map(|row| row[0]).collect();
    println!("{}", tokenizer::decode(&tok, &text)?);
    let total = args.batch * args.max_tokens;
    println!(
        "candle-transformers quantized_llama on {:?}: batch {}, {} prompt tokens, {} generated tokens in {secs:.2}s: {:.1} tokens/s generated; decode steps alone {:.1} tokens/s; time to first token {:.3}s",
        device.location(),
        args.batch,
        prompt.len(),
        total,
        total as f64 / secs,
        (total - args.batch) as f64 / decode_secs,
        ttft.as_secs_f64()
    );
    Ok(())
}
