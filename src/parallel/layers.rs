//! The layers that change under tensor parallelism: a row-parallel linear
//! (its input columns split, the partial outputs summed), the
//! vocabulary-parallel embedding and the vocabulary-parallel LM head
//! (logits gathered). Built whole, each is the plain layer and costs
//! nothing more; the column-parallel projections (q/k/v, gate/up) need no
//! layer of their own: a rank simply loads fewer output rows.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{bail, Result, Tensor};
use candle_nn::{Embedding, Linear, Module};

use super::comm::Communicator;

const OP: &str = "tensor-parallel";

/// `t`'s `range` along `dim`, contiguous (a rank's own copy of its shard).
pub(crate) fn narrow_range(t: &Tensor, dim: usize, range: &Range<usize>) -> Result<Tensor> {
    let size = t.dim(dim)?;
    if range.start > range.end || range.end > size {
        bail!(
            "{OP}: shard {range:?} of dimension {dim} is out of range for shape {:?}",
            t.dims()
        );
    }
    t.narrow(dim, range.start, range.len())?.contiguous()
}

/// A linear layer `(out, in)` whose input columns are split over the ranks
/// (o_proj, down_proj): each rank multiplies its columns, the partial
/// outputs are summed over the ranks, then the bias is added once.
#[derive(Clone, Debug)]
pub(crate) struct RowParallelLinear {
    /// The whole layer (bias included), or this rank's columns without
    /// the bias.
    linear: Linear,
    /// The group and the bias added after the sum.
    group: Option<(Arc<dyn Communicator>, Option<Tensor>)>,
}

impl RowParallelLinear {
    /// The whole layer on one rank: `forward` is `linear`'s.
    pub(crate) fn whole(linear: Linear) -> Self {
        Self {
            linear,
            group: None,
        }
    }

    /// This rank's input columns `cols` of `linear` (weight `(out, in)`,
    /// bias `(out,)`), summed over `comm`'s group.
    pub(crate) fn shard(
        linear: &Linear,
        cols: &Range<usize>,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let weight = narrow_range(linear.weight(), 1, cols)?;
        Ok(Self {
            linear: Linear::new(weight, None),
            group: Some((comm, linear.bias().cloned())),
        })
    }
}

impl Module for RowParallelLinear {
    /// `x` `(num_tokens, in / world_size)` (`in` whole) -> `(num_tokens, out)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = crate::ops::linear::linear(x, self.linear.weight(), self.linear.bias())?;
        let Some((comm, bias)) = &self.group else {
            return Ok(y);
        };
        let y = comm.all_reduce_sum(&y)?;
        match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// A token embedding whose vocabulary rows are split over the ranks: a
/// rank looks up the ids in its rows (zeros for the others), and the sum
/// over the ranks is the whole lookup (exactly: one rank adds each row to
/// zeros).
#[derive(Clone, Debug)]
pub(crate) struct VocabParallelEmbedding {
    /// The whole table, or this rank's rows.
    embedding: Embedding,
    /// The first row and the group.
    group: Option<(u32, Arc<dyn Communicator>)>,
}

impl VocabParallelEmbedding {
    /// The whole table on one rank.
    pub(crate) fn whole(embedding: Embedding) -> Self {
        Self {
            embedding,
            group: None,
        }
    }

    /// This rank's rows `rows` of the table `(vocab, hidden)`.
    pub(crate) fn shard(
        table: &Tensor,
        rows: &Range<usize>,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let hidden = table.dim(1)?;
        let Ok(start) = u32::try_from(rows.start) else {
            bail!("{OP}: vocabulary row {} does not fit u32", rows.start);
        };
        Ok(Self {
            embedding: Embedding::new(narrow_range(table, 0, rows)?, hidden),
            group: Some((start, comm)),
        })
    }

    /// This rank's rows of the table, `(rows, hidden)`.
    pub(crate) fn table(&self) -> &Tensor {
        self.embedding.embeddings()
    }
}

impl Module for VocabParallelEmbedding {
    /// `ids` `(num_tokens,)` u32 (each `< vocab`) -> `(num_tokens, hidden)`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let Some((start, comm)) = &self.group else {
            return self.embedding.forward(ids);
        };
        let table = self.embedding.embeddings();
        let (len, dev) = (table.dim(0)? as u32, ids.device());
        let first = Tensor::full(*start, ids.shape(), dev)?;
        let end = Tensor::full(*start + len, ids.shape(), dev)?;
        let mine = ids.ge(&first)?.mul(&ids.lt(&end)?)?;
        // Ids of other ranks look up row 0 and are then zeroed.
        let local = (mine.where_cond(ids, &first)? - &first)?;
        let rows = self.embedding.forward(&local)?;
        let mine = mine
            .unsqueeze(1)?
            .broadcast_as(rows.shape())?
            .contiguous()?;
        let rows = mine.where_cond(&rows, &rows.zeros_like()?)?;
        comm.all_reduce_sum(&rows)
    }
}

/// An LM head whose vocabulary rows are split over the ranks: each rank
/// computes the logits of its rows, padded to `chunk` columns, and the
/// ranks gather them; every rank ends with the whole logits.
#[derive(Clone, Debug)]
pub(crate) struct VocabParallelHead {
    /// The whole head, or this rank's rows.
    linear: Linear,
    /// `chunk` (every rank's padded width), the vocabulary and the group.
    group: Option<(usize, usize, Arc<dyn Communicator>)>,
}

impl VocabParallelHead {
    /// The whole head on one rank.
    pub(crate) fn whole(linear: Linear) -> Self {
        Self {
            linear,
            group: None,
        }
    }

    /// This rank's rows of the head: `weight` `(rows, hidden)` already
    /// holds only them; `chunk` is every rank's padded width and `vocab`
    /// the whole vocabulary.
    pub(crate) fn shard(
        weight: Tensor,
        chunk: usize,
        vocab: usize,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let rows = weight.dim(0)?;
        if rows > chunk || chunk * comm.world_size() < vocab {
            bail!(
                "{OP}: an LM head shard of {rows} rows does not fit chunks of {chunk} over {} ranks for a vocabulary of {vocab}",
                comm.world_size()
            );
        }
        Ok(Self {
            linear: Linear::new(weight, None),
            group: Some((chunk, vocab, comm)),
        })
    }
}

impl Module for VocabParallelHead {
    /// `x` `(rows, hidden)` -> `(rows, vocab)`, in x's dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = crate::ops::linear::linear(x, self.linear.weight(), self.linear.bias())?;
        let Some((chunk, vocab, comm)) = &self.group else {
            return Ok(y);
        };
        let y = y.pad_with_zeros(1, 0, chunk - y.dim(1)?)?;
        comm.all_gather(&y, 1)?.narrow(1, 0, *vocab)
    }
}
