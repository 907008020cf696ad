//! End-to-end throughput: N requests through the continuous-batching
//! `Engine`, then the same requests through candle-transformers' dense
//! model, side by side.
//!
//! ```text
//! # SmolLM2-135M-Instruct (GGUF), 64 requests of 128 prompt + 128 new tokens:
//! cargo run --release --features models,cuda --example throughput -- --device cuda
//! # varied lengths, arriving at 20 requests/s:
//! cargo run --release --features models,cuda --example throughput -- --device cuda \
//!     --dist lognormal --prompt-len 256 --max-tokens 128 --request-rate 20
//! # 32 copies of one prompt (the dense side batches them):
//! cargo run --release --features models,cuda --example throughput -- --device cuda \
//!     --num-requests 32 --same-prompt
//! # on the CPU, tiny:
//! cargo run --release --features models --example throughput -- --dequantize \
//!     --num-requests 4 --prompt-len 32 --max-tokens 8
//! # a Llama-3-8B-shaped model with random bf16 weights (no download):
//! cargo run --release --features models,cuda --example throughput -- --device cuda \
//!     --model llama3-8b-random --num-requests 1 --ref-requests 1
//! # Gemma 3 270M (GGUF Q4_K_M, bf16 activations on CUDA), batch 1 and batch 32:
//! cargo run --release --features models,cuda --example throughput -- --device cuda \
//!     --model gemma3-270m --num-requests 8 --max-num-seqs 1 --ref-requests 8
//! cargo run --release --features models,cuda --example throughput -- --device cuda \
//!     --model gemma3-270m --num-requests 64 --max-num-seqs 32 --ref-requests 4
//! # the same on the CPU, tiny:
//! cargo run --release --features models --example throughput -- --model gemma3-270m \
//!     --num-requests 4 --prompt-len 32 --max-tokens 16
//! # the same on the CPU, shrunk:
//! cargo run --release --features models --example throughput -- --model llama3-8b-random \
//!     --layers 2 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --vocab 4096 \
//!     --num-requests 4 --prompt-len 32 --max-tokens 8
//! ```
//!
//! Workload (all seeded by `--seed`):
//! * `--num-requests N`; `--dist fixed|uniform|lognormal` draws the prompt
//!   length (`--prompt-len` mean, `--prompt-len-min/-max`) and the output
//!   length (`--max-tokens` mean, `--max-tokens-min/-max`); `fixed` gives
//!   every request the mean, `uniform` is on `[min, max]` (default
//!   `[mean/2, 3*mean/2]`), `lognormal` has the stated mean and shape
//!   `--sigma`, clamped to `[min, max]` (default `[1, 4*mean]`).
//! * Prompts are random token ids (special and control tokens excluded);
//!   `--same-prompt` makes every prompt a prefix of one sequence,
//!   `--shared-prefix K` shares the first K tokens. Decoding is greedy with
//!   no stop token, so every request produces exactly its output length on
//!   both sides.
//! * Requests arrive at t = 0, or as a Poisson process of `--request-rate`
//!   requests per second.
//!
//! Models:
//! * `--model smollm2` (default): SmolLM2-135M-Instruct from
//!   `scripts/fetch-smollm2.sh` (or `--gguf PATH`), the paged
//!   `QuantizedLlama` against candle-transformers' `quantized_llama`.
//!   `--dequantize` loads f32 weights on both sides.
//! * `--model gemma3-270m`: Gemma 3 270M (GGUF Q4_K_M) from
//!   `scripts/fetch-gemma3.sh` (or `--gguf PATH`), the paged
//!   `QuantizedGemma3` against candle-transformers' `quantized_gemma3`
//!   (which batches decodes: its `forward` takes `(batch, seq_len)`; a
//!   whole-prompt forward of a batch fails in 0.11.1, "input has to be
//!   contiguous", at the strided last-position rows it norms, so its
//!   batches prefill one position per forward, as the report says). A `--gguf`
//!   file whose `general.architecture` is `gemma3` takes this path whatever
//!   `--model` says. The two compute different functions: candle-transformers
//!   uses SiLU in the MLP where Gemma 3 uses GELU and lets decodes see past
//!   the 512-token window (`docs/gemma3.md`), so their tokens differ and the
//!   identical-output counts say nothing about correctness; the per-token
//!   work is the same up to the window. `--dequantize` loads f32 weights on
//!   both sides (the paged model then runs f32 activations).
//! * `--model llama3-8b-random`: Llama-3-8B's shape (`--layers 32 --hidden
//!   4096 --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256`, rope
//!   theta 500000) with seeded random weights (`--weight-std`, norms at 1)
//!   in `--dtype` (bf16), one set of tensors loaded by the paged `Llama` and
//!   by candle-transformers' `llama`. The CPU refuses shapes over 4 GiB.
//!
//! Engine: `--block-size`, `--num-blocks` or `--kv-memory-mb` (default: on
//! CUDA, what `--gpu-memory-utilization`, 0.9, of the device memory leaves
//! after the weights of both sides and a profiled step of `--chunk-tokens`
//! tokens, as `generate` sizes it; on the CPU, blocks for the
//! `--max-num-seqs` longest requests at full length, so no preemption is
//! needed), `--chunk-tokens` (token budget of a step),
//! `--max-num-seqs`, `--prefix-caching`.
//!
//! Reported for each side: requests/s and generated tokens/s over the run's
//! wall time; time to first token (from each request's arrival) and
//! inter-token latency (every gap between two tokens of a request), p50 and
//! p99, each token timed with `Instant` when it reaches the host (the
//! engine's `step` events; the dense side's argmax copy); for the engine,
//! preemptions, peak KV blocks in use (shared blocks once) and prefix-cache
//! hits (prompt tokens taken from the cache, and their share of all prompt
//! tokens processed), from the engine's counters (`Engine::stats`, the
//! warm-up excluded). The dense side runs one request at a time (the first
//! `--ref-requests`), and in batches of
//! `--max-num-seqs` when all requests have one prompt length and one output
//! length and arrive together. The batch-1 decode floor is the weight bytes
//! a step reads over `--copy-bandwidth-gbs` (on CUDA by default 4300, an
//! H200's measured copy bandwidth; on the CPU only when the flag gives one). `--json PATH` writes everything as JSON;
//! `--no-reference` skips the dense side, `--no-warmup` the warm-up request.

// Its `--gguf-dtype` is parsed here; the other shared flags are used.
#[allow(dead_code)]
#[path = "common/flags.rs"]
mod flags;
#[path = "throughput/paged.rs"]
mod paged;
#[path = "throughput/random_llama.rs"]
mod random_llama;
#[path = "throughput/reference.rs"]
mod reference;
#[path = "throughput/stats.rs"]
mod stats;
#[path = "throughput/workload.rs"]
mod workload;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use candle_paged_attention::engine::{CacheSizing, KvCacheSpec, SchedulerConfig};
use candle_paged_attention::models::quantized_gemma3::QuantizedGemma3;
use candle_paged_attention::models::{llama, quantized_llama, PagedModel, PagedOptions};
use candle_paged_attention::Attention;

/// The copy bandwidth of the weight-read floor on CUDA without
/// `--copy-bandwidth-gbs`: an H200's, measured (GB/s).
const DEFAULT_COPY_BANDWIDTH_GBS: f64 = 4300.0;
use candle_transformers::models as ct;
use clap::{Parser, ValueEnum};
use serde_json::json;

use reference::{DenseRef, QuantizedGemma3Ref, QuantizedRef, Reference};
use stats::RunStats;
use workload::{Dist, Draw, LenDist, WorkloadSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// SmolLM2-135M-Instruct, GGUF.
    Smollm2,
    /// A Llama-3-8B-shaped model with random weights.
    Llama3_8bRandom,
    /// Gemma 3 270M, GGUF (Q4_K_M).
    #[value(name = "gemma3-270m")]
    Gemma3_270m,
}

#[derive(Parser, Debug)]
#[command(about = "Throughput of the paged engine against candle-transformers' dense models")]
struct Args {
    /// Which model.
    #[arg(long, value_enum, default_value = "smollm2")]
    model: ModelKind,
    /// cpu or cuda (cuda needs --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// A GGUF file (architecture llama or gemma3); default:
    /// scripts/fetch-smollm2.sh, or scripts/fetch-gemma3.sh for gemma3-270m.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Dequantize GGUF weights to f32 on both sides.
    #[arg(long)]
    dequantize: bool,
    /// Activations of the paged GGUF model: auto (f32 on the CPU, bf16 on
    /// CUDA), f32, bf16 or f16 (Gemma 3: f32 or bf16; f32 when
    /// dequantized). candle-transformers' side runs f32.
    #[arg(long, default_value = "auto")]
    gguf_dtype: String,

    /// Requests in the run.
    #[arg(long, default_value_t = 64)]
    num_requests: usize,
    /// Length distribution of prompts and outputs.
    #[arg(long, value_enum, default_value = "fixed")]
    dist: Dist,
    /// Prompt length (the mean for uniform and lognormal).
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    #[arg(long)]
    prompt_len_min: Option<usize>,
    #[arg(long)]
    prompt_len_max: Option<usize>,
    /// Generated tokens per request (the mean for uniform and lognormal).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long)]
    max_tokens_min: Option<usize>,
    #[arg(long)]
    max_tokens_max: Option<usize>,
    /// Shape of the lognormal distribution (sigma of the underlying normal).
    #[arg(long, default_value_t = 0.5)]
    sigma: f64,
    /// Poisson arrivals at this many requests per second; default: all at t = 0.
    #[arg(long)]
    request_rate: Option<f64>,
    /// Every prompt is a prefix of one token sequence.
    #[arg(long)]
    same_prompt: bool,
    /// The first K tokens of every prompt are the same.
    #[arg(long, default_value_t = 0)]
    shared_prefix: usize,
    /// Seed of lengths, prompt tokens, arrivals and random weights.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Sample every request at this temperature (request i with seed i;
    /// needs --no-reference); 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus threshold of sampled requests.
    #[arg(long)]
    top_p: Option<f64>,

    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache blocks per layer (overrides --kv-memory-mb).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// KV cache budget in MiB over all layers; default: on CUDA, what
    /// --gpu-memory-utilization leaves; on the CPU, enough blocks for the
    /// --max-num-seqs longest requests.
    #[arg(long)]
    kv_memory_mb: Option<usize>,
    /// On CUDA, the fraction of the device memory the process may use (the
    /// KV cache takes what the weights and a profiled step leave of it).
    #[arg(long, default_value_t = candle_paged_attention::engine::DEFAULT_GPU_MEMORY_UTILIZATION)]
    gpu_memory_utilization: f64,
    /// Token budget of one engine step (prompts are prefilled in chunks).
    #[arg(long, default_value_t = 512)]
    chunk_tokens: usize,
    /// Sequences running at once (also the dense side's batch size).
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Share cached prompt blocks between sequences.
    #[arg(long)]
    prefix_caching: bool,
    /// Run every step eagerly instead of replaying CUDA graphs.
    #[arg(long)]
    no_cuda_graph: bool,
    /// Replay CUDA graphs of pure-decode steps only (steps with prefills
    /// run eagerly).
    #[arg(long)]
    decode_graphs_only: bool,

    /// Decoder layers of the random Llama.
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// Hidden size of the random Llama.
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// MLP width of the random Llama.
    #[arg(long, default_value_t = 14336)]
    intermediate: usize,
    /// Query heads of the random Llama.
    #[arg(long, default_value_t = 32)]
    heads: usize,
    /// KV heads of the random Llama.
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Vocabulary of the random Llama.
    #[arg(long, default_value_t = 128256)]
    vocab: usize,
    /// Weight dtype of the random Llama: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Standard deviation of the random weights.
    #[arg(long, default_value_t = 0.02)]
    weight_std: f64,

    /// Copy bandwidth in GB/s for the weight-read floor (default on CUDA:
    /// 4300, an H200's; on the CPU no floor is printed without it).
    #[arg(long)]
    copy_bandwidth_gbs: Option<f64>,
    /// Skip candle-transformers.
    #[arg(long)]
    no_reference: bool,
    /// Run the one-at-a-time reference on the first N requests only.
    #[arg(long)]
    ref_requests: Option<usize>,
    /// Skip the untimed warm-up request on each side.
    #[arg(long)]
    no_warmup: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Both sides of one model, and what the report needs to know about it.
struct Loaded {
    paged: Box<dyn PagedModel>,
    reference: Option<Box<dyn Reference>>,
    /// Token ids prompts are drawn from.
    pool: Vec<u32>,
    /// Weight bytes one decode step reads (an untied embedding table is
    /// only gathered from, so it is left out).
    step_weight_bytes: usize,
    /// Longest context (prompt + output) both sides support.
    max_context: usize,
    description: String,
    /// Printed under the table, when there is something to say.
    note: Option<String>,
}

/// Runs `scripts/{name}` (found by `text::fetch`) and returns the model
/// path it prints.
fn fetch(name: &str) -> Result<PathBuf> {
    Ok(candle_paged_attention::text::fetch::fetch_model(name)?)
}

/// Ids of the GGUF vocabulary's ordinary tokens (token type 1; control,
/// user-defined, unknown and byte tokens are left out).
fn ordinary_tokens(ct: &gguf_file::Content) -> Result<Vec<u32>> {
    let vocab = match ct.tensor_infos.get("token_embd.weight") {
        Some(t) => t.shape.dims()[0],
        None => bail!("the GGUF file has no token_embd.weight"),
    };
    let Some(types) = ct.metadata.get("tokenizer.ggml.token_type") else {
        return Ok((0..vocab as u32).collect());
    };
    let types = types.to_vec()?;
    let mut ids = Vec::with_capacity(vocab);
    for (id, t) in types.iter().enumerate().take(vocab) {
        if t.to_i32()? == 1 {
            ids.push(id as u32);
        }
    }
    Ok(ids)
}

/// Bytes of the weights a decode step reads: every tensor at its stored
/// size (f32 when dequantized), without `token_embd` when a separate
/// `output` matrix exists.
fn gguf_step_bytes(ct: &gguf_file::Content, dequantize: bool) -> usize {
    let bytes = |info: &gguf_file::TensorInfo| {
        let n = info.shape.elem_count();
        if dequantize {
            4 * n
        } else {
            n / info.ggml_dtype.block_size() * info.ggml_dtype.type_size()
        }
    };
    let total: usize = ct.tensor_infos.values().map(bytes).sum();
    match (
        ct.tensor_infos.get("output.weight"),
        ct.tensor_infos.get("token_embd.weight"),
    ) {
        (Some(_), Some(embd)) => total - bytes(embd),
        _ => total,
    }
}

/// `--gguf-dtype`: `auto` is f32 on the CPU and bf16 on CUDA.
fn gguf_dtype(args: &Args, dev: &Device) -> Result<DType> {
    Ok(match args.gguf_dtype.as_str() {
        "auto" if dev.is_cuda() => DType::BF16,
        "auto" | "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        d => bail!("--gguf-dtype must be auto, f32, bf16 or f16, got {d}"),
    })
}

/// A GGUF model (`--gguf`, or the `--model`'s fetch script), by its
/// architecture: Gemma 3 or Llama.
fn load_gguf(args: &Args, dev: &Device, opts: PagedOptions) -> Result<Loaded> {
    let path = match (&args.gguf, args.model) {
        (Some(p), _) => p.clone(),
        (None, ModelKind::Gemma3_270m) => fetch("fetch-gemma3.sh")?,
        (None, _) => fetch("fetch-smollm2.sh")?,
    };
    let open = || -> Result<(std::fs::File, gguf_file::Content)> {
        let mut f =
            std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let ct = candle_paged_attention::models::limits::read_gguf(&mut f)?;
        Ok((f, ct))
    };
    let (mut file, ct) = open()?;
    let arch = ct
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let name = ct
        .metadata
        .get("general.name")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_else(|| path.display().to_string());
    let context_length = |key: &str| {
        ct.metadata
            .get(key)
            .and_then(|v| v.to_u32().ok())
            .map_or(usize::MAX, |n| n as usize)
    };
    let wtype = ct
        .tensor_infos
        .get("blk.0.attn_q.weight")
        .map(|t| format!("{:?}", t.ggml_dtype))
        .unwrap_or_default();
    let description = if args.dequantize {
        format!("{name} (GGUF {wtype}, dequantized to f32 on both sides)")
    } else {
        format!("{name} (GGUF {wtype}, quantized matmuls)")
    };
    let gguf_dtype = gguf_dtype(args, dev)?;
    if arch == "gemma3" {
        let paged: Box<dyn PagedModel> = if args.dequantize {
            if args.gguf_dtype != "auto" && gguf_dtype != DType::F32 {
                bail!("--dequantize runs Gemma 3 in f32, not --gguf-dtype {gguf_dtype:?}");
            }
            Box::new(QuantizedGemma3::from_gguf_dequantized(
                &ct, &mut file, dev, opts,
            )?)
        } else {
            Box::new(QuantizedGemma3::from_gguf_with_dtype(
                &ct, &mut file, dev, opts, gguf_dtype,
            )?)
        };
        let reference: Option<Box<dyn Reference>> = if args.no_reference {
            None
        } else {
            // candle-transformers' loader takes the content by value.
            let (mut f, ct) = open()?;
            let m = ct::quantized_gemma3::ModelWeights::from_gguf(ct, &mut f, dev)?;
            Some(Box::new(QuantizedGemma3Ref(m)))
        };
        return Ok(Loaded {
            paged,
            reference,
            pool: ordinary_tokens(&ct)?,
            step_weight_bytes: gguf_step_bytes(&ct, args.dequantize),
            // candle-transformers' rotary table ends at its MAX_SEQ_LEN.
            max_context: ct::quantized_gemma3::MAX_SEQ_LEN
                .min(context_length("gemma3.context_length")),
            description,
            note: Some(
                "candle-transformers' quantized_gemma3 computes a different function from Gemma 3's (SiLU in the MLP instead of GELU; decodes not limited to the 512-token window; docs/gemma3.md): its tokens differ from the engine's, so the identical-output counts say nothing about either side's correctness.".into(),
            ),
        });
    }
    let paged: Box<dyn PagedModel> =
        Box::new(quantized_llama::QuantizedLlama::from_gguf_with_dtype(
            &ct,
            &mut file,
            dev,
            opts,
            args.dequantize,
            gguf_dtype,
        )?);
    let reference: Option<Box<dyn Reference>> = if args.no_reference {
        None
    } else {
        // candle-transformers' loader takes the content by value.
        let (mut f, ct) = open()?;
        let m = ct::quantized_llama::ModelWeights::from_gguf(ct, &mut f, dev)?;
        Some(Box::new(QuantizedRef(m)))
    };
    Ok(Loaded {
        paged,
        reference,
        pool: ordinary_tokens(&ct)?,
        step_weight_bytes: gguf_step_bytes(&ct, args.dequantize),
        // candle-transformers' rotary table ends at its MAX_SEQ_LEN (4096).
        max_context: ct::quantized_llama::MAX_SEQ_LEN.min(context_length("llama.context_length")),
        description,
        note: None,
    })
}

fn load_llama3_random(args: &Args, dev: &Device, opts: PagedOptions) -> Result<Loaded> {
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        d => bail!("--dtype must be bf16, f16 or f32, got {d}"),
    };
    if args.heads == 0
        || args.kv_heads == 0
        || !args.hidden.is_multiple_of(args.heads)
        || !args.heads.is_multiple_of(args.kv_heads)
    {
        bail!(
            "--hidden {} must be a multiple of --heads {}, itself a multiple of --kv-heads {} (all positive)",
            args.hidden,
            args.heads,
            args.kv_heads
        );
    }
    let cfg = random_llama::LlamaShape {
        layers: args.layers,
        hidden: args.hidden,
        intermediate: args.intermediate,
        heads: args.heads,
        kv_heads: args.kv_heads,
        vocab: args.vocab,
    }
    .config();
    let shapes = random_llama::tensor_shapes(&cfg);
    let numel = |s: &[usize]| s.iter().product::<usize>();
    let total: usize = shapes.iter().map(|(_, s, _)| numel(s)).sum();
    let bytes = total * dtype.size_in_bytes();
    if dev.is_cpu() && bytes > 4 << 30 {
        bail!(
            "the random Llama of this shape holds {:.1} GiB of weights, too much for the CPU; shrink it, e.g. --layers 2 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --vocab 4096",
            bytes as f64 / (1u64 << 30) as f64
        );
    }
    let embed = cfg.vocab_size * cfg.hidden_size * dtype.size_in_bytes();
    let vb = VarBuilder::from_tensors(
        random_llama::random_weights(&cfg, args.weight_std, dtype, args.seed, dev)?,
        dtype,
        dev,
    );
    let paged = llama::Llama::load(vb.clone(), &cfg, opts)?;
    let reference: Option<Box<dyn Reference>> = if args.no_reference {
        None
    } else {
        let m = ct::llama::Llama::load(vb, &cfg)?;
        Some(Box::new(DenseRef::new(m, cfg.clone(), dtype, dev)?))
    };
    Ok(Loaded {
        paged: Box::new(paged),
        reference,
        pool: (0..cfg.vocab_size as u32).collect(),
        step_weight_bytes: bytes - if cfg.tie_word_embeddings { 0 } else { embed },
        max_context: cfg.max_position_embeddings,
        description: format!(
            "Llama-3-8B-shaped, random {dtype:?} weights (std {}): {} layers, hidden {}, MLP {}, {} heads, {} KV heads, vocab {}, {:.1}M parameters",
            args.weight_std,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.vocab_size,
            total as f64 / 1e6
        ),
        note: None,
    })
}

/// Requests whose tokens equal the engine's, of those compared.
fn count_equal(engine: &[Vec<u32>], other: &[Vec<u32>]) -> (usize, usize) {
    let eq = engine.iter().zip(other).filter(|(a, b)| a == b).count();
    (eq, other.len())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(gbs) = args
        .copy_bandwidth_gbs
        .filter(|g| !(g.is_finite() && *g > 0.0))
    {
        bail!("--copy-bandwidth-gbs must be finite and positive, got {gbs}");
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!(
            "--temperature must be finite and at least 0, got {}",
            args.temperature
        );
    }
    if args.temperature > 0.0 && !args.no_reference {
        bail!(
            "--temperature {} samples; the dense reference is greedy only: add --no-reference",
            args.temperature
        );
    }
    if args.top_p.is_some() && args.temperature == 0.0 {
        bail!("--top-p needs a --temperature above 0");
    }
    if args.dequantize {
        // candle's QMatMul reads this on first use: candle-transformers'
        // quantized_llama then holds f32 weights like our dequantized model.
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    }
    let dev = flags::device(&args.device)?;
    let opts = PagedOptions {
        block_size: args.block_size,
        ..Default::default()
    };
    let start = std::time::Instant::now();
    let mut loaded = match args.model {
        ModelKind::Smollm2 | ModelKind::Gemma3_270m => load_gguf(&args, &dev, opts)?,
        ModelKind::Llama3_8bRandom => load_llama3_random(&args, &dev, opts)?,
    };
    eprintln!("loaded in {:.2?}: {}", start.elapsed(), loaded.description);

    let spec = WorkloadSpec {
        num_requests: args.num_requests,
        prompt: LenDist::new(
            "prompt length",
            args.dist,
            args.prompt_len,
            args.prompt_len_min,
            args.prompt_len_max,
            args.sigma,
        )?,
        output: LenDist::new(
            "output length",
            args.dist,
            args.max_tokens,
            args.max_tokens_min,
            args.max_tokens_max,
            args.sigma,
        )?,
        request_rate: args.request_rate,
        same_prompt: args.same_prompt,
        shared_prefix: args.shared_prefix,
        seed: args.seed,
        draw: (args.temperature > 0.0).then_some(Draw {
            temperature: args.temperature,
            top_p: args.top_p,
        }),
    };
    let longest = spec.prompt.max() + spec.output.max();
    if longest > loaded.max_context {
        bail!(
            "prompt + output lengths reach {longest} tokens, more than the {} both models support",
            loaded.max_context
        );
    }
    let work = workload::build(&spec, &loaded.pool)?;
    let prompt_tokens: usize = work.iter().map(|w| w.prompt.len()).sum();
    let output_tokens: usize = work.iter().map(|w| w.max_tokens).sum();
    let drawn = |v: Vec<usize>| {
        format!(
            "drawn: mean {:.1}, min {}, max {}",
            v.iter().sum::<usize>() as f64 / v.len() as f64,
            v.iter().min().unwrap_or(&0),
            v.iter().max().unwrap_or(&0)
        )
    };
    let prompt_desc = format!(
        "{} ({})",
        spec.prompt.describe(),
        drawn(work.iter().map(|w| w.prompt.len()).collect())
    );
    let output_desc = format!(
        "{} ({})",
        spec.output.describe(),
        drawn(work.iter().map(|w| w.max_tokens).collect())
    );
    let arrivals = match args.request_rate {
        Some(r) => format!("Poisson at {r} requests/s (seeded)"),
        None => "all at t = 0".into(),
    };

    let model = loaded.paged.as_ref();
    let layers: Vec<&Attention> = model.attention_layers();
    let bs = args.block_size;
    let sizing = match (args.num_blocks, args.kv_memory_mb) {
        (Some(n), _) => CacheSizing::Blocks(n),
        (None, Some(mb)) => match mb.checked_mul(1 << 20) {
            Some(b) => CacheSizing::Bytes(b),
            None => bail!("--kv-memory-mb {mb} is too large: its bytes overflow usize"),
        },
        (None, None) if dev.is_cuda() => CacheSizing::Device {
            utilization: args.gpu_memory_utilization,
            max_batch_tokens: args.chunk_tokens,
            max_num_seqs: args.max_num_seqs,
        },
        (None, None) => {
            let mut need: Vec<usize> = work
                .iter()
                .map(|w| (w.prompt.len() + w.max_tokens).div_ceil(bs))
                .collect();
            need.sort_unstable_by(|a, b| b.cmp(a));
            CacheSizing::Blocks(need.iter().take(args.max_num_seqs).sum::<usize>().max(1))
        }
    };
    let spec = KvCacheSpec {
        prefix_caching: args.prefix_caching,
        ..KvCacheSpec::new(sizing)
    };
    let (cache, plan) = spec.build(model).context(
        "sizing and allocating the KV cache (--num-blocks, --kv-memory-mb, --gpu-memory-utilization)",
    )?;
    let num_blocks = plan.num_blocks;
    let sized_by = match (&sizing, plan.profile) {
        (CacheSizing::Device { utilization, .. }, Some(p)) => format!(
            "sized by --gpu-memory-utilization {utilization}: {:.1} GiB device, {:.1} GiB free after the weights, profiled step of {} tokens peaked at {:.1} MiB",
            p.total_bytes as f64 / (1u64 << 30) as f64,
            p.free_bytes as f64 / (1u64 << 30) as f64,
            args.chunk_tokens,
            p.activation_peak_bytes as f64 / (1u64 << 20) as f64
        ),
        (CacheSizing::Bytes(b), _) => format!("sized by --kv-memory-mb {}", b >> 20),
        (CacheSizing::Blocks(_), _) if args.num_blocks.is_some() => "sized by --num-blocks".into(),
        _ => "sized for the --max-num-seqs longest requests".into(),
    };
    let kv_mib = cache.memory_bytes() as f64 / (1 << 20) as f64;
    let sched = SchedulerConfig {
        max_batch_tokens: args.chunk_tokens,
        max_num_seqs: args.max_num_seqs,
    };
    let path = format!(
        "device {:?}, activations {:?}, KV cache {} layers x {num_blocks} blocks of {bs} tokens ({kv_mib:.1} MiB{}, {sized_by}), step budget {} tokens, at most {} sequences",
        dev.location(),
        model.dtype(),
        layers.len(),
        if args.prefix_caching { ", prefix caching" } else { "" },
        args.chunk_tokens,
        args.max_num_seqs
    );
    eprintln!(
        "workload: {} requests, prompt {prompt_desc}, output {output_desc}, {prompt_tokens} prompt and {output_tokens} output tokens in all, arrivals {arrivals}, seed {}",
        work.len(),
        args.seed
    );
    eprintln!("paged engine: {path}");

    // Reversed, so that the warm-up registers no block of a real prompt in
    // the prefix cache.
    let warm_prompt: Vec<u32> = work[0].prompt.iter().take(16).rev().copied().collect();
    let warm = (!args.no_warmup).then_some(warm_prompt.as_slice());
    let graphs = paged::GraphUse::from_flags(args.no_cuda_graph, args.decode_graphs_only);
    let engine = paged::run(model, cache, sched, &work, warm, graphs, None)?;
    eprintln!(
        "paged engine: {:.3}s, {:.1} generated tok/s; decode path: {}",
        engine.stats.wall_s,
        engine.stats.tokens_per_s(),
        engine.decode_path
    );

    let mut refs: Vec<RunStats> = Vec::new();
    let mut ref_prefill = None;
    if let Some(r) = loaded.reference.as_deref_mut() {
        if let Some(p) = warm {
            reference::warm_up(r, p, &dev)?;
        }
        let n = args.ref_requests.unwrap_or(work.len()).clamp(1, work.len());
        let (mut s, out) = reference::run_sequential(r, &work[..n], &dev)?;
        s.identical_outputs = Some(count_equal(&engine.outputs, &out));
        eprintln!(
            "candle-transformers one at a time: {} requests in {:.3}s",
            n, s.wall_s
        );
        refs.push(s);
        if workload::batchable(&work) {
            let (mut s, out, prefill) =
                reference::run_batched(r, &work, args.max_num_seqs.max(1), &dev)?;
            s.identical_outputs = Some(count_equal(&engine.outputs, &out));
            eprintln!("{}: {:.3}s", s.label, s.wall_s);
            refs.push(s);
            ref_prefill = Some(prefill);
        }
    }

    // The floor needs the device's copy bandwidth: an H200's by default on
    // CUDA, none on the CPU unless given.
    let bandwidth_gbs = args
        .copy_bandwidth_gbs
        .or(dev.is_cuda().then_some(DEFAULT_COPY_BANDWIDTH_GBS));
    let floor_s = bandwidth_gbs.map(|gbs| loaded.step_weight_bytes as f64 / (gbs * 1e9));
    println!("\n## Throughput: {}\n", loaded.description);
    println!(
        "{} requests; prompt {prompt_desc}; output {output_desc}; arrivals {arrivals}; seed {}; {}, no stop tokens.\n",
        work.len(),
        args.seed,
        match work.first().and_then(|w| w.draw) {
            None => "greedy".to_string(),
            Some(d) => format!(
                "sampled at temperature {}{}",
                d.temperature,
                d.top_p.map_or(String::new(), |p| format!(", top-p {p}"))
            ),
        }
    );
    print!("{}", stats::table(&engine.stats, &refs));
    println!(
        "\nRatios are \"times better\": throughput engine / reference, latency reference / engine."
    );
    println!(
        "Greedy outputs may part at near-ties of the logits (batching changes summation order; quantized matmuls round activations to 8 bits); both sides generate the same number of tokens either way."
    );
    if let Some(note) = loaded.note.as_ref().filter(|_| !refs.is_empty()) {
        println!("{note}");
    }
    println!("Path: {path}; decode path: {}.", engine.decode_path);
    match &ref_prefill {
        Some(reference::Prefill::PerPosition(e)) => println!(
            "The batched reference prefills one position per forward (its whole-prompt batch forward failed: {e})."
        ),
        Some(reference::Prefill::Whole) => {
            println!("The batched reference prefills each batch in one forward.")
        }
        None if !refs.is_empty() => println!(
            "No batched reference: it needs one prompt length, one output length and all arrivals at t = 0."
        ),
        None => {}
    }
    let measured = format!(
        "measured ITL p50: engine {:.3} ms (up to {} sequences per step){}",
        engine.stats.itl_ms(50.0),
        engine.stats.max_batch,
        refs.first()
            .map(|r| format!(
                ", candle-transformers one at a time {:.3} ms",
                r.itl_ms(50.0)
            ))
            .unwrap_or_default()
    );
    match (floor_s, bandwidth_gbs) {
        (Some(floor_s), Some(gbs)) => println!(
            "Weight-read floor of a batch-1 decode step: {:.3} GB / {gbs} GB/s = {:.4} ms ({:.0} tok/s); {measured}.",
            loaded.step_weight_bytes as f64 / 1e9,
            floor_s * 1e3,
            1.0 / floor_s,
        ),
        _ => println!(
            "No weight-read floor: the CPU's copy bandwidth is not known (--copy-bandwidth-gbs gives it); a batch-1 decode step reads {:.3} GB of weights; {measured}.",
            loaded.step_weight_bytes as f64 / 1e9,
        ),
    }

    if let Some(p) = &args.json {
        let v = json!({
            "model": loaded.description,
            "note": loaded.note,
            "path": path,
            "decode_path": engine.decode_path,
            "workload": {
                "requests": work.len(),
                "prompt": prompt_desc,
                "output": output_desc,
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "arrivals": arrivals,
                "same_prompt": args.same_prompt,
                "shared_prefix": args.shared_prefix,
                "seed": args.seed,
            },
            "engine": engine.stats.to_json(),
            "engine_counters": {
                "steps": engine.counters.steps,
                "prefill_tokens": engine.counters.prefill_tokens,
                "decode_tokens": engine.counters.decode_tokens,
                "prefix_cache_hit_tokens": engine.counters.prefix_cache_hit_tokens,
                "preemptions": engine.counters.preemptions,
                "peak_used_blocks": engine.counters.peak_used_blocks,
                "num_blocks": engine.counters.num_blocks,
                "graph_steps": engine.counters.graph_steps,
                "mixed_graph_steps": engine.counters.mixed_graph_steps,
                "graphs_captured": engine.counters.graphs_captured,
                "graph_capture_failures": engine.counters.graph_capture_failures,
                "kernels_per_graph_step": engine.counters.kernels_per_graph_step,
            },
            "references": refs.iter().map(RunStats::to_json).collect::<Vec<_>>(),
            "batched_reference_prefill": ref_prefill.map(|p| match p {
                reference::Prefill::Whole => "whole prompt".to_string(),
                reference::Prefill::PerPosition(e) => format!("one position per forward ({e})"),
            }),
            "floor": {
                "step_weight_bytes": loaded.step_weight_bytes,
                "copy_bandwidth_gbs": bandwidth_gbs,
                "batch1_decode_step_ms": floor_s.map(|f| f * 1e3),
            },
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
