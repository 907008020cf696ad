//! SentencePiece BPE from GGUF metadata (`tokenizer.ggml.model = llama`,
//! as Llama 2's and Gemma's).
//!
//! SentencePiece's BPE starts from the characters of the text (spaces
//! written `▁`) and repeatedly joins the adjacent pair whose joined piece is
//! in the vocabulary with the highest score, the leftmost on ties; a
//! character that is no piece becomes its UTF-8 bytes `<0xNN>`. This is a
//! Hugging Face BPE whose merges are every split `(a, b)` of every normal
//! piece `a b` into two normal pieces, ranked by the score of `a b` (the
//! construction of `transformers`' SentencePiece converter), with byte
//! fallback.

use std::collections::HashMap;

use candle_core::quantized::gguf_file;
use candle_core::{bail, Error, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence};
use tokenizers::Tokenizer;

use super::gguf::{boolean, required, string, token_id, token_type, GgufVocab};
use super::OP;

/// SentencePiece's escaped space.
const SPACE: &str = "\u{2581}";

/// A byte trie of pieces: which prefixes of a text are pieces, in time
/// linear in the text.
struct Trie {
    /// (node, byte) to the node below; node 0 is the root.
    edges: HashMap<(u32, u8), u32>,
    /// Whether a piece ends at the node, by node.
    ends: Vec<bool>,
}

impl Trie {
    fn new() -> Self {
        Self {
            edges: HashMap::new(),
            ends: vec![false],
        }
    }

    fn insert(&mut self, bytes: impl Iterator<Item = u8>) {
        let mut node = 0u32;
        for b in bytes {
            node = match self.edges.get(&(node, b)) {
                Some(&next) => next,
                None => {
                    let next = self.ends.len() as u32;
                    self.ends.push(false);
                    self.edges.insert((node, b), next);
                    next
                }
            };
        }
        self.ends[node as usize] = true;
    }

    /// `out[k]` is true when the first `k` bytes of `bytes` are a piece
    /// (`out` has one entry more than `bytes`).
    fn prefixes(&self, bytes: impl ExactSizeIterator<Item = u8>) -> Vec<bool> {
        let mut out = vec![false; bytes.len() + 1];
        let mut node = 0u32;
        out[0] = self.ends[0];
        // `k < bytes.len()`, so `k + 1` is within `out`.
        for (k, b) in bytes.enumerate() {
            match self.edges.get(&(node, b)) {
                Some(&next) => node = next,
                None => break,
            }
            out[k + 1] = self.ends[node as usize];
        }
        out
    }
}

/// The merges of the vocabulary, best first: `(a, b)` for every split of
/// every normal piece into two normal pieces, ordered by the joined piece's
/// score (descending), then its id, then the split position.
///
/// The splits of a piece are found with two tries of the normal pieces
/// (forwards and backwards), so the work is linear in the vocabulary's
/// bytes: hashing every prefix of every piece was quadratic in a piece's
/// length (a 200,000-character piece took seconds).
fn merges(vocab: &GgufVocab, scores: &[f32]) -> Vec<(String, String)> {
    let normal: Vec<(usize, &str)> = vocab
        .tokens
        .iter()
        .zip(&vocab.types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == token_type::NORMAL)
        .map(|(id, (t, _))| (id, t.as_str()))
        .collect();
    let mut forwards = Trie::new();
    let mut backwards = Trie::new();
    for (_, piece) in &normal {
        forwards.insert(piece.bytes());
        backwards.insert(piece.bytes().rev());
    }
    // (score, id, split byte offset)
    let mut ranked: Vec<(f32, usize, usize)> = Vec::new();
    for &(id, piece) in &normal {
        let n = piece.len();
        let prefix = forwards.prefixes(piece.bytes());
        let suffix = backwards.prefixes(piece.bytes().rev());
        // A split at byte `at` (0 < at < n) joins the piece piece[..at] and
        // the piece piece[at..]; both are valid UTF-8 pieces, so `at` is a
        // character boundary.
        // `prefix` and `suffix` have `n + 1` entries and `0 < at < n`: the
        // indices `at` and `n - at` are in range.
        for at in 1..n {
            if prefix[at] && suffix[n - at] {
                // `scores` has one entry per token: checked by the caller.
                ranked.push((scores[id], id, at));
            }
        }
    }
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    ranked
        .into_iter()
        .map(|(_, id, at)| {
            let (a, b) = vocab.tokens[id].split_at(at);
            (a.to_string(), b.to_string())
        })
        .collect()
}

/// Builds the SentencePiece tokenizer of the metadata: `tokens`, `scores`
/// and `token_type` (control and unknown tokens special, user-defined
/// tokens matched whole, byte tokens for the fallback), with a `▁` in front
/// of the text when `tokenizer.ggml.add_space_prefix` (default true, as in
/// llama.cpp; Gemma's files say false). `tokenizer.ggml.pre` must be absent
/// or `default`.
pub(super) fn tokenizer(ct: &gguf_file::Content, vocab: &GgufVocab) -> Result<Tokenizer> {
    if let Some(pre) = string(ct, "tokenizer.ggml.pre")? {
        if pre != "default" {
            bail!("{OP}: GGUF tokenizer.ggml.pre = {pre:?} is not supported for SentencePiece (llama) vocabularies (supported: default or absent)");
        }
    }
    let scores = required(ct, "tokenizer.ggml.scores")?
        .to_vec()?
        .iter()
        .map(|v| v.to_f32())
        .collect::<Result<Vec<f32>>>()?;
    if scores.len() != vocab.tokens.len() {
        bail!(
            "{OP}: GGUF metadata has {} tokens but {} scores",
            vocab.tokens.len(),
            scores.len()
        );
    }
    let bytes = vocab
        .types
        .iter()
        .filter(|&&t| t == token_type::BYTE)
        .count();
    if bytes != 256 {
        bail!("{OP}: a SentencePiece vocabulary needs the 256 byte tokens <0x00>..<0xFF> of its byte fallback, this one has {bytes}");
    }
    let add_space_prefix = boolean(ct, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let unk = token_id(ct, "tokenizer.ggml.unknown_token_id", vocab.tokens.len())?;
    let ids: Vocab = vocab
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(ids, merges(vocab, &scores))
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        // token_id checked unk < the number of tokens.
        builder = builder.unk_token(vocab.tokens[unk as usize].clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| Error::msg(format!("{OP}: building the SentencePiece model: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    let replace =
        |from: &str, to: &str| Replace::new(from, to).map_err(|e| Error::msg(format!("{OP}: {e}")));
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new(SPACE.to_string()).into());
    }
    normalizers.push(replace(" ", SPACE)?.into());
    tok.with_normalizer(Some(Sequence::new(normalizers)))
        .map_err(|e| Error::msg(format!("{OP}: {e}")))?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        DecoderWrapper::Replace(replace(SPACE, " ")?),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    let (special, user) = vocab.added_tokens();
    tok.add_special_tokens(special)
        .map_err(|e| Error::msg(format!("{OP}: adding the control tokens: {e}")))?;
    tok.add_tokens(user)
        .map_err(|e| Error::msg(format!("{OP}: adding the user-defined tokens: {e}")))?;
    Ok(tok)
}
