//! GPT-2 byte-level BPE from GGUF metadata (`tokenizer.ggml.model = gpt2`).

use candle_core::quantized::gguf_file;
use candle_core::{bail, Error, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{SplitDelimiterBehavior, Tokenizer};

use super::gguf::{required, string, GgufVocab};
use super::OP;

/// Llama 3's split regex (llama.cpp's `llama-bpe`, Hugging Face's Llama 3
/// `tokenizer.json`): letters with one leading non-letter, numbers in
/// groups of at most three digits, punctuation runs, newline runs.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values this builder knows, for error messages.
pub(super) const KNOWN_PRE: &str = "default, gpt2, smollm, llama-bpe";

/// The pre-tokenizer llama.cpp uses for `pre`:
/// * absent, `default`, `gpt2` - the GPT-2 regex (Hugging Face's `ByteLevel`
///   with `use_regex`);
/// * `smollm` - every digit alone, then the GPT-2 regex;
/// * `llama-bpe` - Llama 3's regex, then the byte mapping.
///
/// Any other value is an error naming it: its regexes are unknown, and
/// tokens from the wrong split would silently differ from the model's.
pub(super) fn pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
    Ok(match pre.unwrap_or("default") {
        "default" | "gpt2" => byte_level(true).into(),
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into(),
        "llama-bpe" => {
            let split = Split::new(
                SplitPattern::Regex(LLAMA3_REGEX.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| Error::msg(format!("{OP}: the llama-bpe regex: {e}")))?;
            Sequence::new(vec![split.into(), byte_level(false).into()]).into()
        }
        other => bail!(
            "{OP}: GGUF tokenizer.ggml.pre = {other:?} is not supported for gpt2 vocabularies (supported: {KNOWN_PRE}); pass a tokenizer.json instead"
        ),
    })
}

/// Builds the byte-level BPE of the metadata: `tokens` (by id), `merges`
/// (`"a b"`, by rank), the pre-tokenizer of `tokenizer.ggml.pre`, control
/// tokens as special tokens and user-defined ones as added tokens.
pub(super) fn tokenizer(ct: &gguf_file::Content, vocab: &GgufVocab) -> Result<Tokenizer> {
    let merges = required(ct, "tokenizer.ggml.merges")?
        .to_vec()?
        .iter()
        .map(|v| {
            let m = v.to_string()?;
            match m.split_once(' ') {
                Some((a, b)) => Ok((a.to_string(), b.to_string())),
                None => bail!("{OP}: merge {m:?} is not two space-separated tokens"),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let pre = pre_tokenizer(string(ct, "tokenizer.ggml.pre")?)?;
    let ids: Vocab = vocab
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(ids, merges)
        .build()
        .map_err(|e| Error::msg(format!("{OP}: building the GGUF BPE model: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevelDecoder::new(true, true, true)));
    let (special, user) = vocab.added_tokens();
    tok.add_special_tokens(special)
        .map_err(|e| Error::msg(format!("{OP}: adding the control tokens: {e}")))?;
    tok.add_tokens(user)
        .map_err(|e| Error::msg(format!("{OP}: adding the user-defined tokens: {e}")))?;
    Ok(tok)
}
