//! KV caches and their bookkeeping.
//!
//! * [`LayerKvCache`]: one layer's key and value caches,
//!   `(num_blocks, block_size, num_kv_heads, head_size)`, and
//!   [`num_blocks_for_budget`] to size them from a memory budget.
//! * [`BlockManager`]: which blocks each sequence owns. It admits sequences,
//!   allocates blocks as prefill chunks and decodes are scheduled (with
//!   prefix caching, a prefill first takes the cached blocks of its prompt,
//!   including those another sequence computes in the same batch, and
//!   counts the tokens it reuses), recycles blocks that
//!   fell out of a sliding window, frees them when a sequence finishes, and
//!   builds the [`AttentionMetadata`](crate::AttentionMetadata) of each
//!   scheduled batch.
//!
//! [`BlockManager`] keeps what every attention kind shares (sequences,
//! tokens, the undo log of the last batch) and drives one manager per kind
//! (`kind`): full attention with prefix caching, and each sliding-window
//! group.
//!
//! Imports `batch`, `metadata`, `remap`, `ops` (a storage identity helper)
//! and `cuda` (free device memory); must not import `attention`, `params`,
//! the CPU backend or `models`.

mod kind;
mod layer;
mod manager;
mod pool;
mod prefix;

pub use layer::{num_blocks_for_budget, LayerKvCache};
pub use manager::{BlockManager, BlockManagerConfig, ScheduledBatch, WindowGroupConfig, Work};
