//! The OpenAI-compatible server over HTTP on a loopback port, with a tiny
//! random-weight Llama and a one-character-per-token tokenizer: answers
//! (whole and streamed) against the engine run offline, concurrent
//! streams, client disconnects, error bodies, stop strings, metrics and
//! shutdown.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use candle_paged_attention::engine::{Engine, Request, SamplingParams, SchedulerConfig};
use candle_paged_attention::models::{llama, CacheConfig, PagedKvCache, PagedModel, PagedOptions};
use candle_paged_attention::server::{serve, LoadedModel, ServeConfig, Server};
use candle_paged_attention::text::chat::{ChatMessage, ChatTemplate};
use candle_paged_attention::text::tokenizer::{ModelTokenizer, SpecialTokens};
use serde_json::{json, Value};
use tokio::sync::oneshot;

const EOS: u32 = 2;
/// Long enough that an answer of `LONG` tokens takes seconds, so that
/// clients can go away in the middle of it.
const CONTEXT: usize = 16384;
const LONG: usize = 16000;
const NUM_BLOCKS: usize = 1024;
const TEMPLATE: &str = "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";

/// `<unk>`, `<s>`, `</s>`, then one token per printable ASCII character.
fn vocab() -> Vec<String> {
    let mut v = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    v.extend((32u8..127).map(|b| (b as char).to_string()));
    v.push("\n".into());
    v
}

fn tokenizer() -> ModelTokenizer {
    let vocab: serde_json::Map<String, Value> = vocab()
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, json!(i)))
        .collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(1, "<s>"), special(2, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(?s)."},
                          "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    let tokenizer: tokenizers::Tokenizer = spec.to_string().parse().expect("tokenizer json");
    ModelTokenizer {
        tokenizer,
        special: SpecialTokens {
            bos: Some(1),
            eos: Some(EOS),
            add_bos: true,
            add_eos: false,
            stop: vec![EOS],
        },
        chat_template: Some(TEMPLATE.into()),
    }
}

fn config() -> llama::Config {
    let cfg: llama::LlamaConfig = serde_json::from_value(json!({
        "hidden_size": 32, "intermediate_size": 48, "vocab_size": vocab().len(),
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": CONTEXT
    }))
    .expect("config");
    cfg.into_config(false)
}

/// The model over `varmap` (random weights the first time, the same ones
/// after).
fn model(varmap: &VarMap) -> llama::Llama {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    llama::Llama::load(vb, &config(), PagedOptions::default()).expect("llama")
}

fn cache(model: &llama::Llama) -> PagedKvCache {
    PagedKvCache::new(
        &model.attention_layers(),
        CacheConfig::new(NUM_BLOCKS),
        DType::F32,
        &Device::Cpu,
    )
    .expect("cache")
}

/// Random weights: a model over a fresh `VarMap` creates its variables,
/// then each is overwritten with seeded values (norm weights around 1, the
/// rest `N(0, 0.5)`), so that greedy answers vary from token to token.
fn weights(seed: u64) -> VarMap {
    use rand::SeedableRng;
    use rand_distr::{Distribution, Normal};
    let varmap = VarMap::new();
    let _ = model(&varmap);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0f64, 1.0).unwrap();
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let var = &data[name];
        let (center, scale) = if name.contains("norm") {
            (1.0, 0.2)
        } else {
            (0.0, 0.5)
        };
        let v: Vec<f32> = (0..var.elem_count())
            .map(|_| (center + scale * normal.sample(&mut rng)) as f32)
            .collect();
        var.set(&candle_core::Tensor::from_vec(v, var.shape(), var.device()).unwrap())
            .unwrap();
    }
    drop(data);
    varmap
}

/// The tokens the engine generates offline, greedy, for each prompt (run
/// together in one batch), with `stop_tokens`.
fn offline(varmap: &VarMap, prompts: &[Vec<u32>], max_tokens: usize, eos: bool) -> Vec<Vec<u32>> {
    let model = model(varmap);
    let mut engine = Engine::new(&model, cache(&model), SchedulerConfig::default()).unwrap();
    for (id, p) in prompts.iter().enumerate() {
        let mut params = SamplingParams::greedy(max_tokens);
        if eos {
            params.stop_tokens = vec![EOS];
        }
        engine
            .add_request(Request {
                id: id as u64,
                prompt: p.clone(),
                params,
            })
            .unwrap();
    }
    let mut done = engine.run(|_| {}).unwrap();
    done.sort_by_key(|c| c.id);
    done.into_iter().map(|c| c.tokens).collect()
}

/// The answer's text: the tokens decoded, the stop token left out.
fn text_of(tokens: &[u32]) -> String {
    let tok = tokenizer();
    let kept: Vec<u32> = tokens.iter().copied().filter(|&t| t != EOS).collect();
    tok.tokenizer.decode(&kept, true).unwrap()
}

fn encode(text: &str) -> Vec<u32> {
    tokenizer().encode_raw(text).unwrap()
}

struct Running {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    client: reqwest::Client,
}

impl Running {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let resp = self
            .client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path}: status {status}, body {text:?} is not JSON: {e}"));
        (status, value)
    }

    /// A streamed answer's `data:` payloads, `[DONE]` included.
    async fn post_stream(&self, path: &str, body: Value) -> Vec<String> {
        let resp = self
            .client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{path}");
        let ct = resp.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        sse_data(&resp.text().await.unwrap())
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = self
            .client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                (k == name).then(|| v.parse().unwrap())
            })
            .unwrap_or(0.0)
    }

    /// Waits until `/metrics` shows no KV block in use and no request.
    async fn wait_idle(&self, within: Duration) {
        let start = Instant::now();
        loop {
            let used = self.metric("kv_cache_blocks_used").await;
            let running = self.metric("num_requests_running").await;
            let waiting = self.metric("num_requests_waiting").await;
            if used == 0.0 && running == 0.0 && waiting == 0.0 {
                return;
            }
            assert!(
                start.elapsed() < within,
                "still {used} blocks used, {running} running, {waiting} waiting after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn shutdown(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("serve returned in time")
            .unwrap()
            .unwrap();
    }
}

fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.lines()
                .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect()
}

/// The text of streamed chunks (chat deltas or completion texts), the
/// finish reason, and the usage chunk if any.
fn stream_text(events: &[String]) -> (String, Option<String>, Option<Value>) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let (mut text, mut finish, mut usage) = (String::new(), None, None);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "error event {v}");
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
                text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                assert!(finish.is_none(), "two finish reasons in {events:?}");
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish, usage)
}

async fn start(varmap: &VarMap, config: ServeConfig) -> Running {
    let vm = varmap.clone();
    let server = Server::start(
        move || {
            let model = model(&vm);
            let cache = cache(&model);
            let tok = tokenizer();
            let template = ChatTemplate::new(TEMPLATE, "<s>", "</s>")?;
            Ok(LoadedModel {
                model: Box::new(model),
                cache,
                tokenizer: tok,
                chat_template: Some(template),
                name: "tiny-llama".into(),
            })
        },
        config,
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, server, async move {
        let _ = stopped.await;
    }));
    Running {
        addr,
        stop: Some(stop),
        task,
        client: reqwest::Client::new(),
    }
}

fn prompt_text(k: usize) -> String {
    format!("Prompt {k}: the {} quick brown fox", "very ".repeat(k % 5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_match_the_offline_engine() {
    let varmap = weights(1);
    let server = start(&varmap, ServeConfig::default()).await;

    // Completions: a text prompt and a token-id prompt, whole and streamed.
    let text_prompt = "Hello there";
    let ids = vec![1u32, 40, 50, 60, 70, 80];
    let expected = offline(&varmap, &[encode(text_prompt), ids.clone()], 24, true);
    for (k, prompt) in [json!(text_prompt), json!(ids)].into_iter().enumerate() {
        let want = text_of(&expected[k]);
        let body =
            json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 24, "temperature": 0});
        let (status, v) = server.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], want.as_str(), "prompt {k}");
        let prompt_len = if k == 0 {
            encode(text_prompt).len()
        } else {
            ids.len()
        };
        assert_eq!(v["usage"]["prompt_tokens"], prompt_len);
        assert_eq!(v["usage"]["completion_tokens"], expected[k].len());
        let finish = if expected[k].last() == Some(&EOS) {
            "stop"
        } else {
            "length"
        };
        assert_eq!(v["choices"][0]["finish_reason"], finish);

        let mut body = body;
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let events = server.post_stream("/v1/completions", body.clone()).await;
        let (text, f, usage) = stream_text(&events);
        assert_eq!(text, want, "streamed prompt {k}");
        assert_eq!(f.as_deref(), Some(finish));
        let usage = usage.expect("usage chunk");
        assert_eq!(usage["completion_tokens"], expected[k].len());
        assert_eq!(usage["total_tokens"], expected[k].len() + prompt_len);
        assert!(
            events.iter().all(|e| !e.contains("token_ids")),
            "token_ids only when asked for"
        );

        // vLLM's return_token_ids: the generated ids, whole and chunk by
        // chunk (a stop token included).
        body["return_token_ids"] = json!(true);
        let events = server.post_stream("/v1/completions", body.clone()).await;
        let streamed_ids: Vec<u64> = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| v["choices"][0]["token_ids"].as_array().cloned())
            .flatten()
            .map(|id| id.as_u64().expect("an id"))
            .collect();
        let want_ids: Vec<u64> = expected[k].iter().map(|&t| u64::from(t)).collect();
        assert_eq!(streamed_ids, want_ids, "streamed token_ids, prompt {k}");
        body["stream"] = json!(false);
        let (status, v) = server.post("/v1/completions", body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["token_ids"], json!(want_ids), "prompt {k}");
    }

    // Chat: the template's prompt, whole and streamed.
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi!"),
    ];
    let rendered = ChatTemplate::new(TEMPLATE, "<s>", "</s>")
        .unwrap()
        .render(&messages, true)
        .unwrap();
    let chat_ids = tokenizer()
        .tokenizer
        .encode(rendered.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(chat_ids[0], 1, "the template writes BOS");
    let want = text_of(&offline(&varmap, std::slice::from_ref(&chat_ids), 16, true)[0]);
    let body = json!({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}],
        "max_completion_tokens": 16, "temperature": 0.0
    });
    let (status, v) = server.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["usage"]["prompt_tokens"], chat_ids.len());
    let mut body = body;
    body["stream"] = json!(true);
    let events = server.post_stream("/v1/chat/completions", body).await;
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (text, _, usage) = stream_text(&events);
    assert_eq!(text, want);
    assert!(usage.is_none(), "no usage chunk unless asked for");

    // Models, health, metrics.
    let models: Value = server
        .client
        .get(server.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-llama");
    let health = server
        .client
        .get(server.url("/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
    server.wait_idle(Duration::from_secs(5)).await;
    assert_eq!(
        server.metric("kv_cache_blocks_total").await,
        NUM_BLOCKS as f64
    );
    assert!(server.metric("generation_tokens_total").await >= 24.0);
    assert!(server.metric("time_to_first_token_seconds_count").await >= 6.0);
    assert!(server.metric("inter_token_latency_seconds_count").await >= 1.0);
    assert!(server.metric("prompt_tokens_total").await > 0.0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_streams_get_their_own_tokens() {
    let varmap = weights(2);
    let server = std::sync::Arc::new(start(&varmap, ServeConfig::default()).await);
    let n = 32;
    let prompts: Vec<Vec<u32>> = (0..n).map(|k| encode(&prompt_text(k))).collect();
    let expected = offline(&varmap, &prompts, 20, false);
    let mut tasks = Vec::new();
    for k in 0..n {
        let server = server.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"prompt": prompt_text(k), "max_tokens": 20, "temperature": 0,
                              "ignore_eos": true, "stream": true});
            let events = server.post_stream("/v1/completions", body).await;
            stream_text(&events)
        }));
    }
    for (k, t) in tasks.into_iter().enumerate() {
        let (text, finish, _) = t.await.unwrap();
        assert_eq!(text, text_of(&expected[k]), "client {k}");
        assert_eq!(finish.as_deref(), Some("length"));
    }
    server.wait_idle(Duration::from_secs(5)).await;
    let server = std::sync::Arc::into_inner(server).unwrap();
    server.shutdown().await;
}

/// A seeded sampled request (top-p, min-p and penalties) gets the same
/// tokens alone and beside concurrent requests; other seeds get others.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seeded_sampled_requests_repeat_alone_or_in_a_batch() {
    let varmap = weights(4);
    let server = std::sync::Arc::new(start(&varmap, ServeConfig::default()).await);
    let body = |seed: u64| {
        json!({"prompt": prompt_text(2), "max_tokens": 16, "temperature": 1.2, "top_p": 0.95,
               "min_p": 0.01, "frequency_penalty": 0.5, "presence_penalty": 0.25,
               "repetition_penalty": 1.1, "seed": seed, "ignore_eos": true,
               "return_token_ids": true})
    };
    let ids = |v: &Value| v["choices"][0]["token_ids"].clone();
    let (status, alone) = server.post("/v1/completions", body(7)).await;
    assert_eq!(status, 200, "{alone}");
    let alone = ids(&alone);
    assert_eq!(alone.as_array().map(Vec::len), Some(16), "{alone}");
    let mut tasks = Vec::new();
    for k in 0..8u64 {
        let server = server.clone();
        // Even clients repeat seed 7; odd ones use seeds of their own.
        let seed = if k % 2 == 0 { 7 } else { 100 + k };
        let b = body(seed);
        tasks.push(tokio::spawn(async move {
            let (status, v) = server.post("/v1/completions", b).await;
            assert_eq!(status, 200, "{v}");
            (seed, ids(&v))
        }));
    }
    let mut others = Vec::new();
    for t in tasks {
        let (seed, got) = t.await.unwrap();
        if seed == 7 {
            assert_eq!(got, alone, "seed 7 in a batch");
        } else {
            others.push(got);
        }
    }
    assert!(
        others.iter().any(|o| *o != alone),
        "four other seeds all gave seed 7's tokens: {alone}"
    );
    server.wait_idle(Duration::from_secs(5)).await;
    let server = std::sync::Arc::into_inner(server).unwrap();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disconnected_clients_free_their_blocks() {
    let varmap = weights(3);
    let server = start(&varmap, ServeConfig::default()).await;
    let long = json!({"prompt": "Tell me everything.", "max_tokens": LONG, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    // Streaming: read the first chunks, then drop the connection.
    let mut resp = server
        .client
        .post(server.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    let mut seen = 0;
    while seen < 3 {
        let chunk = resp.chunk().await.unwrap().expect("a chunk");
        seen += String::from_utf8_lossy(&chunk).matches("data:").count();
    }
    assert!(server.metric("kv_cache_blocks_used").await > 0.0);
    drop(resp);
    server.wait_idle(Duration::from_secs(2)).await;
    assert_eq!(
        server
            .metric("requests_finished_total{finish_reason=\"aborted\"}")
            .await,
        1.0
    );

    // Not streaming: the client gives up (times out) and closes.
    let mut whole = long.clone();
    whole["stream"] = json!(false);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let err = client
        .post(server.url("/v1/completions"))
        .json(&whole)
        .send()
        .await
        .expect_err("the answer takes longer than the timeout");
    assert!(err.is_timeout(), "{err}");
    server.wait_idle(Duration::from_secs(2)).await;
    assert_eq!(
        server
            .metric("requests_finished_total{finish_reason=\"aborted\"}")
            .await,
        2.0
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stop_strings_split_across_tokens() {
    let varmap = weights(2);
    let server = start(&varmap, ServeConfig::default()).await;
    let prompt = "Once upon a time";
    let full = text_of(&offline(&varmap, &[encode(prompt)], 40, false)[0]);
    // (Special tokens, when generated, have no text.)
    assert!(full.chars().count() >= 30, "{full:?}");
    let distinct: std::collections::HashSet<char> = full.chars().collect();
    assert!(distinct.len() >= 5, "a varied answer: {full:?}");
    // Two and three characters (tokens) from the middle of the answer.
    let chars: Vec<char> = full.chars().collect();
    for (a, b) in [(10usize, 12usize), (20, 23)] {
        let stop: String = chars[a..b].iter().collect();
        let want = &full[..full.find(&stop).unwrap()];
        let body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true,
                          "stop": ["never-generated-string", stop]});
        let (status, v) = server.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want, "stop {stop:?} in {full:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let mut body = body;
        body["stream"] = json!(true);
        body["stop"] = json!(stop);
        let (text, finish, _) = stream_text(&server.post_stream("/v1/completions", body).await);
        assert_eq!(text, want, "streamed, stop {stop:?} in {full:?}");
        assert_eq!(finish.as_deref(), Some("stop"));
    }
    server.wait_idle(Duration::from_secs(2)).await;
    server.shutdown().await;
}

fn assert_error(status: u16, v: &Value, want_status: u16, param: Option<&str>, words: &[&str]) {
    assert_eq!(status, want_status, "{v}");
    let e = &v["error"];
    let msg = e["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no message in {v}"));
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
    for w in words {
        assert!(msg.contains(w), "{msg:?} does not name {w:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refusals_use_openai_error_bodies() {
    let varmap = weights(3);
    let config = ServeConfig {
        max_waiting: 1,
        max_body_bytes: 64 << 10,
        scheduler: SchedulerConfig {
            max_batch_tokens: 64,
            max_num_seqs: 1,
        },
        ..ServeConfig::default()
    };
    let server = start(&varmap, config).await;
    let c = "/v1/completions";
    let post = |body: Value| server.post(c, body);

    let (s, v) = post(json!({"prompt": "hi", "n": 2})).await;
    assert_error(s, &v, 400, Some("n"), &["/v1/completions", "n = 2"]);
    let (s, v) = post(json!({"prompt": "hi", "logprobs": 3})).await;
    assert_error(s, &v, 400, Some("logprobs"), &["logprobs"]);
    let (s, v) = post(json!({"prompt": "hi", "frequency_penalty": 2.5})).await;
    assert_error(s, &v, 400, Some("frequency_penalty"), &["[-2, 2]", "2.5"]);
    let (s, v) = post(json!({"prompt": "hi", "presence_penalty": -3})).await;
    assert_error(s, &v, 400, Some("presence_penalty"), &["[-2, 2]", "-3"]);
    let (s, v) = post(json!({"prompt": "hi", "temperature": 1e300})).await;
    assert_error(s, &v, 400, Some("temperature"), &["at most", "1e300"]);
    let (s, v) = post(json!({"prompt": "hi", "min_p": 1.5})).await;
    assert_error(s, &v, 400, Some("min_p"), &["[0, 1]", "1.5"]);
    let (s, v) = post(json!({"prompt": "hi", "temperature": "hot"})).await;
    assert_error(s, &v, 400, Some("temperature"), &["temperature"]);
    let (s, v) = post(json!({"prompt": "hi", "max_tokens": CONTEXT + 1})).await;
    let (over, ctx) = ((CONTEXT + 1).to_string(), CONTEXT.to_string());
    assert_error(
        s,
        &v,
        400,
        Some("max_tokens"),
        &[&over, &ctx, "3 prompt tokens"],
    );
    let (s, v) = post(json!({"prompt": [1, 5, 9999]})).await;
    assert_error(
        s,
        &v,
        400,
        Some("prompt"),
        &["prompt[2]", "9999", &vocab().len().to_string()],
    );
    let (s, v) = post(json!({"prompt": "x".repeat(CONTEXT)})).await;
    assert_error(s, &v, 400, Some("prompt"), &[&over, &ctx]);
    let (s, v) = post(json!({"prompt": ["a", "b"]})).await;
    assert_error(s, &v, 400, Some("prompt"), &["2 prompts"]);
    let (s, v) = post(json!({"prompt": "hi", "stop": vec!["s"; 17]})).await;
    assert_error(s, &v, 400, Some("stop"), &["17 stop strings", "16"]);
    let (s, v) = post(json!({"prompt": "hi", "stop": ["ok", "x".repeat(300)]})).await;
    assert_error(s, &v, 400, Some("stop"), &["stop string 1", "300 bytes"]);
    let (s, v) = post(json!({"prompt": "hi", "model": "gpt-4"})).await;
    assert_error(s, &v, 404, Some("model"), &["gpt-4", "tiny-llama"]);
    let (s, v) = server
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 7}]}),
        )
        .await;
    assert_error(
        s,
        &v,
        400,
        Some("messages[0].content"),
        &["messages[0].content"],
    );
    let (s, v) = server
        .post("/v1/chat/completions", json!({"prompt": "hi"}))
        .await;
    assert_error(s, &v, 400, None, &["messages"]);

    // Malformed JSON, an unknown route, a body over the limit.
    let raw = |path: &str, body: String| {
        server
            .client
            .post(server.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let resp = raw(c, "{\"prompt\": \"hi\",".into()).await.unwrap();
    let (s, v) = (resp.status().as_u16(), resp.json::<Value>().await.unwrap());
    assert_error(s, &v, 400, None, &["not valid JSON"]);
    let resp = raw("/v1/nothing", "{}".into()).await.unwrap();
    let (s, v) = (resp.status().as_u16(), resp.json::<Value>().await.unwrap());
    assert_error(s, &v, 404, None, &["/v1/nothing"]);
    let resp = server.client.get(server.url(c)).send().await.unwrap();
    let (s, v) = (resp.status().as_u16(), resp.json::<Value>().await.unwrap());
    assert_error(s, &v, 405, None, &["GET"]);
    let big = json!({"prompt": "y".repeat(100 << 10)}).to_string();
    let resp = raw(c, big).await.unwrap();
    let (s, v) = (resp.status().as_u16(), resp.json::<Value>().await.unwrap());
    assert_error(s, &v, 413, None, &["limit"]);

    // 429: one request runs, one waits, the third is refused.
    let long = json!({"prompt": "Go on.", "max_tokens": LONG / 2, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut first = server
        .client
        .post(server.url(c))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status().as_u16(), 200);
    first
        .chunk()
        .await
        .unwrap()
        .expect("the first request runs");
    let second = server
        .client
        .post(server.url(c))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(second.status().as_u16(), 200, "the second request waits");
    let (s, v) = post(json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_error(s, &v, 429, None, &["busy", "1 of 1"]);
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(
        server
            .metric("requests_refused_total{status=\"429\"}")
            .await,
        1.0
    );
    drop(first);
    drop(second);
    server.wait_idle(Duration::from_secs(3)).await;
    // The server still answers.
    let (s, v) = post(json!({"prompt": "hi", "max_tokens": 2, "temperature": 0})).await;
    assert_eq!(s, 200, "{v}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_fails_requests_left_after_the_deadline() {
    let varmap = weights(3);
    let config = ServeConfig {
        shutdown_timeout: Duration::from_millis(300),
        ..ServeConfig::default()
    };
    let server = start(&varmap, config).await;
    let long = json!({"prompt": "Go on.", "max_tokens": LONG, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut resp = server
        .client
        .post(server.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    resp.chunk().await.unwrap().expect("a first chunk");
    let reader = tokio::spawn(async move {
        let mut body = String::new();
        while let Ok(Some(chunk)) = resp.chunk().await {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        body
    });
    let addr = server.addr;
    let began = Instant::now();
    server.shutdown().await;
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "{:?}",
        began.elapsed()
    );
    let body = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .unwrap()
        .unwrap();
    assert!(
        body.contains("shutting down"),
        "the stream ends with an error: {body:?}"
    );
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body:?}");
    // No longer accepting.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

/// A model whose next `failures` forward passes fail (a device error, say).
struct Flaky {
    inner: llama::Llama,
    failures: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl PagedModel for Flaky {
    fn attention_layers(&self) -> Vec<&candle_paged_attention::Attention> {
        self.inner.attention_layers()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_seq_len(&self) -> usize {
        self.inner.max_seq_len()
    }
    fn device(&self) -> &Device {
        self.inner.device()
    }
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn forward(
        &self,
        input_ids: &candle_core::Tensor,
        metadata: &candle_paged_attention::AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> candle_core::Result<candle_core::Tensor> {
        use std::sync::atomic::Ordering;
        let left = self.failures.load(Ordering::SeqCst);
        if left > 0 {
            self.failures.store(left - 1, Ordering::SeqCst);
            candle_core::bail!("injected forward failure ({left} left)");
        }
        self.inner.forward(input_ids, metadata, cache, rows)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_steps_are_retried_then_fail_the_requests() {
    use std::sync::atomic::Ordering;
    let varmap = weights(4);
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (vm, f) = (varmap.clone(), failures.clone());
    let server = Server::start(
        move || {
            let inner = model(&vm);
            let cache = cache(&inner);
            Ok(LoadedModel {
                model: Box::new(Flaky { inner, failures: f }),
                cache,
                tokenizer: tokenizer(),
                chat_template: None,
                name: "flaky".into(),
            })
        },
        ServeConfig {
            step_retries: 3,
            ..ServeConfig::default()
        },
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, server, async move {
        let _ = stopped.await;
    }));
    let server = Running {
        addr,
        stop: Some(stop),
        task,
        client: reqwest::Client::new(),
    };
    let prompt = "Retry me";
    let want = text_of(&offline(&varmap, &[encode(prompt)], 12, false)[0]);
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true});

    // Three failures in a row are retried: the answer is the same.
    failures.store(3, Ordering::SeqCst);
    let (s, v) = server.post("/v1/completions", body.clone()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(failures.load(Ordering::SeqCst), 0);
    assert_eq!(server.metric("engine_step_failures_total").await, 3.0);

    // A fourth fails the request with 500, whole or streamed.
    failures.store(4, Ordering::SeqCst);
    let (s, v) = server.post("/v1/completions", body.clone()).await;
    assert_error(s, &v, 500, None, &["injected forward failure", "4 times"]);
    assert_eq!(v["error"]["type"], "server_error");
    failures.store(4, Ordering::SeqCst);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = server
        .post_stream("/v1/completions", streamed.clone())
        .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let err: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("injected forward failure"),
        "{events:?}"
    );
    server.wait_idle(Duration::from_secs(2)).await;

    // The engine goes on with the next requests.
    let (s, v) = server.post("/v1/completions", body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    let (text, _, _) = stream_text(&server.post_stream("/v1/completions", streamed).await);
    assert_eq!(text, want);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_error_ends_only_that_request() {
    let varmap = weights(5);
    let healthy = "Healthy prompt";
    let healthy_ids = encode(healthy);
    let out = offline(&varmap, std::slice::from_ref(&healthy_ids), 200, false).remove(0);
    // A printable token neither in the healthy prompt nor in its answer:
    // its embedding becomes NaN, so any request that feeds it gets
    // non-finite logits.
    let poison = (3u32..98)
        .find(|t| !healthy_ids.contains(t) && !out.contains(t))
        .expect("an unused token");
    let poison_text = text_of(&[poison]);
    {
        let data = varmap.data().lock().unwrap();
        let (_, emb) = data
            .iter()
            .find(|(k, _)| k.contains("embed_tokens"))
            .expect("the embedding");
        let mut rows = emb.as_tensor().to_vec2::<f32>().unwrap();
        rows[poison as usize].iter_mut().for_each(|x| *x = f32::NAN);
        let (r, c) = (rows.len(), rows[0].len());
        let flat: Vec<f32> = rows.into_iter().flatten().collect();
        emb.set(&candle_core::Tensor::from_vec(flat, (r, c), &Device::Cpu).unwrap())
            .unwrap();
    }
    let server = start(&varmap, ServeConfig::default()).await;
    let good = json!({"prompt": healthy, "max_tokens": 200, "temperature": 0, "ignore_eos": true,
                      "stream": true});
    let bad = json!({"prompt": format!("a{poison_text}b"), "max_tokens": 50, "temperature": 0,
                     "ignore_eos": true});
    let good_task = {
        let (client, url) = (server.client.clone(), server.url("/v1/completions"));
        tokio::spawn(async move {
            let resp = client.post(url).json(&good).send().await.unwrap();
            sse_data(&resp.text().await.unwrap())
        })
    };
    let (s, v) = server.post("/v1/completions", bad.clone()).await;
    assert_error(s, &v, 500, None, &["request"]);
    let mut bad_stream = bad;
    bad_stream["stream"] = json!(true);
    let events = server.post_stream("/v1/completions", bad_stream).await;
    assert!(events.iter().any(|e| e.contains("\"error\"")), "{events:?}");
    let (text, finish, _) = stream_text(&good_task.await.unwrap());
    assert_eq!(text, text_of(&out), "the healthy request goes on");
    assert_eq!(finish.as_deref(), Some("length"));
    server.wait_idle(Duration::from_secs(2)).await;
    assert_eq!(
        server
            .metric("requests_finished_total{finish_reason=\"error\"}")
            .await,
        2.0
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_lets_running_requests_finish() {
    let varmap = weights(6);
    let server = start(&varmap, ServeConfig::default()).await;
    let prompt = "Finish me";
    let want = text_of(&offline(&varmap, &[encode(prompt)], 3000, false)[0]);
    let body = json!({"prompt": prompt, "max_tokens": 3000, "temperature": 0, "ignore_eos": true,
                      "stream": true});
    let mut resp = server
        .client
        .post(server.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut raw =
        String::from_utf8_lossy(&resp.chunk().await.unwrap().expect("a chunk")).to_string();
    let reader = tokio::spawn(async move {
        while let Ok(Some(chunk)) = resp.chunk().await {
            raw.push_str(&String::from_utf8_lossy(&chunk));
        }
        raw
    });
    // The first chunk can leave before the engine thread admits the request
    // (it is then waiting): wait until it runs.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while server.metric("num_requests_running").await != 1.0 && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(
        server.metric("num_requests_running").await,
        1.0,
        "running at shutdown"
    );
    let addr = server.addr;
    server.shutdown().await;
    let (text, finish, _) = stream_text(&sse_data(&reader.await.unwrap()));
    assert_eq!(text, want, "the running request ends normally");
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
