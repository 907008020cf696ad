//! Property test: random mixed batches (decodes, prefills, chunked prefills,
//! sequences with no new token) with random shapes and features match the
//! f64 reference, as `NAME::cpu` and, with the `cuda` feature, `NAME::cuda`
//! (see `common::device`).

#[macro_use]
mod common;

use anyhow::Result;
use candle_core::{DType, Device};
use candle_paged_attention::KvSplit;
use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestError, TestRunner};

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

/// Runs `check_case` on 256 cases drawn from `strategy` (proptest shrinks a
/// failing case and reports the smallest it finds).
fn check_cases(strategy: impl Strategy<Value = Case>, dev: &Device) -> Result<()> {
    let config = Config {
        source_file: Some(file!()),
        ..Config::with_cases(256)
    };
    let result = TestRunner::new(config).run(&strategy, |case| {
        check_case(&case, dev).map_err(|e| TestCaseError::fail(format!("{e:#}")))
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(why, case)) => anyhow::bail!("{why}\nminimal failing case: {case:?}"),
        Err(TestError::Abort(why)) => anyhow::bail!("proptest aborted: {why}"),
    }
}

device_test! {
    fn random_batches_match_oracle(dev: &Device) -> Result<()> {
        check_cases(case(), dev)
    }
}

device_test! {
    fn tiny_batches_match_oracle(dev: &Device) -> Result<()> {
        check_cases(tiny_case(), dev)
    }
}
