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
//! the split-KV policy is the library's automatic choice. One call with the
//! output poisoned checks that every element is finite; then warm-up (at
//! least 3 calls and 25 ms) and reps, each a 256 MiB memset (L2 flush), a
//! start event, one forward, an end event, enqueued back to back with no
//! host sync. The median, min and max over at least 20 reps (about 100 ms of
//! them, at most 200) are reported. The copy-bandwidth and bf16-matmul
//! ceilings are measured in the same process.

use std::io::Write;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    paged_attention, reshape_and_cache, KvScales, PagedAttentionParams, PagedBatch, SlotMapping,
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
            "-h" | "--help" => {
                println!("bench [--shapes shapes.json] [--out ours.jsonl] [--min-reps N] [--max-reps N] [--target-ms MS] [--no-ceilings] [CASE...]");
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

/// The path the library picks for this case: a copy of the automatic rule of
/// `plan` in src/cuda/paged_attention.rs (tile shape, resident programs per
/// SM, segments that fill whole waves), for the report only.
fn path_label(
    seqs: &[(usize, usize)],
    (heads, kv_heads, head_size): (usize, usize, usize),
    window: Option<usize>,
    fp8: bool,
    sms: usize,
) -> String {
    let group = heads / kv_heads;
    let max_q = seqs.iter().map(|s| s.0).max().unwrap_or(0);
    let max_k = seqs.iter().map(|s| s.1).max().unwrap_or(0);
    let tokens: usize = seqs.iter().map(|s| s.0).sum();
    let decode_kind = max_q * group.min(16) <= 16;
    let rows = if decode_kind { 16 } else { 64 };
    let ge = group.min(rows);
    let head = head_size.next_power_of_two().max(32);
    let dv = head.min(256);
    let dv_chunks = head / dv;
    // Shared memory of the instance (kernels/unified_attention.cu `Smem`).
    let (wm, wn, kw) = if decode_kind {
        (1, 4, 16)
    } else {
        (4, 1, if head <= 128 { 64 } else { 32 })
    };
    let (bm, bn) = (16 * wm, kw * wn);
    let tiles = if fp8 {
        bn * (head + 8) * 2 + bn * (dv + 8) * 2 + 2 * bn * head + 2 * bn * dv
    } else {
        4 * bn * (head + 8) + 4 * bn * (dv + 8)
    };
    let smem = bm * (head + 8) * 2 + 8 * wn * bm + 16 * bn + tiles.max(wn * bm * (dv + 8) * 4);
    let by_regs = if decode_kind && head <= 128 { 3 } else { 2 };
    let slots = ((228 * 1024) / (smem + 1024)).min(by_regs).max(1) * sms;
    let decode = max_q == 1 && tokens == seqs.len();
    let segments = if decode {
        let active = seqs.len() * kv_heads * group.div_ceil(ge) * dv_chunks;
        let keys = window.map_or(max_k, |w| w.min(max_k));
        let max_s = keys.div_ceil(128).clamp(1, 64);
        let waves = |s: usize| (active * s).div_ceil(slots) as f64 / s as f64;
        let ideal = active as f64 / slots as f64;
        (1..=max_s)
            .find(|&s| waves(s) <= ideal * 1.03)
            .unwrap_or_else(|| {
                (1..=max_s)
                    .min_by(|&a, &b| waves(a).total_cmp(&waves(b)))
                    .unwrap_or(1)
            })
    } else {
        1
    };
    let fits = 16 / group.min(16);
    let kind = if decode_kind {
        "decode"
    } else if seqs.iter().any(|s| (1..=fits).contains(&s.0)) {
        "decode+prefill"
    } else {
        "prefill"
    };
    if segments > 1 {
        format!("split-kv({segments}, {kind})")
    } else {
        format!("2d({kind})")
    }
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

fn run_case(
    c: &Value,
    dev: &Device,
    timer: &mut Timer,
    args: &Args,
    sms: usize,
    seed: u64,
) -> Result<Value> {
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
    let params = PagedAttentionParams::new(&kc, &vc, &batch, 1.0 / (d as f32).sqrt())
        .with_sliding_window(window);

    // Check once, with the output poisoned.
    std::env::set_var("CANDLE_PAGED_ATTENTION_POISON", "1");
    let out = paged_attention(&q, &params);
    std::env::remove_var("CANDLE_PAGED_ATTENTION_POISON");
    let out = out?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        bail!("output element {i} is {} after the check run", out[i]);
    }

    let stats = timer.time(
        args,
        || {
            paged_attention(&q, &params)?;
            Ok(())
        },
        args.min_reps,
    )?;
    Ok(json!({
        "case": name,
        "impl": "ours",
        "us": stats.median,
        "us_min": stats.min,
        "us_max": stats.max,
        "reps": stats.reps,
        "timing": "eager",
        "path": path_label(&seqs, (h, kvh, d), window, fp8, sms),
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
    let stream = cuda.cuda_stream();
    let sms = stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
        as usize;
    let mut timer = Timer {
        flush: stream.alloc_zeros::<u8>(FLUSH_BYTES)?,
        stream: stream.clone(),
    };
    let mut out =
        std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out))?;
    let mut put = |v: Value| -> Result<()> {
        writeln!(out, "{v}")?;
        println!("{v}");
        Ok(())
    };
    put(
        json!({"meta": {"impl": "ours", "sms": sms, "timing": "eager launches, 256 MiB L2 flush before each rep"}}),
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
    }

    for (i, c) in cases.iter().enumerate() {
        let name = c
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        match run_case(c, &dev, &mut timer, &args, sms, i as u64) {
            Ok(v) => put(v)?,
            Err(e) => put(json!({"case": name, "impl": "ours", "error": format!("{e:#}")}))?,
        }
    }
    Ok(())
}
