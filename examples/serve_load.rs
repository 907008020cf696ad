//! A load benchmark of the OpenAI-compatible server (feature `server`):
//! the same requests through the server over loopback HTTP and through
//! the `Engine` offline, side by side.
//!
//! ```text
//! # SmolLM2 (any GGUF file or safetensors folder models::load reads):
//! cargo run --release --features server,cuda --example serve_load -- \
//!     --model PATH/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda
//! # Llama-3-8B-shaped, random bf16 weights:
//! cargo run --release --features server,cuda --example serve_load -- --random-llama --device cuda
//! # CPU smoke run:
//! cargo run --release --features server --example serve_load -- --random-llama \
//!     --layers 2 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --vocab 4096 \
//!     --concurrency 1,4 --prompt-len 32 --max-tokens 8 --poisson-requests 8 \
//!     --disconnect-requests 40 --disconnect-max-tokens 8
//! ```
//!
//! What it runs, in this order:
//! 1. Offline: for each `--concurrency` level c, `max(--requests-per-client
//!    x c, 8)` requests of `--prompt-len` random prompt tokens and
//!    `--max-tokens` new tokens (greedy, no stop token) through the
//!    `Engine`, c in flight (the next one added when one ends); then
//!    `--poisson-requests` requests arriving at `--request-rate` per second
//!    (Poisson), and the `--disconnect-requests` of the disconnect run.
//!    The engine has the server's configuration (`max_num_seqs` = the most
//!    clients of any run, at least 64; the same step budget and decode
//!    graphs), so a ratio measures the server, not a smaller engine.
//! 2. The model is dropped and loaded again behind the server
//!    (`server::Server`, decode CUDA graphs captured at start-up) on a
//!    loopback port; every request is a streamed `POST /v1/completions`
//!    with the prompt's token ids, `temperature: 0`, `ignore_eos` and
//!    `return_token_ids`, each token timed when its chunk arrives. Level c
//!    runs c clients, each sending its next request when the previous one
//!    ended; the Poisson row sends each request at its arrival time.
//! 3. The disconnect run: `--disconnect-requests` requests from
//!    `--disconnect-clients` clients, of which a seeded
//!    `--disconnect-fraction` leave after a random number of tokens. Every
//!    other request must receive exactly its `max_tokens` tokens, each
//!    client's tokens are compared with the offline engine's (lost or
//!    duplicated tokens show as a different sequence), and the KV blocks in
//!    use must return to 0 (from `/metrics`).
//!
//! Both sides use one KV cache size (`--num-blocks`, by default what the
//! largest level needs at full length), so neither preempts. The report is
//! a markdown table (`--json PATH` writes the figures): request and token
//! throughput, TTFT and ITL p50 / p99 on both sides and their ratios, and
//! how many requests got the offline engine's tokens (greedy tokens can
//! differ where two logits are within rounding of each other and the batch
//! differs, so this is reported, not required).

#[path = "serve_load/client.rs"]
mod client;
#[path = "common/flags.rs"]
mod flags;
// Shared with the throughput runner, which uses all of them.
#[allow(dead_code)]
#[path = "throughput/paged.rs"]
mod paged;
#[path = "throughput/random_llama.rs"]
mod random_llama;
#[allow(dead_code)]
#[path = "throughput/stats.rs"]
mod stats;
#[allow(dead_code)]
#[path = "throughput/workload.rs"]
mod workload;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_nn::VarBuilder;
use candle_paged_attention::engine::{CacheSizing, KvCacheSpec, SchedulerConfig};
use candle_paged_attention::models::{
    llama, load, LoadOptions, PagedKvCache, PagedModel, PagedOptions,
};
use candle_paged_attention::server::{serve, LoadedModel, ServeConfig, Server};
use candle_paged_attention::text::tokenizer::{ModelTokenizer, SpecialTokens};
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use client::{Job, Received};
use stats::{RunStats, Timeline};
use workload::{Dist, LenDist, WorkItem, WorkloadSpec};

#[derive(Parser, Debug, Clone)]
#[command(about = "Load benchmark of the OpenAI-compatible server against the offline engine")]
struct Args {
    /// A GGUF file or a safetensors folder (as models::load reads them).
    #[arg(long, conflicts_with = "random_llama")]
    model: Option<PathBuf>,
    /// A Llama with random weights of the shape flags' sizes (Llama 3 8B's
    /// by default) and a tokenizer of one token per id.
    #[arg(long)]
    random_llama: bool,
    #[arg(long, default_value_t = 32)]
    layers: usize,
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    #[arg(long, default_value_t = 14336)]
    intermediate: usize,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128256)]
    vocab: usize,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Activation dtype: auto (bf16 on CUDA, f32 on the CPU), f32, bf16 or f16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// Clients of the closed-loop levels.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// Requests per client at each level (at least 8 per level).
    #[arg(long, default_value_t = 4)]
    requests_per_client: usize,
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Requests of the Poisson row (0: no such row).
    #[arg(long, default_value_t = 128)]
    poisson_requests: usize,
    /// Arrivals per second of the Poisson row.
    #[arg(long, default_value_t = 20.0)]
    request_rate: f64,
    /// Requests of the disconnect run (0: no such run).
    #[arg(long, default_value_t = 1000)]
    disconnect_requests: usize,
    /// Share of the disconnect run's clients that leave early.
    #[arg(long, default_value_t = 0.1)]
    disconnect_fraction: f64,
    #[arg(long, default_value_t = 64)]
    disconnect_clients: usize,
    #[arg(long, default_value_t = 32)]
    disconnect_prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    disconnect_max_tokens: usize,
    /// Query tokens per engine step.
    #[arg(long, default_value_t = 512)]
    chunk_tokens: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache blocks (default: the largest level's requests at full
    /// length, plus 64).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// Capture no CUDA graph before the runs (the offline engine then runs
    /// every step eagerly).
    #[arg(long)]
    no_cuda_graph: bool,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Standard deviation of the random Llama's weights.
    #[arg(long, default_value_t = 0.02)]
    weight_std: f64,
    /// Write the figures as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One token per id: id `i` reads " t{i}", so that any id sequence decodes.
fn id_tokenizer(vocab: usize) -> Result<ModelTokenizer> {
    let words: serde_json::Map<String, Value> =
        (0..vocab).map(|i| (format!(" t{i}"), json!(i))).collect();
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": words, "unk_token": " t0"}
    });
    let tokenizer: tokenizers::Tokenizer = spec
        .to_string()
        .parse()
        .map_err(|e| anyhow::anyhow!("the id tokenizer: {e}"))?;
    Ok(ModelTokenizer {
        tokenizer,
        special: SpecialTokens {
            bos: None,
            eos: None,
            add_bos: false,
            add_eos: false,
            stop: Vec::new(),
        },
        chat_template: None,
    })
}

/// The model of the flags, its tokenizer, its name and the ids prompts are
/// drawn from.
/// A model, its tokenizer, its name and the ids prompts are drawn from.
type ModelParts = (Box<dyn PagedModel>, ModelTokenizer, String, Vec<u32>);

fn load_model(args: &Args) -> Result<ModelParts> {
    let dev = flags::device(&args.device)?;
    let dtype = flags::activation_dtype(&args.dtype, &dev)?;
    let paged = PagedOptions {
        block_size: args.block_size,
        ..PagedOptions::default()
    };
    if args.random_llama {
        let cfg = random_llama::LlamaShape {
            layers: args.layers,
            hidden: args.hidden,
            intermediate: args.intermediate,
            heads: args.heads,
            kv_heads: args.kv_heads,
            vocab: args.vocab,
        }
        .config();
        let weights = random_llama::random_weights(&cfg, args.weight_std, dtype, args.seed, &dev)?;
        let vb = VarBuilder::from_tensors(weights, dtype, &dev);
        let model = llama::Llama::load(vb, &cfg, paged)?;
        let name = format!(
            "random-llama-{}l-{}h",
            cfg.num_hidden_layers, cfg.hidden_size
        );
        return Ok((
            Box::new(model),
            id_tokenizer(cfg.vocab_size)?,
            name,
            (0..cfg.vocab_size as u32).collect(),
        ));
    }
    let Some(path) = &args.model else {
        bail!("give --model PATH or --random-llama");
    };
    let options = LoadOptions {
        paged,
        dtype,
        ..LoadOptions::default()
    };
    let loaded =
        load(path, &dev, &options).with_context(|| format!("loading {}", path.display()))?;
    let special = &loaded.tokenizer.special;
    let skip: Vec<u32> = special.stop.iter().copied().chain(special.bos).collect();
    let pool = (0..loaded.model.vocab_size() as u32)
        .filter(|id| !skip.contains(id))
        .collect();
    Ok((loaded.model, loaded.tokenizer, loaded.name, pool))
}

fn cache(model: &dyn PagedModel, num_blocks: usize) -> Result<PagedKvCache> {
    Ok(KvCacheSpec::new(CacheSizing::Blocks(num_blocks))
        .build(model)?
        .0)
}

/// One row of the report: a load through the server and the same requests
/// offline.
struct Row {
    label: String,
    server: RunStats,
    offline: RunStats,
    /// Requests whose streamed tokens equal the offline engine's.
    equal: usize,
}

/// The server's figures from what the clients received.
fn server_stats(label: &str, got: &[Received], wall: f64) -> RunStats {
    let mut t = Timeline::new(got.len());
    for (i, r) in got.iter().enumerate() {
        t.arrivals[i] = r.sent;
        t.token_times[i] = r.tokens.iter().map(|&(_, at)| at).collect();
    }
    RunStats::from_timeline(label.to_string(), &t, wall, 0)
}

fn tokens(r: &Received) -> Vec<u32> {
    r.tokens.iter().map(|&(id, _)| id).collect()
}

/// Errors when a request failed or did not get its whole answer.
fn check_complete(label: &str, got: &[Received], jobs: &[Job]) -> Result<()> {
    for (i, (r, j)) in got.iter().zip(jobs).enumerate() {
        if let Some(e) = &r.error {
            bail!("{label}: request {i} failed: {e}");
        }
        if j.leave_after.is_none()
            && (r.tokens.len() != j.item.max_tokens
                || r.completion_tokens != Some(j.item.max_tokens)
                || r.finish.as_deref() != Some("length"))
        {
            bail!(
                "{label}: request {i} received {} tokens (usage {:?}, finish {:?}) instead of {}",
                r.tokens.len(),
                r.completion_tokens,
                r.finish,
                j.item.max_tokens
            );
        }
    }
    Ok(())
}

fn spec(
    args: &Args,
    n: usize,
    prompt: usize,
    output: usize,
    rate: Option<f64>,
    seed: u64,
) -> Result<WorkloadSpec> {
    Ok(WorkloadSpec {
        num_requests: n,
        prompt: LenDist::new("--prompt-len", Dist::Fixed, prompt, None, None, 0.5)?,
        output: LenDist::new("--max-tokens", Dist::Fixed, output, None, None, 0.5)?,
        request_rate: rate,
        same_prompt: false,
        shared_prefix: 0,
        seed: seed ^ args.seed,
        draw: None,
    })
}

fn jobs(items: &[WorkItem]) -> Vec<Job> {
    items
        .iter()
        .map(|item| Job {
            item: item.clone(),
            leave_after: None,
        })
        .collect()
}

fn fmt_row(r: &Row) -> String {
    let (s, o) = (&r.server, &r.offline);
    format!(
        "| {} | {} | {:.2} | {:.1} | {:.1} | {:.3} | {:.1} / {:.1} | {:.1} / {:.1} | {:.3} / {:.3} | {:.3} / {:.3} | {:.3} | {} of {} |",
        r.label,
        s.requests,
        s.requests_per_s(),
        s.tokens_per_s(),
        o.tokens_per_s(),
        s.tokens_per_s() / o.tokens_per_s(),
        s.ttft_ms(50.0),
        s.ttft_ms(99.0),
        o.ttft_ms(50.0),
        o.ttft_ms(99.0),
        s.itl_ms(50.0),
        s.itl_ms(99.0),
        o.itl_ms(50.0),
        o.itl_ms(99.0),
        s.itl_ms(50.0) / o.itl_ms(50.0),
        r.equal,
        s.requests
    )
}

fn main() -> Result<()> {
    let args = Args::parse();
    let graphs = paged::GraphUse::from_flags(args.no_cuda_graph, false);
    let levels: Vec<usize> = args.concurrency.clone();
    if levels.is_empty() || levels.contains(&0) {
        bail!("--concurrency needs levels of at least 1 client, got {levels:?}");
    }
    if !(0.0..=1.0).contains(&args.disconnect_fraction) {
        bail!(
            "--disconnect-fraction must be in [0, 1], got {}",
            args.disconnect_fraction
        );
    }
    let max_clients = levels
        .iter()
        .copied()
        .chain([args.disconnect_clients, 64])
        .max()
        .unwrap_or(64);
    let longest = (args.prompt_len + args.max_tokens)
        .max(args.disconnect_prompt_len + args.disconnect_max_tokens);
    let num_blocks = args
        .num_blocks
        .unwrap_or(max_clients * longest.div_ceil(args.block_size) + 64);

    // --- offline -------------------------------------------------------------
    eprintln!("loading the model for the offline runs...");
    let (model, _tokenizer, name, pool) = load_model(&args)?;
    let mut level_work = Vec::new();
    for (k, &c) in levels.iter().enumerate() {
        let n = (args.requests_per_client * c).max(8);
        let w = workload::build(
            &spec(&args, n, args.prompt_len, args.max_tokens, None, k as u64)?,
            &pool,
        )?;
        level_work.push(w);
    }
    let poisson_work = if args.poisson_requests > 0 {
        let s = spec(
            &args,
            args.poisson_requests,
            args.prompt_len,
            args.max_tokens,
            Some(args.request_rate),
            100,
        )?;
        Some(workload::build(&s, &pool)?)
    } else {
        None
    };
    let disconnect_work = if args.disconnect_requests > 0 {
        let s = spec(
            &args,
            args.disconnect_requests,
            args.disconnect_prompt_len,
            args.disconnect_max_tokens,
            None,
            200,
        )?;
        Some(workload::build(&s, &pool)?)
    } else {
        None
    };
    let warmup: Vec<u32> = level_work[0][0]
        .prompt
        .iter()
        .rev()
        .take(16)
        .copied()
        .collect();
    // The offline engine is configured as the server's (same step budget,
    // same `max_num_seqs`, so the same decode graphs), and a level of c
    // clients keeps c requests in flight: the ratios then measure what the
    // server adds, not a different engine configuration.
    let scheduler = SchedulerConfig {
        max_batch_tokens: args.chunk_tokens,
        max_num_seqs: max_clients,
    };
    // One engine for every offline run, its graphs captured once.
    let mut engine = paged::start(
        model.as_ref(),
        cache(model.as_ref(), num_blocks)?,
        scheduler,
        longest,
        Some(&warmup),
        graphs,
    )?;
    let mut run_offline =
        |work: &[WorkItem], in_flight: Option<usize>| paged::run_on(&mut engine, work, in_flight);
    let mut offline = Vec::new();
    for (w, &c) in level_work.iter().zip(&levels) {
        eprintln!("offline: {} requests, {c} in flight", w.len());
        offline.push(run_offline(w, Some(c))?);
    }
    let offline_poisson = match &poisson_work {
        Some(w) => {
            eprintln!(
                "offline: {} Poisson arrivals at {}/s",
                w.len(),
                args.request_rate
            );
            Some(run_offline(w, None)?)
        }
        None => None,
    };
    let offline_disconnect = match &disconnect_work {
        Some(w) => {
            eprintln!("offline: the {} requests of the disconnect run", w.len());
            Some(run_offline(w, Some(args.disconnect_clients))?)
        }
        None => None,
    };
    let decode_path = offline
        .last()
        .map(|r| r.decode_path.clone())
        .unwrap_or_default();
    // The offline engine's caches and graphs go before the server loads.
    drop(engine);
    drop(model);

    // --- server --------------------------------------------------------------
    eprintln!("loading the model behind the server...");
    let loader_args = args.clone();
    let server = Server::start(
        move || {
            let (model, tokenizer, name, _) =
                load_model(&loader_args).map_err(|e| candle_core::Error::msg(format!("{e:#}")))?;
            let cache = cache(model.as_ref(), num_blocks)
                .map_err(|e| candle_core::Error::msg(format!("{e:#}")))?;
            Ok(LoadedModel {
                model,
                cache,
                tokenizer,
                chat_template: None,
                name,
            })
        },
        ServeConfig {
            scheduler,
            max_waiting: args
                .disconnect_requests
                .max(args.poisson_requests)
                .max(1024),
            capture_graphs_up_to: (graphs != paged::GraphUse::Off).then_some(longest),
            ..ServeConfig::default()
        },
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let url = format!("{base}/v1/completions");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(serve(listener, server, async {
            let _ = stop_rx.await;
        }));
        // Warm-up: one short request.
        let warm = Job {
            item: WorkItem {
                prompt: warmup.clone(),
                max_tokens: 2,
                arrival: Duration::ZERO,
                draw: None,
            },
            leave_after: None,
        };
        let (w, _) = client::closed_loop(&url, std::slice::from_ref(&warm), 1).await?;
        check_complete("warm-up", &w, &[warm])?;

        let mut rows = Vec::new();
        for ((work, &c), off) in level_work.iter().zip(&levels).zip(&offline) {
            eprintln!("server: {} requests from {c} clients", work.len());
            let js = jobs(work);
            let (got, wall) = client::closed_loop(&url, &js, c).await?;
            let label = format!("concurrency {c}");
            check_complete(&label, &got, &js)?;
            let equal = got.iter().zip(&off.outputs).filter(|(g, o)| tokens(g) == **o).count();
            rows.push(Row {
                server: server_stats(&label, &got, wall),
                offline: off.stats.clone(),
                label,
                equal,
            });
        }
        if let (Some(work), Some(off)) = (&poisson_work, &offline_poisson) {
            eprintln!("server: {} Poisson arrivals at {}/s", work.len(), args.request_rate);
            let js = jobs(work);
            let (got, wall) = client::open_loop(&url, &js).await?;
            let label = format!("Poisson {}/s", args.request_rate);
            check_complete(&label, &got, &js)?;
            let equal = got.iter().zip(&off.outputs).filter(|(g, o)| tokens(g) == **o).count();
            rows.push(Row {
                server: server_stats(&label, &got, wall),
                offline: off.stats.clone(),
                label,
                equal,
            });
        }
        let mut disconnect = Value::Null;
        if let (Some(work), Some(off)) = (&disconnect_work, &offline_disconnect) {
            let mut rng = StdRng::seed_from_u64(args.seed ^ 300);
            let js: Vec<Job> = work
                .iter()
                .map(|item| Job {
                    leave_after: (item.max_tokens > 1 && rng.random_bool(args.disconnect_fraction))
                        .then(|| rng.random_range(1..item.max_tokens)),
                    item: item.clone(),
                })
                .collect();
            let leaving = js.iter().filter(|j| j.leave_after.is_some()).count();
            eprintln!(
                "server: disconnect run, {} requests from {} clients, {leaving} leaving early",
                js.len(),
                args.disconnect_clients
            );
            let (got, wall) = client::closed_loop(&url, &js, args.disconnect_clients).await?;
            check_complete("disconnect run", &got, &js)?;
            let (used, took) = client::drained(&base, Duration::from_secs(10)).await?;
            // Tokens against the offline engine's: a complete answer must
            // be exactly its max_tokens tokens; a client that left must
            // have a prefix of the offline answer of the length it read.
            let mut lost_or_extra = 0usize;
            let (mut equal, mut prefix_equal) = (0usize, 0usize);
            for ((g, j), o) in got.iter().zip(&js).zip(&off.outputs) {
                let t = tokens(g);
                match j.leave_after {
                    None => {
                        lost_or_extra += t.len().abs_diff(j.item.max_tokens);
                        equal += usize::from(t == *o);
                    }
                    Some(k) => {
                        lost_or_extra += t.len().abs_diff(k);
                        prefix_equal += usize::from(o.starts_with(&t));
                    }
                }
            }
            let streamed: usize = got.iter().map(|g| g.tokens.len()).sum();
            println!(
                "\nDisconnect run: {} requests from {} clients in {wall:.2} s ({streamed} tokens streamed); {leaving} clients left early.\n\
                 - complete answers: {} of {}, {equal} equal to the offline engine's tokens\n\
                 - early leavers: {prefix_equal} of {leaving} read a prefix of the offline answer\n\
                 - tokens lost or extra against the expected counts: {lost_or_extra}\n\
                 - KV blocks in use after the run: {used} (drained in {:.0} ms)",
                js.len(),
                args.disconnect_clients,
                js.len() - leaving,
                js.len() - leaving,
                took.as_secs_f64() * 1e3
            );
            disconnect = json!({
                "requests": js.len(), "clients": args.disconnect_clients, "left_early": leaving,
                "complete_equal_to_offline": equal, "early_prefix_equal": prefix_equal,
                "tokens_lost_or_extra": lost_or_extra, "kv_blocks_used_after": used,
                "drain_ms": took.as_secs_f64() * 1e3, "wall_s": wall, "tokens_streamed": streamed,
            });
        }
        let _ = stop_tx.send(());
        serving.await??;
        anyhow::Ok((rows, disconnect))
    })?;
    let (rows, disconnect) = report;

    println!(
        "\n{name} on {}: {} + {} tokens per request (greedy, ignore_eos), KV cache {num_blocks} blocks of {}; offline decode path: {decode_path}\n",
        args.device, args.prompt_len, args.max_tokens, args.block_size
    );
    println!("| load | requests | server req/s | server tok/s | offline tok/s | ratio | server TTFT p50 / p99 ms | offline TTFT p50 / p99 ms | server ITL p50 / p99 ms | offline ITL p50 / p99 ms | ITL p50 ratio | tokens equal to offline |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!("{}", fmt_row(r));
    }
    if let Some(path) = &args.json {
        let out = json!({
            "model": name,
            "device": args.device,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "num_blocks": num_blocks,
            "decode_path": decode_path,
            "rows": rows.iter().map(|r| json!({
                "load": r.label, "server": r.server.to_json(), "offline": r.offline.to_json(),
                "equal_to_offline": r.equal,
            })).collect::<Vec<_>>(),
            "disconnect": disconnect,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
