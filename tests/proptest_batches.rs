//! Property test: random mixed batches (decodes, prefills, chunked prefills,
//! sequences with no new token) with random shapes and features match the
//! f64 oracle on the CPU.

mod common;

use candle_core::{DType, Device};
use candle_paged_attention::KvSplit;
use common::*;
use proptest::prelude::*;

/// `(q_len, seq_len)` of one sequence.
fn seq() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        3 => (1usize..=1200).prop_map(|l| (1, l)),
        2 => (1usize..=96).prop_map(|q| (q, q)),
        2 => (2usize..=64, 1usize..=600).prop_map(|(q, ctx)| (q, q + ctx)),
        1 => (0usize..=40).prop_map(|l| (0, l)),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    let shape = (
        prop::collection::vec(seq(), 1..=8),
        prop::sample::select(vec![
            (1usize, 1usize),
            (2, 1),
            (4, 4),
            (8, 2),
            (5, 1),
            (6, 3),
            (9, 3),
            (4, 1),
        ]),
        prop::sample::select(vec![32usize, 48, 64, 80, 96, 112, 128, 192, 256]),
        prop::sample::select(vec![1usize, 3, 8, 16, 32, 64]),
        prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        prop::bool::weighted(0.25),
        prop::option::weighted(0.2, 1usize..=6),
    );
    let features = (
        prop::option::weighted(0.4, 1usize..=120),
        prop_oneof![
            Just(None),
            Just(Some(0.0f32)),
            (0.5f32..60.0).prop_map(Some)
        ],
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec![QqBias::Off, QqBias::Random, QqBias::WithNegInf]),
        any::<bool>(),
        prop::option::weighted(0.2, 0.01f32..2.0),
        prop_oneof![
            Just(KvSplit::Auto),
            Just(KvSplit::Never),
            (1u32..=8).prop_map(KvSplit::Segments)
        ],
        any::<u64>(),
    );
    (shape, features).prop_map(
        |(
            (seqs, heads, head_size, block_size, dtype, fp8, num_blocks),
            (window, softcap, alibi, sinks, qq, prefix, out_scale, split, seed),
        )| {
            let mut case = Case::new(&seqs, heads, head_size, block_size, dtype)
                .with_fp8_cache(fp8)
                .with_window(window)
                .with_softcap(softcap)
                .with_alibi(alibi)
                .with_sinks(sinks)
                .with_qq_bias(qq)
                .with_prefix(if prefix { Prefix::Random } else { Prefix::Off })
                .with_output_scale(out_scale)
                .with_kv_split(split)
                .with_seed(seed);
            if let Some(n) = num_blocks {
                case = case.with_num_blocks(n);
            }
            case
        },
    )
}

/// Tiny shapes where off-by-one errors show: block sizes 1..=5, windows
/// 1..=4, sequences of a few tokens, odd head sizes.
fn tiny_case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((0usize..=6, 0usize..=10), 1..=6),
        prop::sample::select(vec![(1usize, 1usize), (2, 1), (3, 3), (4, 2)]),
        prop::sample::select(vec![1usize, 4, 16, 33]),
        1usize..=5,
        prop::option::of(1usize..=4),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec![QqBias::Off, QqBias::Random, QqBias::WithNegInf]),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(seqs, heads, head_size, block_size, window, alibi, sinks, qq, prefix, seed)| {
                let seqs: Vec<_> = seqs.into_iter().map(|(q, ctx)| (q, q + ctx)).collect();
                Case::new(&seqs, heads, head_size, block_size, DType::F32)
                    .with_window(window)
                    .with_alibi(alibi)
                    .with_sinks(sinks)
                    .with_qq_bias(qq)
                    .with_prefix(if prefix { Prefix::Random } else { Prefix::Off })
                    .with_seed(seed)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_batches_match_oracle(case in case()) {
        check_case(&case, &Device::Cpu).map_err(|e| TestCaseError::fail(format!("{e:#}")))?;
    }

    #[test]
    fn tiny_batches_match_oracle(case in tiny_case()) {
        check_case(&case, &Device::Cpu).map_err(|e| TestCaseError::fail(format!("{e:#}")))?;
    }
}
