//! Tokenizers from the checkpoint, encoding and decoding, and incremental
//! detokenisation for streaming.
//!
//! * GGUF files: [`tokenizer_from_gguf`] builds a `tokenizers::Tokenizer`
//!   from the `tokenizer.ggml.*` metadata: GPT-2 byte-level BPE
//!   (`tokenizer.ggml.model = gpt2`, SmolLM2, Llama 3) with the
//!   pre-tokenizer named by `tokenizer.ggml.pre`, or SentencePiece BPE
//!   (`llama`, Llama 2, Gemma) with scores, byte fallback and `▁` spaces.
//!   Control tokens become special tokens, user-defined ones added tokens.
//! * Directories: `tokenizer.json`, with `tokenizer_config.json`,
//!   `generation_config.json` and `config.json` for the special tokens and
//!   the chat template ([`ModelTokenizer::from_dir`]).
//! * [`ModelTokenizer`] bundles the tokenizer with its [`SpecialTokens`]
//!   (BOS/EOS, whether BOS is added, the ids that end generation) and its
//!   chat template source, and encodes prompts: raw text with control-token
//!   markers parsed, or a rendered chat template whose message text is
//!   encoded as plain text ([`ModelTokenizer::encode_segments`]).
//!
//! Prompt templates are rendered by [`super::chat`].

mod bpe;
mod dir;
mod gguf;
mod sentencepiece;

use candle_core::quantized::gguf_file;
use candle_core::{bail, Error, Result};
use tokenizers::Tokenizer;

use super::chat::PromptSegment;

const OP: &str = "tokenizer";

/// Builds the tokenizer described by GGUF metadata (`tokenizer.ggml.*`):
///
/// * `model = gpt2`: byte-level BPE from `tokens` and `merges`; the
///   pre-tokenizer follows `pre`: absent, `default` or `gpt2` - the GPT-2
///   regex; `smollm` - each digit alone, then the GPT-2 regex; `llama-bpe` -
///   Llama 3's regex. Another `pre` is an error naming it.
/// * `model = llama`: SentencePiece BPE from `tokens`, `scores` and
///   `token_type` with byte fallback (`<0xNN>`), spaces written `▁`, and a
///   leading `▁` when `add_space_prefix` (default true); `pre` must be
///   absent or `default`.
///
/// Control (and unknown) tokens of `token_type` are special tokens: matched
/// whole where their text is written, skipped by [`decode`]; user-defined
/// tokens are matched whole and decoded as text. BOS/EOS are not added
/// here: see [`ModelTokenizer`].
pub fn tokenizer_from_gguf(ct: &gguf_file::Content) -> Result<Tokenizer> {
    let model = gguf::required(ct, "tokenizer.ggml.model")?.to_string()?;
    let vocab = gguf::GgufVocab::read(ct)?;
    match model.as_str() {
        "gpt2" => bpe::tokenizer(ct, &vocab),
        "llama" => sentencepiece::tokenizer(ct, &vocab),
        m => bail!("{OP}: GGUF tokenizer.ggml.model = {m:?} is not supported (supported: gpt2, llama); pass a tokenizer.json instead"),
    }
}

/// The end-of-sequence token id of a GGUF file (`tokenizer.ggml.eos_token_id`).
pub fn gguf_eos_token(ct: &gguf_file::Content) -> Option<u32> {
    ct.metadata
        .get("tokenizer.ggml.eos_token_id")
        .and_then(|v| v.to_u32().ok())
}

/// Control tokens that end a turn in the chat formats of the supported
/// families; those in a vocabulary join its stop tokens.
const END_OF_TURN: [&str; 8] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<eos>",
    "</s>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
];

/// The token ids a checkpoint gives special meaning.
///
/// * `bos`, `eos` - the beginning- and end-of-sequence tokens.
/// * `add_bos`, `add_eos` - whether an encoded raw prompt starts with BOS
///   and ends with EOS (GGUF `tokenizer.ggml.add_bos_token`, default true
///   for SentencePiece and false for GPT-2 BPE; `tokenizer_config.json`'s
///   `add_bos_token`, or what `tokenizer.json`'s post-processor adds).
/// * `stop` - the ids that end generation, sorted: EOS, GGUF's `eot`/`eom`
///   tokens, `generation_config.json`'s `eos_token_id`s, and the
///   end-of-turn control tokens the vocabulary has (`<|im_end|>`,
///   `<end_of_turn>`, `<|eot_id|>`, ...).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence.
    pub eos: Option<u32>,
    /// A raw prompt starts with BOS.
    pub add_bos: bool,
    /// A raw prompt ends with EOS.
    pub add_eos: bool,
    /// Tokens that end generation, sorted and unique.
    pub stop: Vec<u32>,
}

impl SpecialTokens {
    /// Adds `ids` and the [`END_OF_TURN`] control tokens of `tokenizer` to
    /// the stop tokens.
    fn collect_stop(&mut self, tokenizer: &Tokenizer, ids: impl IntoIterator<Item = u32>) {
        self.stop.extend(self.eos);
        self.stop.extend(ids);
        let added = tokenizer.get_added_tokens_decoder();
        self.stop.extend(END_OF_TURN.iter().filter_map(|t| {
            tokenizer
                .token_to_id(t)
                .filter(|id| added.get(id).is_some_and(|a| a.special))
        }));
        self.stop.sort_unstable();
        self.stop.dedup();
    }
}

/// A checkpoint's tokenizer with its special tokens and chat template.
#[derive(Clone, Debug)]
pub struct ModelTokenizer {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// BOS/EOS and the stop tokens.
    pub special: SpecialTokens,
    /// The chat template source (Jinja), when the checkpoint has one.
    pub chat_template: Option<String>,
}

impl ModelTokenizer {
    /// The tokenizer of a GGUF file ([`tokenizer_from_gguf`]), its special
    /// tokens (`tokenizer.ggml.bos_token_id`, `eos_token_id`,
    /// `eot_token_id`, `eom_token_id`, `add_bos_token`, `add_eos_token`)
    /// and `tokenizer.chat_template`.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let tokenizer = tokenizer_from_gguf(ct)?;
        let n = tokenizer.get_vocab_size(true);
        let id = |key: &str| gguf::token_id(ct, &format!("tokenizer.ggml.{key}"), n);
        let spm = gguf::string(ct, "tokenizer.ggml.model")? == Some("llama");
        let mut special = SpecialTokens {
            bos: id("bos_token_id")?,
            eos: id("eos_token_id")?,
            add_bos: gguf::boolean(ct, "tokenizer.ggml.add_bos_token")?.unwrap_or(spm),
            add_eos: gguf::boolean(ct, "tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            stop: Vec::new(),
        };
        if special.add_bos && special.bos.is_none() {
            bail!("{OP}: GGUF metadata asks for a BOS token (add_bos_token) but has no tokenizer.ggml.bos_token_id");
        }
        if special.add_eos && special.eos.is_none() {
            bail!("{OP}: GGUF metadata asks for an EOS token (add_eos_token) but has no tokenizer.ggml.eos_token_id");
        }
        let extra = [id("eot_token_id")?, id("eom_token_id")?];
        special.collect_stop(&tokenizer, extra.into_iter().flatten());
        let chat_template = gguf::string(ct, "tokenizer.chat_template")?.map(String::from);
        Ok(Self {
            tokenizer,
            special,
            chat_template,
        })
    }

    /// The tokenizer of a Hugging Face model directory: `tokenizer.json`
    /// (or `tokenizer`, when given, instead), the special tokens of
    /// `tokenizer_config.json` (`bos_token`, `eos_token`, `add_bos_token`,
    /// `add_eos_token`), `generation_config.json` and `config.json`
    /// (`eos_token_id`, a number or a list), and the chat template of
    /// `chat_template.jinja`, `chat_template.json` or
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of
    /// named templates whose `default` is taken), in that order.
    pub fn from_dir(dir: &std::path::Path, tokenizer: Option<&std::path::Path>) -> Result<Self> {
        dir::from_dir(dir, tokenizer)
    }

    /// The text of token `id` (special tokens included), if it has one.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// The texts of the special (control) tokens, which [`encode`] turns
    /// into their ids where they are written.
    pub fn special_texts(&self) -> Vec<String> {
        let mut texts: Vec<String> = self
            .tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special)
            .map(|t| t.content)
            .collect();
        texts.sort();
        texts
    }

    /// Encodes a raw prompt: control-token markers written in `text`
    /// (`<|im_start|>`, `<start_of_turn>`) become their ids, and BOS/EOS
    /// are added as [`SpecialTokens::add_bos`]/`add_eos` say (BOS not twice
    /// when the text starts with its marker).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = encode(&self.tokenizer, text)?;
        if let (true, Some(bos)) = (self.special.add_bos, self.special.bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        if let (true, Some(eos)) = (self.special.add_eos, self.special.eos) {
            if ids.last() != Some(&eos) {
                ids.push(eos);
            }
        }
        Ok(ids)
    }

    /// Encodes `text` with control-token markers as plain text: a user
    /// message that writes `<|im_start|>` gets the ids of those characters,
    /// never the control token. Nothing is added.
    pub fn encode_plain(&mut self, text: &str) -> Result<Vec<u32>> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        self.tokenizer.set_encode_special_tokens(true);
        let ids = encode(&self.tokenizer, text);
        self.tokenizer.set_encode_special_tokens(false);
        ids
    }

    /// Encodes a rendered chat prompt so that control tokens come from the
    /// template only: the control-token markers written in
    /// [`PromptSegment::Template`] text become their ids, and everything
    /// between them - template text and [`PromptSegment::Message`] text
    /// together - is encoded as plain text ([`encode_plain`](Self::encode_plain)).
    /// Splitting only at the template's markers (as the tokenizer splits a
    /// whole text at every marker) gives the ids of the whole prompt's text
    /// when no message writes a marker; a message that writes one gets the
    /// ids of its characters. Nothing is added: the template writes BOS
    /// where the model wants it.
    pub fn encode_segments(&mut self, segments: &[PromptSegment]) -> Result<Vec<u32>> {
        let mut specials: Vec<(String, u32)> = self
            .tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| (t.content, id))
            .collect();
        // Longest first: the leftmost-longest match, as the tokenizer's.
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut ids = Vec::new();
        let mut plain = String::new();
        for s in segments {
            let text = match s {
                PromptSegment::Message(m) => {
                    plain.push_str(m);
                    continue;
                }
                PromptSegment::Template(t) => t.as_str(),
            };
            let mut rest = text;
            while !rest.is_empty() {
                match specials.iter().find(|(m, _)| rest.starts_with(m.as_str())) {
                    Some((marker, id)) => {
                        ids.extend(self.encode_plain(&plain)?);
                        plain.clear();
                        ids.push(*id);
                        rest = &rest[marker.len()..];
                    }
                    None => {
                        // `rest` is not empty: it has a first character.
                        let len = rest.chars().next().map_or(1, char::len_utf8);
                        plain.push_str(&rest[..len]);
                        rest = &rest[len..];
                    }
                }
            }
        }
        ids.extend(self.encode_plain(&plain)?);
        Ok(ids)
    }
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

    /// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>` (control), the
    /// 256 byte tokens, then pieces whose scores join `▁a` before `ab`:
    /// "▁ab" is `▁a b`, not `▁ ab`.
    fn tiny_spm(add_space_prefix: bool) -> Content {
        let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
        tokens.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
        let pieces = ["\u{2581}", "a", "b", "\u{2581}a", "ab", "\u{2581}b"];
        tokens.extend(pieces.iter().map(|p| p.to_string()));
        let mut types = vec![2, 3, 3];
        types.extend([6; 256]);
        types.extend([1; 6]);
        let mut scores = vec![0.0f32; 259];
        // ▁a (-1) joins before ab (-2).
        scores.extend([-5.0, -6.0, -7.0, -1.0, -2.0, -3.0]);
        let metadata = HashMap::from([
            (
                "tokenizer.ggml.model".to_string(),
                Value::String("llama".into()),
            ),
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::Array(types.into_iter().map(Value::I32).collect()),
            ),
            (
                "tokenizer.ggml.scores".to_string(),
                Value::Array(scores.into_iter().map(Value::F32).collect()),
            ),
            (
                "tokenizer.ggml.add_space_prefix".to_string(),
                Value::Bool(add_space_prefix),
            ),
            ("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(0)),
            ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(1)),
            ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(2)),
        ]);
        Content {
            magic: VersionedMagic::GgufV3,
            metadata,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn sentencepiece_merges_by_score_with_byte_fallback() {
        // Ids: 259 ▁, 260 a, 261 b, 262 ▁a, 263 ab, 264 ▁b.
        let tok = ModelTokenizer::from_gguf(&tiny_spm(false)).unwrap();
        let t = &tok.tokenizer;
        // "▁ab": ▁a (score -1) joins before ab (-2).
        assert_eq!(encode(t, " ab").unwrap(), [262, 261]);
        assert_eq!(encode(t, "ab b").unwrap(), [263, 264]);
        // "é" is no piece: its UTF-8 bytes 0xC3 0xA9 (ids 3 + byte).
        assert_eq!(encode(t, "aé").unwrap(), [260, 3 + 0xC3, 3 + 0xA9]);
        assert_eq!(decode(t, &[260, 3 + 0xC3, 3 + 0xA9, 264]).unwrap(), "aé b");
        // Control tokens are matched where written and skipped by decode.
        assert_eq!(encode(t, "<s>ab").unwrap(), [1, 263]);
        assert_eq!(decode(t, &[1, 263, 2]).unwrap(), "ab");
        // Special tokens from the metadata; BOS added by default (llama).
        assert_eq!(
            (tok.special.bos, tok.special.eos, tok.special.add_bos),
            (Some(1), Some(2), true)
        );
        assert_eq!(tok.special.stop, [2]);
        assert_eq!(tok.encode_raw("ab").unwrap(), [1, 263]);
        // With add_space_prefix the text starts with ▁, which decode drops.
        let spaced = ModelTokenizer::from_gguf(&tiny_spm(true)).unwrap();
        assert_eq!(encode(&spaced.tokenizer, "ab").unwrap(), [262, 261]);
        assert_eq!(decode(&spaced.tokenizer, &[262, 261]).unwrap(), "ab");
    }

    #[test]
    fn a_huge_sentencepiece_piece_loads_in_linear_time() {
        // A 200,000-character piece (and one of its halves): the merges were
        // found by hashing every prefix of every piece, 5 s for this piece.
        let mut ct = tiny_spm(false);
        let huge = "a".repeat(200_000);
        let half = "a".repeat(100_000);
        for (key, values) in [
            (
                "tokenizer.ggml.tokens",
                vec![Value::String(huge.clone()), Value::String(half.clone())],
            ),
            ("tokenizer.ggml.token_type", vec![Value::I32(1); 2]),
            (
                "tokenizer.ggml.scores",
                vec![Value::F32(-0.5), Value::F32(-0.25)],
            ),
        ] {
            match ct.metadata.get_mut(key) {
                Some(Value::Array(a)) => a.extend(values),
                _ => unreachable!("tiny_spm has {key}"),
            }
        }
        let start = std::time::Instant::now();
        let tok = ModelTokenizer::from_gguf(&ct).unwrap();
        let took = start.elapsed();
        assert!(took < std::time::Duration::from_secs(1), "{took:?}");
        let t = &tok.tokenizer;
        // Ids: 265 the huge piece, 266 its half (no merge chain from `a`
        // reaches them: "aaa" stays three `a`s).
        assert_eq!(t.token_to_id(&huge), Some(265));
        assert_eq!(t.token_to_id(&half), Some(266));
        assert_eq!(encode(t, "aaa").unwrap(), [260, 260, 260]);
        assert_eq!(encode(t, " ab").unwrap(), [262, 261]);
    }

    #[test]
    fn sentencepiece_needs_scores_bytes_and_the_default_pre_tokenizer() {
        let mut ct = tiny_spm(false);
        ct.metadata.insert(
            "tokenizer.ggml.pre".to_string(),
            Value::String("llama-bpe".into()),
        );
        let err = tokenizer_from_gguf(&ct).unwrap_err().to_string();
        assert!(err.starts_with("tokenizer: GGUF tokenizer.ggml.pre = \"llama-bpe\" is not supported for SentencePiece (llama) vocabularies (supported: default or absent)"), "{err}");
        let mut ct = tiny_spm(false);
        ct.metadata.remove("tokenizer.ggml.scores");
        let err = tokenizer_from_gguf(&ct).unwrap_err().to_string();
        assert!(
            err.starts_with("tokenizer: GGUF metadata has no tokenizer.ggml.scores"),
            "{err}"
        );
        let mut ct = tiny_spm(false);
        let types = ct.metadata.get_mut("tokenizer.ggml.token_type").unwrap();
        if let Value::Array(t) = types {
            t[3] = Value::I32(1);
        }
        let err = tokenizer_from_gguf(&ct).unwrap_err().to_string();
        assert!(err.starts_with("tokenizer: a SentencePiece vocabulary needs the 256 byte tokens <0x00>..<0xFF> of its byte fallback, this one has 255"), "{err}");
    }

    #[test]
    fn duplicate_tokens_and_bad_special_ids_are_errors() {
        let mut ct = tiny_gguf();
        ct.metadata.insert(
            "tokenizer.ggml.tokens".to_string(),
            strings(&["a", "b", "ab", "a", "Ġ", "Ġab", "1", "2", "Ã", "©"]),
        );
        let err = tokenizer_from_gguf(&ct).unwrap_err().to_string();
        assert!(
            err.starts_with("tokenizer: GGUF token \"a\" is written twice, as ids 0 and 3"),
            "{err}"
        );
        let mut ct = tiny_gguf();
        ct.metadata
            .insert("tokenizer.ggml.bos_token_id".to_string(), Value::U32(10));
        let err = ModelTokenizer::from_gguf(&ct).unwrap_err().to_string();
        assert!(err.starts_with("tokenizer: GGUF metadata tokenizer.ggml.bos_token_id = 10 is outside the vocabulary of 10 tokens"), "{err}");
        let mut ct = tiny_gguf();
        ct.metadata.insert(
            "tokenizer.ggml.add_bos_token".to_string(),
            Value::Bool(true),
        );
        let err = ModelTokenizer::from_gguf(&ct).unwrap_err().to_string();
        assert!(err.starts_with("tokenizer: GGUF metadata asks for a BOS token (add_bos_token) but has no tokenizer.ggml.bos_token_id"), "{err}");
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
