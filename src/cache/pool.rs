//! A pool of cache block ids with reference counts and a prefix cache.
//!
//! A block is free (never used or its content forgotten), in use (reference
//! count > 0), or cached-and-unused: its content hash is still registered so a
//! later sequence with the same prefix can take it back, but it is the first
//! to be reused (least recently released first) when the free list runs dry.
//!
//! A leaf: imports nothing from this crate.

use std::collections::{BTreeMap, HashMap, VecDeque};

use candle_core::{bail, Result};

const OP: &str = "block-manager";

#[derive(Debug)]
struct Cached {
    hash: u64,
    tokens: Box<[u32]>,
}

/// Per-block state lives in vectors that grow as blocks are first handed
/// out (ids `0..touched`), so a pool of any size, up to `u32::MAX + 1`
/// blocks, costs nothing until its blocks are used: blocks never used are
/// implicit (ids `touched..num_blocks`), taken in order before any released
/// block, exactly as a free list of all ids in order would serve them.
#[derive(Debug)]
pub(crate) struct BlockPool {
    num_blocks: usize,
    /// Ids below this have been handed out at least once.
    touched: usize,
    /// Released blocks, oldest first (all below `touched`).
    free: VecDeque<u32>,
    ref_counts: Vec<u32>,
    cached: Vec<Option<Cached>>,
    by_hash: HashMap<u64, u32>,
    /// Unused cached blocks by release time (oldest first).
    evictable: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    clock: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` block ids; ids are u32, so at most
    /// `u32::MAX + 1` of them are ever handed out.
    pub(crate) fn new(num_blocks: usize) -> Self {
        Self {
            num_blocks: num_blocks.min(u32::MAX as usize + 1),
            touched: 0,
            free: VecDeque::new(),
            ref_counts: Vec::new(),
            cached: Vec::new(),
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: Vec::new(),
            clock: 0,
        }
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks an allocation can take: never-used and free ones plus unused
    /// cached ones.
    pub(crate) fn num_available(&self) -> usize {
        (self.num_blocks - self.touched) + self.free.len() + self.evictable.len()
    }

    /// Unused blocks that still hold a registered prefix.
    pub(crate) fn num_cached_unused(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks registered in the prefix cache, used or not.
    pub(crate) fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    pub(crate) fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts.get(block as usize).copied().unwrap_or(0)
    }

    /// The cached block holding `tokens` under `hash`, if there is one
    /// (nothing is taken).
    pub(crate) fn lookup(&self, hash: u64, tokens: &[u32]) -> Option<u32> {
        let &block = self.by_hash.get(&hash)?;
        let c = self.cached.get(block as usize)?.as_ref()?;
        (*c.tokens == *tokens).then_some(block)
    }

    /// Forgets the prefix `block` is registered under (its content is not
    /// what the hash says); an unused block goes back to the free list.
    pub(crate) fn unregister(&mut self, block: u32) {
        let b = block as usize;
        let Some(c) = self.cached.get_mut(b).and_then(Option::take) else {
            return;
        };
        self.by_hash.remove(&c.hash);
        if self.ref_counts.get(b) == Some(&0) {
            // Unused and cached: it sits in `evictable` under its release time.
            if let Some(t) = self.released_at.get(b) {
                self.evictable.remove(t);
            }
            self.free.push_back(block);
        }
    }

    /// Takes a block: a free one, else the least recently released cached one
    /// (whose prefix is forgotten).
    pub(crate) fn allocate(&mut self) -> Result<u32> {
        if self.touched < self.num_blocks {
            // `touched < num_blocks <= u32::MAX + 1`, so the id fits u32.
            let block = self.touched as u32;
            self.touched += 1;
            self.ref_counts.push(1);
            self.cached.push(None);
            self.released_at.push(0);
            return Ok(block);
        }
        let block = match self.free.pop_front() {
            Some(b) => b,
            None => {
                let Some((_, b)) = self.evictable.pop_first() else {
                    bail!(
                        "{OP}: no free block left in a pool of {}",
                        self.num_blocks()
                    );
                };
                if let Some(c) = self.cached.get_mut(b as usize).and_then(Option::take) {
                    self.by_hash.remove(&c.hash);
                }
                b
            }
        };
        // Released and evictable ids are below `touched`: they have an entry.
        if let Some(r) = self.ref_counts.get_mut(block as usize) {
            *r = 1;
        }
        Ok(block)
    }

    /// Takes a reference to the cached block holding `tokens` under `hash`,
    /// if there is one.
    pub(crate) fn acquire_cached(&mut self, hash: u64, tokens: &[u32]) -> Option<u32> {
        let &block = self.by_hash.get(&hash)?;
        let b = block as usize;
        let c = self.cached.get(b)?.as_ref()?;
        if *c.tokens != *tokens {
            return None;
        }
        // A registered block was handed out, so all three vectors hold it.
        let count = self.ref_counts.get_mut(b)?;
        if *count == 0 {
            self.evictable.remove(&self.released_at[b]);
        }
        *count += 1;
        Some(block)
    }

    /// Registers a full, computed block under its content hash so later
    /// sequences can share it. A hash already held by another block keeps
    /// that block.
    /// A block that was never handed out is ignored.
    pub(crate) fn register(&mut self, block: u32, hash: u64, tokens: &[u32]) {
        let Some(entry) = self.cached.get_mut(block as usize) else {
            return;
        };
        if entry.is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        *entry = Some(Cached {
            hash,
            tokens: tokens.into(),
        });
        self.by_hash.insert(hash, block);
    }

    /// Drops one reference; an unused block goes back to the free list, or
    /// stays cached (evictable) when it holds a registered prefix.
    pub(crate) fn release(&mut self, block: u32) -> Result<()> {
        let b = block as usize;
        if b >= self.num_blocks {
            bail!(
                "{OP}: release of block {block} outside a pool of {}",
                self.num_blocks()
            );
        }
        let Some(count) = self.ref_counts.get_mut(b).filter(|c| **c > 0) else {
            bail!("{OP}: release of block {block}, which is not in use");
        };
        *count -= 1;
        if *count == 0 {
            if self.cached[b].is_some() {
                self.clock += 1;
                self.released_at[b] = self.clock;
                self.evictable.insert(self.clock, block);
            } else {
                self.free.push_back(block);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_blocks_are_reused_then_evicted_oldest_first() {
        let mut pool = BlockPool::new(3);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.register(a, 11, &[1, 2]);
        pool.register(b, 22, &[3, 4]);
        pool.release(b).unwrap();
        pool.release(a).unwrap();
        assert_eq!((pool.num_available(), pool.num_cached_unused()), (3, 2));
        assert_eq!(
            pool.acquire_cached(11, &[9, 9]),
            None,
            "tokens must match too"
        );
        assert_eq!(pool.acquire_cached(11, &[1, 2]), Some(a));
        assert_eq!(pool.num_available(), 2);
        let c = pool.allocate().unwrap();
        assert_eq!(c, 2, "free blocks go first");
        assert_eq!(pool.allocate().unwrap(), b, "then the oldest cached one");
        assert_eq!(
            pool.acquire_cached(22, &[3, 4]),
            None,
            "its prefix is forgotten"
        );
        assert!(pool.allocate().is_err());
        assert!(pool.release(7).is_err());
        pool.release(c).unwrap();
        assert!(pool.release(c).is_err());
    }

    #[test]
    fn huge_pools_cost_nothing_until_used() {
        let mut pool = BlockPool::new(u32::MAX as usize + 7);
        assert_eq!(pool.num_blocks(), u32::MAX as usize + 1);
        assert_eq!(pool.num_available(), u32::MAX as usize + 1);
        let ids: Vec<u32> = (0..4).map(|_| pool.allocate().unwrap()).collect();
        assert_eq!(ids, [0, 1, 2, 3]);
        pool.release(1).unwrap();
        // Never-used ids come first, as from a free list of all ids in order.
        assert_eq!(pool.allocate().unwrap(), 4);
        assert_eq!(pool.ref_count(1), 0);
        assert_eq!(pool.num_available(), u32::MAX as usize + 1 - 4);
        let err = pool.release(9).unwrap_err();
        assert!(
            err.to_string()
                .contains("release of block 9, which is not in use"),
            "{err}"
        );
    }
}
