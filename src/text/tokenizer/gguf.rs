//! The vocabulary of a GGUF file's `tokenizer.ggml.*` metadata.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{bail, Result};
use tokenizers::AddedToken;

use super::OP;

/// Token types of `tokenizer.ggml.token_type` (llama.cpp's, which are
/// SentencePiece's piece types).
pub(super) mod token_type {
    /// An ordinary piece.
    pub const NORMAL: i32 = 1;
    /// The unknown-token piece.
    pub const UNKNOWN: i32 = 2;
    /// A control token (`<bos>`, `<|im_start|>`): never produced from text
    /// by the model, matched whole where its text is written.
    pub const CONTROL: i32 = 3;
    /// A user-defined piece (Gemma's newline and space runs): matched whole.
    pub const USER_DEFINED: i32 = 4;
    /// A byte piece `<0xNN>` of SentencePiece's byte fallback.
    pub const BYTE: i32 = 6;
}

/// The metadata value at `key`, or an error naming the key.
pub(super) fn required<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a Value> {
    match ct.metadata.get(key) {
        Some(v) => Ok(v),
        None => bail!("{OP}: GGUF metadata has no {key}"),
    }
}

/// The string at `key`, if present (an error when it is not a string).
pub(super) fn string<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<Option<&'a str>> {
    match ct.metadata.get(key) {
        None => Ok(None),
        Some(v) => match v.to_string() {
            Ok(s) => Ok(Some(s.as_str())),
            Err(_) => bail!("{OP}: GGUF metadata {key} is not a string: {v:?}"),
        },
    }
}

/// The boolean at `key`, if present.
pub(super) fn boolean(ct: &gguf_file::Content, key: &str) -> Result<Option<bool>> {
    match ct.metadata.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => bail!("{OP}: GGUF metadata {key} is not a boolean: {v:?}"),
    }
}

/// The token id at `key`, if present, checked against the vocabulary size.
pub(super) fn token_id(ct: &gguf_file::Content, key: &str, vocab: usize) -> Result<Option<u32>> {
    let Some(v) = ct.metadata.get(key) else {
        return Ok(None);
    };
    let id = match v {
        Value::I32(i) if *i < 0 => return Ok(None), // llama.cpp writes -1 for "none"
        Value::I64(i) if *i < 0 => return Ok(None),
        _ => v.to_u32().or_else(|_| {
            v.to_i32()
                .ok()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| {
                    candle_core::Error::msg(format!(
                        "{OP}: GGUF metadata {key} is not a token id: {v:?}"
                    ))
                })
        })?,
    };
    if id as usize >= vocab {
        bail!("{OP}: GGUF metadata {key} = {id} is outside the vocabulary of {vocab} tokens");
    }
    Ok(Some(id))
}

/// The vocabulary arrays of the metadata.
pub(super) struct GgufVocab {
    /// `tokenizer.ggml.tokens`, by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, by id (all [`token_type::NORMAL`] when absent).
    pub types: Vec<i32>,
}

impl GgufVocab {
    /// Reads `tokens` and `token_type`; fails when their lengths differ or a
    /// token is written twice (two ids for one text cannot round-trip).
    pub fn read(ct: &gguf_file::Content) -> Result<Self> {
        let tokens = required(ct, "tokenizer.ggml.tokens")?
            .to_vec()?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<Vec<String>>>()?;
        let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<Result<_>>()?,
            None => vec![token_type::NORMAL; tokens.len()],
        };
        if types.len() != tokens.len() {
            bail!(
                "{OP}: GGUF metadata has {} tokens but {} token types",
                tokens.len(),
                types.len()
            );
        }
        let mut seen = std::collections::HashMap::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            if let Some(first) = seen.insert(t.as_str(), id) {
                bail!("{OP}: GGUF token {t:?} is written twice, as ids {first} and {id}");
            }
        }
        Ok(Self { tokens, types })
    }

    /// The control and unknown tokens as special added tokens (matched whole
    /// in raw text, skipped when decoding), and the user-defined ones as
    /// plain added tokens (matched whole in raw text, decoded as text).
    pub fn added_tokens(&self) -> (Vec<AddedToken>, Vec<AddedToken>) {
        let mut special = Vec::new();
        let mut user = Vec::new();
        for (tok, &ty) in self.tokens.iter().zip(&self.types) {
            if tok.is_empty() {
                continue; // nothing to match in text
            }
            let added = |special: bool| AddedToken::from(tok.clone(), special).normalized(false);
            match ty {
                token_type::CONTROL | token_type::UNKNOWN => special.push(added(true)),
                token_type::USER_DEFINED => user.push(added(false)),
                _ => {}
            }
        }
        (special, user)
    }
}
