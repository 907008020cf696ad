//! Fuzz target: GGUF headers, metadata and tensor infos.
//!
//! Starting from a tiny GGUF Llama or Gemma 3 with a GPT-2 tokenizer and a
//! chat template, each case edits metadata values (counts, dimensions,
//! floats and strings set to boundary values, keys removed), then bytes of
//! the header (single bytes, u32 and u64 words at random offsets), then may
//! truncate the file. The checked reader, the tokenizer, the chat template,
//! the model loader and one forward pass then run on the result. The
//! property: each returns `Ok` or a clean `Err`, the whole case within
//! [`CASE_LIMIT`], and no single allocation exceeds 256 MiB (the capped
//! allocator aborts the binary otherwise).
//!
//! [`CASES`] cases from a fixed seed (`FUZZ_CASES` and `FUZZ_SEED` run
//! others); about 4 s in release on 2 cores.

#![cfg(feature = "models")]

mod tiny_checkpoint;

use std::io::Cursor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::QTensor;
use candle_core::Device;
use candle_paged_attention::models::limits::read_gguf;
use candle_paged_attention::models::quantized_gemma3::QuantizedGemma3;
use candle_paged_attention::models::quantized_llama::QuantizedLlama;
use candle_paged_attention::models::{PagedModel, PagedOptions};
use candle_paged_attention::text::chat::{ChatMessage, ChatTemplate};
use candle_paged_attention::text::tokenizer::ModelTokenizer;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use tiny_checkpoint::*;

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// Cases run (CI runs them all).
const CASES: u32 = 10_000;
/// The longest one case may take.
const CASE_LIMIT: Duration = Duration::from_secs(2);

/// One base file: metadata, tensors, and the bytes of its header.
struct Base {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, QTensor)>,
    header_len: usize,
}

fn bases() -> &'static [Base; 2] {
    static BASES: OnceLock<[Base; 2]> = OnceLock::new();
    BASES.get_or_init(|| {
        let make = |mut metadata: Vec<(String, Value)>, tensors: Vec<(String, QTensor)>| {
            metadata.extend(tokenizer_gguf_metadata());
            let bytes = gguf_bytes(&metadata, &tensors).expect("base gguf");
            let ct = read_gguf(&mut Cursor::new(&bytes)).expect("base reads");
            Base {
                metadata,
                tensors,
                header_len: ct.tensor_data_offset as usize,
            }
        };
        [
            make(
                llama_gguf_metadata(),
                llama_gguf_tensors().expect("tensors"),
            ),
            make(
                gemma3_gguf_metadata(),
                gemma3_gguf_tensors().expect("tensors"),
            ),
        ]
    })
}

/// A metadata value at a boundary, of any type.
fn hostile_value() -> impl Strategy<Value = Value> {
    let ints = prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(3),
        Just(7),
        Just(31),
        Just(32),
        Just(33),
        Just(u32::MAX as u64),
        Just(u32::MAX as u64 + 1),
        Just(1 << 60),
        Just(u64::MAX),
        any::<u64>(),
        0u64..100,
    ];
    let floats = prop_oneof![
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(0.0f32),
        Just(-1.0),
        Just(1e-38),
        Just(1e38),
        any::<f32>(),
    ];
    let strings = prop_oneof![
        Just(String::new()),
        Just("llama".to_string()),
        Just("gemma3".to_string()),
        Just("gpt2".to_string()),
        Just("llama".to_string()),
        Just("linear".to_string()),
        Just(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
                .to_string()
        ),
        Just("{{ 'x' * 100000000 }}".to_string()),
        Just("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}".to_string()),
        Just("{% if".to_string()),
        ".{0,16}",
    ];
    prop_oneof![
        ints.clone().prop_map(|v| Value::U32(v as u32)),
        ints.clone().prop_map(Value::U64),
        ints.clone().prop_map(|v| Value::I32(v as i32)),
        ints.prop_map(|v| Value::I64(v as i64)),
        floats.clone().prop_map(Value::F32),
        floats.prop_map(|f| Value::F64(f as f64)),
        any::<bool>().prop_map(Value::Bool),
        strings.clone().prop_map(Value::String),
        prop::collection::vec(strings.prop_map(Value::String), 0..6).prop_map(Value::Array),
        prop::collection::vec(any::<u32>().prop_map(Value::U32), 0..6).prop_map(Value::Array),
    ]
}

/// One edit of a base file.
#[derive(Clone, Debug)]
enum Edit {
    /// Metadata entry `i` (modulo their count) takes a new value.
    Set(usize, Value),
    /// Metadata entry `i` is removed.
    Remove(usize),
    /// The header byte at `at` (modulo the header's length) becomes `b`.
    Byte(usize, u8),
    /// A little-endian u32 is written into the header at `at`.
    Word(usize, u32),
    /// A little-endian u64 is written into the header at `at`.
    Long(usize, u64),
}

fn edit() -> impl Strategy<Value = Edit> {
    let word = prop_oneof![
        Just(0u32),
        Just(1),
        Just(u32::MAX),
        Just(1 << 31),
        any::<u32>()
    ];
    let long = prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(1 << 60),
        Just(1 << 32),
        any::<u64>()
    ];
    prop_oneof![
        3 => (any::<usize>(), hostile_value()).prop_map(|(i, v)| Edit::Set(i, v)),
        1 => any::<usize>().prop_map(Edit::Remove),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Byte(i, b)),
        1 => (any::<usize>(), word).prop_map(|(i, w)| Edit::Word(i, w)),
        1 => (any::<usize>(), long).prop_map(|(i, w)| Edit::Long(i, w)),
    ]
}

/// The bytes of `base` after `edits`, cut to `truncate` (a fraction of the
/// length in 1/1000ths) when given.
fn mutate(base: &Base, edits: &[Edit], truncate: Option<u16>) -> Vec<u8> {
    let mut md = base.metadata.clone();
    for e in edits {
        match e {
            Edit::Set(i, v) if !md.is_empty() => {
                let k = i % md.len();
                md[k].1 = v.clone();
            }
            Edit::Remove(i) if !md.is_empty() => {
                let k = i % md.len();
                md.remove(k);
            }
            _ => {}
        }
    }
    let Ok(mut bytes) = gguf_bytes(&md, &base.tensors) else {
        return Vec::new();
    };
    let header = base.header_len.min(bytes.len()).max(1);
    for e in edits {
        let mut put = |at: usize, v: &[u8]| {
            let at = at % header;
            let end = (at + v.len()).min(bytes.len());
            bytes[at..end].copy_from_slice(&v[..end - at]);
        };
        match e {
            Edit::Byte(at, b) => put(*at, &[*b]),
            Edit::Word(at, w) => put(*at, &w.to_le_bytes()),
            Edit::Long(at, l) => put(*at, &l.to_le_bytes()),
            _ => {}
        }
    }
    if let Some(t) = truncate {
        bytes.truncate(bytes.len() * (t as usize % 1000) / 1000);
    }
    bytes
}

/// Runs everything a runner runs on a GGUF file; every step may fail, none
/// may panic. True when a model loaded and ran a prompt.
fn exercise(bytes: Vec<u8>) -> bool {
    let mut r = Cursor::new(bytes);
    let Ok(ct) = read_gguf(&mut r) else {
        return false;
    };
    if let Ok(tok) = ModelTokenizer::from_gguf(&ct) {
        let _ = tok.encode_raw("abc ab c");
        if let Some(source) = &tok.chat_template {
            let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default();
            if let Ok(t) = ChatTemplate::new(source, &text(tok.special.bos), &text(tok.special.eos))
            {
                let _ = t.render(&[ChatMessage::new("user", "hi")], true);
            }
        }
    }
    let arch = ct
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let (dev, opts) = (Device::Cpu, PagedOptions::default());
    let model: candle_core::Result<Box<dyn PagedModel>> = match arch.as_str() {
        "gemma3" => QuantizedGemma3::from_gguf(&ct, &mut r, &dev, opts).map(|m| Box::new(m) as _),
        _ => QuantizedLlama::from_gguf(&ct, &mut r, &dev, opts).map(|m| Box::new(m) as _),
    };
    let Ok(model) = model else {
        return false;
    };
    let vocab = model.vocab_size().max(1) as u32;
    let ids: Vec<u32> = [1u32, 2, 3, 5, 8].iter().map(|i| i % vocab).collect();
    forward_prompt(model.as_ref(), &ids).is_ok()
}

/// Every case runs; at least a tenth of them must load a model and run it
/// (else the edits would only ever exercise the header checks).
#[test]
fn gguf_files_load_or_fail_cleanly_within_bounds() {
    let loaded = AtomicUsize::new(0);
    let mut runner = TestRunner::new(fuzz_config(CASES));
    let cases = (
        any::<bool>(),
        prop::collection::vec(edit(), 0..5),
        prop::option::weighted(0.1, any::<u16>()),
    );
    let result = runner.run(&cases, |(gemma, edits, truncate)| {
        let base = &bases()[usize::from(gemma)];
        let bytes = mutate(base, &edits, truncate);
        let start = Instant::now();
        if exercise(bytes) {
            loaded.fetch_add(1, Ordering::Relaxed);
        }
        let took = start.elapsed();
        prop_assert!(took < CASE_LIMIT, "a case took {took:?}");
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (ran, loaded) = (runner.config().cases as usize, loaded.into_inner());
    println!("{ran} files, {loaded} loaded and ran");
    assert!(
        loaded * 10 >= ran,
        "only {loaded} of {ran} files loaded and ran"
    );
}

/// The unedited bases load, tokenize, render and run: the fuzz target
/// exercises the whole path, not only the first check.
#[test]
fn the_bases_load_and_run() -> anyhow::Result<()> {
    for base in bases() {
        let mut r = Cursor::new(gguf_bytes(&base.metadata, &base.tensors)?);
        let ct = read_gguf(&mut r)?;
        let tok = ModelTokenizer::from_gguf(&ct)?;
        anyhow::ensure!(!tok.encode_raw("abc")?.is_empty());
        let source = tok.chat_template.clone().unwrap_or_default();
        let t = ChatTemplate::new(&source, "<s>", "</s>")?;
        anyhow::ensure!(t
            .render(&[ChatMessage::new("user", "hi")], true)?
            .contains("hi"));
        let model: Box<dyn PagedModel> = match base.metadata[0].1.to_string()?.as_str() {
            "gemma3" => Box::new(QuantizedGemma3::from_gguf(
                &ct,
                &mut r,
                &Device::Cpu,
                PagedOptions::default(),
            )?),
            _ => Box::new(QuantizedLlama::from_gguf(
                &ct,
                &mut r,
                &Device::Cpu,
                PagedOptions::default(),
            )?),
        };
        anyhow::ensure!(forward_prompt(model.as_ref(), &[1, 2, 3])?.dims() == [1, VOCAB]);
    }
    Ok(())
}
