//! The decode shapes of CUDA-graph steps: batch-size buckets and block-table
//! widths, and the split-KV plan every pure-decode step uses (graph or not).
//!
//! A step of `n` decodes runs as a batch of `B` = the smallest of
//! [`BATCH_BUCKETS`] `>= n` sequences with tables of `W` = the next power of
//! two `>=` its table width, at least [`MIN_TABLE_WIDTH`] blocks. Its
//! split-KV is planned for `W * block_size` keys
//! ([`GraphMode::Replayable`](crate::GraphMode::Replayable)):
//! a graph's launches then depend only on its shape, and an eager step of
//! the same batch launches the same programs, so both sum the same partials
//! in the same order.

/// Batch sizes a decode graph is captured for; a step pads up to the
/// smallest that holds it.
pub const BATCH_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The narrowest block table of a decode graph, in blocks.
pub const MIN_TABLE_WIDTH: usize = 32;

/// The bucket shape `(B, W)` of a decode step of `num_seqs` sequences whose
/// tables are `width` blocks wide, or `None` past the largest bucket.
pub fn decode_bucket(num_seqs: usize, width: usize) -> Option<(usize, usize)> {
    let b = *BATCH_BUCKETS.iter().find(|&&b| b >= num_seqs)?;
    let w = width
        .max(MIN_TABLE_WIDTH)
        .checked_next_power_of_two()
        .unwrap_or(width);
    Some((b, w))
}

/// The key count split-KV is planned for in a decode step whose tables are
/// `width` blocks of `block_size` tokens: the bucket's `W * block_size`.
pub fn decode_split_plan_keys(width: usize, block_size: usize) -> usize {
    let w = width
        .max(MIN_TABLE_WIDTH)
        .checked_next_power_of_two()
        .unwrap_or(width);
    w.saturating_mul(block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up() {
        assert_eq!(decode_bucket(1, 1), Some((1, 32)));
        assert_eq!(decode_bucket(3, 33), Some((4, 64)));
        assert_eq!(decode_bucket(64, 64), Some((64, 64)));
        assert_eq!(decode_bucket(65, 500), Some((128, 512)));
        assert_eq!(decode_bucket(257, 1), None);
        assert_eq!(decode_split_plan_keys(33, 16), 1024);
        assert_eq!(decode_split_plan_keys(1, 16), 512);
    }
}
