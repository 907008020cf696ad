//! Latency and throughput figures of one side of the comparison, and the
//! final table.

use std::fmt::Write as _;

use serde_json::{json, Value};

/// When each request arrived and when each of its tokens reached the caller,
/// in seconds from the start of the run.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub arrivals: Vec<f64>,
    pub token_times: Vec<Vec<f64>>,
}

impl Timeline {
    /// An empty timeline for `n` requests.
    pub fn new(n: usize) -> Self {
        Self {
            arrivals: vec![0.0; n],
            token_times: vec![Vec::new(); n],
        }
    }
}

/// The figures of one side.
#[derive(Clone, Debug)]
pub struct RunStats {
    pub label: String,
    pub requests: usize,
    pub generated: usize,
    pub wall_s: f64,
    /// Time to first token of each request (from its arrival).
    pub ttft_s: Vec<f64>,
    /// Every gap between two consecutive tokens of a request, pooled.
    pub itl_s: Vec<f64>,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    pub preemptions: Option<usize>,
    pub peak_kv_blocks: Option<String>,
    pub prefix_cache_hits: Option<String>,
    /// Requests whose greedy tokens equal the engine's (reference sides).
    pub identical_outputs: Option<(usize, usize)>,
}

impl RunStats {
    /// Figures from a timeline; `wall_s` is the run's duration.
    pub fn from_timeline(label: String, t: &Timeline, wall_s: f64, max_batch: usize) -> Self {
        let mut ttft = Vec::new();
        let mut itl = Vec::new();
        for (arrival, times) in t.arrivals.iter().zip(&t.token_times) {
            if let Some(first) = times.first() {
                ttft.push(first - arrival);
            }
            itl.extend(times.windows(2).map(|w| w[1] - w[0]));
        }
        Self {
            label,
            requests: t.token_times.len(),
            generated: t.token_times.iter().map(Vec::len).sum(),
            wall_s,
            ttft_s: ttft,
            itl_s: itl,
            max_batch,
            preemptions: None,
            peak_kv_blocks: None,
            prefix_cache_hits: None,
            identical_outputs: None,
        }
    }

    pub fn requests_per_s(&self) -> f64 {
        self.requests as f64 / self.wall_s
    }

    pub fn tokens_per_s(&self) -> f64 {
        self.generated as f64 / self.wall_s
    }

    pub fn ttft_ms(&self, p: f64) -> f64 {
        1e3 * percentile(&self.ttft_s, p)
    }

    pub fn itl_ms(&self, p: f64) -> f64 {
        1e3 * percentile(&self.itl_s, p)
    }

    pub fn to_json(&self) -> Value {
        let nan_null = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "label": self.label,
            "requests": self.requests,
            "generated_tokens": self.generated,
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s(),
            "generated_tokens_per_s": self.tokens_per_s(),
            "ttft_ms_p50": nan_null(self.ttft_ms(50.0)),
            "ttft_ms_p99": nan_null(self.ttft_ms(99.0)),
            "itl_ms_p50": nan_null(self.itl_ms(50.0)),
            "itl_ms_p99": nan_null(self.itl_ms(99.0)),
            "max_batch": self.max_batch,
            "preemptions": self.preemptions,
            "peak_kv_blocks": self.peak_kv_blocks,
            "prefix_cache_hits": self.prefix_cache_hits,
            "identical_outputs": self.identical_outputs.map(|(k, n)| json!({"equal": k, "of": n})),
        })
    }
}

/// Nearest-rank percentile `p` (0..=100) of `v`; NaN when `v` is empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// How a figure compares between the sides.
#[derive(Clone, Copy)]
enum Better {
    /// Not compared (counts).
    Neither,
    /// Throughput: engine / reference.
    Higher,
    /// Latency: reference / engine.
    Lower,
}

/// One numeric row of the table.
struct Figure {
    name: &'static str,
    better: Better,
    digits: usize,
    get: fn(&RunStats) -> f64,
}

impl Figure {
    fn new(name: &'static str, better: Better, digits: usize, get: fn(&RunStats) -> f64) -> Self {
        Self {
            name,
            better,
            digits,
            get,
        }
    }
}

fn fixed(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "-".to_string()
    }
}

/// The markdown table: the engine, then each reference with its ratio.
///
/// Ratios read "times better": throughput is engine / reference, latency
/// is reference / engine.
pub fn table(engine: &RunStats, refs: &[RunStats]) -> String {
    let figures = [
        Figure::new("requests", Better::Neither, 0, |s| s.requests as f64),
        Figure::new("generated tokens", Better::Neither, 0, |s| {
            s.generated as f64
        }),
        Figure::new("wall s", Better::Neither, 3, |s| s.wall_s),
        Figure::new("requests/s", Better::Higher, 3, RunStats::requests_per_s),
        Figure::new("generated tok/s", Better::Higher, 1, RunStats::tokens_per_s),
        Figure::new("TTFT p50 ms", Better::Lower, 2, |s| s.ttft_ms(50.0)),
        Figure::new("TTFT p99 ms", Better::Lower, 2, |s| s.ttft_ms(99.0)),
        Figure::new("ITL p50 ms", Better::Lower, 3, |s| s.itl_ms(50.0)),
        Figure::new("ITL p99 ms", Better::Lower, 3, |s| s.itl_ms(99.0)),
    ];
    let mut out = format!("| metric | {} |", engine.label);
    let mut rule = String::from("|---|---:|");
    for r in refs {
        let _ = write!(out, " {} | ratio |", r.label);
        rule.push_str("---:|---:|");
    }
    let _ = writeln!(out, "\n{rule}");
    for Figure {
        name,
        better,
        digits,
        get,
    } in figures
    {
        let e = get(engine);
        let _ = write!(out, "| {name} | {} |", fixed(e, digits));
        for r in refs {
            let v = get(r);
            let x = match better {
                Better::Neither => f64::NAN,
                Better::Higher => e / v,
                Better::Lower => v / e,
            };
            let ratio = if x.is_finite() && x > 0.0 {
                format!("{x:.2}x")
            } else {
                String::new()
            };
            let _ = write!(out, " {} | {ratio} |", fixed(v, digits));
        }
        out.push('\n');
    }
    let texts = |s: &RunStats| -> [(&'static str, String); 5] {
        let or_dash = |x: Option<String>| x.unwrap_or_else(|| "-".into());
        [
            ("sequences per step at most", s.max_batch.to_string()),
            ("preemptions", or_dash(s.preemptions.map(|p| p.to_string()))),
            ("peak KV blocks", or_dash(s.peak_kv_blocks.clone())),
            ("prefix-cache hits", or_dash(s.prefix_cache_hits.clone())),
            (
                "greedy outputs equal to the engine's",
                or_dash(s.identical_outputs.map(|(k, n)| format!("{k}/{n}"))),
            ),
        ]
    };
    let ref_texts: Vec<_> = refs.iter().map(texts).collect();
    for (row, (name, value)) in texts(engine).into_iter().enumerate() {
        let _ = write!(out, "| {name} | {value} |");
        for r in &ref_texts {
            let _ = write!(out, " {} | |", r[row].1);
        }
        out.push('\n');
    }
    out
}
