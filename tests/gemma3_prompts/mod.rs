//! Gemma 3 270M prompts as token ids, looked up word by word in the
//! checkpoint's vocabulary (no tokenizer involved), for the tests that run
//! the real checkpoint.
#![allow(dead_code)]

use anyhow::{ensure, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::Tensor;

pub const BOS: u32 = 2;
/// The sliding window of Gemma 3 270M's local layers.
pub const WINDOW: usize = 512;

/// The vocabulary's pieces (`tokenizer.ggml.tokens`).
pub fn vocabulary(content: &gguf_file::Content) -> Result<Vec<String>> {
    let tokens = content
        .metadata
        .get("tokenizer.ggml.tokens")
        .context("no tokenizer.ggml.tokens")?
        .to_vec()?;
    Ok(tokens
        .iter()
        .map(|t| t.to_string().cloned())
        .collect::<candle_core::Result<_>>()?)
}

/// BOS, then each word as one SentencePiece piece (`▁word` after the first
/// word, trailing punctuation as its own piece).
pub fn encode_words(vocab: &[String], text: &str) -> Result<Vec<u32>> {
    let id = |piece: &str| -> Result<u32> {
        let i = vocab
            .iter()
            .position(|p| p == piece)
            .with_context(|| format!("piece {piece:?} is not in the vocabulary"))?;
        Ok(i as u32)
    };
    let mut ids = vec![BOS];
    for (n, word) in text.split_whitespace().enumerate() {
        let (stem, punct) = match word.strip_suffix(['.', ',']) {
            Some(stem) => (stem, &word[stem.len()..]),
            None => (word, ""),
        };
        let piece = if n == 0 {
            stem.to_string()
        } else {
            format!("\u{2581}{stem}")
        };
        ids.push(id(&piece)?);
        if !punct.is_empty() {
            ids.push(id(punct)?);
        }
    }
    Ok(ids)
}

/// The pieces joined, `▁` as a space (for printing).
pub fn decode(vocab: &[String], ids: &[u32]) -> String {
    ids.iter()
        .map(|&i| vocab.get(i as usize).map_or("?", String::as_str))
        .collect::<String>()
        .replace('\u{2581}', " ")
}

pub const STORY: &str =
    "Once upon a time there was a little girl who lived in a small house near the \
    forest. Every morning she walked to the river with her old dog, and every evening she \
    told her grandmother what she had seen. The birds sang in the trees, the wind moved the \
    long grass, and the water was cold and clear.";

pub const LESSON: &str = "The sun is a star at the center of our solar system. The earth moves \
    around the sun once every year, and the moon moves around the earth. Light from the sun \
    takes about eight minutes to reach us. Plants use that light to make food, and animals \
    eat the plants.";

/// Two short prompts and two longer than the window (the story repeated to
/// 600 tokens, the lesson to 530).
pub fn prompts(vocab: &[String]) -> Result<Vec<Vec<u32>>> {
    let repeated = |text: &str, len: usize| -> Result<Vec<u32>> {
        let once = encode_words(vocab, text)?;
        let mut ids = vec![BOS];
        while ids.len() < len {
            ids.extend_from_slice(&once[1..]);
        }
        ids.truncate(len);
        Ok(ids)
    };
    let p = vec![
        encode_words(vocab, "The capital of France is")?,
        encode_words(
            vocab,
            "Here is a short story about a dog named Max. Max loved to run in the park every \
             morning with his best friend, a small black cat. One day",
        )?,
        repeated(STORY, 600)?,
        repeated(LESSON, 530)?,
    ];
    ensure!(p[2].len() > WINDOW + 64 && p[3].len() > WINDOW);
    Ok(p)
}

/// Greedy margins: the gap between the top two logits of each step.
pub fn margins(logits: &[Tensor]) -> Result<Vec<f32>> {
    logits
        .iter()
        .map(|l| {
            let mut v = l.to_vec1::<f32>()?;
            v.sort_by(|a, b| b.total_cmp(a));
            Ok(v[0] - v[1])
        })
        .collect()
}

/// BOS and the story repeated, `len` tokens in all.
pub fn story_prompt(vocab: &[String], len: usize) -> Result<Vec<u32>> {
    let once = encode_words(vocab, STORY)?;
    let mut ids = vec![BOS];
    while ids.len() < len {
        ids.extend_from_slice(&once[1..]);
    }
    ids.truncate(len);
    Ok(ids)
}
