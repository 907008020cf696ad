//! The engine's failure isolation, one test per defect: requests that can
//! never run are refused by `add_request`, a failed step is rolled back
//! exactly and retried, a sequence that outgrows the cache alone ends with
//! its tokens, `abort`, the context length taken from the checkpoint, and
//! non-finite logits ending only their own request.
//!
//! Most tests run a mock model (`engine_mock`) whose next token is an exact
//! function of its KV cache, so the expected tokens are known exactly.

#![cfg(feature = "models")]

mod engine_mock;

use anyhow::{ensure, Result};
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_paged_attention::engine::{
    Completion, Engine, FinishReason, Request, SamplingParams, SchedulerConfig,
};
use candle_paged_attention::models::{quantized_llama, PagedModel, PagedOptions};
use candle_paged_attention::{AttentionMetadata, PagedBatch, SlotMapping};
use engine_mock::{oracle_next, Fail, MockModel, Poison, INJECTED};

const VOCAB: usize = 32;

fn request(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        id,
        prompt,
        params: SamplingParams::greedy(max_tokens),
    }
}

fn config(max_batch_tokens: usize, max_num_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_tokens,
        max_num_seqs,
    }
}

/// The greedy tokens the mock gives `prompt` when nothing stops it.
fn expected(prompt: &[u32], n: usize, window: Option<usize>) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = oracle_next(&ctx, window, VOCAB);
        out.push(t);
        ctx.push(t);
    }
    out
}

fn err_text<T>(r: candle_core::Result<T>) -> String {
    match r {
        Ok(_) => "no error".to_string(),
        Err(e) => e.to_string(),
    }
}

fn by_id(mut done: Vec<Completion>) -> Vec<Completion> {
    done.sort_by_key(|c| c.id);
    done
}

#[test]
fn out_of_vocabulary_tokens_are_refused_and_the_others_finish() -> Result<()> {
    let model = MockModel::new(4, None, VOCAB, 64)?;
    let mut engine = Engine::new(&model, model.cache(16, None, false)?, config(8, 4))?;
    engine.add_request(request(1, vec![1, 2, 3], 4))?;
    let got = err_text(engine.add_request(request(2, vec![1, VOCAB as u32], 4)));
    ensure!(
        got.starts_with("engine: request 2 has token id 32 at prompt position 1, outside the model's vocabulary of 32 tokens"),
        "{got}"
    );
    let got = err_text(engine.add_request(request(3, vec![u32::MAX], 4)));
    ensure!(
        got.starts_with("engine: request 3 has token id 4294967295 at prompt position 0"),
        "{got}"
    );
    let done = engine.run(|_| {})?;
    ensure!(done.len() == 1 && done[0].id == 1);
    ensure!(done[0].tokens == expected(&[1, 2, 3], 4, None));
    ensure!(done[0].finish == FinishReason::Length);
    Ok(())
}

#[test]
fn context_length_is_enforced_when_a_request_is_added() -> Result<()> {
    let model = MockModel::new(4, None, VOCAB, 16)?;
    let mut engine = Engine::new(&model, model.cache(16, None, false)?, config(8, 4))?;
    let got = err_text(engine.add_request(request(5, vec![1; 10], 7)));
    ensure!(
        got.starts_with("engine: request 5 needs 10 prompt tokens + 7 new tokens = 17 positions, more than the model's context length of 16"),
        "{got}"
    );
    let got = err_text(engine.add_request(request(6, vec![1; 10], usize::MAX)));
    ensure!(
        got.starts_with("engine: request 6 needs 10 prompt tokens + 18446744073709551615 new tokens = more than usize::MAX positions"),
        "{got}"
    );
    // Exactly the context length is fine: the last token is never fed back.
    engine.add_request(request(7, vec![1; 10], 6))?;
    let done = engine.run(|_| {})?;
    ensure!(done.len() == 1 && done[0].tokens == expected(&[1; 10], 6, None));
    Ok(())
}

#[test]
fn a_prompt_larger_than_the_whole_cache_is_refused() -> Result<()> {
    let model = MockModel::new(4, None, VOCAB, 64)?;
    let mut engine = Engine::new(&model, model.cache(3, None, false)?, config(8, 4))?;
    let got = err_text(engine.add_request(request(9, vec![2; 13], 1)));
    ensure!(
        got.starts_with("engine: request 9 has 13 prompt tokens, which need 4 blocks of 4 tokens, but the KV cache has 3 blocks in all"),
        "{got}"
    );
    ensure!(!engine.has_work());
    Ok(())
}

#[test]
fn invalid_sampling_and_config_name_the_parameter() -> Result<()> {
    let model = MockModel::new(4, None, VOCAB, 64)?;
    let got = err_text(Engine::new(
        &model,
        model.cache(4, None, false)?,
        config(0, 4),
    ));
    ensure!(
        got.starts_with("engine: max_batch_tokens must be at least 1, got 0"),
        "{got}"
    );
    let got = err_text(Engine::new(
        &model,
        model.cache(4, None, false)?,
        config(4, 0),
    ));
    ensure!(
        got.starts_with("engine: max_num_seqs must be at least 1, got 0"),
        "{got}"
    );
    let mut engine = Engine::new(&model, model.cache(4, None, false)?, config(8, 4))?;
    let mut r = request(4, vec![1], 2);
    r.params.temperature = 1.0;
    r.params.top_p = Some(1e-50);
    let got = err_text(engine.add_request(r));
    ensure!(
        got.starts_with("engine: request 4: sampling: top_p 1e-50 is too small: it is applied in f32 and must be at least 1.1754944e-38"),
        "{got}"
    );
    let got = err_text(engine.add_request(request(4, vec![], 2)));
    ensure!(
        got.starts_with("engine: request 4 has an empty prompt"),
        "{got}"
    );
    Ok(())
}

/// What `rollback` must restore: per request (tokens and computed positions
/// in the block manager, block count), the free blocks, the queue sizes.
type Snapshot = (
    Vec<(u64, Option<Vec<u32>>, Option<usize>, usize)>,
    usize,
    usize,
    usize,
);

fn snapshot(engine: &Engine<'_, MockModel>, ids: &[u64]) -> Snapshot {
    let m = engine.block_manager();
    let seqs = ids
        .iter()
        .map(|&id| {
            (
                id,
                m.tokens(id).map(<[u32]>::to_vec),
                m.num_computed(id),
                m.block_table(id).map_or(0, <[u32]>::len),
            )
        })
        .collect();
    (
        seqs,
        m.num_free_blocks(),
        engine.num_running(),
        engine.num_waiting(),
    )
}

#[test]
fn a_failed_step_is_rolled_back_exactly_and_the_retry_gives_the_same_tokens() -> Result<()> {
    let prompts: [Vec<u32>; 3] = [(1..12).collect(), vec![5, 6], (3..10).collect()];
    let max_tokens = [5, 7, 3];
    let ids = [0u64, 1, 2];
    fn start<'m>(
        model: &'m MockModel,
        prompts: &[Vec<u32>],
        max_tokens: &[usize],
    ) -> Result<Engine<'m, MockModel>> {
        let mut engine = Engine::new(model, model.cache(32, None, false)?, config(6, 2))?;
        for (i, p) in prompts.iter().enumerate() {
            engine.add_request(request(i as u64, p.clone(), max_tokens[i]))?;
        }
        Ok(engine)
    }
    // The forward calls of a run without failures; fail each in turn, both ways.
    let calls = {
        let model = MockModel::new(2, None, VOCAB, 64)?;
        start(&model, &prompts, &max_tokens)?.run(|_| {})?;
        model.calls()
    };
    ensure!(calls >= 10, "{calls} calls");
    for call in 0..calls {
        for how in [Fail::BeforeStore, Fail::AfterStore] {
            let model = MockModel::new(2, None, VOCAB, 64)?;
            model.fail_at(call, how);
            let mut engine = start(&model, &prompts, &max_tokens)?;
            let mut failures = 0;
            let mut steps = 0;
            while engine.has_work() {
                steps += 1;
                ensure!(steps < 100, "the engine does not finish");
                let before = snapshot(&engine, &ids);
                match engine.step() {
                    Ok(_) => {}
                    Err(e) => {
                        failures += 1;
                        let msg = e.to_string();
                        ensure!(
                            msg.starts_with("engine: the forward pass of a batch of")
                                && msg.contains("the step was rolled back and can be retried")
                                && msg.contains(INJECTED),
                            "{msg}"
                        );
                        let after = snapshot(&engine, &ids);
                        ensure!(
                            after == before,
                            "call {call} {how:?}: {after:?} != {before:?}"
                        );
                    }
                }
            }
            ensure!(failures == 1, "call {call}: {failures} failures");
            let done = by_id(engine.take_completions());
            ensure!(done.len() == 3);
            for (i, c) in done.iter().enumerate() {
                ensure!(
                    c.tokens == expected(&prompts[i], max_tokens[i], None),
                    "call {call} {how:?} request {i}: {:?}",
                    c.tokens
                );
            }
            ensure!(engine.block_manager().num_free_blocks() == 32);
        }
    }
    Ok(())
}

#[test]
fn run_returns_the_error_keeps_finished_work_and_resumes() -> Result<()> {
    let model = MockModel::new(4, None, VOCAB, 64)?;
    let mut engine = Engine::new(&model, model.cache(16, None, false)?, config(16, 4))?;
    engine.add_request(request(0, vec![1, 2], 1))?;
    engine.add_request(request(1, vec![3, 4, 5], 6))?;
    // Call 0 prefills both and finishes request 0; call 2 fails.
    model.fail_at(2, Fail::AfterStore);
    let got = err_text(engine.run(|_| {}));
    ensure!(got.contains(INJECTED), "{got}");
    let finished = engine.take_completions();
    ensure!(finished.len() == 1 && finished[0].id == 0);
    ensure!(finished[0].tokens == expected(&[1, 2], 1, None));
    ensure!(engine.has_work());
    let rest = engine.run(|_| {})?;
    ensure!(rest.len() == 1 && rest[0].tokens == expected(&[3, 4, 5], 6, None));
    ensure!(model.calls() == 7, "{} forward calls", model.calls());
    Ok(())
}

#[test]
fn a_sequence_outgrowing_the_cache_alone_ends_with_its_tokens() -> Result<()> {
    // 4 blocks of 4: 16 positions. A 6-token prompt computes positions 0..16
    // and so generates 11 tokens before its next token finds no block.
    let model = MockModel::new(4, None, VOCAB, 64)?;
    let mut engine = Engine::new(&model, model.cache(4, None, false)?, config(8, 4))?;
    let prompt: Vec<u32> = (1..7).collect();
    engine.add_request(request(0, prompt.clone(), 30))?;
    engine.add_request(request(1, vec![9, 9, 9], 3))?;
    let done = by_id(engine.run(|_| {})?);
    ensure!(done.len() == 2);
    ensure!(
        done[0].tokens == expected(&prompt, 11, None),
        "{:?}",
        done[0].tokens
    );
    let msg = done[0].error().unwrap_or("no error");
    ensure!(
        msg.starts_with("engine: request 0 outgrew the KV cache: with 17 tokens in context it needs more blocks than the cache has even alone (4 blocks of 4 tokens); it ends with the 11 tokens generated so far (block-manager: sequence 0 needs 1 more blocks but 0 are free"),
        "{msg}"
    );
    ensure!(done[1].tokens == expected(&[9, 9, 9], 3, None));
    ensure!(done[1].finish == FinishReason::Length);
    ensure!(engine.block_manager().num_free_blocks() == 4);
    Ok(())
}

#[test]
fn a_lone_prompt_chunk_too_large_for_the_window_pool_is_split() -> Result<()> {
    // Window 4, blocks of 2, a window pool of 3 blocks: a 12-token chunk needs
    // 6 window blocks at once, smaller chunks recycle as they go.
    let model = MockModel::new(2, Some(4), VOCAB, 64)?;
    let mut engine = Engine::new(&model, model.cache(32, Some(3), false)?, config(16, 4))?;
    let prompt: Vec<u32> = (0..12).collect();
    engine.add_request(request(0, prompt.clone(), 5))?;
    let done = engine.run(|_| {})?;
    ensure!(done.len() == 1 && done[0].finish == FinishReason::Length);
    ensure!(done[0].tokens == expected(&prompt, 5, Some(4)));
    ensure!(engine.block_manager().num_free_window_blocks(0) == Some(3));
    Ok(())
}

/// How a request of the non-finite logits test picks its tokens.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Device argmax.
    Greedy,
    /// Greedy with a repeat penalty: the host sampler's argmax.
    Penalised,
    /// Temperature with top-k 1 (the argmax, through the sampling path).
    Sampled,
}

fn params(mode: Mode, max_tokens: usize) -> SamplingParams {
    let greedy = SamplingParams::greedy(max_tokens);
    match mode {
        Mode::Greedy => greedy,
        // The mock's logits are one-hot (1 and 0s): a penalty of 2 keeps
        // the peak, so the expected tokens are the oracle's.
        Mode::Penalised => SamplingParams {
            repeat_penalty: 2.0,
            repeat_last_n: 8,
            ..greedy
        },
        Mode::Sampled => SamplingParams {
            temperature: 0.8,
            top_k: Some(1),
            ..greedy
        },
    }
}

#[test]
fn non_finite_logits_end_their_request_with_an_error_and_the_others_finish() -> Result<()> {
    // Request 2 (first token 7) gets non-finite logits from position 4 on:
    // its rows at positions 2 and 3 give two tokens, the third fails.
    let poisoned: Vec<u32> = vec![7, 1, 2];
    let others: [(u64, Vec<u32>); 3] = [(0, vec![1, 2, 3]), (1, vec![4, 5]), (3, vec![9, 9, 9, 9])];
    let poisons = [
        (f32::NAN, true),
        (f32::NAN, false),
        (f32::INFINITY, false),
        (f32::NEG_INFINITY, true),
    ];
    let modes = [Mode::Greedy, Mode::Penalised, Mode::Sampled];
    for (value, whole_row) in poisons {
        for mode in modes {
            // All requests greedy (the device argmax of every row), or the
            // others in the three modes (the greedy rows gathered).
            for mixed in [false, true] {
                let case = format!("{value} whole_row={whole_row} {mode:?} mixed={mixed}");
                let model = MockModel::new(4, None, VOCAB, 64)?;
                model.poison(Poison {
                    first_token: 7,
                    from_position: 4,
                    value,
                    whole_row,
                });
                let mut engine = Engine::new(&model, model.cache(16, None, false)?, config(16, 4))?;
                engine.add_request(Request {
                    id: 2,
                    prompt: poisoned.clone(),
                    params: params(mode, 5),
                })?;
                for (n, (id, prompt)) in others.iter().enumerate() {
                    let mode = if mixed { modes[n] } else { Mode::Greedy };
                    engine.add_request(Request {
                        id: *id,
                        prompt: prompt.clone(),
                        params: params(mode, 5),
                    })?;
                }
                let done = by_id(engine.run(|_| {})?);
                ensure!(done.len() == 4, "{case}: {} completions", done.len());
                for c in &done {
                    if c.id == 2 {
                        let msg = c.error().unwrap_or("no error");
                        ensure!(
                            msg.starts_with("engine: request 2: ")
                                && msg.contains("non-finite logits"),
                            "{case}: {msg}"
                        );
                        ensure!(
                            c.tokens == expected(&poisoned, 2, None),
                            "{case}: {:?}",
                            c.tokens
                        );
                    } else {
                        let prompt = &others.iter().find(|(id, _)| *id == c.id).unwrap().1;
                        ensure!(c.finish == FinishReason::Length, "{case}: {:?}", c.finish);
                        ensure!(
                            c.tokens == expected(prompt, 5, None),
                            "{case}: request {}: {:?}",
                            c.id,
                            c.tokens
                        );
                    }
                }
                ensure!(engine.block_manager().num_free_blocks() == 16, "{case}");
            }
        }
    }
    // The messages of a greedy and a penalised row, in full.
    let model = MockModel::new(4, None, VOCAB, 64)?;
    model.poison(Poison {
        first_token: 7,
        from_position: 0,
        value: f32::NAN,
        whole_row: true,
    });
    let mut engine = Engine::new(&model, model.cache(16, None, false)?, config(16, 4))?;
    for (id, mode) in [(5, Mode::Greedy), (6, Mode::Penalised)] {
        engine.add_request(Request {
            id,
            prompt: poisoned.clone(),
            params: params(mode, 3),
        })?;
    }
    let done = by_id(engine.run(|_| {})?);
    ensure!(done.iter().all(|c| c.tokens.is_empty()));
    let msgs: Vec<&str> = done
        .iter()
        .map(|c| c.error().unwrap_or("no error"))
        .collect();
    ensure!(
        msgs[0] == "engine: request 5: the model gave non-finite logits (NaN or infinity) for its next token (token 0 of 32 has logit NaN); no token can be picked"
            && msgs[1] == "engine: request 6: the model gave non-finite logits (NaN or infinity) for its next token (token 0 of 32 has logit NaN); no token can be picked",
        "{msgs:?}"
    );
    ensure!(engine.block_manager().num_free_blocks() == 16);
    Ok(())
}

#[test]
fn abort_cancels_waiting_and_running_requests() -> Result<()> {
    let model = MockModel::new(2, None, VOCAB, 64)?;
    let mut engine = Engine::new(&model, model.cache(8, None, false)?, config(8, 1))?;
    engine.add_request(request(1, vec![1, 2, 3], 10))?;
    engine.add_request(request(2, vec![4, 5], 10))?;
    engine.step()?;
    engine.step()?;
    ensure!(engine.num_running() == 1 && engine.num_waiting() == 1);
    ensure!(engine.block_manager().num_free_blocks() == 6);
    let waiting = engine.abort(2)?.map(|c| (c.finish, c.tokens));
    ensure!(
        waiting == Some((FinishReason::Aborted, vec![])),
        "{waiting:?}"
    );
    let running = engine.abort(1)?.map(|c| (c.finish, c.tokens));
    ensure!(
        running == Some((FinishReason::Aborted, expected(&[1, 2, 3], 2, None))),
        "{running:?}"
    );
    ensure!(engine.abort(1)?.is_none() && engine.abort(99)?.is_none());
    ensure!(!engine.has_work() && engine.block_manager().num_free_blocks() == 8);
    ensure!(engine.step()?.is_empty() && engine.take_completions().is_empty());
    Ok(())
}

/// SmolLM2's GGUF says `llama.context_length` 8192: the model takes it as
/// its context length and runs a token at position 5000 (beyond the 4096 of
/// candle-transformers' fixed rotary table), refuses position 8192 and an
/// out-of-vocabulary id before embedding it.
#[test]
fn gguf_context_length_sizes_the_model() -> Result<()> {
    let path = candle_paged_attention::text::fetch::fetch_model("fetch-smollm2.sh")?;
    let mut file = std::fs::File::open(&path)?;
    let ct = gguf_file::Content::read(&mut file)?;
    let dev = Device::Cpu;
    let model =
        quantized_llama::QuantizedLlama::from_gguf(&ct, &mut file, &dev, PagedOptions::default())?;
    ensure!(model.params().context_length == Some(8192));
    ensure!(model.max_seq_len() == 8192 && model.vocab_size() == 49152);
    let cache = candle_paged_attention::models::PagedKvCache::new(
        &model.attention_layers(),
        candle_paged_attention::models::CacheConfig::new(1),
        model.dtype(),
        &dev,
    )?;
    // One token at `pos`, every block of its table being block 0 (block ids
    // may repeat): the keys are the cache's zeros, the position is real.
    let one_token_at = |pos: u32| -> candle_core::Result<AttentionMetadata> {
        let width = (pos as usize + 1).div_ceil(16);
        let batch = PagedBatch::new(&[0, 1], &[pos + 1], &vec![0; width], width, 16, &dev)?;
        AttentionMetadata::new(batch, SlotMapping::new(&[(pos % 16) as i64], &dev)?)
    };
    let ids = Tensor::new(&[42u32], &dev)?;
    let logits = model.forward(&ids, &one_token_at(5000)?, &cache, &[0])?;
    ensure!(logits.dims() == [1, 49152]);
    let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
    ensure!(logits.iter().all(|x| x.is_finite()));
    let got = err_text(model.forward(&ids, &one_token_at(8192)?, &cache, &[0]));
    ensure!(
        got.starts_with("rotary-embedding: position 8192 is beyond the model's context length of 8192 positions"),
        "{got}"
    );
    let bad = Tensor::new(&[u32::MAX], &dev)?;
    let got = err_text(model.forward(&bad, &one_token_at(3)?, &cache, &[0]));
    ensure!(
        got.starts_with("quantized-llama: token id 4294967295 at row 0 is outside the vocabulary of 49152 tokens"),
        "{got}"
    );
    Ok(())
}
