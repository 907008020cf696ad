//! Full attention: every block of a sequence stays in its table until the
//! sequence is freed, and full computed blocks can be shared through the
//! prefix cache.

use std::collections::{HashMap, HashSet};

use candle_core::Result;

use super::{KindManager, Planned};
use crate::cache::pool::BlockPool;
use crate::cache::prefix::block_hash;

/// A sequence's full-attention blocks and the content hashes of its leading
/// full ones (prefix caching): one hash per full computed block.
#[derive(Debug, Default)]
struct FullTable {
    blocks: Vec<u32>,
    hashes: Vec<u64>,
}

/// The full-attention pool, the tables of the sequences, and the prefix
/// cache (when enabled).
#[derive(Debug)]
pub(in crate::cache) struct FullAttentionManager {
    block_size: usize,
    prefix_caching: bool,
    pool: BlockPool,
    tables: HashMap<u64, FullTable>,
}

impl FullAttentionManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub(in crate::cache) fn new(
        block_size: usize,
        num_blocks: usize,
        prefix_caching: bool,
    ) -> Self {
        Self {
            block_size,
            prefix_caching,
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
        }
    }

    /// Whether full computed blocks are shared through the prefix cache.
    pub(in crate::cache) fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// The block table of a sequence.
    pub(in crate::cache) fn block_table(&self, seq_id: u64) -> Option<&[u32]> {
        self.tables.get(&seq_id).map(|t| t.blocks.as_slice())
    }

    /// Content hashes of a sequence's leading full blocks (0 for an unknown
    /// sequence).
    pub(in crate::cache) fn num_hashes(&self, seq_id: u64) -> usize {
        self.tables.get(&seq_id).map_or(0, |t| t.hashes.len())
    }

    /// The hash of a sequence's last hashed block.
    pub(in crate::cache) fn last_hash(&self, seq_id: u64) -> Option<u64> {
        self.tables.get(&seq_id)?.hashes.last().copied()
    }

    /// The cached blocks holding the next prompt blocks of a sequence with
    /// `tokens` of which `computed` are computed, as `(hash, Some(block))`
    /// for blocks earlier batches computed, then `(hash, None)` for blocks
    /// that earlier items of the batch being planned compute
    /// (`computed_here`). Only whole blocks before the last prompt token
    /// count, and only when the sequence has computed whole blocks.
    pub(in crate::cache) fn prefix_hits(
        &self,
        seq_id: u64,
        tokens: &[u32],
        computed: usize,
        computed_here: &HashMap<u64, &[u32]>,
    ) -> Vec<(u64, Option<u32>)> {
        let bs = self.block_size;
        let mut hits: Vec<(u64, Option<u32>)> = Vec::new();
        if !computed.is_multiple_of(bs) {
            return hits;
        }
        let mut parent = self.last_hash(seq_id);
        // Blocks wholly before the last token, whose logits start generation.
        let end = tokens.len().saturating_sub(1) / bs;
        for b in computed / bs..end {
            let toks = &tokens[b * bs..(b + 1) * bs];
            let hash = block_hash(parent, toks);
            let in_batch_run = hits.last().is_some_and(|h| h.1.is_none());
            match self.pool.lookup(hash, toks) {
                // Cached blocks come first: `schedule` takes them before any
                // item of the batch allocates.
                Some(block) if !in_batch_run => hits.push((hash, Some(block))),
                _ if computed_here.get(&hash) == Some(&toks) => hits.push((hash, None)),
                _ => break,
            }
            parent = Some(hash);
        }
        hits
    }

    /// Leading whole blocks of `tokens` (before its last token) that the
    /// prefix cache holds and sequences use. Zero without prefix caching.
    pub(in crate::cache) fn shared_prefix_blocks(&self, tokens: &[u32]) -> usize {
        if !self.prefix_caching {
            return 0;
        }
        let mut parent = None;
        let mut in_use = 0;
        for toks in tokens[..tokens.len().saturating_sub(1)].chunks_exact(self.block_size) {
            let hash = block_hash(parent, toks);
            let Some(block) = self.pool.lookup(hash, toks) else {
                break;
            };
            if self.pool.ref_count(block) > 0 {
                in_use += 1;
            }
            parent = Some(hash);
        }
        in_use
    }

    /// Appends to a sequence's table the cached block holding `tokens`
    /// under `hash`; false when there is none (or no such sequence).
    pub(in crate::cache) fn take_cached(&mut self, seq_id: u64, hash: u64, tokens: &[u32]) -> bool {
        let Some(table) = self.tables.get_mut(&seq_id) else {
            return false;
        };
        let Some(block) = self.pool.acquire_cached(hash, tokens) else {
            return false;
        };
        table.blocks.push(block);
        table.hashes.push(hash);
        true
    }

    /// Registers in the prefix cache the full blocks among the first
    /// `computed` of `tokens` that a sequence has not hashed yet; returns
    /// those registered under their own hash (the batch's registrations). A
    /// no-op without prefix caching.
    pub(in crate::cache) fn register_computed(
        &mut self,
        seq_id: u64,
        tokens: &[u32],
        computed: usize,
    ) -> Vec<u32> {
        let bs = self.block_size;
        let mut registered = Vec::new();
        if !self.prefix_caching {
            return registered;
        }
        let Some(table) = self.tables.get_mut(&seq_id) else {
            return registered;
        };
        // Full blocks: `b < computed / bs <= blocks.len()`.
        for b in table.hashes.len()..computed / bs {
            let toks = &tokens[b * bs..(b + 1) * bs];
            let hash = block_hash(table.hashes.last().copied(), toks);
            let block = table.blocks[b];
            self.pool.register(block, hash, toks);
            if self.pool.lookup(hash, toks) == Some(block) {
                registered.push(block);
            }
            table.hashes.push(hash);
        }
        registered
    }

    /// Forgets the prefixes `blocks` are registered under.
    pub(in crate::cache) fn unregister(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.pool.unregister(b);
        }
    }

    /// Keeps the first `len` hashes of a sequence.
    pub(in crate::cache) fn truncate_hashes(&mut self, seq_id: u64, len: usize) {
        if let Some(table) = self.tables.get_mut(&seq_id) {
            table.hashes.truncate(len);
        }
    }
}

impl KindManager for FullAttentionManager {
    fn pool_name(&self) -> String {
        "full-attention".to_string()
    }

    fn pool(&self) -> &BlockPool {
        &self.pool
    }

    fn add_sequence(&mut self, seq_id: u64, prompt: &[u32]) -> usize {
        let mut table = FullTable::default();
        if self.prefix_caching {
            let before_last = &prompt[..prompt.len().saturating_sub(1)];
            for toks in before_last.chunks_exact(self.block_size) {
                let hash = block_hash(table.hashes.last().copied(), toks);
                let Some(block) = self.pool.acquire_cached(hash, toks) else {
                    break;
                };
                table.blocks.push(block);
                table.hashes.push(hash);
            }
        }
        let cached = table.blocks.len() * self.block_size;
        self.tables.insert(seq_id, table);
        cached
    }

    fn num_held(&self, seq_id: u64) -> usize {
        self.tables.get(&seq_id).map_or(0, |t| t.blocks.len())
    }

    fn num_blocks_to_allocate(&self, p: &Planned) -> usize {
        let held = self
            .tables
            .get(&p.seq_id)
            .map_or(0, |t| t.blocks.len() + p.hits.len());
        (p.start + p.q_len)
            .div_ceil(self.block_size)
            .saturating_sub(held)
    }

    fn num_available(&self, plan: &[Planned]) -> usize {
        // Unused cached blocks the plan takes leave the available ones.
        let pinned: HashSet<u32> = plan
            .iter()
            .flat_map(|p| p.hits.iter().filter_map(|h| h.1))
            .filter(|&b| self.pool.ref_count(b) == 0)
            .collect();
        self.pool.num_available().saturating_sub(pinned.len())
    }

    fn allocate(&mut self, seq_id: u64, num_tokens: usize) -> Result<()> {
        let needed = num_tokens.div_ceil(self.block_size);
        let table = self.tables.entry(seq_id).or_default();
        while table.blocks.len() < needed {
            table.blocks.push(self.pool.allocate()?);
        }
        Ok(())
    }

    fn truncate(&mut self, seq_id: u64, len: usize) -> Result<()> {
        let Some(table) = self.tables.get_mut(&seq_id) else {
            return Ok(());
        };
        for b in table.blocks.drain(len.min(table.blocks.len())..) {
            self.pool.release(b)?;
        }
        Ok(())
    }

    fn free(&mut self, seq_id: u64) -> Result<()> {
        let Some(table) = self.tables.remove(&seq_id) else {
            return Ok(());
        };
        for &b in &table.blocks {
            self.pool.release(b)?;
        }
        Ok(())
    }

    fn block_at(&self, seq_id: u64, index: usize) -> Option<u32> {
        self.tables.get(&seq_id)?.blocks.get(index).copied()
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
    fn allocates_in_order_truncates_and_frees() {
        let mut m = FullAttentionManager::new(4, 8, false);
        assert_eq!(m.add_sequence(0, &[1; 9]), 0);
        m.add_sequence(1, &[2; 3]);
        assert_eq!(m.num_blocks_to_allocate(&planned(0, 0, 9)), 3);
        m.allocate(0, 9).unwrap();
        m.allocate(1, 3).unwrap();
        assert_eq!(m.block_table(0).unwrap(), [0, 1, 2]);
        assert_eq!(m.block_table(1).unwrap(), [3]);
        assert_eq!(m.num_blocks_to_allocate(&planned(0, 9, 1)), 0);
        assert_eq!(m.num_blocks_to_allocate(&planned(0, 12, 1)), 1);
        m.truncate(0, 1).unwrap();
        assert_eq!(m.block_table(0).unwrap(), [0]);
        assert_eq!(m.pool().num_available(), 6);
        // Released blocks come back after the never-used ones, oldest first.
        m.allocate(1, 12).unwrap();
        assert_eq!(m.block_table(1).unwrap(), [3, 4, 5]);
        m.free(0).unwrap();
        assert_eq!(m.block_table(0), None);
        assert_eq!(m.pool().num_available(), 5);
        assert_eq!(m.pool_name(), "full-attention");
    }

    #[test]
    fn shares_registered_prefixes() {
        let mut m = FullAttentionManager::new(2, 8, true);
        let prompt = [1, 2, 3, 4, 5];
        assert_eq!(m.add_sequence(0, &prompt), 0);
        m.allocate(0, 5).unwrap();
        // Blocks 0 and 1 are full; block 2 holds one token.
        assert_eq!(m.register_computed(0, &prompt, 5), [0, 1]);
        assert_eq!(m.num_hashes(0), 2);
        // A later sequence with the same prompt takes both full blocks, not
        // the one holding the last token.
        assert_eq!(m.add_sequence(1, &prompt), 4);
        assert_eq!(m.block_table(1).unwrap(), [0, 1]);
        assert_eq!((m.pool().ref_count(0), m.pool().ref_count(1)), (2, 2));
        assert_eq!(m.shared_prefix_blocks(&prompt), 2);
        // A third finds the cached blocks when it plans its prefill.
        m.add_sequence(2, &[1, 2, 3, 4, 9]);
        m.truncate(2, 0).unwrap();
        m.truncate_hashes(2, 0);
        let hits = m.prefix_hits(2, &[1, 2, 3, 4, 9], 0, &HashMap::new());
        assert_eq!(
            hits.iter().map(|h| h.1).collect::<Vec<_>>(),
            [Some(0), Some(1)]
        );
        // The blocks free only when no sequence holds them; their prefixes
        // stay cached until they are needed.
        m.free(0).unwrap();
        m.free(1).unwrap();
        m.free(2).unwrap();
        assert_eq!(m.pool().num_cached_unused(), 2);
        m.unregister(&[0]);
        assert_eq!(m.pool().num_cached(), 1);
        assert!(!m.take_cached(3, hits[1].0, &[3, 4]), "unknown sequence");
    }

    #[test]
    fn without_prefix_caching_nothing_is_registered() {
        let mut m = FullAttentionManager::new(2, 4, false);
        m.add_sequence(0, &[1, 2, 3]);
        m.allocate(0, 3).unwrap();
        assert!(m.register_computed(0, &[1, 2, 3], 3).is_empty());
        assert_eq!(m.add_sequence(1, &[1, 2, 3]), 0);
        assert_eq!(m.shared_prefix_blocks(&[1, 2, 3]), 0);
        assert_eq!(m.pool().num_cached(), 0);
    }
}
