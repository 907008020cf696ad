//! Prometheus metrics of the server (`GET /metrics`, text format).
//!
//! The engine thread sets the gauges after every step and counts tokens,
//! latencies and finished requests; the handlers count refusals.

use std::time::Duration;

use candle_core::{Error, Result};
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

use crate::engine::EngineStats;

const OP: &str = "server metrics";

/// The server's metrics and their registry.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests in the running batch.
    pub running: IntGauge,
    /// Requests waiting to join it.
    pub waiting: IntGauge,
    /// KV cache blocks in use.
    pub kv_blocks_used: IntGauge,
    /// KV cache blocks in all.
    pub kv_blocks_total: IntGauge,
    /// Preemptions (a sequence's cache dropped and recomputed later).
    pub preemptions: IntCounter,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hit_tokens: IntCounter,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: IntCounter,
    /// Generated tokens.
    pub generation_tokens: IntCounter,
    /// Finished requests by finish reason.
    pub requests: IntCounterVec,
    /// Requests refused, by HTTP status.
    pub refused: IntCounterVec,
    /// Engine steps that failed (rolled back).
    pub step_failures: IntCounter,
    /// Seconds from submission to the first token.
    pub time_to_first_token: Histogram,
    /// Seconds between consecutive tokens of a request.
    pub inter_token_latency: Histogram,
    /// Seconds from submission to the end of a request.
    pub request_latency: Histogram,
    /// Engine counters already added to the counters above.
    seen: EngineStats,
}

fn wrap(e: prometheus::Error) -> Error {
    Error::msg(format!("{OP}: {e}"))
}

impl Metrics {
    /// Registers every metric in a new registry.
    pub fn new() -> Result<Self> {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| -> Result<IntGauge> {
            let g = IntGauge::new(name, help).map_err(wrap)?;
            registry.register(Box::new(g.clone())).map_err(wrap)?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> Result<IntCounter> {
            let c = IntCounter::new(name, help).map_err(wrap)?;
            registry.register(Box::new(c.clone())).map_err(wrap)?;
            Ok(c)
        };
        let counter_vec = |name: &str, help: &str, label: &str| -> Result<IntCounterVec> {
            let c = IntCounterVec::new(Opts::new(name, help), &[label]).map_err(wrap)?;
            registry.register(Box::new(c.clone())).map_err(wrap)?;
            Ok(c)
        };
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| -> Result<Histogram> {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .map_err(wrap)?;
            registry.register(Box::new(h.clone())).map_err(wrap)?;
            Ok(h)
        };
        let latency_buckets = vec![
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ];
        Ok(Self {
            running: gauge("num_requests_running", "Requests in the running batch")?,
            waiting: gauge("num_requests_waiting", "Requests waiting to run")?,
            kv_blocks_used: gauge("kv_cache_blocks_used", "KV cache blocks in use")?,
            kv_blocks_total: gauge("kv_cache_blocks_total", "KV cache blocks in all")?,
            preemptions: counter("num_preemptions_total", "Sequences preempted")?,
            prefix_cache_hit_tokens: counter(
                "prefix_cache_hit_tokens_total",
                "Prompt tokens found in the prefix cache",
            )?,
            prompt_tokens: counter("prompt_tokens_total", "Prompt tokens of finished requests")?,
            generation_tokens: counter("generation_tokens_total", "Tokens generated")?,
            requests: counter_vec(
                "requests_finished_total",
                "Finished requests by finish reason",
                "finish_reason",
            )?,
            refused: counter_vec(
                "requests_refused_total",
                "Requests refused, by HTTP status",
                "status",
            )?,
            step_failures: counter("engine_step_failures_total", "Engine steps rolled back")?,
            time_to_first_token: histogram(
                "time_to_first_token_seconds",
                "Seconds from submission to the first token",
                latency_buckets.clone(),
            )?,
            inter_token_latency: histogram(
                "inter_token_latency_seconds",
                "Seconds between consecutive tokens of a request",
                latency_buckets.clone(),
            )?,
            request_latency: histogram(
                "e2e_request_latency_seconds",
                "Seconds from submission to the end of a request",
                latency_buckets,
            )?,
            seen: EngineStats::default(),
            registry,
        })
    }

    /// Sets the gauges from the engine's state and adds the growth of its
    /// cumulative counters.
    pub fn update_engine(
        &mut self,
        stats: &EngineStats,
        running: usize,
        waiting: usize,
        used_blocks: usize,
    ) {
        self.running.set(running as i64);
        self.waiting.set(waiting as i64);
        self.kv_blocks_used.set(used_blocks as i64);
        self.kv_blocks_total.set(stats.num_blocks as i64);
        let grew = |now: usize, before: usize| now.saturating_sub(before) as u64;
        self.preemptions
            .inc_by(grew(stats.preemptions, self.seen.preemptions));
        self.prefix_cache_hit_tokens.inc_by(grew(
            stats.prefix_cache_hit_tokens,
            self.seen.prefix_cache_hit_tokens,
        ));
        self.seen = *stats;
    }

    /// Records a finished request.
    pub fn finished(&self, reason: &str, prompt_tokens: usize, latency: Duration) {
        self.requests.with_label_values(&[reason]).inc();
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        self.request_latency.observe(latency.as_secs_f64());
    }

    /// The metrics in Prometheus' text format.
    pub fn render(&self) -> Result<String> {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .map_err(wrap)?;
        String::from_utf8(out).map_err(|e| Error::msg(format!("{OP}: {e}")))
    }
}
