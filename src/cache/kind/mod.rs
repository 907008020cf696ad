//! One manager per attention kind: the blocks each sequence holds in the
//! caches of the layers of that kind, in the manner of vLLM's single-type
//! KV-cache managers.
//!
//! * [`FullAttentionManager`]: the full-attention pool and tables, with
//!   prefix caching (content hashes of full blocks, cached blocks shared
//!   between sequences).
//! * [`SlidingWindowManager`]: one sliding-window group's pool and tables,
//!   whose blocks that fell out of the window go back to the pool.
//!
//! [`BlockManager`](super::BlockManager) keeps what every kind shares (the
//! sequences, their tokens and computed positions, the undo log of the last
//! batch) and drives one manager per kind, the full-attention one first,
//! then the window groups in their order.
//!
//! Imports the pool, `prefix` and `remap`, nothing else of this crate.

mod full;
mod window;

pub(super) use full::FullAttentionManager;
pub(super) use window::SlidingWindowManager;

use candle_core::Result;

use super::pool::BlockPool;

/// One sequence's share of a batch being scheduled.
#[derive(Clone, Debug)]
pub(super) struct Planned {
    pub(super) seq_id: u64,
    /// First position computed (after the blocks taken from the cache).
    pub(super) start: usize,
    pub(super) q_len: usize,
    pub(super) token: Option<u32>,
    /// Blocks taken from the prefix cache first, by hash: `Some(block)`
    /// computed by an earlier batch, `None` by an earlier item of this one.
    pub(super) hits: Vec<(u64, Option<u32>)>,
}

/// The blocks of one attention kind: its pool and the block table of every
/// admitted sequence.
pub(super) trait KindManager {
    /// The pool's name in errors (`full-attention`, `window-{window}`).
    fn pool_name(&self) -> String;

    /// The pool the blocks come from.
    fn pool(&self) -> &BlockPool;

    /// Starts the table of an admitted sequence; returns the prompt tokens
    /// whose blocks it took from the prefix cache (whole blocks, 0 without
    /// prefix caching).
    fn add_sequence(&mut self, seq_id: u64, prompt: &[u32]) -> usize;

    /// Entries of a sequence's table (recycled ones included); 0 for an
    /// unknown sequence.
    fn num_held(&self, seq_id: u64) -> usize;

    /// Blocks `p` needs from the pool for its positions up to
    /// `p.start + p.q_len`, beyond those its sequence holds (and, for full
    /// attention, the cached blocks it takes).
    fn num_blocks_to_allocate(&self, p: &Planned) -> usize;

    /// Blocks the pool can give `plan`: the available ones, less the unused
    /// cached ones the plan takes, plus those recycling returns first.
    fn num_available(&self, plan: &[Planned]) -> usize;

    /// Grows a sequence's table to cover `num_tokens` tokens.
    fn allocate(&mut self, seq_id: u64, num_tokens: usize) -> Result<()>;

    /// Returns the blocks of a sequence that no query at or after position
    /// `start` can see (nothing for full attention).
    fn recycle_out_of_window(&mut self, _seq_id: u64, _start: usize) -> Result<()> {
        Ok(())
    }

    /// Shrinks a sequence's table to `len` entries, releasing the blocks
    /// dropped (last batch undone).
    fn truncate(&mut self, seq_id: u64, len: usize) -> Result<()>;

    /// Releases every block of a sequence and forgets its table.
    fn free(&mut self, seq_id: u64) -> Result<()>;

    /// Block `index` of a sequence's table; `None` past its end or where the
    /// block was recycled.
    fn block_at(&self, seq_id: u64, index: usize) -> Option<u32>;
}
