//! Text generation over a paged model: sampling and a continuous-batching
//! engine (sequences join and leave the running batch between steps;
//! prompts are prefilled in chunks that fit a per-step token budget, mixed
//! with the decodes of the other sequences).

mod sampling;
mod scheduler;

pub use sampling::{Sampler, SamplingParams};
pub use scheduler::{
    Completion, Engine, EngineStats, FinishReason, Request, SchedulerConfig, TokenEvent,
};
