//! The CUDA launch plan against the device: every launch's resident-program
//! figure (what its split-KV waves and prefill tile are sized with) equals
//! the driver's occupancy of the kernel it runs, at the threads and dynamic
//! shared memory it launches with; and split-KV calls stay exact through a
//! run of calls of different shapes that reuse the workspace (and, under
//! `CANDLE_PAGED_ATTENTION_SPLIT_MERGE=launch`, where the last program of
//! each decode group merges the partials in the attention launch itself,
//! its arrival counters; by default the reduce launch merges them, and
//! the stream-decode instances merge their own); and decodes take the
//! stream-decode instances where one serves. GPU only: without the `cuda`
//! feature this binary is empty.
#![cfg(feature = "cuda")]

#[macro_use]
mod common;

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use candle_paged_attention::{cuda_launch_residency, launch_plans_made, KvSplit};
use common::case::Case;
use common::check::{check_case, run_op};

/// The (major, minor) compute capability of the CUDA device `dev`.
fn compute_capability(dev: &Device) -> Result<(i32, i32)> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    let Device::Cuda(cuda) = dev else {
        anyhow::bail!("a cuda device expected, got {:?}", dev.location());
    };
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    Ok((
        ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// A labelled batch, its sequences as (new tokens, keys) and the launches
/// its plan makes.
type Batch = (&'static str, &'static [(usize, usize)], usize);

cuda_test! {
    /// For decode, prefill and mixed batches of each head size, query dtype
    /// and cache kind: the plan's programs per SM equal the driver's, and
    /// never exceed what shared memory alone allows.
    fn plan_residency_matches_the_driver(
        dev: &Device,
        #[values(32, 64, 128, 256, 512)] head_size: usize,
        #[values(DType::BF16, DType::F16)] dtype: DType,
        #[values(false, true)] fp8: bool,
    ) -> Result<()> {
        // (label, sequences as (new tokens, keys), parts expected).
        let batches: [Batch; 4] = [
            ("decode", &[(1, 1024); 4], 1),
            ("long decode", &[(1, 3000)], 1),
            ("prefill", &[(300, 300), (77, 500)], 1),
            ("mixed", &[(1, 2000), (200, 700), (1, 65)], 2),
        ];
        for (label, seqs, parts) in batches {
            let case = Case::new(seqs, (16, 4), head_size, 16, dtype).with_fp8_cache(fp8);
            let inputs = case.build(dev)?;
            let params = case.params(&inputs);
            let launches = cuda_launch_residency(&inputs.q, &params)?;
            ensure!(
                launches.len() == parts,
                "{label} h{head_size}: {} launches, {parts} expected: {launches:?}",
                launches.len()
            );
            // One sequence x 4 KV heads: far from a wave, so the decode splits.
            if label == "long decode" {
                ensure!(launches[0].segments > 1, "{label} h{head_size}: {launches:?}");
            }
            for l in &launches {
                ensure!(
                    l.planned_resident == l.driver_resident
                        && l.driver_resident >= 1
                        && l.driver_resident <= l.smem_resident,
                    "{label} h{head_size} {dtype:?} fp8={fp8}: plan and driver disagree: {l:?}"
                );
            }
        }
        Ok(())
    }
}

cuda_test! {
    /// On a device of compute capability 9.0, long 16-bit prefills of head
    /// size 64, 128 and 256 take a warpgroup instance (128 or, with
    /// `CANDLE_PAGED_ATTENTION_PREFILL_ROWS=64`, 64 rows) unless
    /// `CANDLE_PAGED_ATTENTION_WGMMA=0`, over 16-bit and fp8 caches; other
    /// head sizes and other devices the mma.sync ones.
    fn hopper_prefills_take_the_warpgroup_instance(dev: &Device) -> Result<()> {
        let cc = compute_capability(dev)?;
        let env = |v: &str| std::env::var(v).unwrap_or_default();
        let on = cc == (9, 0) && env("CANDLE_PAGED_ATTENTION_WGMMA") != "0";
        // The warp-specialised instance where forced: these rows see 512
        // keys on average, below the default policy's threshold.
        let ws = on && env("CANDLE_PAGED_ATTENTION_WS") == "1";
        for (head_size, fp8, has_instance) in [
            (128, false, true),
            (64, false, true),
            (128, true, true),
            (256, false, true),
            (32, false, false),
        ] {
            let case = Case::new(&[(1024, 1024); 4], (16, 4), head_size, 16, DType::BF16)
                .with_fp8_cache(fp8);
            let inputs = case.build(dev)?;
            let plan = candle_paged_attention::cuda_launch_plan(&inputs.q, &case.params(&inputs))?;
            // 16-bit caches at head 64 / 128: the warp-specialised instance.
            let expected = match (on && has_instance, ws && !fp8 && head_size <= 128) {
                (true, true) => "prefill-wgmma-ws",
                (true, false) => "prefill-wgmma",
                _ => "prefill",
            };
            ensure!(plan == expected, "h{head_size} fp8={fp8} on sm_{}{}: {plan}", cc.0, cc.1);
        }
        Ok(())
    }
}

cuda_test! {
    /// Decodes of head size 64, 128 and 256 over blocks of 16 take the
    /// stream-decode instance (merging their split-KV partials in the same
    /// launch) unless `CANDLE_PAGED_ATTENTION_STREAM=0`; head size 32 and
    /// blocks of 8 take the unified kernel's decode instance; either way the
    /// output matches the reference.
    fn decodes_take_the_stream_instance(dev: &Device) -> Result<()> {
        let env = |v: &str| std::env::var(v).unwrap_or_default();
        let on = env("CANDLE_PAGED_ATTENTION_STREAM") != "0";
        let merge = env("CANDLE_PAGED_ATTENTION_SPLIT_MERGE");
        for (head_size, block_size, fp8, has_instance) in [
            (128, 16, false, true),
            (64, 32, true, true),
            (256, 16, false, true),
            (32, 16, false, false),
            (128, 8, false, false),
        ] {
            let case = Case::new(&[(1, 2000)], (8, 2), head_size, block_size, DType::BF16)
                .with_fp8_cache(fp8)
                .with_seed(head_size as u64);
            let inputs = case.build(dev)?;
            let plan = candle_paged_attention::cuda_launch_plan(&inputs.q, &case.params(&inputs))?;
            let stream = on && has_instance;
            // `CANDLE_PAGED_ATTENTION_STREAM=wide`: the wide h128 instance.
            let wide = env("CANDLE_PAGED_ATTENTION_STREAM") == "wide" && head_size == 128;
            let expected = match (stream, wide) {
                (true, true) => "stream-wide split-kv(",
                (true, false) => "stream split-kv(",
                (false, _) => "decode split-kv(",
            };
            ensure!(plan.starts_with(expected), "h{head_size} bs{block_size}: {plan}");
            let reduced = plan.ends_with("+ reduce");
            let want_reduce = if stream { merge == "reduce" } else { merge != "launch" };
            ensure!(reduced == want_reduce, "h{head_size} bs{block_size}: {plan}");
            check_case(&case, dev)?;
        }
        Ok(())
    }
}

cuda_test! {
    /// A head-128 decode batch whose (sequence, KV head) groups fill a wave
    /// of the default stream instance (`_r8`) and fit one of the wide one
    /// (`_r8w`, more programs per SM) takes the wide instance, unsplit, and
    /// so does a mixed batch with as many decodes (in one launch, under
    /// `CANDLE_PAGED_ATTENTION_OVERLAP=one-launch`, the 8-row instance,
    /// split or not); both match the reference. Under `CANDLE_PAGED_ATTENTION_STREAM=0` they take the
    /// unified kernel's decode instance.
    fn one_wave_decodes_take_the_wide_instance(dev: &Device) -> Result<()> {
        let Device::Cuda(cuda) = dev else {
            anyhow::bail!("a cuda device expected, got {:?}", dev.location());
        };
        let off = std::env::var("CANDLE_PAGED_ATTENTION_STREAM").is_ok_and(|v| v == "0");
        // A mixed batch in one launch keeps the 8-row stream instance.
        let one_launch = std::env::var("CANDLE_PAGED_ATTENTION_OVERLAP")
            .is_ok_and(|v| v.starts_with("one-launch"));
        // The device's SMs (from any launch) and the driver's programs per
        // SM of `_r8` and of the wide instance.
        let probe = Case::new(&[(1, 64)], (32, 8), 128, 16, DType::BF16);
        let inputs = probe.build(dev)?;
        let launch = cuda_launch_residency(&inputs.q, &probe.params(&inputs))?;
        let Some(sms) = launch.first().map(|l| l.sms) else {
            anyhow::bail!("no launch for a bf16 decode");
        };
        let reports = candle_paged_attention::kernel_instance_reports(cuda)?;
        let resident = |name: &str| -> Result<usize> {
            let report = reports.iter().find(|r| r.name == name);
            report
                .map(|r| r.driver_resident)
                .ok_or_else(|| anyhow::anyhow!("no instance {name}"))
        };
        let narrow = resident("unified_attention_h128_stream_r8_bf16")?;
        let wide = resident("unified_attention_h128_stream_r8w_bf16")?;
        ensure!(narrow < wide, "{narrow} and {wide} programs per SM");
        // The fewest sequences (8 groups each) that fill a wave of `_r8`.
        let seqs = (narrow * sms).div_ceil(8);
        let decodes = vec![(1, 700); seqs];
        let mut mixed = decodes.clone();
        mixed.extend([(300, 900), (77, 77)]);
        for (label, batch) in [("decode", &decodes), ("mixed", &mixed)] {
            let case = Case::new(batch, (32, 8), 128, 16, DType::BF16).with_seed(seqs as u64);
            let inputs = case.build(dev)?;
            let plan = candle_paged_attention::cuda_launch_plan(&inputs.q, &case.params(&inputs))?;
            let expected = match (off, one_launch && label == "mixed") {
                (true, _) => "decode",
                (false, true) => "stream",
                (false, false) => "stream-wide",
            };
            let decode_part = plan.split(" + ").next().unwrap_or_default();
            // In one launch the 8-row instance may split: these groups fill
            // a wave of the wide one, not of it.
            let splits_allowed = off || (one_launch && label == "mixed");
            ensure!(
                decode_part.starts_with(expected)
                    && !(expected == "stream" && decode_part.starts_with("stream-wide"))
                    && (splits_allowed || !decode_part.contains("split")),
                "{label}, {seqs} sequences on {sms} SMs: {plan}"
            );
            check_case(&case, dev)?;
        }
        Ok(())
    }
}

cuda_test! {
    /// f32 queries run the scalar kernel: no tensor-core launch to report.
    fn scalar_path_has_no_plan(dev: &Device) -> Result<()> {
        let case = Case::new(&[(1, 100)], (4, 2), 64, 16, DType::F32);
        let inputs = case.build(dev)?;
        let launches = cuda_launch_residency(&inputs.q, &case.params(&inputs))?;
        ensure!(launches.is_empty(), "{launches:?}");
        Ok(())
    }
}

cuda_test! {
    /// Split-KV calls of different shapes, one after the other on one
    /// device (so they share the workspace and its arrival counters, which
    /// every launch must leave at zero), each checked against the reference:
    /// mostly empty segments, sinks with an fp8 cache and fp8 output, a
    /// mixed batch whose decode launch splits alone (Auto, its partials
    /// indexed by (sequence, row)) or whose two launches both split, split
    /// prefills, two value chunks
    /// (head size 512), a sliding window; then the first call again.
    fn merged_split_calls_in_a_row(dev: &Device) -> Result<()> {
        let empty_segments = Case::new(&[(1, 40), (1, 3000), (1, 1)], (8, 2), 128, 16, DType::BF16)
            .with_kv_split(KvSplit::Segments(64))
            .with_seed(3);
        let cases = [
            empty_segments.clone(),
            Case::new(&[(1, 900), (1, 64), (1, 2500)], (8, 8), 64, 16, DType::BF16)
                .with_fp8_cache(true)
                .with_sinks(true)
                .with_output_scale(Some(0.5))
                .with_kv_split(KvSplit::Segments(11))
                .with_seed(5),
            Case::new(&[(1, 5000), (40, 300), (2, 900)], (16, 4), 128, 16, DType::F16)
                .with_sinks(true)
                .with_kv_split(KvSplit::Auto)
                .with_seed(7),
            Case::new(&[(1, 700), (70, 400), (3, 1200)], (8, 2), 64, 16, DType::BF16)
                .with_kv_split(KvSplit::Segments(5))
                .with_seed(9),
            Case::new(&[(100, 300), (37, 37), (1, 800)], (8, 2), 64, 16, DType::F16)
                .with_sinks(true)
                .with_kv_split(KvSplit::Segments(4))
                .with_seed(10),
            Case::new(&[(90, 90), (33, 1000)], (4, 4), 128, 16, DType::BF16)
                .with_fp8_cache(true)
                .with_kv_split(KvSplit::Segments(6))
                .with_seed(12),
            Case::new(&[(1, 600), (2, 333)], (4, 2), 512, 16, DType::BF16)
                .with_kv_split(KvSplit::Segments(3))
                .with_seed(11),
            Case::new(&[(1, 4000), (1, 100)], (8, 1), 256, 16, DType::F16)
                .with_window(Some(500))
                .with_kv_split(KvSplit::Segments(8))
                .with_seed(13),
            empty_segments,
        ];
        for case in &cases {
            check_case(case, dev)?;
        }
        Ok(())
    }
}

cuda_test! {
    /// A mixed batch (a split decode launch and a prefill launch, which
    /// by default runs on the device's side stream beside it, forked and
    /// joined inside the capture) captured in a CUDA graph twice: the way
    /// the engine and the benchmark capture (cudarc's event tracking off),
    /// and with the tracking on, which a side stream made by cudarc would
    /// break (docs/perf.md, versions 9 and 10): each replay writes exactly
    /// what the eager call wrote, and the eager call matches the
    /// reference; over a 16-bit cache with sinks, and over an fp8 cache
    /// with a window.
    fn mixed_batches_replay_in_a_cuda_graph(dev: &Device) -> Result<()> {
        let Device::Cuda(cuda) = dev else {
            anyhow::bail!("a cuda device expected, got {:?}", dev.location());
        };
        let mut seqs = vec![(1, 2000); 40];
        seqs.insert(5, (200, 700));
        seqs.push((90, 90));
        let cases = [
            Case::new(&seqs, (16, 4), 128, 16, DType::BF16).with_sinks(true).with_seed(31),
            Case::new(&seqs, (8, 2), 64, 16, DType::F16)
                .with_fp8_cache(true)
                .with_window(Some(256))
                .with_seed(32),
        ];
        for case in &cases {
            check_case(case, dev)?;
            let inputs = case.build(dev)?;
            let params = case.params(&inputs);
            let plan = candle_paged_attention::cuda_launch_plan(&inputs.q, &params)?;
            ensure!(plan.contains(" + prefill"), "{plan}");
            let eager = run_op(case, &inputs)?;
            for tracking in [false, true] {
                let replayed = capture_and_replay(cuda, &inputs.q, &params, tracking)?;
                ensure!(replayed.len() == eager.len(), "{} vs {}", replayed.len(), eager.len());
                let differ = eager
                    .iter()
                    .zip(&replayed)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                ensure!(
                    differ == 0,
                    "{plan} (event tracking {tracking}): {differ} of {} elements differ",
                    eager.len()
                );
            }
        }
        Ok(())
    }

}

cuda_test! {
    /// Under `CANDLE_PAGED_ATTENTION_OVERLAP=one-launch` (or
    /// `one-launch-prefill-first`) on a device of compute capability 9.0,
    /// mixed batches over 16-bit caches at head sizes 64 and 128 (8- and
    /// 16-row stream tiles, bf16 and f16) run both parts in one launch; fp8
    /// caches and head size 256 run two. Under any other policy none runs
    /// one. Every case matches the reference, with its decode part split
    /// (few sequences, long keys) and unsplit (many).
    fn mixed_batches_take_one_launch_where_asked(dev: &Device) -> Result<()> {
        let cc = compute_capability(dev)?;
        let env = |v: &str| std::env::var(v).unwrap_or_default();
        let asked = cc == (9, 0)
            && env("CANDLE_PAGED_ATTENTION_OVERLAP").starts_with("one-launch")
            && env("CANDLE_PAGED_ATTENTION_WGMMA") != "0"
            && env("CANDLE_PAGED_ATTENTION_STREAM") != "0"
            && env("CANDLE_PAGED_ATTENTION_PREFILL_ROWS") != "128";
        let few: Vec<(usize, usize)> = vec![(1, 3000), (300, 300), (1, 65), (77, 500)];
        let mut many = vec![(1, 900); 40];
        many.insert(7, (200, 700));
        many.push((513, 1400));
        // (heads, head size, dtype, fp8 cache, an instance serves it)
        let kinds = [
            ((16, 4), 128, DType::BF16, false, true),
            ((16, 1), 128, DType::BF16, false, true),
            ((9, 3), 64, DType::F16, false, true),
            ((32, 2), 64, DType::BF16, false, true),
            ((16, 4), 128, DType::BF16, true, false),
            ((8, 2), 256, DType::BF16, false, false),
        ];
        for (i, (heads, head_size, dtype, fp8, has)) in kinds.into_iter().enumerate() {
            for (j, seqs) in [&few, &many].into_iter().enumerate() {
                let case = Case::new(seqs, heads, head_size, 16, dtype)
                    .with_fp8_cache(fp8)
                    .with_seed((10 * i + j) as u64);
                let inputs = case.build(dev)?;
                let plan =
                    candle_paged_attention::cuda_launch_plan(&inputs.q, &case.params(&inputs))?;
                let label = format!("{heads:?} h{head_size} {dtype:?} fp8={fp8} batch {j}");
                ensure!(plan.contains(" + prefill"), "{label}: {plan}");
                ensure!(
                    plan.ends_with("(one launch)") == (asked && has),
                    "{label}: {plan} (one launch asked: {asked})"
                );
                check_case(&case, dev)?;
            }
        }
        Ok(())
    }
}

cuda_test! {
    /// The layers of one kind share one launch plan per batch: repeated
    /// calls over one batch (the layers of a model) plan once and launch
    /// the same programs (bit-identical outputs); a layer of another kind
    /// (a sliding window) plans once more, and a new batch plans anew.
    fn one_plan_per_batch_and_layer_kind(dev: &Device) -> Result<()> {
        let case = Case::new(&[(1, 2000), (200, 700), (1, 65)], (16, 4), 128, 16, DType::BF16);
        let inputs = case.build(dev)?;
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let before = launch_plans_made();
        let first = bits(run_op(&case, &inputs)?);
        for layer in 1..4 {
            let again = bits(run_op(&case, &inputs)?);
            ensure!(again == first, "layer {layer}: the output differs from layer 0's");
        }
        ensure!(
            launch_plans_made() - before == 1,
            "4 layers over one batch made {} plans, 1 expected",
            launch_plans_made() - before
        );
        let windowed = case.clone().with_window(Some(256));
        run_op(&windowed, &inputs)?;
        run_op(&windowed, &inputs)?;
        ensure!(
            launch_plans_made() - before == 2,
            "a second layer kind: {} plans in all, 2 expected",
            launch_plans_made() - before
        );
        let next = case.clone().with_seed(7).build(dev)?;
        run_op(&case, &next)?;
        ensure!(
            launch_plans_made() - before == 3,
            "a new batch: {} plans in all, 3 expected",
            launch_plans_made() - before
        );
        Ok(())
    }
}

/// Captures one forward on `cuda`'s stream into a CUDA graph, with
/// cudarc's event tracking off (as the engine and the benchmark
/// capture) or left on, replays it once and reads the replay's output
/// as f32 (which holds every bf16/f16 value), as `run_op` reads its own.
fn capture_and_replay(
    cuda: &candle_core::CudaDevice,
    q: &candle_core::Tensor,
    params: &candle_paged_attention::PagedAttentionParams,
    tracking: bool,
) -> Result<Vec<f32>> {
    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUgraphInstantiate_flags, CUstreamCaptureMode,
    };
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    stream.synchronize()?;
    if !tracking {
        // SAFETY: as in the engine's capture: the forward runs on this
        // one stream (and the side stream it forks and joins), and the
        // tracking is back on before the output is read.
        unsafe { ctx.disable_event_tracking() };
    }
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = candle_paged_attention::paged_attention(q, params);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    let launched = graph.map(|g| g.map(|g| (g.launch(), g)));
    stream.synchronize()?;
    if !tracking {
        // SAFETY: the stream is idle (synchronized above).
        unsafe { ctx.enable_event_tracking() };
    }
    let out = captured?;
    let (launch, _graph) =
        launched?.ok_or_else(|| anyhow::anyhow!("the capture recorded nothing"))?;
    launch?;
    Ok(out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}
