//! Tensor parallelism for the decoder stack (feature `models`):
//! Megatron-style sharding over the ranks of a group and the collectives
//! it needs.
//!
//! * [`ShardPlan`] - what each rank owns: query heads, KV heads
//!   (replicated when there are fewer than ranks), intermediate columns,
//!   vocabulary rows; a pure function of the shape, the world size and the
//!   rank.
//! * [`Communicator`] - all-reduce (sum) and all-gather, with abort and
//!   timeouts so that a failed rank fails the step for every rank instead
//!   of hanging it; [`LocalGroup`] is the in-process reference over
//!   threads (an NCCL implementation can slot in behind the same trait).

pub mod comm;
pub mod shard;

pub use comm::{Communicator, LocalGroup};
pub use shard::{ShardConfig, ShardPlan};
