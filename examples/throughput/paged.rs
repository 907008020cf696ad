//! The paged side: the requests through the crate's continuous-batching
//! `Engine`, timed per token.
//!
//! The engine API used here, kept narrow on purpose: `Engine::new`,
//! `add_request` (`Request { id, prompt, params: SamplingParams::greedy(n) }`),
//! `has_work`, `step` (its `TokenEvent::id`), `num_running`,
//! `take_completions` (`Completion::{id, tokens, preemptions}`).

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_paged_attention::models::generation::{Engine, Request, SamplingParams};
use candle_paged_attention::models::generation::{SchedulerConfig, TokenEvent};
use candle_paged_attention::models::{PagedKvCache, PagedModel};

use super::stats::{RunStats, Timeline};
use super::workload::WorkItem;

/// What the paged run produced besides its timeline.
pub struct EngineRun {
    pub stats: RunStats,
    /// Generated tokens of each request, by request index.
    pub outputs: Vec<Vec<u32>>,
}

/// Estimates the KV blocks in use at each step from what the engine makes
/// public.
///
/// The engine exposes no free-block count (its block manager is private)
/// and `Engine::cache()` only gives the cache's configuration, so the
/// estimate rebuilds the running set: the engine keeps running and waiting
/// sequences in arrival order (admission takes the queue's front,
/// preemption puts the newest running sequence back at the front), so the
/// running sequences are the first `num_running()` unfinished requests. A
/// sequence that has produced a token since it was (re)admitted holds
/// `ceil((prompt + generated - 1) / block_size)` blocks exactly; one still
/// reading its prompt (or recomputing after a preemption) is counted at its
/// whole context, an upper bound. Blocks shared by prefix caching are
/// counted once per sequence (another over-count). Replace this with the
/// engine's own counter once it has one.
struct KvEstimate {
    block_size: usize,
    /// Unfinished requests in arrival order.
    order: Vec<usize>,
    prompt_len: Vec<usize>,
    generated: Vec<usize>,
    /// Produced a token since its last admission.
    decoding: Vec<bool>,
    running: Vec<usize>,
    peak: usize,
}

impl KvEstimate {
    fn new(block_size: usize, work: &[WorkItem]) -> Self {
        Self {
            block_size,
            order: Vec::new(),
            prompt_len: work.iter().map(|w| w.prompt.len()).collect(),
            generated: vec![0; work.len()],
            decoding: vec![false; work.len()],
            running: Vec::new(),
            peak: 0,
        }
    }

    fn arrived(&mut self, i: usize) {
        self.order.push(i);
    }

    /// After a step: `events` its tokens, `finished` the requests that
    /// finished in it, `num_running` the engine's count after it.
    fn step(&mut self, events: &[TokenEvent], finished: &[usize], num_running: usize) {
        for ev in events {
            let i = ev.id as usize;
            self.generated[i] += 1;
            self.decoding[i] = true;
        }
        self.order.retain(|i| !finished.contains(i));
        let running: Vec<usize> = self.order.iter().take(num_running).copied().collect();
        for i in &self.running {
            if !running.contains(i) {
                self.decoding[*i] = false; // preempted: recomputed later
            }
        }
        // The step held the blocks of the sequences still running and of
        // those it finished (freed at its end).
        let held: usize = running
            .iter()
            .chain(finished)
            .map(|&i| {
                let ctx = self.prompt_len[i] + self.generated[i];
                let cached = if self.decoding[i] { ctx - 1 } else { ctx };
                cached.div_ceil(self.block_size)
            })
            .sum();
        self.peak = self.peak.max(held);
        self.running = running;
    }
}

/// One short request through the engine before the timed run, so that it
/// does not pay for first-use initialisation (kernel loading, allocator
/// growth).
fn warm_up<M: PagedModel + ?Sized>(engine: &mut Engine<'_, M>, prompt: &[u32]) -> Result<()> {
    engine.add_request(request(u64::MAX, prompt.to_vec(), 2))?;
    while engine.has_work() {
        engine.step()?;
    }
    engine.take_completions();
    Ok(())
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        id,
        prompt,
        // Greedy, no stop token: every request produces exactly max_tokens.
        params: SamplingParams::greedy(max_tokens),
    }
}

/// Builds an engine over `model` and `cache`, warms it up with
/// `warmup_prompt` when given, and runs `work`.
pub fn run(
    model: &dyn PagedModel,
    cache: PagedKvCache,
    config: SchedulerConfig,
    work: &[WorkItem],
    warmup_prompt: Option<&[u32]>,
) -> Result<EngineRun> {
    let block_size = cache.block_size();
    let num_blocks = cache.config().num_blocks;
    let mut engine = Engine::new(model, cache, config)?;
    if let Some(p) = warmup_prompt {
        warm_up(&mut engine, p)?;
    }
    let mut timeline = Timeline::new(work.len());
    let mut kv = KvEstimate::new(block_size, work);
    let mut next = 0;
    let mut max_batch = 0;
    let t0 = Instant::now();
    while next < work.len() || engine.has_work() {
        let now = t0.elapsed();
        while next < work.len() && work[next].arrival <= now {
            let w = &work[next];
            engine.add_request(request(next as u64, w.prompt.clone(), w.max_tokens))?;
            timeline.arrivals[next] = w.arrival.as_secs_f64();
            kv.arrived(next);
            next += 1;
        }
        if !engine.has_work() {
            let wait = work[next].arrival.saturating_sub(now);
            std::thread::sleep(wait.min(Duration::from_millis(50)));
            continue;
        }
        let events = engine.step()?;
        let t = t0.elapsed().as_secs_f64();
        max_batch = max_batch.max(events.len());
        let mut finished = Vec::new();
        for ev in &events {
            let i = ev.id as usize;
            timeline.token_times[i].push(t);
            if timeline.token_times[i].len() == work[i].max_tokens {
                finished.push(i);
            }
        }
        kv.step(&events, &finished, engine.num_running());
    }
    let wall = t0.elapsed().as_secs_f64();
    let mut outputs = vec![Vec::new(); work.len()];
    let mut preemptions = 0;
    for c in engine.take_completions() {
        preemptions += c.preemptions;
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
    stats.preemptions = Some(preemptions);
    stats.peak_kv_blocks = Some(if kv.peak > num_blocks {
        format!(
            "{num_blocks} of {num_blocks} (estimate, capped: its upper bound reached {})",
            kv.peak
        )
    } else {
        format!("{} of {num_blocks} (estimate)", kv.peak)
    });
    // The engine does not report prefix-cache hits.
    stats.prefix_cache_hits = Some("n/a".into());
    Ok(EngineRun { stats, outputs })
}
