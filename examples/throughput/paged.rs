//! The paged side: the requests through the crate's continuous-batching
//! `Engine`, timed per token.
//!
//! The engine API used here, kept narrow on purpose: `Engine::new`,
//! `add_request` (`Request { id, prompt, params: SamplingParams::greedy(n) }`),
//! `has_work`, `step` (its `TokenEvent::id`), `take_completions`
//! (`Completion::{id, tokens}`), and `reset_stats` / `stats` for the
//! preemptions, the peak KV blocks in use and the prefix-cache hits of the
//! timed run (the warm-up excluded); `with_cuda_graphs`,
//! `with_mixed_step_graphs` and `capture_cuda_graphs` (before the timed
//! run, as a server does at start-up) for the graph paths.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_paged_attention::engine::SchedulerConfig;
use candle_paged_attention::engine::{Engine, EngineStats, Request, SamplingParams};
use candle_paged_attention::models::{PagedKvCache, PagedModel};

use super::stats::{RunStats, Timeline};
use super::workload::{Draw, WorkItem};

/// Which steps replay CUDA graphs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphUse {
    /// None: every step launches its kernels one by one.
    Off,
    /// Pure-decode steps only.
    DecodeOnly,
    /// Pure-decode steps and steps with prefills (the engine's default).
    All,
}

impl GraphUse {
    /// From the runners' `--no-cuda-graph` and `--decode-graphs-only`.
    pub fn from_flags(no_cuda_graph: bool, decode_graphs_only: bool) -> Self {
        match (no_cuda_graph, decode_graphs_only) {
            (true, _) => Self::Off,
            (false, true) => Self::DecodeOnly,
            (false, false) => Self::All,
        }
    }
}

/// What the paged run produced besides its timeline.
pub struct EngineRun {
    pub stats: RunStats,
    /// Generated tokens of each request, by request index.
    pub outputs: Vec<Vec<u32>>,
    /// The engine's counters over the timed run.
    pub counters: EngineStats,
    /// Which path the decode steps took.
    pub decode_path: String,
}

/// One short request through the engine before the timed run, so that it
/// does not pay for first-use initialisation (kernel loading, allocator
/// growth).
fn warm_up<M: PagedModel + ?Sized>(engine: &mut Engine<'_, M>, prompt: &[u32]) -> Result<()> {
    engine.add_request(request(u64::MAX, prompt.to_vec(), 2, None))?;
    while engine.has_work() {
        engine.step()?;
    }
    engine.take_completions();
    Ok(())
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: usize, draw: Option<Draw>) -> Request {
    // No stop token: every request produces exactly max_tokens.
    let greedy = SamplingParams::greedy(max_tokens);
    let params = match draw {
        None => greedy,
        Some(d) => SamplingParams {
            temperature: d.temperature,
            top_p: d.top_p,
            seed: id,
            ..greedy
        },
    };
    Request { id, prompt, params }
}

/// Builds an engine over `model` and `cache` (steps replaying CUDA graphs
/// as `graphs` says, the decode ones captured before the timed run), warms it
/// up with `warmup_prompt` when given, and runs `work` (see [`run_on`]).
pub fn run(
    model: &dyn PagedModel,
    cache: PagedKvCache,
    config: SchedulerConfig,
    work: &[WorkItem],
    warmup_prompt: Option<&[u32]>,
    graphs: GraphUse,
    max_in_flight: Option<usize>,
) -> Result<EngineRun> {
    let max_context = work
        .iter()
        .map(|w| w.prompt.len() + w.max_tokens)
        .max()
        .unwrap_or(1);
    let mut engine = start(model, cache, config, max_context, warmup_prompt, graphs)?;
    run_on(&mut engine, work, max_in_flight)
}

/// Builds an engine over `model` and `cache`, captures its decode graphs
/// for sequences of up to `max_context` tokens unless `graphs` is off (as a
/// server does at start-up), and warms it up with `warmup_prompt` when
/// given.
pub fn start<'m>(
    model: &'m dyn PagedModel,
    cache: PagedKvCache,
    config: SchedulerConfig,
    max_context: usize,
    warmup_prompt: Option<&[u32]>,
    graphs: GraphUse,
) -> Result<Engine<'m, dyn PagedModel + 'm>> {
    let mut engine = Engine::new(model, cache, config)?
        .with_cuda_graphs(graphs != GraphUse::Off)
        .with_mixed_step_graphs(graphs == GraphUse::All);
    let t = Instant::now();
    let graphs = engine.capture_cuda_graphs(max_context)?;
    if graphs > 0 {
        eprintln!(
            "paged engine: {graphs} CUDA graphs captured in {:.2}s",
            t.elapsed().as_secs_f64()
        );
    }
    if let Some(p) = warmup_prompt {
        warm_up(&mut engine, p)?;
    }
    Ok(engine)
}

/// Runs `work` through `engine` (idle: every earlier request ended), timing
/// each token; the counters cover this run alone.
///
/// With `max_in_flight = Some(c)`, at most `c` requests are in the engine
/// at once: the next one is added (at its arrival time or later) when one
/// finishes, as `c` clients that each send a request when their previous
/// one ended (a closed loop). With `None`, each request is added at its
/// arrival time and the engine's `max_num_seqs` alone bounds the batch.
pub fn run_on(
    engine: &mut Engine<'_, dyn PagedModel + '_>,
    work: &[WorkItem],
    max_in_flight: Option<usize>,
) -> Result<EngineRun> {
    if max_in_flight == Some(0) {
        bail!("max_in_flight must be at least 1 when given");
    }
    if engine.has_work() {
        bail!("the engine still has requests of an earlier run");
    }
    let in_flight_limit = max_in_flight.unwrap_or(usize::MAX);
    engine.reset_stats();
    let mut timeline = Timeline::new(work.len());
    let mut next = 0;
    let mut finished = 0;
    let mut max_batch = 0;
    let t0 = Instant::now();
    while next < work.len() || engine.has_work() {
        let now = t0.elapsed();
        if !engine.has_work() {
            // Whatever was added has ended (a request that failed sends no
            // last token).
            finished = next;
        }
        while next < work.len() && work[next].arrival <= now && next - finished < in_flight_limit {
            let w = &work[next];
            engine.add_request(request(next as u64, w.prompt.clone(), w.max_tokens, w.draw))?;
            // A closed loop's request is sent when its client is free.
            let sent = if max_in_flight.is_some() {
                now.max(w.arrival)
            } else {
                w.arrival
            };
            timeline.arrivals[next] = sent.as_secs_f64();
            next += 1;
        }
        if !engine.has_work() {
            // Nothing is in flight: the next request has not arrived yet.
            let wait = work[next].arrival.saturating_sub(now);
            std::thread::sleep(wait.min(Duration::from_millis(50)));
            continue;
        }
        let events = engine.step()?;
        let t = t0.elapsed().as_secs_f64();
        max_batch = max_batch.max(events.len());
        for ev in &events {
            timeline.token_times[ev.id as usize].push(t);
            finished += usize::from(ev.finished.is_some());
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let mut outputs = vec![Vec::new(); work.len()];
    for c in engine.take_completions() {
        outputs[c.id as usize] = c.tokens;
    }
    for (i, (o, w)) in outputs.iter().zip(work).enumerate() {
        if o.len() != w.max_tokens {
            bail!(
                "request {i} produced {} tokens instead of its {}: the two sides would not do the same work",
                o.len(),
                w.max_tokens
            );
        }
    }
    let mut stats = RunStats::from_timeline("paged engine".into(), &timeline, wall, max_batch);
    let counters = engine.stats();
    stats.preemptions = Some(counters.preemptions);
    stats.peak_kv_blocks = Some(format!(
        "{} of {}",
        counters.peak_used_blocks, counters.num_blocks
    ));
    let (hits, computed) = (counters.prefix_cache_hit_tokens, counters.prefill_tokens);
    stats.prefix_cache_hits = Some(format!(
        "{hits} tokens ({:.1}% of {} prompt tokens)",
        100.0 * hits as f64 / (hits + computed).max(1) as f64,
        hits + computed
    ));
    let decode_path = if engine.uses_cuda_graphs() {
        let mut line = format!(
            "CUDA graphs: {} of {} steps replayed ({} of them with prefills), {} kernels per decode step",
            counters.graph_steps,
            counters.steps,
            counters.mixed_graph_steps,
            counters.kernels_per_graph_step
        );
        if let Some(e) = engine.cuda_graph_error() {
            line += &format!(
                " ({} captures failed: {e})",
                counters.graph_capture_failures
            );
        }
        line
    } else {
        "eager".to_string()
    };
    Ok(EngineRun {
        stats,
        outputs,
        counters,
        decode_path,
    })
}
