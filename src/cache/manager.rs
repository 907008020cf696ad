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
/// batch needs all at once or fails with nothing changed.
///
/// Blocks scheduled for computation are registered for prefix sharing right
/// away, so run the forward pass of every scheduled batch before the next
/// `add_sequence`.
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
}

impl BlockManager {
    /// An empty manager.
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
        let mut windows: Vec<WindowPool> = Vec::new();
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
            windows.push(WindowPool {
                window: g.window,
                pool: BlockPool::new(g.num_blocks),
            });
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
            windows,
            seqs: HashMap::new(),
        })
    }

    /// Admits a sequence with its prompt. With prefix caching, the leading
    /// full blocks already cached for the same tokens are shared; the last
    /// prompt token is always left to compute (its logits start generation).
    ///
    /// Returns the number of prompt tokens found in the cache; the first
    /// [`Work::Prefill`] starts after them.
    pub fn add_sequence(&mut self, seq_id: u64, prompt: &[u32]) -> Result<usize> {
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
    /// `device`. Fails without changing anything (except recycling blocks the
    /// sliding windows no longer need) when a sequence is unknown, scheduled
    /// twice, asks for more prompt than is left, decodes before its prompt is
    /// done, or when a pool runs out of blocks.
    pub fn schedule(&mut self, work: &[Work], device: &Device) -> Result<ScheduledBatch> {
        if work.is_empty() {
            bail!("{OP}: nothing to schedule (empty work list)");
        }
        let plan = self.plan(work)?;
        self.recycle_out_of_window(&plan)?;
        self.check_capacity(&plan)?;
        for p in &plan {
            self.commit(p)?;
        }
        self.build(&plan, device)
    }

    fn plan(&self, work: &[Work]) -> Result<Vec<Planned>> {
        let mut seen = HashSet::with_capacity(work.len());
        let mut plan = Vec::with_capacity(work.len());
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

    fn check_capacity(&self, plan: &[Planned]) -> Result<()> {
        let bs = self.block_size;
        let check = |pool: &BlockPool,
                     name: &str,
                     held: &dyn Fn(&Sequence) -> usize|
         -> Result<()> {
            let available = pool.num_available();
            let mut taken = 0;
            for p in plan {
                let held = self.seqs.get(&p.seq_id).map_or(0, held);
                let need = (p.start + p.q_len).div_ceil(bs).saturating_sub(held);
                if taken + need > available {
                    bail!(
                        "{OP}: sequence {} needs {need} more blocks but {} {} free in the {name} pool ({} of {} blocks free before this batch)",
                        p.seq_id,
                        available - taken,
                        if available - taken == 1 { "is" } else { "are" },
                        available,
                        pool.num_blocks()
                    );
                }
                taken += need;
            }
            Ok(())
        };
        check(&self.pool, "full-attention", &|s| s.blocks.len())?;
        for (g, w) in self.windows.iter().enumerate() {
            let name = format!("window-{}", w.window);
            check(&w.pool, &name, &|s| s.window_blocks[g].len())?;
        }
        Ok(())
    }

    fn commit(&mut self, p: &Planned) -> Result<()> {
        let bs = self.block_size;
        let Some(seq) = self.seqs.get_mut(&p.seq_id) else {
            bail!("{OP}: sequence {} vanished while scheduling", p.seq_id);
        };
        if let Some(t) = p.token {
            seq.tokens.push(t);
        }
        seq.computed = p.start + p.q_len;
        let needed = seq.computed.div_ceil(bs);
        while seq.blocks.len() < needed {
            seq.blocks.push(self.pool.allocate()?);
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
                self.pool.register(seq.blocks[b], hash, toks);
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
