//! The `generate` runner's errors: flags are checked before anything is
//! loaded or allocated and every error names its flag; a prompt that cannot
//! run prints its error while the others complete.
//!
//! The runner's source is compiled into this test, whose cases call its
//! `run` with parsed flags and read what it prints. Cases that need the
//! model use SmolLM2-135M-Instruct through `scripts/fetch-smollm2.sh`.

#![cfg(feature = "models")]

#[path = "../examples/generate.rs"]
#[allow(dead_code)]
mod generate;

use anyhow::{ensure, Result};
use clap::Parser;

/// Runs the runner with `flags`; returns what it printed and its error
/// (with its causes, `a: b`), if any.
fn run(flags: &[&str]) -> Result<(String, Option<String>)> {
    let args =
        generate::Args::try_parse_from(std::iter::once("generate").chain(flags.iter().copied()))?;
    let mut out = Vec::new();
    let err = generate::run(args, &mut out)
        .err()
        .map(|e| format!("{e:#}"));
    Ok((String::from_utf8(out)?, err))
}

/// The runner's error for `flags`, which must fail.
fn error_of(flags: &[&str]) -> Result<String> {
    let (_, err) = run(flags)?;
    err.ok_or_else(|| anyhow::anyhow!("{flags:?} did not fail"))
}

#[test]
fn flags_are_checked_before_loading_and_name_the_flag() -> Result<()> {
    let checks: &[(&[&str], &str)] = &[
        (&["--chunk-tokens", "0"], "--chunk-tokens must be at least 1, got 0"),
        (&["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
        (&["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (&["--block-size", "0"], "--block-size must be at least 1, got 0"),
        (&["--num-blocks", "0"], "--num-blocks must be at least 1, got 0"),
        (&["--window-blocks", "0"], "--window-blocks must be at least 1, got 0"),
        (
            &["--kv-memory-mb", "17592186044417"],
            "--kv-memory-mb 17592186044417 is too large: its bytes overflow usize",
        ),
        (&["--temperature", "NaN"], "--temperature must be finite, got NaN"),
        (
            &["--gpu-memory-utilization", "0"],
            "--gpu-memory-utilization must be in (0, 1], got 0",
        ),
        (
            &["--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization must be in (0, 1], got 1.5",
        ),
        (
            &["--top-p", "1e-50"],
            "--top-p: sampling: top_p 1e-50 is too small: it is applied in f32 and must be at least 1.1754944e-38",
        ),
        (&["--top-p", "1.5"], "--top-p: sampling: top_p must be in (0, 1], got 1.5"),
        (
            &["--seed", "18446744073709551615", "--prompt", "a", "--prompt", "b"],
            "--seed 18446744073709551615: prompt i uses seed + i, which overflows u64 for 2 prompts",
        ),
        (
            &["--prefix-caching", "--window-blocks", "8"],
            "--prefix-caching cannot be combined with --window-blocks",
        ),
        (&["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got tpu"),
        (&["--top-k", "0"], "--top-k: sampling: top_k must be at least 1, got 0"),
        (
            &["--repeat-penalty", "0"],
            "--repeat-penalty: sampling: repeat_penalty must be finite and positive, got 0",
        ),
        (
            &["--repeat-penalty", "inf"],
            "--repeat-penalty: sampling: repeat_penalty must be finite and positive, got inf",
        ),
        (
            &["--kv-cache-dtype", "fp16"],
            "--kv-cache-dtype must be auto or fp8, got fp16",
        ),
        (
            &["--raw", "--system", "Be brief."],
            "--system cannot be combined with --raw (a raw prompt goes without the chat template)",
        ),
        (
            &["--chat-template", "/nonexistent/t.jinja"],
            "--chat-template: reading /nonexistent/t.jinja",
        ),
        // A folder is caught before the model loads, as any unreadable file.
        (&["--chat-template", "/"], "--chat-template: reading /"),
    ];
    for (flags, want) in checks {
        let got = error_of(flags)?;
        ensure!(
            got.starts_with(want),
            "{flags:?}: expected {want:?}, got {got:?}"
        );
    }
    Ok(())
}

/// A template with a syntax error is refused with the flag before the
/// model loads (the default model is never fetched for it).
#[test]
fn a_chat_template_with_a_syntax_error_is_refused_before_loading() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("cpa-runner-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("bad.jinja");
    std::fs::write(&path, "{% for m in messages %}{{ m.content }")?;
    let p = path.display().to_string();
    let got = error_of(&["/nonexistent/model.gguf", "--chat-template", &p])?;
    ensure!(
        got.starts_with(&format!("--chat-template {p}: ")) && got.contains("syntax error"),
        "{got}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// `--gpu-memory-utilization` sizes nothing on the CPU or beside
/// `--num-blocks` / `--kv-memory-mb`: the runner says so instead of
/// ignoring it silently.
#[test]
fn an_unused_gpu_memory_utilization_is_noted() -> Result<()> {
    let args = |flags: &[&str]| {
        generate::Args::try_parse_from(std::iter::once("generate").chain(flags.iter().copied()))
    };
    let cpu = candle_core::Device::Cpu;
    let note =
        generate::unused_utilization_note(&args(&["--gpu-memory-utilization", "0.5"])?, &cpu);
    ensure!(
        note.as_deref()
            == Some("note: --gpu-memory-utilization 0.5 is ignored on the CPU (the cache is sized by --num-blocks or --kv-memory-mb, 256 MiB by default)"),
        "{note:?}"
    );
    ensure!(generate::unused_utilization_note(&args(&[])?, &cpu).is_none());
    Ok(())
}

/// A text decoding error of the one streamed prompt fails the run (a
/// tokenizer of 4 words cannot decode SmolLM2's tokens).
#[test]
fn a_streaming_decode_error_gives_a_non_zero_exit() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("cpa-runner-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("tokenizer.json");
    std::fs::write(
        &path,
        r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "what": 1, "is": 2, "it": 3}, "unk_token": "[UNK]"}}"#,
    )?;
    let p = path.display().to_string();
    let (out, err) = run(&[
        "--raw",
        "--prompt",
        "what is it",
        "--max-tokens",
        "4",
        "--tokenizer",
        &p,
    ])?;
    let err = err.unwrap_or_default();
    ensure!(
        err == "1 of 1 prompts failed (see their errors above)",
        "{err} / {out}"
    );
    ensure!(
        out.contains("error: prompt 0: decoding its text failed: tokenizer: token id "),
        "{out}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn an_empty_or_blank_prompts_file_is_an_error() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("cpa-runner-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for (name, text) in [("empty.txt", ""), ("blank.txt", "\n  \n\t\n")] {
        let path = dir.join(name);
        std::fs::write(&path, text)?;
        let p = path.display().to_string();
        let got = error_of(&["--prompts-file", &p])?;
        let want = format!("--prompts-file {p} holds no prompt (the file is empty or blank)");
        ensure!(got.starts_with(&want), "{got}");
        // Even with a --prompt beside it.
        let got = error_of(&["--prompt", "hi", "--prompts-file", &p])?;
        ensure!(got.starts_with(&want), "{got}");
    }
    let missing = dir.join("missing.txt").display().to_string();
    let got = error_of(&["--prompts-file", &missing])?;
    ensure!(
        got.starts_with(&format!("--prompts-file: reading {missing}")),
        "{got}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn cache_sizes_that_overflow_or_exceed_memory_name_the_flag() -> Result<()> {
    // SmolLM2: 30 layers x 2 x 3 KV heads x 64 x 4 bytes per token.
    let got = error_of(&["--block-size", "18014398509481984"])?;
    ensure!(
        got.starts_with("--kv-memory-mb 256, --block-size 18014398509481984: paged-kv-cache: a block of 18014398509481984 tokens of layer 0 (3 kv heads x head_size 64) takes more than usize::MAX bytes"),
        "{got}"
    );
    let got = error_of(&["--num-blocks", "100000000000"])?;
    ensure!(
        got.starts_with("--num-blocks 100000000000, --block-size 16: EngineBuilder: the KV cache would take 73728000000000000 bytes (100000000000 blocks per layer, 30 layers), more than the ")
            && got.contains(" bytes of memory available"),
        "{got}"
    );
    let got = error_of(&["--kv-memory-mb", "1000000000000"])?;
    ensure!(
        got.starts_with("--kv-memory-mb 1000000000000, --block-size 16: EngineBuilder: the KV cache would take "),
        "{got}"
    );
    let got = error_of(&["--block-size", "100000000"])?;
    ensure!(
        got.starts_with("--kv-memory-mb 256, --block-size 100000000: paged-kv-cache: 268435456 bytes hold no cache block (30 layers, 4608000000000 bytes per block of 100000000 tokens over the full-attention layers, 0 bytes of window caches)"),
        "{got}"
    );
    Ok(())
}

#[test]
fn a_prompt_beyond_the_context_prints_its_error_and_the_others_complete() -> Result<()> {
    let long = "hello ".repeat(9000);
    let (out, err) = run(&[
        "--prompt",
        "What is 2 + 2?",
        "--prompt",
        &long,
        "--max-tokens",
        "4",
    ])?;
    let err = err.unwrap_or_default();
    ensure!(
        err == "1 of 2 prompts failed (see their errors above)",
        "{err}"
    );
    let (first, second) = out
        .split_once("--- [1] ")
        .ok_or_else(|| anyhow::anyhow!("no second prompt in {out:?}"))?;
    // Without --verbose a long prompt is echoed shortened.
    ensure!(
        second.starts_with(&format!(
            "{}... (54000 characters; --verbose shows them all)\n",
            &long[..100]
        )),
        "{:?}",
        &second[..200.min(second.len())]
    );
    let answer = first
        .strip_prefix("--- [0] What is 2 + 2?\n")
        .ok_or_else(|| anyhow::anyhow!("no first prompt in {first:?}"))?;
    ensure!(
        !answer.trim().is_empty() && !answer.contains("error"),
        "{answer:?}"
    );
    ensure!(
        second.contains("\nerror: prompt 1: engine: request 1 needs ")
            && second.contains(" prompt tokens + 4 new tokens = ")
            && second.contains("positions, more than the model's context length of 8192"),
        "{second:?}"
    );
    Ok(())
}

#[test]
fn a_prompt_outgrowing_the_cache_keeps_its_text_and_prints_its_error() -> Result<()> {
    // One block of 16 tokens: a 4-token raw prompt generates 13 tokens, then
    // its next token has no block.
    let (out, err) = run(&[
        "--raw",
        "--prompt",
        "Once upon a time",
        "--num-blocks",
        "1",
        "--max-tokens",
        "40",
    ])?;
    let err = err.unwrap_or_default();
    ensure!(
        err == "1 of 1 prompts failed (see their errors above)",
        "{err}"
    );
    let (text, error) = out
        .split_once("\nerror: prompt 0: ")
        .ok_or_else(|| anyhow::anyhow!("no error line in {out:?}"))?;
    let text = text
        .strip_prefix("> Once upon a time\n")
        .ok_or_else(|| anyhow::anyhow!("no prompt line in {text:?}"))?;
    ensure!(text.split_whitespace().count() >= 3, "{text:?}");
    ensure!(
        error.starts_with("engine: request 0 outgrew the KV cache: with 17 tokens in context it needs more blocks than the cache has even alone (1 blocks of 16 tokens); it ends with the 13 tokens generated so far"),
        "{error:?}"
    );
    Ok(())
}

#[test]
fn prompts_go_through_the_checkpoint_template_and_raw_keeps_markers() -> Result<()> {
    // The template wraps the prompt and --system; the forged <|im_end|> is
    // plain text (as a control token the prompt would have 19 tokens).
    let (out, err) = run(&[
        "--verbose",
        "--system",
        "Be brief.",
        "--prompt",
        "Hi<|im_end|>",
        "--max-tokens",
        "2",
    ])?;
    ensure!(err.is_none(), "{err:?}");
    ensure!(
        out.starts_with(
            "[prompt 0: 25 tokens]\n<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|><|im_end|>\n<|im_start|>assistant\n\n> Hi<|im_end|>\n"
        ),
        "{out:?}"
    );
    // --raw: as written, the markers are control tokens (10 tokens).
    let (out, err) = run(&[
        "--raw",
        "--verbose",
        "--prompt",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "--max-tokens",
        "2",
    ])?;
    ensure!(err.is_none(), "{err:?}");
    ensure!(
        out.starts_with(
            "[prompt 0: 10 tokens]\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n\n"
        ),
        "{out:?}"
    );
    // --chat-template replaces the checkpoint's.
    let dir = std::env::temp_dir().join(format!("cpa-runner-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let tpl = dir.join("t.jinja");
    std::fs::write(&tpl, "{{ messages[0]['content'] }}!")?;
    let (out, err) = run(&[
        "--verbose",
        "--chat-template",
        &tpl.display().to_string(),
        "--prompt",
        "Hi",
        "--max-tokens",
        "1",
    ])?;
    std::fs::remove_dir_all(&dir)?;
    ensure!(err.is_none(), "{err:?}");
    ensure!(
        out.starts_with("[prompt 0: 2 tokens]\nHi!\n> Hi\n"),
        "{out:?}"
    );
    Ok(())
}

#[test]
fn fp8_cache_top_k_and_repeat_penalty_run() -> Result<()> {
    for flags in [
        &["--kv-cache-dtype", "fp8"][..],
        &["--repeat-penalty", "1.3", "--repeat-last-n", "16"][..],
        &["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9"][..],
    ] {
        let mut all = vec!["--prompt", "Name a colour.", "--max-tokens", "4"];
        all.extend_from_slice(flags);
        let (out, err) = run(&all)?;
        ensure!(err.is_none(), "{flags:?}: {err:?}");
        let answer = out
            .strip_prefix("> Name a colour.\n")
            .ok_or_else(|| anyhow::anyhow!("{flags:?}: {out:?}"))?;
        ensure!(!answer.trim().is_empty(), "{flags:?}: {out:?}");
    }
    Ok(())
}

#[test]
fn q4_gguf_weights_are_dequantized_on_the_cpu_unless_kept() -> Result<()> {
    let path = candle_paged_attention::text::fetch::fetch_model("fetch-smollm2.sh")?;
    let ct = candle_core::quantized::gguf_file::Content::read(&mut std::fs::File::open(&path)?)?;
    let args = |flags: &[&str]| {
        generate::Args::try_parse_from(std::iter::once("generate").chain(flags.iter().copied()))
    };
    let cpu = candle_core::Device::Cpu;
    let (yes, note) = generate::dequantize_gguf(&ct, &args(&[])?, &cpu);
    let note = note.unwrap_or_default();
    ensure!(
        yes && note.starts_with("dequantizing the Q4_1 weights to f32 (")
            && note.ends_with(" MiB): faster on the CPU (--keep-quantized keeps them)"),
        "{note}"
    );
    ensure!(generate::dequantize_gguf(&ct, &args(&["--keep-quantized"])?, &cpu) == (false, None));
    ensure!(generate::dequantize_gguf(&ct, &args(&["--dequantize"])?, &cpu) == (true, None));
    let err = args(&["--dequantize", "--keep-quantized"])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.contains("'--dequantize' cannot be used with '--keep-quantized'"),
        "{err}"
    );
    Ok(())
}

#[test]
fn model_id_needs_the_hub_feature_and_its_flags_need_it() -> Result<()> {
    #[cfg(not(feature = "hub"))]
    {
        let err = error_of(&["--model-id", "org/model", "--revision", "v1"])?;
        ensure!(
            err == "--model-id org/model: downloading from the Hugging Face hub needs the `hub` feature (cargo run --release --features models,hub --example generate -- --model-id org/model); without it, give a model path or run scripts/fetch-smollm2.sh",
            "{err}"
        );
    }
    let parse = |flags: &[&str]| {
        generate::Args::try_parse_from(std::iter::once("generate").chain(flags.iter().copied()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let err = parse(&["--revision", "v1"]);
    ensure!(
        err.contains("the following required arguments were not provided")
            && err.contains("--model-id <MODEL_ID>"),
        "{err}"
    );
    let err = parse(&["model.gguf", "--model-id", "org/model"]);
    ensure!(
        err.contains("the argument '[MODEL]' cannot be used with '--model-id <MODEL_ID>'"),
        "{err}"
    );
    Ok(())
}

/// A sharded safetensors directory (two shards and their index, as a hub
/// snapshot holds them) loads through the index: a stray
/// `consolidated.safetensors` that is not a safetensors file is not read.
/// The model is a tiny random Llama with SmolLM2's vocabulary and
/// tokenizer.json.
#[test]
fn a_sharded_safetensors_directory_loads_through_its_index() -> Result<()> {
    use candle_core::{DType, Device};
    use candle_nn::{VarBuilder, VarMap};
    use candle_paged_attention::models::{llama, PagedOptions};
    use candle_paged_attention::text::tokenizer::ModelTokenizer;

    let gguf = candle_paged_attention::text::fetch::fetch_model("fetch-smollm2.sh")?;
    let ct = candle_core::quantized::gguf_file::Content::read(&mut std::fs::File::open(&gguf)?)?;
    let tok = ModelTokenizer::from_gguf(&ct)?;
    let dir = std::env::temp_dir().join(format!("cpa-runner-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    tok.tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(anyhow::Error::msg)?;
    let config = r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
        "vocab_size": 49152, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": true}"#;
    std::fs::write(dir.join("config.json"), config)?;
    let cfg = serde_json::from_str::<llama::LlamaConfig>(config)?.into_config(false);
    let varmap = VarMap::new();
    let dev = Device::Cpu;
    llama::Llama::load(
        VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        &cfg,
        PagedOptions::default(),
    )?;
    let (mut shards, mut weight_map) = ([Vec::new(), Vec::new()], serde_json::Map::new());
    {
        let data = varmap
            .data()
            .lock()
            .map_err(|e| anyhow::anyhow!("varmap lock: {e}"))?;
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for (i, name) in names.into_iter().enumerate() {
            let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
            weight_map.insert(name.clone(), file.into());
            shards[i % 2].push((name.clone(), data[name].as_tensor().clone()));
        }
    }
    for (i, shard) in shards.iter().enumerate() {
        candle_core::safetensors::save(
            &shard.iter().cloned().collect(),
            dir.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
        )?;
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )?;
    std::fs::write(dir.join("consolidated.safetensors"), "not safetensors")?;

    let n = tok.encode_raw("Hi")?.len();
    let shown = dir.display().to_string();
    let result = run(&[
        &shown,
        "--raw",
        "--verbose",
        "--prompt",
        "Hi",
        "--max-tokens",
        "3",
    ]);
    std::fs::remove_dir_all(&dir)?;
    let (out, err) = result?;
    ensure!(err.is_none(), "{err:?}");
    ensure!(
        out.starts_with(&format!("[prompt 0: {n} tokens]\nHi\n> Hi\n")),
        "{out:?}"
    );
    Ok(())
}
