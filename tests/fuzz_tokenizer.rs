//! Fuzzing tokenizer loading: a small valid `tokenizer.json` (byte-level
//! BPE with an added special token) mutated by random byte edits and by
//! JSON edits (a node replaced by a huge or negative number, a long string,
//! `null`, an empty or nested array), loaded with
//! `ModelTokenizer::from_dir` beside a `config.json` and
//! `tokenizer_config.json`; and GGUF tokenizer metadata built in memory
//! with random tokens, types, scores, merges and special ids, loaded with
//! `ModelTokenizer::from_gguf`. Each load must return `Ok` or `Err` within
//! 2 s without a panic; a loaded tokenizer must encode and decode a short
//! text to `Ok` or `Err` without a panic.
//!
//! 10,000 cases each; measured: 41 s for the file in release on 2
//! shared cores.

#![cfg(feature = "models")]

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{Content, Value as GgufValue, VersionedMagic};
use candle_paged_attention::text::tokenizer::{self, ModelTokenizer};
use proptest::prelude::*;
use serde_json::Value;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The valid `tokenizer.json` the mutations start from.
fn base_json() -> &'static str {
    static BASE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BASE.get_or_init(build_base_json)
}

fn build_base_json() -> String {
    let vocab: tokenizers::models::bpe::Vocab = [
        ("a", 0),
        ("b", 1),
        ("c", 2),
        ("\u{120}", 3),
        ("ab", 4),
        ("\u{120}a", 5),
        ("abc", 6),
    ]
    .into_iter()
    .map(|(t, i)| (t.to_string(), i))
    .collect();
    let merges = vec![
        ("a".to_string(), "b".to_string()),
        ("\u{120}".to_string(), "a".to_string()),
        ("ab".to_string(), "c".to_string()),
    ];
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .expect("a valid BPE");
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default()));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.add_special_tokens([AddedToken::from("<s>", true)])
        .expect("a special token");
    tok.to_string(false).expect("serialisable")
}

/// A folder per test thread for the mutated files.
fn folder() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "cpa-fuzz-tokenizer-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    dir
}

/// A value to put in place of a JSON node.
fn json_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(Value::from(u64::MAX)),
        Just(Value::from(-1)),
        Just(Value::from(4_000_000_000u64)),
        Just(Value::from(1e300)),
        Just(Value::from("a".repeat(10_000))),
        Just(Value::from("")),
        Just(Value::Array(vec![])),
        Just(serde_json::json!([[["a"]]])),
        Just(serde_json::json!({"type": "BPE"})),
        "[ -~]{0,8}".prop_map(Value::from),
    ]
}

/// Replaces the `pick`-th node (in preorder) of `v` by `new`.
fn replace_node(v: &mut Value, pick: &mut usize, new: &Value) -> bool {
    if *pick == 0 {
        *v = new.clone();
        return true;
    }
    *pick -= 1;
    match v {
        Value::Array(a) => a.iter_mut().any(|x| replace_node(x, pick, new)),
        Value::Object(o) => o.values_mut().any(|x| replace_node(x, pick, new)),
        _ => false,
    }
}

/// An edit of the base file.
#[derive(Clone, Debug)]
enum Edit {
    /// Set the byte at (index) to the value.
    Byte(prop::sample::Index, u8),
    /// Delete a byte run at (index) of the length.
    Delete(prop::sample::Index, usize),
    /// Replace the n-th JSON node by the value.
    Node(usize, Value),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Byte(i, b)),
        (any::<prop::sample::Index>(), 1usize..16).prop_map(|(i, n)| Edit::Delete(i, n)),
        (0usize..200, json_value()).prop_map(|(n, v)| Edit::Node(n, v)),
    ]
}

/// Runs `f`, failing the case on a panic or a run past 2 s.
fn bounded<T>(what: &str, f: impl FnOnce() -> T) -> std::result::Result<T, TestCaseError> {
    let start = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(f));
    let took = start.elapsed();
    prop_assert!(took < Duration::from_secs(2), "{what} took {took:?}");
    match r {
        Ok(v) => Ok(v),
        Err(_) => Err(TestCaseError::fail(format!("{what} panicked"))),
    }
}

/// Encodes and decodes a short text with a loaded tokenizer.
fn exercise(tok: &ModelTokenizer) -> std::result::Result<(), TestCaseError> {
    bounded("encoding", || {
        if let Ok(ids) = tok.encode_raw("<s>ab c abc \u{e9}") {
            let _ = tokenizer::decode(&tok.tokenizer, &ids);
        }
        let _ = tokenizer::encode(&tok.tokenizer, "abc");
    })
}

/// A GGUF string array.
fn strings(list: &[String]) -> GgufValue {
    GgufValue::Array(list.iter().cloned().map(GgufValue::String).collect())
}

/// `cases` cases (or `$FUZZ_CASES`) from a fixed seed, so that CI runs the
/// same cases every time (`$FUZZ_SEED` explores others), without
/// regression files.
fn fuzz_config(cases: u32) -> ProptestConfig {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    ProptestConfig {
        cases: env("FUZZ_CASES").map_or(cases, |c| c as u32),
        rng_seed: proptest::test_runner::RngSeed::Fixed(env("FUZZ_SEED").unwrap_or(0x5eed_cafe)),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(fuzz_config(10_000))]

    #[test]
    fn mutated_tokenizer_json_loads_or_fails_cleanly(
        edits in prop::collection::vec(edit(), 1..4),
        bos in prop_oneof![Just(Value::from(1)), Just(Value::from(4_000_000_000u64)), json_value()],
    ) {
        let mut text = base_json().as_bytes().to_vec();
        for e in &edits {
            match e {
                Edit::Byte(i, b) if !text.is_empty() => {
                    let at = i.index(text.len());
                    text[at] = *b;
                }
                Edit::Delete(i, n) if !text.is_empty() => {
                    let at = i.index(text.len());
                    let end = (at + n).min(text.len());
                    text.drain(at..end);
                }
                Edit::Node(n, v) => {
                    if let Ok(mut json) = serde_json::from_slice::<Value>(&text) {
                        let mut pick = *n;
                        replace_node(&mut json, &mut pick, v);
                        text = json.to_string().into_bytes();
                    }
                }
                _ => {}
            }
        }
        let dir = folder();
        std::fs::write(dir.join("tokenizer.json"), &text).expect("written");
        std::fs::write(
            dir.join("config.json"),
            serde_json::json!({"bos_token_id": bos, "eos_token_id": [2, bos]}).to_string(),
        )
        .expect("written");
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::json!({"eos_token": "<s>", "chat_template": "{{ messages }}"}).to_string(),
        )
        .expect("written");
        let loaded = bounded("loading", || ModelTokenizer::from_dir(&dir, None))?;
        if let Ok(tok) = loaded {
            exercise(&tok)?;
        }
    }

    #[test]
    fn random_gguf_tokenizer_metadata_loads_or_fails_cleanly(
        spm in any::<bool>(),
        tokens in prop::collection::vec("[ab\u{2581}<>0-9xA-F]{0,6}", 0..40),
        types in prop::collection::vec(-2i32..8, 0..40),
        scores in prop::collection::vec(any::<f32>(), 0..40),
        merges in prop::collection::vec("[ab ]{0,5}", 0..10),
        bos in prop_oneof![Just(GgufValue::U32(1)), Just(GgufValue::I32(-1)), Just(GgufValue::U64(4_000_000_000)), any::<u32>().prop_map(GgufValue::U32), Just(GgufValue::String("x".into()))],
        bytes in any::<bool>(),
        pre in prop_oneof![Just(None), Just(Some("default")), Just(Some("llama-bpe")), Just(Some("smollm")), Just(Some("x"))],
    ) {
        let mut tokens = tokens;
        let mut types = types;
        let mut scores = scores;
        if bytes {
            // The byte tokens a SentencePiece vocabulary needs.
            tokens.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
            types.extend([6; 256]);
            scores.extend([0.0; 256]);
        }
        let mut metadata = HashMap::from([
            (
                "tokenizer.ggml.model".to_string(),
                GgufValue::String(if spm { "llama" } else { "gpt2" }.into()),
            ),
            ("tokenizer.ggml.tokens".to_string(), strings(&tokens)),
            (
                "tokenizer.ggml.token_type".to_string(),
                GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
            ),
            (
                "tokenizer.ggml.scores".to_string(),
                GgufValue::Array(scores.into_iter().map(GgufValue::F32).collect()),
            ),
            ("tokenizer.ggml.merges".to_string(), strings(&merges)),
            ("tokenizer.ggml.bos_token_id".to_string(), bos),
        ]);
        if let Some(pre) = pre {
            metadata.insert("tokenizer.ggml.pre".to_string(), GgufValue::String(pre.into()));
        }
        let ct = Content {
            magic: VersionedMagic::GgufV3,
            metadata,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        };
        let loaded = bounded("loading GGUF metadata", || ModelTokenizer::from_gguf(&ct))?;
        if let Ok(tok) = loaded {
            exercise(&tok)?;
        }
    }
}
