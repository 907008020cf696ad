//! Gemma 3 270M prompts as token ids, looked up word by word in the
//! checkpoint's vocabulary (no tokenizer involved), for the tests that run
//! the real checkpoint.
#![allow(dead_code)]

use anyhow::{ensure, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_paged_attention::models::{CacheConfig, PagedKvCache, PagedModel};
use candle_paged_attention::Work;

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

/// Teacher-forced logits of `model` over a cache of `cache`: all prompts
/// batched, prefilled in chunks of `chunk` tokens, then decodes feeding `decodes[i]` (all but the
/// last). Per sequence, the logits `(vocab,)` after its prompt and after
/// each decode, copied to the CPU.
pub fn paged_logits(
    model: &dyn PagedModel,
    cache: CacheConfig,
    prompts: &[Vec<u32>],
    decodes: &[Vec<u32>],
    chunk: usize,
) -> Result<Vec<Vec<Tensor>>> {
    let dev = model.device().clone();
    let cache = PagedKvCache::new(&model.attention_layers(), cache, model.dtype(), &dev)?;
    let mut manager = cache.block_manager()?;
    for (i, p) in prompts.iter().enumerate() {
        manager.add_sequence(i as u64, p)?;
    }
    let mut out: Vec<Vec<Tensor>> = vec![Vec::new(); prompts.len()];
    let mut step = |work: Vec<Work>, out: &mut Vec<Vec<Tensor>>| -> Result<()> {
        let batch = manager.schedule(&work, &dev)?;
        let ready: Vec<usize> = (0..work.len()).filter(|&i| batch.ready[i]).collect();
        let rows: Vec<usize> = ready.iter().map(|&i| batch.last_rows[i]).collect();
        let ids = Tensor::new(batch.token_ids.as_slice(), &dev)?;
        let rows_or_first = if rows.is_empty() { vec![0] } else { rows };
        let logits = model.forward(&ids, &batch.metadata, &cache, &rows_or_first)?;
        for (r, &i) in ready.iter().enumerate() {
            out[batch.seq_ids[i] as usize].push(logits.get(r)?.to_device(&Device::Cpu)?);
        }
        Ok(())
    };
    let mut done = vec![0; prompts.len()];
    while done.iter().zip(prompts).any(|(d, p)| d < &p.len()) {
        let mut work = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let n = (p.len() - done[i]).min(chunk);
            if n > 0 {
                work.push(Work::Prefill {
                    seq_id: i as u64,
                    num_tokens: n,
                });
                done[i] += n;
            }
        }
        step(work, &mut out)?;
    }
    let steps = decodes.iter().map(Vec::len).min().unwrap_or(0);
    for s in 0..steps.saturating_sub(1) {
        let work = decodes
            .iter()
            .enumerate()
            .map(|(i, d)| Work::Decode {
                seq_id: i as u64,
                token: d[s],
            })
            .collect();
        step(work, &mut out)?;
    }
    Ok(out)
}
