//! The launch policy: which kernel instances and launch arrangements the
//! plans of `PagedAttention` may take, and which kernel a skinny matmul
//! runs. One value, read from the environment
//! once per process ([`LaunchPolicy::current`]) and passed to the planner,
//! so that tests and the benchmark cover each path by setting variables,
//! and host tests build any policy directly ([`LaunchPolicy::from_vars`]).
//!
//! | variable | values | field |
//! |---|---|---|
//! | `CANDLE_PAGED_ATTENTION_STREAM` | `0`, `wide`, else auto | [`stream`](LaunchPolicy::stream) |
//! | `CANDLE_PAGED_ATTENTION_WGMMA` | `0`, else on | [`wgmma`](LaunchPolicy::wgmma) |
//! | `CANDLE_PAGED_ATTENTION_WS` | `0`, `1`, else auto | [`warp_specialized`](LaunchPolicy::warp_specialized) |
//! | `CANDLE_PAGED_ATTENTION_PREFILL_ROWS` | `64`, `128`, else free | [`prefill_rows`](LaunchPolicy::prefill_rows) |
//! | `CANDLE_PAGED_ATTENTION_SPLIT_MERGE` | `launch`, `reduce`, else by kernel | [`split_merge`](LaunchPolicy::split_merge) |
//! | `CANDLE_PAGED_ATTENTION_OVERLAP` | `0`, `decode-first`, `one-launch`, `one-launch-prefill-first`, else prefill first | [`overlap`](LaunchPolicy::overlap) |
//! | `CANDLE_PAGED_ATTENTION_SKINNY_KERNEL` | `fma`, else `mma` | [`skinny`](LaunchPolicy::skinny) |
//! | `CANDLE_PAGED_ATTENTION_SINGLE_SEGMENT_KEYS` | a key count, else 256 | [`single_segment_keys`](LaunchPolicy::single_segment_keys) |
//!
//! A leaf of the CUDA modules: imports nothing of the crate.

use std::sync::OnceLock;

/// Which decode-shaped instances the plan may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamMode {
    /// `0`: the unified kernel's decode instances only.
    Off,
    /// The default: stream decode where an instance serves the call, the
    /// wide one where the planner's `prefer_wide` says.
    Auto,
    /// `wide`: the wide instance wherever it exists for the call.
    Wide,
}

/// Where the plan may take the warp-specialised prefill instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WsMode {
    /// `0`: never.
    Off,
    /// The default: for prefill parts whose rows see many keys on average
    /// (the planner's `ws_prefill`), outside CUDA-graph steps.
    Auto,
    /// `1`: wherever an instance serves the part (tests and benchmarks).
    On,
}

/// Who merges the split-KV partials of a decode-shaped part. The
/// stream-decode instances merge in their launch by default and the
/// unified kernel's decode instances through a separate reduce launch
/// (the planner's `Merge` docs give the measurements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Merge {
    /// The last program of each group, through arrival counters: one launch.
    InLaunch,
    /// `reduce_segments_*`, a second launch.
    Reduce,
}

/// How a mixed batch's two launches (a decode-shaped part and a prefill
/// part) are enqueued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Overlap {
    /// `0`: both launches on the device's stream, one after the other.
    Off,
    /// The default: the prefill launch on the side stream, enqueued before
    /// the decode launch.
    PrefillFirst,
    /// `decode-first`: enqueued after it.
    DecodeFirst,
    /// `one-launch` (`one-launch-prefill-first`): both parts' programs in
    /// one launch (kernels/mixed_attention.cuh) where an instance serves
    /// the batch (16-bit caches, head sizes 64 and 128, a stream-decode
    /// part; the prefill part then takes 64-row programs), spread evenly
    /// (or the prefill programs first); elsewhere as `PrefillFirst`.
    OneLaunch {
        /// The prefill programs take the launch's first places.
        prefill_first: bool,
    },
}

/// Which kernel a skinny matmul (`skinny_matmul`) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SkinnyKernel {
    /// `fma`: warps of f32 FMAs over R weight rows each
    /// (`skinny_matmul_{t}_m{M}`), the kernel before the tensor-core one.
    Fma,
    /// The default: one m16n8k16 tile of 16 weight rows per program, the k
    /// range split over its warps (`skinny_mma_{t}`); as fast or faster at
    /// every row count on the Llama-3-8B projections (docs/perf.md).
    Mma,
}

/// The launch switches of one process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaunchPolicy {
    /// Decode-shaped instances allowed.
    pub(crate) stream: StreamMode,
    /// The warpgroup (wgmma) prefill instances on a device that has them;
    /// `false` keeps prefills on the mma.sync instances.
    pub(crate) wgmma: bool,
    /// Where the warp-specialised warpgroup prefill instances (16-bit
    /// caches, head sizes 64 and 128, 128-row programs) may replace the
    /// warpgroup ones.
    pub(crate) warp_specialized: WsMode,
    /// Packed rows of every prefill tile (64 or 128, up to head size 128),
    /// whatever the batch; `None`: chosen by the batch's size.
    pub(crate) prefill_rows: Option<usize>,
    /// Who merges split-KV partials, for every decode-shaped part; `None`:
    /// by kernel.
    pub(crate) split_merge: Option<Merge>,
    /// A mixed batch's launches.
    pub(crate) overlap: Overlap,
    /// The skinny matmul's kernel.
    pub(crate) skinny: SkinnyKernel,
    /// A stream-decode part split by the planner (`KvSplit::Auto` or
    /// `AutoUpTo`) and merged in its launch runs each sequence whose keys
    /// span at most this many keys unsplit, decided on the device from the
    /// sequence's length (0: never). A CUDA-graph step plans its split for
    /// the longest sequence the graph may see; short sequences then skip
    /// the partials and their merge.
    pub(crate) single_segment_keys: usize,
}

/// The default of [`LaunchPolicy::single_segment_keys`].
pub(crate) const SINGLE_SEGMENT_KEYS: usize = 256;

impl Default for LaunchPolicy {
    /// Every switch unset.
    fn default() -> Self {
        Self::from_vars(|_| None)
    }
}

impl LaunchPolicy {
    /// The policy the variables give, `var(name)` being the value of
    /// `name` (`None` when unset). Values other than those of the module
    /// table count as unset.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| var(&format!("CANDLE_PAGED_ATTENTION_{name}"));
        Self {
            stream: match get("STREAM").as_deref() {
                Some("0") => StreamMode::Off,
                Some("wide") => StreamMode::Wide,
                _ => StreamMode::Auto,
            },
            wgmma: get("WGMMA").as_deref() != Some("0"),
            warp_specialized: match get("WS").as_deref() {
                Some("0") => WsMode::Off,
                Some("1") => WsMode::On,
                _ => WsMode::Auto,
            },
            prefill_rows: get("PREFILL_ROWS")
                .and_then(|v| v.parse().ok())
                .filter(|&rows| rows == 64 || rows == 128),
            split_merge: match get("SPLIT_MERGE").as_deref() {
                Some("launch") => Some(Merge::InLaunch),
                Some("reduce") => Some(Merge::Reduce),
                _ => None,
            },
            overlap: match get("OVERLAP").as_deref() {
                Some("0") => Overlap::Off,
                Some("decode-first") => Overlap::DecodeFirst,
                Some("one-launch") => Overlap::OneLaunch {
                    prefill_first: false,
                },
                Some("one-launch-prefill-first") => Overlap::OneLaunch {
                    prefill_first: true,
                },
                _ => Overlap::PrefillFirst,
            },
            skinny: match get("SKINNY_KERNEL").as_deref() {
                Some("fma") => SkinnyKernel::Fma,
                _ => SkinnyKernel::Mma,
            },
            single_segment_keys: get("SINGLE_SEGMENT_KEYS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(SINGLE_SEGMENT_KEYS),
        }
    }

    /// The process's policy: the environment, read on first use.
    pub(crate) fn current() -> &'static Self {
        static POLICY: OnceLock<LaunchPolicy> = OnceLock::new();
        POLICY.get_or_init(|| Self::from_vars(|name| std::env::var(name).ok()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(pairs: &[(&str, &str)]) -> LaunchPolicy {
        LaunchPolicy::from_vars(|name| {
            pairs
                .iter()
                .find(|(k, _)| name == format!("CANDLE_PAGED_ATTENTION_{k}"))
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn each_variable_sets_its_field() {
        let d = LaunchPolicy::default();
        assert_eq!(
            d,
            LaunchPolicy {
                stream: StreamMode::Auto,
                wgmma: true,
                warp_specialized: WsMode::Auto,
                prefill_rows: None,
                split_merge: None,
                overlap: Overlap::PrefillFirst,
                skinny: SkinnyKernel::Mma,
                single_segment_keys: SINGLE_SEGMENT_KEYS,
            }
        );
        assert_eq!(with(&[("STREAM", "0")]).stream, StreamMode::Off);
        assert_eq!(with(&[("STREAM", "wide")]).stream, StreamMode::Wide);
        assert!(!with(&[("WGMMA", "0")]).wgmma);
        assert_eq!(with(&[("WS", "0")]).warp_specialized, WsMode::Off);
        assert_eq!(with(&[("WS", "1")]).warp_specialized, WsMode::On);
        assert_eq!(with(&[("PREFILL_ROWS", "64")]).prefill_rows, Some(64));
        assert_eq!(with(&[("PREFILL_ROWS", "128")]).prefill_rows, Some(128));
        assert_eq!(
            with(&[("SPLIT_MERGE", "launch")]).split_merge,
            Some(Merge::InLaunch)
        );
        assert_eq!(
            with(&[("SPLIT_MERGE", "reduce")]).split_merge,
            Some(Merge::Reduce)
        );
        assert_eq!(with(&[("OVERLAP", "0")]).overlap, Overlap::Off);
        assert_eq!(
            with(&[("OVERLAP", "decode-first")]).overlap,
            Overlap::DecodeFirst
        );
        assert_eq!(
            with(&[("OVERLAP", "one-launch")]).overlap,
            Overlap::OneLaunch {
                prefill_first: false
            }
        );
        assert_eq!(
            with(&[("OVERLAP", "one-launch-prefill-first")]).overlap,
            Overlap::OneLaunch {
                prefill_first: true
            }
        );
        assert_eq!(with(&[("SKINNY_KERNEL", "fma")]).skinny, SkinnyKernel::Fma);
        assert_eq!(with(&[("SINGLE_SEGMENT_KEYS", "0")]).single_segment_keys, 0);
        assert_eq!(
            with(&[("SINGLE_SEGMENT_KEYS", "512")]).single_segment_keys,
            512
        );
    }

    #[test]
    fn other_values_count_as_unset() {
        let odd = with(&[
            ("STREAM", "1"),
            ("WGMMA", "no"),
            ("WS", "off"),
            ("PREFILL_ROWS", "96"),
            ("SPLIT_MERGE", "both"),
            ("OVERLAP", "2"),
            ("SKINNY_KERNEL", "wmma"),
            ("SINGLE_SEGMENT_KEYS", "-1"),
        ]);
        assert_eq!(odd, LaunchPolicy::default());
    }
}
