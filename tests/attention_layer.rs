//! The attention layer driven by the block manager through simulated
//! generations, checked step by step against dense attention over each
//! sequence's full history, computed here independently in f64. Each body
//! runs as `NAME::cpu` and, with the `cuda` feature, as `NAME::cuda` (see
//! `common::device`).

#[macro_use]
mod common;

use std::collections::HashMap;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    Attention, AttentionMetadata, AttentionOptions, BlockManager, BlockManagerConfig, KvCacheDtype,
    KvScales, LayerKvCache, PagedBatch, RotaryRows, SlotMapping, Work,
};

/// Splitmix64: deterministic values from a seed.
struct Rng(u64);

impl Rng {
    fn from_key(key: &[u64]) -> Self {
        let mut r = Rng(0x5EED);
        for &k in key {
            r.0 ^= k;
            r.next();
        }
        r
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One layer of the simulated model.
#[derive(Clone, Debug, Default)]
struct LayerSpec {
    window: Option<usize>,
    chunk: Option<usize>,
    sinks: bool,
    softcap: Option<f32>,
    alibi: bool,
    fp8: Option<KvScales>,
}

/// A request: arrives at step `arrive` with a prompt, generates `max_new`
/// tokens. With `shared`, its prompt starts with the first `shared.1` prompt
/// tokens of request `shared.0`.
#[derive(Clone, Debug)]
struct Request {
    arrive: usize,
    prompt_len: usize,
    max_new: usize,
    shared: Option<(usize, usize)>,
}

fn req(arrive: usize, prompt_len: usize, max_new: usize) -> Request {
    Request {
        arrive,
        prompt_len,
        max_new,
        shared: None,
    }
}

#[derive(Clone, Debug)]
struct Sim {
    heads: usize,
    kv_heads: usize,
    head_size: usize,
    scale: f32,
    config: BlockManagerConfig,
    layers: Vec<LayerSpec>,
    requests: Vec<Request>,
    max_chunk: usize,
    tol: f64,
}

impl Sim {
    fn new(layers: Vec<LayerSpec>) -> Self {
        Self {
            heads: 4,
            kv_heads: 2,
            head_size: 16,
            scale: 0.25,
            config: BlockManagerConfig::new(4, 64),
            layers,
            requests: vec![
                req(0, 13, 9),
                req(0, 1, 6),
                req(1, 22, 4),
                req(3, 5, 14),
                req(4, 9, 0),
                req(6, 31, 7),
                req(9, 2, 11),
            ],
            max_chunk: 7,
            tol: 1e-4,
        }
    }
}

/// What the reference needs of a layer.
struct RefLayer {
    window: Option<usize>,
    chunk: Option<usize>,
    sinks: Option<Vec<f32>>,
    softcap: Option<f32>,
    slopes: Option<Vec<f32>>,
    fp8: Option<KvScales>,
}

#[derive(Debug, Default)]
struct Stats {
    steps: usize,
    rows: usize,
    mixed_steps: usize,
    cached_tokens: usize,
    max_diff: f64,
}

struct Live {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    generated: usize,
    max_new: usize,
    pending: Option<u32>,
}

/// The key and value rows a layer computes for `token` at `pos`: a function
/// of both, as a model's would be, so shared prefixes share cache content.
fn kv_rows(layer: usize, token: u32, pos: usize, width: usize) -> (Vec<f32>, Vec<f32>) {
    let mut r = Rng::from_key(&[1, layer as u64, token as u64, pos as u64]);
    (r.vec(width), r.vec(width))
}

/// Rows as the cache holds them: fp8-rounded and rescaled for an fp8 layer.
/// The reference rounds on the host, whatever device the layer runs on
/// (candle's CUDA backend has no f32 -> F8E4M3 cast).
fn stored(rows: &[Vec<f32>], scale: Option<f32>) -> Result<Vec<Vec<f32>>> {
    let Some(s) = scale else {
        return Ok(rows.to_vec());
    };
    let flat: Vec<f32> = rows.concat();
    let t = Tensor::from_vec(flat, (rows.len(), rows[0].len()), &Device::Cpu)?;
    let q = ((t / s as f64)?
        .to_dtype(DType::F8E4M3)?
        .to_dtype(DType::F32)?
        * s as f64)?;
    Ok(q.to_vec2::<f32>()?)
}

/// Dense attention of one query row at absolute position `p` over the keys
/// `0..=p` of its sequence, with the layer's masks and score options.
fn dense_row(
    q: &[f32],
    keys: &[Vec<f32>],
    values: &[Vec<f32>],
    p: usize,
    sim: &Sim,
    l: &RefLayer,
) -> Vec<f32> {
    let (h, kvh, d) = (sim.heads, sim.kv_heads, sim.head_size);
    let lo = l
        .window
        .map_or(0, |w| (p + 1).saturating_sub(w))
        .max(l.chunk.map_or(0, |c| p / c * c));
    let mut out = vec![0f32; h * d];
    for hh in 0..h {
        let kv = hh / (h / kvh);
        let qh = &q[hh * d..(hh + 1) * d];
        let scores: Vec<f64> = (lo..=p)
            .map(|j| {
                let kh = &keys[j][kv * d..(kv + 1) * d];
                let mut s = sim.scale as f64
                    * qh.iter()
                        .zip(kh)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>();
                if let Some(c) = l.softcap.filter(|&c| c > 0.0) {
                    s = c as f64 * (s / c as f64).tanh();
                }
                if let Some(sl) = &l.slopes {
                    s += sl[hh] as f64 * (j as f64 - p as f64);
                }
                s
            })
            .collect();
        let sink = l.sinks.as_ref().map(|s| s[hh] as f64);
        let m = scores
            .iter()
            .copied()
            .chain(sink)
            .fold(f64::NEG_INFINITY, f64::max);
        let mut denom = sink.map_or(0.0, |s| (s - m).exp());
        let mut acc = vec![0f64; d];
        for (j, s) in (lo..=p).zip(&scores) {
            let w = (s - m).exp();
            denom += w;
            for (a, v) in acc.iter_mut().zip(&values[j][kv * d..(kv + 1) * d]) {
                *a += w * *v as f64;
            }
        }
        for (o, a) in out[hh * d..(hh + 1) * d].iter_mut().zip(acc) {
            *o = (a / denom) as f32;
        }
    }
    out
}

fn build_layers(sim: &Sim, dev: &Device) -> Result<Vec<(Attention, LayerKvCache, RefLayer)>> {
    let mut out = Vec::new();
    for (i, spec) in sim.layers.iter().enumerate() {
        let mut r = Rng::from_key(&[2, i as u64]);
        let sinks = spec.sinks.then(|| {
            r.vec(sim.heads)
                .iter()
                .map(|x| 2.0 * x)
                .collect::<Vec<f32>>()
        });
        let slopes = spec.alibi.then(|| {
            (0..sim.heads)
                .map(|h| 0.5f32.powi(h as i32 + 1))
                .collect::<Vec<f32>>()
        });
        let to_t = |v: &Option<Vec<f32>>| -> Result<Option<Tensor>> {
            Ok(match v {
                Some(v) => Some(Tensor::from_slice(v, v.len(), dev)?),
                None => None,
            })
        };
        let options = AttentionOptions {
            sliding_window: spec.window,
            sinks: to_t(&sinks)?,
            softcap: spec.softcap,
            alibi_slopes: to_t(&slopes)?,
            attention_chunk_size: spec.chunk,
            kv_cache_dtype: spec.fp8.map_or(KvCacheDtype::Auto, KvCacheDtype::Fp8E4M3),
            block_size: sim.config.block_size,
            ..Default::default()
        };
        let attn = Attention::new(sim.heads, sim.kv_heads, sim.head_size, sim.scale, options)?;
        let group = sim
            .config
            .window_groups
            .iter()
            .find(|g| Some(g.window) == spec.window);
        let num_blocks = group.map_or(sim.config.num_blocks, |g| g.num_blocks);
        let cache = attn.new_cache(num_blocks, DType::F32, dev)?;
        let reference = RefLayer {
            window: spec.window,
            chunk: spec.chunk,
            sinks,
            softcap: spec.softcap,
            slopes,
            fp8: spec.fp8,
        };
        out.push((attn, cache, reference));
    }
    Ok(out)
}

fn prompt_of(sim: &Sim, i: usize) -> Vec<u32> {
    let r = &sim.requests[i];
    let mut rng = Rng::from_key(&[3, i as u64]);
    let mut tokens: Vec<u32> = (0..r.prompt_len).map(|_| rng.below(1000) as u32).collect();
    if let Some((src, n)) = r.shared {
        let shared = prompt_of(sim, src);
        tokens[..n].copy_from_slice(&shared[..n]);
    }
    tokens
}

/// Runs the generation; every layer output of every step is compared with
/// the dense reference.
fn simulate(sim: &Sim, dev: &Device) -> Result<Stats> {
    let mut mgr = BlockManager::new(sim.config.clone())?;
    let layers = build_layers(sim, dev)?;
    let (qw, kvw) = (sim.heads * sim.head_size, sim.kv_heads * sim.head_size);
    // history[layer][seq] = (keys, values) as the cache holds them.
    type History = HashMap<u64, (Vec<Vec<f32>>, Vec<Vec<f32>>)>;
    let mut history: Vec<History> = (0..layers.len()).map(|_| HashMap::new()).collect();
    let mut live: Vec<Live> = Vec::new();
    let mut stats = Stats::default();
    let mut sched = Rng::from_key(&[4]);
    let mut arrived = 0;
    for step in 0..400 {
        for (i, r) in sim.requests.iter().enumerate() {
            if r.arrive != step {
                continue;
            }
            let tokens = prompt_of(sim, i);
            let id = 100 + i as u64;
            let cached = mgr.add_sequence(id, &tokens)?;
            stats.cached_tokens += cached;
            for (l, (_, _, rl)) in layers.iter().enumerate() {
                let (ks, vs): (Vec<_>, Vec<_>) =
                    (0..cached).map(|p| kv_rows(l, tokens[p], p, kvw)).unzip();
                let entry = history[l].entry(id).or_default();
                if cached > 0 {
                    entry.0 = stored(&ks, rl.fp8.map(|s| s.k_scale))?;
                    entry.1 = stored(&vs, rl.fp8.map(|s| s.v_scale))?;
                }
            }
            live.push(Live {
                id,
                prompt_len: tokens.len(),
                tokens,
                computed: cached,
                generated: 0,
                max_new: r.max_new,
                pending: None,
            });
            arrived += 1;
        }
        if live.is_empty() {
            if arrived == sim.requests.len() {
                break;
            }
            continue;
        }
        let work: Vec<Work> = live
            .iter()
            .map(|s| match s.pending {
                Some(token) => Work::Decode {
                    seq_id: s.id,
                    token,
                },
                None => Work::Prefill {
                    seq_id: s.id,
                    num_tokens: (s.prompt_len - s.computed).min(1 + sched.below(sim.max_chunk)),
                },
            })
            .collect();
        let batch = mgr.schedule(&work, dev)?;
        let meta = &batch.metadata;
        let n = meta.num_tokens();
        ensure!(batch.token_ids.len() == n);
        if meta.num_decodes() > 0 && meta.num_prefills() > 0 {
            stats.mixed_steps += 1;
        }
        // Rows of each sequence and their absolute positions.
        let mut spans = Vec::new();
        for (i, s) in live.iter_mut().enumerate() {
            if let Some(t) = s.pending.take() {
                s.tokens.push(t);
            }
            let (start, end) = (
                meta.batch().host().cu_seqlens_q()[i] as usize,
                meta.batch().host().cu_seqlens_q()[i + 1] as usize,
            );
            let first = s.computed;
            s.computed += end - start;
            ensure!(
                meta.positions_host()[start..end]
                    == (first..s.computed).map(|p| p as u32).collect::<Vec<_>>()[..]
            );
            spans.push((start, end, first));
        }
        for (l, (attn, cache, rl)) in layers.iter().enumerate() {
            let q: Vec<f32> = (0..n)
                .flat_map(|row| Rng::from_key(&[5, l as u64, step as u64, row as u64]).vec(qw))
                .collect();
            let mut k = Vec::with_capacity(n * kvw);
            let mut v = Vec::with_capacity(n * kvw);
            for (s, &(start, end, first)) in live.iter().zip(&spans) {
                let rows: Vec<_> = (0..end - start)
                    .map(|j| kv_rows(l, s.tokens[first + j], first + j, kvw))
                    .collect();
                let (ks, vs): (Vec<_>, Vec<_>) = rows.into_iter().unzip();
                k.extend(ks.concat());
                v.extend(vs.concat());
                let entry = history[l].entry(s.id).or_default();
                entry.0.extend(stored(&ks, rl.fp8.map(|s| s.k_scale))?);
                entry.1.extend(stored(&vs, rl.fp8.map(|s| s.v_scale))?);
            }
            let qt = Tensor::from_vec(q.clone(), (n, qw), dev)?;
            let kt = Tensor::from_vec(k, (n, kvw), dev)?;
            let vt = Tensor::from_vec(v, (n, kvw), dev)?;
            let out = attn.forward(&qt, &kt, &vt, cache, meta)?.to_vec2::<f32>()?;
            for (s, &(start, end, first)) in live.iter().zip(&spans) {
                let (keys, values) = &history[l][&s.id];
                ensure!(keys.len() == s.computed);
                for row in start..end {
                    let p = first + row - start;
                    let want = dense_row(&q[row * qw..(row + 1) * qw], keys, values, p, sim, rl);
                    let diff = want
                        .iter()
                        .zip(&out[row])
                        .map(|(a, b)| (*a as f64 - *b as f64).abs())
                        .fold(0.0, f64::max);
                    ensure!(
                        diff <= sim.tol,
                        "step {step} layer {l} seq {} row {row} position {p}: max diff {diff}",
                        s.id
                    );
                    stats.max_diff = stats.max_diff.max(diff);
                }
            }
        }
        stats.steps += 1;
        stats.rows += n;
        // Sample (deterministically) for sequences whose logits are ready.
        let mut finished = Vec::new();
        for (i, s) in live.iter_mut().enumerate() {
            ensure!(batch.seq_ids[i] == s.id && batch.last_rows[i] == spans[i].1 - 1);
            ensure!(batch.ready[i] == (s.computed == s.tokens.len()));
            if !batch.ready[i] {
                continue;
            }
            if s.generated == s.max_new {
                finished.push(s.id);
            } else {
                s.generated += 1;
                s.pending = Some(Rng::from_key(&[6, s.id, step as u64]).below(1000) as u32);
            }
        }
        for id in finished {
            mgr.free(id)?;
            live.retain(|s| s.id != id);
            for h in history.iter_mut() {
                h.remove(&id);
            }
        }
    }
    ensure!(
        live.is_empty() && arrived == sim.requests.len(),
        "simulation did not finish"
    );
    ensure!(mgr.num_sequences() == 0);
    eprintln!("{stats:?}");
    ensure!(
        mgr.num_free_blocks() == sim.config.num_blocks,
        "blocks leaked"
    );
    for g in 0..sim.config.window_groups.len() {
        ensure!(mgr.num_free_window_blocks(g) == Some(sim.config.window_groups[g].num_blocks));
    }
    Ok(stats)
}

fn full_causal_generation(dev: &Device) -> Result<()> {
    let sim = Sim::new(vec![LayerSpec::default()]);
    let stats = simulate(&sim, dev)?;
    ensure!(stats.mixed_steps > 3, "{stats:?}");
    // Multi-query and equal heads too.
    for (heads, kv_heads) in [(4, 1), (2, 2)] {
        let sim = Sim {
            heads,
            kv_heads,
            ..Sim::new(vec![LayerSpec::default()])
        };
        simulate(&sim, dev)?;
    }
    Ok(())
}

fn sliding_window_generation(dev: &Device) -> Result<()> {
    // A window group of 5 tokens with few blocks: it only fits because blocks
    // that left the window are recycled. A window-3 layer without a group
    // reads the full tables.
    let mut sim = Sim::new(vec![
        LayerSpec::default(),
        LayerSpec {
            window: Some(5),
            ..Default::default()
        },
        LayerSpec {
            window: Some(3),
            ..Default::default()
        },
    ]);
    sim.config = BlockManagerConfig::new(4, 64).with_window_group(5, 28);
    let stats = simulate(&sim, dev)?;
    ensure!(stats.steps > 20, "{stats:?}");
    // Without recycling this sequence alone would need 11 group blocks.
    let mut tight = sim.clone();
    tight.config = BlockManagerConfig::new(4, 64).with_window_group(5, 9);
    tight.requests = vec![req(0, 31, 12)];
    simulate(&tight, dev)?;
    Ok(())
}

fn chunked_local_generation(dev: &Device) -> Result<()> {
    let sim = Sim::new(vec![
        LayerSpec {
            chunk: Some(8),
            ..Default::default()
        },
        LayerSpec::default(),
        LayerSpec {
            chunk: Some(4),
            ..Default::default()
        },
    ]);
    simulate(&sim, dev)?;
    // Chunked local attention on top of a sliding-window group.
    let mut sim = Sim::new(vec![LayerSpec {
        chunk: Some(8),
        window: Some(6),
        ..Default::default()
    }]);
    sim.config = BlockManagerConfig::new(4, 64).with_window_group(6, 24);
    simulate(&sim, dev)?;
    Ok(())
}

fn sinks_softcap_alibi_generation(dev: &Device) -> Result<()> {
    let mut sim = Sim::new(vec![
        LayerSpec {
            sinks: true,
            ..Default::default()
        },
        LayerSpec {
            softcap: Some(1.5),
            ..Default::default()
        },
        LayerSpec {
            sinks: true,
            softcap: Some(2.0),
            window: Some(7),
            ..Default::default()
        },
        LayerSpec {
            alibi: true,
            ..Default::default()
        },
    ]);
    sim.scale = 1.0;
    simulate(&sim, dev)?;
    Ok(())
}

fn fp8_cache_generation(dev: &Device) -> Result<()> {
    let mut sim = Sim::new(vec![
        LayerSpec {
            fp8: Some(KvScales::new(0.05, 0.02)),
            ..Default::default()
        },
        LayerSpec {
            fp8: Some(KvScales::new(1.0, 1.0)),
            chunk: Some(8),
            ..Default::default()
        },
    ]);
    sim.tol = 1e-3;
    simulate(&sim, dev)?;
    Ok(())
}

fn prefix_cached_generation(dev: &Device) -> Result<()> {
    let mut sim = Sim::new(vec![
        LayerSpec::default(),
        LayerSpec {
            chunk: Some(8),
            ..Default::default()
        },
    ]);
    sim.config = BlockManagerConfig::new(4, 48).with_prefix_caching(true);
    sim.requests = vec![
        req(0, 18, 3),
        Request {
            shared: Some((0, 14)),
            ..req(8, 20, 5)
        },
        // Arrives after request 0 finished: its blocks are cached, unused.
        Request {
            shared: Some((0, 18)),
            ..req(20, 18, 4)
        },
        req(2, 6, 30),
    ];
    let stats = simulate(&sim, dev)?;
    // 12 + 16 tokens come from the cache.
    ensure!(stats.cached_tokens == 28, "{stats:?}");
    Ok(())
}

/// Realistic block and head sizes, more sequences, longer histories.
fn larger_mixed_generation(dev: &Device) -> Result<()> {
    let mut sim = Sim::new(vec![
        LayerSpec::default(),
        LayerSpec {
            window: Some(24),
            ..Default::default()
        },
        LayerSpec {
            chunk: Some(32),
            ..Default::default()
        },
        LayerSpec {
            sinks: true,
            softcap: Some(30.0),
            ..Default::default()
        },
    ]);
    sim.heads = 8;
    sim.kv_heads = 2;
    sim.head_size = 64;
    sim.scale = 0.125;
    sim.max_chunk = 40;
    sim.config = BlockManagerConfig::new(16, 128).with_window_group(24, 40);
    sim.requests = (0..12)
        .map(|i| req(i * 3, 1 + (i * 37) % 97, (i * 13) % 41))
        .collect();
    let stats = simulate(&sim, dev)?;
    ensure!(stats.mixed_steps > 10 && stats.rows > 500, "{stats:?}");
    Ok(())
}

/// A small manager, layer and cache for the error tests.
fn small(dev: &Device, num_blocks: usize) -> Result<(BlockManager, Attention, LayerKvCache)> {
    let mgr = BlockManager::new(BlockManagerConfig::new(4, num_blocks))?;
    let attn = Attention::new(
        2,
        1,
        8,
        0.3,
        AttentionOptions {
            block_size: 4,
            ..Default::default()
        },
    )?;
    let cache = attn.new_cache(num_blocks, DType::F32, dev)?;
    Ok((mgr, attn, cache))
}

fn inputs(n: usize, dev: &Device) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        Tensor::randn(0f32, 1., (n, 16), dev)?,
        Tensor::randn(0f32, 1., (n, 8), dev)?,
        Tensor::randn(0f32, 1., (n, 8), dev)?,
    ))
}

fn out_of_blocks_is_an_error(dev: &Device) -> Result<()> {
    let (mut mgr, attn, cache) = small(dev, 4)?;
    mgr.add_sequence(1, &[1; 10])?;
    mgr.add_sequence(2, &[2; 9])?;
    let b = mgr.schedule(
        &[Work::Prefill {
            seq_id: 1,
            num_tokens: 10,
        }],
        dev,
    )?;
    let (q, k, v) = inputs(10, dev)?;
    attn.forward(&q, &k, &v, &cache, &b.metadata)?;
    let err = mgr
        .schedule(
            &[
                Work::Decode {
                    seq_id: 1,
                    token: 3,
                },
                Work::Prefill {
                    seq_id: 2,
                    num_tokens: 9,
                },
            ],
            dev,
        )
        .unwrap_err();
    let msg = err.to_string();
    ensure!(
        msg.contains("block-manager: sequence 2 needs 3 more blocks but 1 is free"),
        "{msg}"
    );
    // Nothing changed: the decode alone still fits.
    ensure!(mgr.num_computed(1) == Some(10) && mgr.num_free_blocks() == 1);
    ensure!(mgr.tokens(1).map(<[u32]>::len) == Some(10));
    mgr.schedule(
        &[Work::Decode {
            seq_id: 1,
            token: 3,
        }],
        dev,
    )?;
    mgr.free(1)?;
    mgr.schedule(
        &[Work::Prefill {
            seq_id: 2,
            num_tokens: 9,
        }],
        dev,
    )?;
    Ok(())
}

fn malformed_inputs_are_errors(dev: &Device) -> Result<()> {
    let (mut mgr, attn, cache) = small(dev, 8)?;
    mgr.add_sequence(1, &[1; 6])?;
    let b = mgr.schedule(
        &[Work::Prefill {
            seq_id: 1,
            num_tokens: 6,
        }],
        dev,
    )?;
    let (q, k, v) = inputs(6, dev)?;
    let expect = |r: candle_core::Result<Tensor>, needle: &str| -> Result<()> {
        let err = r.err().map(|e| e.to_string()).unwrap_or_default();
        ensure!(err.contains(needle), "expected {needle:?}, got {err:?}");
        Ok(())
    };
    // Wrong row count, wrong head width, wrong dtype.
    let (q5, _, _) = inputs(5, dev)?;
    expect(
        attn.forward(&q5, &k, &v, &cache, &b.metadata),
        "attention: q must be [num_tokens = 6, 2 heads x 8], got shape [5, 16]",
    )?;
    expect(
        attn.forward(&q, &q, &v, &cache, &b.metadata),
        "attention: k must be [num_tokens = 6, 1 heads x 8]",
    )?;
    let k16 = k.to_dtype(DType::F16)?;
    expect(
        attn.forward(&q, &k16, &v, &cache, &b.metadata),
        "attention: k is F16 but q is F32",
    )?;
    // A cache of another block size, or too small for the manager's blocks.
    let other = LayerKvCache::new(8, 2, 1, 8, DType::F32, dev)?;
    expect(
        attn.forward(&q, &k, &v, &other, &b.metadata),
        "cache has (block_size, num_kv_heads, head_size) = (2, 1, 8)",
    )?;
    let tiny = attn.new_cache(1, DType::F32, dev)?;
    expect(
        attn.forward(&q, &k, &v, &tiny, &b.metadata),
        "slot_mapping holds slot",
    )?;
    // An fp8 layer given a cache of the model dtype.
    let fp8 = Attention::new(
        2,
        1,
        8,
        0.3,
        AttentionOptions {
            block_size: 4,
            kv_cache_dtype: KvCacheDtype::Fp8E4M3(KvScales::new(0.1, 0.1)),
            ..Default::default()
        },
    )?;
    expect(
        fp8.forward(&q, &k, &v, &cache, &b.metadata),
        "the layer's kv_cache_dtype needs F8E4M3",
    )?;
    // No cache: only a one-token prefill may run.
    let empty = attn.new_cache(0, DType::F32, dev)?;
    expect(
        attn.forward(&q, &k, &v, &empty, &b.metadata),
        "the layer cache has no blocks",
    )?;
    // Rotary rows of another token count than the batch's.
    let qkv = Tensor::zeros((6, 32), DType::F32, dev)?;
    let (cos, cos5, sin7) = (
        Tensor::zeros((6, 4), DType::F32, dev)?,
        Tensor::zeros((5, 4), DType::F32, dev)?,
        Tensor::zeros((7, 4), DType::F32, dev)?,
    );
    let rows = |cos, sin| RotaryRows {
        cos,
        sin,
        interleaved: false,
    };
    expect(
        attn.forward_rotary_qkv(&qkv, rows(&cos5, &cos5), &cache, &b.metadata),
        "attention: rotary cos must be (num_tokens = 6, head_size / 2 = 4), got shape [5, 4]: 5 rows for 6 tokens",
    )?;
    expect(
        attn.forward_rotary_qkv(&qkv, rows(&cos, &sin7), &cache, &b.metadata),
        "attention: rotary sin must be (num_tokens = 6, head_size / 2 = 4), got shape [7, 4]: 7 rows for 6 tokens",
    )?;
    let sin16 = cos.to_dtype(DType::F16)?;
    expect(
        attn.forward_rotary_qkv(&qkv, rows(&cos, &sin16), &cache, &b.metadata),
        "attention: rotary sin is F16 but cos is F32",
    )?;
    attn.forward_rotary_qkv(&qkv, rows(&cos, &cos), &cache, &b.metadata)?;
    // Hand-built metadata with a block id past the cache.
    let batch = PagedBatch::from_rows(&[0, 6], &[6], &[vec![0, 9]], 4, dev)?;
    let meta = AttentionMetadata::new(batch, SlotMapping::new(&[0, 1, 2, 3, -1, -1], dev)?)?;
    expect(
        attn.forward(&q, &k, &v, &cache, &meta),
        "block_tables holds block id 9 >= num_blocks 8",
    )?;
    // Malformed batches are refused when they are built.
    let err = PagedBatch::from_rows(&[0, 6], &[5], &[vec![0, 1]], 4, dev).unwrap_err();
    ensure!(err.to_string().contains("q_len 6 > seq_len 5"), "{err}");
    let batch = PagedBatch::from_rows(&[0, 6], &[6], &[vec![0, 1]], 4, dev)?;
    let err = AttentionMetadata::new(batch, SlotMapping::new(&[0, 1], dev)?).unwrap_err();
    ensure!(
        err.to_string()
            .contains("slot_mapping has 2 slots but the batch has 6 tokens"),
        "{err}"
    );
    Ok(())
}

/// A one-token prompt with no cache takes the shortcut; with a cache the
/// same answer comes from the kernel.
fn single_token_prefill(dev: &Device) -> Result<()> {
    let (mut mgr, attn, cache) = small(dev, 2)?;
    mgr.add_sequence(1, &[5])?;
    let b = mgr.schedule(
        &[Work::Prefill {
            seq_id: 1,
            num_tokens: 1,
        }],
        dev,
    )?;
    let (q, k, v) = inputs(1, dev)?;
    let empty = attn.new_cache(0, DType::F32, dev)?;
    let shortcut = attn.forward(&q, &k, &v, &empty, &b.metadata)?;
    let kernel = attn.forward(&q, &k, &v, &cache, &b.metadata)?;
    let expected = Tensor::cat(&[&v, &v], 1)?;
    for t in [&shortcut, &kernel] {
        let diff = (t - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
        ensure!(diff < 1e-6, "diff {diff}");
    }
    Ok(())
}

device_test!(
    full_causal_generation,
    sliding_window_generation,
    chunked_local_generation,
    sinks_softcap_alibi_generation,
    fp8_cache_generation,
    prefix_cached_generation,
    larger_mixed_generation,
    out_of_blocks_is_an_error,
    malformed_inputs_are_errors,
    single_token_prefill,
);
