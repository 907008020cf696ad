//! An OpenAI-compatible HTTP server over a paged model (feature `server`).
//!
//! ```text
//! cargo run --release --features server --example serve -- MODEL [--port 8000]
//! curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
//! ```
//!
//! MODEL is a GGUF file or a safetensors checkpoint folder, as
//! `models::load` reads them. Ctrl-C (or SIGTERM) stops accepting
//! connections and gives running requests `--shutdown-timeout-secs` to end.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_paged_attention::engine::{
    CacheSizing, KvCacheSpec, SchedulerConfig, DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION,
};
use candle_paged_attention::models::{load, LoadOptions, PagedOptions};
use candle_paged_attention::server::{serve, LoadedModel, ServeConfig, Server};
use clap::Parser;

#[path = "common/flags.rs"]
mod flags;

#[derive(Parser, Debug)]
#[command(about = "Serve a paged model over an OpenAI-compatible HTTP API")]
struct Args {
    /// A GGUF file, or a folder with config.json, *.safetensors and
    /// tokenizer.json.
    model: PathBuf,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The name clients give as `model` (default: the checkpoint's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests waiting to run at most; more are answered 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Sequences running at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Query tokens per engine step (prompts are prefilled in chunks).
    #[arg(long, default_value_t = 512)]
    chunk_tokens: usize,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache blocks per layer (default: what the memory allows).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// Share the KV blocks of common prompt prefixes between requests.
    #[arg(long)]
    prefix_caching: bool,
    /// cpu or cuda (device 0), or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Activation dtype: auto (bf16 on CUDA, f32 on the CPU), f32, bf16, f16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// On CUDA without --num-blocks: the fraction of device memory to use.
    #[arg(long, default_value_t = DEFAULT_GPU_MEMORY_UTILIZATION)]
    gpu_memory_utilization: f64,
    /// A Jinja chat template file in place of the checkpoint's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// A tokenizer.json in place of the checkpoint's tokenizer.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// New tokens when a request gives no max_tokens (default: what the
    /// context leaves).
    #[arg(long)]
    default_max_tokens: Option<usize>,
    /// Request bodies larger than this many bytes are answered 413.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// On CUDA: the step graphs (decode steps and steps with prefills) are
    /// captured at start-up for sequences of up to this many tokens (longer
    /// ones capture theirs on first use).
    #[arg(long, default_value_t = 4096)]
    cuda_graph_context: usize,
    /// On CUDA: capture each step graph on its first step instead.
    #[arg(long)]
    lazy_cuda_graphs: bool,
    /// Seconds running requests get to finish after Ctrl-C.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout_secs: u64,
}

/// Loads the checkpoint and sizes its KV cache (on the engine thread).
fn load_model(args: &Args) -> Result<LoadedModel> {
    let dev = flags::device(&args.device)?;
    let dtype = flags::activation_dtype(&args.dtype, &dev)?;
    let template_source = match &args.chat_template {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("--chat-template {}", p.display()))?,
        ),
        None => None,
    };
    let options = LoadOptions {
        paged: PagedOptions {
            block_size: args.block_size,
            ..PagedOptions::default()
        },
        dtype,
        tokenizer: args.tokenizer.clone(),
        ..LoadOptions::default()
    };
    eprintln!("loading {} on {dev:?} ({dtype:?})...", args.model.display());
    let start = Instant::now();
    let loaded = load(&args.model, &dev, &options)
        .with_context(|| format!("loading {}", args.model.display()))?;
    for note in &loaded.notes {
        eprintln!("note: {note}");
    }
    let chat_template = loaded
        .chat_template(template_source.as_deref())
        .context("compiling the chat template")?;
    if chat_template.is_none() {
        eprintln!(
            "note: {} has no chat template: /v1/chat/completions answers 400 (--chat-template FILE gives one)",
            loaded.name
        );
    }
    eprintln!(
        "loaded {} ({}) in {:.2?}; context {} tokens",
        loaded.name,
        loaded.architecture.name,
        start.elapsed(),
        loaded.model.max_seq_len()
    );
    let model = loaded.model;
    let sizing = match args.num_blocks {
        Some(n) => CacheSizing::Blocks(n),
        None if dev.is_cpu() => CacheSizing::Bytes(DEFAULT_CPU_KV_BYTES),
        None => CacheSizing::Device {
            utilization: args.gpu_memory_utilization,
            max_batch_tokens: args.chunk_tokens,
            max_num_seqs: args.max_num_seqs,
        },
    };
    let spec = KvCacheSpec {
        prefix_caching: args.prefix_caching,
        ..KvCacheSpec::new(sizing)
    };
    let (cache, plan) = spec
        .build(model.as_ref())
        .with_context(|| format!("sizing and allocating the KV cache ({sizing:?})"))?;
    eprintln!(
        "KV cache: {} blocks of {} tokens ({:.1} MiB)",
        plan.num_blocks,
        args.block_size,
        cache.memory_bytes() as f64 / (1 << 20) as f64
    );
    Ok(LoadedModel {
        model,
        cache,
        tokenizer: loaded.tokenizer,
        chat_template,
        name: args.served_model_name.clone().unwrap_or(loaded.name),
    })
}

/// Resolves on Ctrl-C or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    eprintln!("shutting down: no new connections; waiting for running requests");
}

fn main() -> Result<()> {
    let args = Args::parse();
    let config = ServeConfig {
        scheduler: SchedulerConfig {
            max_batch_tokens: args.chunk_tokens,
            max_num_seqs: args.max_num_seqs,
        },
        max_waiting: args.max_waiting,
        max_body_bytes: args.max_body_bytes,
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout_secs),
        default_max_tokens: args.default_max_tokens,
        capture_graphs_up_to: (!args.lazy_cuda_graphs).then_some(args.cuda_graph_context),
        ..ServeConfig::default()
    };
    let addr = format!("{}:{}", args.host, args.port);
    let server = Server::start(
        move || load_model(&args).map_err(candle_core::Error::wrap),
        config,
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        eprintln!(
            "serving {} on http://{addr} (POST /v1/chat/completions, /v1/completions; GET /v1/models, /health, /metrics)",
            server.model_name()
        );
        serve(listener, server, shutdown_signal())
            .await
            .context("serving")?;
        eprintln!("stopped");
        Ok(())
    })
}
