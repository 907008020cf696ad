//! The tile table of the tensor-core kernel: the program shape of every
//! instance, its threads and its dynamic shared memory.
//!
//! This file is the one definition of those figures. It is dependency-free
//! (std only, no `crate::` or `super::` paths) because build.rs includes it
//! too (`#[path]`) to generate the kernels' entry points from
//! [`instances`] (`$OUT_DIR/attention_instances.cuh` and
//! `stream_instances.cuh`, which the kernel files include) and
//! `$OUT_DIR/kernel_contract.cuh`, whose per-instance constants the
//! `CPA_ATTN` and `CPA_STREAM` macros check with `static_assert`s against
//! the kernels' own `Cfg`/`Smem` and `StreamProgram::SMEM`.
//!
//! A leaf: imports nothing.

/// Padded head sizes with a compiled kernel instance.
pub(crate) const HEAD_SIZES: [usize; 5] = [32, 64, 128, 256, 512];

/// Program shape of the tensor-core kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// 16 packed rows, 4 warps splitting 64 keys per tile.
    Decode,
    /// 128 packed rows (4 warps x 2 x 16) by default; 64 rows (4 warps x 16)
    /// when the launch has less than a wave of programs and for head sizes
    /// above 128. One warp per key tile.
    Prefill,
    /// Stream decode (kernels/stream_decode.cu): 8 or 16 packed rows, 4
    /// warps each streaming its own 16-key steps through a ring of
    /// shared-memory stages; split-KV partials merged in the launch.
    Stream,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Decode => "decode",
            Kind::Prefill => "prefill",
            Kind::Stream => "stream",
        }
    }
}

/// The tile shape of one kernel instance; mirrors `Cfg` in
/// kernels/unified_attention.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TileShape {
    /// Warps along the packed query rows.
    pub(crate) warps_m: usize,
    /// Warps splitting the keys of a tile.
    pub(crate) warps_n: usize,
    /// Keys per warp per tile.
    pub(crate) keys_per_warp: usize,
    /// 16-row MMA tiles per warp.
    pub(crate) m_tiles: usize,
    /// K/V tiles in the cp.async ring; for stream-decode instances, each
    /// warp's ring stages over a 16-bit cache (see `stream_depth`).
    pub(crate) stages: usize,
    /// Programs of this instance per SM that its registers allow (the
    /// register file over the registers one program uses, as compiled).
    /// `resident_programs`, the host-side estimate the host tests plan with,
    /// takes the smaller of this and the shared-memory limit (the launches
    /// plan with the driver's occupancy of the instance instead). For
    /// decode-shaped instances that estimate is expected to equal the
    /// driver's occupancy at the planned shared memory; for prefill-shaped
    /// ones it is a lower bound of the driver's (tests/kernel_contract.rs
    /// checks both, per instance, on a GPU). It is not the minimum programs per SM of the instance's
    /// `__launch_bounds__`: decode h256 and h512 are compiled with a minimum
    /// of 1, and prefill instances with 1, yet more may be resident.
    pub(crate) max_resident: usize,
    /// The minimum programs per SM of the instance's `__launch_bounds__`
    /// (the register budget it is compiled for): decode 4 up to head size
    /// 64, 3 at 128, 1 above; prefill 1; warpgroup prefill 2 up to head
    /// size 128, 1 above; stream decode 4 for the wide instance, 3 for 8
    /// rows up to head size 128, 2 otherwise (registers per thread: at most
    /// 128 for 4, 168 for 3, 255 for 2).
    pub(crate) min_programs: usize,
    /// Kernel name suffix after the kind (`""`, `"_m1"` or `"_wg"`).
    pub(crate) suffix: &'static str,
    /// Hopper warpgroup MMAs over 128-byte-swizzled tiles: an instance of
    /// the sm_90a module (see [`wgmma_tile`]).
    pub(crate) wgmma: bool,
    /// Packed rows of one MMA tile: 16, or 8 for the stream-decode
    /// instances, whose rows are the N dimension of transposed products.
    pub(crate) tile_rows: usize,
    /// A stream-decode instance (see [`stream_tile`]): of the stream-decode
    /// module, its shared memory laid out by `stream_smem_bytes`.
    pub(crate) stream: bool,
    /// Warps of the producer warpgroup of a warp-specialised instance (see
    /// [`wgmma_ws_tile`]), besides the `warps_m x warps_n` that hold rows;
    /// 0 elsewhere.
    pub(crate) producer_warps: usize,
}

impl TileShape {
    /// Threads per program (the `__launch_bounds__` of the instance).
    pub(crate) fn threads(&self) -> usize {
        32 * (self.warps_m * self.warps_n + self.producer_warps)
    }
    /// A warp-specialised instance (see [`wgmma_ws_tile`]).
    pub(crate) fn is_warp_specialized(&self) -> bool {
        self.producer_warps > 0
    }
    /// The cache kinds (`fp8`: false, true) it is compiled for: 16-bit
    /// caches only for the warp-specialised instances, both elsewhere.
    pub(crate) fn cache_kinds(&self) -> &'static [bool] {
        if self.is_warp_specialized() {
            &[false]
        } else {
            &[false, true]
        }
    }
    /// Packed rows per program.
    pub(crate) fn rows(&self) -> usize {
        self.tile_rows * self.m_tiles * self.warps_m
    }
    /// Keys per tile.
    pub(crate) fn keys(&self) -> usize {
        self.keys_per_warp * self.warps_n
    }
    /// The wide stream-decode instance (see [`stream_wide_tile`]).
    pub(crate) fn is_stream_wide(&self) -> bool {
        self.stream && self.suffix == STREAM_WIDE_SUFFIX
    }
}

/// The instance a launch of `kind` uses for padded head size `head`.
/// `small`: a prefill launch with less than a wave of 128-row programs,
/// which then takes 64-row ones (twice the programs) where both exist; for
/// `Kind::Stream`, the 8-row shape instead of the 16-row one (whether an
/// instance exists for `head` is [`stream_tile`]'s answer).
pub(crate) fn tile_shape(kind: Kind, head: usize, small: bool) -> TileShape {
    match kind {
        Kind::Stream => stream_shape(head, if small { 8 } else { 16 }),
        Kind::Decode => TileShape {
            warps_m: 1,
            warps_n: 4,
            keys_per_warp: 16,
            m_tiles: 1,
            stages: 2,
            max_resident: match head {
                0..=64 => 4,
                65..=128 => 3,
                _ => 2,
            },
            min_programs: match head {
                0..=64 => 4,
                65..=128 => 3,
                _ => 1,
            },
            suffix: "",
            wgmma: false,
            tile_rows: 16,
            stream: false,
            producer_warps: 0,
        },
        Kind::Prefill => {
            let two_tiles = head <= 128 && !small;
            TileShape {
                warps_m: 4,
                warps_n: 1,
                keys_per_warp: if head <= 128 { 64 } else { 32 },
                m_tiles: if two_tiles { 2 } else { 1 },
                stages: 2,
                max_resident: 2,
                min_programs: 1,
                suffix: if head <= 128 && small { "_m1" } else { "" },
                wgmma: false,
                tile_rows: 16,
                stream: false,
                producer_warps: 0,
            }
        }
    }
}

/// Padded head sizes with warpgroup prefill instances.
pub(crate) const WGMMA_HEAD_SIZES: [usize; 3] = [64, 128, 256];

/// A warpgroup prefill instance of the sm_90a module for padded head size
/// `head` (16-bit queries; 16-bit or fp8 caches), if there is one: 128 packed
/// rows as two warpgroups of four warps (16 rows each), or with `small` (a
/// launch with less than a wave of those) 64 rows as one warpgroup; 64
/// keys per tile, two stages. They take the place of the `mma.sync`
/// prefill instances on devices of compute capability 9.0.
pub(crate) fn wgmma_tile(head: usize, small: bool) -> Option<TileShape> {
    WGMMA_HEAD_SIZES.contains(&head).then_some(TileShape {
        warps_m: if small { 4 } else { 8 },
        warps_n: 1,
        keys_per_warp: 64,
        m_tiles: 1,
        stages: 2,
        max_resident: if head <= 128 { 2 } else { 1 },
        min_programs: if head <= 128 { 2 } else { 1 },
        suffix: if small { "_wg_m1" } else { "_wg" },
        wgmma: true,
        tile_rows: 16,
        stream: false,
        producer_warps: 0,
    })
}

/// Padded head sizes with warp-specialised prefill instances.
pub(crate) const WS_HEAD_SIZES: [usize; 2] = [64, 128];

/// The warp-specialised prefill instance of the sm_90a module for padded
/// head size `head` (16-bit queries over a 16-bit cache), if there is one
/// (kernels/prefill_ws.cuh): the 128 packed rows of [`wgmma_tile`] as two
/// consumer warpgroups, 128 keys per tile, two stages, and a producer
/// warpgroup (4 warps) that loads the tiles; one program per SM. It takes
/// the place of the 128-row warpgroup instance where the plan allows.
pub(crate) fn wgmma_ws_tile(head: usize) -> Option<TileShape> {
    WS_HEAD_SIZES.contains(&head).then_some(TileShape {
        warps_m: 8,
        warps_n: 1,
        keys_per_warp: 128,
        m_tiles: 1,
        stages: 2,
        max_resident: 1,
        min_programs: 1,
        suffix: "_ws",
        wgmma: true,
        tile_rows: 16,
        stream: false,
        producer_warps: 4,
    })
}

/// Padded head sizes with stream-decode instances.
pub(crate) const STREAM_HEAD_SIZES: [usize; 3] = [64, 128, 256];

/// Packed rows of the stream-decode instances: one or two 8-row tiles.
pub(crate) const STREAM_ROWS: [usize; 2] = [8, 16];

/// The stream-decode instance for padded head size `head` with `rows` (8 or
/// 16) packed rows, if there is one (none for 16 rows at head size 256):
/// 4 warps, each with its own ring of 16-key steps in shared memory
/// (`stream_depth` stages: `stages`, or 3 over fp8 at head size 256). Registers allow 3
/// programs per SM (2 for 16 rows at head size 128 and at head size 256;
/// as compiled for sm_90a), shared memory 3 or more (head size 256: 3 over
/// a 16-bit cache, 2 over fp8). Compiled for every target
/// (kernels/stream_decode.cu); used for decode-shaped launches whose block
/// size is a multiple of 16 and whose loads can be 16 bytes wide.
pub(crate) fn stream_tile(head: usize, rows: usize) -> Option<TileShape> {
    let exists = STREAM_HEAD_SIZES.contains(&head)
        && STREAM_ROWS.contains(&rows)
        && !(head == 256 && rows == 16);
    exists.then(|| stream_shape(head, rows))
}

/// The kernel name suffix of the wide stream-decode instance.
pub(crate) const STREAM_WIDE_SUFFIX: &str = "_r8w";

/// The wide stream-decode instance for padded head size `head` with `rows`
/// packed rows, if there is one (head size 128, 8 rows only): the `_r8`
/// program with one ring stage per warp (two over fp8, whose steps are half
/// the bytes), whose registers (at most 128) and
/// shared memory let 4 programs share an SM instead of 3. The plan takes it
/// for batches whose groups fill one wave of it and not of `_r8`.
pub(crate) fn stream_wide_tile(head: usize, rows: usize) -> Option<TileShape> {
    (head == 128 && rows == 8).then(|| TileShape {
        stages: 1,
        max_resident: 4,
        min_programs: 4,
        suffix: STREAM_WIDE_SUFFIX,
        ..stream_shape(head, rows)
    })
}

/// The stream-decode program shape with `rows` (8 or 16) packed rows at
/// padded head size `head` (see [`stream_tile`] for the residency).
fn stream_shape(head: usize, rows: usize) -> TileShape {
    TileShape {
        warps_m: 1,
        warps_n: 4,
        keys_per_warp: 16,
        m_tiles: rows / 8,
        stages: if head <= 128 { 2 } else { 1 },
        max_resident: if head == 256 || (head == 128 && rows == 16) {
            2
        } else {
            3
        },
        min_programs: if head <= 128 && rows == 8 { 3 } else { 2 },
        suffix: if rows == 8 { "_r8" } else { "_r16" },
        wgmma: false,
        tile_rows: 8,
        stream: true,
        producer_warps: 0,
    }
}

/// Padded head sizes with one-launch mixed instances.
pub(crate) const MIXED_HEAD_SIZES: [usize; 2] = [64, 128];

/// The one-launch instance of a mixed batch (kernels/mixed_attention.cuh,
/// in the sm_90a module): the programs of a prefill part with the 64-row
/// warpgroup tile and of a decode-shaped part with a (not wide) stream
/// tile, in one grid. 16-bit caches; bf16 and f16 queries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MixedInstance {
    /// Padded head size.
    pub(crate) head: usize,
    /// The prefill programs' tile (`wgmma_tile(head, true)`).
    pub(crate) prefill: TileShape,
    /// The decode programs' tile (`stream_tile(head, rows)`).
    pub(crate) stream: TileShape,
}

impl MixedInstance {
    /// Threads per program: both roles' (128).
    pub(crate) fn threads(&self) -> usize {
        self.prefill.threads().max(self.stream.threads())
    }
    /// Dynamic shared memory per program: the larger role's.
    pub(crate) fn smem(&self) -> usize {
        smem_bytes(&self.prefill, self.head, false).max(smem_bytes(&self.stream, self.head, false))
    }
    /// The kernel's suffix after `_mixed`: the stream tile's (`_r8`, `_r16`).
    pub(crate) fn suffix(&self) -> &'static str {
        self.stream.suffix
    }
    /// `unified_attention_h{head}_mixed_r{rows}_{dtype}`.
    pub(crate) fn name(&self, dtype_name: &str) -> String {
        format!(
            "unified_attention_h{}_mixed{}_{dtype_name}",
            self.head,
            self.suffix()
        )
    }
}

/// The one-launch instance for a mixed batch whose decode-shaped part
/// takes `stream` at padded head size `head`, if there is one: head sizes
/// 64 and 128, an 8- or 16-row stream tile that is not the wide one.
pub(crate) fn mixed_instance(head: usize, stream: &TileShape) -> Option<MixedInstance> {
    let exists = MIXED_HEAD_SIZES.contains(&head)
        && stream.stream
        && !stream.is_stream_wide()
        && stream_tile(head, stream.rows()) == Some(*stream);
    let prefill = wgmma_tile(head, true).filter(|_| exists)?;
    (prefill.threads() == stream.threads()).then_some(MixedInstance {
        head,
        prefill,
        stream: *stream,
    })
}

/// Every one-launch mixed instance (each compiled for every query dtype of
/// [`QUERY_DTYPES`], over 16-bit caches).
pub(crate) fn mixed_instances() -> Vec<MixedInstance> {
    MIXED_HEAD_SIZES
        .iter()
        .flat_map(|&head| {
            STREAM_ROWS
                .iter()
                .filter_map(move |&rows| mixed_instance(head, &stream_tile(head, rows)?))
        })
        .collect()
}

/// One compiled tensor-core kernel instance: a program kind and its tile at
/// a padded head size. Each is compiled for every query dtype of
/// [`QUERY_DTYPES`], over a 16-bit cache of that dtype and over fp8.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TileInstance {
    /// Padded head size.
    pub(crate) head: usize,
    /// Program shape.
    pub(crate) kind: Kind,
    /// Tile of the program.
    pub(crate) tile: TileShape,
}

/// The query dtypes of the tensor-core instances: the kernel-name dtype and
/// its CUDA type.
pub(crate) const QUERY_DTYPES: [(&str, &str); 2] = [("bf16", "__nv_bfloat16"), ("f16", "__half")];

/// Every tensor-core instance, in the order the kernel files define them:
/// the `mma.sync` instances of kernels/unified_attention.cu (decode and the
/// default prefill tile per head size, then the 64-row prefill tiles where
/// they differ), the warpgroup instances of its sm_90a module, then the
/// stream-decode instances of kernels/stream_decode.cu. The one list of
/// instances: build.rs generates the kernels' entry points and the
/// contract constants from it, and the per-instance report walks it.
pub(crate) fn instances() -> Vec<TileInstance> {
    let mut out = Vec::new();
    let mut push = |head, kind, tile| out.push(TileInstance { head, kind, tile });
    for head in HEAD_SIZES {
        push(head, Kind::Decode, tile_shape(Kind::Decode, head, false));
        push(head, Kind::Prefill, tile_shape(Kind::Prefill, head, false));
    }
    for head in HEAD_SIZES {
        let small = tile_shape(Kind::Prefill, head, true);
        if small != tile_shape(Kind::Prefill, head, false) {
            push(head, Kind::Prefill, small);
        }
    }
    for head in WGMMA_HEAD_SIZES {
        for small in [false, true] {
            if let Some(tile) = wgmma_tile(head, small) {
                push(head, Kind::Prefill, tile);
            }
        }
    }
    for head in WS_HEAD_SIZES {
        if let Some(tile) = wgmma_ws_tile(head) {
            push(head, Kind::Prefill, tile);
        }
    }
    for head in STREAM_HEAD_SIZES {
        for rows in STREAM_ROWS {
            for tile in [stream_tile(head, rows), stream_wide_tile(head, rows)]
                .into_iter()
                .flatten()
            {
                push(head, Kind::Stream, tile);
            }
        }
    }
    out
}

/// Dynamic shared memory of one instance; mirrors `Smem` in
/// kernels/unified_attention.cu (warpgroup instances: unpadded swizzled
/// rows, plus 1024 bytes to align their tiles).
pub(crate) fn smem_bytes(tile: &TileShape, head: usize, fp8: bool) -> usize {
    let dv = head.min(256);
    if tile.stream {
        return stream_smem_bytes(tile, head, fp8);
    }
    let (bm, bn, st) = (tile.rows(), tile.keys(), tile.stages);
    let pad = if tile.wgmma { 0 } else { 8 };
    let (qs, ks, vs, cs) = (head + pad, head + pad, dv + pad, dv + 8);
    let q = bm * qs * 2;
    let red = 2 * tile.warps_n * bm * 4;
    let offsets = st * bn * 8;
    let tiles = if fp8 {
        bn * ks * 2 + bn * vs * 2 + st * bn * (head + dv)
    } else {
        st * bn * (ks + vs) * 2
    };
    let merge = tile.warps_n * bm * cs * 4;
    let align = if tile.wgmma { 1024 } else { 0 };
    // Warp-specialised: a full and an empty barrier per K and V stage.
    let barriers = if tile.is_warp_specialized() {
        4 * st * 8
    } else {
        0
    };
    align + q + red + offsets + tiles.max(merge) + barriers
}

/// Dynamic shared memory of a stream-decode instance (mirrors
/// `StreamProgram::SMEM` in kernels/stream_decode.cuh, whose `CPA_STREAM`
/// macros assert that both agree): Q `[rows][head + 16]` 16-bit, the row
/// scales, the warps' row maxima and sums, then the larger of the warps'
/// rescaled accumulators `[warps][rows][dv + 4]` f32 and their rings of
/// [`stream_depth`] stages (one 16-key step each: 16 key rows and 16 value
/// rows, padded).
fn stream_smem_bytes(tile: &TileShape, head: usize, fp8: bool) -> usize {
    let dv = head.min(256);
    let (rows, warps) = (tile.rows(), tile.warps_n);
    let ring = warps * stream_depth(tile, head, fp8) * stream_stage_bytes(head, fp8);
    let merge = warps * rows * (dv + 4) * 4;
    rows * (head + 16) * 2 + rows * 4 + 2 * warps * rows * 4 + ring.max(merge)
}

/// Bytes of one stage of a stream-decode warp's ring: 16 key rows and 16
/// value rows, each padded by 16 bytes.
fn stream_stage_bytes(head: usize, fp8: bool) -> usize {
    let elem = if fp8 { 1 } else { 2 };
    16 * (head * elem + 16 + head.min(256) * elem + 16)
}

/// Stages in flight per stream-decode warp: the tile's `stages` (2 up to
/// head size 128, 1 for the wide instance), except for the wide instance
/// over an fp8 cache, 2 (half-size steps), and at head size 256 over an
/// fp8 cache, 3 (1 over a 16-bit one: either way two programs per Hopper
/// SM; a 16-bit ring of 2 or more would hold one, whose start and merge
/// nothing overlaps, and not fit an A100's 163 KiB per program). Mirrors
/// `StreamProgram::DEPTH`.
fn stream_depth(tile: &TileShape, head: usize, fp8: bool) -> usize {
    if head > 128 && fp8 {
        3
    } else if fp8 && tile.is_stream_wide() {
        2
    } else {
        tile.stages
    }
}

/// The kernel name of a tensor-core instance,
/// `unified_attention_h{head}_{kind}{suffix}_{dtype}[_fp8]`: the one place
/// this format lives on the Rust side (the `CPA_ATTN` macros of
/// kernels/unified_attention.cu build the same names).
pub(crate) fn instance_name(
    head: usize,
    kind: Kind,
    tile: &TileShape,
    dtype_name: &str,
    fp8: bool,
) -> String {
    let cache_suffix = if fp8 { "_fp8" } else { "" };
    format!(
        "unified_attention_h{head}_{}{}_{dtype_name}{cache_suffix}",
        kind.name(),
        tile.suffix
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tile a launch can pick is compiled, and no instance twice: the
    /// generated entry points are exactly the tiles the planner chooses from.
    #[test]
    fn instances_are_every_plannable_tile_once() {
        let all = instances();
        let mut names: Vec<String> = all
            .iter()
            .map(|i| instance_name(i.head, i.kind, &i.tile, "bf16", false))
            .collect();
        names.sort();
        let unique = names.len();
        names.dedup();
        assert_eq!(names.len(), unique, "an instance is listed twice");
        let has = |head, kind, tile: TileShape| all.contains(&TileInstance { head, kind, tile });
        for head in HEAD_SIZES {
            for small in [false, true] {
                for kind in [Kind::Decode, Kind::Prefill] {
                    assert!(
                        has(head, kind, tile_shape(kind, head, small)),
                        "{kind:?} h{head}"
                    );
                }
                if let Some(tile) = wgmma_tile(head, small) {
                    assert!(
                        has(head, Kind::Prefill, tile),
                        "warpgroup h{head} small {small}"
                    );
                }
            }
            if let Some(tile) = wgmma_ws_tile(head) {
                assert!(has(head, Kind::Prefill, tile), "warp-specialised h{head}");
            }
            for rows in STREAM_ROWS {
                for tile in [stream_tile(head, rows), stream_wide_tile(head, rows)]
                    .into_iter()
                    .flatten()
                {
                    assert!(has(head, Kind::Stream, tile), "stream h{head} rows {rows}");
                }
            }
        }
        // The one-launch mixed instances: head sizes 64 and 128, 8 and 16
        // stream rows, 128 threads in both roles.
        let mixed = mixed_instances();
        assert_eq!(mixed.len(), 4);
        for m in &mixed {
            assert_eq!((m.threads(), m.prefill.rows()), (128, 64), "{m:?}");
            assert!(!m.stream.is_stream_wide() && m.prefill.wgmma, "{m:?}");
        }
        assert_eq!(mixed[0].name("bf16"), "unified_attention_h64_mixed_r8_bf16");
        for head in [32, 256, 512] {
            for rows in STREAM_ROWS {
                if let Some(tile) = stream_tile(head, rows) {
                    assert!(mixed_instance(head, &tile).is_none(), "h{head} r{rows}");
                }
            }
        }
        // The wide instance exists, and has no one-launch instance.
        assert!(stream_wide_tile(128, 8).is_some_and(|wide| mixed_instance(128, &wide).is_none()));
        // 5 decode, 5 + 3 prefill, 3 x 2 warpgroup, 2 warp-specialised,
        // 6 stream.
        assert_eq!(all.len(), 27);
        for i in &all {
            assert!(
                i.tile.min_programs >= 1 && i.tile.min_programs <= 4,
                "{i:?}"
            );
        }
    }
}
