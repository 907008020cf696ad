//! Which part of every weight a rank of a tensor-parallel group owns: a
//! pure function of the model's shape, the world size and the rank.
//!
//! Megatron-style rules, as vLLM applies them:
//! * query heads split evenly: rank `r` owns heads
//!   `r * h / n .. (r + 1) * h / n` (`h` heads, `n` ranks), so the rows of
//!   q (and its bias) and the input columns of o split with them;
//! * KV heads split evenly when `num_kv_heads >= n`; when there are fewer
//!   KV heads than ranks, each rank holds the one KV head its query heads
//!   read (`kv = q_head / (h / num_kv_heads)`), replicated over
//!   `n / num_kv_heads` ranks;
//! * the MLP's intermediate columns split evenly: rows of gate and up,
//!   input columns of down;
//! * the vocabulary splits in chunks of `ceil(vocab / n)` rows (the last
//!   rank's chunk may be shorter): rows of the embedding and of the LM head.
//!
//! Everything else (norms, rotary tables, the residual stream) is replicated.

use std::ops::Range;

use candle_core::{bail, Result};

const OP: &str = "tensor-parallel";

/// The shape of a decoder that decides its sharding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardConfig {
    /// Query heads per layer.
    pub num_heads: usize,
    /// KV heads per layer (`num_heads` is a multiple of it).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Model width (replicated; checked to be positive).
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
}

/// What rank `rank` of `world_size` owns of a decoder of shape
/// [`ShardConfig`]. Build it with [`ShardPlan::new`], or every rank's with
/// [`ShardPlan::all`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    config: ShardConfig,
    world_size: usize,
    rank: usize,
    q_heads: Range<usize>,
    kv_heads: Range<usize>,
    intermediate: Range<usize>,
    vocab: Range<usize>,
    vocab_chunk: usize,
}

impl ShardPlan {
    /// The plan of rank `rank` of `world_size`.
    ///
    /// Fails, naming the argument and its value, when `world_size` is 0,
    /// `rank >= world_size`, a size is 0, `num_heads` is not a multiple of
    /// `num_kv_heads` or of `world_size`, `world_size` and `num_kv_heads`
    /// do not divide one another, `intermediate_size` is not a multiple of
    /// `world_size`, or the vocabulary is too small to give every rank a
    /// row.
    pub fn new(config: &ShardConfig, world_size: usize, rank: usize) -> Result<Self> {
        let ShardConfig {
            num_heads: h,
            num_kv_heads: kvh,
            head_dim,
            hidden_size,
            intermediate_size: inter,
            vocab_size: vocab,
        } = *config;
        let n = world_size;
        if n == 0 {
            bail!("{OP}: world_size must be at least 1, got 0");
        }
        if rank >= n {
            bail!("{OP}: rank {rank} is out of range for world_size {n}");
        }
        for (name, v) in [
            ("num_attention_heads", h),
            ("num_key_value_heads", kvh),
            ("head_dim", head_dim),
            ("hidden_size", hidden_size),
            ("intermediate_size", inter),
            ("vocab_size", vocab),
        ] {
            if v == 0 {
                bail!("{OP}: {name} must be positive, got 0");
            }
        }
        if !h.is_multiple_of(kvh) {
            bail!("{OP}: num_attention_heads {h} is not a multiple of num_key_value_heads {kvh}");
        }
        if !h.is_multiple_of(n) {
            bail!("{OP}: num_attention_heads {h} is not a multiple of world_size {n}");
        }
        if kvh >= n && !kvh.is_multiple_of(n) {
            bail!("{OP}: num_key_value_heads {kvh} is not a multiple of world_size {n}");
        }
        if kvh < n && !n.is_multiple_of(kvh) {
            bail!(
                "{OP}: world_size {n} is not a multiple of num_key_value_heads {kvh} (fewer KV heads than ranks are replicated, each over the same number of ranks)"
            );
        }
        if !inter.is_multiple_of(n) {
            bail!("{OP}: intermediate_size {inter} is not a multiple of world_size {n}");
        }
        let vocab_chunk = vocab.div_ceil(n);
        if (n - 1) * vocab_chunk >= vocab {
            bail!(
                "{OP}: vocab_size {vocab} is too small for world_size {n} (chunks of {vocab_chunk} rows leave the last rank none)"
            );
        }
        let q_per = h / n;
        let q_heads = rank * q_per..(rank + 1) * q_per;
        let kv_heads = if kvh >= n {
            let per = kvh / n;
            rank * per..(rank + 1) * per
        } else {
            // The KV head of this rank's first query head; its other query
            // heads read the same one (`q_per <= h / kvh`, aligned).
            let kv = q_heads.start / (h / kvh);
            kv..kv + 1
        };
        let i_per = inter / n;
        let start = rank * vocab_chunk;
        Ok(Self {
            config: *config,
            world_size: n,
            rank,
            q_heads,
            kv_heads,
            intermediate: rank * i_per..(rank + 1) * i_per,
            vocab: start..(start + vocab_chunk).min(vocab),
            vocab_chunk,
        })
    }

    /// The plans of ranks `0..world_size`, in order.
    pub fn all(config: &ShardConfig, world_size: usize) -> Result<Vec<Self>> {
        if world_size == 0 {
            bail!("{OP}: world_size must be at least 1, got 0");
        }
        (0..world_size)
            .map(|r| Self::new(config, world_size, r))
            .collect()
    }

    /// The shape the plan shards.
    pub fn config(&self) -> &ShardConfig {
        &self.config
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The query heads this rank owns (global head indices).
    pub fn q_heads(&self) -> Range<usize> {
        self.q_heads.clone()
    }

    /// The KV heads this rank holds (global indices); one replicated head
    /// when there are fewer KV heads than ranks.
    pub fn kv_heads(&self) -> Range<usize> {
        self.kv_heads.clone()
    }

    /// Whether this rank's KV head is also held by other ranks.
    pub fn kv_replicated(&self) -> bool {
        self.config.num_kv_heads < self.world_size
    }

    /// The rows of q (its weight `(num_heads * head_dim, hidden)` and bias)
    /// this rank owns; also the input columns of o.
    pub fn q_rows(&self) -> Range<usize> {
        let d = self.config.head_dim;
        self.q_heads.start * d..self.q_heads.end * d
    }

    /// The rows of k and of v (`(num_kv_heads * head_dim, hidden)` each)
    /// this rank holds.
    pub fn kv_rows(&self) -> Range<usize> {
        let d = self.config.head_dim;
        self.kv_heads.start * d..self.kv_heads.end * d
    }

    /// The intermediate columns this rank owns: rows of gate and of up,
    /// input columns of down.
    pub fn intermediate(&self) -> Range<usize> {
        self.intermediate.clone()
    }

    /// The vocabulary rows this rank owns: rows of the embedding and of
    /// the LM head. `vocab_chunk()` long except, maybe, on the last rank.
    pub fn vocab(&self) -> Range<usize> {
        self.vocab.clone()
    }

    /// `ceil(vocab_size / world_size)`: the width every rank's logits are
    /// padded to before they are gathered (collectives take equal shapes).
    pub fn vocab_chunk(&self) -> usize {
        self.vocab_chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(h: usize, kvh: usize, inter: usize, vocab: usize) -> ShardConfig {
        ShardConfig {
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: 8,
            hidden_size: h * 8,
            intermediate_size: inter,
            vocab_size: vocab,
        }
    }

    fn msg(e: candle_core::Error) -> String {
        e.to_string().lines().next().unwrap_or_default().to_string()
    }

    /// Every query head, intermediate column and vocabulary row is owned
    /// by exactly one rank; each rank holds the KV heads its query heads
    /// read (GQA mapping), all of one size; shapes per rank are even.
    #[test]
    fn every_weight_is_covered_exactly_once() -> Result<()> {
        let configs = [
            config(8, 8, 48, 100),
            config(8, 2, 64, 128),
            config(8, 1, 96, 97),
            config(16, 4, 128, 1000),
            config(32, 8, 256, 32003),
            config(24, 8, 72, 77),
        ];
        let mut checked = 0;
        for c in &configs {
            for n in 1..=8 {
                let Ok(plans) = ShardPlan::all(c, n) else {
                    // Only sizes that do not divide are refused.
                    assert!(
                        !c.num_heads.is_multiple_of(n)
                            || !c.intermediate_size.is_multiple_of(n)
                            || (c.num_kv_heads >= n && !c.num_kv_heads.is_multiple_of(n))
                            || (c.num_kv_heads < n && !n.is_multiple_of(c.num_kv_heads)),
                        "{c:?} refused for world size {n}"
                    );
                    continue;
                };
                checked += 1;
                let mut q = vec![0usize; c.num_heads];
                let mut inter = vec![0usize; c.intermediate_size];
                let mut vocab = vec![0usize; c.vocab_size];
                let mut kv = vec![0usize; c.num_kv_heads];
                let group = c.num_heads / c.num_kv_heads;
                for (r, p) in plans.iter().enumerate() {
                    assert_eq!((p.rank(), p.world_size()), (r, n));
                    assert_eq!(p.q_heads().len(), c.num_heads / n);
                    assert_eq!(p.kv_heads().len(), (c.num_kv_heads / n).max(1));
                    assert_eq!(p.intermediate().len(), c.intermediate_size / n);
                    assert_eq!(p.q_rows().len(), p.q_heads().len() * c.head_dim);
                    assert_eq!(p.kv_rows().len(), p.kv_heads().len() * c.head_dim);
                    assert!(!p.vocab().is_empty() && p.vocab().len() <= p.vocab_chunk());
                    assert_eq!(p.kv_replicated(), c.num_kv_heads < n);
                    q[p.q_heads()].iter_mut().for_each(|x| *x += 1);
                    inter[p.intermediate()].iter_mut().for_each(|x| *x += 1);
                    vocab[p.vocab()].iter_mut().for_each(|x| *x += 1);
                    kv[p.kv_heads()].iter_mut().for_each(|x| *x += 1);
                    // GQA: local query head i reads local KV head
                    // i / (local q heads / local kv heads), the global one
                    // its global head reads.
                    let local_group = p.q_heads().len() / p.kv_heads().len();
                    for (i, head) in p.q_heads().enumerate() {
                        assert_eq!(p.kv_heads().start + i / local_group, head / group);
                    }
                }
                assert!(q.iter().all(|&x| x == 1), "{c:?} n={n}: q heads {q:?}");
                assert!(inter.iter().all(|&x| x == 1), "{c:?} n={n}: intermediate");
                assert!(vocab.iter().all(|&x| x == 1), "{c:?} n={n}: vocab");
                // KV heads: each held by one rank, or by n / kvh ranks.
                let copies = (n / c.num_kv_heads).max(1);
                assert!(kv.iter().all(|&x| x == copies), "{c:?} n={n}: kv {kv:?}");
            }
        }
        assert!(
            checked >= 20,
            "only {checked} (config, world size) pairs ran"
        );
        Ok(())
    }

    #[test]
    fn shapes_per_rank() -> Result<()> {
        // 8 heads, 2 KV heads over 4 ranks: two ranks per KV head.
        let plans = ShardPlan::all(&config(8, 2, 64, 130), 4)?;
        let kv: Vec<_> = plans.iter().map(|p| p.kv_heads()).collect();
        assert_eq!(kv, [0..1, 0..1, 1..2, 1..2]);
        let q: Vec<_> = plans.iter().map(|p| p.q_heads()).collect();
        assert_eq!(q, [0..2, 2..4, 4..6, 6..8]);
        let vocab: Vec<_> = plans.iter().map(|p| p.vocab()).collect();
        assert_eq!(vocab, [0..33, 33..66, 66..99, 99..130]);
        assert_eq!(plans[3].vocab_chunk(), 33);
        assert_eq!(plans[1].q_rows(), 16..32);
        assert_eq!(plans[2].kv_rows(), 8..16);
        assert_eq!(plans[3].intermediate(), 48..64);
        Ok(())
    }

    #[test]
    fn sizes_that_do_not_divide_are_refused_by_name() {
        let cases = [
            (
                config(8, 2, 64, 128),
                0,
                "world_size must be at least 1, got 0",
            ),
            (
                config(6, 2, 64, 128),
                4,
                "num_attention_heads 6 is not a multiple of world_size 4",
            ),
            (
                config(12, 6, 64, 128),
                4,
                "num_key_value_heads 6 is not a multiple of world_size 4",
            ),
            (
                config(24, 8, 64, 128),
                3,
                "num_key_value_heads 8 is not a multiple of world_size 3",
            ),
            (
                config(12, 4, 60, 128),
                8,
                "num_attention_heads 12 is not a multiple of world_size 8",
            ),
            (
                config(6, 2, 60, 128),
                3,
                "world_size 3 is not a multiple of num_key_value_heads 2",
            ),
            (
                config(8, 8, 60, 128),
                8,
                "intermediate_size 60 is not a multiple of world_size 8",
            ),
            (
                config(8, 3, 64, 128),
                2,
                "num_attention_heads 8 is not a multiple of num_key_value_heads 3",
            ),
            (
                config(8, 8, 64, 5),
                4,
                "vocab_size 5 is too small for world_size 4",
            ),
            (
                config(8, 0, 64, 128),
                2,
                "num_key_value_heads must be positive, got 0",
            ),
        ];
        for (c, n, want) in cases {
            let err = msg(ShardPlan::all(&c, n).unwrap_err());
            assert!(err.starts_with(&format!("{OP}: {want}")), "{err}");
        }
        let err = msg(ShardPlan::new(&config(8, 8, 64, 128), 2, 2).unwrap_err());
        assert_eq!(
            err,
            "tensor-parallel: rank 2 is out of range for world_size 2"
        );
    }
}
