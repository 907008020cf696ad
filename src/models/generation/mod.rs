//! Text generation over a paged model: sampling and a continuous-batching
//! engine (sequences join and leave the running batch between steps;
//! prompts are prefilled in chunks that fit a per-step token budget, mixed
//! with the decodes of the other sequences).

mod buckets;
#[cfg(feature = "cuda")]
mod graphs;
mod sampling;
mod scheduler;

pub use buckets::{decode_bucket, decode_split_plan_keys, BATCH_BUCKETS, MIN_TABLE_WIDTH};
#[cfg(feature = "cuda")]
pub use graphs::{DecodeGraphs, GraphStats};

pub use sampling::{Sampler, SamplingParams};
pub use scheduler::{
    Completion, Engine, EngineStats, FinishReason, Request, SchedulerConfig, TokenEvent,
};
