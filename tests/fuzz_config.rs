//! Fuzz target: `config.json`.
//!
//! Starting from the `config.json` of a tiny Llama, Gemma 2, Gemma 3,
//! Qwen2, Qwen3, Mistral or Phi-3 (with weights that match the unedited config), each case sets fields to
//! boundary values (0, 1, huge and negative numbers, floats, strings,
//! nulls, arrays, objects), removes fields, or edits bytes of the text. The
//! config is then parsed and the model loaded over the weights and run on
//! one prompt, as the runners do. The property: each step returns `Ok` or a
//! clean `Err`, the whole case within [`CASE_LIMIT`], and no single
//! allocation exceeds 256 MiB (the capped allocator aborts the binary
//! otherwise).
//!
//! [`CASES`] cases from a fixed seed (`FUZZ_CASES` and `FUZZ_SEED` run
//! others); about 10 s in release on 2 cores.

#![cfg(feature = "models")]

mod tiny_checkpoint;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use serde_json::Value;
use tiny_checkpoint::*;

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// Cases run (CI runs them all).
const CASES: u32 = 10_000;
/// The longest one case may take.
const CASE_LIMIT: Duration = Duration::from_secs(2);

/// The configs' fields, and other keys the loaders read.
const KEYS: &[&str] = &[
    "model_type",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_local_base_freq",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_scaling",
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "hidden_activation",
    "hidden_act",
    "attention_bias",
    "bos_token_id",
    "eos_token_id",
    "use_sliding_window",
    "max_window_layers",
    "partial_rotary_factor",
    "original_max_position_embeddings",
];

/// The tiny configs (one per family) and their weights.
fn bases() -> &'static [(String, HashMap<String, Tensor>); 7] {
    static BASES: OnceLock<[(String, HashMap<String, Tensor>); 7]> = OnceLock::new();
    BASES.get_or_init(|| {
        [
            llama_config_json(),
            gemma2_config_json(),
            gemma3_config_json(),
            qwen2_config_json(),
            qwen3_config_json(),
            mistral_config_json(),
            phi3_config_json(),
        ]
        .map(|c| {
            let w = weights_for(&c).expect("weights");
            (c, w)
        })
    })
}

/// A JSON value at a boundary, of any type.
fn hostile_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        Just(serde_json::json!(0)),
        Just(serde_json::json!(1)),
        Just(serde_json::json!(2)),
        Just(serde_json::json!(3)),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(4294967295u64)),
        Just(serde_json::json!(4294967296u64)),
        Just(serde_json::json!(1u64 << 60)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(i64::MIN)),
        Just(serde_json::json!(1e-300)),
        Just(serde_json::json!(1e300)),
        Just(serde_json::json!(-0.0)),
        Just(serde_json::json!(0.5)),
        Just(serde_json::json!(true)),
        Just(serde_json::json!("llama")),
        Just(serde_json::json!("gemma2")),
        Just(serde_json::json!("gemma3_text")),
        Just(serde_json::json!("qwen2")),
        Just(serde_json::json!("qwen3")),
        Just(serde_json::json!("mistral")),
        Just(serde_json::json!("phi3")),
        Just(
            serde_json::json!({"type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]})
        ),
        Just(serde_json::json!("gelu_pytorch_tanh")),
        Just(serde_json::json!("sliding_attention")),
        Just(serde_json::json!("")),
        any::<i64>().prop_map(|v| serde_json::json!(v)),
        (0u64..64).prop_map(|v| serde_json::json!(v)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|v| serde_json::json!(v)),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..4).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// One edit of a config.
#[derive(Clone, Debug)]
enum Edit {
    /// Key `KEYS[i]` takes a value.
    Set(usize, Value),
    /// Key `KEYS[i]` is removed.
    Remove(usize),
    /// The text's byte at `at` (modulo its length) becomes `b` (applied
    /// after the field edits; the text may stop being JSON).
    Byte(usize, u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        6 => (0..KEYS.len(), hostile_json()).prop_map(|(i, v)| Edit::Set(i, v)),
        2 => (0..KEYS.len()).prop_map(Edit::Remove),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Byte(i, b)),
    ]
}

fn mutate(base: &str, edits: &[Edit]) -> String {
    let mut json: Value = serde_json::from_str(base).expect("base config");
    for e in edits {
        let Some(obj) = json.as_object_mut() else {
            break;
        };
        match e {
            Edit::Set(i, v) => {
                obj.insert(KEYS[*i].to_string(), v.clone());
            }
            Edit::Remove(i) => {
                obj.remove(KEYS[*i]);
            }
            Edit::Byte(..) => {}
        }
    }
    let mut bytes = json.to_string().into_bytes();
    for e in edits {
        if let Edit::Byte(at, b) = e {
            let n = bytes.len().max(1);
            if let Some(x) = bytes.get_mut(at % n) {
                *x = *b;
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Every case runs; at least a tenth of them must load a model and run it
/// (else the edits would only ever exercise the JSON parser).
#[test]
fn configs_load_or_fail_cleanly_within_bounds() {
    let loaded = AtomicUsize::new(0);
    let mut runner = TestRunner::new(fuzz_config(CASES));
    let cases = (0usize..7, prop::collection::vec(edit(), 1..5));
    let result = runner.run(&cases, |(base, edits)| {
        let (config, weights) = &bases()[base];
        let config = mutate(config, &edits);
        let start = Instant::now();
        let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
        if let Ok(model) = load_config(&config, vb) {
            let vocab = model.vocab_size().max(1) as u32;
            let ids: Vec<u32> = [1u32, 2, 3, 5, 8].iter().map(|i| i % vocab).collect();
            if forward_prompt(model.as_ref(), &ids).is_ok() {
                loaded.fetch_add(1, Ordering::Relaxed);
            }
        }
        let took = start.elapsed();
        prop_assert!(took < CASE_LIMIT, "a case took {took:?}: {config}");
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (ran, loaded) = (runner.config().cases as usize, loaded.into_inner());
    println!("{ran} configs, {loaded} loaded and ran");
    assert!(
        loaded * 10 >= ran,
        "only {loaded} of {ran} configs loaded and ran"
    );
}

/// The unedited configs load and run: the target exercises the whole path.
#[test]
fn the_bases_load_and_run() -> anyhow::Result<()> {
    for (config, weights) in bases() {
        let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
        let model = load_config(config, vb)?;
        anyhow::ensure!(forward_prompt(model.as_ref(), &[1, 2, 3])?.dims() == [1, VOCAB]);
    }
    Ok(())
}
