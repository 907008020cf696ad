//! Kernel benchmark: times `paged_attention` on CUDA device 0 over the cases
//! of a `shapes.json` (the side-by-side harness's format) and writes JSON
//! lines that `compare.py` sets beside vLLM's Triton kernel.
//!
//! ```text
//! cargo run --release --features cuda --example bench -- \
//!     --shapes shapes.json --out ours.jsonl [CASE...]
//! ```
//!
//! Per case: random normal bf16 query and K/V caches (fp8 caches for
//! `kv_dtype: "fp8"`, scales 1.0; the caches are written by
//! `reshape_and_cache`), block tables from a random permutation of
//! the cache's blocks, scale `1/sqrt(head_size)`, causal, the case's window;
//! the split-KV policy is the library's automatic choice (reported as `path`,
//! from `cuda_launch_plan`). One call with the output poisoned checks that
//! every element is finite; then one forward is captured in a CUDA graph
//! (eager launches if the capture fails, reported as `timing`), and after a
//! warm-up (at least 3 replays and 25 ms) come the reps, each a 256 MiB
//! memset (L2 flush), a start event, one replay, an end event, enqueued back
//! to back with no host sync. The median, min and max over at least 20 reps
//! (about 100 ms of them, at most 200) are reported. The copy-bandwidth and
//! bf16-matmul ceilings are measured in the same process, and the floor of
//! the timing itself (`launch_floor_us`: a replayed graph of one output
//! allocation and a one-element kernel).
//!
//! `--segments N` forces the split-KV segment count (`KvSplit::Segments`).
//! `--plan-keys N` plans as a CUDA-graph step does (`KvSplit::AutoUpTo`:
//! split-KV for up to `N` keys, and a batch with prefills planned for its
//! shape alone, both launches of a mixed batch included).
//! `--clean-flush` reads a second 256 MiB buffer after each memset, so that
//! the L2 holds clean lines only when a rep starts: the memset leaves dirty
//! lines, which the timed forward writes back as its reads evict them (a
//! diagnostic; vLLM's harness flushes with the memset alone).

use std::io::Write;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys::{
    CUdevice_attribute, CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    cuda_launch_plan, paged_attention, reshape_and_cache, KvScales, KvSplit, PagedAttentionParams,
    PagedBatch, SlotMapping,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::{json, Value};

const FLUSH_BYTES: usize = 256 << 20;

struct Args {
    shapes: String,
    out: String,
    cases: Vec<String>,
    min_reps: usize,
    max_reps: usize,
    target_ms: f64,
    ceilings: bool,
    /// Forced split-KV segments (`KvSplit::Segments`); the plan's own when unset.
    segments: Option<u32>,
    /// Plan as a replayable step (`KvSplit::AutoUpTo`) for this many keys.
    plan_keys: Option<u32>,
    /// After each rep's memset, read a second 256 MiB buffer, so that the L2
    /// holds clean lines only (a diagnostic: vLLM's harness flushes with the
    /// memset alone).
    clean_flush: bool,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        shapes: "shapes.json".into(),
        out: "ours.jsonl".into(),
        cases: Vec::new(),
        min_reps: 20,
        max_reps: 200,
        target_ms: 100.0,
        ceilings: true,
        segments: None,
        plan_keys: None,
        clean_flush: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--shapes" => args.shapes = value("--shapes")?,
            "--out" => args.out = value("--out")?,
            "--min-reps" => args.min_reps = value("--min-reps")?.parse()?,
            "--max-reps" => args.max_reps = value("--max-reps")?.parse()?,
            "--target-ms" => args.target_ms = value("--target-ms")?.parse()?,
            "--no-ceilings" => args.ceilings = false,
            "--segments" => args.segments = Some(value("--segments")?.parse()?),
            "--plan-keys" => args.plan_keys = Some(value("--plan-keys")?.parse()?),
            "--clean-flush" => args.clean_flush = true,
            "-h" | "--help" => {
                println!("bench [--shapes shapes.json] [--out ours.jsonl] [--min-reps N] [--max-reps N] [--target-ms MS] [--no-ceilings] [--segments N] [--plan-keys N] [--clean-flush] [CASE...]");
                std::process::exit(0);
            }
            s if s.starts_with("--") => bail!("unknown option {s}"),
            s => args.cases.push(s.to_string()),
        }
    }
    Ok(args)
}

/// Median, min and max (microseconds) of a set of rep times.
struct Stats {
    median: f64,
    min: f64,
    max: f64,
    reps: usize,
}

/// Times `f` with CUDA events, the L2 flushed before each rep.
struct Timer {
    stream: Arc<CudaStream>,
    flush: CudaSlice<u8>,
    /// Read after the memset with `--clean-flush` ([64 Mi] f32).
    clean: Option<Tensor>,
}

impl Timer {
    fn event(&self) -> Result<candle_core::cuda_backend::cudarc::driver::CudaEvent> {
        Ok(self
            .stream
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    fn time(
        &mut self,
        args: &Args,
        mut f: impl FnMut() -> Result<()>,
        min_reps: usize,
    ) -> Result<Stats> {
        f()?;
        self.stream.synchronize()?;
        let (s, e) = (self.event()?, self.event()?);
        s.record(&self.stream)?;
        for _ in 0..3 {
            f()?;
        }
        e.record(&self.stream)?;
        let est = (s.elapsed_ms(&e)? as f64 / 3.0).max(1e-3);
        let n = ((args.target_ms / est) as usize).clamp(min_reps, args.max_reps.max(min_reps));
        let warm = ((25.0 / est) as usize).clamp(3, 100);
        for _ in 0..warm {
            f()?;
        }
        let starts: Vec<_> = (0..n).map(|_| self.event()).collect::<Result<_>>()?;
        let ends: Vec<_> = (0..n).map(|_| self.event()).collect::<Result<_>>()?;
        for i in 0..n {
            self.stream.memset_zeros(&mut self.flush)?;
            if let Some(clean) = &self.clean {
                clean.sum_all()?;
            }
            starts[i].record(&self.stream)?;
            f()?;
            ends[i].record(&self.stream)?;
        }
        let mut us: Vec<f64> = starts
            .iter()
            .zip(&ends)
            .map(|(s, e)| Ok(s.elapsed_ms(e)? as f64 * 1e3))
            .collect::<Result<_>>()?;
        us.sort_by(|a, b| a.total_cmp(b));
        Ok(Stats {
            median: us[n / 2],
            min: us[0],
            max: us[n - 1],
            reps: n,
        })
    }
}

/// Captures the launches `f` enqueues on `stream` into a CUDA graph (its
/// allocations become graph-owned and are freed inside the graph).
fn capture(stream: &Arc<CudaStream>, f: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    stream.synchronize()?;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let run = f();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    run?;
    let graph = graph?.context("the capture recorded nothing")?;
    graph.upload()?;
    stream.synchronize()?;
    Ok(graph)
}

fn field<'a>(c: &'a Value, name: &str) -> Result<&'a Value> {
    c.get(name)
        .with_context(|| format!("case has no field {name}"))
}

fn uint(c: &Value, name: &str) -> Result<usize> {
    field(c, name)?
        .as_u64()
        .map(|v| v as usize)
        .with_context(|| format!("field {name} is not an unsigned integer"))
}

/// Fills the first `rows` cache rows of both caches with random normal
/// values, a chunk of rows at a time (bf16 values stored through
/// `reshape_and_cache`, which also converts to fp8).
fn fill_random(kc: &Tensor, vc: &Tensor, rows: usize, dev: &Device) -> Result<()> {
    let (kvh, d) = (kc.dims()[2], kc.dims()[3]);
    let chunk = ((1usize << 27) / (kvh * d)).max(1);
    let mut start = 0;
    while start < rows {
        let n = chunk.min(rows - start);
        let k = Tensor::randn(0f32, 1.0, (n, kvh, d), dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (n, kvh, d), dev)?.to_dtype(DType::BF16)?;
        let slots: Vec<i64> = (start as i64..(start + n) as i64).collect();
        let slots = SlotMapping::new(&slots, dev)?;
        reshape_and_cache(&k, &v, kc, vc, &slots, KvScales::default())?;
        start += n;
    }
    Ok(())
}

fn run_case(c: &Value, dev: &Device, timer: &mut Timer, args: &Args, seed: u64) -> Result<Value> {
    let name = field(c, "name")?.as_str().context("name")?;
    let (h, kvh, d, bs) = (
        uint(c, "num_heads")?,
        uint(c, "num_kv_heads")?,
        uint(c, "head_size")?,
        uint(c, "block_size")?,
    );
    if c.get("dtype").and_then(Value::as_str).unwrap_or("bf16") != "bf16" {
        bail!("only bf16 cases are supported");
    }
    let fp8 = c.get("kv_dtype").and_then(Value::as_str) == Some("fp8");
    let window = c
        .get("sliding_window")
        .and_then(Value::as_u64)
        .map(|w| w as usize);
    let seqs: Vec<(usize, usize)> = field(c, "seqs")?
        .as_array()
        .context("seqs")?
        .iter()
        .map(|s| {
            let a = s.as_array().context("seq entry")?;
            Ok((
                a.first().and_then(Value::as_u64).context("q_len")? as usize,
                a.get(1).and_then(Value::as_u64).context("seq_len")? as usize,
            ))
        })
        .collect::<Result<_>>()?;
    let tokens: usize = seqs.iter().map(|s| s.0).sum();
    let blocks: usize = seqs.iter().map(|s| s.1.div_ceil(bs)).sum();

    // Each sequence gets its own blocks, from a random permutation of the cache.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut perm: Vec<u32> = (0..blocks as u32).collect();
    perm.shuffle(&mut rng);
    let mut rows = Vec::with_capacity(seqs.len());
    let mut next = 0;
    for &(_, l) in &seqs {
        let n = l.div_ceil(bs);
        rows.push(perm[next..next + n].to_vec());
        next += n;
    }
    let mut cu = vec![0u32];
    for &(q, _) in &seqs {
        cu.push(cu.last().copied().unwrap_or(0) + q as u32);
    }
    let seq_lens: Vec<u32> = seqs.iter().map(|s| s.1 as u32).collect();
    let batch = PagedBatch::from_rows(&cu, &seq_lens, &rows, bs, dev)?;

    let q = Tensor::randn(0f32, 1.0, (tokens, h, d), dev)?.to_dtype(DType::BF16)?;
    let cache_dtype = if fp8 { DType::F8E4M3 } else { DType::BF16 };
    let kc = Tensor::zeros((blocks.max(1), bs, kvh, d), cache_dtype, dev)?;
    let vc = Tensor::zeros((blocks.max(1), bs, kvh, d), cache_dtype, dev)?;
    fill_random(&kc, &vc, blocks * bs, dev)?;
    let mut params = PagedAttentionParams::new(&kc, &vc, &batch, 1.0 / (d as f32).sqrt())
        .with_sliding_window(window);
    if let Some(k) = args.segments {
        params = params.with_kv_split(KvSplit::Segments(k));
    }
    if let Some(keys) = args.plan_keys {
        params = params.with_kv_split(KvSplit::AutoUpTo(keys));
    }

    let path = cuda_launch_plan(&q, &params)?;
    // Check once, with the output poisoned.
    std::env::set_var("CANDLE_PAGED_ATTENTION_POISON", "1");
    let out = paged_attention(&q, &params);
    std::env::remove_var("CANDLE_PAGED_ATTENTION_POISON");
    let out = out?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        bail!("output element {i} is {} after the check run", out[i]);
    }

    // One forward as a graph replay (launches, workspace and output
    // allocation included), as the harness times vLLM's kernel; eager
    // launches if the capture fails.
    let forward = || -> Result<()> {
        paged_attention(&q, &params)?;
        Ok(())
    };
    let (stats, timing) = match capture(&timer.stream, forward) {
        Ok(graph) => (
            timer.time(args, || Ok(graph.launch()?), args.min_reps)?,
            "graph",
        ),
        Err(e) => {
            eprintln!("{name}: graph capture failed ({e:#}); timing eager launches");
            (timer.time(args, forward, args.min_reps)?, "eager")
        }
    };
    Ok(json!({
        "case": name,
        "impl": "ours",
        "us": stats.median,
        "us_min": stats.min,
        "us_max": stats.max,
        "reps": stats.reps,
        "timing": timing,
        "path": path,
    }))
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(&args.shapes)
            .with_context(|| format!("reading {}", args.shapes))?,
    )?;
    let all = match &doc {
        Value::Object(o) => o
            .get("cases")
            .and_then(Value::as_array)
            .context("no cases")?
            .clone(),
        Value::Array(a) => a.clone(),
        _ => bail!("{}: expected an object with cases", args.shapes),
    };
    let cases: Vec<Value> = if args.cases.is_empty() {
        all
    } else {
        all.into_iter()
            .filter(|c| {
                c.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| args.cases.iter().any(|x| x == n))
            })
            .collect()
    };

    let dev = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        bail!("not a cuda device")
    };
    // SAFETY: every launch of this program goes on candle's one stream, so
    // no cross-stream ordering events are needed (and none may be recorded
    // inside a graph capture).
    unsafe { cuda.disable_event_tracking() };
    let stream = cuda.cuda_stream();
    let sms = stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
        as usize;
    let mut timer = Timer {
        flush: stream.alloc_zeros::<u8>(FLUSH_BYTES)?,
        stream: stream.clone(),
        clean: if args.clean_flush {
            Some(Tensor::zeros(FLUSH_BYTES / 4, DType::F32, &dev)?)
        } else {
            None
        },
    };
    let mut out =
        std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out))?;
    let mut put = |v: Value| -> Result<()> {
        writeln!(out, "{v}")?;
        println!("{v}");
        Ok(())
    };
    put(
        json!({"meta": {"impl": "ours", "sms": sms, "timing": "CUDA-graph replay of one forward (eager launches where capture fails), 256 MiB L2 flush before each rep"}}),
    )?;

    if args.ceilings {
        // Device-to-device copy of 4 GiB: bytes read + written over the median time.
        let bytes = 4usize << 30;
        let src = stream.alloc_zeros::<u8>(bytes)?;
        let mut dst = stream.alloc_zeros::<u8>(bytes)?;
        let s = timer.time(&args, || Ok(stream.memcpy_dtod(&src, &mut dst)?), 20)?;
        put(
            json!({"ceiling": "copy_tbs", "value": 2.0 * bytes as f64 / (s.median * 1e-6) / 1e12}),
        )?;
        drop((src, dst));
        // bf16 8192^3 matmul through candle (cuBLAS), after about 1 s of warm-up.
        let n = 8192;
        let a = Tensor::randn(0f32, 1.0, (n, n), &dev)?.to_dtype(DType::BF16)?;
        let b = Tensor::randn(0f32, 1.0, (n, n), &dev)?.to_dtype(DType::BF16)?;
        let t0 = std::time::Instant::now();
        while t0.elapsed().as_secs_f64() < 1.0 {
            a.matmul(&b)?;
            stream.synchronize()?;
        }
        let s = timer.time(
            &args,
            || {
                a.matmul(&b)?;
                Ok(())
            },
            20,
        )?;
        put(
            json!({"ceiling": "matmul_tflops", "value": 2.0 * (n as f64).powi(3) / (s.median * 1e-6) / 1e12}),
        )?;
        // The floor of this timing method: a graph of one output allocation
        // and one one-element kernel, replayed between the same events after
        // the same flush. No forward of one launch can measure less.
        let one = Tensor::zeros(1, DType::F32, &dev)?;
        let graph = capture(&stream, || {
            one.affine(1.0, 1.0)?;
            Ok(())
        })?;
        let s = timer.time(&args, || Ok(graph.launch()?), 20)?;
        put(json!({"ceiling": "launch_floor_us", "value": s.median, "min": s.min, "max": s.max}))?;
    }

    for (i, c) in cases.iter().enumerate() {
        let name = c
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        match run_case(c, &dev, &mut timer, &args, i as u64) {
            Ok(v) => put(v)?,
            Err(e) => put(json!({"case": name, "impl": "ours", "error": format!("{e:#}")}))?,
        }
    }
    Ok(())
}
