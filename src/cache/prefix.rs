//! Content hashes of full blocks for prefix caching.
//!
//! A block's hash chains its parent's hash with its own token ids, so equal
//! hashes mean equal prefixes up to and including the block (up to 64-bit
//! collisions, which the pool rules out by also comparing the block's tokens).

use std::hash::{DefaultHasher, Hash, Hasher};

/// Hash of the block holding `tokens`, whose preceding block hashed to
/// `parent` (`None` for a sequence's first block).
pub(crate) fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_parents() {
        let a = block_hash(None, &[1, 2]);
        assert_eq!(a, block_hash(None, &[1, 2]));
        assert_ne!(a, block_hash(None, &[2, 1]));
        assert_ne!(
            block_hash(Some(a), &[3, 4]),
            block_hash(Some(a + 1), &[3, 4])
        );
    }
}
