//! [`TensorParallel`]: the ranks of a tensor-parallel decoder as one
//! [`PagedModel`], run in lockstep on threads of this process.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use super::comm::{Communicator, LocalGroup};
use crate::attention::Attention;
use crate::cache::LayerKvCache;
use crate::metadata::AttentionMetadata;
use crate::models::decoder::{DecoderSpec, DecoderStack};
use crate::models::{PagedKvCache, PagedModel, PagedOptions};

const OP: &str = "tensor-parallel";

/// A decoder sharded over `world_size` ranks ([`DecoderStack::load_shard`]),
/// driven as one [`PagedModel`]: each forward pass runs every rank on its
/// own thread (rank 0 on the caller's) with the same batch, metadata and
/// rows, the ranks meeting in their [`Communicator`]s' collectives, and
/// returns rank 0's logits. The LM head is vocabulary-parallel and its
/// logits are gathered, so every rank holds the whole logits; rank 0's are
/// returned.
///
/// **The cache.** [`attention_layers`](PagedModel::attention_layers) lists
/// every rank's layers, rank by rank (`world_size * num_layers` of them,
/// each with its rank's KV heads), so that a [`PagedKvCache`] built from
/// them holds every rank's caches with one block layout: one block manager
/// and one scheduler (the engine's) drive all ranks, and block `b` of a
/// sequence is block `b` of every rank's cache. Rank `r` reads and writes
/// layers `r * num_layers .. (r + 1) * num_layers`. The cache lives on one
/// device (the CPU reference runs every rank there).
///
/// **Failures.** A rank whose forward pass fails (or panics) aborts the
/// group: the ranks waiting in a collective return at once, and the step
/// fails for every rank with the group's [`failure`](Communicator::failure)
/// (the failing rank and its error); a rank that never reaches a
/// collective fails the others after the communicator's timeout. The group is then reset, and the caller (the
/// [`Engine`](crate::engine::Engine) rolls the step back) may run the step
/// again. A step never hangs.
#[derive(Debug)]
pub struct TensorParallel {
    ranks: Vec<DecoderStack>,
    comms: Vec<Arc<dyn Communicator>>,
}

impl TensorParallel {
    /// Loads `spec` sharded over the ranks of `comms` (one communicator per
    /// rank, in rank order, all of one group).
    ///
    /// # Arguments
    /// * `vbs` - the full checkpoint of rank `r` is `vbs[r]` (its device and
    ///   dtype), or `vbs[0]` for every rank when it holds one.
    /// * `spec` - the decoder (see each family's `spec`, e.g.
    ///   [`llama::spec`](crate::models::llama::spec)).
    /// * `options` - paging options of every rank's attention layers.
    /// * `comms` - rank `r`'s communicator is `comms[r]`.
    pub fn load(
        vbs: &[VarBuilder],
        spec: &DecoderSpec,
        options: PagedOptions,
        comms: Vec<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        let n = comms.len();
        if n == 0 {
            bail!("{OP}: no communicator: a group needs at least one rank");
        }
        if vbs.len() != 1 && vbs.len() != n {
            bail!(
                "{OP}: {} weight sources for {n} ranks (give one, or one per rank)",
                vbs.len()
            );
        }
        for (r, c) in comms.iter().enumerate() {
            if c.rank() != r || c.world_size() != n {
                bail!(
                    "{OP}: communicator {r} is rank {} of {}, expected rank {r} of {n}",
                    c.rank(),
                    c.world_size()
                );
            }
        }
        let ranks = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let vb = vbs.get(r).unwrap_or(&vbs[0]).clone();
                DecoderStack::load_shard(vb, spec, options, c.clone())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { ranks, comms })
    }

    /// [`load`](Self::load) over a new [`LocalGroup`] of `world_size` ranks
    /// (collective timeout [`LocalGroup::DEFAULT_TIMEOUT`]), every rank
    /// reading `vb`.
    pub fn local(
        vb: VarBuilder,
        spec: &DecoderSpec,
        options: PagedOptions,
        world_size: usize,
    ) -> Result<Self> {
        let comms = LocalGroup::new(world_size, LocalGroup::DEFAULT_TIMEOUT)?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        Self::load(&[vb], spec, options, comms)
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s shard of the decoder, if `r < world_size()`.
    pub fn rank(&self, r: usize) -> Option<&DecoderStack> {
        self.ranks.get(r)
    }

    /// Decoder layers of each rank.
    fn num_layers(&self) -> usize {
        self.ranks.first().map_or(0, DecoderStack::num_layers)
    }

    /// Runs rank `r`'s forward pass; on failure records the step's first
    /// failure (when it is the first) and aborts the group.
    fn run_rank(
        &self,
        r: usize,
        step: &Step<'_>,
        first_failure: &Mutex<Option<(usize, String)>>,
    ) -> Result<Tensor> {
        let caches = &step.caches[r * self.num_layers()..(r + 1) * self.num_layers()];
        let out = catch_unwind(AssertUnwindSafe(|| {
            self.ranks[r].forward_layers(step.input_ids, step.metadata, caches, step.rows)
        }))
        .unwrap_or_else(|panic| bail!("panicked: {}", panic_message(&*panic)));
        if let Err(e) = &out {
            // A collective's error already names the op and the rank.
            let msg = first_line(e);
            let own = format!("{OP}: rank {r}: ");
            let msg = msg.strip_prefix(&own).map_or(msg.clone(), str::to_string);
            if let Ok(mut first) = first_failure.lock() {
                first.get_or_insert((r, msg.clone()));
            }
            self.comms[r].abort(&format!("rank {r} failed: {msg}"));
        }
        out
    }
}

/// One forward pass's inputs, shared by the ranks.
struct Step<'a> {
    input_ids: &'a Tensor,
    metadata: &'a AttentionMetadata,
    caches: &'a [LayerKvCache],
    rows: &'a [usize],
}

/// The first line of an error (candle appends a backtrace when
/// `RUST_BACKTRACE` is set).
fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

impl PagedModel for TensorParallel {
    /// Every rank's attention layers, rank by rank (see the type's docs).
    fn attention_layers(&self) -> Vec<&Attention> {
        self.ranks
            .iter()
            .flat_map(|r| r.attention_layers())
            .collect()
    }

    fn vocab_size(&self) -> usize {
        self.ranks[0].vocab_size()
    }

    fn max_seq_len(&self) -> usize {
        self.ranks[0].max_seq_len()
    }

    /// Rank 0's device.
    fn device(&self) -> &Device {
        self.ranks[0].device()
    }

    fn dtype(&self) -> DType {
        self.ranks[0].dtype()
    }

    /// Runs every rank on the batch in lockstep and returns rank 0's
    /// logits `(rows.len(), vocab_size)` f32. `cache` holds every rank's
    /// layers, as built from [`attention_layers`](PagedModel::attention_layers).
    fn forward(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> Result<Tensor> {
        let (n, layers) = (self.world_size(), self.num_layers());
        if cache.num_layers() != n * layers {
            bail!(
                "{OP}: the cache has {} layers but {n} ranks of {layers} layers need {}",
                cache.num_layers(),
                n * layers
            );
        }
        let step = Step {
            input_ids,
            metadata,
            caches: cache.layers(),
            rows,
        };
        let first_failure = Mutex::new(None);
        let results: Vec<Result<Tensor>> = std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(n - 1);
            for r in 1..n {
                let (step, first_failure) = (&step, &first_failure);
                let spawned = std::thread::Builder::new()
                    .name(format!("tp-rank-{r}"))
                    .spawn_scoped(s, move || self.run_rank(r, step, first_failure));
                match spawned {
                    Ok(h) => handles.push(Ok(h)),
                    Err(e) => {
                        let msg = format!("rank {r} failed: its thread did not start: {e}");
                        if let Ok(mut first) = first_failure.lock() {
                            first.get_or_insert((r, msg.clone()));
                        }
                        self.comms[r].abort(&msg);
                        handles.push(Err(candle_core::Error::msg(msg)));
                    }
                }
            }
            let mut results = vec![self.run_rank(0, &step, &first_failure)];
            for h in handles {
                results.push(h.and_then(|h| {
                    h.join()
                        .unwrap_or_else(|p| bail!("panicked: {}", panic_message(&*p)))
                }));
            }
            results
        });
        if results.iter().all(Result::is_ok) {
            let mut results = results;
            return results.swap_remove(0);
        }
        // The group's first failure is the cause (the others' errors follow
        // from it); else the first rank that failed.
        let reason = self.comms.iter().find_map(|c| c.failure()).or_else(|| {
            let first = first_failure.into_inner().ok().flatten();
            first.map(|(r, msg)| format!("rank {r} failed: {msg}"))
        });
        // Every rank has returned: clear the failed step's collectives.
        for c in &self.comms {
            c.reset()?;
        }
        let reason = reason.unwrap_or_else(|| "an unknown failure".to_string());
        bail!("{OP}: the step failed on every rank of {n}: {reason}")
    }
}
