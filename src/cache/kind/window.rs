//! Sliding-window attention: a query sees only the last `window` positions,
//! so the blocks wholly before the window of a sequence's next query go
//! back to the group's pool, and their table entries read as recycled.

use std::collections::HashMap;

use candle_core::Result;

use super::{KindManager, Planned};
use crate::cache::pool::BlockPool;
use crate::remap::blocks_out_of_window;

/// One sliding-window group's pool and the tables of the sequences.
#[derive(Debug)]
pub(in crate::cache) struct SlidingWindowManager {
    block_size: usize,
    window: usize,
    pool: BlockPool,
    /// Per sequence; `None` marks a block recycled out of the window.
    tables: HashMap<u64, Vec<Option<u32>>>,
}

impl SlidingWindowManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens for layers with
    /// a sliding window of `window` tokens.
    pub(in crate::cache) fn new(block_size: usize, window: usize, num_blocks: usize) -> Self {
        Self {
            block_size,
            window,
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
        }
    }

    /// The layers' sliding window in tokens.
    pub(in crate::cache) fn window(&self) -> usize {
        self.window
    }

    /// The block table of a sequence; `None` entries were recycled.
    pub(in crate::cache) fn block_table(&self, seq_id: u64) -> Option<&[Option<u32>]> {
        self.tables.get(&seq_id).map(Vec::as_slice)
    }

    /// Blocks of a sequence (not yet recycled) that no query at or after
    /// position `start` can see.
    fn num_recyclable(&self, seq_id: u64, start: usize) -> usize {
        let Some(blocks) = self.tables.get(&seq_id) else {
            return 0;
        };
        let out = blocks_out_of_window(start, self.window, self.block_size).min(blocks.len());
        blocks[..out].iter().flatten().count()
    }
}

impl KindManager for SlidingWindowManager {
    fn pool_name(&self) -> String {
        format!("window-{}", self.window)
    }

    fn pool(&self) -> &BlockPool {
        &self.pool
    }

    fn add_sequence(&mut self, seq_id: u64, _prompt: &[u32]) -> usize {
        self.tables.insert(seq_id, Vec::new());
        0
    }

    fn num_held(&self, seq_id: u64) -> usize {
        self.tables.get(&seq_id).map_or(0, Vec::len)
    }

    fn num_blocks_to_allocate(&self, p: &Planned) -> usize {
        // Prefix caching is off with window groups: `p.hits` is empty.
        (p.start + p.q_len)
            .div_ceil(self.block_size)
            .saturating_sub(self.num_held(p.seq_id))
    }

    fn num_available(&self, plan: &[Planned]) -> usize {
        let recyclable: usize = plan
            .iter()
            .map(|p| self.num_recyclable(p.seq_id, p.start))
            .sum();
        self.pool.num_available() + recyclable
    }

    fn allocate(&mut self, seq_id: u64, num_tokens: usize) -> Result<()> {
        let needed = num_tokens.div_ceil(self.block_size);
        let blocks = self.tables.entry(seq_id).or_default();
        while blocks.len() < needed {
            blocks.push(Some(self.pool.allocate()?));
        }
        Ok(())
    }

    fn recycle_out_of_window(&mut self, seq_id: u64, start: usize) -> Result<()> {
        let Some(blocks) = self.tables.get_mut(&seq_id) else {
            return Ok(());
        };
        let out = blocks_out_of_window(start, self.window, self.block_size).min(blocks.len());
        for b in blocks[..out].iter_mut() {
            if let Some(id) = b.take() {
                self.pool.release(id)?;
            }
        }
        Ok(())
    }

    fn truncate(&mut self, seq_id: u64, len: usize) -> Result<()> {
        let Some(blocks) = self.tables.get_mut(&seq_id) else {
            return Ok(());
        };
        for b in blocks.drain(len.min(blocks.len())..).flatten() {
            self.pool.release(b)?;
        }
        Ok(())
    }

    fn free(&mut self, seq_id: u64) -> Result<()> {
        let Some(blocks) = self.tables.remove(&seq_id) else {
            return Ok(());
        };
        for b in blocks.iter().flatten() {
            self.pool.release(*b)?;
        }
        Ok(())
    }

    fn block_at(&self, seq_id: u64, index: usize) -> Option<u32> {
        self.tables.get(&seq_id)?.get(index).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(seq_id: u64, start: usize, q_len: usize) -> Planned {
        Planned {
            seq_id,
            start,
            q_len,
            token: None,
            hits: Vec::new(),
        }
    }

    #[test]
    fn allocates_in_order_and_counts_what_it_needs() {
        let mut m = SlidingWindowManager::new(2, 4, 6);
        assert_eq!(m.add_sequence(0, &[1, 2, 3]), 0);
        m.add_sequence(1, &[4]);
        assert_eq!(m.num_blocks_to_allocate(&planned(0, 0, 3)), 2);
        m.allocate(0, 3).unwrap();
        m.allocate(1, 1).unwrap();
        m.allocate(0, 4).unwrap();
        assert_eq!(m.block_table(0).unwrap(), [Some(0), Some(1)]);
        assert_eq!(m.block_table(1).unwrap(), [Some(2)]);
        assert_eq!(m.num_blocks_to_allocate(&planned(0, 4, 1)), 1);
        assert_eq!(m.pool().num_available(), 3);
        assert_eq!(m.pool_name(), "window-4");
    }

    #[test]
    fn recycles_blocks_out_of_the_window() {
        let mut m = SlidingWindowManager::new(2, 4, 4);
        m.add_sequence(7, &[1; 8]);
        m.allocate(7, 8).unwrap();
        assert_eq!(m.pool().num_available(), 0);
        // A query at position 8 sees positions 5..=8: blocks 0 and 1 are out.
        let plan = [planned(7, 8, 1)];
        assert_eq!(m.num_available(&plan), 2);
        assert_eq!(m.num_blocks_to_allocate(&plan[0]), 1);
        m.recycle_out_of_window(7, 8).unwrap();
        assert_eq!(m.block_table(7).unwrap(), [None, None, Some(2), Some(3)]);
        assert_eq!((m.block_at(7, 0), m.block_at(7, 2)), (None, Some(2)));
        assert_eq!(m.pool().num_available(), 2);
        // Recycling again returns nothing more; the freed ids come back in order.
        m.recycle_out_of_window(7, 8).unwrap();
        assert_eq!(m.num_available(&plan), 2);
        m.allocate(7, 9).unwrap();
        assert_eq!(m.block_at(7, 4), Some(0));
        // Undo drops the new entry and releases its block.
        m.truncate(7, 4).unwrap();
        assert_eq!(m.num_held(7), 4);
        assert_eq!(m.pool().num_available(), 2);
    }

    #[test]
    fn free_releases_only_the_blocks_still_held() {
        let mut m = SlidingWindowManager::new(2, 3, 3);
        m.add_sequence(1, &[1; 6]);
        m.allocate(1, 6).unwrap();
        m.recycle_out_of_window(1, 6).unwrap();
        assert_eq!(m.block_table(1).unwrap(), [None, None, Some(2)]);
        m.free(1).unwrap();
        assert_eq!(m.block_table(1), None);
        assert_eq!(m.pool().num_available(), 3);
        assert_eq!(m.pool().ref_count(2), 0);
        // A second free of the same sequence releases nothing twice.
        m.free(1).unwrap();
        assert_eq!(m.pool().num_available(), 3);
    }
}
