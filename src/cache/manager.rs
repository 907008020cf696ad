//! The block manager: which cache blocks each sequence owns, and the
//! metadata of each scheduled batch.

use std::collections::{HashMap, HashSet};

use candle_core::{bail, Device, Result};

use super::pool::BlockPool;
use super::prefix::block_hash;
use crate::batch::{PagedBatch, SlotMapping};
use crate::metadata::AttentionMetadata;
use crate::remap::blocks_out_of_window;

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
    Prefill {
        /// The sequence, as admitted by `add_sequence`.
        seq_id: u64,
        /// Prompt tokens to compute in this step.
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
}

/// One sequence's lengths before a batch.
#[derive(Debug)]
struct SeqUndo {
    seq_id: u64,
    computed: usize,
    tokens: usize,
    blocks: usize,
    hashes: usize,
    window_blocks: Vec<usize>,
}

#[derive(Debug)]
struct Sequence {
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the cache (or scheduled).
    computed: usize,
    blocks: Vec<u32>,
    /// Content hashes of the leading full blocks (prefix caching).
    block_hashes: Vec<u64>,
    /// Per window group; `None` marks a block recycled out of the window.
    window_blocks: Vec<Vec<Option<u32>>>,
}

#[derive(Debug)]
struct WindowPool {
    window: usize,
    pool: BlockPool,
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
/// Blocks scheduled for computation are registered for prefix sharing right
/// away, so run the forward pass of every scheduled batch (or roll it back)
/// before the next `add_sequence`. A block registered by a batch that was
/// rolled back is never shared until its content is computed again.
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
    prefix_caching: bool,
    pool: BlockPool,
    windows: Vec<WindowPool>,
    seqs: HashMap<u64, Sequence>,
    /// Batches scheduled so far (numbers them for `rollback`).
    batches: u64,
    /// The batch `rollback` may undo: the last one, before any other change.
    last_batch: Option<u64>,
    /// Full-attention blocks registered for prefix sharing by a batch that
    /// was rolled back, with the hash they are registered under: their
    /// content may be incomplete, so they are not shared until a batch
    /// computes them again or the pool hands them out afresh.
    poisoned: HashMap<u32, u64>,
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
            prefix_caching: enable_prefix_caching,
            pool: BlockPool::new(num_blocks),
            windows: windows
                .into_iter()
                .map(|g| WindowPool {
                    window: g.window,
                    pool: BlockPool::new(g.num_blocks),
                })
                .collect(),
            seqs: HashMap::new(),
            batches: 0,
            last_batch: None,
            poisoned: HashMap::new(),
        })
    }

    /// Admits a sequence with its prompt. With prefix caching, the leading
    /// full blocks already cached for the same tokens are shared; the last
    /// prompt token is always left to compute (its logits start generation).
    ///
    /// Returns the number of prompt tokens found in the cache; the first
    /// [`Work::Prefill`] starts after them.
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
        let bs = self.block_size;
        let mut seq = Sequence {
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            window_blocks: vec![Vec::new(); self.windows.len()],
        };
        if self.prefix_caching {
            for toks in prompt[..prompt.len() - 1].chunks_exact(bs) {
                let hash = block_hash(seq.block_hashes.last().copied(), toks);
                let Some(block) = self.pool.acquire_cached(hash, toks) else {
                    break;
                };
                if self.poisoned.contains_key(&block) {
                    // A rolled-back batch left its content incomplete.
                    self.pool.release(block)?;
                    break;
                }
                seq.blocks.push(block);
                seq.block_hashes.push(hash);
            }
            seq.computed = seq.blocks.len() * bs;
        }
        let cached = seq.computed;
        self.seqs.insert(seq_id, seq);
        Ok(cached)
    }

    /// Releases every block of a finished (or aborted) sequence. Shared
    /// blocks stay with their other users; cached ones stay reusable until
    /// their blocks are needed.
    pub fn free(&mut self, seq_id: u64) -> Result<()> {
        self.last_batch = None;
        let Some(seq) = self.seqs.remove(&seq_id) else {
            bail!("{OP}: cannot free sequence {seq_id}: it is not admitted");
        };
        for &b in &seq.blocks {
            self.pool.release(b)?;
        }
        for (w, blocks) in self.windows.iter_mut().zip(&seq.window_blocks) {
            for b in blocks.iter().flatten() {
                w.pool.release(*b)?;
            }
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
        let mut undo = Vec::with_capacity(plan.len());
        for p in &plan {
            if let Err(e) = self.commit(p, &mut undo) {
                self.undo(&undo)?;
                return Err(e);
            }
        }
        match self.build(&plan, device) {
            Ok(mut batch) => {
                self.batches += 1;
                batch.undo = BatchUndo {
                    id: self.batches,
                    seqs: undo,
                };
                self.last_batch = Some(self.batches);
                Ok(batch)
            }
            Err(e) => {
                self.undo(&undo)?;
                Err(e)
            }
        }
    }

    /// Whether [`schedule`](Self::schedule) would find the blocks `work`
    /// needs, counting the blocks it would recycle out of sliding windows.
    /// Changes nothing.
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

    /// Undoes `batch`, the last batch [`schedule`](Self::schedule) returned,
    /// after its forward pass failed: the scheduled sequences get back their
    /// computed positions, lose the decoded tokens the batch appended, and
    /// return the blocks it allocated (to the free list; a cached prefix the
    /// allocation evicted stays forgotten). Blocks the batch registered for
    /// prefix sharing are never shared until a later batch computes them.
    /// Blocks recycled out of sliding windows stay recycled: no query at or
    /// after the batch's positions sees them.
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
        self.undo(&batch.undo.seqs)
    }

    /// Restores the sequences of `undo`, newest change first.
    fn undo(&mut self, undo: &[SeqUndo]) -> Result<()> {
        for u in undo.iter().rev() {
            let Some(seq) = self.seqs.get_mut(&u.seq_id) else {
                bail!("{OP}: sequence {} vanished before its rollback", u.seq_id);
            };
            seq.computed = u.computed;
            seq.tokens.truncate(u.tokens);
            for (i, &hash) in seq.block_hashes.iter().enumerate().skip(u.hashes) {
                if let Some(&b) = seq.blocks.get(i) {
                    self.poisoned.insert(b, hash);
                }
            }
            seq.block_hashes.truncate(u.hashes);
            for b in seq.blocks.drain(u.blocks.min(seq.blocks.len())..) {
                self.pool.release(b)?;
            }
            for ((w, blocks), &len) in self
                .windows
                .iter_mut()
                .zip(&mut seq.window_blocks)
                .zip(&u.window_blocks)
            {
                for b in blocks.drain(len.min(blocks.len())..).flatten() {
                    w.pool.release(b)?;
                }
            }
        }
        Ok(())
    }

    fn plan(&self, work: &[Work]) -> Result<Vec<Planned>> {
        let mut seen = HashSet::with_capacity(work.len());
        let mut plan = Vec::with_capacity(work.len());
        let mut num_tokens = 0usize;
        for w in work {
            let seq_id = w.seq_id();
            let Some(seq) = self.seqs.get(&seq_id) else {
                bail!("{OP}: sequence {seq_id} is not admitted");
            };
            if !seen.insert(seq_id) {
                bail!("{OP}: sequence {seq_id} is scheduled twice in one batch");
            }
            let left = seq.tokens.len() - seq.computed;
            let (q_len, token) = match *w {
                Work::Prefill { num_tokens, .. } => {
                    if num_tokens == 0 || num_tokens > left {
                        bail!(
                            "{OP}: sequence {seq_id} asks to prefill {num_tokens} tokens but {left} prompt tokens are left"
                        );
                    }
                    (num_tokens, None)
                }
                Work::Decode { token, .. } => {
                    if left > 0 {
                        bail!("{OP}: sequence {seq_id} cannot decode: {left} prompt tokens are not prefilled yet");
                    }
                    (1, Some(token))
                }
            };
            if seq.computed + q_len > u32::MAX as usize {
                bail!("{OP}: sequence {seq_id} would exceed u32 positions");
            }
            num_tokens += q_len;
            if num_tokens > u32::MAX as usize {
                bail!("{OP}: the batch would have more than u32::MAX query tokens");
            }
            plan.push(Planned {
                seq_id,
                start: seq.computed,
                q_len,
                token,
            });
        }
        Ok(plan)
    }

    /// Returns window-group blocks that no query at or after each planned
    /// sequence's first new position can see.
    fn recycle_out_of_window(&mut self, plan: &[Planned]) -> Result<()> {
        for (g, w) in self.windows.iter_mut().enumerate() {
            for p in plan {
                let Some(seq) = self.seqs.get_mut(&p.seq_id) else {
                    continue;
                };
                let blocks = &mut seq.window_blocks[g];
                let out =
                    blocks_out_of_window(p.start, w.window, self.block_size).min(blocks.len());
                for b in blocks[..out].iter_mut() {
                    if let Some(id) = b.take() {
                        w.pool.release(id)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The first pool that cannot give `plan` its blocks, as the error
    /// `schedule` reports; `None` when every pool can. Window pools count the
    /// blocks `recycle_out_of_window` would return first.
    fn capacity_shortfall(&self, plan: &[Planned]) -> Option<String> {
        let bs = self.block_size;
        let check = |pool: &BlockPool,
                     name: &str,
                     recyclable: usize,
                     held: &dyn Fn(&Sequence) -> usize|
         -> Option<String> {
            let available = pool.num_available() + recyclable;
            let mut taken = 0;
            for p in plan {
                let held = self.seqs.get(&p.seq_id).map_or(0, held);
                let need = (p.start + p.q_len).div_ceil(bs).saturating_sub(held);
                if taken + need > available {
                    return Some(format!(
                        "{OP}: sequence {} needs {need} more blocks but {} {} free in the {name} pool ({} of {} blocks free before this batch)",
                        p.seq_id,
                        available - taken,
                        if available - taken == 1 { "is" } else { "are" },
                        available,
                        pool.num_blocks()
                    ));
                }
                taken += need;
            }
            None
        };
        if let Some(why) = check(&self.pool, "full-attention", 0, &|s| s.blocks.len()) {
            return Some(why);
        }
        for (g, w) in self.windows.iter().enumerate() {
            let recyclable: usize = plan
                .iter()
                .filter_map(|p| self.seqs.get(&p.seq_id))
                .zip(plan)
                .map(|(s, p)| {
                    let blocks = &s.window_blocks[g];
                    let out = blocks_out_of_window(p.start, w.window, bs).min(blocks.len());
                    blocks[..out].iter().flatten().count()
                })
                .sum();
            let name = format!("window-{}", w.window);
            if let Some(why) = check(&w.pool, &name, recyclable, &|s| s.window_blocks[g].len()) {
                return Some(why);
            }
        }
        None
    }

    /// Appends the decoded token, advances `computed` and allocates the
    /// blocks of one planned sequence, recording its previous lengths in
    /// `undo` first.
    fn commit(&mut self, p: &Planned, undo: &mut Vec<SeqUndo>) -> Result<()> {
        let bs = self.block_size;
        let Some(seq) = self.seqs.get_mut(&p.seq_id) else {
            bail!("{OP}: sequence {} vanished while scheduling", p.seq_id);
        };
        undo.push(SeqUndo {
            seq_id: p.seq_id,
            computed: seq.computed,
            tokens: seq.tokens.len(),
            blocks: seq.blocks.len(),
            hashes: seq.block_hashes.len(),
            window_blocks: seq.window_blocks.iter().map(Vec::len).collect(),
        });
        if let Some(t) = p.token {
            seq.tokens.push(t);
        }
        seq.computed = p.start + p.q_len;
        let needed = seq.computed.div_ceil(bs);
        while seq.blocks.len() < needed {
            let b = self.pool.allocate()?;
            // A fresh allocation holds no registered prefix any more.
            self.poisoned.remove(&b);
            seq.blocks.push(b);
        }
        for (g, w) in self.windows.iter_mut().enumerate() {
            while seq.window_blocks[g].len() < needed {
                seq.window_blocks[g].push(Some(w.pool.allocate()?));
            }
        }
        if self.prefix_caching {
            for b in seq.block_hashes.len()..seq.computed / bs {
                let toks = &seq.tokens[b * bs..(b + 1) * bs];
                let hash = block_hash(seq.block_hashes.last().copied(), toks);
                let block = seq.blocks[b];
                self.pool.register(block, hash, toks);
                if self.poisoned.get(&block) == Some(&hash) {
                    // This batch computes the block again.
                    self.poisoned.remove(&block);
                }
                seq.block_hashes.push(hash);
            }
        }
        Ok(())
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
        let mut seqs = Vec::with_capacity(plan.len());
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
            seqs.push(seq);
        }
        let width = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0);
        let rows = |table: &dyn Fn(&Sequence, usize) -> u32| -> Vec<u32> {
            let mut flat = vec![0u32; plan.len() * width];
            for (row, s) in flat.chunks_mut(width.max(1)).zip(&seqs) {
                for (j, slot) in row.iter_mut().enumerate().take(s.blocks.len()) {
                    *slot = table(s, j);
                }
            }
            flat
        };
        let slots = |block_of: &dyn Fn(&Sequence, usize) -> Option<u32>| -> Result<Vec<i64>> {
            let mut out = Vec::with_capacity(num_tokens);
            for (p, s) in plan.iter().zip(&seqs) {
                for pos in p.start..p.start + p.q_len {
                    let Some(b) = block_of(s, pos / bs) else {
                        bail!(
                            "{OP}: sequence {} has no block for position {pos}",
                            p.seq_id
                        );
                    };
                    out.push(b as i64 * bs as i64 + (pos % bs) as i64);
                }
            }
            Ok(out)
        };
        let full_tables = rows(&|s, j| s.blocks[j]);
        let full_slots = slots(&|s, j| s.blocks.get(j).copied())?;
        let batch = PagedBatch::new(&cu_seqlens_q, &seq_lens, &full_tables, width, bs, device)?;
        let mut metadata = AttentionMetadata::new(batch, SlotMapping::new(&full_slots, device)?)?;
        for (g, w) in self.windows.iter().enumerate() {
            // Recycled blocks read as block 0: the window masks them.
            let tables = rows(&|s, j| s.window_blocks[g][j].unwrap_or(0));
            let group_slots = slots(&|s, j| s.window_blocks[g].get(j).copied().flatten())?;
            let batch = PagedBatch::new(&cu_seqlens_q, &seq_lens, &tables, width, bs, device)?;
            metadata = metadata.with_window_group(
                w.window,
                batch,
                SlotMapping::new(&group_slots, device)?,
            )?;
        }
        Ok(ScheduledBatch {
            metadata,
            token_ids,
            seq_ids: plan.iter().map(|p| p.seq_id).collect(),
            last_rows,
            ready,
            undo: BatchUndo {
                id: 0,
                seqs: Vec::new(),
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
        self.pool.num_available()
    }

    /// Blocks window group `group` can still hand out.
    pub fn num_free_window_blocks(&self, group: usize) -> Option<usize> {
        self.windows.get(group).map(|w| w.pool.num_available())
    }

    /// Blocks registered in the prefix cache (in use or not).
    pub fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached()
    }

    /// Cached blocks no sequence uses (reusable by a later prefix, evicted first).
    pub fn num_cached_unused_blocks(&self) -> usize {
        self.pool.num_cached_unused()
    }

    /// Sequences holding full-attention block `block`.
    pub fn block_ref_count(&self, block: u32) -> u32 {
        self.pool.ref_count(block)
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
        self.seqs.get(&seq_id).map(|s| s.blocks.as_slice())
    }

    /// Block table of a sequence in window group `group`; `None` entries were
    /// recycled out of the window.
    pub fn window_block_table(&self, seq_id: u64, group: usize) -> Option<&[Option<u32>]> {
        self.seqs
            .get(&seq_id)?
            .window_blocks
            .get(group)
            .map(Vec::as_slice)
    }
}

#[derive(Clone, Copy, Debug)]
struct Planned {
    seq_id: u64,
    start: usize,
    q_len: usize,
    token: Option<u32>,
}
