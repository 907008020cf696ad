//! The server's per-request text over a byte-level BPE tokenizer (one token
//! per byte, so multi-byte characters span tokens): windowed incremental
//! decoding gives the text of the whole decoding, and stop strings cut it
//! wherever they fall.

use candle_paged_attention::server::text::{Detokenizer, IncrementalDecoder};
use candle_paged_attention::text::tokenizer::decode;
use serde_json::{json, Value};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

fn byte_tokenizer() -> Tokenizer {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort();
    let vocab: serde_json::Map<String, Value> = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "dropout": null,
                  "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false}
    });
    spec.to_string().parse().expect("tokenizer json")
}

const TEXT: &str = "Un café très bon, 日本語 and 👩‍👩‍👧 emoji: done.";

#[test]
fn incremental_decoding_gives_the_whole_text() {
    let tok = byte_tokenizer();
    let ids = tok.encode(TEXT, false).unwrap().get_ids().to_vec();
    assert_eq!(ids.len(), TEXT.len(), "one token per byte");
    let mut dec = IncrementalDecoder::new();
    let mut out = String::new();
    for (k, &id) in ids.iter().enumerate() {
        if let Some(t) = dec.push(&tok, id).unwrap() {
            assert!(!t.contains('\u{fffd}'), "token {k}: {t:?}");
            out.push_str(&t);
        }
        // What was handed out is always a prefix of the text.
        assert!(TEXT.starts_with(&out), "{out:?}");
    }
    assert_eq!(dec.finish(&tok).unwrap(), None);
    assert_eq!(out, TEXT);
    assert_eq!(out, decode(&tok, &ids).unwrap());

    // Tokens that stop inside a character: the end gives U+FFFD, as the
    // whole decoding does.
    let cut = TEXT.find('日').unwrap() + 1;
    let mut dec = IncrementalDecoder::new();
    let mut out = String::new();
    for &id in &ids[..cut] {
        out.push_str(&dec.push(&tok, id).unwrap().unwrap_or_default());
    }
    assert_eq!(out, &TEXT[..cut - 1]);
    out.push_str(&dec.finish(&tok).unwrap().unwrap());
    assert_eq!(out, decode(&tok, &ids[..cut]).unwrap());
    assert!(out.ends_with('\u{fffd}'));
}

/// The text handed out by a detokenizer with `stops`, streamed token by
/// token, and whether it stopped.
fn run(tok: &Tokenizer, ids: &[u32], stops: &[&str]) -> (String, bool) {
    let mut d = Detokenizer::new(stops.iter().map(|s| s.to_string()).collect());
    let mut out = String::new();
    for &id in ids {
        let delta = d.push(tok, id).unwrap();
        out.push_str(&delta.text);
        if delta.stopped {
            assert!(d.stopped());
            return (out, true);
        }
    }
    let end = d.finish(tok).unwrap();
    out.push_str(&end.text);
    (out, end.stopped)
}

#[test]
fn stop_strings_cut_the_text_across_tokens() {
    let tok = byte_tokenizer();
    let ids = tok.encode(TEXT, false).unwrap().get_ids().to_vec();
    // Each stop string spans several tokens (bytes); the text ends before
    // its first occurrence, and no byte of it was handed out before.
    for stop in ["très", "é", "日本", "👩‍👧", "done", "n", "bon, 日"] {
        let (out, stopped) = run(&tok, &ids, &[stop]);
        assert!(stopped, "{stop:?}");
        assert_eq!(out, &TEXT[..TEXT.find(stop).unwrap()], "{stop:?}");
    }
    // The earliest of several wins; absent ones change nothing.
    let (out, stopped) = run(&tok, &ids, &["emoji", "語", "absent"]);
    assert!(stopped);
    assert_eq!(out, &TEXT[..TEXT.find('語').unwrap()]);
    let (out, stopped) = run(&tok, &ids, &["absent", "done!", ""]);
    assert!(!stopped);
    assert_eq!(
        out, TEXT,
        "text held back for a partial match comes out at the end"
    );
}
