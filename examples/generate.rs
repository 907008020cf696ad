//! Text generation with the paged models and continuous batching.
//!
//! ```text
//! cargo run --release --features models --example generate -- --prompt "What is 2 + 2?"
//! cargo run --release --features models --example generate -- model.gguf --prompt a --prompt b
//! cargo run --release --features models --example generate -- ./gemma-3-1b-it --prompts-file prompts.txt
//! ```
//!
//! Without a model path, SmolLM2-135M-Instruct is fetched by
//! `scripts/fetch-smollm2.sh`; `gemma3-270m` in its place fetches Gemma 3
//! 270M through `scripts/fetch-gemma3.sh` (the scripts are found beside the
//! executable, in `$CANDLE_PAGED_ATTENTION_SCRIPTS`, or in the crate's
//! source). With the `hub` feature, `--model-id ORG/NAME [--revision REV]`
//! downloads a GGUF file or a safetensors checkpoint from the Hugging Face
//! hub instead (`--model-file` picks among several GGUF files; with
//! `HF_HUB_OFFLINE=1`, from the hub cache only). One prompt streams its tokens;
//! several run through the continuous-batching engine (on a terminal, a
//! progress bar shows the prompts done and the tokens/s) and print each
//! output and the
//! aggregate throughput.
//!
//! Prompts go through the checkpoint's chat template (GGUF
//! `tokenizer.chat_template`, or a directory's `tokenizer_config.json`),
//! rendered with `minijinja`, with `--system` as the system message; the
//! text of the prompt is encoded as plain text, so control-token markers it
//! writes (`<|im_start|>`, `<start_of_turn>`) never become control tokens.
//! `--raw` sends a prompt as written, markers included (the way to send an
//! already templated prompt), with BOS when the checkpoint asks for it; a
//! checkpoint without a template sends prompts raw too, unless
//! `--chat-template FILE` gives one.
//!
//! The KV cache takes `--num-blocks` blocks per layer, or what fits in
//! `--kv-memory-mb`; by default, on CUDA, what `--gpu-memory-utilization`
//! (0.9) of the device memory leaves after the weights and a profiled
//! forward pass of `--chunk-tokens` tokens, and 256 MiB on the CPU.
//!
//! Flags are checked before anything is loaded or allocated, and every
//! error names its flag. A prompt that cannot run (longer than the model's
//! context, say) prints its error in place of its answer while the others
//! complete; the exit status is then non-zero.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::Device;
use candle_paged_attention::engine::{
    CacheSizing, Completion, Engine, EngineBuilder, EngineStats, FinishReason, KvCacheSpec,
    Request, SamplingParams, SchedulerConfig, DEFAULT_CPU_KV_BYTES,
};
use candle_paged_attention::models::registry::{Dequantize, LoadOptions};
use candle_paged_attention::models::{self, PagedModel, PagedOptions};
use candle_paged_attention::text::chat::{self, ChatMessage, ChatTemplate};
use candle_paged_attention::text::fetch::fetch_model;
#[cfg(feature = "hub")]
use candle_paged_attention::text::hub::{self, CheckpointFiles};
use candle_paged_attention::text::tokenizer::{self, ModelTokenizer, TextStream};
use clap::Parser;

#[path = "common/flags.rs"]
mod flags;
use flags::{activation_dtype, kv_cache_dtype};

#[derive(Parser, Debug)]
#[command(about = "Generate text with paged Llama / Gemma models and continuous batching")]
pub struct Args {
    /// A GGUF file (quantized Llama or Gemma 3), a directory with
    /// config.json, *.safetensors and tokenizer.json (Llama, Gemma 2, Gemma
    /// 3), or `gemma3-270m` (Gemma 3 270M, fetched by
    /// scripts/fetch-gemma3.sh). Default: SmolLM2-135M-Instruct, fetched by
    /// scripts/fetch-smollm2.sh.
    model: Option<PathBuf>,
    /// A Hugging Face hub model (ORG/NAME) to download in place of a model
    /// path: its GGUF file, or its safetensors checkpoint (config.json,
    /// tokenizer files and weights). Needs the `hub` feature.
    #[arg(long, conflicts_with = "model")]
    model_id: Option<String>,
    /// The revision of --model-id: a branch, tag or commit.
    #[arg(long, default_value = "main", requires = "model_id")]
    revision: String,
    /// The GGUF file of --model-id to load, when it has several.
    #[arg(long, requires = "model_id")]
    model_file: Option<String>,
    /// A prompt; repeat for several (they run as one continuous batch).
    #[arg(long)]
    prompt: Vec<String>,
    /// A file with one prompt per line (blank lines are skipped; a file with
    /// no prompt is an error).
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Send prompts as they are, without the chat template: control-token
    /// markers they write (`<|im_start|>`) are control tokens, and BOS is
    /// added when the checkpoint asks for it. The way to send an already
    /// templated prompt.
    #[arg(long)]
    raw: bool,
    /// A system message, before each prompt in the chat template.
    #[arg(long)]
    system: Option<String>,
    /// A Jinja chat template file to use instead of the checkpoint's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Echo each full prompt (chat template included) and its token count;
    /// otherwise prompts longer than 100 characters are shortened.
    #[arg(long)]
    verbose: bool,
    /// New tokens per prompt at most.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling threshold (with a temperature).
    #[arg(long)]
    top_p: Option<f64>,
    /// Sample among the k most likely tokens only (with a temperature).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep only tokens at least this fraction as likely as the most likely
    /// one (with a temperature), in [0, 1].
    #[arg(long)]
    min_p: Option<f64>,
    /// Subtracted from a token's logit per time it was generated before.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Subtracted from the logit of every token generated before.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Penalty of the tokens among the last --repeat-last-n ones (prompt
    /// included): positive logits are divided by it, negative ones
    /// multiplied; 1 is off. Applies to greedy decoding too.
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the repeat penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Random seed (prompt i uses seed + i).
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// cpu or cuda (cuda needs --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Activation dtype: auto (f32 on the CPU, bf16 on CUDA), f32, bf16 or
    /// f16. GGUF Llama models take bf16/f16 on CUDA only (or with
    /// --dequantize); GGUF Gemma 3 takes bf16 (its residual stream
    /// overflows f16), on the CPU too, and runs dequantized in f32 only.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// KV cache blocks per layer (overrides --kv-memory-mb and
    /// --gpu-memory-utilization).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// KV cache budget in MiB, over all layers (overrides
    /// --gpu-memory-utilization). Default: 256 on the CPU; on CUDA what
    /// --gpu-memory-utilization leaves.
    #[arg(long)]
    kv_memory_mb: Option<usize>,
    /// On CUDA, the fraction of the device memory the process may use: the
    /// KV cache takes what is left of it after the weights and a profiled
    /// forward pass of --chunk-tokens tokens (default 0.9). Ignored, with a
    /// note, on the CPU and when --num-blocks or --kv-memory-mb is given.
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// Give sliding-window layers (Gemma) their own caches of N blocks,
    /// recycling blocks that fell out of the window.
    #[arg(long)]
    window_blocks: Option<usize>,
    /// Share cached prompt blocks between sequences with a common prefix.
    #[arg(long)]
    prefix_caching: bool,
    /// Run every decode step eagerly instead of replaying CUDA graphs (CUDA only).
    #[arg(long)]
    no_cuda_graph: bool,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache element type: auto (the model's) or fp8 (F8E4M3 with
    /// scales 1, half the memory of bf16).
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: String,
    /// Token budget of one step: prompts are prefilled in chunks that fit it.
    #[arg(long, default_value_t = 256)]
    chunk_tokens: usize,
    /// Sequences running at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Dequantize GGUF weights to f32 at load time (dense matmuls). On the
    /// CPU, Q4_0/Q4_1 weights are dequantized by default when the f32
    /// weights fit in half the memory available.
    #[arg(long)]
    dequantize: bool,
    /// Keep Q4_0/Q4_1 GGUF weights quantized on the CPU.
    #[arg(long, conflicts_with = "dequantize")]
    keep_quantized: bool,
    /// A tokenizer.json to use instead of the model's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

/// A loaded checkpoint and the chat template the prompts go through.
struct Loaded {
    model: Box<dyn PagedModel>,
    tokenizer: ModelTokenizer,
    /// The chat template (`--chat-template` or the checkpoint's), if any.
    template: Option<ChatTemplate>,
    name: String,
}

/// Downloads `--model-id` (files in the hub cache are reused) and returns
/// the GGUF file or safetensors directory to load.
#[cfg(feature = "hub")]
fn hub_model(args: &Args, id: &str) -> Result<PathBuf> {
    let files = hub::download(id, &args.revision, args.model_file.as_deref())
        .with_context(|| format!("--model-id {id} --revision {}", args.revision))?;
    Ok(match files {
        CheckpointFiles::Gguf(p) => p,
        CheckpointFiles::Safetensors(s) => s.dir,
    })
}

/// `--model-id` without the `hub` feature: an error (check_flags reports it
/// before anything is loaded).
#[cfg(not(feature = "hub"))]
fn hub_model(_args: &Args, id: &str) -> Result<PathBuf> {
    bail!("{}", no_hub_error(id))
}

/// The error of `--model-id` in a build without the `hub` feature.
#[cfg(not(feature = "hub"))]
fn no_hub_error(id: &str) -> String {
    format!(
        "--model-id {id}: downloading from the Hugging Face hub needs the `hub` feature (cargo run --release --features models,hub --example generate -- --model-id {id}); without it, give a model path or run scripts/fetch-smollm2.sh"
    )
}

/// Loads the checkpoint at `path` through the library's registry
/// ([`models::load`]) with the runner's flags, printing its notes; the chat
/// template of `--chat-template` or the checkpoint.
fn load(path: &Path, args: &Args, dev: &Device, opts: PagedOptions) -> Result<Loaded> {
    let options = LoadOptions {
        paged: opts,
        dtype: activation_dtype(&args.dtype, dev)?,
        dequantize: match (args.dequantize, args.keep_quantized) {
            (true, _) => Dequantize::Always,
            (false, true) => Dequantize::Never,
            (false, false) => Dequantize::Auto,
        },
        tokenizer: args.tokenizer.clone(),
    };
    let loaded = models::load(path, dev, &options)?;
    for note in &loaded.notes {
        eprintln!("note: {note}{}", flag_hint(note));
    }
    let source = match &args.chat_template {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("--chat-template: reading {}", p.display()))?,
        ),
        None => None,
    };
    let template = loaded
        .chat_template(source.as_deref())
        .context("the chat template (--chat-template or the checkpoint's)")?;
    Ok(Loaded {
        model: loaded.model,
        tokenizer: loaded.tokenizer,
        template,
        name: loaded.name,
    })
}

/// The runner flag that reverses a dequantization note.
fn flag_hint(note: &str) -> &'static str {
    if note.starts_with("dequantizing") {
        " (--keep-quantized keeps them)"
    } else {
        ""
    }
}

/// Whether the GGUF weights are dequantized to f32 at load time, and a note
/// saying why when it was not asked for: with `--dequantize`; by default on
/// the CPU when the file has Q4_0 or Q4_1 weights and the f32 weights take
/// at most half the memory available ([`models::registry::auto_dequantize`]),
/// unless `--keep-quantized`.
pub fn dequantize_gguf(
    ct: &gguf_file::Content,
    args: &Args,
    dev: &Device,
) -> (bool, Option<String>) {
    if args.dequantize {
        return (true, None);
    }
    if args.keep_quantized {
        return (false, None);
    }
    let (yes, note) = models::registry::auto_dequantize(ct, dev);
    (yes, note.map(|n| format!("{n}{}", flag_hint(&n))))
}

/// A prompt's token ids and its full text: through the chat template
/// (`--system` first), the prompt's text encoded as plain text; or, with
/// `--raw` or without a template, as written with BOS as the checkpoint
/// asks.
fn encode_prompt(
    tok: &mut ModelTokenizer,
    template: Option<&ChatTemplate>,
    args: &Args,
    prompt: &str,
) -> Result<(Vec<u32>, String)> {
    let template = match (template, args.raw) {
        (Some(t), false) => t,
        _ => return Ok((tok.encode_raw(prompt)?, prompt.to_string())),
    };
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage::new("system", system));
    }
    messages.push(ChatMessage::new("user", prompt));
    let segments = template.render_segments(&messages, true)?;
    let ids = tok.encode_segments(&segments)?;
    Ok((ids, chat::segments_text(&segments)))
}

/// `prompt` for echoing: whole with `--verbose` or when short, else its
/// first 100 characters.
fn echo(prompt: &str, verbose: bool) -> String {
    const SHOWN: usize = 100;
    let n = prompt.chars().count();
    if verbose || n <= SHOWN {
        return prompt.to_string();
    }
    let head: String = prompt.chars().take(SHOWN).collect();
    format!("{head}... ({n} characters; --verbose shows them all)")
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> Result<()> {
    run(Args::parse(), &mut std::io::stdout())
}

/// The prompts of `--prompt` and `--prompts-file`, or the default prompt
/// when neither is given.
fn read_prompts(args: &Args) -> Result<Vec<String>> {
    let mut prompts = args.prompt.clone();
    if let Some(f) = &args.prompts_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("--prompts-file: reading {}", f.display()))?;
        let before = prompts.len();
        prompts.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
        if prompts.len() == before {
            bail!(
                "--prompts-file {} holds no prompt (the file is empty or blank)",
                f.display()
            );
        }
    }
    if prompts.is_empty() {
        prompts.push("What is the capital of France? Answer in one sentence.".to_string());
    }
    Ok(prompts)
}

/// `--gpu-memory-utilization`, or its default.
fn gpu_memory_utilization(args: &Args) -> f64 {
    args.gpu_memory_utilization
        .unwrap_or(candle_paged_attention::engine::DEFAULT_GPU_MEMORY_UTILIZATION)
}

/// A note when `--gpu-memory-utilization` is given where it sizes nothing:
/// on the CPU, or beside `--num-blocks` or `--kv-memory-mb`.
pub fn unused_utilization_note(args: &Args, dev: &Device) -> Option<String> {
    let u = args.gpu_memory_utilization?;
    if dev.is_cpu() {
        return Some(format!(
            "note: --gpu-memory-utilization {u} is ignored on the CPU (the cache is sized by --num-blocks or --kv-memory-mb, 256 MiB by default)"
        ));
    }
    (args.num_blocks.is_some() || args.kv_memory_mb.is_some()).then(|| {
        format!("note: --gpu-memory-utilization {u} is ignored: --num-blocks or --kv-memory-mb sizes the cache")
    })
}

/// Checks the flags that need no model, before anything is loaded.
fn check_flags(args: &Args, num_prompts: usize) -> Result<()> {
    let positive = [
        ("--max-tokens", args.max_tokens),
        ("--chunk-tokens", args.chunk_tokens),
        ("--max-num-seqs", args.max_num_seqs),
        ("--block-size", args.block_size),
        ("--num-blocks", args.num_blocks.unwrap_or(1)),
        ("--window-blocks", args.window_blocks.unwrap_or(1)),
        ("--kv-memory-mb", args.kv_memory_mb.unwrap_or(1)),
    ];
    for (flag, value) in positive {
        if value == 0 {
            bail!("{flag} must be at least 1, got 0");
        }
    }
    if let Some(mb) = args.kv_memory_mb {
        if mb.checked_mul(1 << 20).is_none() {
            bail!("--kv-memory-mb {mb} is too large: its bytes overflow usize");
        }
    }
    let u = gpu_memory_utilization(args);
    if !(u > 0.0 && u <= 1.0) {
        bail!("--gpu-memory-utilization must be in (0, 1], got {u}");
    }
    if !args.temperature.is_finite() {
        bail!("--temperature must be finite, got {}", args.temperature);
    }
    let top_p = SamplingParams {
        top_p: args.top_p,
        ..SamplingParams::greedy(1)
    };
    top_p.validate().context("--top-p")?;
    let top_k = SamplingParams {
        top_k: args.top_k,
        ..SamplingParams::greedy(1)
    };
    top_k.validate().context("--top-k")?;
    let penalty = SamplingParams {
        repeat_penalty: args.repeat_penalty,
        ..SamplingParams::greedy(1)
    };
    penalty.validate().context("--repeat-penalty")?;
    let rest = SamplingParams {
        min_p: args.min_p,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        ..SamplingParams::greedy(1)
    };
    rest.validate()
        .context("--min-p, --frequency-penalty or --presence-penalty")?;
    kv_cache_dtype(&args.kv_cache_dtype)?;
    if let Some(p) = &args.chat_template {
        // Read and compiled now (with empty BOS and EOS texts), so that a
        // folder, an unreadable file or a syntax error is reported before
        // the model loads.
        let source = std::fs::read_to_string(p)
            .with_context(|| format!("--chat-template: reading {}", p.display()))?;
        ChatTemplate::new(&source, "", "")
            .with_context(|| format!("--chat-template {}", p.display()))?;
    }
    if args.raw && args.system.is_some() {
        bail!(
            "--system cannot be combined with --raw (a raw prompt goes without the chat template)"
        );
    }
    if args.seed.checked_add(num_prompts as u64 - 1).is_none() {
        bail!(
            "--seed {}: prompt i uses seed + i, which overflows u64 for {num_prompts} prompts",
            args.seed
        );
    }
    #[cfg(not(feature = "hub"))]
    if let Some(id) = &args.model_id {
        bail!("{}", no_hub_error(id));
    }
    if args.window_blocks.is_some() && args.prefix_caching {
        bail!("--prefix-caching cannot be combined with --window-blocks");
    }
    Ok(())
}

/// The cache of `--num-blocks`, `--kv-memory-mb` or, by default,
/// `--gpu-memory-utilization` on CUDA (256 MiB on the CPU), with
/// `--window-blocks` and `--prefix-caching`, and the flag it was sized by.
fn cache_spec(args: &Args, dev: &Device) -> (KvCacheSpec, String) {
    let (sizing, flag) = match (args.num_blocks, args.kv_memory_mb) {
        (Some(n), _) => (CacheSizing::Blocks(n), format!("--num-blocks {n}")),
        // checked in check_flags
        (None, Some(mb)) => (CacheSizing::Bytes(mb << 20), format!("--kv-memory-mb {mb}")),
        (None, None) if dev.is_cpu() => (
            CacheSizing::Bytes(DEFAULT_CPU_KV_BYTES),
            format!("--kv-memory-mb {}", DEFAULT_CPU_KV_BYTES >> 20),
        ),
        (None, None) => (
            CacheSizing::Device {
                utilization: gpu_memory_utilization(args),
                max_batch_tokens: args.chunk_tokens,
                max_num_seqs: args.max_num_seqs,
            },
            format!(
                "--gpu-memory-utilization {} (with --chunk-tokens {})",
                gpu_memory_utilization(args),
                args.chunk_tokens
            ),
        ),
    };
    let spec = KvCacheSpec {
        sizing,
        window_blocks: args.window_blocks,
        prefix_caching: args.prefix_caching,
    };
    (spec, flag)
}

/// What became of one prompt.
enum Outcome {
    /// `add_request` refused it (or it could not be tokenized).
    Refused(String),
    /// It ran: its completion.
    Done(Completion),
    /// It had not finished when the engine failed.
    Unfinished,
}

/// Parses nothing, prints to `out`: the runner behind `main`, given its flags.
pub fn run(args: Args, out: &mut dyn Write) -> Result<()> {
    let prompts = read_prompts(&args)?;
    check_flags(&args, prompts.len())?;
    let dev = flags::device(&args.device)?;
    if let Some(note) = unused_utilization_note(&args, &dev) {
        eprintln!("{note}");
    }
    let path = match (&args.model, &args.model_id) {
        (_, Some(id)) => hub_model(&args, id)?,
        (Some(p), None) if p.as_os_str() == "gemma3-270m" && !p.exists() => {
            fetch_model("fetch-gemma3.sh")?
        }
        (Some(p), None) => p.clone(),
        (None, None) => fetch_model("fetch-smollm2.sh")?,
    };
    let opts = PagedOptions {
        block_size: args.block_size,
        kv_cache_dtype: kv_cache_dtype(&args.kv_cache_dtype)?,
    };
    let start = Instant::now();
    let mut loaded = load(&path, &args, &dev, opts)?;
    if loaded.template.is_none() {
        if args.system.is_some() {
            bail!(
                "--system needs a chat template, and {} has none (pass --chat-template FILE)",
                loaded.name
            );
        }
        if !args.raw {
            eprintln!(
                "note: {} has no chat template: prompts are sent as written (--chat-template FILE gives one)",
                loaded.name
            );
        }
    }
    let model = loaded.model.as_ref();
    let (spec, sized_by) = cache_spec(&args, &dev);
    let (mut engine, plan) = EngineBuilder::new(model)
        .cache(spec)
        .scheduler(SchedulerConfig {
            max_batch_tokens: args.chunk_tokens,
            max_num_seqs: args.max_num_seqs,
        })
        .cuda_graphs(!args.no_cuda_graph)
        .build()
        .with_context(|| format!("{sized_by}, --block-size {}", args.block_size))?;
    let kv_bytes = engine.cache().memory_bytes();
    eprintln!(
        "model {} loaded in {:.2?} on {:?}; context {} tokens; KV cache: {} layers x {} blocks of {} tokens = {:.1} MiB ({}), sized by {sized_by}",
        loaded.name,
        start.elapsed(),
        dev,
        model.max_seq_len(),
        model.attention_layers().len(),
        plan.num_blocks,
        args.block_size,
        mib(kv_bytes),
        args.kv_cache_dtype
    );
    if let Some(p) = plan.profile {
        eprintln!(
            "device memory: {:.1} MiB in all, {:.1} MiB free after the weights, a profiled step of {} tokens peaked at {:.1} MiB; KV budget {:.1} MiB",
            mib(p.total_bytes),
            mib(p.free_bytes),
            args.chunk_tokens,
            mib(p.activation_peak_bytes),
            mib(plan.budget_bytes.unwrap_or(0))
        );
    }
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(prompts.len());
    let mut prompt_tokens = 0;
    let markers = loaded.tokenizer.special_texts();
    let stop_tokens = loaded.tokenizer.special.stop.clone();
    for (i, p) in prompts.iter().enumerate() {
        if loaded.template.is_some() && !args.raw {
            if let Some(m) = markers.iter().find(|m| p.contains(m.as_str())) {
                eprintln!("note: prompt {i} writes the control token {m}; inside the chat template it is encoded as plain text (--raw sends a templated prompt as written)");
            }
        }
        let added = encode_prompt(&mut loaded.tokenizer, loaded.template.as_ref(), &args, p)
            .and_then(|(ids, text)| {
                let n = ids.len();
                if args.verbose {
                    writeln!(out, "[prompt {i}: {n} tokens]\n{text}")?;
                }
                engine
                    .add_request(Request {
                        id: i as u64,
                        prompt: ids,
                        params: SamplingParams {
                            temperature: args.temperature,
                            top_k: args.top_k,
                            top_p: args.top_p,
                            min_p: args.min_p,
                            repeat_penalty: args.repeat_penalty,
                            repeat_last_n: args.repeat_last_n,
                            frequency_penalty: args.frequency_penalty,
                            presence_penalty: args.presence_penalty,
                            // check_flags made sure seed + i fits.
                            seed: args.seed.wrapping_add(i as u64),
                            max_tokens: args.max_tokens,
                            stop_tokens: stop_tokens.clone(),
                        },
                    })
                    .map(|()| n)
                    .map_err(anyhow::Error::from)
            });
        outcomes.push(match added {
            Ok(n) => {
                prompt_tokens += n;
                Outcome::Unfinished
            }
            Err(e) => Outcome::Refused(format!("prompt {i}: {e}")),
        });
    }
    let start = Instant::now();
    let tok = &loaded.tokenizer.tokenizer;
    // A decoding error of the streamed prompt: it fails like any other.
    let mut stream_error = None;
    let result = if prompts.len() == 1 {
        writeln!(out, "> {}", echo(&prompts[0], args.verbose))?;
        let mut stream = TextStream::new();
        let mut err = None;
        let done = engine.run(|ev| {
            if stop_tokens.contains(&ev.token) || err.is_some() {
                return;
            }
            match stream.push(tok, ev.token) {
                Ok(Some(text)) => {
                    let _ = write!(out, "{text}").and_then(|()| out.flush());
                }
                Ok(None) => {}
                Err(e) => err = Some(e),
            }
        });
        if err.is_none() {
            match stream.finish(tok) {
                Ok(Some(text)) => write!(out, "{text}")?,
                Ok(None) => {}
                Err(e) => err = Some(e),
            }
        }
        writeln!(out)?;
        stream_error = err.map(|e| format!("prompt 0: decoding its text failed: {e}"));
        done
    } else {
        // Per-prompt progress on stderr (drawn only on a terminal): prompts
        // done, tokens generated, tokens/s.
        let bar = indicatif::ProgressBar::new(prompts.len() as u64);
        bar.set_style(indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} prompts done, {msg} [{elapsed}]",
        )?);
        let mut generated = 0usize;
        let done = engine.run(|ev| {
            generated += 1;
            if ev.finished.is_some() {
                bar.inc(1);
            }
            if generated.is_multiple_of(16) || ev.finished.is_some() {
                let secs = start.elapsed().as_secs_f64().max(1e-9);
                bar.set_message(format!(
                    "{generated} tokens, {:.1} tokens/s",
                    generated as f64 / secs
                ));
            }
        });
        bar.finish_and_clear();
        done
    };
    let (completions, failure) = match result {
        Ok(done) => (done, None),
        Err(e) => (engine.take_completions(), Some(e)),
    };
    for c in &completions {
        let i = c.id as usize;
        if let Some(slot) = outcomes.get_mut(i) {
            *slot = Outcome::Done(c.clone());
        }
    }
    let mut failed = 0;
    for (i, outcome) in outcomes.iter().enumerate() {
        let error = match outcome {
            Outcome::Refused(e) => Some(e.clone()),
            Outcome::Done(c) => c
                .error()
                .map(|e| format!("prompt {i}: {e}"))
                .or_else(|| stream_error.clone()),
            Outcome::Unfinished => Some(format!("prompt {i}: unfinished when generation failed")),
        };
        if prompts.len() > 1 {
            writeln!(out, "--- [{i}] {}", echo(&prompts[i], args.verbose))?;
            if let Outcome::Done(c) = outcome {
                match tokenizer::decode(tok, &c.tokens) {
                    Ok(text) => writeln!(out, "{}", text.trim())?,
                    Err(e) => {
                        // Counted below, with the prompt's other error if any.
                        failed += usize::from(error.is_none());
                        writeln!(out, "error: prompt {i}: decoding its text failed: {e}")?;
                    }
                }
            }
        }
        if let Some(e) = &error {
            failed += 1;
            writeln!(out, "error: {e}")?;
        }
        if prompts.len() > 1 {
            writeln!(out)?;
        }
    }
    report(
        &completions,
        start.elapsed(),
        prompt_tokens,
        kv_bytes,
        &engine.stats(),
        args.prefix_caching,
    );
    eprintln!("{}", decode_path(&engine));
    if let Some(e) = failure {
        return Err(anyhow::Error::from(e).context(format!(
            "generation failed after {} of {} prompts finished (their outputs are printed above)",
            completions.len(),
            prompts.len()
        )));
    }
    if failed > 0 {
        bail!(
            "{failed} of {} prompts failed (see their errors above)",
            prompts.len()
        );
    }
    Ok(())
}

/// Which path the decode steps took, for the summary.
fn decode_path<M: PagedModel + ?Sized>(engine: &Engine<'_, M>) -> String {
    let stats = engine.stats();
    if !engine.uses_cuda_graphs() {
        return "decode path: eager (CUDA graphs need a CUDA device; off with --no-cuda-graph)"
            .into();
    }
    let mut line = format!(
        "decode path: CUDA graphs, {} of {} steps replayed ({} of them with prefills; {} graphs captured, {} kernels per decode step)",
        stats.graph_steps,
        stats.steps,
        stats.mixed_graph_steps,
        stats.graphs_captured,
        stats.kernels_per_graph_step
    );
    if let Some(e) = engine.cuda_graph_error() {
        line += &format!(
            "; {} captures failed, those shapes ran eagerly: {e}",
            stats.graph_capture_failures
        );
    }
    line
}

fn report(
    done: &[Completion],
    wall: Duration,
    prompt_tokens: usize,
    kv_bytes: usize,
    stats: &EngineStats,
    prefix_caching: bool,
) {
    let steps = stats.steps;
    let generated: usize = done.iter().map(|c| c.tokens.len()).sum();
    let ttft: Vec<f64> = done
        .iter()
        .filter(|c| !c.tokens.is_empty())
        .map(|c| c.time_to_first_token.as_secs_f64())
        .collect();
    let mean_ttft = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
    let max_ttft = ttft.iter().cloned().fold(0.0, f64::max);
    let preempted: usize = done.iter().map(|c| c.preemptions).sum();
    let errors = done
        .iter()
        .filter(|c| matches!(c.finish, FinishReason::Error(_)))
        .count();
    eprintln!(
        "{} sequences ({errors} with errors), {prompt_tokens} prompt tokens, {generated} generated tokens in {:.2}s ({steps} steps): {:.1} tokens/s generated, {:.1} tokens/s processed",
        done.len(),
        wall.as_secs_f64(),
        generated as f64 / wall.as_secs_f64(),
        (generated + prompt_tokens) as f64 / wall.as_secs_f64(),
    );
    eprintln!(
        "time to first token: mean {:.3}s, max {:.3}s; KV cache {:.1} MiB, peak {} of {} blocks in use; preemptions {preempted}",
        mean_ttft,
        max_ttft,
        mib(kv_bytes),
        stats.peak_used_blocks,
        stats.num_blocks
    );
    let hits = stats.prefix_cache_hit_tokens;
    if prefix_caching {
        eprintln!(
            "prefix cache: {hits} prompt tokens reused, {} computed ({:.1}% of the prompt tokens reused)",
            stats.prefill_tokens,
            100.0 * hits as f64 / (hits + stats.prefill_tokens).max(1) as f64
        );
    } else {
        eprintln!(
            "prompt tokens computed: {} (prefix caching off)",
            stats.prefill_tokens
        );
    }
}
