//! The engine thread: one OS thread owns the model, its KV cache and the
//! [`Engine`]; HTTP handlers talk to it through channels.
//!
//! Handlers send commands (submit a request with the sender of its
//! events, abort one, abort all, shut down) over a standard channel; the
//! thread drains them between steps, runs [`Engine::step`], routes each
//! token to its request's channel and, after the step, sends each finished
//! request its completion. A request whose receiver is gone (the client
//! disconnected) is aborted before the next step, so its blocks are free
//! within one step. With nothing to run, the thread blocks on the command
//! channel.
//!
//! A step that fails is rolled back by the engine and retried, up to
//! `step_retries` times in a row with a short pause; then every live
//! request fails with [`Event::Failed`] (HTTP 500) and the thread goes on
//! with the requests that come next.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{Error, Result};
use tokio::sync::{mpsc as tmpsc, oneshot};

use super::metrics::Metrics;
use crate::engine::{Completion, Engine, FinishReason, Request, SamplingParams, SchedulerConfig};
use crate::models::{PagedKvCache, PagedModel};
use crate::text::chat::ChatTemplate;
use crate::text::tokenizer::ModelTokenizer;

const OP: &str = "engine thread";

/// What a loader gives the engine thread: the model with its KV cache (both
/// stay on the thread), and the tokenizer and chat template (handed to the
/// HTTP side).
pub struct LoadedModel {
    /// The model.
    pub model: Box<dyn PagedModel>,
    /// Its KV cache.
    pub cache: PagedKvCache,
    /// Its tokenizer and special tokens.
    pub tokenizer: ModelTokenizer,
    /// Its chat template, if it has one (`/v1/chat/completions` needs it).
    pub chat_template: Option<ChatTemplate>,
    /// The name clients use in `model`.
    pub name: String,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What the engine thread tells the HTTP side about its model once loaded.
#[derive(Debug)]
pub struct ModelInfo {
    /// The served name.
    pub name: String,
    /// The tokenizer.
    pub tokenizer: ModelTokenizer,
    /// The chat template.
    pub chat_template: Option<ChatTemplate>,
    /// Token ids are below this.
    pub vocab_size: usize,
    /// Prompt plus new tokens at most.
    pub max_seq_len: usize,
    /// KV cache blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
}

/// Limits of the engine thread.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// The engine's step limits.
    pub scheduler: SchedulerConfig,
    /// Requests queued (not yet running) at most; more are refused.
    pub max_waiting: usize,
    /// Failed steps retried in a row before the live requests fail.
    pub step_retries: usize,
    /// Capture the CUDA graphs (decode steps and steps with prefills) for
    /// sequences of up to this many tokens before serving (see
    /// `Engine::capture_cuda_graphs`); `None`: each is captured on its first
    /// step.
    pub capture_graphs_up_to: Option<usize>,
}

/// An event of one request.
#[derive(Debug)]
pub enum Event {
    /// A new token.
    Token(u32),
    /// The request ended (its last token, if any, came before).
    Done(Completion),
    /// The request failed for a reason outside it (the engine's step kept
    /// failing, or the server is shutting down).
    Failed(String),
}

/// Why a submission was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// `max_waiting` requests are queued already.
    QueueFull(usize),
    /// The engine refused the request (the message says why).
    Invalid(String),
    /// The engine thread is shutting down or gone.
    Unavailable,
}

/// A submitted request: its id and events.
#[derive(Debug)]
pub struct Submitted {
    /// The engine's request id.
    pub id: u64,
    /// Its tokens, then [`Event::Done`] or [`Event::Failed`]. Dropping the
    /// receiver aborts the request.
    pub events: tmpsc::UnboundedReceiver<Event>,
}

enum Command {
    Submit {
        request: Request,
        events: tmpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<std::result::Result<(), SubmitError>>,
    },
    Abort {
        id: u64,
        reason: &'static str,
    },
    AbortAll(String),
    Shutdown,
}

/// The HTTP side's handle on the engine thread (cheap to clone).
#[derive(Clone, Debug)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    alive: Arc<AtomicBool>,
}

/// Clears the flag when the engine thread ends, by return or panic.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit { request, .. } => write!(f, "Submit({})", request.id),
            Command::Abort { id, reason } => write!(f, "Abort({id}, {reason})"),
            Command::AbortAll(why) => write!(f, "AbortAll({why})"),
            Command::Shutdown => write!(f, "Shutdown"),
        }
    }
}

impl EngineHandle {
    /// Queues a request for `prompt`; resolves once the engine thread has
    /// accepted or refused it.
    pub async fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> std::result::Result<Submitted, SubmitError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = tmpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        let request = Request { id, prompt, params };
        self.commands
            .send(Command::Submit {
                request,
                events,
                reply,
            })
            .map_err(|_| SubmitError::Unavailable)?;
        match answer.await {
            Ok(Ok(())) => Ok(Submitted {
                id,
                events: receiver,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SubmitError::Unavailable),
        }
    }

    /// Aborts request `id`; `reason` goes into its log line.
    pub fn abort(&self, id: u64, reason: &'static str) {
        let _ = self.commands.send(Command::Abort { id, reason });
    }

    /// Fails every live request with `why`.
    pub fn abort_all(&self, why: &str) {
        let _ = self.commands.send(Command::AbortAll(why.to_string()));
    }

    /// Asks the thread to finish its requests and stop.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }

    /// True while the engine thread is there to take commands.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

/// Starts the engine thread: runs `loader` on it, then serves commands.
/// Returns once the model is loaded (or the loader failed).
pub fn spawn<F>(
    loader: F,
    config: EngineConfig,
    metrics: Metrics,
) -> Result<(EngineHandle, ModelInfo, JoinHandle<()>)>
where
    F: FnOnce() -> Result<LoadedModel> + Send + 'static,
{
    if config.max_waiting == 0 {
        candle_core::bail!("{OP}: max_waiting must be at least 1, got 0");
    }
    let (commands, receiver) = mpsc::channel();
    let (info_tx, info_rx) = mpsc::channel();
    let alive = Arc::new(AtomicBool::new(true));
    let guard = AliveGuard(alive.clone());
    let thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let _guard = guard;
            let loaded = match loader() {
                Ok(l) => l,
                Err(e) => {
                    let _ = info_tx.send(Err(e));
                    return;
                }
            };
            let LoadedModel {
                model,
                cache,
                tokenizer,
                chat_template,
                name,
            } = loaded;
            let (num_blocks, block_size) = (cache.config().num_blocks, cache.block_size());
            let mut engine = match Engine::new(&*model, cache, config.scheduler) {
                Ok(e) => e,
                Err(e) => {
                    let _ = info_tx.send(Err(e));
                    return;
                }
            };
            if let Some(context) = config.capture_graphs_up_to {
                let start = Instant::now();
                match engine.capture_cuda_graphs(context.min(model.max_seq_len())) {
                    Ok(0) => {}
                    Ok(n) => eprintln!("{OP}: {n} CUDA graphs captured in {:.2?}", start.elapsed()),
                    // Steps then capture on first use, or run eagerly.
                    Err(e) => eprintln!("{OP}: capturing the CUDA graphs: {e}"),
                }
            }
            let info = ModelInfo {
                name,
                tokenizer,
                chat_template,
                vocab_size: model.vocab_size(),
                max_seq_len: model.max_seq_len(),
                num_blocks,
                block_size,
            };
            if info_tx.send(Ok(info)).is_err() {
                return;
            }
            EngineLoop::new(engine, config, metrics).run(receiver);
        })
        .map_err(|e| Error::msg(format!("{OP}: starting the thread: {e}")))?;
    match info_rx.recv() {
        Ok(Ok(info)) => Ok((
            EngineHandle {
                commands,
                next_id: Arc::new(AtomicU64::new(0)),
                alive,
            },
            info,
            thread,
        )),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let panicked = thread.join().is_err();
            candle_core::bail!(
                "{OP}: the thread ended while loading the model{}",
                if panicked { " (it panicked)" } else { "" }
            )
        }
    }
}

/// A live request's channel and timing.
struct Route {
    events: tmpsc::UnboundedSender<Event>,
    submitted: Instant,
    prompt_len: usize,
    last_token: Option<Instant>,
    first_token: Option<Duration>,
    tokens: usize,
}

struct EngineLoop<'m> {
    engine: Engine<'m, dyn PagedModel>,
    config: EngineConfig,
    metrics: Metrics,
    routes: HashMap<u64, Route>,
    failures: usize,
    shutting_down: bool,
}

impl<'m> EngineLoop<'m> {
    fn new(engine: Engine<'m, dyn PagedModel>, config: EngineConfig, metrics: Metrics) -> Self {
        let mut this = Self {
            engine,
            config,
            metrics,
            routes: HashMap::new(),
            failures: 0,
            shutting_down: false,
        };
        this.update_gauges();
        this
    }

    fn run(mut self, commands: mpsc::Receiver<Command>) {
        loop {
            if !self.engine.has_work() {
                if self.shutting_down {
                    return;
                }
                // Idle: block until a command comes.
                match commands.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        // Every handle is gone: nobody can read the answers.
                        self.fail_all("the server stopped");
                        return;
                    }
                }
            }
            self.abort_disconnected();
            if self.engine.has_work() {
                self.step();
            }
            self.update_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                request,
                events,
                reply,
            } => {
                let answer = self.submit(request, events);
                let _ = reply.send(answer);
            }
            Command::Abort { id, reason } => self.abort(id, reason),
            Command::AbortAll(why) => self.fail_all(&why),
            Command::Shutdown => self.shutting_down = true,
        }
    }

    fn submit(
        &mut self,
        request: Request,
        events: tmpsc::UnboundedSender<Event>,
    ) -> std::result::Result<(), SubmitError> {
        if self.shutting_down {
            return Err(SubmitError::Unavailable);
        }
        if self.engine.num_waiting() >= self.config.max_waiting {
            return Err(SubmitError::QueueFull(self.config.max_waiting));
        }
        let (id, prompt_len) = (request.id, request.prompt.len());
        self.engine
            .add_request(request)
            .map_err(|e| SubmitError::Invalid(e.to_string()))?;
        self.routes.insert(
            id,
            Route {
                events,
                submitted: Instant::now(),
                prompt_len,
                last_token: None,
                first_token: None,
                tokens: 0,
            },
        );
        self.update_gauges();
        Ok(())
    }

    fn abort(&mut self, id: u64, reason: &'static str) {
        let Some(route) = self.routes.remove(&id) else {
            return;
        };
        match self.engine.abort(id) {
            Ok(_) => {}
            Err(e) => eprintln!("{OP}: aborting request {id}: {e}"),
        }
        self.log_end(id, &route, reason);
        self.metrics
            .finished(reason, route.prompt_len, route.submitted.elapsed());
    }

    /// Aborts the requests whose clients went away.
    fn abort_disconnected(&mut self) {
        let gone: Vec<u64> = self
            .routes
            .iter()
            .filter(|(_, r)| r.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.abort(id, "aborted");
        }
    }

    /// Fails every live request with `why`.
    fn fail_all(&mut self, why: &str) {
        let ids: Vec<u64> = self.routes.keys().copied().collect();
        for id in ids {
            if let Some(route) = self.routes.get(&id) {
                let _ = route.events.send(Event::Failed(why.to_string()));
            }
            self.abort(id, "error");
        }
    }

    fn step(&mut self) {
        match self.engine.step() {
            Ok(events) => {
                self.failures = 0;
                let now = Instant::now();
                for ev in events {
                    self.metrics.generation_tokens.inc();
                    let Some(route) = self.routes.get_mut(&ev.id) else {
                        continue;
                    };
                    match route.last_token {
                        Some(t) => self
                            .metrics
                            .inter_token_latency
                            .observe((now - t).as_secs_f64()),
                        None => {
                            let ttft = now - route.submitted;
                            route.first_token = Some(ttft);
                            self.metrics.time_to_first_token.observe(ttft.as_secs_f64());
                        }
                    }
                    route.last_token = Some(now);
                    route.tokens += 1;
                    // A closed receiver is aborted before the next step.
                    let _ = route.events.send(Event::Token(ev.token));
                }
            }
            Err(e) => {
                self.failures += 1;
                self.metrics.step_failures.inc();
                eprintln!(
                    "{OP}: step failed ({} of {} tries): {e}",
                    self.failures,
                    self.config.step_retries + 1
                );
                if self.failures > self.config.step_retries {
                    self.failures = 0;
                    self.fail_all(&format!(
                        "the engine step failed {} times in a row: {e}",
                        self.config.step_retries + 1
                    ));
                } else {
                    std::thread::sleep(Duration::from_millis(10 << self.failures.min(6)));
                }
            }
        }
        for completion in self.engine.take_completions() {
            let Some(route) = self.routes.remove(&completion.id) else {
                continue;
            };
            let reason = match &completion.finish {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
                FinishReason::Aborted => "aborted",
                FinishReason::Error(_) => "error",
            };
            self.log_end(completion.id, &route, reason);
            self.metrics
                .finished(reason, completion.prompt_len, completion.latency);
            let _ = route.events.send(Event::Done(completion));
        }
    }

    fn log_end(&self, id: u64, route: &Route, reason: &str) {
        let ttft = route.first_token.map_or_else(
            || "-".to_string(),
            |d| format!("{:.1} ms", d.as_secs_f64() * 1e3),
        );
        eprintln!(
            "request {id}: {} prompt tokens, {} output tokens, ttft {ttft}, {:.1} ms in all, finish {reason}",
            route.prompt_len,
            route.tokens,
            route.submitted.elapsed().as_secs_f64() * 1e3
        );
    }

    fn update_gauges(&mut self) {
        let stats = self.engine.stats();
        let (running, waiting) = (self.engine.num_running(), self.engine.num_waiting());
        let used = self.engine.block_manager().num_used_blocks();
        self.metrics.update_engine(&stats, running, waiting, used);
    }
}
