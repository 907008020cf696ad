//! Continuous batching: an engine that admits requests, schedules chunked
//! prefills and decodes within a token budget, runs the model and samples.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use candle_core::{bail, Result, Tensor};

use super::sampling::{Sampler, SamplingParams};
use crate::cache::{BlockManager, Work};
use crate::models::{PagedKvCache, PagedModel};

const OP: &str = "engine";

/// Limits of one engine step.
///
/// * `max_batch_tokens` - query tokens per step (decodes count one each;
///   prompts are prefilled in chunks that fit what is left).
/// * `max_num_seqs` - sequences running at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Token budget of a step.
    pub max_batch_tokens: usize,
    /// Running sequences at most.
    pub max_num_seqs: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_num_seqs: 64,
        }
    }
}

/// A prompt to complete.
#[derive(Clone, Debug)]
pub struct Request {
    /// Caller-chosen id, unique among live requests.
    pub id: u64,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced a stop token.
    Stop,
    /// It reached `max_tokens`.
    Length,
}

/// A token produced by [`Engine::step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenEvent {
    /// The request.
    pub id: u64,
    /// The new token.
    pub token: u32,
    /// Set when this was the sequence's last token.
    pub finished: Option<FinishReason>,
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The request.
    pub id: u64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub finish: FinishReason,
    /// From admission to the first token.
    pub time_to_first_token: Duration,
    /// From admission to the last token.
    pub latency: Duration,
    /// Times it was preempted (its cache dropped and recomputed).
    pub preemptions: usize,
}

#[derive(Debug)]
struct Sequence {
    request: Request,
    generated: Vec<u32>,
    /// Sampled but not yet fed back.
    pending: Option<u32>,
    sampler: Sampler,
    arrival: Instant,
    first_token: Option<Duration>,
    preemptions: usize,
}

impl Sequence {
    /// Tokens the cache must hold before decoding resumes: the prompt and
    /// everything generated (after a preemption, all of it is recomputed).
    fn context(&self) -> Vec<u32> {
        let mut t = self.request.prompt.clone();
        t.extend_from_slice(&self.generated);
        t
    }
}

/// Runs requests through a [`PagedModel`] with continuous batching.
///
/// Each [`step`](Self::step) schedules the decodes of all running sequences,
/// then prefill chunks of sequences still reading their prompts, then admits
/// waiting requests while the token budget and `max_num_seqs` allow. When
/// the cache runs out of blocks, the newest sequence is preempted (its
/// blocks freed, its prompt and generated tokens recomputed later).
pub struct Engine<'m, M: PagedModel + ?Sized> {
    model: &'m M,
    cache: PagedKvCache,
    manager: BlockManager,
    config: SchedulerConfig,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    completions: Vec<Completion>,
    steps: usize,
}

impl<'m, M: PagedModel + ?Sized> Engine<'m, M> {
    /// An engine over `model` whose layers store into `cache`.
    pub fn new(model: &'m M, cache: PagedKvCache, config: SchedulerConfig) -> Result<Self> {
        if config.max_batch_tokens == 0 || config.max_num_seqs == 0 {
            bail!("{OP}: max_batch_tokens and max_num_seqs must be positive, got {config:?}");
        }
        let manager = cache.block_manager()?;
        Ok(Self {
            model,
            cache,
            manager,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            completions: Vec::new(),
            steps: 0,
        })
    }

    /// Queues a request; it joins the running batch at a later step.
    pub fn add_request(&mut self, request: Request) -> Result<()> {
        request.params.validate()?;
        if request.prompt.is_empty() {
            bail!("{OP}: request {} has an empty prompt", request.id);
        }
        let id = request.id;
        if self
            .running
            .iter()
            .chain(&self.waiting)
            .any(|s| s.request.id == id)
        {
            bail!("{OP}: request id {id} is already queued or running");
        }
        self.waiting.push_back(Sequence {
            sampler: Sampler::new(&request.params),
            request,
            generated: Vec::new(),
            pending: None,
            arrival: Instant::now(),
            first_token: None,
            preemptions: 0,
        });
        Ok(())
    }

    /// True while requests are waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Sequences in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Steps run so far.
    pub fn num_steps(&self) -> usize {
        self.steps
    }

    /// The caches.
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// Finished requests, in the order they finished (drained).
    pub fn take_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.completions)
    }

    /// Runs steps until every request has finished; `on_token` sees each
    /// token as it is sampled. Returns the completions in finishing order.
    pub fn run(&mut self, mut on_token: impl FnMut(&TokenEvent)) -> Result<Vec<Completion>> {
        while self.has_work() {
            for ev in self.step()? {
                on_token(&ev);
            }
        }
        Ok(self.take_completions())
    }

    /// Schedules and runs one batch; returns the tokens it sampled.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>> {
        // Admissions allowed this step: lowered when a batch does not fit.
        let mut admit_limit = usize::MAX;
        loop {
            let admitted = self.admit(admit_limit);
            let work = self.plan();
            if work.is_empty() {
                if self.waiting.is_empty() {
                    return Ok(Vec::new());
                }
                bail!(
                    "{OP}: request {} cannot be scheduled: its {} prompt tokens need more blocks than the cache has free ({} free of {})",
                    self.waiting[0].request.id,
                    self.waiting[0].context().len(),
                    self.manager.num_free_blocks(),
                    self.cache.config().num_blocks
                );
            }
            match self.manager.schedule(&work, self.model.device()) {
                Ok(batch) => return self.run_batch(batch),
                Err(e) => {
                    if admitted > 0 {
                        self.unadmit(admitted)?;
                        admit_limit = admitted - 1;
                    } else if self.running.len() > 1 {
                        self.preempt_newest()?;
                        admit_limit = 0;
                    } else {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Moves up to `limit` waiting requests into the running batch while
    /// sequences and a rough block estimate allow; returns how many joined.
    fn admit(&mut self, limit: usize) -> usize {
        let bs = self.cache.block_size();
        let mut free = self.manager.num_free_blocks();
        let mut admitted = 0;
        while admitted < limit && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let need = seq.context().len().div_ceil(bs);
            // The first admission of an empty batch always tries, so that an
            // impossible prompt reports an error instead of waiting forever.
            if need > free && !(self.running.is_empty() && admitted == 0) {
                break;
            }
            let seq = self.waiting.pop_front().expect("front exists");
            if self
                .manager
                .add_sequence(seq.request.id, &seq.context())
                .is_err()
            {
                self.waiting.push_front(seq);
                break;
            }
            free = free.saturating_sub(need);
            self.running.push(seq);
            admitted += 1;
        }
        admitted
    }

    /// Takes the `n` newest admissions back to the waiting queue.
    fn unadmit(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let seq = self.running.pop().expect("admitted sequences are running");
            self.manager.free(seq.request.id)?;
            self.waiting.push_front(seq);
        }
        Ok(())
    }

    /// Frees the newest running sequence and queues it for recomputation.
    fn preempt_newest(&mut self) -> Result<()> {
        let mut seq = self.running.pop().expect("at least two sequences run");
        self.manager.free(seq.request.id)?;
        seq.pending = None;
        seq.preemptions += 1;
        self.waiting.push_front(seq);
        Ok(())
    }

    /// Decodes first, then prefill chunks, within the token budget.
    fn plan(&self) -> Vec<Work> {
        let mut budget = self.config.max_batch_tokens;
        let mut work = Vec::with_capacity(self.running.len());
        for seq in &self.running {
            if let Some(token) = seq.pending {
                work.push(Work::Decode {
                    seq_id: seq.request.id,
                    token,
                });
                budget = budget.saturating_sub(1);
            }
        }
        for seq in &self.running {
            if seq.pending.is_some() || budget == 0 {
                continue;
            }
            let id = seq.request.id;
            let total = self.manager.tokens(id).map_or(0, |t| t.len());
            let done = self.manager.num_computed(id).unwrap_or(total);
            let n = (total - done).min(budget);
            if n > 0 {
                work.push(Work::Prefill {
                    seq_id: id,
                    num_tokens: n,
                });
                budget -= n;
            }
        }
        work
    }

    fn run_batch(&mut self, batch: crate::cache::ScheduledBatch) -> Result<Vec<TokenEvent>> {
        self.steps += 1;
        let dev = self.model.device();
        let input = Tensor::new(batch.token_ids.as_slice(), dev)?;
        let ready: Vec<usize> = (0..batch.seq_ids.len())
            .filter(|&i| batch.ready[i])
            .collect();
        let mut events = Vec::with_capacity(ready.len());
        for seq in &mut self.running {
            if batch.seq_ids.contains(&seq.request.id) {
                seq.pending = None;
            }
        }
        if ready.is_empty() {
            // Only prompt chunks that do not end their prompts: the keys and
            // values are stored, no logits are needed (one row is computed).
            self.model
                .forward(&input, &batch.metadata, &self.cache, &[0])?;
            return Ok(events);
        }
        let rows: Vec<usize> = ready.iter().map(|&i| batch.last_rows[i]).collect();
        let logits = self
            .model
            .forward(&input, &batch.metadata, &self.cache, &rows)?;
        // Greedy rows take their argmax on the logits' device in one pass
        // and one copy, instead of one copy of a vocabulary row per sequence.
        let any_greedy = ready.iter().any(|&i| {
            self.running
                .iter()
                .any(|s| s.request.id == batch.seq_ids[i] && s.sampler.is_greedy())
        });
        let argmax: Vec<u32> = if any_greedy {
            logits.argmax(candle_core::D::Minus1)?.to_vec1()?
        } else {
            Vec::new()
        };
        let mut finished = Vec::new();
        for (r, &i) in ready.iter().enumerate() {
            let id = batch.seq_ids[i];
            let seq = self
                .running
                .iter_mut()
                .find(|s| s.request.id == id)
                .expect("scheduled sequences are running");
            let token = if seq.sampler.is_greedy() {
                argmax[r]
            } else {
                seq.sampler.sample(&logits.get(r)?)?
            };
            seq.generated.push(token);
            seq.first_token.get_or_insert_with(|| seq.arrival.elapsed());
            let finish = if seq.request.params.stop_tokens.contains(&token) {
                Some(FinishReason::Stop)
            } else if seq.generated.len() >= seq.request.params.max_tokens {
                Some(FinishReason::Length)
            } else {
                seq.pending = Some(token);
                None
            };
            if let Some(f) = finish {
                finished.push((id, f));
            }
            events.push(TokenEvent {
                id,
                token,
                finished: finish,
            });
        }
        for (id, finish) in finished {
            self.finish(id, finish)?;
        }
        Ok(events)
    }

    fn finish(&mut self, id: u64, finish: FinishReason) -> Result<()> {
        let pos = self
            .running
            .iter()
            .position(|s| s.request.id == id)
            .expect("finished sequences are running");
        let seq = self.running.remove(pos);
        self.manager.free(id)?;
        self.completions.push(Completion {
            id,
            prompt_len: seq.request.prompt.len(),
            tokens: seq.generated,
            finish,
            time_to_first_token: seq.first_token.unwrap_or_default(),
            latency: seq.arrival.elapsed(),
            preemptions: seq.preemptions,
        });
        Ok(())
    }
}
