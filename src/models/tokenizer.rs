//! Tokenizers for the models: a byte-level BPE built from GGUF metadata,
//! encoding and decoding, and incremental detokenisation for streaming.
//! Prompt templates live in [`super::chat`].

use candle_core::quantized::gguf_file;
use candle_core::{bail, Error, Result};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

const OP: &str = "tokenizer";

/// Builds the tokenizer described by GGUF metadata: `tokenizer.ggml.model`
/// `gpt2` (byte-level BPE: `tokens`, `merges`, control tokens from
/// `token_type` as special tokens). The pre-tokenizer follows
/// `tokenizer.ggml.pre`: `smollm`/`starcoder` split digits one by one before
/// the GPT-2 regex; other values use the GPT-2 regex alone.
pub fn tokenizer_from_gguf(ct: &gguf_file::Content) -> Result<Tokenizer> {
    let md = |key: &str| match ct.metadata.get(key) {
        Some(v) => Ok(v),
        None => bail!("{OP}: GGUF metadata has no {key}"),
    };
    let model = md("tokenizer.ggml.model")?.to_string()?;
    if model != "gpt2" {
        bail!("{OP}: only byte-level BPE (tokenizer.ggml.model = gpt2) GGUF tokenizers are supported, got {model}; pass a tokenizer.json instead");
    }
    let tokens = md("tokenizer.ggml.tokens")?
        .to_vec()?
        .iter()
        .map(|v| v.to_string().cloned())
        .collect::<Result<Vec<String>>>()?;
    let merges = md("tokenizer.ggml.merges")?
        .to_vec()?
        .iter()
        .map(|v| {
            let m = v.to_string()?;
            match m.split_once(' ') {
                Some((a, b)) => Ok(json!([a, b])),
                None => bail!("{OP}: merge {m:?} is not two space-separated tokens"),
            }
        })
        .collect::<Result<Vec<Value>>>()?;
    let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()?
            .iter()
            .map(|t| t.to_i32())
            .collect::<Result<_>>()?,
        None => vec![1; tokens.len()],
    };
    let pre = ct
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
        .unwrap_or("gpt2");
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), json!(id));
        // 3: control, 4: user-defined tokens: matched whole, never split.
        if matches!(types.get(id), Some(3) | Some(4)) {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": types[id] == 3,
            }));
        }
    }
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let pre_tokenizer = if matches!(pre, "smollm" | "starcoder" | "refact") {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level
        ]})
    } else {
        byte_level
    };
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    spec.to_string().parse::<Tokenizer>().map_err(|e| {
        Error::msg(format!(
            "{OP}: building the BPE tokenizer from GGUF metadata: {e}"
        ))
    })
}

/// The end-of-sequence token id of a GGUF file (`tokenizer.ggml.eos_token_id`).
pub fn gguf_eos_token(ct: &gguf_file::Content) -> Option<u32> {
    ct.metadata
        .get("tokenizer.ggml.eos_token_id")
        .and_then(|v| v.to_u32().ok())
}

/// The id of `token` in `tokenizer`'s vocabulary (special tokens included).
pub fn token_id(tokenizer: &Tokenizer, token: &str) -> Option<u32> {
    tokenizer.token_to_id(token)
}

/// Encodes `text` without adding special tokens; the text may contain
/// special tokens such as `<|im_start|>`, which map to their ids.
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tokenizer
        .encode(text, false)
        .map_err(|e| Error::msg(format!("{OP}: encoding {} chars: {e}", text.len())))?;
    Ok(enc.get_ids().to_vec())
}

/// Decodes `ids`, dropping special tokens. Fails on an id the tokenizer
/// does not know (instead of dropping it silently).
pub fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
    if let Some((pos, id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| tokenizer.id_to_token(id).is_none())
    {
        bail!(
            "{OP}: token id {id} at position {pos} is not in the vocabulary of {} tokens",
            tokenizer.get_vocab_size(true)
        );
    }
    tokenizer
        .decode(ids, true)
        .map_err(|e| Error::msg(format!("{OP}: decoding {} tokens: {e}", ids.len())))
}

/// Incremental detokenisation: feeds tokens one by one and yields the text
/// that became final (byte-level BPE tokens may end inside a UTF-8
/// character, whose text waits for the next token). Call
/// [`finish`](Self::finish) at the end of the stream for what is left.
#[derive(Debug, Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    emitted: usize,
}

impl TextStream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `token` and returns the new text, if any is complete.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        let text = decode(tokenizer, &self.tokens)?;
        if text.ends_with('\u{fffd}') {
            return Ok(None);
        }
        match text.get(self.emitted..) {
            Some(new) if !new.is_empty() => {
                let new = new.to_string();
                self.emitted = text.len();
                Ok(Some(new))
            }
            _ => Ok(None),
        }
    }

    /// Ends the stream: returns the text not emitted yet, if any. A trailing
    /// incomplete UTF-8 character (the tokens stopped inside it) comes out
    /// as U+FFFD, as [`decode`] gives it.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>> {
        let text = decode(tokenizer, &self.tokens)?;
        match text.get(self.emitted..) {
            Some(new) if !new.is_empty() => {
                let new = new.to_string();
                self.emitted = text.len();
                Ok(Some(new))
            }
            _ => Ok(None),
        }
    }

    /// The text of all tokens so far.
    pub fn text(&self, tokenizer: &Tokenizer) -> Result<String> {
        decode(tokenizer, &self.tokens)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};

    use super::*;

    fn strings(items: &[&str]) -> Value {
        Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
    }

    /// A GGUF header with a ten-token byte-level BPE vocabulary; tokens 8
    /// and 9 are the bytes 0xC3 and 0xA9 ("é" in UTF-8).
    fn tiny_gguf() -> Content {
        let metadata = HashMap::from([
            (
                "tokenizer.ggml.model".to_string(),
                Value::String("gpt2".into()),
            ),
            (
                "tokenizer.ggml.pre".to_string(),
                Value::String("smollm".into()),
            ),
            (
                "tokenizer.ggml.tokens".to_string(),
                strings(&[
                    "<|im_start|>",
                    "a",
                    "b",
                    "ab",
                    "Ġ",
                    "Ġab",
                    "1",
                    "2",
                    "Ã",
                    "©",
                ]),
            ),
            (
                "tokenizer.ggml.merges".to_string(),
                strings(&["a b", "Ġ ab"]),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::Array([3, 1, 1, 1, 1, 1, 1, 1, 1, 1].map(Value::I32).to_vec()),
            ),
            ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(0)),
        ]);
        Content {
            magic: VersionedMagic::GgufV3,
            metadata,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn gguf_bpe_merges_and_special_tokens() {
        let ct = tiny_gguf();
        let tok = tokenizer_from_gguf(&ct).unwrap();
        assert_eq!(encode(&tok, "<|im_start|>ab ab").unwrap(), [0, 3, 5]);
        // SmolLM's pre-tokenizer splits digits one by one.
        assert_eq!(encode(&tok, "12").unwrap(), [6, 7]);
        assert_eq!(decode(&tok, &[0, 3, 5]).unwrap(), "ab ab");
        assert_eq!(gguf_eos_token(&ct), Some(0));
    }

    #[test]
    fn rejects_sentencepiece_gguf() {
        let mut ct = tiny_gguf();
        ct.metadata.insert(
            "tokenizer.ggml.model".to_string(),
            Value::String("llama".into()),
        );
        let err = tokenizer_from_gguf(&ct).unwrap_err().to_string();
        assert!(err.contains("got llama"), "{err}");
    }

    #[test]
    fn text_stream_emits_complete_text() {
        let tok = tokenizer_from_gguf(&tiny_gguf()).unwrap();
        let mut stream = TextStream::new();
        assert_eq!(stream.push(&tok, 3).unwrap().as_deref(), Some("ab"));
        assert_eq!(stream.push(&tok, 5).unwrap().as_deref(), Some(" ab"));
        assert_eq!(stream.text(&tok).unwrap(), "ab ab");
    }

    #[test]
    fn decode_refuses_unknown_ids() {
        let tok = tokenizer_from_gguf(&tiny_gguf()).unwrap();
        let err = decode(&tok, &[1, 10]).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "tokenizer: token id 10 at position 1 is not in the vocabulary of 10 tokens"
            ),
            "{err}"
        );
        let err = decode(&tok, &[u32::MAX]).unwrap_err().to_string();
        assert!(
            err.starts_with("tokenizer: token id 4294967295 at position 0"),
            "{err}"
        );
        let mut stream = TextStream::new();
        assert!(stream.push(&tok, 12).is_err());
    }

    #[test]
    fn text_stream_waits_for_a_whole_character_and_finish_flushes() {
        let tok = tokenizer_from_gguf(&tiny_gguf()).unwrap();
        assert_eq!(decode(&tok, &[8, 9]).unwrap(), "\u{e9}");
        let mut stream = TextStream::new();
        assert_eq!(stream.push(&tok, 1).unwrap().as_deref(), Some("a"));
        // 0xC3 alone is half of a character: nothing yet.
        assert_eq!(stream.push(&tok, 8).unwrap(), None);
        assert_eq!(stream.push(&tok, 9).unwrap().as_deref(), Some("\u{e9}"));
        assert_eq!(stream.finish(&tok).unwrap(), None);
        // A stream that ends inside a character flushes it as U+FFFD.
        let mut stream = TextStream::new();
        assert_eq!(stream.push(&tok, 3).unwrap().as_deref(), Some("ab"));
        assert_eq!(stream.push(&tok, 8).unwrap(), None);
        assert_eq!(stream.finish(&tok).unwrap().as_deref(), Some("\u{fffd}"));
        assert_eq!(stream.finish(&tok).unwrap(), None);
        assert_eq!(stream.text(&tok).unwrap(), "ab\u{fffd}");
    }
}
