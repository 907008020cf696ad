//! `reshape_and_cache`: written rows are exact copies (f32/f16/bf16),
//! padding slots and unwritten rows keep their old contents, fp8 caches
//! round-trip within fp8 precision and saturate at +-448.
//!
//! Each body runs as `NAME::cpu` and, with the `cuda` feature, as
//! `NAME::cuda` (see `common::device`); on the GPU the caches are also
//! compared with the CPU path's (`matches_cpu`).

#[macro_use]
mod common;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{reshape_and_cache, KvScales, SlotMapping};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

const CPU: Device = Device::Cpu;
/// Exactly representable in every cache dtype, fp8 included.
const SENTINEL: f32 = -40.0;

/// Cache geometry: `[num_blocks, block_size, num_kv_heads, head_size]`.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
}

impl Geometry {
    fn slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
    fn row(&self) -> usize {
        self.num_kv_heads * self.head_size
    }
    fn shape(&self) -> [usize; 4] {
        [
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_size,
        ]
    }
}

const GEOMETRY: Geometry = Geometry {
    num_blocks: 7,
    block_size: 5,
    num_kv_heads: 3,
    head_size: 24,
};

/// Tensors are built on the CPU and then moved: candle's CUDA backend has no
/// f32 to `F8E4M3` cast.
fn sentinel_cache(g: Geometry, dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(Tensor::full(SENTINEL, &g.shape(), &CPU)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

fn random_tokens(
    rng: &mut StdRng,
    n: usize,
    g: Geometry,
    std: f32,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let data: Vec<f32> = (0..n * g.row())
        .map(|_| std * rng.sample::<f32, _>(StandardNormal))
        .collect();
    let t = Tensor::from_vec(data, (n, g.num_kv_heads, g.head_size), &CPU)?;
    Ok(t.to_dtype(dtype)?.to_device(device)?)
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&CPU)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Slot written by each cache row after storing `slots` (the last token
/// wins; `None` for rows no token writes).
fn writers(slots: &[i64], g: Geometry) -> Vec<Option<usize>> {
    let mut w = vec![None; g.slots()];
    for (t, &s) in slots.iter().enumerate() {
        if s >= 0 {
            w[s as usize] = Some(t);
        }
    }
    w
}

/// Every written cache row equals its token's row exactly; every other row
/// still holds the sentinel.
fn check_exact(cache: &[f32], new: &[f32], slots: &[i64], g: Geometry) -> Result<()> {
    let r = g.row();
    for (slot, writer) in writers(slots, g).into_iter().enumerate() {
        let got = &cache[slot * r..(slot + 1) * r];
        match writer {
            Some(t) => ensure!(
                got == &new[t * r..(t + 1) * r],
                "slot {slot} does not hold token {t}"
            ),
            None => ensure!(
                got.iter().all(|&x| x == SENTINEL),
                "slot {slot} was not written but changed"
            ),
        }
    }
    Ok(())
}

device_test! {
    /// Stores random tokens at distinct random slots, some of them padding, and
    /// checks both caches row by row.
    fn exact_rows(
        dev: &Device,
        #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
        #[values(1, 2, 3)] seed: u64,
    ) -> Result<()> {
        let g = GEOMETRY;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut order: Vec<i64> = (0..g.slots() as i64).collect();
        order.shuffle(&mut rng);
        let n = 20;
        let mut slots: Vec<i64> = order[..n].to_vec();
        let mut positions: Vec<usize> = (0..n).collect();
        positions.shuffle(&mut rng);
        for (&p, pad) in positions.iter().zip([-1, -7, i64::MIN]) {
            slots[p] = pad;
        }
        let key = random_tokens(&mut rng, n, g, 1.0, dtype, dev)?;
        let value = random_tokens(&mut rng, n, g, 3.0, dtype, dev)?;
        let (kc, vc) = (sentinel_cache(g, dtype, dev)?, sentinel_cache(g, dtype, dev)?);
        let mapping = SlotMapping::new(&slots, dev)?;
        // Scales are ignored for caches of the token dtype.
        reshape_and_cache(&key, &value, &kc, &vc, &mapping, KvScales::new(0.3, 7.0))?;
        check_exact(&host(&kc)?, &host(&key)?, &slots, g)?;
        check_exact(&host(&vc)?, &host(&value)?, &slots, g)
    }
}

device_test! {
    /// Only padding slots: both caches are untouched (for an fp8 cache, with
    /// f32 tokens and scales).
    fn padding_slots_leave_cache_untouched(
        dev: &Device,
        #[values(DType::F32, DType::F16, DType::BF16, DType::F8E4M3)] cache_dtype: DType,
    ) -> Result<()> {
        let g = GEOMETRY;
        let (kc, vc) = (sentinel_cache(g, cache_dtype, dev)?, sentinel_cache(g, cache_dtype, dev)?);
        if cache_dtype == DType::F8E4M3 {
            let key = Tensor::ones((3, g.num_kv_heads, g.head_size), DType::F32, dev)?;
            let mapping = SlotMapping::new(&[-1, -3, i64::MIN], dev)?;
            reshape_and_cache(&key, &key, &kc, &vc, &mapping, KvScales::new(0.5, 2.0))?;
        } else {
            let mut rng = StdRng::seed_from_u64(5);
            let slots = [-1, -2, i64::MIN, -(g.slots() as i64)];
            let key = random_tokens(&mut rng, slots.len(), g, 1.0, cache_dtype, dev)?;
            let mapping = SlotMapping::new(&slots, dev)?;
            reshape_and_cache(&key, &key, &kc, &vc, &mapping, KvScales::default())?;
        }
        for c in [&kc, &vc] {
            ensure!(
                host(c)?.iter().all(|&x| x == SENTINEL),
                "a padding slot wrote into the cache"
            );
        }
        Ok(())
    }
}

device_test! {
    /// A random permutation of every slot: the whole cache is the permuted
    /// input.
    fn random_slot_permutations(
        dev: &Device,
        #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
        #[values(
            Geometry { num_blocks: 7, block_size: 5, num_kv_heads: 3, head_size: 24 },
            Geometry { num_blocks: 3, block_size: 16, num_kv_heads: 8, head_size: 128 },
            Geometry { num_blocks: 40, block_size: 1, num_kv_heads: 1, head_size: 80 },
        )]
        g: Geometry,
        #[values(11, 12)] seed: u64,
    ) -> Result<()> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut slots: Vec<i64> = (0..g.slots() as i64).collect();
        slots.shuffle(&mut rng);
        let key = random_tokens(&mut rng, slots.len(), g, 1.0, dtype, dev)?;
        let value = random_tokens(&mut rng, slots.len(), g, 1.0, dtype, dev)?;
        let (kc, vc) = (sentinel_cache(g, dtype, dev)?, sentinel_cache(g, dtype, dev)?);
        let mapping = SlotMapping::new(&slots, dev)?;
        reshape_and_cache(&key, &value, &kc, &vc, &mapping, KvScales::default())?;
        check_exact(&host(&kc)?, &host(&key)?, &slots, g)?;
        check_exact(&host(&vc)?, &host(&value)?, &slots, g)
    }
}

device_test! {
    /// A strided (non-contiguous) key and value store the same rows as their
    /// contiguous copies.
    fn strided_input(dev: &Device, #[values(DType::F32, DType::BF16)] dtype: DType) -> Result<()> {
        let g = GEOMETRY;
        let mut rng = StdRng::seed_from_u64(9);
        let slots: Vec<i64> = vec![3, 0, -1, 17, 34, 8];
        let key = random_tokens(&mut rng, slots.len(), g, 1.0, dtype, dev)?;
        let strided = key.transpose(0, 1)?.contiguous()?.transpose(0, 1)?;
        ensure!(!strided.is_contiguous());
        let (kc, vc) = (sentinel_cache(g, dtype, dev)?, sentinel_cache(g, dtype, dev)?);
        let mapping = SlotMapping::new(&slots, dev)?;
        reshape_and_cache(&strided, &strided, &kc, &vc, &mapping, KvScales::default())?;
        check_exact(&host(&kc)?, &host(&key)?, &slots, g)?;
        check_exact(&host(&vc)?, &host(&key)?, &slots, g)
    }
}

device_test! {
    /// Storing twice into the same slots: the second call wins, other rows
    /// keep the first call's values.
    fn overwrite(dev: &Device, #[values(DType::F32, DType::F16)] dtype: DType) -> Result<()> {
        let g = GEOMETRY;
        let mut rng = StdRng::seed_from_u64(13);
        let first_slots: Vec<i64> = vec![0, 1, 2, 3, 4];
        let second_slots: Vec<i64> = vec![-1, 1, -1, 3, -1];
        let first = random_tokens(&mut rng, 5, g, 1.0, dtype, dev)?;
        let second = random_tokens(&mut rng, 5, g, 1.0, dtype, dev)?;
        let (kc, vc) = (sentinel_cache(g, dtype, dev)?, sentinel_cache(g, dtype, dev)?);
        let s1 = SlotMapping::new(&first_slots, dev)?;
        let s2 = SlotMapping::new(&second_slots, dev)?;
        reshape_and_cache(&first, &first, &kc, &vc, &s1, KvScales::default())?;
        reshape_and_cache(&second, &second, &kc, &vc, &s2, KvScales::default())?;
        let (cache, a, b, r) = (host(&kc)?, host(&first)?, host(&second)?, g.row());
        for slot in 0..5 {
            let want = if slot % 2 == 1 { &b } else { &a };
            ensure!(
                cache[slot * r..(slot + 1) * r] == want[slot * r..(slot + 1) * r],
                "slot {slot} holds the wrong token"
            );
        }
        Ok(())
    }
}

/// Every row written into an fp8 cache is within fp8 precision of its token
/// (relative 2^-4, absolute half the smallest subnormal) in the attention
/// domain (`stored * scale`, against the input clamped to `+-448 * scale`);
/// unwritten rows keep the sentinel.
fn check_fp8_rows(
    cache: &[f32],
    new: &[f32],
    scale: f32,
    slots: &[i64],
    g: Geometry,
) -> Result<()> {
    let (r, scale) = (g.row(), scale as f64);
    for (slot, writer) in writers(slots, g).into_iter().enumerate() {
        let got = &cache[slot * r..(slot + 1) * r];
        let Some(t) = writer else {
            ensure!(
                got.iter().all(|&x| x == SENTINEL),
                "slot {slot} was not written but changed"
            );
            continue;
        };
        for (i, (&q, &x)) in got.iter().zip(&new[t * r..(t + 1) * r]).enumerate() {
            let want = (x as f64).clamp(-448.0 * scale, 448.0 * scale);
            let back = q as f64 * scale;
            ensure!(
                back.is_finite()
                    && (back - want).abs() <= want.abs() / 16.0 + scale * 2f64.powi(-10),
                "slot {slot}, element {i}: {x} came back as {back} (scale {scale})"
            );
        }
    }
    Ok(())
}

device_test! {
    /// An fp8 cache stores `clamp(x / scale, +-448)`: dequantised (`* scale`)
    /// it is within fp8 precision of the input; values past 448 * scale
    /// saturate; unwritten rows keep the sentinel.
    fn fp8_round_trip(
        dev: &Device,
        #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
        #[values(
            KvScales::new(0.05, 3.0),
            KvScales::new(1.0, 1.0),
            KvScales::new(2.5, 0.4)
        )]
        scales: KvScales,
    ) -> Result<()> {
        let g = GEOMETRY;
        let mut rng = StdRng::seed_from_u64(21);
        let mut order: Vec<i64> = (0..g.slots() as i64).collect();
        order.shuffle(&mut rng);
        let n = 16;
        let mut slots: Vec<i64> = order[..n].to_vec();
        slots[5] = -1;
        // Magnitudes across the fp8 range, relative to the scales.
        let key = random_tokens(&mut rng, n, g, 30.0 * scales.k_scale, dtype, dev)?;
        let value = random_tokens(&mut rng, n, g, 0.5 * scales.v_scale, dtype, dev)?;
        // Token 0 saturates: far past 448 * scale, both signs.
        let r = g.row();
        let mut kdata = host(&key)?;
        for (i, x) in kdata[..r].iter_mut().enumerate() {
            *x = if i % 2 == 0 { 1e4 } else { -1e4 } * scales.k_scale;
        }
        let key = Tensor::from_vec(kdata, (n, g.num_kv_heads, g.head_size), &CPU)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let fp8 = DType::F8E4M3;
        let (kc, vc) = (sentinel_cache(g, fp8, dev)?, sentinel_cache(g, fp8, dev)?);
        let mapping = SlotMapping::new(&slots, dev)?;
        reshape_and_cache(&key, &value, &kc, &vc, &mapping, scales)?;
        check_fp8_rows(&host(&kc)?, &host(&key)?, scales.k_scale, &slots, g)?;
        check_fp8_rows(&host(&vc)?, &host(&value)?, scales.v_scale, &slots, g)?;
        // The saturated token stores exactly +-448.
        let kc = host(&kc)?;
        let s0 = slots[0] as usize;
        for (i, &q) in kc[s0 * r..(s0 + 1) * r].iter().enumerate() {
            let want = if i % 2 == 0 { 448.0 } else { -448.0 };
            ensure!(
                q == want,
                "saturated element {i} stored {q}, expected {want}"
            );
        }
        Ok(())
    }
}

cuda_test! {
    /// `reshape_and_cache` on the GPU writes exactly what the CPU path writes,
    /// skipping negative slots, for every value dtype and an fp8 cache.
    fn matches_cpu(
        dev: &Device,
        #[values(DType::F32, DType::F16, DType::BF16)] dtype: DType,
        #[values(false, true)] fp8: bool,
        #[values(64, 36)] head_size: usize,
    ) -> Result<()> {
        let g = Geometry {
            num_blocks: 40,
            block_size: 16,
            num_kv_heads: 3,
            head_size,
        };
        let tokens = 300usize;
        let mut rng = StdRng::seed_from_u64(head_size as u64 + fp8 as u64);
        let mut free: Vec<i64> = (0..g.slots() as i64).collect();
        let slots: Vec<i64> = (0..tokens)
            .map(|_| {
                if rng.random_bool(0.1) {
                    -1
                } else {
                    let i = rng.random_range(0..free.len());
                    free.swap_remove(i)
                }
            })
            .collect();
        let cache_dtype = if fp8 { DType::F8E4M3 } else { dtype };
        let scales = KvScales::new(0.5, 2.0);
        let shape = (tokens, g.num_kv_heads, head_size);
        let k = Tensor::randn(0f32, 3.0, shape, &CPU)?.to_dtype(dtype)?;
        let v = Tensor::randn(0f32, 3.0, shape, &CPU)?.to_dtype(dtype)?;
        let mut caches = Vec::new();
        for device in [&CPU, dev] {
            let filled = || -> Result<Tensor> {
                Ok(Tensor::full(7f32, &g.shape(), &CPU)?
                    .to_dtype(cache_dtype)?
                    .to_device(device)?)
            };
            let (kc, vc) = (filled()?, filled()?);
            let sm = SlotMapping::new(&slots, device)?;
            reshape_and_cache(&k.to_device(device)?, &v.to_device(device)?, &kc, &vc, &sm, scales)?;
            caches.push((host(&kc)?, host(&vc)?));
        }
        let (cpu, gpu) = (&caches[0], &caches[1]);
        for (name, a, b) in [("key", &cpu.0, &gpu.0), ("value", &cpu.1, &gpu.1)] {
            for (i, (&x, &y)) in a.iter().zip(b.iter()).enumerate() {
                // fp8: one rounding step apart at most (ties may round differently).
                let tol = if fp8 { 0.0625 * x.abs() + 1e-6 } else { 0.0 };
                ensure!(
                    (x - y).abs() <= tol,
                    "{name}_cache element {i}: cpu {x}, gpu {y} \
                     ({dtype:?}, fp8 {fp8}, head_size {head_size})"
                );
            }
        }
        Ok(())
    }
}
