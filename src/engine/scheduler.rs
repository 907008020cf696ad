//! The engine's scheduler: which requests run in a step and how many of
//! their tokens.
//!
//! Each [`Scheduler::schedule`] admits waiting requests (in the order of a
//! [`RequestQueue`]) while `max_num_seqs` and a rough block estimate allow,
//! plans the decodes of all running sequences, then prefill chunks within the
//! token budget, and, when the block manager cannot hold the plan, takes
//! back the newest admission, preempts the newest running sequence, halves
//! a lone sequence's prompt chunks, or finishes a lone sequence that cannot
//! fit at all.

use std::collections::VecDeque;

use candle_core::{bail, Result};

use super::request::{Completion, FinishReason, Sequence};
use super::OP;
use crate::cache::{BlockManager, Work};
use crate::models::CacheConfig;

/// Limits of one engine step.
///
/// * `max_batch_tokens` - query tokens per step (decodes count one each;
///   prompts are prefilled in chunks that fit what is left; the decodes of
///   all running sequences always run, so keep it `>= max_num_seqs`).
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

/// The waiting requests, in the order they join the running batch (vLLM's
/// `RequestQueue`).
pub(super) trait RequestQueue {
    /// Queues a new request.
    fn push(&mut self, seq: Sequence);
    /// Puts back a sequence taken out of the running batch (preempted, or an
    /// admission taken back), to join again before the others.
    fn push_front(&mut self, seq: Sequence);
    /// The request that joins next.
    fn peek(&self) -> Option<&Sequence>;
    /// Takes the request that joins next.
    fn pop(&mut self) -> Option<Sequence>;
    /// Takes request `id` out of the queue.
    fn remove(&mut self, id: u64) -> Option<Sequence>;
    /// Whether request `id` is queued.
    fn contains(&self, id: u64) -> bool;
    /// Requests queued.
    fn len(&self) -> usize;
    /// True when no request is queued.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// First come, first served: requests join in arrival order; a sequence put
/// back joins first.
#[derive(Debug, Default)]
pub(super) struct FcfsQueue(VecDeque<Sequence>);

impl RequestQueue for FcfsQueue {
    fn push(&mut self, seq: Sequence) {
        self.0.push_back(seq);
    }

    fn push_front(&mut self, seq: Sequence) {
        self.0.push_front(seq);
    }

    fn peek(&self) -> Option<&Sequence> {
        self.0.front()
    }

    fn pop(&mut self) -> Option<Sequence> {
        self.0.pop_front()
    }

    fn remove(&mut self, id: u64) -> Option<Sequence> {
        let pos = self.0.iter().position(|s| s.request.id == id)?;
        self.0.remove(pos)
    }

    fn contains(&self, id: u64) -> bool {
        self.0.iter().any(|s| s.request.id == id)
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// The work of one step.
#[derive(Debug)]
pub(super) struct SchedulerOutput {
    /// Decodes first, then prefill chunks, all of which the block manager
    /// can hold; empty when scheduling finished every request with an error.
    pub(super) work: Vec<Work>,
    /// Requests that joined the running batch in this step (the newest
    /// running sequences), taken back when the step fails.
    pub(super) admitted: usize,
}

/// The waiting queue, the running batch and the policy that moves requests
/// between them.
pub(super) struct Scheduler {
    config: SchedulerConfig,
    cache: CacheConfig,
    block_size: usize,
    waiting: Box<dyn RequestQueue>,
    running: Vec<Sequence>,
    /// Requests that finished while scheduling (refused by the block
    /// manager, or too large for the cache alone), not yet taken.
    finished: Vec<Completion>,
    /// Preemptions not yet taken.
    preemptions: usize,
}

impl Scheduler {
    /// A scheduler with an empty FCFS queue, for a cache of `cache` blocks of
    /// `block_size` tokens.
    pub(super) fn new(config: SchedulerConfig, cache: CacheConfig, block_size: usize) -> Self {
        Self {
            config,
            cache,
            block_size,
            waiting: Box::new(FcfsQueue::default()),
            running: Vec::new(),
            finished: Vec::new(),
            preemptions: 0,
        }
    }

    /// True while requests are waiting or running.
    pub(super) fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Sequences in the running batch.
    pub(super) fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting to join the running batch.
    pub(super) fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether request `id` is waiting or running.
    pub(super) fn contains(&self, id: u64) -> bool {
        self.running.iter().any(|s| s.request.id == id) || self.waiting.contains(id)
    }

    /// Queues a new request.
    pub(super) fn add(&mut self, seq: Sequence) {
        self.waiting.push(seq);
    }

    /// The running sequence of request `id`.
    pub(super) fn running(&self, id: u64) -> Option<&Sequence> {
        self.running.iter().find(|s| s.request.id == id)
    }

    /// The running sequences, in admission order.
    pub(super) fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }

    /// Takes request `id` out, waiting or running (its blocks freed).
    pub(super) fn abort(
        &mut self,
        id: u64,
        manager: &mut BlockManager,
    ) -> Result<Option<Sequence>> {
        // Waiting sequences hold no blocks (preemption freed them).
        if let Some(seq) = self.waiting.remove(id) {
            return Ok(Some(seq));
        }
        let Some(pos) = self.running.iter().position(|s| s.request.id == id) else {
            return Ok(None);
        };
        let seq = self.running.remove(pos);
        manager.free(id)?;
        Ok(Some(seq))
    }

    /// Takes the finished running sequence `id` out of the batch and frees
    /// its blocks.
    pub(super) fn finish(&mut self, id: u64, manager: &mut BlockManager) -> Result<Sequence> {
        let Some(pos) = self.running.iter().position(|s| s.request.id == id) else {
            bail!("{OP}: finished sequence {id} is not running");
        };
        let seq = self.running.remove(pos);
        manager.free(id)?;
        Ok(seq)
    }

    /// The completions of the requests that finished while scheduling, in
    /// the order they finished (drained).
    pub(super) fn take_finished(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.finished)
    }

    /// Preemptions since the last call.
    pub(super) fn take_preemptions(&mut self) -> usize {
        std::mem::take(&mut self.preemptions)
    }

    /// Plans the next step: admits waiting requests, then fits the decodes
    /// and prefill chunks of the running batch to the token budget and the
    /// blocks of `manager` (which holds the admitted sequences afterwards).
    ///
    /// Requests that cannot go on finish with [`FinishReason::Error`] (see
    /// [`take_finished`](Self::take_finished)). Fails, with the admissions
    /// of this call taken back, when the block manager fails, and when
    /// nothing can be scheduled although requests are left.
    pub(super) fn schedule(&mut self, manager: &mut BlockManager) -> Result<SchedulerOutput> {
        let mut admitted = self.admit(manager);
        // At most this many prompt tokens per sequence: halved while a lone
        // sequence's chunk does not fit (sliding-window pools).
        let mut chunk_limit = usize::MAX;
        loop {
            let work = self.plan(manager, chunk_limit);
            if work.is_empty() {
                if !self.has_work() {
                    // This step finished every request with an error.
                    return Ok(SchedulerOutput { work, admitted: 0 });
                }
                bail!(
                    "{OP}: nothing can be scheduled although {} requests wait and {} run (max_num_seqs {})",
                    self.waiting.len(),
                    self.running.len(),
                    self.config.max_num_seqs
                );
            }
            let shortfall = match manager.shortfall(&work) {
                Ok(s) => s,
                Err(e) => {
                    self.unadmit(admitted, manager)?;
                    return Err(e);
                }
            };
            let Some(why) = shortfall else {
                return Ok(SchedulerOutput { work, admitted });
            };
            if self.running.len() > 1 {
                if admitted > 0 {
                    self.unadmit(1, manager)?;
                    admitted -= 1;
                } else {
                    self.preempt_newest(manager)?;
                }
                continue;
            }
            // One sequence alone: smaller prompt chunks may fit the window
            // pools; a single token that does not fit never will.
            let largest_chunk = work
                .iter()
                .filter_map(|w| match w {
                    Work::Prefill { num_tokens, .. } => Some(*num_tokens),
                    Work::Decode { .. } => None,
                })
                .max()
                .unwrap_or(0);
            if largest_chunk > 1 {
                chunk_limit = largest_chunk / 2;
                continue;
            }
            self.fail_running_alone(&why, manager)?;
            admitted = self.admit(manager);
            chunk_limit = usize::MAX;
        }
    }

    /// Moves waiting requests into the running batch while sequences and a
    /// rough block estimate allow; returns how many joined. A request the
    /// block manager refuses finishes with an error.
    fn admit(&mut self, manager: &mut BlockManager) -> usize {
        let bs = self.block_size;
        let mut free = manager.num_free_blocks();
        let mut admitted = 0;
        while self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.peek() else {
                break;
            };
            // Cached blocks other sequences use are shared, not taken.
            let shared = if self.cache.prefix_caching {
                manager.shared_prefix_blocks(&seq.context())
            } else {
                0
            };
            let need = seq.context_len().div_ceil(bs).saturating_sub(shared);
            // The first admission of an empty batch always tries, so that a
            // sequence too large for the cache ends with an error instead of
            // waiting forever.
            if need > free && !(self.running.is_empty() && admitted == 0) {
                break;
            }
            let Some(seq) = self.waiting.pop() else {
                break;
            };
            if let Err(e) = manager.add_sequence(seq.request.id, &seq.context()) {
                let why = format!("{OP}: request {} cannot be admitted: {e}", seq.request.id);
                self.finished
                    .push(seq.into_completion(FinishReason::Error(why)));
                continue;
            }
            free = free.saturating_sub(need);
            self.running.push(seq);
            admitted += 1;
        }
        admitted
    }

    /// Takes the `n` newest admissions back to the front of the waiting
    /// queue, in their order.
    pub(super) fn unadmit(&mut self, n: usize, manager: &mut BlockManager) -> Result<()> {
        for _ in 0..n {
            let Some(seq) = self.running.pop() else {
                bail!("{OP}: cannot take back an admission: no sequence is running");
            };
            manager.free(seq.request.id)?;
            self.waiting.push_front(seq);
        }
        Ok(())
    }

    /// Frees the newest running sequence and queues it for recomputation.
    fn preempt_newest(&mut self, manager: &mut BlockManager) -> Result<()> {
        let Some(mut seq) = self.running.pop() else {
            bail!("{OP}: cannot preempt: no sequence is running");
        };
        manager.free(seq.request.id)?;
        seq.pending = None;
        seq.preemptions += 1;
        self.preemptions += 1;
        self.waiting.push_front(seq);
        Ok(())
    }

    /// Finishes the only running sequence, which cannot get the blocks of
    /// its next token even with the whole cache to itself.
    fn fail_running_alone(&mut self, why: &str, manager: &mut BlockManager) -> Result<()> {
        let Some(seq) = self.running.pop() else {
            bail!("{OP}: no running sequence to finish ({why})");
        };
        let id = seq.request.id;
        manager.free(id)?;
        let msg = format!(
            "{OP}: request {id} outgrew the KV cache: with {} tokens in context it needs more blocks than the cache has even alone ({} blocks of {} tokens); it ends with the {} tokens generated so far ({why})",
            seq.context_len(),
            self.cache.num_blocks,
            self.block_size,
            seq.generated.len()
        );
        self.finished
            .push(seq.into_completion(FinishReason::Error(msg)));
        Ok(())
    }

    /// Decodes first, then prefill chunks of at most `chunk_limit` tokens,
    /// within the token budget.
    fn plan(&self, manager: &BlockManager, chunk_limit: usize) -> Vec<Work> {
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
            let total = manager.tokens(id).map_or(0, |t| t.len());
            let done = manager.num_computed(id).unwrap_or(total);
            // Blocks cached by earlier steps are taken, not computed: they
            // cost no budget. (Blocks that earlier items of this step compute
            // are taken too, leaving part of this item's budget unused.)
            let cached = manager.cached_prefix_len(id);
            let n = total
                .saturating_sub(done.saturating_add(cached))
                .min(budget)
                .min(chunk_limit);
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
}
