//! Validation of `PagedBatch`, `paged_attention` and `reshape_and_cache`,
//! table-driven: each row of a table changes one thing in a valid base call
//! and names the error the ops must return (a message starting with the op
//! and containing every listed part: the argument and the bad value), or
//! the result a valid variant must give. Empty batches are valid.
//!
//! Each table runs as `NAME::cpu` and, with the `cuda` feature, as
//! `NAME::cuda` (see `common::device`); the GPU adds the device-mismatch rows.

// Prefix ranges are `Vec<Range<u32>>` per sequence: one-range vectors are meant.
#![allow(clippy::single_range_in_vec_init)]

#[macro_use]
mod common;

use std::ops::Range;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    paged_attention, reshape_and_cache, KvScales, KvSplit, PagedAttentionParams, PagedBatch,
    SlotMapping,
};

const PA: &str = "paged-attention: ";
const RC: &str = "reshape-and-cache: ";

/// How a row makes one tensor of a call: ones of `dims` and `dtype` on the
/// call's device (or on the CPU with `on_cpu`); `transposed` stores the
/// last two axes swapped (same shape, not contiguous).
#[derive(Clone, Debug)]
struct Spec {
    dims: Vec<usize>,
    dtype: DType,
    transposed: bool,
    on_cpu: bool,
}

impl Spec {
    fn new(dims: &[usize], dtype: DType) -> Self {
        Self {
            dims: dims.to_vec(),
            dtype,
            transposed: false,
            on_cpu: false,
        }
    }

    /// The same tensor on the CPU, whatever the call's device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn on_cpu(self) -> Self {
        Self {
            on_cpu: true,
            ..self
        }
    }

    /// Built on the CPU and moved (candle's CUDA backend has no f32 to
    /// `F8E4M3` cast).
    fn build(&self, dev: &Device) -> candle_core::Result<Tensor> {
        let device = if self.on_cpu { &Device::Cpu } else { dev };
        let mut dims = self.dims.clone();
        let rank = dims.len();
        if self.transposed {
            dims.swap(rank - 2, rank - 1);
        }
        let t = Tensor::ones(dims, DType::F32, &Device::Cpu)?
            .to_dtype(self.dtype)?
            .to_device(device)?;
        if self.transposed {
            t.transpose(rank - 2, rank - 1)
        } else {
            Ok(t)
        }
    }
}

fn build_option(spec: &Option<Spec>, dev: &Device) -> candle_core::Result<Option<Tensor>> {
    spec.as_ref().map(|s| s.build(dev)).transpose()
}

// ---- paged_attention --------------------------------------------------------

/// Every input of one `paged_attention` call, as data a row can change.
#[derive(Clone, Debug)]
struct PaCall {
    q: Spec,
    key_cache: Spec,
    value_cache: Spec,
    cu_seqlens_q: Vec<u32>,
    seq_lens: Vec<u32>,
    /// Row-major, `width` ids per sequence.
    block_tables: Vec<u32>,
    width: usize,
    /// When set, the batch is built from these rows (`PagedBatch::from_rows`).
    table_rows: Option<Vec<Vec<u32>>>,
    block_size: usize,
    prefix_ranges: Option<Vec<Vec<Range<u32>>>>,
    batch_on_cpu: bool,
    scale: f32,
    sliding_window: Option<usize>,
    softcap: Option<f32>,
    alibi_slopes: Option<Spec>,
    sinks: Option<Spec>,
    qq_bias: Option<Spec>,
    kv_scales: KvScales,
    output_scale: Option<f32>,
    kv_split: KvSplit,
}

impl PaCall {
    /// The valid call: 4 query heads over 2 KV heads of size 8, 4 blocks of 4
    /// tokens; a prefill of 3 tokens (block 1) and a decode after 4 cached
    /// tokens (blocks 2, 3); f32 everywhere.
    fn valid() -> Self {
        Self {
            q: Spec::new(&[4, 4, 8], DType::F32),
            key_cache: Spec::new(&[4, 4, 2, 8], DType::F32),
            value_cache: Spec::new(&[4, 4, 2, 8], DType::F32),
            cu_seqlens_q: vec![0, 3, 4],
            seq_lens: vec![3, 5],
            block_tables: vec![1, 0, 2, 3],
            width: 2,
            table_rows: None,
            block_size: 4,
            prefix_ranges: None,
            batch_on_cpu: false,
            scale: 0.35,
            sliding_window: None,
            softcap: None,
            alibi_slopes: None,
            sinks: None,
            qq_bias: None,
            kv_scales: KvScales::default(),
            output_scale: None,
            kv_split: KvSplit::Auto,
        }
    }

    /// Applies `f` to both caches.
    fn caches(&mut self, f: impl Fn(&mut Spec)) {
        f(&mut self.key_cache);
        f(&mut self.value_cache);
    }

    fn batch(&self, dev: &Device) -> candle_core::Result<PagedBatch> {
        let dev = if self.batch_on_cpu { &Device::Cpu } else { dev };
        let (cu, lens, bs) = (&self.cu_seqlens_q, &self.seq_lens, self.block_size);
        let batch = match &self.table_rows {
            Some(rows) => PagedBatch::from_rows(cu, lens, rows, bs, dev)?,
            None => PagedBatch::new(cu, lens, &self.block_tables, self.width, bs, dev)?,
        };
        match &self.prefix_ranges {
            Some(ranges) => batch.with_prefix_ranges(ranges),
            None => Ok(batch),
        }
    }

    fn run(&self, dev: &Device) -> candle_core::Result<Tensor> {
        let (kc, vc) = (self.key_cache.build(dev)?, self.value_cache.build(dev)?);
        let params = PagedAttentionParams::new(&kc, &vc, &self.batch(dev)?, self.scale)
            .with_sliding_window(self.sliding_window)
            .with_softcap(self.softcap)
            .with_alibi_slopes(build_option(&self.alibi_slopes, dev)?)
            .with_sinks(build_option(&self.sinks, dev)?)
            .with_qq_bias(build_option(&self.qq_bias, dev)?)
            .with_kv_scales(self.kv_scales)
            .with_output_scale(self.output_scale)
            .with_kv_split(self.kv_split);
        paged_attention(&self.q.build(dev)?, &params)
    }
}

/// Checks that `r` failed with a message starting with `prefix` and
/// containing every one of `parts`.
fn expect_err<T: std::fmt::Debug>(
    r: candle_core::Result<T>,
    prefix: &str,
    parts: &[&str],
) -> Result<()> {
    let msg = match r {
        Ok(v) => anyhow::bail!("expected an error containing {parts:?}, got Ok({v:?})"),
        Err(e) => e.to_string(),
    };
    ensure!(
        msg.starts_with(prefix),
        "message {msg:?} does not start with {prefix:?}"
    );
    for p in parts {
        ensure!(msg.contains(p), "message {msg:?} does not contain {p:?}");
    }
    Ok(())
}

/// Runs the base call changed by `mutate` and expects its error.
fn expect_pa_err(dev: &Device, mutate: fn(&mut PaCall), parts: &[&str]) -> Result<()> {
    let mut call = PaCall::valid();
    mutate(&mut call);
    expect_err(call.run(dev).map(|t| t.dims().to_vec()), PA, parts)
}

device_test! {
    /// (row, change to the valid call, parts of the expected message).
    // The query.
    #[case::q_rank_2(|c: &mut PaCall| c.q.dims = vec![4, 32], &["q must have rank 3", "[4, 32]"])]
    #[case::q_rank_4(
        |c: &mut PaCall| c.q.dims = vec![4, 4, 8, 1],
        &["q must have rank 3", "[4, 4, 8, 1]"]
    )]
    #[case::q_dtype_f64(
        |c: &mut PaCall| c.q.dtype = DType::F64,
        &["q must be f32, f16 or bf16", "F64"]
    )]
    #[case::q_dtype_u32(
        |c: &mut PaCall| c.q.dtype = DType::U32,
        &["q must be f32, f16 or bf16", "U32"]
    )]
    #[case::q_dtype_f8e4m3(
        |c: &mut PaCall| c.q.dtype = DType::F8E4M3,
        &["q must be f32, f16 or bf16", "F8E4M3"]
    )]
    #[case::q_head_size_differs_from_cache(
        |c: &mut PaCall| c.q.dims = vec![4, 4, 16],
        &["q has head_size 16", "key_cache has head_size 8"]
    )]
    #[case::head_size_too_large(
        |c: &mut PaCall| {
            c.q.dims = vec![4, 4, 520];
            c.caches(|s| s.dims = vec![4, 4, 2, 520]);
        },
        &["head_size", "520"]
    )]
    #[case::heads_5_not_divisible(
        |c: &mut PaCall| c.q.dims = vec![4, 5, 8],
        &["num_heads 5 is not a multiple of num_kv_heads 2"]
    )]
    #[case::heads_3_not_divisible(
        |c: &mut PaCall| c.q.dims = vec![4, 3, 8],
        &["num_heads 3 is not a multiple of num_kv_heads 2"]
    )]
    #[case::heads_1_not_divisible(
        |c: &mut PaCall| c.q.dims = vec![4, 1, 8],
        &["num_heads 1 is not a multiple of num_kv_heads 2"]
    )]
    #[case::num_tokens_differs_from_cu_seqlens_q(
        |c: &mut PaCall| c.q.dims = vec![5, 4, 8],
        &["cu_seqlens_q ends at 4", "q has 5 tokens"]
    )]
    // The caches.
    #[case::key_cache_wrong_rank(
        |c: &mut PaCall| c.caches(|s| s.dims = vec![16, 2, 8]),
        &["key_cache must have rank 4", "[16, 2, 8]"]
    )]
    #[case::value_cache_shape_differs(
        |c: &mut PaCall| c.value_cache.dims = vec![5, 4, 2, 8],
        &["value_cache shape [5, 4, 2, 8]", "key_cache shape [4, 4, 2, 8]"]
    )]
    #[case::key_and_value_cache_dtypes_differ(
        |c: &mut PaCall| c.value_cache.dtype = DType::F8E4M3,
        &["key_cache is F32", "value_cache is F8E4M3"]
    )]
    #[case::cache_f16_for_f32_query(
        |c: &mut PaCall| c.caches(|s| s.dtype = DType::F16),
        &["key_cache must be F32 (the query dtype) or F8E4M3, got F16"]
    )]
    #[case::cache_f32_for_bf16_query(
        |c: &mut PaCall| c.q.dtype = DType::BF16,
        &["key_cache must be BF16 (the query dtype) or F8E4M3, got F32"]
    )]
    #[case::cache_not_contiguous(
        |c: &mut PaCall| c.caches(|s| s.transposed = true),
        &["must be contiguous"]
    )]
    #[case::block_size_of_batch_differs_from_cache(
        |c: &mut PaCall| {
            c.block_tables = vec![1, 2];
            c.width = 1;
            c.block_size = 8;
        },
        &["block_size 8", "block_size 4"]
    )]
    #[case::block_id_not_below_num_blocks(
        |c: &mut PaCall| c.block_tables = vec![1, 0, 2, 4],
        &["block id 4 >= num_blocks 4"]
    )]
    // The batch.
    #[case::cu_seqlens_q_not_starting_at_0(
        |c: &mut PaCall| c.cu_seqlens_q = vec![1, 3, 4],
        &["cu_seqlens_q must start at 0, got 1"]
    )]
    #[case::cu_seqlens_q_decreasing(
        |c: &mut PaCall| c.cu_seqlens_q = vec![0, 3, 2],
        &["cu_seqlens_q must be non-decreasing", "cu_seqlens_q[1] = 3 > cu_seqlens_q[2] = 2"]
    )]
    #[case::cu_seqlens_q_length_differs_from_seq_lens(
        |c: &mut PaCall| c.cu_seqlens_q = vec![0, 3],
        &["cu_seqlens_q has 2 entries but seq_lens has 2"]
    )]
    #[case::q_len_longer_than_seq_len(
        |c: &mut PaCall| {
            c.cu_seqlens_q = vec![0, 3, 5];
            c.seq_lens = vec![3, 1];
        },
        &["sequence 1 has q_len 2 > seq_len 1"]
    )]
    #[case::block_table_too_narrow(
        |c: &mut PaCall| c.seq_lens = vec![3, 9],
        &["block_tables has width 2", "sequence 1 with seq_len 9 needs 3 blocks"]
    )]
    #[case::block_table_length_differs_from_width(
        |c: &mut PaCall| c.block_tables = vec![1, 0, 2],
        &["block_tables holds 3 ids", "2 sequences x width 2 need 4"]
    )]
    #[case::block_table_rows_differ_from_seq_lens(
        |c: &mut PaCall| c.table_rows = Some(vec![vec![1]]),
        &["block_tables has 1 rows", "seq_lens describes 2 sequences"]
    )]
    #[case::block_size_zero(
        |c: &mut PaCall| c.block_size = 0,
        &["block_size must be positive, got 0"]
    )]
    #[case::prefix_ranges_count_differs_from_sequences(
        |c: &mut PaCall| c.prefix_ranges = Some(vec![vec![0..2]]),
        &["prefix_ranges has 1 entries", "batch has 2 sequences"]
    )]
    #[case::prefix_range_start_after_end(
        |c: &mut PaCall| c.prefix_ranges = Some(vec![vec![], vec![Range { start: 3, end: 1 }]]),
        &["prefix_ranges[1] = 3..1 has start > end"]
    )]
    #[case::prefix_range_past_seq_len(
        |c: &mut PaCall| c.prefix_ranges = Some(vec![vec![0..4], vec![]]),
        &["prefix_ranges[0] = 0..4 ends past seq_len 3"]
    )]
    // Scalars.
    #[case::scale_nan(|c: &mut PaCall| c.scale = f32::NAN, &["scale must be finite", "NaN"])]
    #[case::scale_inf(|c: &mut PaCall| c.scale = f32::INFINITY, &["scale must be finite", "inf"])]
    #[case::sliding_window_zero(
        |c: &mut PaCall| c.sliding_window = Some(0),
        &["sliding_window must be at least 1, got 0"]
    )]
    #[case::softcap_negative(
        |c: &mut PaCall| c.softcap = Some(-1.0),
        &["softcap must be finite and >= 0", "-1"]
    )]
    #[case::softcap_nan(
        |c: &mut PaCall| c.softcap = Some(f32::NAN),
        &["softcap must be finite and >= 0", "NaN"]
    )]
    #[case::softcap_inf(
        |c: &mut PaCall| c.softcap = Some(f32::INFINITY),
        &["softcap must be finite and >= 0", "inf"]
    )]
    #[case::fp8_k_scale_zero(
        |c: &mut PaCall| {
            c.caches(|s| s.dtype = DType::F8E4M3);
            c.kv_scales = KvScales::new(0.0, 1.0);
        },
        &["k_scale must be finite and > 0, got 0"]
    )]
    #[case::fp8_k_scale_negative(
        |c: &mut PaCall| {
            c.caches(|s| s.dtype = DType::F8E4M3);
            c.kv_scales = KvScales::new(-2.0, 1.0);
        },
        &["k_scale must be finite and > 0, got -2"]
    )]
    #[case::fp8_v_scale_nan(
        |c: &mut PaCall| {
            c.caches(|s| s.dtype = DType::F8E4M3);
            c.kv_scales = KvScales::new(1.0, f32::NAN);
        },
        &["v_scale must be finite and > 0, got NaN"]
    )]
    #[case::fp8_v_scale_inf(
        |c: &mut PaCall| {
            c.caches(|s| s.dtype = DType::F8E4M3);
            c.kv_scales = KvScales::new(1.0, f32::INFINITY);
        },
        &["v_scale must be finite and > 0, got inf"]
    )]
    #[case::output_scale_zero(
        |c: &mut PaCall| c.output_scale = Some(0.0),
        &["output_scale must be finite and > 0", "got 0"]
    )]
    #[case::output_scale_negative(
        |c: &mut PaCall| c.output_scale = Some(-0.5),
        &["output_scale must be finite and > 0", "got -0.5"]
    )]
    #[case::output_scale_nan(
        |c: &mut PaCall| c.output_scale = Some(f32::NAN),
        &["output_scale must be finite and > 0", "got NaN"]
    )]
    #[case::output_scale_inf(
        |c: &mut PaCall| c.output_scale = Some(f32::INFINITY),
        &["output_scale must be finite and > 0", "got inf"]
    )]
    #[case::kv_split_zero_segments(
        |c: &mut PaCall| c.kv_split = KvSplit::Segments(0),
        &["kv_split Segments(0)"]
    )]
    // Per-head vectors and qq_bias.
    #[case::alibi_slopes_wrong_shape(
        |c: &mut PaCall| c.alibi_slopes = Some(Spec::new(&[5], DType::F32)),
        &["alibi_slopes must have shape [num_heads = 4], got [5]"]
    )]
    #[case::sinks_wrong_shape(
        |c: &mut PaCall| c.sinks = Some(Spec::new(&[5], DType::F32)),
        &["sinks must have shape [num_heads = 4], got [5]"]
    )]
    #[case::alibi_slopes_wrong_dtype(
        |c: &mut PaCall| c.alibi_slopes = Some(Spec::new(&[4], DType::F16)),
        &["alibi_slopes must be f32, got F16"]
    )]
    #[case::sinks_wrong_dtype(
        |c: &mut PaCall| c.sinks = Some(Spec::new(&[4], DType::F16)),
        &["sinks must be f32, got F16"]
    )]
    #[case::qq_bias_too_few_rows(
        |c: &mut PaCall| c.qq_bias = Some(Spec::new(&[2, 3], DType::F32)),
        &["qq_bias has 2 rows", "longest query span is 3"]
    )]
    #[case::qq_bias_wrong_rank(
        |c: &mut PaCall| c.qq_bias = Some(Spec::new(&[3], DType::F32)),
        &["qq_bias must have rank 2", "[3]"]
    )]
    #[case::qq_bias_wrong_dtype(
        |c: &mut PaCall| c.qq_bias = Some(Spec::new(&[3, 3], DType::BF16)),
        &["qq_bias must be f32, got BF16"]
    )]
    fn paged_attention_rejects(
        dev: &Device,
        #[case] mutate: fn(&mut PaCall),
        #[case] parts: &[&str],
    ) -> Result<()> {
        expect_pa_err(dev, mutate, parts)
    }
}

cuda_test! {
    /// Inputs on another device than the query (here the CPU).
    #[case::key_cache_on_cpu(
        |c: &mut PaCall| c.caches(|s| s.on_cpu = true),
        &["key_cache is on Cpu but the query is on Cuda"]
    )]
    #[case::value_cache_on_cpu(
        |c: &mut PaCall| c.value_cache.on_cpu = true,
        &["value_cache is on Cpu but the query is on Cuda"]
    )]
    #[case::batch_on_cpu(
        |c: &mut PaCall| c.batch_on_cpu = true,
        &["batch is on Cpu but the query is on Cuda"]
    )]
    #[case::alibi_slopes_on_cpu(
        |c: &mut PaCall| c.alibi_slopes = Some(Spec::new(&[4], DType::F32).on_cpu()),
        &["alibi_slopes is on Cpu but the query is on Cuda"]
    )]
    #[case::sinks_on_cpu(
        |c: &mut PaCall| c.sinks = Some(Spec::new(&[4], DType::F32).on_cpu()),
        &["sinks is on Cpu but the query is on Cuda"]
    )]
    #[case::qq_bias_on_cpu(
        |c: &mut PaCall| c.qq_bias = Some(Spec::new(&[3, 3], DType::F32).on_cpu()),
        &["qq_bias is on Cpu but the query is on Cuda"]
    )]
    fn paged_attention_rejects_other_devices(
        dev: &Device,
        #[case] mutate: fn(&mut PaCall),
        #[case] parts: &[&str],
    ) -> Result<()> {
        expect_pa_err(dev, mutate, parts)
    }
}

device_test! {
    /// (row, change to the valid call, output dims and dtype).
    #[case::valid_call(|_: &mut PaCall| {}, [4, 4, 8], DType::F32)]
    #[case::block_ids_past_a_sequence_are_not_checked(
        // Sequence 0 needs one block; its second column is padding.
        |c: &mut PaCall| c.block_tables = vec![1, 99, 2, 3],
        [4, 4, 8],
        DType::F32
    )]
    #[case::kv_scales_ignored_for_plain_cache(
        |c: &mut PaCall| c.kv_scales = KvScales::new(0.0, -1.0),
        [4, 4, 8],
        DType::F32
    )]
    #[case::empty_batch_no_sequences(
        |c: &mut PaCall| {
            (c.cu_seqlens_q, c.seq_lens, c.block_tables, c.width) = (vec![0], vec![], vec![], 0);
            c.q = Spec::new(&[0, 4, 8], DType::BF16);
            c.caches(|s| s.dtype = DType::BF16);
        },
        [0, 4, 8],
        DType::BF16
    )]
    #[case::empty_batch_no_new_tokens(
        |c: &mut PaCall| {
            (c.cu_seqlens_q, c.block_tables) = (vec![0, 0, 0], vec![1; 4]);
            c.q = Spec::new(&[0, 4, 8], DType::BF16);
            c.caches(|s| s.dtype = DType::BF16);
        },
        [0, 4, 8],
        DType::BF16
    )]
    fn paged_attention_accepts(
        dev: &Device,
        #[case] mutate: fn(&mut PaCall),
        #[case] dims: [usize; 3],
        #[case] dtype: DType,
    ) -> Result<()> {
        let mut call = PaCall::valid();
        mutate(&mut call);
        let out = call.run(dev)?;
        ensure!(out.dims() == dims, "output shape {:?}, expected {dims:?}", out.dims());
        ensure!(out.dtype() == dtype, "output dtype {:?}, expected {dtype:?}", out.dtype());
        Ok(())
    }
}

// ---- reshape_and_cache -------------------------------------------------------

/// Every input of one `reshape_and_cache` call, as data a row can change.
#[derive(Clone, Debug)]
struct RcCall {
    key: Spec,
    value: Spec,
    key_cache: Spec,
    value_cache: Spec,
    slots: Vec<i64>,
    slots_on_cpu: bool,
    scales: KvScales,
}

impl RcCall {
    /// The valid call: 3 tokens of 2 KV heads of size 8 into slots 0, 1, 2
    /// of caches of 4 blocks of 4 tokens; f32 everywhere.
    fn valid() -> Self {
        Self {
            key: Spec::new(&[3, 2, 8], DType::F32),
            value: Spec::new(&[3, 2, 8], DType::F32),
            key_cache: Spec::new(&[4, 4, 2, 8], DType::F32),
            value_cache: Spec::new(&[4, 4, 2, 8], DType::F32),
            slots: vec![0, 1, 2],
            slots_on_cpu: false,
            scales: KvScales::default(),
        }
    }

    /// Applies `f` to the key and the value.
    fn tokens(&mut self, f: impl Fn(&mut Spec)) {
        f(&mut self.key);
        f(&mut self.value);
    }

    /// Applies `f` to both caches.
    fn caches(&mut self, f: impl Fn(&mut Spec)) {
        f(&mut self.key_cache);
        f(&mut self.value_cache);
    }

    fn run(&self, dev: &Device) -> candle_core::Result<()> {
        let slots_dev = if self.slots_on_cpu { &Device::Cpu } else { dev };
        reshape_and_cache(
            &self.key.build(dev)?,
            &self.value.build(dev)?,
            &self.key_cache.build(dev)?,
            &self.value_cache.build(dev)?,
            &SlotMapping::new(&self.slots, slots_dev)?,
            self.scales,
        )
    }
}

/// Runs the base call changed by `mutate` and expects its error.
fn expect_rc_err(dev: &Device, mutate: fn(&mut RcCall), parts: &[&str]) -> Result<()> {
    let mut call = RcCall::valid();
    mutate(&mut call);
    expect_err(call.run(dev), RC, parts)
}

device_test! {
    /// (row, change to the valid call, parts of the expected message).
    #[case::key_and_value_shapes_differ(
        |c: &mut RcCall| c.value.dims = vec![2, 2, 8],
        &["key shape [3, 2, 8] differs from value shape [2, 2, 8]"]
    )]
    #[case::cache_shapes_differ(
        |c: &mut RcCall| c.value_cache.dims = vec![4, 5, 2, 8],
        &["key_cache shape [4, 4, 2, 8] differs from value_cache shape [4, 5, 2, 8]"]
    )]
    #[case::key_wrong_rank(
        |c: &mut RcCall| c.tokens(|s| s.dims = vec![3, 16]),
        &["key must have rank 3", "[3, 16]"]
    )]
    #[case::cache_wrong_rank(
        |c: &mut RcCall| c.caches(|s| s.dims = vec![16, 2, 8]),
        &["key_cache must have rank 4", "[16, 2, 8]"]
    )]
    #[case::key_wrong_dtype(
        |c: &mut RcCall| c.tokens(|s| s.dtype = DType::F64),
        &["key must be f32, f16 or bf16, got F64"]
    )]
    #[case::cache_dtype_mismatch(
        |c: &mut RcCall| {
            c.tokens(|s| s.dtype = DType::BF16);
            c.caches(|s| s.dtype = DType::F16);
        },
        &["key_cache must be BF16 (the key dtype) or F8E4M3, got F16"]
    )]
    #[case::value_cache_dtype_mismatch(
        |c: &mut RcCall| c.value_cache.dtype = DType::F16,
        &["value_cache must be F32 (the value dtype) or F8E4M3, got F16"]
    )]
    #[case::heads_mismatch(
        |c: &mut RcCall| c.tokens(|s| s.dims = vec![3, 2, 16]),
        &["key has 2 heads of size 16", "key_cache has 2 heads of size 8"]
    )]
    #[case::slot_mapping_length(
        |c: &mut RcCall| c.slots = vec![0, 1, 2, 3],
        &["slot_mapping has 4 entries", "key has 3 tokens"]
    )]
    #[case::slot_past_capacity(
        |c: &mut RcCall| c.slots = vec![0, 16, -1],
        &["slot_mapping holds slot 16 >= num_blocks * block_size = 16"]
    )]
    #[case::fp8_k_scale_zero(
        |c: &mut RcCall| {
            c.caches(|s| s.dtype = DType::F8E4M3);
            c.scales = KvScales::new(0.0, 1.0);
        },
        &["k_scale must be finite and > 0, got 0"]
    )]
    #[case::fp8_v_scale_negative(
        |c: &mut RcCall| {
            c.caches(|s| s.dtype = DType::F8E4M3);
            c.scales = KvScales::new(1.0, -1.0);
        },
        &["v_scale must be finite and > 0, got -1"]
    )]
    #[case::fp8_k_scale_nan(
        |c: &mut RcCall| {
            c.caches(|s| s.dtype = DType::F8E4M3);
            c.scales = KvScales::new(f32::NAN, 1.0);
        },
        &["k_scale must be finite and > 0, got NaN"]
    )]
    #[case::cache_not_contiguous(
        |c: &mut RcCall| c.caches(|s| s.transposed = true),
        &["key_cache must be contiguous"]
    )]
    fn reshape_and_cache_rejects(
        dev: &Device,
        #[case] mutate: fn(&mut RcCall),
        #[case] parts: &[&str],
    ) -> Result<()> {
        expect_rc_err(dev, mutate, parts)
    }
}

cuda_test! {
    /// Tokens or slots on another device than the caches (here the CPU).
    #[case::key_on_cpu(
        |c: &mut RcCall| c.tokens(|s| s.on_cpu = true),
        &["key is on Cpu but key_cache is on Cuda"]
    )]
    #[case::slot_mapping_on_cpu(
        |c: &mut RcCall| c.slots_on_cpu = true,
        &["slot_mapping is on Cpu but key_cache is on Cuda"]
    )]
    fn reshape_and_cache_rejects_other_devices(
        dev: &Device,
        #[case] mutate: fn(&mut RcCall),
        #[case] parts: &[&str],
    ) -> Result<()> {
        expect_rc_err(dev, mutate, parts)
    }
}

device_test! {
    /// (row, change to the valid call): the call succeeds.
    #[case::valid_call(|_: &mut RcCall| {})]
    #[case::no_tokens(|c: &mut RcCall| {
        c.tokens(|s| s.dims = vec![0, 2, 8]);
        c.slots = vec![];
    })]
    fn reshape_and_cache_accepts(dev: &Device, #[case] mutate: fn(&mut RcCall)) -> Result<()> {
        let mut call = RcCall::valid();
        mutate(&mut call);
        Ok(call.run(dev)?)
    }
}

/// `q_len` of a sequence index past the batch is `None`, not a panic.
#[test]
fn q_len_out_of_range_is_none() -> Result<()> {
    let batch = PagedBatch::from_rows(&[0, 2, 5], &[2, 4], &[vec![0], vec![1]], 4, &Device::Cpu)?;
    let host = batch.host();
    ensure!(host.q_len(0) == Some(2) && host.q_len(1) == Some(3));
    for i in [2, 3, usize::MAX] {
        ensure!(host.q_len(i).is_none(), "q_len({i}) = {:?}", host.q_len(i));
    }
    let empty = PagedBatch::from_rows(&[0], &[], &[], 4, &Device::Cpu)?;
    ensure!(empty.host().q_len(0).is_none());
    Ok(())
}
