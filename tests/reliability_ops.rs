//! Bad input to the ops and their support types returns an error (never a
//! panic, an abort or a silent wrong write): sizes that overflow or exceed
//! memory, the public `ReshapeAndCache` op applied directly, caches that
//! alias, duplicate or misplaced slots, subnormal scales, non-finite sinks
//! and slopes, prefix ranges that window groups or chunked-local layers
//! cannot serve. Each body takes the device and runs through the shared
//! harness (`device_test!`): `NAME::cpu` on the CPU and, with the `cuda`
//! feature, `NAME::cuda` on CUDA device 0 (see tests/common/device.rs for
//! the environment a GPU run needs).
#![allow(clippy::single_range_in_vec_init)]

#[macro_use]
mod common;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    num_blocks_for_budget, paged_attention, reshape_and_cache, Attention, AttentionMetadata,
    AttentionOptions, BlockManager, BlockManagerConfig, KvCacheDtype, KvScales, LayerKvCache,
    PagedAttentionParams, PagedBatch, ReshapeAndCache, SlotMapping, Work,
};

/// Checks that `r` failed with a message containing every one of `parts`.
fn expect_err<T: std::fmt::Debug>(r: candle_core::Result<T>, parts: &[&str]) -> Result<()> {
    let err = match r {
        Ok(v) => bail!("expected an error containing {parts:?}, got Ok({v:?})"),
        Err(e) => e.to_string(),
    };
    for p in parts {
        ensure!(err.contains(p), "error {err:?} does not contain {p:?}");
    }
    Ok(())
}

/// `n` consecutive rows of `row` elements, row `t` holding `t + 1 + i / 100`.
fn rows(n: usize, heads: usize, head_size: usize, dev: &Device) -> Result<Tensor> {
    let row = heads * head_size;
    let data: Vec<f32> = (0..n * row)
        .map(|i| (i / row) as f32 + 1.0 + (i % row) as f32 / 100.0)
        .collect();
    Ok(Tensor::from_vec(data, (n, heads, head_size), dev)?)
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// A cache `(blocks, block_size, heads, head_size)` filled with -7.
fn sentinel(shape: (usize, usize, usize, usize), dtype: DType, dev: &Device) -> Result<Tensor> {
    // Built on the CPU: candle's CUDA backend has no cast to `F8E4M3`.
    Ok(Tensor::full(-7f32, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)?)
}

// ---- paged_attention sizes -------------------------------------------------

/// A query with no heads is an error, not a "chunk size must be non-zero"
/// panic. (CPU only: CUDA allocations of zero elements are not portable;
/// the check runs before any backend.)
#[test]
fn zero_heads_is_an_error() -> Result<()> {
    let dev = &Device::Cpu;
    let cache = Tensor::zeros((4, 4, 1, 8), DType::F32, dev)?;
    let batch = PagedBatch::from_rows(&[0, 2], &[2], &[vec![1]], 4, dev)?;
    let params = PagedAttentionParams::new(&cache, &cache.zeros_like()?, &batch, 0.3);
    let q = Tensor::zeros((2, 0, 8), DType::F32, dev)?;
    expect_err(
        paged_attention(&q, &params),
        &["paged-attention: q has 0 heads; num_heads must be at least 1"],
    )
}

/// `attention_chunk_size` of 2^32 or the largest multiple of the block size
/// below `usize::MAX`: the remap stays as small as the batch (no capacity
/// overflow, no huge allocation), and since every sequence lies in one
/// chunk the layer gives exactly what plain causal attention gives.
fn huge_attention_chunk_size_is_plain_causal(dev: &Device) -> Result<()> {
    let (heads, kv_heads, d, bs) = (4, 2, 16, 16);
    // A decode after 40 tokens, a chunked prefill (5 new after 12) and a prefill.
    let batch = PagedBatch::from_rows(
        &[0, 1, 6, 26],
        &[41, 17, 20],
        &[vec![0, 1, 2], vec![3, 4], vec![5, 6]],
        bs,
        dev,
    )?;
    let slots: Vec<i64> = [(0usize, 40usize..41usize), (1, 12..17), (2, 0..20)]
        .iter()
        .flat_map(|(s, r)| {
            let table = [vec![0i64, 1, 2], vec![3, 4], vec![5, 6]][*s].clone();
            r.clone()
                .map(move |p| table[p / bs] * bs as i64 + (p % bs) as i64)
        })
        .collect();
    let meta = AttentionMetadata::new(batch, SlotMapping::new(&slots, dev)?)?;
    let n = meta.num_tokens();
    let q = rows(n, heads, d, dev)?.reshape((n, heads * d))?;
    let k = (rows(n, kv_heads, d, dev)? * 0.01)?.reshape((n, kv_heads * d))?;
    let v = rows(n, kv_heads, d, dev)?.reshape((n, kv_heads * d))?;
    let run = |chunk: Option<usize>| -> Result<Vec<f32>> {
        let layer = Attention::new(
            heads,
            kv_heads,
            d,
            0.25,
            AttentionOptions {
                attention_chunk_size: chunk,
                block_size: bs,
                ..Default::default()
            },
        )?;
        let cache = layer.new_cache(8, DType::F32, dev)?;
        // The cached context of the decode and the chunked prefill.
        let ctx_slots: Vec<i64> = (0..40i64)
            .map(|p| [0i64, 1, 2][p as usize / bs] * bs as i64 + p % bs as i64)
            .chain((0..12i64).map(|p| 3 * bs as i64 + p))
            .collect();
        let ctx = Tensor::ones((ctx_slots.len(), kv_heads, d), DType::F32, dev)?;
        reshape_and_cache(
            &(&ctx * 0.02)?,
            &ctx,
            cache.key(),
            cache.value(),
            &SlotMapping::new(&ctx_slots, dev)?,
            KvScales::default(),
        )?;
        host(&layer.forward(&q, &k, &v, &cache, &meta)?)
    };
    let plain = run(None)?;
    for chunk in [1usize << 32, usize::MAX & !(bs - 1)] {
        let local = meta.local_batch(None, chunk)?;
        ensure!(
            local.host().block_table_width() == 3,
            "chunk {chunk}: the remapped table has width {}",
            local.host().block_table_width()
        );
        ensure!(
            run(Some(chunk))? == plain,
            "chunk {chunk} differs from causal attention"
        );
    }
    Ok(())
}

// ---- cache sizing ------------------------------------------------------------

/// Sizes whose byte counts overflow are errors (they divided by zero).
#[test]
fn cache_budget_overflow_is_an_error() -> Result<()> {
    // `generate --block-size 18014398509481984`.
    expect_err(
        num_blocks_for_budget(1 << 30, 24, 18014398509481984, 8, 64, DType::BF16),
        &["kv-cache: a block of 18014398509481984 tokens x 8 kv heads x head_size 64 of BF16 overflows usize bytes"],
    )?;
    expect_err(
        num_blocks_for_budget(1 << 30, usize::MAX / 2, 16, 8, 64, DType::BF16),
        &["kv-cache: 9223372036854775807 layers x 32768 bytes per block overflow usize"],
    )?;
    expect_err(
        LayerKvCache::bytes_per_block(1 << 62, 4, 1, DType::F32),
        &["overflows usize bytes"],
    )?;
    ensure!(LayerKvCache::bytes_per_block(16, 8, 64, DType::BF16)? == 32768);
    ensure!(num_blocks_for_budget(32768 * 24 * 3 + 1, 24, 16, 8, 64, DType::BF16)? == 3);
    Ok(())
}

/// A cache larger than the memory it would live in is refused before any
/// allocation, with its byte count.
fn oversized_cache_is_refused(dev: &Device) -> Result<()> {
    // 2^40 blocks x 2 x 16 x 8 x 128 x 2 bytes = 2^56 bytes.
    let what = if dev.is_cpu() {
        "physical memory"
    } else {
        "free memory on the cuda device"
    };
    expect_err(
        LayerKvCache::new(1 << 40, 16, 8, 128, DType::BF16, dev),
        &[
            "need 72057594037927936 bytes for the key and value caches",
            what,
        ],
    )?;
    expect_err(
        LayerKvCache::new(usize::MAX / 4, 16, 8, 128, DType::BF16, dev),
        &["blocks of 65536 bytes (key and value caches) overflow usize"],
    )?;
    let layer = Attention::new(8, 8, 128, 0.1, AttentionOptions::default())?;
    expect_err(layer.new_cache(1 << 40, DType::BF16, dev), &[what])?;
    let small = LayerKvCache::new(3, 16, 8, 128, DType::BF16, dev)?;
    ensure!(small.num_blocks() == 3);
    Ok(())
}

/// A block manager of `u32::MAX` blocks (its ids are u32) is refused with the
/// byte count instead of aborting on a 160 GiB bookkeeping allocation; a
/// large pool within the bound is built without touching its free list.
#[test]
fn block_manager_with_u32_max_blocks() -> Result<()> {
    let err = BlockManager::new(BlockManagerConfig::new(16, u32::MAX as usize))
        .err()
        .context("u32::MAX blocks were accepted")?
        .to_string();
    ensure!(
        err.contains("4294967295 blocks would take 171798691800 bytes of bookkeeping"),
        "{err}"
    );
    let blocks = 1 << 24;
    let mut mgr = BlockManager::new(BlockManagerConfig::new(16, blocks))?;
    ensure!(mgr.num_free_blocks() == blocks);
    mgr.add_sequence(7, &[1, 2, 3, 4, 5])?;
    let batch = mgr.schedule(
        &[Work::Prefill {
            seq_id: 7,
            num_tokens: 5,
        }],
        &Device::Cpu,
    )?;
    ensure!(batch.metadata.slot_mapping().host() == [0, 1, 2, 3, 4]);
    ensure!(mgr.num_free_blocks() == blocks - 1);
    mgr.free(7)?;
    ensure!(mgr.num_free_blocks() == blocks);
    Ok(())
}

// ---- ReshapeAndCache applied directly -----------------------------------------

const GEOM: (usize, usize, usize, usize) = (4, 4, 2, 8);

fn raw_store(cache: &Tensor, new: &Tensor, slots: &[i64], scale: f32) -> candle_core::Result<()> {
    let slots = Tensor::new(slots, new.device())?;
    cache.inplace_op3(new, &slots, &ReshapeAndCache { scale })
}

/// Slot 2^61 (which wrapped onto slot 0) and slot 1000 (which panicked) are
/// errors on the CPU, and nothing is written, not even the valid tokens.
#[test]
fn raw_op_slot_past_capacity_is_an_error_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    let cache = sentinel(GEOM, DType::F32, &dev)?;
    let new = rows(3, 2, 8, &dev)?;
    expect_err(
        raw_store(&cache, &new, &[2, 1 << 61, -1], 1.0),
        &["reshape-and-cache: slot_mapping[1] = 2305843009213693952 >= num_blocks * block_size = 16"],
    )?;
    expect_err(
        raw_store(&cache, &new, &[1000, 0, 1], 1.0),
        &["slot_mapping[0] = 1000 >= num_blocks * block_size = 16"],
    )?;
    ensure!(
        host(&cache)?.iter().all(|&x| x == -7.0),
        "the cache changed"
    );
    Ok(())
}

/// On CUDA the slots stay on the device: the kernel skips slots past the
/// cache and writes the others.
#[cfg(feature = "cuda")]
#[test]
fn raw_op_slot_past_capacity_is_skipped_on_cuda() -> Result<()> {
    let Some(dev) = common::cuda_device()? else {
        return Ok(());
    };
    for dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
        let cache = sentinel(GEOM, dtype, &dev)?;
        let new = rows(4, 2, 8, &dev)?.to_dtype(if dtype == DType::F8E4M3 {
            DType::F16
        } else {
            dtype
        })?;
        raw_store(&cache, &new, &[1 << 61, 1000, 5, 16], 1.0)?;
        let (got, want_row) = (host(&cache)?, host(&new)?);
        let row = 16;
        for slot in 0..16 {
            let got = &got[slot * row..(slot + 1) * row];
            if slot == 5 {
                // Token 2's row, through the cache dtype.
                let want = Tensor::new(&want_row[2 * row..3 * row], &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?;
                ensure!(got == want, "{dtype:?}: slot 5 holds {got:?}");
            } else {
                ensure!(
                    got.iter().all(|&x| x == -7.0),
                    "{dtype:?}: slot {slot} changed"
                );
            }
        }
    }
    Ok(())
}

/// Malformed operands of the raw op are errors on every device: a rank-2
/// cache (which panicked), rows of another head size (written glued or
/// misplaced), non-i64 or too few slots, a zero or subnormal fp8 scale
/// (which stored +-448 or NaN).
fn raw_op_validates_operands(dev: &Device) -> Result<()> {
    let cache = sentinel(GEOM, DType::F32, dev)?;
    let flat = Tensor::zeros((16, 16), DType::F32, dev)?;
    expect_err(
        raw_store(&flat, &rows(2, 2, 8, dev)?, &[0, 1], 1.0),
        &["reshape-and-cache: the cache must have rank 4 [num_blocks, block_size, num_kv_heads, head_size], got shape [16, 16]"],
    )?;
    expect_err(
        raw_store(&cache, &rows(2, 2, 16, dev)?, &[0, 1], 1.0),
        &["the new values have 2 heads of size 16 but the cache has 2 heads of size 8"],
    )?;
    // Same row length, other head layout.
    expect_err(
        raw_store(&cache, &rows(2, 4, 4, dev)?, &[0, 1], 1.0),
        &["the new values have 4 heads of size 4 but the cache has 2 heads of size 8"],
    )?;
    expect_err(
        raw_store(&cache, &rows(2, 2, 8, dev)?.flatten_from(1)?, &[0, 1], 1.0),
        &["the new values must have rank 3"],
    )?;
    let new = rows(2, 2, 8, dev)?;
    let u32_slots = Tensor::new(&[0u32, 1], dev)?;
    expect_err(
        cache.inplace_op3(&new, &u32_slots, &ReshapeAndCache { scale: 1.0 }),
        &["slot_mapping must be i64, got U32"],
    )?;
    expect_err(
        raw_store(&cache, &new, &[0], 1.0),
        &["slot_mapping has 1 entries but there are 2 new tokens"],
    )?;
    expect_err(
        raw_store(&cache, &new.to_dtype(DType::F16)?, &[0, 1], 1.0),
        &["the cache must be F16 (the new values' dtype) or F8E4M3, got F32"],
    )?;
    let fp8 = sentinel(GEOM, DType::F8E4M3, dev)?;
    expect_err(
        raw_store(&fp8, &new, &[0, 1], 0.0),
        &["reshape-and-cache: scale must be finite and > 0, got 0"],
    )?;
    expect_err(
        raw_store(&fp8, &new, &[0, 1], 1e-45),
        &["scale 1e-45 is subnormal; it must be at least f32::MIN_POSITIVE = 1.1754944e-38"],
    )?;
    ensure!(host(&cache)?.iter().all(|&x| x == -7.0), "a cache changed");
    ensure!(
        host(&fp8)?.iter().all(|&x| x == -7.0),
        "the fp8 cache changed"
    );
    // A valid raw call writes.
    raw_store(&cache, &new, &[3, -1], 1.0)?;
    ensure!(host(&cache)?[3 * 16..4 * 16] == host(&new)?[..16]);
    Ok(())
}

/// Of two tokens with one slot in a raw CPU call, the last one wins.
#[test]
fn raw_op_duplicate_slots_last_write_wins_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    let cache = sentinel(GEOM, DType::F32, &dev)?;
    let new = rows(3, 2, 8, &dev)?;
    raw_store(&cache, &new, &[6, 2, 6], 1.0)?;
    let (got, new) = (host(&cache)?, host(&new)?);
    ensure!(
        got[6 * 16..7 * 16] == new[2 * 16..3 * 16],
        "slot 6 is not token 2"
    );
    ensure!(
        got[2 * 16..3 * 16] == new[16..2 * 16],
        "slot 2 is not token 1"
    );
    Ok(())
}

// ---- reshape_and_cache -----------------------------------------------------------

/// One tensor, or two views of one allocation, as both caches is an error
/// (values were stored over keys).
fn aliased_caches_are_an_error(dev: &Device) -> Result<()> {
    let kc = sentinel(GEOM, DType::F32, dev)?;
    let k = rows(2, 2, 8, dev)?;
    let slots = SlotMapping::new(&[0, 5], dev)?;
    let msg = "reshape-and-cache: key_cache and value_cache share one allocation; they must be distinct tensors";
    expect_err(
        reshape_and_cache(&k, &k, &kc, &kc, &slots, KvScales::default()),
        &[msg],
    )?;
    let view = kc.reshape(GEOM)?;
    expect_err(
        reshape_and_cache(&k, &k, &kc, &view, &slots, KvScales::default()),
        &[msg],
    )?;
    expect_err(
        LayerKvCache::from_tensors(kc.clone(), view),
        &["kv-cache: the key and value caches share one allocation"],
    )?;
    ensure!(host(&kc)?.iter().all(|&x| x == -7.0), "the cache changed");
    Ok(())
}

/// A slot mapping with a slot twice is an error (on CUDA which token would
/// land there is unspecified); padding may repeat.
fn duplicate_slots_are_an_error(dev: &Device) -> Result<()> {
    expect_err(
        SlotMapping::new(&[3, -1, 7, 3, -1], dev),
        &["reshape-and-cache: slot_mapping holds slot 3 twice (tokens 0 and 3)"],
    )?;
    let ok = SlotMapping::new(&[3, -1, 7, 4, -1], dev)?;
    ensure!(ok.max_slot() == Some(7));
    Ok(())
}

/// Head size 0 names the problem (it was "dst has repeated elements").
/// (CPU only, as for zero heads.)
#[test]
fn zero_head_size_is_a_clear_error() -> Result<()> {
    let dev = &Device::Cpu;
    let kc = Tensor::zeros((4, 4, 2, 0), DType::F32, dev)?;
    let vc = Tensor::zeros((4, 4, 2, 0), DType::F32, dev)?;
    let k = Tensor::zeros((2, 2, 0), DType::F32, dev)?;
    expect_err(
        reshape_and_cache(&k, &k, &kc, &vc, &SlotMapping::new(&[0, 1], dev)?, KvScales::default()),
        &["reshape-and-cache: key_cache has block_size 4, 2 heads and head_size 0; all must be positive"],
    )
}

/// Padding-only tokens need no cache at all: an empty cache is fine.
/// (CPU only, as for zero heads.)
#[test]
fn padding_into_an_empty_cache_is_a_no_op() -> Result<()> {
    let dev = &Device::Cpu;
    let kc = Tensor::zeros((0, 4, 2, 8), DType::F32, dev)?;
    let vc = Tensor::zeros((0, 4, 2, 8), DType::F32, dev)?;
    let k = rows(2, 2, 8, dev)?;
    reshape_and_cache(
        &k,
        &k,
        &kc,
        &vc,
        &SlotMapping::new(&[-1, -1], dev)?,
        KvScales::default(),
    )?;
    expect_err(
        reshape_and_cache(
            &k,
            &k,
            &kc,
            &vc,
            &SlotMapping::new(&[-1, 0], dev)?,
            KvScales::default(),
        ),
        &["slot_mapping holds slot 0 >= num_blocks * block_size = 0"],
    )
}

// ---- scales, sinks, slopes -----------------------------------------------------------

/// Subnormal scales (whose reciprocal is infinite) are errors wherever a
/// scale enters: fp8 stores (they stored NaN), fp8 reads, the fp8 output
/// (1e-45 turned zeros into NaN), the layer's fp8 options.
fn subnormal_scales_are_errors(dev: &Device) -> Result<()> {
    let fp8 = sentinel(GEOM, DType::F8E4M3, dev)?;
    let fp8_v = sentinel(GEOM, DType::F8E4M3, dev)?;
    let k = rows(2, 2, 8, dev)?;
    let slots = SlotMapping::new(&[0, 1], dev)?;
    let sub = "k_scale 1e-45 is subnormal; it must be at least f32::MIN_POSITIVE = 1.1754944e-38";
    expect_err(
        reshape_and_cache(&k, &k, &fp8, &fp8_v, &slots, KvScales::new(1e-45, 1.0)),
        &["reshape-and-cache: ", sub],
    )?;
    let batch = PagedBatch::from_rows(&[0, 2], &[2], &[vec![0]], 4, dev)?;
    let q = rows(2, 2, 8, dev)?;
    let p = PagedAttentionParams::new(&fp8, &fp8_v, &batch, 0.3)
        .with_kv_scales(KvScales::new(1e-45, 1.0));
    expect_err(paged_attention(&q, &p), &["paged-attention: ", sub])?;
    let kc = sentinel(GEOM, DType::F32, dev)?;
    let vc = sentinel(GEOM, DType::F32, dev)?;
    let p = PagedAttentionParams::new(&kc, &vc, &batch, 0.3).with_output_scale(Some(1e-45));
    expect_err(
        paged_attention(&q, &p),
        &["paged-attention: output_scale 1e-45 is subnormal"],
    )?;
    // The smallest normal scale works and keeps zeros zero.
    let zeros = q.zeros_like()?;
    let p = PagedAttentionParams::new(&kc.zeros_like()?, &vc.zeros_like()?, &batch, 0.3)
        .with_output_scale(Some(f32::MIN_POSITIVE));
    ensure!(host(&paged_attention(&zeros, &p)?)?
        .iter()
        .all(|&x| x == 0.0));
    let opts = AttentionOptions {
        kv_cache_dtype: KvCacheDtype::Fp8E4M3(KvScales::new(1.0, 3e-39)),
        ..Default::default()
    };
    expect_err(
        Attention::new(2, 2, 8, 0.3, opts),
        &["attention: v_scale 3e-39 is subnormal"],
    )
}

/// Non-finite sinks or ALiBi slopes are rejected once, when the layer is
/// built (they gave zeros).
fn nonfinite_sinks_and_slopes_are_rejected_by_the_layer(dev: &Device) -> Result<()> {
    let bad = [
        (
            "sinks",
            Tensor::new(&[0.5f32, f32::NAN, 1.0, 0.0], dev)?,
            "attention: sinks[1] is NaN; sinks must be finite",
        ),
        (
            "sinks",
            Tensor::new(&[0.5f32, 1.0, f32::INFINITY, 0.0], dev)?,
            "attention: sinks[2] is inf; sinks must be finite",
        ),
        (
            "alibi_slopes",
            Tensor::new(&[f32::NEG_INFINITY, 1.0, 1.0, 0.0], dev)?,
            "attention: alibi_slopes[0] is -inf; alibi_slopes must be finite",
        ),
        (
            "alibi_slopes",
            Tensor::new(&[0.1f32, 0.2, 0.3, f32::NAN], dev)?.to_dtype(DType::BF16)?,
            "attention: alibi_slopes[3] is NaN",
        ),
    ];
    for (name, t, msg) in bad {
        let opts = if name == "sinks" {
            AttentionOptions {
                sinks: Some(t),
                ..Default::default()
            }
        } else {
            AttentionOptions {
                alibi_slopes: Some(t),
                ..Default::default()
            }
        };
        expect_err(Attention::new(4, 2, 8, 0.3, opts), &[msg])?;
    }
    let good = AttentionOptions {
        sinks: Some(Tensor::new(&[0.5f32, -3.0, 1.0, 0.0], dev)?),
        alibi_slopes: Some(Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], dev)?),
        ..Default::default()
    };
    Attention::new(4, 2, 8, 0.3, good)?;
    Ok(())
}

// ---- metadata ---------------------------------------------------------------------------

/// A prefill of 3 tokens (blocks 0, 1) and a decode at position 4 (blocks
/// 2, 3, 4), blocks of 2 tokens.
fn two_seq_batch(dev: &Device) -> Result<PagedBatch> {
    Ok(PagedBatch::from_rows(
        &[0, 3, 4],
        &[3, 5],
        &[vec![0, 1], vec![2, 3, 4]],
        2,
        dev,
    )?)
}

/// Every slot must be the cache row its position is read from through its
/// sequence's table (a slot elsewhere stored the token where attention
/// never reads it, and attention read stale data instead).
#[test]
fn slots_must_match_the_block_tables() -> Result<()> {
    let dev = Device::Cpu;
    let ok = AttentionMetadata::new(
        two_seq_batch(&dev)?,
        SlotMapping::new(&[0, 1, -1, 8], &dev)?,
    )?;
    ensure!(ok.slot_mapping().host() == [0, 1, -1, 8]);
    expect_err(
        AttentionMetadata::new(two_seq_batch(&dev)?, SlotMapping::new(&[0, 1, 2, 9], &dev)?),
        &["attention-metadata: slot_mapping[3] = 9 but token 0 of sequence 1 (position 4) belongs in slot 8 (block_tables[1][2] = 4, row 0)"],
    )?;
    // Another sequence's block.
    expect_err(
        AttentionMetadata::new(two_seq_batch(&dev)?, SlotMapping::new(&[0, 1, 4, 8], &dev)?),
        &["slot_mapping[2] = 4 but token 2 of sequence 0 (position 2) belongs in slot 2"],
    )?;
    // The window group's slots are checked against the group's tables.
    let group = PagedBatch::from_rows(&[0, 3, 4], &[3, 5], &[vec![5, 6], vec![0, 0, 7]], 2, &dev)?;
    let meta =
        AttentionMetadata::new(two_seq_batch(&dev)?, SlotMapping::new(&[0, 1, 2, 8], &dev)?)?;
    expect_err(
        meta.with_window_group(4, group, SlotMapping::new(&[10, 11, 12, 8], &dev)?),
        &["attention-metadata: window group 4 slot_mapping[3] = 8 but token 0 of sequence 1 (position 4) belongs in slot 14"],
    )?;
    Ok(())
}

/// Prefix ranges reach the window group's batch (they were dropped), and
/// a range that reaches back into blocks the group may have recycled is
/// an error.
#[test]
fn prefix_ranges_reach_window_groups() -> Result<()> {
    let dev = Device::Cpu;
    let ranges = vec![vec![0..3], vec![3..5]];
    let batch = two_seq_batch(&dev)?.with_prefix_ranges(&ranges)?;
    let group = PagedBatch::from_rows(&[0, 3, 4], &[3, 5], &[vec![5, 6], vec![0, 0, 7]], 2, &dev)?;
    let meta = AttentionMetadata::new(batch.clone(), SlotMapping::new(&[0, 1, 2, 8], &dev)?)?
        .with_window_group(4, group.clone(), SlotMapping::new(&[10, 11, 12, 14], &dev)?)?;
    let layer = meta.for_layer(Some(4), None)?;
    ensure!(layer.batch.host().prefix_ranges() == ranges);
    ensure!(layer.batch.host().block_tables() == [5, 6, 0, 0, 0, 7]);
    ensure!(layer.batch.prefix_ranges().is_some());
    // Window 2: the decode (position 4) keeps blocks from position 2 on;
    // range 0..5 would reach positions 0 and 1.
    let reach_back = two_seq_batch(&dev)?.with_prefix_ranges(&[vec![], vec![0..5]])?;
    let meta = AttentionMetadata::new(reach_back, SlotMapping::new(&[0, 1, 2, 8], &dev)?)?;
    expect_err(
        meta.with_window_group(2, group.clone(), SlotMapping::new(&[10, 11, 12, 14], &dev)?),
        &["attention-metadata: prefix range 0..5 of sequence 1 reaches keys before position 2, whose blocks window group 2 may have recycled"],
    )?;
    // A group batch with ranges of its own that differ is an error.
    let meta = AttentionMetadata::new(batch, SlotMapping::new(&[0, 1, 2, 8], &dev)?)?;
    expect_err(
        meta.with_window_group(
            4,
            group.with_prefix_ranges(&[vec![0..1], vec![]])?,
            SlotMapping::new(&[10, 11, 12, 14], &dev)?,
        ),
        &["window group 4 has prefix ranges [[0..1], []] but the batch has [[0..3], [3..5]]"],
    )?;
    Ok(())
}

/// Chunked-local layers move each range into its chunk's virtual sequence
/// (they were dropped); a range that reaches a new token across a chunk
/// boundary is an error; one that ends before the new tokens is moot.
fn prefix_ranges_in_chunked_local_layers(dev: &Device) -> Result<()> {
    let (heads, d, bs, chunk) = (2, 8, 2, 4);
    // One prefill of 10 tokens (chunks 0..4, 4..8, 8..10) in blocks 0..5.
    let batch = PagedBatch::from_rows(&[0, 10], &[10], &[vec![0, 1, 2, 3, 4]], bs, dev)?;
    let slots = SlotMapping::new(&(0..10).collect::<Vec<i64>>(), dev)?;
    let ranges = vec![vec![5..8, 8..10]];
    let meta = AttentionMetadata::new(batch.clone().with_prefix_ranges(&ranges)?, slots.clone())?;
    let local = meta.local_batch(None, chunk)?;
    ensure!(local.host().seq_lens() == [4, 4, 2]);
    ensure!(
        local.host().prefix_ranges() == vec![vec![], vec![1..4], vec![0..2]],
        "{:?}",
        local.host().prefix_ranges()
    );
    // Against a dense reference: key k is visible to query p when it lies
    // in p's chunk at or before p, or when both lie in one range.
    let kc = (rows(20, 1, d, dev)? * 0.1)?.reshape((10, bs, 1, d))?;
    let vc = rows(20, 1, d, dev)?.reshape((10, bs, 1, d))?;
    let q = (rows(10, heads, d, dev)? * 0.05)?;
    let out = host(&paged_attention(
        &q,
        &PagedAttentionParams::new(&kc, &vc, &local, 0.5),
    )?)?;
    let (kh, vh, qh) = (host(&kc)?, host(&vc)?, host(&q)?);
    for p in 0..10usize {
        for h in 0..heads {
            let visible: Vec<usize> = (0..10)
                .filter(|&k| {
                    (k / chunk == p / chunk && k <= p)
                        || ranges[0]
                            .iter()
                            .any(|r| r.contains(&(p as u32)) && r.contains(&(k as u32)))
                })
                .collect();
            let qv = &qh[(p * heads + h) * d..(p * heads + h + 1) * d];
            let scores: Vec<f64> = visible
                .iter()
                .map(|&k| {
                    0.5 * (0..d)
                        .map(|x| qv[x] as f64 * kh[k * d + x] as f64)
                        .sum::<f64>()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for x in 0..d {
                let want: f64 = visible
                    .iter()
                    .zip(&w)
                    .map(|(&k, w)| w * vh[k * d + x] as f64)
                    .sum::<f64>()
                    / sum;
                let got = out[(p * heads + h) * d + x] as f64;
                ensure!(
                    (got - want).abs() <= 1e-4 + 1e-4 * want.abs(),
                    "query {p} head {h} dim {x}: {got} vs {want}"
                );
            }
        }
    }
    // Crossing a chunk boundary.
    let crossing = AttentionMetadata::new(
        batch.clone().with_prefix_ranges(&[vec![2..6]])?,
        slots.clone(),
    )?;
    expect_err(
        crossing.local_batch(None, chunk),
        &["attention-metadata: prefix range 2..6 of sequence 0 crosses a boundary of attention_chunk_size 4"],
    )?;
    // Entirely in the context of a decode: no query lies in it.
    let decode = PagedBatch::from_rows(&[0, 1], &[10], &[vec![0, 1, 2, 3, 4]], bs, dev)?
        .with_prefix_ranges(&[vec![2..6]])?;
    let meta = AttentionMetadata::new(decode, SlotMapping::new(&[9], dev)?)?;
    let local = meta.local_batch(None, chunk)?;
    ensure!(local.host().prefix_ranges() == vec![Vec::<std::ops::Range<u32>>::new()]);
    Ok(())
}

// ---- device instantiation ---------------------------------------------------------------

device_test!(
    huge_attention_chunk_size_is_plain_causal,
    oversized_cache_is_refused,
    raw_op_validates_operands,
    aliased_caches_are_an_error,
    duplicate_slots_are_an_error,
    subnormal_scales_are_errors,
    nonfinite_sinks_and_slopes_are_rejected_by_the_layer,
    prefix_ranges_in_chunked_local_layers,
);
