//! A streaming client of `POST /v1/completions` that times every token as
//! it arrives, and the loops that drive the server: a fixed number of
//! clients sending one request after another, and Poisson arrivals.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::workload::WorkItem;

/// What one streamed request received.
#[derive(Clone, Debug, Default)]
pub struct Received {
    /// When it was sent, in seconds from the start of the run.
    pub sent: f64,
    /// Each generated token, with when its chunk arrived (seconds from the
    /// start of the run).
    pub tokens: Vec<(u32, f64)>,
    /// The finish reason of the last chunk; `None` when the client left
    /// first or the stream ended without one.
    pub finish: Option<String>,
    /// `usage.completion_tokens` of the usage chunk.
    pub completion_tokens: Option<usize>,
    /// An error event or status, if any.
    pub error: Option<String>,
}

/// One request of the load: its work item and, for the disconnect run,
/// after how many tokens the client goes away.
#[derive(Clone, Debug)]
pub struct Job {
    pub item: WorkItem,
    pub leave_after: Option<usize>,
}

/// Sends `job` to `url` (`.../v1/completions`) as a greedy streamed
/// request for exactly `max_tokens` tokens (`ignore_eos`) with token ids
/// returned, and reads the stream until `[DONE]` or until the job's
/// `leave_after` tokens have come.
pub async fn stream_one(http: &reqwest::Client, url: &str, job: &Job, t0: Instant) -> Received {
    let mut got = Received {
        sent: t0.elapsed().as_secs_f64(),
        ..Received::default()
    };
    if let Err(e) = read_stream(http, url, job, t0, &mut got).await {
        got.error = Some(format!("{e:#}"));
    }
    got
}

async fn read_stream(
    http: &reqwest::Client,
    url: &str,
    job: &Job,
    t0: Instant,
    got: &mut Received,
) -> Result<()> {
    let body = json!({
        "prompt": job.item.prompt,
        "max_tokens": job.item.max_tokens,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
        "return_token_ids": true,
    });
    let resp = http.post(url).json(&body).send().await?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        bail!("HTTP {status}: {text}");
    }
    let mut bytes = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    while let Some(piece) = bytes.next().await {
        buf.extend_from_slice(&piece?);
        let now = t0.elapsed().as_secs_f64();
        // Events end with a blank line.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = std::str::from_utf8(&event).context("a non-UTF-8 event")?;
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    return Ok(());
                }
                let v: Value = serde_json::from_str(data).context("an event that is not JSON")?;
                if let Some(e) = v.get("error") {
                    bail!("error event: {e}");
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    got.completion_tokens = Some(n as usize);
                }
                let Some(choice) = v["choices"].get(0) else {
                    continue;
                };
                if let Some(ids) = choice["token_ids"].as_array() {
                    for id in ids {
                        let id = id.as_u64().context("a token id that is not a number")?;
                        got.tokens.push((id as u32, now));
                    }
                }
                if let Some(r) = choice["finish_reason"].as_str() {
                    got.finish = Some(r.to_string());
                }
                if job.leave_after.is_some_and(|k| got.tokens.len() >= k) {
                    // Dropping the response closes the connection.
                    return Ok(());
                }
            }
        }
    }
    bail!("the stream ended without [DONE]")
}

/// `clients` tasks, each sending the next job of `jobs` as soon as its
/// previous one ended (a closed loop). Returns what each job received, in
/// job order, and the wall time.
pub async fn closed_loop(url: &str, jobs: &[Job], clients: usize) -> Result<(Vec<Received>, f64)> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .build()?;
    let jobs: Arc<Vec<Job>> = Arc::new(jobs.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients.max(1) {
        let (http, jobs, next, url) = (http.clone(), jobs.clone(), next.clone(), url.to_string());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                out.push((i, stream_one(&http, &url, job, t0).await));
            }
            out
        }));
    }
    let mut all = vec![Received::default(); jobs.len()];
    for t in tasks {
        for (i, r) in t.await? {
            all[i] = r;
        }
    }
    Ok((all, t0.elapsed().as_secs_f64()))
}

/// Each job sent at its work item's arrival time, however many are
/// running (an open loop).
pub async fn open_loop(url: &str, jobs: &[Job]) -> Result<(Vec<Received>, f64)> {
    let http = reqwest::Client::new();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for job in jobs.iter().cloned() {
        let (http, url) = (http.clone(), url.to_string());
        tasks.push(tokio::spawn(async move {
            let wait = job.item.arrival.saturating_sub(t0.elapsed());
            tokio::time::sleep(wait).await;
            stream_one(&http, &url, &job, t0).await
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await?);
    }
    Ok((all, t0.elapsed().as_secs_f64()))
}

/// The server's Prometheus gauge `name` (without labels).
pub async fn gauge(base: &str, name: &str) -> Result<f64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await?
        .text()
        .await?;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(name) {
            if let Some(v) = rest.strip_prefix(' ') {
                return Ok(v.trim().parse()?);
            }
        }
    }
    bail!("/metrics has no {name}")
}

/// Polls the gauges until no request runs or waits and no KV block is in
/// use, for at most `limit`; returns the last blocks-in-use figure and how
/// long it took.
pub async fn drained(base: &str, limit: Duration) -> Result<(f64, Duration)> {
    let start = Instant::now();
    loop {
        let used = gauge(base, "kv_cache_blocks_used").await?;
        let running = gauge(base, "num_requests_running").await?;
        let waiting = gauge(base, "num_requests_waiting").await?;
        if (used == 0.0 && running == 0.0 && waiting == 0.0) || start.elapsed() > limit {
            return Ok((used, start.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
