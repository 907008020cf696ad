//! Property test of the engine: random request streams (prompt lengths
//! with shared prefixes, `max_tokens`, arrival steps, aborts, stop tokens,
//! greedy and sampled requests) over caches small enough to force
//! preemption, sliding-window pools and prefix caching, with a mock model
//! that fails on chosen forward calls (before or after storing its keys and
//! values). For every case:
//!
//! * the `step` / `run` loop terminates, and every step error is an
//!   injected failure;
//! * each request ends exactly once: refused by `add_request`, aborted, or
//!   one completion;
//! * greedy tokens and finish reasons equal those of the mock's exact
//!   oracle (the request alone), sampled ones those of the request run
//!   alone through an engine without failures; aborted requests hold a
//!   prefix of them; the token events of each request are its tokens;
//! * every block is free again at the end.

#![cfg(feature = "models")]

mod engine_mock;

use std::collections::HashMap;

use candle_paged_attention::engine::{
    Completion, Engine, EngineStats, FinishReason, Request, SamplingParams, SchedulerConfig,
    TokenEvent,
};
use engine_mock::{oracle_next, Fail, MockModel, INJECTED};
use proptest::prelude::*;

const VOCAB: usize = 32;

#[derive(Clone, Debug)]
struct Req {
    prompt: Vec<u32>,
    max_tokens: usize,
    /// Driver tick at which it is added.
    arrival: usize,
    /// Ticks after its arrival at which it is aborted.
    abort_after: Option<usize>,
    /// Sampled at temperature 1 instead of greedy.
    sampled: bool,
    seed: u64,
    stop: Option<u32>,
}

#[derive(Clone, Debug)]
struct Case {
    block_size: usize,
    num_blocks: usize,
    /// The window layer's window and its pool's blocks (`None` for the
    /// pool: the layer reads the full tables).
    window: Option<(usize, Option<usize>)>,
    prefix_caching: bool,
    max_batch_tokens: usize,
    max_num_seqs: usize,
    max_seq_len: usize,
    requests: Vec<Req>,
    /// Forward calls that fail.
    failures: Vec<(usize, Fail)>,
    /// Drive the end with `run` instead of `step`.
    finish_with_run: bool,
}

fn request_strategy(bases: Vec<Vec<u32>>) -> impl Strategy<Value = Req> {
    (
        (
            0..bases.len(),
            0usize..12,
            prop::collection::vec(0..VOCAB as u32, 0..6),
        ),
        1usize..12,
        0usize..10,
        prop::option::weighted(0.25, 0usize..16),
        prop::bool::weighted(0.25),
        any::<u64>(),
        prop::option::weighted(0.3, 0..VOCAB as u32),
        prop::bool::weighted(0.04),
    )
        .prop_map(
            move |(
                (b, cut, suffix),
                max_tokens,
                arrival,
                abort_after,
                sampled,
                seed,
                stop,
                oov,
            )| {
                let base = &bases[b];
                let mut prompt = base[..cut.min(base.len())].to_vec();
                prompt.extend(suffix);
                if prompt.is_empty() {
                    prompt.push(seed as u32 % VOCAB as u32);
                }
                if oov {
                    prompt.push(VOCAB as u32);
                }
                Req {
                    prompt,
                    max_tokens,
                    arrival,
                    abort_after,
                    sampled,
                    seed,
                    stop,
                }
            },
        )
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let shape = (
        prop::sample::select(vec![1usize, 2, 4]),
        1usize..=16,
        prop::option::weighted(0.35, (1usize..8, prop::option::weighted(0.7, 0usize..3))),
        prop::bool::weighted(0.5),
        1usize..12,
        1usize..6,
        12usize..48,
    );
    let bases = prop::collection::vec(prop::collection::vec(0..VOCAB as u32, 1..14), 2);
    (shape, bases)
        .prop_flat_map(|(shape, bases)| {
            (
                Just(shape),
                prop::collection::vec(request_strategy(bases), 1..9),
                prop::collection::vec(
                    (
                        0usize..40,
                        prop::sample::select(vec![Fail::BeforeStore, Fail::AfterStore]),
                    ),
                    0..5,
                ),
                any::<bool>(),
            )
        })
        .prop_map(|(shape, requests, failures, finish_with_run)| {
            let (bs, num_blocks, window, prefix, tokens, seqs, max_seq_len) = shape;
            // A window pool always holds the blocks of one token's window
            // (ceil(w / bs) + 1), so a sequence alone never fails on it.
            let window = window.map(|(w, extra)| (w, extra.map(|e| w.div_ceil(bs) + 1 + e)));
            Case {
                block_size: bs,
                num_blocks,
                prefix_caching: prefix && window.is_none_or(|(_, pool)| pool.is_none()),
                window,
                max_batch_tokens: tokens,
                max_num_seqs: seqs,
                max_seq_len,
                requests,
                failures,
                finish_with_run,
            }
        })
}

fn model_of(case: &Case) -> MockModel {
    MockModel::new(
        case.block_size,
        case.window.map(|(w, _)| w),
        VOCAB,
        case.max_seq_len,
    )
    .expect("mock model")
}

fn engine_of<'m>(case: &Case, model: &'m MockModel) -> Engine<'m, MockModel> {
    let cache = model
        .cache(
            case.num_blocks,
            case.window.and_then(|(_, pool)| pool),
            case.prefix_caching,
        )
        .expect("cache");
    Engine::new(
        model,
        cache,
        SchedulerConfig {
            max_batch_tokens: case.max_batch_tokens,
            max_num_seqs: case.max_num_seqs,
        },
    )
    .expect("engine")
}

fn request_of(id: usize, r: &Req) -> Request {
    Request {
        id: id as u64,
        prompt: r.prompt.clone(),
        params: SamplingParams {
            temperature: if r.sampled { 1.0 } else { 0.0 },
            seed: r.seed,
            max_tokens: r.max_tokens,
            stop_tokens: r.stop.into_iter().collect(),
            ..Default::default()
        },
    }
}

/// How a request ends when it runs alone.
#[derive(Clone, Debug, PartialEq)]
enum Expected {
    Refused,
    Done(Vec<u32>, FinishReason),
}

/// The mock's exact outcome for a greedy request alone: refused up front, or
/// its tokens until a stop token, `max_tokens`, or the cache's last block.
fn oracle(case: &Case, r: &Req) -> Expected {
    let cap = case.num_blocks * case.block_size;
    if r.prompt.iter().any(|&t| t as usize >= VOCAB)
        || r.prompt.len() + r.max_tokens > case.max_seq_len
        || r.prompt.len().div_ceil(case.block_size) > case.num_blocks
    {
        return Expected::Refused;
    }
    let window = case.window.map(|(w, _)| w);
    let mut ctx = r.prompt.clone();
    let mut out = Vec::new();
    loop {
        let t = oracle_next(&ctx, window, VOCAB);
        out.push(t);
        if r.stop == Some(t) {
            return Expected::Done(out, FinishReason::Stop);
        }
        if out.len() == r.max_tokens {
            return Expected::Done(out, FinishReason::Length);
        }
        if ctx.len() + 1 > cap {
            // The message is checked by prefix in `same_finish`.
            return Expected::Done(out, FinishReason::Error(String::new()));
        }
        ctx.push(t);
    }
}

/// The request run alone through an engine without failures.
fn alone(case: &Case, id: usize, r: &Req) -> Expected {
    let model = model_of(case);
    let mut engine = engine_of(case, &model);
    if engine.add_request(request_of(id, r)).is_err() {
        return Expected::Refused;
    }
    let done = engine.run(|_| {}).expect("a run without failures");
    assert_eq!(done.len(), 1);
    let c = done.into_iter().next().expect("one completion");
    Expected::Done(c.tokens, c.finish)
}

fn same_finish(got: &FinishReason, want: &FinishReason, id: usize) -> bool {
    match (got, want) {
        (FinishReason::Error(g), FinishReason::Error(w)) => {
            g.starts_with(&format!("engine: request {id} outgrew the KV cache"))
                && (w.is_empty() || g == w)
        }
        _ => got == want,
    }
}

/// Runs `case` with its failures; fails (through `prop_assert`) on any
/// violated property. Returns the engine's counters.
fn check(case: &Case) -> Result<EngineStats, TestCaseError> {
    let model = model_of(case);
    for &(call, how) in &case.failures {
        model.fail_at(call, how);
    }
    let mut engine = engine_of(case, &model);
    let n = case.requests.len();
    let mut refused = vec![false; n];
    let mut aborted: Vec<Option<Completion>> = vec![None; n];
    let mut completed: Vec<Vec<Completion>> = vec![Vec::new(); n];
    let mut events: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut errors = 0usize;
    let last_tick = case
        .requests
        .iter()
        .map(|r| r.arrival + r.abort_after.unwrap_or(0))
        .max()
        .unwrap_or(0);
    let record = |evs: &[TokenEvent], events: &mut Vec<Vec<u32>>| {
        for ev in evs {
            events[ev.id as usize].push(ev.token);
        }
    };
    let mut tick = 0;
    loop {
        prop_assert!(tick < 5_000, "the driver loop does not terminate");
        for (i, r) in case.requests.iter().enumerate() {
            if r.arrival == tick {
                refused[i] = engine.add_request(request_of(i, r)).is_err();
            }
            if r.abort_after.map(|a| r.arrival + a) == Some(tick) && !refused[i] {
                aborted[i] = engine.abort(i as u64).expect("abort");
            }
        }
        if tick >= last_tick {
            if !engine.has_work() {
                break;
            }
            if case.finish_with_run {
                let mut evs = Vec::new();
                match engine.run(|ev| evs.push(ev.clone())) {
                    Ok(done) => {
                        record(&evs, &mut events);
                        for c in done {
                            completed[c.id as usize].push(c);
                        }
                        break;
                    }
                    Err(e) => {
                        record(&evs, &mut events);
                        prop_assert!(e.to_string().contains(INJECTED), "{e}");
                        errors += 1;
                        for c in engine.take_completions() {
                            completed[c.id as usize].push(c);
                        }
                        tick += 1;
                        continue;
                    }
                }
            }
        }
        let free = engine.block_manager().num_free_blocks();
        let live = engine.num_running() + engine.num_waiting();
        let result = engine.step();
        let finished = engine.take_completions();
        match result {
            Ok(evs) => record(&evs, &mut events),
            Err(e) => {
                prop_assert!(e.to_string().contains(INJECTED), "{e}");
                errors += 1;
                // Rolled back: no block kept (preemptions and requests that
                // ended before the failure may free some), no request lost.
                prop_assert!(engine.block_manager().num_free_blocks() >= free);
                prop_assert_eq!(
                    engine.num_running() + engine.num_waiting() + finished.len(),
                    live
                );
            }
        }
        for c in finished {
            completed[c.id as usize].push(c);
        }
        tick += 1;
    }
    for c in engine.take_completions() {
        completed[c.id as usize].push(c);
    }
    let fired = case
        .failures
        .iter()
        .map(|&(call, _)| call)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|&call| call < model.calls())
        .count();
    prop_assert_eq!(errors, fired, "every injected failure is one error");

    let mut alone_cache: HashMap<usize, Expected> = HashMap::new();
    for (i, r) in case.requests.iter().enumerate() {
        let endings = refused[i] as usize + aborted[i].is_some() as usize + completed[i].len();
        prop_assert_eq!(endings, 1, "request {} ends {} times", i, endings);
        let want = if r.sampled {
            alone_cache
                .entry(i)
                .or_insert_with(|| alone(case, i, r))
                .clone()
        } else {
            oracle(case, r)
        };
        match (&want, refused[i]) {
            (Expected::Refused, true) => continue,
            (Expected::Refused, false) | (_, true) => {
                prop_assert!(
                    false,
                    "request {i}: refused {} but expected {want:?}",
                    refused[i]
                );
            }
            _ => {}
        }
        let Expected::Done(tokens, finish) = want else {
            unreachable!("refusals handled above")
        };
        if let Some(c) = &aborted[i] {
            prop_assert_eq!(&c.finish, &FinishReason::Aborted);
            prop_assert!(
                tokens.starts_with(&c.tokens),
                "request {i}: aborted with {:?}, not a prefix of {tokens:?}",
                c.tokens
            );
            prop_assert_eq!(&events[i], &c.tokens, "request {} events", i);
            continue;
        }
        let c = &completed[i][0];
        prop_assert_eq!(&c.tokens, &tokens, "request {} tokens", i);
        prop_assert!(
            same_finish(&c.finish, &finish, i),
            "request {i}: {:?} vs {finish:?}",
            c.finish
        );
        prop_assert_eq!(&events[i], &c.tokens, "request {} events", i);
    }
    let manager = engine.block_manager();
    prop_assert_eq!(manager.num_sequences(), 0);
    prop_assert_eq!(manager.num_free_blocks(), case.num_blocks);
    prop_assert_eq!(manager.num_used_blocks(), 0);
    let stats = engine.stats();
    prop_assert!(stats.peak_used_blocks <= case.num_blocks, "{stats:?}");
    prop_assert_eq!(stats.num_blocks, case.num_blocks);
    if !case.prefix_caching {
        prop_assert_eq!(stats.prefix_cache_hit_tokens, 0);
    }
    // Hits are whole blocks of prompts (and of contexts recomputed after a
    // preemption).
    prop_assert_eq!(stats.prefix_cache_hit_tokens % case.block_size, 0);
    if let Some((_, Some(pool))) = case.window {
        prop_assert_eq!(manager.num_free_window_blocks(0), Some(pool));
    }
    Ok(stats)
}

/// The oracle is what the engine gives a greedy request alone.
fn check_oracle_is_alone(case: &Case) -> Result<(), TestCaseError> {
    if let Some((i, r)) = case.requests.iter().enumerate().find(|(_, r)| !r.sampled) {
        let (a, o) = (alone(case, i, r), oracle(case, r));
        let same = match (&a, &o) {
            (Expected::Done(ta, fa), Expected::Done(to, fo)) => ta == to && same_finish(fa, fo, i),
            _ => a == o,
        };
        prop_assert!(same, "alone {a:?} vs oracle {o:?}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1024,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_survives_failures_and_matches_requests_alone(case in case_strategy()) {
        check_oracle_is_alone(&case)?;
        check(&case)?;
    }
}

/// The random streams exercise prefix caching: in a fixed sample of cases,
/// many take blocks from the cache (the properties above then hold with
/// blocks shared between requests, within a step and across steps).
#[test]
fn random_streams_share_prefixes() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = case_strategy();
    let (mut with_cache, mut with_hits) = (0, 0);
    for _ in 0..300 {
        let case = strategy.new_tree(&mut runner).expect("a case").current();
        let stats = check(&case).expect("the properties hold");
        with_cache += case.prefix_caching as usize;
        with_hits += (stats.prefix_cache_hit_tokens > 0) as usize;
    }
    eprintln!("{with_hits} of {with_cache} cases with prefix caching had hits");
    assert!(
        with_hits * 3 >= with_cache && with_cache >= 100,
        "{with_hits} of {with_cache} cases with prefix caching had hits"
    );
}
