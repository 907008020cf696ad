//! Launch planning of `PagedAttention` on CUDA: which tile shapes a call
//! launches (one part, or two for a batch that mixes decode-shaped and
//! longer sequences) and how many split-KV segments each part uses.
//!
//! Every figure about the device comes from the caller: the SM count from
//! `DeviceLimits` and the programs of each instance resident per SM from a
//! `resident` function (on a GPU, the driver's occupancy of the instance
//! the launch uses, see `occupancy`; in the host tests, the arithmetic
//! estimate `resident_programs` over fake limits).
//!
//! Owns `Merge`, `Part`, `Plan`, `plan`, `resident_programs`, `choose_segments` and
//! `MAX_SEGMENTS`. Pure host-side arithmetic on the batch's host copies and
//! the figures it is given: it allocates and launches nothing.
//!
//! Imports `params` and the sibling CUDA modules; never `ops` or `cpu`.

use candle_core::{bail, Result};

use super::policy::{LaunchPolicy, Overlap, StreamMode, WsMode};
use super::tiles::{
    instance_name, mixed_instance, smem_bytes, stream_tile, stream_wide_tile, tile_shape,
    wgmma_tile, wgmma_ws_tile, Kind, MixedInstance, TileShape, HEAD_SIZES,
};
use super::{AttnModule, DeviceLimits};
use crate::params::{AttentionDims, KvSplit, PagedAttentionParams};

const OP: &str = "paged-attention";

/// Most split-KV segments per (sequence, KV head).
pub(crate) const MAX_SEGMENTS: usize = 256;

/// Who merges the split-KV partials of a part with more than one segment
/// (defined with the launch policy that may force it).
///
/// Stream-decode parts plan `InLaunch` (their merge is an online merge over
/// batches of segments, one L2 round trip per 16 segments; docs/perf.md,
/// version 7). The unified kernel's decode-shaped parts plan `Reduce`: on
/// an H200 (docs/perf.md, version 5) that second launch was as fast or
/// faster than their in-launch merge on every split decode case of the
/// benchmark (b256 L1k 343.8 against 378.0 µs, b1 L8k 31.9 against
/// 34.6 µs). The policy's `split_merge` forces one or the other for every
/// decode-shaped part, which the GPU tests run too.
pub(super) use super::policy::Merge;

/// One launch of the tensor-core kernel: a tile shape and the sequences
/// (by new-token count) whose programs do work.
#[derive(Clone, Copy, Debug)]
pub(super) struct Part {
    pub(super) kind: Kind,
    pub(super) tile: TileShape,
    /// Split-KV segments of this launch (1: it writes the output).
    pub(super) segments: usize,
    /// Who merges the partials when `segments > 1`.
    pub(super) merge: Merge,
    /// Programs of this launch's instance resident per SM, as the plan was
    /// given them (what its split-KV waves are sized with).
    pub(super) resident: usize,
    pub(super) group_entries: usize,
    pub(super) head_chunks: usize,
    pub(super) grid_x: usize,
    pub(super) q_len_min: usize,
    pub(super) q_len_max: usize,
    /// Stream decode merged in the launch: sequences whose keys span at
    /// most this many 16-key steps run unsplit, decided by the programs
    /// from the sequence's length (0: every sequence takes `segments`;
    /// see `LaunchPolicy::single_segment_keys`).
    pub(super) single_segment_steps: usize,
}

/// How one call is launched: one part, or two for a batch that mixes
/// sequences that fit a decode-shaped program with longer ones.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    pub(super) head: usize,
    pub(super) dv_chunks: usize,
    /// 0: split-KV partial rows are tokens; else rows per sequence (partial
    /// row `seq * ws_seq_rows + row`), for a mixed batch's decode launch.
    pub(super) ws_seq_rows: usize,
    pub(super) parts: [Option<Part>; 2],
    /// Both parts in one launch of this instance (a mixed batch under
    /// `Overlap::OneLaunch`; kernels/mixed_attention.cuh): `parts[0]` is
    /// then a stream-decode part and `parts[1]` a 64-row warpgroup prefill
    /// part, each planned as for a launch of its own.
    pub(super) one_launch: Option<MixedInstance>,
}

/// The kernel instance one part launches: its name, threads and dynamic
/// shared memory per program, and the module it is in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Instance {
    pub(super) name: String,
    pub(super) threads: usize,
    pub(super) smem: usize,
    pub(super) module: AttnModule,
}

impl Plan {
    /// The instance `part` launches for `dtype_name` (`"bf16"`/`"f16"`)
    /// queries over a plain or fp8 cache.
    pub(super) fn instance(&self, part: &Part, dtype_name: &str, fp8: bool) -> Instance {
        Instance {
            name: instance_name(self.head, part.kind, &part.tile, dtype_name, fp8),
            threads: part.tile.threads(),
            smem: smem_bytes(&part.tile, self.head, fp8),
            module: AttnModule::of(&part.tile),
        }
    }
}

/// The part of `kind` with tile `tile` serving the sequences whose new-token
/// count lies in `q_lens` (inclusive), before any split-KV.
fn part(
    kind: Kind,
    tile: TileShape,
    dims: &AttentionDims,
    num_seqs: usize,
    q_lens: (usize, usize),
) -> Part {
    let group = dims.group_size();
    let group_entries = group.min(tile.rows());
    let block_q = tile.rows() / group_entries;
    // A decode-shaped launch serves spans of at most `block_q` rows: one
    // program per sequence.
    let grid_x = match kind {
        Kind::Decode | Kind::Stream => num_seqs,
        Kind::Prefill => dims.num_tokens / block_q + num_seqs,
    };
    Part {
        kind,
        tile,
        segments: 1,
        merge: match kind {
            Kind::Stream => Merge::InLaunch,
            Kind::Decode | Kind::Prefill => Merge::Reduce,
        },
        resident: 1,
        group_entries,
        head_chunks: group.div_ceil(group_entries),
        grid_x,
        q_len_min: q_lens.0,
        q_len_max: q_lens.1,
        single_segment_steps: 0,
    }
}

thread_local! {
    /// Launch plans made by this thread (see [`launch_plans_made`]).
    static PLANS_MADE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many launch plans the calling thread has made: a forward plans once
/// per batch and layer kind (the layers of one kind share the plan through
/// the batch's memo), and each `cuda_launch_plan` report makes one. Counted
/// per thread, so that forwards on other threads (tests running side by
/// side) do not change the count.
pub fn launch_plans_made() -> usize {
    PLANS_MADE.with(std::cell::Cell::get)
}

/// Programs of an instance resident per SM: `resident(kind, tile, head)`
/// for the instance of `kind` with `tile` at padded head size `head` (the
/// call's query dtype and cache kind).
pub(super) type ResidentFn<'a> = dyn Fn(Kind, &TileShape, usize) -> Result<usize> + 'a;

/// Mean keys per query row of a prefill part from which the default
/// policy takes the warp-specialised prefill instance (head sizes 64 and
/// 128). Its programs (one per SM) pay more per program than the warpgroup
/// ones (two per SM, whose start and end overlap the other's key loop) and
/// less per key tile. Measured on an H100 against the warpgroup instance
/// (docs/perf.md, kernels "Version 16"), as the warpgroup instance's time
/// over its own: at head size 128, 1.11-1.16x at 4,096-4,352 keys per row
/// (an 8k prompt, 512-token chunks after 4k), 0.95x at 2,048 (a 4k
/// prompt), 0.68-0.77x at 1,024 (2k prompts); at head size 64 (version
/// 15's kernels), 1.01-1.11x at 4,096-4,352, 1.19-1.34x at 8,192-16,640,
/// 0.64-0.88x at 1,024-2,048.
pub(super) const WS_MIN_MEAN_KEYS: usize = 4096;

/// Whether the prefill part of `params`' batch (sequences with more than
/// `fits` new tokens) has rows that see at least [`WS_MIN_MEAN_KEYS`] keys
/// on average (the sliding window, if any, bounding each).
fn ws_prefill(params: &PagedAttentionParams, fits: usize) -> bool {
    let host = params.batch.host();
    let (mut rows, mut keys) = (0usize, 0usize);
    for (i, &seq_len) in host.seq_lens().iter().enumerate() {
        let q = host.q_len(i).unwrap_or(0);
        if q <= fits {
            continue;
        }
        let context = (seq_len as usize).saturating_sub(q);
        // Row r sees context + r + 1 keys: (q + 1) / 2 past the context on average.
        let mean = context + q.div_ceil(2);
        let mean = params.sliding_window.map_or(mean, |w| mean.min(w));
        rows += q;
        keys += q * mean;
    }
    rows > 0 && keys >= WS_MIN_MEAN_KEYS * rows
}

/// The launch plan of one call on a device with `limits` whose instances
/// fit `resident` programs per SM: the parts, their split-KV segments and
/// the workspace row layout. `aligned`: the query and the caches start on
/// 16 bytes (what the stream-decode instances need besides the head size).
/// `policy` says which instances and merges the plan may take.
pub(super) fn plan(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    limits: &DeviceLimits,
    aligned: bool,
    resident: &ResidentFn<'_>,
    policy: &LaunchPolicy,
) -> Result<Plan> {
    PLANS_MADE.with(|n| n.set(n.get() + 1));
    let sms = limits.sms;
    let host = params.batch.host();
    let Some(&head) = HEAD_SIZES.iter().find(|&&h| h >= dims.head_size) else {
        bail!(
            "{OP}: head_size {} exceeds the largest kernel (512)",
            dims.head_size
        );
    };
    let group = dims.group_size();
    let n = host.num_seqs();
    let fp8 = params.key_cache.dtype() == candle_core::DType::F8E4M3;
    let all = (0, i32::MAX as usize);
    // A step with prefills planned for a CUDA graph (`KvSplit::AutoUpTo`):
    // the plan depends on the batch's shape alone (sequences, tokens, table
    // width), never on its lengths, so a graph captured on one batch of the
    // shape replays any other. Both parts are launched (a part whose
    // sequences the batch lacks exits at once), the prefill tile is chosen
    // for the token count, the decode-shaped one for its longest span.
    let by_shape = matches!(params.kv_split, KvSplit::AutoUpTo(_)) && !host.is_pure_decode();
    // Longest span whose rows (times the packed heads) fit one decode-shaped program.
    let fits = 16 / group.min(16);
    // The decode-shaped launch's longest span: a stream-decode instance
    // serves it where one exists (`stream_decode_tile`).
    let decode_span = if by_shape {
        fits
    } else if host.max_seqlen_q() <= fits {
        host.max_seqlen_q().max(1)
    } else {
        (0..n)
            .map(|i| host.q_len(i).unwrap_or(0))
            .filter(|&q| q <= fits)
            .max()
            .unwrap_or(1)
    };
    let stream = stream_decode_tile(dims, fp8, head, decode_span, aligned, limits, policy);
    // Both a decode-shaped and a prefill part.
    let mixed_batch = by_shape
        || (host.max_seqlen_q() > fits
            && (0..n).any(|i| (1..=fits).contains(&host.q_len(i).unwrap_or(0))));
    let decode = tile_shape(Kind::Decode, head, false);
    // The prefill tiles: the warpgroup instances on a device of compute
    // capability 9.0 for their head sizes (unless the policy turns them
    // off), else the mma.sync ones.
    let wgmma = limits.wgmma && policy.wgmma;
    // A mixed batch in one launch where the policy asks for it and an
    // instance serves it: 16-bit caches, a stream-decode tile that has a
    // one-launch instance, and the 64-row warpgroup prefill tile.
    let one_launch = match (policy.overlap, stream) {
        (Overlap::OneLaunch { .. }, Some(tile))
            if wgmma && !fp8 && mixed_batch && policy.prefill_rows != Some(128) =>
        {
            mixed_instance(head, &tile)
        }
        _ => None,
    };
    let prefill_tile = |small| match wgmma_tile(head, small) {
        Some(tile) if wgmma => tile,
        _ => tile_shape(Kind::Prefill, head, small),
    };
    let (wide, narrow) = (prefill_tile(false), prefill_tile(true));
    // Prefill programs of 128 rows: less than a wave (of the programs the
    // device holds) takes 64-row ones. Above head size 128 the mma.sync
    // instances have one tile (of 64 rows).
    let small = match policy.prefill_rows {
        _ if one_launch.is_some() => true,
        Some(rows) => rows == 64,
        None if narrow == wide || (!by_shape && host.max_seqlen_q() <= fits) => false,
        None if by_shape => {
            // As below, with every token in the prefill part.
            dims.num_tokens.div_ceil(128 / group.min(128)) * dims.num_kv_heads * group.div_ceil(128)
                < resident(Kind::Prefill, &wide, head)? * sms
        }
        None => {
            let prefill_programs: usize = (0..n)
                .filter(|&i| host.q_len(i).unwrap_or(0) > fits)
                .map(|i| host.q_len(i).unwrap_or(0).div_ceil(128 / group.min(128)))
                .sum::<usize>()
                * dims.num_kv_heads
                * group.div_ceil(128);
            prefill_programs < resident(Kind::Prefill, &wide, head)? * sms
        }
    };
    // 128-row programs over a 16-bit cache with 16-byte loads: the
    // warp-specialised instance where there is one and the policy takes it
    // (by default for rows that see many keys, `ws_prefill`).
    let warp_specialized = wgmma
        && one_launch.is_none()
        && !fp8
        && aligned
        && match policy.warp_specialized {
            WsMode::Off => false,
            WsMode::On => true,
            WsMode::Auto => !by_shape && ws_prefill(params, fits),
        };
    let prefill = match wgmma_ws_tile(head) {
        _ if small => narrow,
        Some(tile) if warp_specialized => tile,
        _ => wide,
    };
    // The decode-shaped launch: a stream-decode instance where one serves
    // the call, else the unified kernel's.
    let decode_part = |q_lens| match stream {
        Some(tile) => part(Kind::Stream, tile, dims, n, q_lens),
        None => part(Kind::Decode, decode, dims, n, q_lens),
    };
    let parts = if by_shape {
        [
            Some(decode_part((1, fits))),
            Some(part(Kind::Prefill, prefill, dims, n, (fits + 1, all.1))),
        ]
    } else if host.max_seqlen_q() <= fits {
        [Some(decode_part(all)), None]
    } else if mixed_batch {
        [
            Some(decode_part((1, fits))),
            Some(part(Kind::Prefill, prefill, dims, n, (fits + 1, all.1))),
        ]
    } else {
        [Some(part(Kind::Prefill, prefill, dims, n, all)), None]
    };
    let dv_chunks = head / head.min(256);
    let mut parts = parts;
    for p in parts.iter_mut().flatten() {
        p.resident = resident(p.kind, &p.tile, head)?;
    }
    // The wide stream-decode instance where the decode part's groups fill
    // a wave of the default one and fit one wave of it (`prefer_wide`);
    // never in one launch with the prefill part.
    // Sequences of the decode-shaped launch (in a mixed batch, those whose
    // new tokens fit it).
    let decode_count = match parts {
        [_, None] => n,
        _ if by_shape => n,
        _ => (0..n)
            .filter(|&i| (1..=fits).contains(&host.q_len(i).unwrap_or(0)))
            .count(),
    };
    if let Some(p) = parts[0]
        .as_mut()
        .filter(|p| p.kind == Kind::Stream && one_launch.is_none())
    {
        let wide_tile = stream_wide_tile(head, p.tile.rows())
            .filter(|tile| smem_bytes(tile, head, fp8) <= limits.max_smem_per_block);
        if let Some(wide_tile) = wide_tile {
            let groups = decode_count * dims.num_kv_heads * p.head_chunks * dv_chunks;
            let wide_resident = resident(Kind::Stream, &wide_tile, head)?;
            if prefer_wide(policy.stream, groups, p.resident, wide_resident, sms) {
                p.tile = wide_tile;
                p.resident = wide_resident;
            }
        }
    }
    // Split the decode-shaped programs, one per (sequence, KV head, chunk),
    // into the segment count with the least modelled time on the resident
    // programs (`choose_segments`).
    let key_bytes = 2 * dims.head_size * params.key_cache.dtype().size_in_bytes();
    let auto_segments = |p: &Part, seqs: usize, max_keys: usize| {
        let active = seqs * dims.num_kv_heads * p.head_chunks * dv_chunks;
        let slots = p.resident * sms;
        let keys = params.sliding_window.map_or(max_keys, |w| w.min(max_keys));
        // A stream-decode segment can be one 16-key step per warp.
        let segment_keys = if p.kind == Kind::Stream { 64 } else { 128 };
        let segments = choose_segments(active, slots, keys, key_bytes, segment_keys);
        // A stream-decode split of one wave: at most one program per SM
        // over a 16-bit cache, two over fp8 (`one_wave_stream_programs`),
        // and still one wave of those.
        if p.kind == Kind::Stream && segments > 1 && active * segments <= slots {
            let one_wave = sms * p.resident.min(one_wave_stream_programs(fp8));
            let fit = (one_wave / active).max(1);
            return choose_segments(active, one_wave, keys, key_bytes, segment_keys).min(fit);
        }
        segments
    };
    let mut ws_seq_rows = 0;
    match (params.kv_split, &mut parts) {
        (KvSplit::Never, _) => {}
        (KvSplit::Segments(k), parts) => {
            for p in parts.iter_mut().flatten() {
                p.segments = (k as usize).clamp(1, MAX_SEGMENTS);
            }
        }
        (KvSplit::Auto, [Some(p), None]) if host.is_pure_decode() => {
            p.segments = auto_segments(p, n, host.max_seqlen_k());
        }
        (KvSplit::AutoUpTo(keys), [Some(p), None]) if host.is_pure_decode() => {
            p.segments = auto_segments(p, n, keys as usize);
        }
        (KvSplit::AutoUpTo(keys), [Some(d), Some(_)]) => {
            // As `Auto` below, sized for `keys` instead of the batch's lengths.
            d.segments = auto_segments(d, decode_count, keys as usize);
            if d.segments > 1 {
                ws_seq_rows = fits;
            }
        }
        (KvSplit::Auto, [Some(d), Some(_)]) => {
            // A mixed batch: only the decode-shaped launch splits; its
            // partials are indexed by (sequence, row) so the workspace does
            // not grow with the prefill tokens.
            let decode_seqs: Vec<usize> = (0..n)
                .filter(|&i| (1..=fits).contains(&host.q_len(i).unwrap_or(0)))
                .collect();
            let max_keys = decode_seqs
                .iter()
                .map(|&i| host.seq_lens()[i] as usize)
                .max()
                .unwrap_or(0);
            d.segments = auto_segments(d, decode_seqs.len(), max_keys);
            if d.segments > 1 {
                ws_seq_rows = fits;
            }
        }
        (KvSplit::Auto | KvSplit::AutoUpTo(_), _) => {}
    }
    if let Some(merge) = policy.split_merge {
        for p in parts.iter_mut().flatten() {
            if matches!(p.kind, Kind::Decode | Kind::Stream) {
                p.merge = merge;
            }
        }
    }
    // Splits the planner chose (not a forced count) of stream-decode parts
    // that merge in their launch: short sequences run unsplit.
    if matches!(params.kv_split, KvSplit::Auto | KvSplit::AutoUpTo(_)) {
        for p in parts.iter_mut().flatten() {
            if p.kind == Kind::Stream && p.segments > 1 && p.merge == Merge::InLaunch {
                p.single_segment_steps = policy.single_segment_keys / 16;
            }
        }
    }
    Ok(Plan {
        head,
        dv_chunks,
        ws_seq_rows,
        parts,
        one_launch,
    })
}

/// The stream-decode tile for the decode-shaped launch of a call at padded
/// head size `head` whose decode-shaped spans have at most `span` new
/// tokens, if one serves it: the policy allows stream decode,
/// the head size has an instance, the block size is a multiple of 16 (a
/// warp step of 16 keys lies in one block), the query and caches are
/// `aligned` and the head size allows 16-byte loads (a multiple of 8, of 16
/// over an fp8 cache), and the device allows the instance's shared memory
/// per program. 8 packed rows when the span's rows (times the query heads
/// of a KV group) fit them, else 16 (none at head size 256).
fn stream_decode_tile(
    dims: &AttentionDims,
    fp8: bool,
    head: usize,
    span: usize,
    aligned: bool,
    limits: &DeviceLimits,
    policy: &LaunchPolicy,
) -> Option<TileShape> {
    let loads = aligned && dims.head_size.is_multiple_of(if fp8 { 16 } else { 8 });
    if policy.stream == StreamMode::Off || !loads || !dims.block_size.is_multiple_of(16) {
        return None;
    }
    let group = dims.group_size();
    let rows = if group <= 8 && span * group <= 8 {
        8
    } else {
        16
    };
    stream_tile(head, rows).filter(|tile| smem_bytes(tile, head, fp8) <= limits.max_smem_per_block)
}

/// Whether a stream-decode launch of `groups` (sequence, KV head, chunk)
/// groups takes the wide instance (`wide_resident` programs per SM) rather
/// than the default one (`resident`): when more programs fit an SM and the
/// groups fill a wave of the default instance (which would then split them
/// into several waves of short segments) but fit one wave of the wide one,
/// which runs them unsplit. On an H200 (docs/perf.md, version 10) that took
/// 64 x 1k decodes (512 groups) from 99.2-99.3 to 85.0-85.2 µs and 64 x 8k
/// from 560.2-560.6 to 542.8-543.4, while the wide instance was slower
/// where its programs do not fill the SMs (splits of 1-16 sequences: 3-25%)
/// and 1% slower at 256 x 32k.
fn prefer_wide(
    mode: StreamMode,
    groups: usize,
    resident: usize,
    wide_resident: usize,
    sms: usize,
) -> bool {
    match mode {
        StreamMode::Off => false,
        StreamMode::Wide => true,
        StreamMode::Auto => {
            wide_resident > resident && (resident * sms..=wide_resident * sms).contains(&groups)
        }
    }
}

/// The host-side estimate of the programs of one instance resident on one
/// SM: the device's shared memory per SM over the instance's bytes plus the
/// driver's reservation per program, and the register limit
/// (`TileShape::max_resident`, as compiled for sm_90). The launches use the
/// driver's occupancy instead (`occupancy`); this is what the host tests
/// plan with, and what the kernel-contract GPU test checks against the
/// driver.
pub(super) fn resident_programs(
    tile: &TileShape,
    head: usize,
    fp8: bool,
    limits: &DeviceLimits,
) -> usize {
    let by_smem =
        limits.smem_per_sm / (smem_bytes(tile, head, fp8) + limits.reserved_smem_per_block);
    by_smem.min(tile.max_resident).max(1)
}

/// Bytes of K/V reading that one split-KV segment costs beyond its own keys:
/// a program's start (sequence lengths, block table, the first tile's
/// latency), its partial stores and its share of the reduce. 64 KiB is 128
/// keys of a head-128 bf16 cache. Fitted on an H200 (docs/perf.md, version
/// 5): at 1024 keys, 256 sequences ran 293.0 µs unsplit against 342.7 µs in
/// 4 segments; at 8192 keys, 64 sequences ran 556.9 µs in 3 segments
/// against 727.3 µs unsplit; the head-64 and head-256 cases followed the
/// same figure in bytes, not in keys.
const SEGMENT_OVERHEAD_BYTES: usize = 64 << 10;

/// Programs per SM that a stream-decode split of one wave is sized for: one
/// over a 16-bit cache, two over fp8. Past one, the SM's programs stream
/// no faster together than one alone does at these lengths, and each extra
/// segment adds its start and its share of the merge; fp8 steps convert
/// their keys and values in registers, so a second program's warps help.
/// Measured on an H200 (docs/perf.md, version 11) with forced counts, µs,
/// one program per SM against two: b16 L1k 33.3 against 36.1, b1 L8k 25.1
/// against 27.4, b1 L32k 53.8 against 56.0, b4 L1k 17.9 against 18.2,
/// b16 L8k 147.5 against 149.0; b4 L8k 53.6 against 53.4, b4 L32k 150.3
/// against 149.4, b16 L32k 537.3 against 532.3; fp8 b1 L32k 42.8 against
/// 39.6.
fn one_wave_stream_programs(fp8: bool) -> usize {
    if fp8 {
        2
    } else {
        1
    }
}

/// Segments per program for `active` programs that see up to `keys` keys of
/// `key_bytes` bytes (K and V) each, on `slots` resident programs: the
/// count (1 to one per `segment_keys` keys, at most 64) that minimises the
/// modelled time, waves x (bytes per segment + `SEGMENT_OVERHEAD_BYTES`),
/// where waves = ceil(active x segments / slots); the fewest segments on a
/// tie.
fn choose_segments(
    active: usize,
    slots: usize,
    keys: usize,
    key_bytes: usize,
    segment_keys: usize,
) -> usize {
    let (active, slots) = (active.max(1), slots.max(1));
    let max_segments = keys.div_ceil(segment_keys.max(1)).clamp(1, 64);
    let cost = |s: usize| {
        (active * s).div_ceil(slots) * (keys.div_ceil(s) * key_bytes + SEGMENT_OVERHEAD_BYTES)
    };
    (1..=max_segments)
        .min_by_key(|&s| (cost(s), s))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::PagedBatch;
    use candle_core::{DType, Device, Tensor};

    /// An H100 / H200: 132 SMs, 228 KiB of shared memory per SM, 227 KiB
    /// per program.
    const HOPPER: DeviceLimits = DeviceLimits {
        sms: 132,
        max_smem_per_block: 227 * 1024,
        smem_per_sm: 228 * 1024,
        reserved_smem_per_block: 1024,
        wgmma: false,
    };
    /// The same with the warpgroup instances.
    const HOPPER_WG: DeviceLimits = DeviceLimits {
        wgmma: true,
        ..HOPPER
    };
    /// An A100: 108 SMs, 164 KiB of shared memory per SM, 163 KiB per
    /// program.
    const A100: DeviceLimits = DeviceLimits {
        sms: 108,
        max_smem_per_block: 163 * 1024,
        smem_per_sm: 164 * 1024,
        reserved_smem_per_block: 1024,
        wgmma: false,
    };

    /// Llama-shaped attention (32 query heads, 8 KV heads, head size
    /// `head`) over a bf16 (or fp8) cache of block size 16 whose tables all
    /// point at block 0, for sequences of `(new tokens, keys)`; the bf16
    /// query and its params.
    fn call(head: usize, fp8: bool, seqs: &[(u32, u32)]) -> (Tensor, PagedAttentionParams) {
        call_with(head, fp8, 16, seqs)
    }

    /// [`call`] over blocks of `block_size` tokens (8: no stream-decode
    /// instance, so decodes take the unified kernel's).
    fn call_with(
        head: usize,
        fp8: bool,
        block_size: usize,
        seqs: &[(u32, u32)],
    ) -> (Tensor, PagedAttentionParams) {
        let dev = Device::Cpu;
        let mut cu = vec![0u32];
        for &(q, _) in seqs {
            cu.push(cu[cu.len() - 1] + q);
        }
        let lens: Vec<u32> = seqs.iter().map(|&(_, k)| k).collect();
        let rows: Vec<Vec<u32>> = lens
            .iter()
            .map(|&k| vec![0; k.div_ceil(block_size as u32) as usize])
            .collect();
        let batch = PagedBatch::from_rows(&cu, &lens, &rows, block_size, &dev).expect("batch");
        let cache_dtype = if fp8 { DType::F8E4M3 } else { DType::BF16 };
        let cache = Tensor::zeros((1, block_size, 8, head), cache_dtype, &dev).expect("cache");
        let tokens = cu[cu.len() - 1] as usize;
        let q = Tensor::zeros((tokens, 32, head), DType::BF16, &dev).expect("q");
        (q, PagedAttentionParams::new(&cache, &cache, &batch, 0.1))
    }

    /// The plan of `call(..)` on `limits` with the host-side residency
    /// estimate.
    fn plan_on(q: &Tensor, params: &PagedAttentionParams, limits: &DeviceLimits) -> Plan {
        plan_with(q, params, limits, LaunchPolicy::current())
    }

    /// As `plan_on`, under `policy`.
    fn plan_with(
        q: &Tensor,
        params: &PagedAttentionParams,
        limits: &DeviceLimits,
        policy: &LaunchPolicy,
    ) -> Plan {
        let dims = params
            .validate(q.dtype(), q.shape(), q.device())
            .expect("valid call");
        let fp8 = params.key_cache.dtype() == DType::F8E4M3;
        plan(
            params,
            &dims,
            limits,
            true,
            &|_, tile, head| Ok(resident_programs(tile, head, fp8, limits)),
            policy,
        )
        .expect("plan")
    }

    #[test]
    fn replayable_steps_with_prefills_plan_for_their_shape_alone() {
        // Three batches of 4 sequences and 64 tokens: decodes beside prompt
        // chunks, other lengths, and a prefill-only one with empty
        // sequences. Planned for a graph (`AutoUpTo`), they launch the same
        // programs: both parts, the same tiles, segments and grids.
        let batches: [&[(u32, u32)]; 3] = [
            &[(1, 300), (1, 40), (30, 30), (32, 100)],
            &[(33, 120), (29, 29), (1, 500), (1, 9)],
            &[(40, 40), (24, 100), (0, 0), (0, 0)],
        ];
        for limits in [HOPPER, HOPPER_WG, A100] {
            for fp8 in [false, true] {
                let plans: Vec<String> = batches
                    .iter()
                    .map(|seqs| {
                        let (q, params) = call(128, fp8, seqs);
                        let params = params.with_kv_split(KvSplit::AutoUpTo(512));
                        format!("{:?}", plan_on(&q, &params, &limits))
                    })
                    .collect();
                assert!(plans.iter().all(|p| *p == plans[0]), "{plans:#?}");
                let (q, params) = call(128, fp8, batches[0]);
                let p = plan_on(&q, &params.with_kv_split(KvSplit::AutoUpTo(512)), &limits);
                assert!(p.parts.iter().all(Option::is_some), "{p:?}");
            }
        }
        // Planned for the batch itself, the prefill-only batch launches one
        // part.
        let (q, params) = call(128, false, batches[2]);
        assert!(plan_on(&q, &params, &HOPPER).parts[1].is_none());
    }

    #[test]
    fn hopper_prefills_take_the_warpgroup_tile() {
        if !LaunchPolicy::current().wgmma || LaunchPolicy::current().prefill_rows.is_some() {
            eprintln!("skipped: CANDLE_PAGED_ATTENTION_WGMMA=0 or _PREFILL_ROWS overrides the prefill tile");
            return;
        }
        let prefill = |head, fp8, limits: &DeviceLimits, seqs: &[(u32, u32)]| {
            let (q, params) = call(head, fp8, seqs);
            let plan = plan_on(&q, &params, limits);
            let part = plan
                .parts
                .iter()
                .flatten()
                .find(|p| p.kind == Kind::Prefill)
                .copied();
            part.map(|p| {
                (
                    p.tile.wgmma,
                    p.tile.rows(),
                    plan.instance(&p, "bf16", fp8).name,
                )
            })
        };
        let long = [(2048, 2048); 4];
        // 16-bit caches at head 64 / 128 on Hopper: the sm_90a instance (the
        // warp-specialised one only where the policy forces it: these rows
        // see 1,024 keys on average).
        let ws = LaunchPolicy::current().warp_specialized == WsMode::On;
        for head in [64, 128] {
            let suffix = if ws { "ws" } else { "wg" };
            assert_eq!(
                prefill(head, false, &HOPPER_WG, &long),
                Some((
                    true,
                    128,
                    format!("unified_attention_h{head}_prefill_{suffix}_bf16")
                ))
            );
            // Over an fp8 cache too; elsewhere the mma.sync one.
            assert_eq!(
                prefill(head, false, &HOPPER, &long),
                Some((
                    false,
                    128,
                    format!("unified_attention_h{head}_prefill_bf16")
                ))
            );
            assert_eq!(
                prefill(head, true, &HOPPER_WG, &long),
                Some((
                    true,
                    128,
                    format!("unified_attention_h{head}_prefill_wg_bf16_fp8")
                ))
            );
        }
        // Head 256 too (its warpgroup instance); head 32 has none.
        assert_eq!(
            prefill(256, false, &HOPPER_WG, &long),
            Some((
                true,
                128,
                "unified_attention_h256_prefill_wg_bf16".to_string()
            ))
        );
        assert_eq!(
            prefill(32, false, &HOPPER_WG, &long).map(|p| p.0),
            Some(false)
        );
        // Less than a wave of 128-row programs: the 64-row warpgroup tile.
        for head in [64, 128, 256] {
            assert_eq!(
                prefill(head, false, &HOPPER_WG, &[(64, 64)]),
                Some((
                    true,
                    64,
                    format!("unified_attention_h{head}_prefill_wg_m1_bf16")
                ))
            );
        }
        // The prefill part of a mixed batch too.
        let mixed = [
            (1, 4096),
            (2048, 2048),
            (2048, 2048),
            (2048, 2048),
            (2048, 2048),
        ];
        assert_eq!(
            prefill(128, false, &HOPPER_WG, &mixed).map(|p| p.0),
            Some(true)
        );
    }

    /// The default policy takes the warp-specialised instance for prefill
    /// parts whose rows see at least `WS_MIN_MEAN_KEYS` (4,096) keys on
    /// average, outside CUDA-graph steps;
    /// `CANDLE_PAGED_ATTENTION_WS=1` everywhere one serves, `0` nowhere.
    #[test]
    fn long_prefills_take_the_warp_specialised_tile() {
        let policy = |ws| LaunchPolicy {
            warp_specialized: ws,
            prefill_rows: None,
            wgmma: true,
            ..LaunchPolicy::default()
        };
        let suffix = |head, fp8, seqs: &[(u32, u32)], window: Option<usize>, ws, split| {
            let (q, params) = call(head, fp8, seqs);
            let params = params.with_sliding_window(window).with_kv_split(split);
            let plan = plan_with(&q, &params, &HOPPER_WG, &policy(ws));
            let part = plan
                .parts
                .iter()
                .flatten()
                .find(|p| p.kind == Kind::Prefill)
                .copied()
                .expect("a prefill part");
            part.tile.suffix
        };
        let auto = KvSplit::Auto;
        // Mean keys per row: a 16k prompt 8,192; 8k 4,096; 8,190 tokens
        // 4,095 (one below the threshold); 4k 2,048; four 512-token chunks
        // (so that the programs fill a wave of 128 rows) after 16k of
        // context 16,640, after 4k 4,352; a 12k and a 4k prompt 5,120, a 16k
        // and a 4k one 6,963. One threshold serves head sizes 64 and 128.
        for (seqs, want) in [
            (&[(16384, 16384)][..], "_ws"),
            (&[(8192, 8192)][..], "_ws"),
            (&[(8190, 8190)][..], "_wg"),
            (&[(4096, 4096)][..], "_wg"),
            (
                &[
                    (512, 16896),
                    (512, 16896),
                    (512, 16896),
                    (512, 16896),
                    (1, 900),
                ][..],
                "_ws",
            ),
            (&[(512, 4608); 4][..], "_ws"),
            (&[(12288, 12288), (4096, 4096)][..], "_ws"),
            (&[(16384, 16384), (4096, 4096)][..], "_ws"),
        ] {
            for head in [64, 128] {
                assert_eq!(
                    suffix(head, false, seqs, None, WsMode::Auto, auto),
                    want,
                    "{seqs:?} h{head}"
                );
                assert_eq!(
                    suffix(head, false, seqs, None, WsMode::On, auto),
                    "_ws",
                    "{seqs:?} h{head}"
                );
                assert_eq!(
                    suffix(head, false, seqs, None, WsMode::Off, auto),
                    "_wg",
                    "{seqs:?} h{head}"
                );
            }
        }
        let long = &[(16384, 16384)][..];
        // A window bounds the keys a row sees; fp8 caches and head 256 have
        // no instance; a CUDA-graph step plans by shape (not by lengths).
        assert_eq!(
            suffix(128, false, long, Some(2048), WsMode::Auto, auto),
            "_wg"
        );
        assert_eq!(suffix(128, true, long, None, WsMode::On, auto), "_wg");
        assert_eq!(suffix(256, false, long, None, WsMode::On, auto), "_wg");
        let graph = KvSplit::AutoUpTo(32768);
        assert_eq!(suffix(128, false, long, None, WsMode::Auto, graph), "_wg");
        assert_eq!(suffix(128, false, long, None, WsMode::On, graph), "_ws");
    }

    #[test]
    fn residency_follows_the_devices_shared_memory() {
        let decode = |head| tile_shape(Kind::Decode, head, false);
        // Decode h128 (75,520 bytes bf16, 73,472 fp8): 3 per Hopper SM, 2 per A100 SM.
        assert_eq!(smem_bytes(&decode(128), 128, false), 75_520);
        assert_eq!(resident_programs(&decode(128), 128, false, &HOPPER), 3);
        assert_eq!(resident_programs(&decode(128), 128, false, &A100), 2);
        assert_eq!(resident_programs(&decode(128), 128, true, &HOPPER), 3);
        assert_eq!(resident_programs(&decode(128), 128, true, &A100), 2);
        // Decode h64 (40,704 bytes): the register bound (4) on both.
        assert_eq!(smem_bytes(&decode(64), 64, false), 40_704);
        assert_eq!(resident_programs(&decode(64), 64, false, &HOPPER), 4);
        assert_eq!(resident_programs(&decode(64), 64, false, &A100), 4);
        // Decode h256 (145,152 bytes): one program on either.
        assert_eq!(resident_programs(&decode(256), 256, false, &HOPPER), 1);
        assert_eq!(resident_programs(&decode(256), 256, false, &A100), 1);
        // Stream decode h256, 8 rows: one stage of 16.9 KB per warp over
        // bf16 (72,224 bytes), three of 8.7 KB over fp8 (109,088); the
        // register bound (2) on Hopper, shared memory on an A100.
        let stream = stream_tile(256, 8).expect("an h256 stream instance");
        for (fp8, bytes, a100) in [(false, 72_224, 2), (true, 109_088, 1)] {
            assert_eq!(smem_bytes(&stream, 256, fp8), bytes);
            assert_eq!(resident_programs(&stream, 256, fp8, &HOPPER), 2);
            assert_eq!(resident_programs(&stream, 256, fp8, &A100), a100);
        }
    }

    #[test]
    fn split_kv_waves_are_sized_for_the_device() {
        // 4 sequences x 8 KV heads = 32 decode programs, 8192 keys (64
        // segments at most): as many segments as fill one wave. Blocks of 8
        // tokens: the unified kernel's decode instance (3 per Hopper SM, 2
        // per A100 SM).
        // Blocks of 16: the stream-decode instance (3 per Hopper SM, 2 per
        // A100 SM: 72,224 bytes of shared memory), whose split of one wave
        // over a 16-bit cache is sized for 1 program per SM.
        let stream = [
            (16, Kind::Stream, &HOPPER, 3, 132 / 32),
            (16, Kind::Stream, &A100, 2, 108 / 32),
        ];
        let unified = [
            (8, Kind::Decode, &HOPPER, 3, 396 / 32),
            (8, Kind::Decode, &A100, 2, 216 / 32),
        ];
        // (`CANDLE_PAGED_ATTENTION_STREAM=wide`: the wide instance, 4 per SM.)
        let cases = if LaunchPolicy::current().stream == StreamMode::Auto {
            [unified, stream].concat()
        } else {
            unified.to_vec()
        };
        for (bs, kind, limits, resident, segments) in cases {
            let (q, params) = call_with(128, false, bs, &[(1, 8192); 4]);
            let p = plan_on(&q, &params, limits).parts[0].expect("one part");
            assert_eq!(
                (p.kind, p.resident, p.segments),
                (kind, resident, segments),
                "blocks of {bs}, {} SMs",
                limits.sms
            );
        }
        let (q, params) = call_with(128, false, 8, &[(1, 8192); 4]);
        // The plan sizes its waves with the figure it is given, not its own.
        let dims = params
            .validate(q.dtype(), q.shape(), q.device())
            .expect("valid");
        let given = plan(
            &params,
            &dims,
            &HOPPER,
            true,
            &|_, _, _| Ok(1),
            LaunchPolicy::current(),
        )
        .expect("plan");
        let p = given.parts[0].expect("one part");
        assert_eq!((p.resident, p.segments), (1, 132 / 32));
        // 64 sequences: 512 programs on 396 (Hopper) or 216 (A100) slots.
        // Hopper: 3 segments, 4 waves of 2731 + 128 keys (11,436), against
        // 2 waves of 8192 + 128 unsplit (16,640). A100: 2 segments, 5 waves
        // of 4096 + 128 (21,120), against 8 waves of 2731 + 128 (22,872).
        let (q, params) = call_with(128, false, 8, &[(1, 8192); 64]);
        let p = plan_on(&q, &params, &HOPPER).parts[0].expect("one part");
        assert_eq!(p.segments, choose_segments(512, 396, 8192, 512, 128));
        assert_eq!(p.segments, 3);
        let p = plan_on(&q, &params, &A100).parts[0].expect("one part");
        assert_eq!(p.segments, choose_segments(512, 216, 8192, 512, 128));
        assert_eq!(p.segments, 2);
    }

    #[test]
    fn split_parts_merge_by_kernel() {
        if std::env::var_os("CANDLE_PAGED_ATTENTION_SPLIT_MERGE").is_some() {
            eprintln!("skipped: CANDLE_PAGED_ATTENTION_SPLIT_MERGE overrides the default");
            return;
        }
        // A split decode, and a mixed batch whose decode part splits: the
        // unified kernel's decode parts (blocks of 8) merge through the
        // reduce launch, stream-decode parts (blocks of 16) in their own.
        for seqs in [&[(1, 8192); 4][..], &[(1, 8192), (1, 4096), (300, 300)][..]] {
            for (bs, kind, merge) in [
                (8, Kind::Decode, Merge::Reduce),
                (16, Kind::Stream, Merge::InLaunch),
            ] {
                if kind == Kind::Stream && LaunchPolicy::current().stream == StreamMode::Off {
                    continue;
                }
                let (q, params) = call_with(128, false, bs, seqs);
                let plan = plan_on(&q, &params, &HOPPER);
                let d = plan.parts[0].expect("decode part");
                assert_eq!((d.kind, d.merge), (kind, merge), "block size {bs}");
                assert!(d.segments > 1, "{}", d.segments);
                if let Some(p) = plan.parts[1] {
                    assert_eq!((p.kind, p.merge), (Kind::Prefill, Merge::Reduce));
                }
            }
        }
    }

    #[test]
    fn planner_splits_of_stream_decode_run_short_sequences_unsplit() {
        use super::super::policy::SINGLE_SEGMENT_KEYS;
        let policy = LaunchPolicy::default();
        let steps = |split: KvSplit, policy: &LaunchPolicy| {
            let (q, params) = call(128, false, &[(1, 8192); 4]);
            let params = params.with_kv_split(split);
            // Cannot fire: a batch of one-token sequences plans exactly one
            // part, its decode part, first.
            let d = plan_with(&q, &params, &HOPPER, policy).parts[0].expect("decode part");
            (d.kind, d.segments > 1, d.single_segment_steps)
        };
        let default_steps = SINGLE_SEGMENT_KEYS / 16;
        // The planner's splits (for the lengths, or for a graph's longest).
        assert_eq!(
            steps(KvSplit::Auto, &policy),
            (Kind::Stream, true, default_steps)
        );
        assert_eq!(
            steps(KvSplit::AutoUpTo(8192), &policy),
            (Kind::Stream, true, default_steps)
        );
        // A forced count is every sequence's, and so is a merge by the
        // reduce launch (which reads every segment's partials).
        assert_eq!(
            steps(KvSplit::Segments(4), &policy),
            (Kind::Stream, true, 0)
        );
        let reduce = LaunchPolicy {
            split_merge: Some(Merge::Reduce),
            ..policy
        };
        assert_eq!(steps(KvSplit::Auto, &reduce), (Kind::Stream, true, 0));
        let off = LaunchPolicy {
            single_segment_keys: 0,
            ..policy
        };
        assert_eq!(steps(KvSplit::Auto, &off), (Kind::Stream, true, 0));
        let wide = LaunchPolicy {
            single_segment_keys: 1000,
            ..policy
        };
        assert_eq!(steps(KvSplit::Auto, &wide), (Kind::Stream, true, 62));
    }

    #[test]
    fn one_launch_serves_mixed_batches_where_an_instance_exists() -> std::result::Result<(), String>
    {
        let policy = LaunchPolicy {
            overlap: Overlap::OneLaunch {
                prefill_first: false,
            },
            ..LaunchPolicy::default()
        };
        let mixed: &[(u32, u32)] = &[(1, 4096), (1, 900), (512, 512), (300, 1000)];
        for head in [64, 128] {
            let (q, params) = call(head, false, mixed);
            let p = plan_with(&q, &params, &HOPPER_WG, &policy);
            let one = p
                .one_launch
                .ok_or_else(|| format!("h{head}: no one-launch instance: {p:?}"))?;
            let [Some(d), Some(f)] = p.parts else {
                return Err(format!("h{head}: two parts expected: {p:?}"));
            };
            assert_eq!((d.kind, d.tile), (Kind::Stream, one.stream), "h{head}");
            assert!(!d.tile.is_stream_wide(), "h{head}");
            assert_eq!((f.kind, f.tile), (Kind::Prefill, one.prefill), "h{head}");
            assert_eq!(f.tile.rows(), 64, "h{head}");
            // A graph step with prefills (planned by shape) too.
            let by_shape = params.clone().with_kv_split(KvSplit::AutoUpTo(4096));
            assert!(plan_with(&q, &by_shape, &HOPPER_WG, &policy)
                .one_launch
                .is_some());
        }
        // Not without an instance or a second part: fp8 caches, head size
        // 256, no warpgroup MMAs, a pure decode or prefill batch, 128-row
        // prefills forced; nor under the default policy.
        let none =
            |head, fp8, seqs: &[(u32, u32)], limits: &DeviceLimits, policy: &LaunchPolicy| {
                let (q, params) = call(head, fp8, seqs);
                plan_with(&q, &params, limits, policy).one_launch.is_none()
            };
        assert!(none(128, true, mixed, &HOPPER_WG, &policy));
        assert!(none(256, false, mixed, &HOPPER_WG, &policy));
        assert!(none(128, false, mixed, &HOPPER, &policy));
        assert!(none(128, false, &[(1, 4096); 8], &HOPPER_WG, &policy));
        assert!(none(128, false, &[(512, 512); 2], &HOPPER_WG, &policy));
        let rows_128 = LaunchPolicy {
            prefill_rows: Some(128),
            ..policy
        };
        assert!(none(128, false, mixed, &HOPPER_WG, &rows_128));
        assert!(none(
            128,
            false,
            mixed,
            &HOPPER_WG,
            &LaunchPolicy::default()
        ));
        Ok(())
    }

    #[test]
    fn decodes_take_the_stream_instance_where_one_serves() {
        if LaunchPolicy::current().stream == StreamMode::Off {
            eprintln!("skipped: CANDLE_PAGED_ATTENTION_STREAM=0 turns the stream instances off");
            return;
        }
        let decode = |head, fp8, bs, seqs: &[(u32, u32)], aligned| {
            let (q, params) = call_with(head, fp8, bs, seqs);
            let dims = params
                .validate(q.dtype(), q.shape(), q.device())
                .expect("valid call");
            let pl = plan(
                &params,
                &dims,
                &HOPPER,
                aligned,
                &|_, tile, head| Ok(resident_programs(tile, head, fp8, &HOPPER)),
                LaunchPolicy::current(),
            )
            .expect("plan");
            let p = pl.parts[0].expect("a part");
            (p.kind, p.tile.rows(), pl.instance(&p, "bf16", fp8).name)
        };
        let one = [(1, 1000); 3];
        // Head sizes 64, 128, 256 (padded: 80 and 100 too), 16-bit or fp8.
        for (head, padded) in [(64, 64), (128, 128), (256, 256), (80, 128), (96, 128)] {
            for fp8 in [false, true] {
                let (kind, rows, name) = decode(head, fp8, 16, &one, true);
                let cache = if fp8 { "_fp8" } else { "" };
                // `CANDLE_PAGED_ATTENTION_STREAM=wide`: the wide instance.
                let wide = LaunchPolicy::current().stream == StreamMode::Wide && padded == 128;
                let shape = if wide { "r8w" } else { "r8" };
                assert_eq!(
                    (kind, rows, name),
                    (
                        Kind::Stream,
                        8,
                        format!("unified_attention_h{padded}_stream_{shape}_bf16{cache}")
                    ),
                    "head {head}"
                );
            }
        }
        // Blocks of 32 too; spans of 2 and 3 tokens (x 4 heads) take 16 rows.
        assert_eq!(decode(128, false, 32, &one, true).0, Kind::Stream);
        assert_eq!(decode(128, false, 16, &[(2, 500), (1, 90)], true).1, 8);
        assert_eq!(decode(128, false, 16, &[(3, 500), (1, 90)], true).1, 16);
        // Not for: head size 32, blocks of 8, unaligned tensors, an fp8
        // cache of head size 72 (no 16-byte loads), 16 rows at head size 256.
        for (head, fp8, bs, seqs, aligned) in [
            (32, false, 16, &one[..], true),
            (128, false, 8, &one[..], true),
            (128, false, 16, &one[..], false),
            (72, true, 16, &one[..], true),
            (256, false, 16, &[(3, 500)][..], true),
        ] {
            assert_eq!(
                decode(head, fp8, bs, seqs, aligned).0,
                Kind::Decode,
                "head {head} bs {bs}"
            );
        }
        // Nor where the device allows less shared memory per program than
        // the instance needs: 99 KiB (compute capability 8.9) holds the
        // head-256 instance over bf16 (72,224 bytes), not over fp8
        // (109,088), whose decodes take the unified kernel's instance.
        let sm89 = DeviceLimits {
            sms: 58,
            max_smem_per_block: 99 * 1024,
            smem_per_sm: 100 * 1024,
            ..A100
        };
        for (fp8, kind) in [(false, Kind::Stream), (true, Kind::Decode)] {
            let (q, params) = call(256, fp8, &one);
            let p = plan_on(&q, &params, &sm89).parts[0].expect("a part");
            assert_eq!(p.kind, kind, "fp8 {fp8}");
        }
    }

    #[test]
    fn wide_stream_instance_takes_one_wave_batches() {
        if LaunchPolicy::current().stream != StreamMode::Auto {
            eprintln!("skipped: CANDLE_PAGED_ATTENTION_STREAM overrides the instance choice");
            return;
        }
        // Head 128, 8 KV heads: 8 groups per decode. The default `_r8`
        // instance holds 3 programs per SM on both devices (A100: by shared
        // memory, 72,224 bytes), the wide one 4 (its registers; 37,408
        // bytes over bf16, 39,456 over fp8, the same as `_r8`'s).
        let wide = stream_wide_tile(128, 8).expect("a wide h128 instance");
        assert_eq!(smem_bytes(&wide, 128, false), 37_408);
        assert_eq!(smem_bytes(&wide, 128, true), 39_456);
        assert!(stream_wide_tile(64, 8).is_none() && stream_wide_tile(128, 16).is_none());
        let instance = |limits: &DeviceLimits, fp8, seqs: &[(u32, u32)]| {
            let (q, params) = call(128, fp8, seqs);
            let plan = plan_on(&q, &params, limits);
            let d = plan.parts[0].expect("a decode part");
            (plan.instance(&d, "bf16", fp8).name, d.resident, d.segments)
        };
        let name = |shape: &str, fp8| {
            let cache = if fp8 { "_fp8" } else { "" };
            format!("unified_attention_h128_stream_{shape}_bf16{cache}")
        };
        // Hopper: 396 slots of `_r8`, 528 of the wide one. 49 sequences
        // (392 groups) fit a wave of `_r8`; 50 to 66 (400-528) take the
        // wide instance, unsplit; 67 (536) do not fit one wave of it.
        for (seqs, keys, wide_expected) in [
            (49, 1024, false),
            (50, 1024, true),
            (64, 1024, true),
            (64, 8192, true),
            (66, 32768, true),
            (67, 1024, false),
            (256, 1024, false),
        ] {
            for fp8 in [false, true] {
                let (got, resident, segments) = instance(&HOPPER, fp8, &vec![(1, keys); seqs]);
                let (shape, r) = if wide_expected { ("r8w", 4) } else { ("r8", 3) };
                assert_eq!((got, resident), (name(shape, fp8), r), "{seqs} x {keys}");
                if wide_expected {
                    assert_eq!(segments, 1, "{seqs} x {keys}");
                }
            }
        }
        // A100 (108 SMs): `_r8` 2 per SM (216 slots), wide 4 (432).
        for (seqs, wide_expected) in [(26, false), (27, true), (54, true), (55, false)] {
            let (got, resident, _) = instance(&A100, false, &vec![(1, 1024); seqs]);
            let (shape, r) = if wide_expected { ("r8w", 4) } else { ("r8", 2) };
            assert_eq!((got, resident), (name(shape, false), r), "A100, {seqs}");
        }
        // A mixed batch counts its decode sequences: 60 decodes (480
        // groups) beside 4 prefills take it.
        let mut mixed = vec![(1, 4096); 60];
        mixed.extend([(512, 512); 4]);
        let (got, _, _) = instance(&HOPPER, false, &mixed);
        assert_eq!(got, name("r8w", false));
    }

    #[test]
    fn one_wave_stream_splits_hold_one_program_per_sm_over_16_bit_caches() {
        if LaunchPolicy::current().stream != StreamMode::Auto {
            eprintln!("skipped: CANDLE_PAGED_ATTENTION_STREAM overrides the instance choice");
            return;
        }
        // Head 128, 8 KV heads (8 groups per sequence) on Hopper's 132 SMs:
        // a split that fits one wave takes at most 132 programs over bf16,
        // 264 over fp8.
        let segments = |fp8, seqs: usize, keys: u32| {
            let (q, params) = call(128, fp8, &vec![(1, keys); seqs]);
            let plan = plan_on(&q, &params, &HOPPER);
            plan.parts[0].expect("a decode part").segments
        };
        for (seqs, keys, bf16, fp8) in [
            (1, 1024, 16, 16),
            (1, 8192, 16, 33),
            (1, 32768, 16, 33),
            (4, 1024, 4, 8),
            (4, 8192, 4, 8),
            (16, 1024, 1, 2),
            (16, 32768, 1, 2),
        ] {
            assert_eq!(segments(false, seqs, keys), bf16, "bf16 {seqs} x {keys}");
            assert_eq!(segments(true, seqs, keys), fp8, "fp8 {seqs} x {keys}");
        }
    }

    #[test]
    fn prefill_tile_follows_the_resident_programs() {
        if LaunchPolicy::current().prefill_rows.is_some() {
            eprintln!("skipped: CANDLE_PAGED_ATTENTION_PREFILL_ROWS overrides the prefill tile");
            return;
        }
        // 3 sequences of 1024 new tokens, 32 query rows (x 4 heads of a KV
        // group) per 128-row program: 3 x 32 x 8 KV heads = 768 programs.
        let (q, params) = call(128, false, &[(1024, 1024); 3]);
        let dims = params
            .validate(q.dtype(), q.shape(), q.device())
            .expect("valid");
        let rows_with = |resident: usize| {
            let pl = plan(
                &params,
                &dims,
                &HOPPER,
                true,
                &|_, _, _| Ok(resident),
                LaunchPolicy::current(),
            )
            .expect("plan");
            let p = pl.parts[0].expect("one part");
            assert_eq!(p.kind, Kind::Prefill);
            p.tile.rows()
        };
        // 768 programs: at least a wave of 2 x 132, less than one of 6 x 132.
        assert_eq!(rows_with(2), 128);
        assert_eq!(rows_with(6), 64);
    }

    #[test]
    fn segments_follow_the_cost_model() {
        // Head 128, bf16: 512 bytes per key, the overhead is 128 keys.
        let h128 = 512;
        // One long decode: split until the GPU is full (49 x 8 = 392 of 396).
        assert_eq!(choose_segments(8, 396, 32768, h128, 128), 49);
        // Short context: capped at one segment per 128 keys.
        assert_eq!(choose_segments(8, 396, 1024, h128, 128), 8);
        assert_eq!(choose_segments(8, 396, 100, h128, 128), 1);
        // 16 x 8 programs at 1024 keys: 3 segments still fit one wave.
        assert_eq!(choose_segments(128, 396, 1024, h128, 128), 3);
        // 256 x 8 programs at 1024 keys: 6 waves of 1024 + 128 keys
        // (6,912) beat 11 waves of 512 + 128 (7,040): no split.
        assert_eq!(choose_segments(2048, 396, 1024, h128, 128), 1);
        // 256 x 8 programs at 8192 keys: 4 segments (21 waves of 2048 + 128,
        // 45,696) beat the unsplit 6 waves of 8192 + 128 (49,920).
        assert_eq!(choose_segments(2048, 396, 8192, h128, 128), 4);
        // Already many full waves: no split.
        assert_eq!(choose_segments(396 * 8, 396, 8192, h128, 128), 1);
        // No keys: one segment.
        assert_eq!(choose_segments(8, 396, 0, h128, 128), 1);
        // Stream decode: down to 64 keys a segment (b1 L1k: 16 per program).
        assert_eq!(choose_segments(8, 396, 1024, h128, 64), 16);
        // Head 64 (256 bytes per key, the overhead is 256 keys), 64 x 3
        // programs at 2048 keys on 528 slots: 2 segments in one wave
        // (1024 + 256) beat 5 in two waves (2 x (410 + 256)).
        assert_eq!(choose_segments(192, 528, 2048, 256, 128), 2);
        // Head 256 (1 KiB per key, the overhead is 64 keys), 64 x 4
        // programs on 132 slots, a 1024-key window: no split (2 waves of
        // 1024 + 64 against 4 of 512 + 64).
        assert_eq!(choose_segments(256, 132, 1024, 1024, 128), 1);
    }

    #[test]
    fn shared_memory_fits_hopper() {
        for &head in &HEAD_SIZES {
            for kind in [Kind::Decode, Kind::Prefill] {
                for fp8 in [false, true] {
                    for small in [false, true] {
                        let s = smem_bytes(&tile_shape(kind, head, small), head, fp8);
                        assert!(s <= 227 * 1024, "{kind:?} h{head} fp8={fp8}: {s} bytes");
                    }
                }
            }
        }
    }
}
