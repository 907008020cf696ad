//! The grid modelled on vLLM's unified-attention test and the feature-set
//! cases.

use std::fmt;

use candle_core::DType;
use candle_paged_attention::KvSplit;

use super::case::{Case, Prefix, QqBias};

/// The two sequence mixes of vLLM's unified-attention test, as
/// `(q_len, seq_len)`: a decode, a chunked prefill and a prefill-sized
/// chunk; then three decodes.
pub const GRID_MIXES: [&[(usize, usize)]; 2] = [
    &[(1, 1328), (5, 18), (129, 463)],
    &[(1, 523), (1, 37), (1, 2011)],
];
pub const GRID_HEADS: [(usize, usize); 3] = [(4, 4), (8, 2), (5, 1)];
pub const GRID_HEAD_SIZES: [usize; 5] = [64, 80, 96, 128, 256];
pub const GRID_BLOCK_SIZES: [usize; 2] = [16, 32];
pub const GRID_WINDOWS: [Option<usize>; 3] = [None, Some(64), Some(256)];
pub const GRID_SOFTCAPS: [Option<f32>; 2] = [None, Some(50.0)];
/// `(query dtype, fp8 cache)`.
pub const GRID_DTYPES: [(DType, bool); 6] = [
    (DType::F32, false),
    (DType::F16, false),
    (DType::BF16, false),
    (DType::F32, true),
    (DType::F16, true),
    (DType::BF16, true),
];
pub const GRID_ROTATIONS: usize = 6;

fn position<T: PartialEq + fmt::Debug>(list: &[T], value: &T) -> usize {
    list.iter()
        .position(|x| x == value)
        .unwrap_or_else(|| panic!("{value:?} is not one of {list:?}"))
}

/// A case of the grid: a full product over mix x heads x block size x window
/// x softcap x rotation; the case's index in that product picks the head
/// size, the dtype pair and the split policy, so every value of those
/// dimensions appears many times and meets every value of the others.
pub fn grid_case(
    mix: usize,
    heads: (usize, usize),
    block_size: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    rotation: usize,
) -> Case {
    assert!(rotation < GRID_ROTATIONS);
    let mut k = mix;
    k = k * GRID_HEADS.len() + position(&GRID_HEADS, &heads);
    k = k * GRID_BLOCK_SIZES.len() + position(&GRID_BLOCK_SIZES, &block_size);
    k = k * GRID_WINDOWS.len() + position(&GRID_WINDOWS, &window);
    k = k * GRID_SOFTCAPS.len() + position(&GRID_SOFTCAPS, &softcap);
    k = k * GRID_ROTATIONS + rotation;
    let head_size = GRID_HEAD_SIZES[k % GRID_HEAD_SIZES.len()];
    let (dtype, fp8) = GRID_DTYPES[(k / GRID_HEAD_SIZES.len()) % GRID_DTYPES.len()];
    let split = [KvSplit::Auto, KvSplit::Never, KvSplit::Segments(3)][(k / 7) % 3];
    Case::new(GRID_MIXES[mix], heads, head_size, block_size, dtype)
        .with_fp8_cache(fp8)
        .with_window(window)
        .with_softcap(softcap)
        .with_kv_split(split)
        .with_seed(k as u64)
}

/// Feature bits of [`feature_case`].
pub const ALIBI: u32 = 1;
pub const SINKS: u32 = 2;
pub const QQ_BIAS: u32 = 4;
pub const PREFIX: u32 = 8;
pub const FP8_OUT: u32 = 16;

/// A small mixed batch (decodes, prefills, chunked prefills, a sequence
/// with no new token) with the features in `features` switched on; the
/// window, softcap and cache dtype rotate with the feature set.
pub fn feature_case(features: u32, dtype: DType) -> Case {
    let seqs = [
        (1, 57),
        (9, 9),
        (16, 80),
        (1, 1),
        (3, 20),
        (0, 12),
        (24, 24),
    ];
    let rot = features as usize + position(&[DType::F32, DType::F16, DType::BF16], &dtype);
    let qq = if features & QQ_BIAS == 0 {
        QqBias::Off
    } else if rot.is_multiple_of(2) {
        QqBias::WithNegInf
    } else {
        QqBias::Random
    };
    Case::new(&seqs, (8, 2), 64, 16, dtype)
        .with_alibi(features & ALIBI != 0)
        .with_sinks(features & SINKS != 0)
        .with_qq_bias(qq)
        .with_prefix(if features & PREFIX != 0 {
            Prefix::Random
        } else {
            Prefix::Off
        })
        .with_output_scale((features & FP8_OUT != 0).then_some(0.05))
        .with_window([None, Some(10), None, Some(33)][rot % 4])
        .with_softcap([None, Some(3.0), Some(0.0)][rot % 3])
        .with_fp8_cache(rot % 5 == 4)
        .with_kv_split([KvSplit::Auto, KvSplit::Never, KvSplit::Segments(2)][rot % 3])
        .with_seed(1000 + features as u64 * 3 + rot as u64)
}
