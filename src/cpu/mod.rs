//! The CPU path: the reference implementation of both ops (every feature,
//! f32 accumulation), parallel over independent pieces of work.

pub(crate) mod elem;
pub(crate) mod paged_attention;
pub(crate) mod reshape_and_cache;
