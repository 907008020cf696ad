//! The block manager: which cache blocks each sequence owns, and the
//! metadata of each scheduled batch.

use std::collections::{HashMap, HashSet};

use candle_core::{bail, Device, Result};

use super::kind::{FullAttentionManager, KindManager, Planned, SlidingWindowManager};
use super::prefix::block_hash;
use crate::batch::{PagedBatch, SlotMapping};
use crate::metadata::AttentionMetadata;

const OP: &str = "block-manager";

/// A sliding-window KV-cache group: the caches of layers with this window
/// hold `num_blocks` blocks each, and a sequence's blocks that fell out of
/// the window go back to the group's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowGroupConfig {
    /// The layers' sliding window in tokens (`query_pos - key_pos < window`).
    pub window: usize,
    /// Blocks in each cache of the group.
    pub num_blocks: usize,
}

/// Sizes and features of a [`BlockManager`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockManagerConfig {
    /// Tokens per block (the caches' dimension 1).
    pub block_size: usize,
    /// Blocks in each full-attention layer's cache.
    pub num_blocks: usize,
    /// Share full blocks between sequences with the same token prefix.
    pub enable_prefix_caching: bool,
    /// Sliding-window groups, one per distinct window.
    pub window_groups: Vec<WindowGroupConfig>,
}

impl BlockManagerConfig {
    /// Full attention only, no prefix caching.
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        Self {
            block_size,
            num_blocks,
            enable_prefix_caching: false,
            window_groups: Vec::new(),
        }
    }

    /// Turns prefix caching on or off.
    pub fn with_prefix_caching(mut self, enable: bool) -> Self {
        self.enable_prefix_caching = enable;
        self
    }

    /// Adds a sliding-window group whose caches hold `num_blocks` blocks.
    pub fn with_window_group(mut self, window: usize, num_blocks: usize) -> Self {
        self.window_groups
            .push(WindowGroupConfig { window, num_blocks });
        self
    }
}

/// One sequence's share of a scheduled batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Compute the next `num_tokens` prompt tokens (the whole rest of the
    /// prompt, or a chunk of it).
    ///
    /// With prefix caching, [`BlockManager::schedule`] first takes the
    /// cached blocks that hold the sequence's next prompt tokens (see
    /// [`BlockManager`]); their tokens are not computed, and the item
    /// computes `min(num_tokens, prompt tokens left after them)` tokens from
    /// there ([`ScheduledBatch::prefix_hits`] says how many were taken).
    Prefill {
        /// The sequence, as admitted by `add_sequence`.
        seq_id: u64,
        /// Prompt tokens to compute in this step at most (at most the
        /// prompt tokens left before the cache lookup).
        num_tokens: usize,
    },
    /// Append `token` (sampled from the previous step) and compute it.
    Decode {
        /// The sequence, as admitted by `add_sequence`.
        seq_id: u64,
        /// The token sampled for it in the previous step.
        token: u32,
    },
}

impl Work {
    fn seq_id(&self) -> u64 {
        match *self {
            Work::Prefill { seq_id, .. } | Work::Decode { seq_id, .. } => seq_id,
        }
    }
}

/// A scheduled batch: the metadata every layer reads and the inputs of the
/// model, in the order of the [`Work`] items.
#[derive(Debug)]
pub struct ScheduledBatch {
    /// Tables, slots and positions of the batch.
    pub metadata: AttentionMetadata,
    /// Token id of each query row, `num_tokens` entries.
    pub token_ids: Vec<u32>,
    /// The sequence of each work item.
    pub seq_ids: Vec<u64>,
    /// The last query row of each sequence (where its logits are).
    pub last_rows: Vec<usize>,
    /// Whether each sequence has computed all its tokens after this step, so
    /// the logits at its last row predict its next token.
    pub ready: Vec<bool>,
    /// Prompt tokens each work item took from the prefix cache when it was
    /// scheduled (whole blocks; 0 without prefix caching): its first query
    /// row sits after them.
    pub prefix_hits: Vec<usize>,
    /// What [`BlockManager::rollback`] restores.
    undo: BatchUndo,
}

/// The state of each scheduled sequence before a batch, for
/// [`BlockManager::rollback`].
#[derive(Debug)]
struct BatchUndo {
    /// The batch's number (the manager's count of scheduled batches).
    id: u64,
    seqs: Vec<SeqUndo>,
    /// The manager's hit counter and peak block use before the batch.
    hit_tokens: usize,
    peak_used: usize,
}

/// One sequence's lengths before a batch, and the prefixes the batch
/// registered for it.
#[derive(Debug)]
struct SeqUndo {
    seq_id: u64,
    computed: usize,
    tokens: usize,
    /// Table entries per attention kind (full attention first).
    tables: Vec<usize>,
    /// Full-attention block hashes.
    hashes: usize,
    uncounted_hits: usize,
    /// Blocks the batch registered in the prefix cache (their content is
    /// incomplete when the batch's forward pass failed).
    registered: Vec<u32>,
}

#[derive(Debug)]
struct Sequence {
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the cache (or scheduled).
    computed: usize,
    /// Tokens `add_sequence` took from the prefix cache, counted in the hit
    /// counter when the sequence's first batch is scheduled.
    uncounted_hits: usize,
}

/// Tracks the blocks of every sequence and builds each batch's metadata.
///
/// The life of a sequence: [`add_sequence`](Self::add_sequence) (taking
/// cached prompt blocks when prefix caching is on), one or more
/// [`Work::Prefill`] items until the prompt is done, [`Work::Decode`] items,
/// then [`free`](Self::free). [`schedule`](Self::schedule) allocates what a
/// batch needs all at once or fails with nothing changed;
/// [`shortfall`](Self::shortfall) tells beforehand whether it would find the
/// blocks.
///
/// Scheduling is transactional: when the forward pass of a batch fails,
/// [`rollback`](Self::rollback) returns the manager to its state before
/// [`schedule`](Self::schedule) (computed positions, decoded tokens, block
/// allocations), so that scheduling the same work again recomputes the same
/// positions. Only the last scheduled batch can be rolled back, before any
/// other `add_sequence`, `free` or `schedule`.
///
/// # Prefix caching
/// With [`BlockManagerConfig::enable_prefix_caching`], every full block a
/// batch computes is registered under a hash of its tokens and of all
/// tokens before it, and a sequence takes the registered blocks that hold
/// its next prompt tokens instead of computing them: when it is admitted
/// ([`add_sequence`](Self::add_sequence)) and again each time a
/// [`Work::Prefill`] of it is scheduled, so sequences admitted together
/// share the blocks the first of them computes. A prefill item takes the
/// blocks computed by earlier batches and those that earlier items of the
/// same batch compute: one forward pass stores every token's keys and
/// values of a layer before any query of that layer attends, so the shared
/// blocks are complete when they are read. The last prompt token is always
/// computed (its logits start generation).
///
/// Blocks are registered when they are scheduled, so run the forward pass
/// of every scheduled batch (or roll it back) before the next
/// `add_sequence` or `schedule`. A rolled-back batch's registrations are
/// forgotten: its blocks are shared only once a later batch computes them.
/// [`prefix_cache_hit_tokens`](Self::prefix_cache_hit_tokens) counts the
/// tokens taken from the cache by scheduled batches.
///
/// # Example
/// A generation loop with one layer: chunked prefills, then decodes.
/// ```
/// use std::collections::HashMap;
///
/// use candle_core::{DType, Device, Tensor};
/// use candle_paged_attention::{Attention, AttentionOptions, BlockManager, BlockManagerConfig, Work};
///
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let (heads, kv_heads, head_size, block_size, num_blocks) = (4, 2, 8, 16, 64);
/// let options = AttentionOptions { block_size, ..Default::default() };
/// let attn = Attention::new(heads, kv_heads, head_size, 1.0 / (head_size as f32).sqrt(), options)?;
/// let cache = attn.new_cache(num_blocks, DType::F32, &dev)?; // one per layer
/// let mut manager = BlockManager::new(BlockManagerConfig::new(block_size, num_blocks))?;
///
/// manager.add_sequence(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10])?;
/// manager.add_sequence(1, &[7, 8])?;
/// let mut sampled: HashMap<u64, u32> = HashMap::new();
/// for step in 0..5 {
///     // Prefill prompts in chunks of at most 4 tokens; decode the others.
///     let work: Vec<Work> = [0u64, 1]
///         .into_iter()
///         .map(|seq_id| match sampled.remove(&seq_id) {
///             Some(token) => Work::Decode { seq_id, token },
///             None => {
///                 let left = manager.tokens(seq_id).unwrap().len() - manager.num_computed(seq_id).unwrap();
///                 Work::Prefill { seq_id, num_tokens: left.min(4) }
///             }
///         })
///         .collect();
///     let batch = manager.schedule(&work, &dev)?;
///     let n = batch.token_ids.len();
///     // A model embeds batch.token_ids, applies rotary embeddings at
///     // batch.metadata.positions() and projects q, k, v; random here.
///     let q = Tensor::randn(0f32, 1., (n, heads * head_size), &dev)?;
///     let k = Tensor::randn(0f32, 1., (n, kv_heads * head_size), &dev)?;
///     let v = Tensor::randn(0f32, 1., (n, kv_heads * head_size), &dev)?;
///     let out = attn.forward(&q, &k, &v, &cache, &batch.metadata)?;
///     assert_eq!(out.dims(), &[n, heads * head_size]);
///     for (i, &seq_id) in batch.seq_ids.iter().enumerate() {
///         if batch.ready[i] {
///             // The model's head turns row batch.last_rows[i] into a token.
///             sampled.insert(seq_id, 100 + step);
///         }
///     }
/// }
/// manager.free(0)?;
/// manager.free(1)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    /// The full-attention layers' blocks (and the prefix cache).
    full: FullAttentionManager,
    /// One manager per sliding-window group.
    windows: Vec<SlidingWindowManager>,
    /// What every attention kind shares: the tokens of each sequence.
    seqs: HashMap<u64, Sequence>,
    /// Batches scheduled so far (numbers them for `rollback`).
    batches: u64,
    /// The batch `rollback` may undo: the last one, before any other change.
    last_batch: Option<u64>,
    /// Prompt tokens scheduled batches took from the prefix cache.
    hit_tokens: usize,
    /// The most full-attention blocks in use after a scheduled batch.
    peak_used: usize,
}

/// Host bookkeeping per block of a pool: its entry in the free list (4
/// bytes), its reference count (4), its prefix-cache slot (24) and its
/// release time (8); cached prefixes add their hash-map entries and tokens.
const BOOKKEEPING_BYTES_PER_BLOCK: usize = 40;

/// The most bytes of per-block bookkeeping `BlockManager::new` allocates
/// over all its pools (4 GiB, about 107 million blocks): a larger request is
/// refused with an error instead of aborting the process when the memory
/// runs out.
const MAX_BOOKKEEPING_BYTES: usize = if usize::BITS > 32 {
    1 << 32
} else {
    usize::MAX
};

impl BlockManager {
    /// An empty manager.
    ///
    /// Fails when a size is zero, when a pool has more blocks than 32-bit
    /// block ids can name, when `num_blocks * block_size` slots do not fit
    /// an `i64`, or when the pools' bookkeeping (40 bytes per block) would
    /// take more than 4 GiB, about 107 million blocks in all (checked before
    /// anything is allocated, so that an absurd size is an error, not an
    /// abort).
    pub fn new(config: BlockManagerConfig) -> Result<Self> {
        let BlockManagerConfig {
            block_size,
            num_blocks,
            enable_prefix_caching,
            window_groups,
        } = config;
        if block_size == 0 || num_blocks == 0 {
            bail!("{OP}: block_size and num_blocks must be positive, got {block_size} and {num_blocks}");
        }
        if num_blocks > u32::MAX as usize {
            bail!("{OP}: num_blocks {num_blocks} does not fit block ids of 32 bits");
        }
        let mut windows: Vec<WindowGroupConfig> = Vec::new();
        for g in &window_groups {
            if g.window == 0 || g.num_blocks == 0 || g.num_blocks > u32::MAX as usize {
                bail!(
                    "{OP}: window group needs window >= 1 and 1..=u32::MAX blocks, got window {} and {} blocks",
                    g.window,
                    g.num_blocks
                );
            }
            if windows.iter().any(|w| w.window == g.window) {
                bail!("{OP}: two window groups have window {}", g.window);
            }
            windows.push(*g);
        }
        for (pool, blocks) in std::iter::once(("full-attention", num_blocks))
            .chain(windows.iter().map(|g| ("window", g.num_blocks)))
        {
            if blocks
                .checked_mul(block_size)
                .is_none_or(|slots| slots > i64::MAX as usize)
            {
                bail!("{OP}: the {pool} pool's {blocks} blocks of {block_size} tokens have more slots than an i64 can index");
            }
        }
        let total_blocks = windows
            .iter()
            .try_fold(num_blocks, |acc, g| acc.checked_add(g.num_blocks));
        let bytes = total_blocks.and_then(|n| n.checked_mul(BOOKKEEPING_BYTES_PER_BLOCK));
        match bytes {
            Some(b) if b <= MAX_BOOKKEEPING_BYTES => {}
            _ => bail!(
                "{OP}: {} blocks would take {} bytes of bookkeeping ({BOOKKEEPING_BYTES_PER_BLOCK} bytes per block), more than the {MAX_BOOKKEEPING_BYTES} bytes allowed",
                total_blocks.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
                bytes.map_or_else(|| "more than usize::MAX".to_string(), |b| b.to_string()),
            ),
        }
        if enable_prefix_caching && !windows.is_empty() {
            bail!(
                "{OP}: prefix caching with sliding-window groups is not supported (windows {:?})",
                window_groups.iter().map(|g| g.window).collect::<Vec<_>>()
            );
        }
        Ok(Self {
            block_size,
            full: FullAttentionManager::new(block_size, num_blocks, enable_prefix_caching),
            windows: windows
                .into_iter()
                .map(|g| SlidingWindowManager::new(block_size, g.window, g.num_blocks))
                .collect(),
            seqs: HashMap::new(),
            batches: 0,
            last_batch: None,
            hit_tokens: 0,
            peak_used: 0,
        })
    }

    /// Admits a sequence with its prompt. With prefix caching, the leading
    /// full blocks already cached for the same tokens are shared; the last
    /// prompt token is always left to compute (its logits start generation).
    ///
    /// Returns the number of prompt tokens found in the cache; the first
    /// [`Work::Prefill`] starts after them (or later: scheduling takes the
    /// blocks cached since, see [`BlockManager`]).
    pub fn add_sequence(&mut self, seq_id: u64, prompt: &[u32]) -> Result<usize> {
        self.last_batch = None;
        if self.seqs.contains_key(&seq_id) {
            bail!("{OP}: sequence {seq_id} is already admitted");
        }
        if prompt.is_empty() {
            bail!("{OP}: sequence {seq_id} has an empty prompt");
        }
        if prompt.len() > u32::MAX as usize {
            bail!(
                "{OP}: sequence {seq_id} has {} prompt tokens, more than u32 positions",
                prompt.len()
            );
        }
        let cached = self.full.add_sequence(seq_id, prompt);
        for w in &mut self.windows {
            w.add_sequence(seq_id, prompt);
        }
        self.seqs.insert(
            seq_id,
            Sequence {
                tokens: prompt.to_vec(),
                prompt_len: prompt.len(),
                computed: cached,
                uncounted_hits: cached,
            },
        );
        Ok(cached)
    }

    /// Releases every block of a finished (or aborted) sequence. Shared
    /// blocks stay with their other users; cached ones stay reusable until
    /// their blocks are needed.
    pub fn free(&mut self, seq_id: u64) -> Result<()> {
        self.last_batch = None;
        if self.seqs.remove(&seq_id).is_none() {
            bail!("{OP}: cannot free sequence {seq_id}: it is not admitted");
        }
        for kind in self.kinds_mut() {
            kind.free(seq_id)?;
        }
        Ok(())
    }

    /// Allocates the blocks `work` needs and builds the batch's metadata on
    /// `device`. Fails without changing anything when a sequence is unknown,
    /// scheduled twice, asks for more prompt than is left, decodes before its
    /// prompt is done, or when a pool runs out of blocks (see
    /// [`shortfall`](Self::shortfall)). When the metadata cannot be built,
    /// it fails with the allocations undone.
    ///
    /// With prefix caching, each [`Work::Prefill`] first takes the cached
    /// blocks holding its sequence's next prompt tokens, computed by earlier
    /// batches or by earlier items of this one (see [`BlockManager`]);
    /// [`ScheduledBatch::prefix_hits`] gives their tokens per item.
    ///
    /// Window-group blocks that no query at or after a planned sequence's
    /// next position can see go back to their pools first (and stay there
    /// whatever happens next). The batch can be undone with
    /// [`rollback`](Self::rollback) until the next change.
    pub fn schedule(&mut self, work: &[Work], device: &Device) -> Result<ScheduledBatch> {
        self.last_batch = None;
        if work.is_empty() {
            bail!("{OP}: nothing to schedule (empty work list)");
        }
        let plan = self.plan(work)?;
        if let Some(why) = self.capacity_shortfall(&plan) {
            bail!("{why}");
        }
        // Recycled blocks stay recycled on a failure or a rollback: no query
        // at or after the planned positions can see them.
        self.recycle_out_of_window(&plan)?;
        let (hit_tokens, peak_used) = (self.hit_tokens, self.peak_used);
        let mut undo = Vec::with_capacity(plan.len());
        // Every item takes its cached blocks before any item allocates, so
        // that no allocation evicts a cached block a later item takes.
        let mut done = plan.iter().try_for_each(|p| self.take_cached(p, &mut undo));
        if done.is_ok() {
            done = plan
                .iter()
                .zip(undo.iter_mut())
                .try_for_each(|(p, u)| self.commit(p, u));
        }
        let built = done.and_then(|()| self.build(&plan, device));
        match built {
            Ok(mut batch) => {
                self.batches += 1;
                batch.undo = BatchUndo {
                    id: self.batches,
                    seqs: undo,
                    hit_tokens,
                    peak_used,
                };
                self.last_batch = Some(self.batches);
                self.peak_used = self.peak_used.max(self.num_used_blocks());
                Ok(batch)
            }
            Err(e) => {
                self.undo(&undo)?;
                (self.hit_tokens, self.peak_used) = (hit_tokens, peak_used);
                Err(e)
            }
        }
    }

    /// Whether [`schedule`](Self::schedule) would find the blocks `work`
    /// needs, counting the blocks it would recycle out of sliding windows
    /// and those it would take from the prefix cache. Changes nothing.
    ///
    /// Returns `Ok(None)` when the blocks are there, `Ok(Some(reason))` when a
    /// pool runs short (the error `schedule` would give), and an error when
    /// the work itself is invalid (as `schedule` checks it).
    pub fn shortfall(&self, work: &[Work]) -> Result<Option<String>> {
        if work.is_empty() {
            bail!("{OP}: nothing to schedule (empty work list)");
        }
        let plan = self.plan(work)?;
        Ok(self.capacity_shortfall(&plan))
    }

    /// Prompt tokens of `seq_id` that its next [`Work::Prefill`] would take
    /// from the prefix cache, counting only the blocks earlier batches
    /// computed (a batch may add the blocks its earlier items compute).
    /// Zero without prefix caching, for an unknown sequence, and when the
    /// sequence has computed part of a block.
    pub fn cached_prefix_len(&self, seq_id: u64) -> usize {
        match self.seqs.get(&seq_id) {
            Some(seq) if self.full.prefix_caching() => {
                let hits =
                    self.full
                        .prefix_hits(seq_id, &seq.tokens, seq.computed, &HashMap::new());
                hits.len() * self.block_size
            }
            _ => 0,
        }
    }

    /// Leading whole blocks of `tokens` (before its last token) that the
    /// prefix cache holds and admitted sequences use: a sequence admitted
    /// with these tokens shares them instead of taking blocks from the pool.
    /// Zero without prefix caching.
    pub fn shared_prefix_blocks(&self, tokens: &[u32]) -> usize {
        self.full.shared_prefix_blocks(tokens)
    }

    /// Undoes `batch`, the last batch [`schedule`](Self::schedule) returned,
    /// after its forward pass failed: the scheduled sequences get back their
    /// computed positions, lose the decoded tokens the batch appended, and
    /// return the blocks it allocated (to the free list; a cached prefix the
    /// allocation evicted stays forgotten) and the cached blocks it took
    /// (to the prefix cache). The prefixes the batch registered are
    /// forgotten: those blocks are shared only once a later batch computes
    /// them. The hit counter and the peak block use go back to their values
    /// before the batch. Blocks recycled out of sliding windows stay
    /// recycled: no query at or after the batch's positions sees them.
    ///
    /// Fails without changing anything when `batch` is not the last scheduled
    /// batch or when `add_sequence`, `free` or `schedule` was called since.
    pub fn rollback(&mut self, batch: ScheduledBatch) -> Result<()> {
        let id = batch.undo.id;
        if self.last_batch != Some(id) {
            bail!(
                "{OP}: batch {id} cannot be rolled back: only the last scheduled batch can be, before any other add_sequence, free or schedule"
            );
        }
        self.last_batch = None;
        self.undo(&batch.undo.seqs)?;
        self.hit_tokens = batch.undo.hit_tokens;
        self.peak_used = batch.undo.peak_used;
        Ok(())
    }

    /// Restores the sequences of `undo`, newest change first.
    fn undo(&mut self, undo: &[SeqUndo]) -> Result<()> {
        for u in undo.iter().rev() {
            let Some(seq) = self.seqs.get_mut(&u.seq_id) else {
                bail!("{OP}: sequence {} vanished before its rollback", u.seq_id);
            };
            seq.computed = u.computed;
            seq.tokens.truncate(u.tokens);
            seq.uncounted_hits = u.uncounted_hits;
            self.full.unregister(&u.registered);
            self.full.truncate_hashes(u.seq_id, u.hashes);
            for (kind, &len) in self.kinds_mut().zip(&u.tables) {
                kind.truncate(u.seq_id, len)?;
            }
        }
        Ok(())
    }

    fn plan(&self, work: &[Work]) -> Result<Vec<Planned>> {
        let bs = self.block_size;
        let mut seen = HashSet::with_capacity(work.len());
        let mut plan = Vec::with_capacity(work.len());
        let mut num_tokens = 0usize;
        // Full prompt blocks that earlier prefill items of this batch
        // compute, by hash: later items may take them.
        let mut computed_here: HashMap<u64, &[u32]> = HashMap::new();
        for w in work {
            let seq_id = w.seq_id();
            let Some(seq) = self.seqs.get(&seq_id) else {
                bail!("{OP}: sequence {seq_id} is not admitted");
            };
            if !seen.insert(seq_id) {
                bail!("{OP}: sequence {seq_id} is scheduled twice in one batch");
            }
            let left = seq.tokens.len() - seq.computed;
            let (hits, q_len, token) = match *w {
                Work::Prefill { num_tokens, .. } => {
                    if num_tokens == 0 || num_tokens > left {
                        bail!(
                            "{OP}: sequence {seq_id} asks to prefill {num_tokens} tokens but {left} prompt tokens are left"
                        );
                    }
                    let hits = if self.full.prefix_caching() {
                        self.full
                            .prefix_hits(seq_id, &seq.tokens, seq.computed, &computed_here)
                    } else {
                        Vec::new()
                    };
                    // Hits end before the last prompt token: at least one is left.
                    let left = left - hits.len() * bs;
                    (hits, num_tokens.min(left), None)
                }
                Work::Decode { token, .. } => {
                    if left > 0 {
                        bail!("{OP}: sequence {seq_id} cannot decode: {left} prompt tokens are not prefilled yet");
                    }
                    (Vec::new(), 1, Some(token))
                }
            };
            let start = seq.computed + hits.len() * bs;
            if start + q_len > u32::MAX as usize {
                bail!("{OP}: sequence {seq_id} would exceed u32 positions");
            }
            num_tokens += q_len;
            if num_tokens > u32::MAX as usize {
                bail!("{OP}: the batch would have more than u32::MAX query tokens");
            }
            if self.full.prefix_caching() && token.is_none() {
                let mut parent = hits.last().map(|h| h.0).or(self.full.last_hash(seq_id));
                for b in self.full.num_hashes(seq_id) + hits.len()..(start + q_len) / bs {
                    let toks = &seq.tokens[b * bs..(b + 1) * bs];
                    let hash = block_hash(parent, toks);
                    computed_here.entry(hash).or_insert(toks);
                    parent = Some(hash);
                }
            }
            plan.push(Planned {
                seq_id,
                start,
                q_len,
                token,
                hits,
            });
        }
        Ok(plan)
    }

    /// The manager of each attention kind present: full attention first,
    /// then the window groups in their order.
    fn kinds(&self) -> impl Iterator<Item = &dyn KindManager> + '_ {
        std::iter::once(&self.full as &dyn KindManager)
            .chain(self.windows.iter().map(|w| w as &dyn KindManager))
    }

    /// [`kinds`](Self::kinds), mutable.
    fn kinds_mut(&mut self) -> impl Iterator<Item = &mut dyn KindManager> + '_ {
        std::iter::once(&mut self.full as &mut dyn KindManager)
            .chain(self.windows.iter_mut().map(|w| w as &mut dyn KindManager))
    }

    /// Returns window-group blocks that no query at or after each planned
    /// sequence's first new position can see.
    fn recycle_out_of_window(&mut self, plan: &[Planned]) -> Result<()> {
        for kind in self.kinds_mut() {
            for p in plan {
                kind.recycle_out_of_window(p.seq_id, p.start)?;
            }
        }
        Ok(())
    }

    /// The first pool that cannot give `plan` its blocks, as the error
    /// `schedule` reports; `None` when every pool can. Window pools count the
    /// blocks `recycle_out_of_window` would return first; the full-attention
    /// pool counts the unused cached blocks the plan takes as taken, and the
    /// blocks taken from the cache as held.
    fn capacity_shortfall(&self, plan: &[Planned]) -> Option<String> {
        self.kinds().find_map(|kind| {
            let available = kind.num_available(plan);
            let mut taken = 0;
            for p in plan {
                let need = kind.num_blocks_to_allocate(p);
                if taken + need > available {
                    return Some(format!(
                        "{OP}: sequence {} needs {need} more blocks but {} {} free in the {} pool ({} of {} blocks free before this batch)",
                        p.seq_id,
                        available - taken,
                        if available - taken == 1 { "is" } else { "are" },
                        kind.pool_name(),
                        available,
                        kind.pool().num_blocks()
                    ));
                }
                taken += need;
            }
            None
        })
    }

    /// Takes the cached blocks earlier batches computed for one planned
    /// sequence, recording its previous lengths in `undo` first.
    fn take_cached(&mut self, p: &Planned, undo: &mut Vec<SeqUndo>) -> Result<()> {
        let bs = self.block_size;
        let tables = self.kinds().map(|k| k.num_held(p.seq_id)).collect();
        let Some(seq) = self.seqs.get_mut(&p.seq_id) else {
            bail!("{OP}: sequence {} vanished while scheduling", p.seq_id);
        };
        undo.push(SeqUndo {
            seq_id: p.seq_id,
            computed: seq.computed,
            tokens: seq.tokens.len(),
            tables,
            hashes: self.full.num_hashes(p.seq_id),
            uncounted_hits: seq.uncounted_hits,
            registered: Vec::new(),
        });
        for &(hash, _) in p.hits.iter().take_while(|h| h.1.is_some()) {
            let b = self.full.num_hashes(p.seq_id);
            let toks = &seq.tokens[b * bs..(b + 1) * bs];
            if !self.full.take_cached(p.seq_id, hash, toks) {
                bail!(
                    "{OP}: sequence {}: the cached block of its prompt block {b} vanished while scheduling",
                    p.seq_id
                );
            }
            seq.computed += bs;
        }
        Ok(())
    }

    /// Takes the blocks earlier items of the batch compute, appends the
    /// decoded token, advances `computed`, allocates and registers the
    /// blocks of one planned sequence, whose state before the batch `undo`
    /// holds.
    fn commit(&mut self, p: &Planned, undo: &mut SeqUndo) -> Result<()> {
        let bs = self.block_size;
        let Some(seq) = self.seqs.get_mut(&p.seq_id) else {
            bail!("{OP}: sequence {} vanished while scheduling", p.seq_id);
        };
        for &(hash, _) in p.hits.iter().filter(|h| h.1.is_none()) {
            let b = self.full.num_hashes(p.seq_id);
            let toks = &seq.tokens[b * bs..(b + 1) * bs];
            if !self.full.take_cached(p.seq_id, hash, toks) {
                bail!(
                    "{OP}: sequence {}: its prompt block {b} was not registered by the item of the batch that computes it",
                    p.seq_id
                );
            }
            seq.computed += bs;
        }
        if seq.computed != p.start {
            bail!(
                "{OP}: sequence {}: its cached prefix ends at {} but its planned work starts at {}",
                p.seq_id,
                seq.computed,
                p.start
            );
        }
        let hits = seq.uncounted_hits.saturating_add(p.hits.len() * bs);
        self.hit_tokens = self.hit_tokens.saturating_add(hits);
        seq.uncounted_hits = 0;
        if let Some(t) = p.token {
            seq.tokens.push(t);
        }
        seq.computed = p.start + p.q_len;
        let computed = seq.computed;
        for kind in self.kinds_mut() {
            kind.allocate(p.seq_id, computed)?;
        }
        if let Some(seq) = self.seqs.get(&p.seq_id) {
            let registered = self.full.register_computed(p.seq_id, &seq.tokens, computed);
            undo.registered.extend(registered);
        }
        Ok(())
    }

    /// The metadata of `num_seqs` padding sequences with tables of `width`
    /// blocks, shaped like a decode step of this manager's batches (the same
    /// window groups): each has one new token at position 0 that is not
    /// stored (slot -1), and all-zero tables. What a CUDA graph of that
    /// shape can be captured on before any real step runs.
    pub fn padding_batch(
        &self,
        num_seqs: usize,
        width: usize,
        device: &Device,
    ) -> Result<AttentionMetadata> {
        if num_seqs == 0 {
            bail!("{OP}: a padding batch needs at least one sequence");
        }
        let (Ok(n), Some(cells)) = (u32::try_from(num_seqs), num_seqs.checked_mul(width)) else {
            bail!("{OP}: a padding batch of {num_seqs} sequences of width {width} overflows its indices");
        };
        let cu: Vec<u32> = (0..=n).collect();
        let seq_lens = vec![1u32; num_seqs];
        let tables = vec![0u32; cells];
        let slots = vec![-1i64; num_seqs];
        let bs = self.block_size;
        self.kinds_metadata(|_| {
            let batch = PagedBatch::new(&cu, &seq_lens, &tables, width, bs, device)?;
            Ok((batch, SlotMapping::new(&slots, device)?))
        })
    }

    /// Metadata with one batch per attention kind, each built by
    /// `batch_of`: full attention's, then each window group's.
    fn kinds_metadata(
        &self,
        mut batch_of: impl FnMut(&dyn KindManager) -> Result<(PagedBatch, SlotMapping)>,
    ) -> Result<AttentionMetadata> {
        let (batch, slots) = batch_of(&self.full)?;
        let mut metadata = AttentionMetadata::new(batch, slots)?;
        for w in &self.windows {
            let (batch, slots) = batch_of(w)?;
            metadata = metadata.with_window_group(w.window(), batch, slots)?;
        }
        Ok(metadata)
    }

    fn build(&self, plan: &[Planned], device: &Device) -> Result<ScheduledBatch> {
        let bs = self.block_size;
        let num_tokens: usize = plan.iter().map(|p| p.q_len).sum();
        let mut cu_seqlens_q = Vec::with_capacity(plan.len() + 1);
        cu_seqlens_q.push(0u32);
        let mut seq_lens = Vec::with_capacity(plan.len());
        let mut token_ids = Vec::with_capacity(num_tokens);
        let mut last_rows = Vec::with_capacity(plan.len());
        let mut ready = Vec::with_capacity(plan.len());
        for p in plan {
            let Some(seq) = self.seqs.get(&p.seq_id) else {
                bail!("{OP}: sequence {} vanished while scheduling", p.seq_id);
            };
            let end = p.start + p.q_len;
            token_ids.extend_from_slice(&seq.tokens[p.start..end]);
            cu_seqlens_q.push(token_ids.len() as u32);
            seq_lens.push(end as u32);
            last_rows.push(token_ids.len() - 1);
            ready.push(end == seq.tokens.len() && end >= seq.prompt_len);
        }
        // Every kind's table has as many entries as the full-attention one.
        let held: Vec<usize> = plan.iter().map(|p| self.full.num_held(p.seq_id)).collect();
        let width = held.iter().copied().max().unwrap_or(0);
        let metadata = self.kinds_metadata(|kind| {
            // Recycled window blocks read as block 0: the window masks them.
            let mut tables = vec![0u32; plan.len() * width];
            for ((row, p), &len) in tables.chunks_mut(width.max(1)).zip(plan).zip(&held) {
                for (j, slot) in row.iter_mut().enumerate().take(len) {
                    *slot = kind.block_at(p.seq_id, j).unwrap_or(0);
                }
            }
            let mut slots = Vec::with_capacity(num_tokens);
            for p in plan {
                for pos in p.start..p.start + p.q_len {
                    let Some(b) = kind.block_at(p.seq_id, pos / bs) else {
                        bail!(
                            "{OP}: sequence {} has no block for position {pos}",
                            p.seq_id
                        );
                    };
                    slots.push(b as i64 * bs as i64 + (pos % bs) as i64);
                }
            }
            let batch = PagedBatch::new(&cu_seqlens_q, &seq_lens, &tables, width, bs, device)?;
            Ok((batch, SlotMapping::new(&slots, device)?))
        })?;
        Ok(ScheduledBatch {
            metadata,
            token_ids,
            seq_ids: plan.iter().map(|p| p.seq_id).collect(),
            last_rows,
            ready,
            prefix_hits: plan.iter().map(|p| p.hits.len() * bs).collect(),
            undo: BatchUndo {
                id: 0,
                seqs: Vec::new(),
                hit_tokens: 0,
                peak_used: 0,
            },
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// True when `seq_id` is admitted and not freed.
    pub fn contains(&self, seq_id: u64) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// Admitted sequences.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Blocks the full-attention pool can still hand out (free ones plus
    /// unused cached ones).
    pub fn num_free_blocks(&self) -> usize {
        self.full.pool().num_available()
    }

    /// Blocks of the full-attention pool (each full-attention layer's cache).
    pub fn num_blocks(&self) -> usize {
        self.full.pool().num_blocks()
    }

    /// Full-attention blocks held by sequences (shared ones once):
    /// [`num_blocks`](Self::num_blocks) minus
    /// [`num_free_blocks`](Self::num_free_blocks).
    pub fn num_used_blocks(&self) -> usize {
        let pool = self.full.pool();
        pool.num_blocks().saturating_sub(pool.num_available())
    }

    /// The most full-attention blocks in use right after a scheduled batch
    /// (rolled-back batches excluded): the cache a run actually needed.
    pub fn peak_used_blocks(&self) -> usize {
        self.peak_used
    }

    /// Prompt tokens whose keys and values scheduled batches took from the
    /// prefix cache instead of computing them (rolled-back batches
    /// excluded); a sequence's hits count once its first batch is
    /// scheduled.
    pub fn prefix_cache_hit_tokens(&self) -> usize {
        self.hit_tokens
    }

    /// Blocks window group `group` can still hand out.
    pub fn num_free_window_blocks(&self, group: usize) -> Option<usize> {
        self.windows.get(group).map(|w| w.pool().num_available())
    }

    /// Blocks registered in the prefix cache (in use or not).
    pub fn num_cached_blocks(&self) -> usize {
        self.full.pool().num_cached()
    }

    /// Cached blocks no sequence uses (reusable by a later prefix, evicted first).
    pub fn num_cached_unused_blocks(&self) -> usize {
        self.full.pool().num_cached_unused()
    }

    /// Sequences holding full-attention block `block`.
    pub fn block_ref_count(&self, block: u32) -> u32 {
        self.full.pool().ref_count(block)
    }

    /// All tokens of a sequence (prompt, then decoded ones).
    pub fn tokens(&self, seq_id: u64) -> Option<&[u32]> {
        self.seqs.get(&seq_id).map(|s| s.tokens.as_slice())
    }

    /// Tokens of a sequence whose keys and values are cached or scheduled.
    pub fn num_computed(&self, seq_id: u64) -> Option<usize> {
        self.seqs.get(&seq_id).map(|s| s.computed)
    }

    /// Full-attention block table of a sequence.
    pub fn block_table(&self, seq_id: u64) -> Option<&[u32]> {
        self.full.block_table(seq_id)
    }

    /// Block table of a sequence in window group `group`; `None` entries were
    /// recycled out of the window.
    pub fn window_block_table(&self, seq_id: u64, group: usize) -> Option<&[Option<u32>]> {
        self.windows.get(group)?.block_table(seq_id)
    }
}
