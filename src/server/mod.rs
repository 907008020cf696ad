//! An OpenAI-compatible HTTP server over the continuous-batching
//! [`Engine`](crate::engine::Engine) (feature `server`).
//!
//! * `POST /v1/chat/completions` - messages through the checkpoint's chat
//!   template; `POST /v1/completions` - a prompt string or token ids. Both
//!   answer whole or, with `stream: true`, as server-sent events ending
//!   with `data: [DONE]`.
//! * `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! One OS thread owns the model, its KV cache and the engine
//! ([`engine_thread`]); the HTTP handlers ([`routes`]) tokenise, submit
//! and turn tokens back into text ([`text`]), in the OpenAI wire format
//! ([`protocol`]), with OpenAI's error bodies ([`error`]).
//!
//! # Example
//! ```no_run
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device};
//! use candle_paged_attention::models::{load, CacheConfig, LoadOptions, PagedKvCache};
//! use candle_paged_attention::server::{serve, LoadedModel, ServeConfig, Server};
//!
//! let server = Server::start(
//!     || {
//!         let dev = Device::Cpu;
//!         let loaded = load("model.gguf".as_ref(), &dev, &LoadOptions::default())?;
//!         let cache = PagedKvCache::new(
//!             &loaded.model.attention_layers(),
//!             CacheConfig::new(1024),
//!             loaded.model.dtype(),
//!             &dev,
//!         )?;
//!         let chat_template = loaded.chat_template(None)?;
//!         Ok(LoadedModel {
//!             model: loaded.model,
//!             cache,
//!             tokenizer: loaded.tokenizer,
//!             chat_template,
//!             name: loaded.name,
//!         })
//!     },
//!     ServeConfig::default(),
//! )?;
//! let rt = tokio::runtime::Runtime::new().map_err(candle_core::Error::wrap)?;
//! rt.block_on(async {
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//!     serve(listener, server, async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await
//! })
//! .map_err(candle_core::Error::wrap)
//! # }
//! ```

pub mod engine_thread;
pub mod error;
pub mod metrics;
pub mod protocol;
pub mod routes;
pub mod text;

use std::future::{Future, IntoFuture};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::serve::ListenerExt;
use axum::Router;
use candle_core::Result;

pub use engine_thread::{EngineHandle, LoadedModel};
pub use error::ApiError;
pub use metrics::Metrics;

use crate::engine::SchedulerConfig;
use engine_thread::EngineConfig;
use routes::AppState;

/// How the server runs.
#[derive(Clone, Copy, Debug)]
pub struct ServeConfig {
    /// The engine's per-step limits (`max_batch_tokens`, `max_num_seqs`).
    pub scheduler: SchedulerConfig,
    /// Requests waiting to run at most; more are answered 429.
    pub max_waiting: usize,
    /// Request bodies larger than this are answered 413.
    pub max_body_bytes: usize,
    /// Failed engine steps retried in a row before the running requests
    /// fail with 500.
    pub step_retries: usize,
    /// After the shutdown signal, running requests have this long to
    /// finish before they are failed.
    pub shutdown_timeout: Duration,
    /// New tokens when a request gives no `max_tokens` (never more than
    /// the context leaves); `None`: what the context leaves.
    pub default_max_tokens: Option<usize>,
    /// On CUDA: capture the step graphs (decode steps, and steps with
    /// prefills: see `Engine::capture_cuda_graphs`) for sequences of up to
    /// this many tokens at start-up, so that no request waits for a
    /// capture; `None`: each graph is captured on its first step.
    pub capture_graphs_up_to: Option<usize>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerConfig::default(),
            max_waiting: 256,
            max_body_bytes: 4 << 20,
            step_retries: 3,
            shutdown_timeout: Duration::from_secs(30),
            default_max_tokens: None,
            capture_graphs_up_to: None,
        }
    }
}

/// A loaded model behind its engine thread, ready to [`serve`].
#[derive(Debug)]
pub struct Server {
    state: Arc<AppState>,
    config: ServeConfig,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Starts the engine thread, runs `loader` on it (the model and its
    /// cache never leave that thread, so they need not be `Send`) and
    /// returns once the model is loaded. Fails with the loader's error, or
    /// when the engine refuses the configuration.
    pub fn start<F>(loader: F, config: ServeConfig) -> Result<Self>
    where
        F: FnOnce() -> Result<LoadedModel> + Send + 'static,
    {
        let metrics = Metrics::new()?;
        let (engine, info, thread) = engine_thread::spawn(
            loader,
            EngineConfig {
                scheduler: config.scheduler,
                max_waiting: config.max_waiting,
                step_retries: config.step_retries,
                capture_graphs_up_to: config.capture_graphs_up_to,
            },
            metrics.clone(),
        )?;
        let decoder = info.tokenizer.tokenizer.clone();
        let stop_tokens = info.tokenizer.special.stop.clone();
        let state = AppState {
            engine,
            encoder: Mutex::new(info.tokenizer),
            decoder,
            chat_template: info.chat_template,
            stop_tokens,
            model_name: info.name,
            vocab_size: info.vocab_size,
            max_seq_len: info.max_seq_len,
            default_max_tokens: config.default_max_tokens,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            metrics,
        };
        Ok(Self {
            state: Arc::new(state),
            config,
            thread: Some(thread),
        })
    }

    /// The axum router of the endpoints.
    pub fn router(&self) -> Router {
        routes::router(self.state.clone(), self.config.max_body_bytes)
    }

    /// The name clients give as `model`.
    pub fn model_name(&self) -> &str {
        &self.state.model_name
    }

    /// The model's context length.
    pub fn max_seq_len(&self) -> usize {
        self.state.max_seq_len
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.state.metrics
    }

    /// The engine thread's handle.
    pub fn engine(&self) -> &EngineHandle {
        &self.state.engine
    }

    /// Stops the engine thread (its live requests fail) and waits for it.
    fn stop_engine(&mut self) {
        self.state.engine.abort_all("the server is shutting down");
        self.state.engine.shutdown();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                eprintln!("server: the engine thread panicked");
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_engine();
    }
}

/// Serves `server` on `listener` until `shutdown` resolves, then shuts down
/// gracefully: stops accepting connections, gives running requests
/// [`ServeConfig::shutdown_timeout`] to finish, fails those left (their
/// clients get a 500 or an error event), stops the engine thread and
/// returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    mut server: Server,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (signal_tx, mut signal_rx) = tokio::sync::watch::channel(false);
    let graceful = async move {
        shutdown.await;
        let _ = signal_tx.send(true);
    };
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle's
    // algorithm holds one back until the previous one is acknowledged, and
    // a client's delayed ACK then stalls the stream for tens of ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            eprintln!("server: TCP_NODELAY on a connection: {e}");
        }
    });
    let app = axum::serve(listener, server.router())
        .with_graceful_shutdown(graceful)
        .into_future();
    let mut app = std::pin::pin!(app);
    let timeout = server.config.shutdown_timeout;
    let deadline = async move {
        if signal_rx.wait_for(|&v| v).await.is_err() {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(timeout).await;
    };
    let result = tokio::select! {
        r = &mut app => r,
        _ = deadline => {
            eprintln!("server: shutdown deadline of {timeout:?} reached; failing the requests left");
            server.state.engine.abort_all("the server is shutting down");
            // Their handlers answer at once; connections still open after
            // that are dropped.
            tokio::time::timeout(Duration::from_secs(5), &mut app)
                .await
                .unwrap_or(Ok(()))
        }
    };
    tokio::task::spawn_blocking(move || server.stop_engine())
        .await
        .map_err(std::io::Error::other)?;
    result
}
