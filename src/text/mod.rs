//! Text in and out of a model (feature `models`): tokenizers, chat
//! templates and the files of a checkpoint. Nothing here knows a model or
//! the engine: the model zoo's loaders ([`crate::models::load`]) and the
//! server use these modules, not the other way round.
//!
//! * [`tokenizer`] - tokenizers from the checkpoint: GGUF GPT-2 BPE and
//!   SentencePiece vocabularies, `tokenizer.json`; special tokens.
//! * [`chat`] - the checkpoint's chat template, rendered with `minijinja`.
//! * [`hub`] - which files of a checkpoint to load (a GGUF file, or a
//!   safetensors directory and its shards), from a local folder, the Hugging
//!   Face hub cache or, with the `hub` feature, a download.
//! * [`fetch`] - the offline fetch scripts (`scripts/fetch-*.sh`): finding
//!   and running them.

pub mod chat;
pub mod fetch;
pub mod hub;
pub mod tokenizer;
