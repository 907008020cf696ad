//! The shapes of CUDA-graph steps: batch-size buckets, token-count buckets
//! of steps with prefills, block-table widths, and the split-KV plan every
//! step of a bucket uses (graph or not).
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

/// Token counts a graph of a step with prefills (or prefill chunks) is
/// captured for: a step pads up to the smallest that holds its tokens. Past
/// the last, a step runs eagerly: its matmuls are long enough that launches
/// no longer dominate (vLLM's largest capture size is 512 tokens too).
/// There is no 448: on an H100, cuBLAS ran the 8B shape's gate/up
/// projection (28,672 x 4,096) on 448 rows in 299.6 µs and on 512 rows in
/// 166.4 µs, and a 448-token step of that model replayed in 18.1 ms padded
/// to 448 tokens against 15.3 ms padded to 512 (docs/perf.md, version 14).
pub const MIXED_TOKEN_BUCKETS: [usize; 10] = [8, 16, 32, 64, 128, 192, 256, 320, 384, 512];

/// The most tokens of a step with prefills that a graph runs.
pub const MAX_MIXED_GRAPH_TOKENS: usize = MIXED_TOKEN_BUCKETS[MIXED_TOKEN_BUCKETS.len() - 1];

/// The bucket shape `(B, T, W)` of a step with prefills of `num_seqs`
/// sequences and `num_tokens` tokens whose tables are `width` blocks of
/// `block_size` tokens: `B` sequences (the batch bucket above `num_seqs`,
/// so at least one padding sequence), `T` tokens (the token bucket that
/// holds `num_tokens`; the first padding sequence takes the `T -
/// num_tokens` padding tokens, the others none), tables of `W` blocks (as a
/// decode step's, widened until the padding tokens fit). `None` when no
/// bucket holds the step.
pub fn mixed_bucket(
    num_seqs: usize,
    num_tokens: usize,
    width: usize,
    block_size: usize,
) -> Option<(usize, usize, usize)> {
    let b = *BATCH_BUCKETS.iter().find(|&&b| b > num_seqs)?;
    let t = *MIXED_TOKEN_BUCKETS.iter().find(|&&t| t >= num_tokens)?;
    let pad = t - num_tokens;
    let mut w = width.max(MIN_TABLE_WIDTH).checked_next_power_of_two()?;
    while w.checked_mul(block_size)? < pad {
        w = w.checked_mul(2)?;
    }
    Some((b, t, w))
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

    #[test]
    fn mixed_buckets_pad_to_the_next_token_count() {
        // 3 sequences of 100 tokens: 4 sequences, 128 tokens (28 padding).
        assert_eq!(mixed_bucket(3, 100, 7, 16), Some((4, 128, 32)));
        // A full batch bucket takes the next one: 4 -> 8 sequences; a step
        // at a token bucket pads no token.
        assert_eq!(mixed_bucket(4, 64, 40, 16), Some((8, 64, 64)));
        assert_eq!(mixed_bucket(1, 5, 1, 2), Some((2, 8, 32)));
        assert_eq!(mixed_bucket(1, 129, 1, 2), Some((2, 192, 32)));
        // The padding tokens must fit their table: 63 tokens in blocks of
        // one token widen it to 64 blocks.
        assert_eq!(mixed_bucket(1, 65, 1, 1), Some((2, 128, 64)));
        // Past the largest buckets.
        assert_eq!(mixed_bucket(3, 512, 1, 16), Some((4, 512, 32)));
        assert_eq!(mixed_bucket(3, 513, 1, 16), None);
        assert_eq!(mixed_bucket(256, 300, 1, 16), None);
        for (n, tokens, width, bs) in [
            (1, 2, 1, 16),
            (5, 77, 9, 16),
            (100, 300, 3, 8),
            (2, 400, 2, 1),
        ] {
            let (b, t, w) = mixed_bucket(n, tokens, width, bs).unwrap();
            assert!(b > n && t >= tokens && w >= width);
            assert!(w * bs >= t - tokens);
        }
    }
}
