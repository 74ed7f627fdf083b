//! Generation slots. Engine work never runs on the async runtime: one engine thread owns
//! an [`Engine`] with one cache slot per concurrent request and decodes all active
//! requests together, each cycle drafting every block in ONE drafter decode and
//! verifying them in ONE target decode. New requests join between cycles (continuous
//! batching) from a bounded queue; each answers through a channel of its own.
//!
//! The engine thread also loads the models: llama.cpp's CPU backend runs on OpenMP, and
//! a second thread that ever ran a parallel region (the weight repacking at load time
//! does) keeps an OpenMP team alive. With more OpenMP threads than cores, libgomp stops
//! spinning at its barriers and every op waits for a wake-up: decoding ran 5x slower.
use super::metrics::{Busy, Metrics};
use crate::engine::{self, Engine, EngineConfig, GenerateOptions, Generation, PromptProgress, Run, Stats};
use crate::llama::{Model, Token};
use crate::sampling::TokenProb;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use tokio::sync::mpsc;

/// Events a request may hold before the engine waits for the client to read them.
const EVENT_BUFFER: usize = 64;

pub struct GenRequest {
    pub prompt: Vec<Token>,
    pub opts: GenerateOptions,
    /// The slot asked for (llama-server's `id_slot`): taken when it is free, else any free one
    /// (the answer is the same in every slot; only the cached prefix a slot reuses differs).
    pub slot: Option<usize>,
    /// Send [`GenEvent::Progress`] while the prompt is decoded (llama-server's `return_progress`).
    pub progress: bool,
}

/// What a request receives, in order: `Progress` while its prompt is decoded (when asked for),
/// `Tokens` per decode cycle, then `Done` or `Error`.
/// Dropping the receiver cancels the request: its slot is freed after the current cycle.
#[derive(Debug)]
pub enum GenEvent {
    /// Tokens committed by one cycle and the text they release: whole UTF-8 characters
    /// only, never a possible beginning of a stop string (held back until resolved).
    Tokens {
        tokens: Vec<Token>,
        text: String,
        /// Log-probabilities of the tokens committed since the last event (when asked for).
        probs: Vec<TokenProb>,
        /// The generation's counters so far (llama-server's `timings_per_token`).
        stats: Box<Stats>,
    },
    /// How far the prompt is, when asked for: before its first decode and after each batch.
    Progress(PromptProgress),
    Done(Box<Generation>),
    Error(String),
}

#[derive(Debug, thiserror::Error)]
#[error("every slot is busy and the queue is full")]
pub struct QueueFull;

/// What the engine thread needs to build (and rebuild) its engine.
struct SlotModels {
    target: Arc<Model>,
    drafter: Option<Arc<Model>>,
    cfg: EngineConfig,
}

impl SlotModels {
    /// Load the models once, for every slot to share; the files are checked first
    /// (readable GGUF, a drafter that pairs with the target), so a bad file is an error,
    /// not an abort.
    fn load(cfg: EngineConfig) -> engine::Result<Self> {
        let (target, drafter) = Engine::load_models(&cfg)?;
        Ok(Self { target, drafter, cfg })
    }

    fn engine(&self) -> engine::Result<Engine> {
        Engine::from_models(self.target.clone(), self.drafter.clone(), &self.cfg)
    }
}

/// Facts about the engine, read once it is built.
#[derive(Clone)]
pub struct SlotInfo {
    /// The target, for chat templates and tokenizing (read-only, shared with the engine).
    pub target: Arc<Model>,
    /// Context of each slot, as llama.cpp made it.
    pub n_ctx: usize,
    /// Block size the drafter was trained with, if there is a drafter.
    pub trained_block: Option<usize>,
}

struct Job {
    req: GenRequest,
    events: mpsc::Sender<GenEvent>,
    /// llama-server's `id_task`: requests are numbered as they are submitted.
    id_task: i64,
}

/// What `GET /slots` shows of one slot: the last request it took and how far it got (an idle
/// slot keeps its last request's settings, as llama-server's do).
#[derive(Debug, Clone)]
pub struct SlotState {
    /// -1 before the slot's first request.
    pub id_task: i64,
    pub processing: bool,
    pub n_prompt_tokens: usize,
    /// The request's options (`None` before the first one).
    pub opts: Option<GenerateOptions>,
    pub n_decoded: usize,
    pub has_new_line: bool,
}

impl Default for SlotState {
    fn default() -> Self {
        Self { id_task: -1, processing: false, n_prompt_tokens: 0, opts: None, n_decoded: 0, has_new_line: false }
    }
}

/// The slots' states, written by the engine thread and read by `GET /slots`.
type SlotStates = Arc<Mutex<Vec<SlotState>>>;

pub struct Scheduler {
    /// `None` only while dropping: closing the queue is what stops the engine thread.
    queue: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    slots: usize,
    info: SlotInfo,
    next_task: AtomicI64,
    states: SlotStates,
}

impl Scheduler {
    /// Start the engine thread, which loads the models of `cfg`, with `slots` concurrent
    /// requests behind a queue of `queue` waiting ones; returns once the engine is built,
    /// or with its failure.
    pub fn start(mut cfg: EngineConfig, slots: usize, queue: usize, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        anyhow::ensure!(slots >= 1 && queue >= 1, "need at least one slot and one queue place");
        cfg.n_slots = slots;
        let (tx, rx) = mpsc::channel::<Job>(queue);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let states: SlotStates = Arc::new(Mutex::new(vec![SlotState::default(); slots]));
        let worker_states = states.clone();
        let worker = std::thread::Builder::new().name("dflash2-engine".into()).spawn(move || {
            if let Some(worker) = Worker::build(cfg, metrics, worker_states, ready_tx) {
                worker.serve(rx);
            }
        })?;
        let info = match ready_rx.recv() {
            Ok(Ok(i)) => i,
            Ok(Err(e)) => anyhow::bail!("{e}"),
            Err(_) => anyhow::bail!("the engine thread died while building its engine"),
        };
        Ok(Self { queue: Some(tx), worker: Some(worker), slots, info, next_task: AtomicI64::new(0), states })
    }

    /// Queue a request; fails at once when every slot is busy and the queue is full.
    pub fn submit(&self, req: GenRequest) -> Result<mpsc::Receiver<GenEvent>, QueueFull> {
        let (events, rx) = mpsc::channel(EVENT_BUFFER);
        let queue = self.queue.as_ref().expect("the queue is open until drop");
        let id_task = self.next_task.fetch_add(1, Ordering::Relaxed);
        queue.try_send(Job { req, events, id_task }).map_err(|_| QueueFull)?;
        Ok(rx)
    }

    /// Every slot's state, in slot order.
    pub fn slot_states(&self) -> Vec<SlotState> {
        lock(&self.states).clone()
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.as_ref().map_or(0, |q| q.max_capacity() - q.capacity())
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn info(&self) -> &SlotInfo {
        &self.info
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // Closing the queue ends the engine thread once its active requests are over.
        self.queue.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A request being decoded in a slot.
struct Active {
    job: Job,
    run: Run,
    text: TextRelease,
    /// Log-probabilities already sent.
    probs_sent: usize,
    _busy: Busy,
}

struct Worker {
    models: SlotModels,
    metrics: Arc<Metrics>,
    states: SlotStates,
    /// `None` after a panic left it in an unknown state and rebuilding failed.
    engine: Option<Engine>,
    /// One entry per engine slot.
    slots: Vec<Option<Active>>,
}

impl Worker {
    fn build(
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
        states: SlotStates,
        ready: std::sync::mpsc::Sender<Result<SlotInfo, String>>,
    ) -> Option<Self> {
        let built = SlotModels::load(cfg).map_err(|e| e.to_string()).and_then(|models| match models.engine() {
            Ok(engine) => Ok((models, engine)),
            Err(e) => Err(format!("cannot build the engine: {e}")),
        });
        match built {
            Ok((models, engine)) => {
                let info = SlotInfo {
                    target: models.target.clone(),
                    n_ctx: engine.n_ctx(),
                    trained_block: engine.drafter().map(|d| d.trained_block()),
                };
                let _ = ready.send(Ok(info));
                let slots = (0..engine.n_slots()).map(|_| None).collect();
                Some(Self { models, metrics, states, engine: Some(engine), slots })
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                None
            }
        }
    }

    fn serve(mut self, mut queue: mpsc::Receiver<Job>) {
        let mut open = true;
        loop {
            // Admit waiting requests into free slots; sleep only when nothing is active.
            while open {
                let Some(slot) = self.slots.iter().position(Option::is_none) else { break };
                let idle = self.slots.iter().all(Option::is_none);
                let job = if idle {
                    queue.blocking_recv()
                } else {
                    match queue.try_recv() {
                        Ok(j) => Some(j),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => None,
                    }
                };
                match job {
                    Some(job) => {
                        let asked = job.req.slot.filter(|&s| self.slots.get(s).is_some_and(Option::is_none));
                        self.admit(asked.unwrap_or(slot), job)
                    }
                    None => open = false, // the queue closed: finish what is active, then stop
                }
            }
            if self.slots.iter().all(Option::is_none) {
                if open {
                    continue;
                }
                return;
            }
            self.cycle();
        }
    }

    /// Start a request in `slot`: its prompt is decoded now (the slot's cached prefix is reused).
    fn admit(&mut self, slot: usize, job: Job) {
        if job.events.is_closed() {
            return; // the client left while its request waited
        }
        let busy = self.metrics.busy();
        if self.engine.is_none() {
            self.rebuild(); // a failed rebuild is retried with each request
        }
        let started = match self.engine.as_mut() {
            Some(engine) => catch_unwind(AssertUnwindSafe(|| {
                let events = &job.events;
                let mut progress = |p: PromptProgress| {
                    if job.req.progress {
                        let _ = events.blocking_send(GenEvent::Progress(p));
                    }
                };
                engine.start_reporting(slot, &job.req.prompt, &job.req.opts, &mut progress)
            })),
            None => Ok(Err(engine::EngineError::Config("the engine cannot be built (see the log)".into()))),
        };
        match started {
            Ok(Ok(run)) => {
                self.metrics.decoded(1);
                let opts = Some(job.req.opts.clone());
                let n_prompt_tokens = job.req.prompt.len();
                lock(&self.states)[slot] =
                    SlotState { id_task: job.id_task, processing: true, n_prompt_tokens, opts, n_decoded: 0, has_new_line: false };
                let text = TextRelease::new(job.req.opts.stop.clone());
                let first = run.tokens().to_vec();
                self.slots[slot] = self.deliver(Active { job, run, text, probs_sent: 0, _busy: busy }, first);
            }
            Ok(Err(e)) => {
                self.metrics.failed();
                tracing::warn!(slot, "request failed: {e}");
                let _ = job.events.blocking_send(GenEvent::Error(e.to_string()));
            }
            Err(panic) => {
                self.metrics.failed();
                let what = panic_message(&panic);
                tracing::error!(slot, "request panicked: {what}");
                self.abort_all(&format!("internal error: {what}"));
                let _ = job.events.blocking_send(GenEvent::Error(format!("internal error: {what}")));
            }
        }
    }

    /// One decode cycle for every active request.
    fn cycle(&mut self) {
        let Some(engine) = self.engine.as_mut() else {
            self.abort_all("the engine cannot be built (see the log)");
            return;
        };
        let mut runs: Vec<&mut Run> = self.slots.iter_mut().flatten().map(|a| &mut a.run).collect();
        self.metrics.decoded(runs.len());
        let outcome = catch_unwind(AssertUnwindSafe(|| engine.step_all(&mut runs)));
        match outcome {
            Ok(Ok(fresh)) => {
                let mut fresh = fresh.into_iter();
                for slot in 0..self.slots.len() {
                    let Some(active) = self.slots[slot].take() else { continue };
                    let tokens = fresh.next().unwrap_or_default();
                    self.slots[slot] = self.deliver(active, tokens);
                }
            }
            Ok(Err(e)) => {
                tracing::warn!("decode cycle failed: {e}");
                self.abort_all(&e.to_string());
                // The caches may be half-updated: start again from empty ones.
                if self.engine.as_mut().is_some_and(|en| en.reset().is_err()) {
                    self.rebuild();
                }
            }
            Err(panic) => {
                let what = panic_message(&panic);
                tracing::error!("decode cycle panicked: {what}");
                self.abort_all(&format!("internal error: {what}"));
                self.rebuild();
            }
        }
    }

    /// Send a request its new tokens (and its result once it is over). Returns it while
    /// it keeps its slot: not once it finished or its client went away.
    fn deliver(&self, mut a: Active, tokens: Vec<Token>) -> Option<Active> {
        let released = a.text.release(&a.run);
        let has_new_line = released.contains('\n');
        let gone = if tokens.is_empty() && released.is_empty() && a.run.probs().len() == a.probs_sent {
            a.job.events.is_closed()
        } else {
            let probs = a.run.probs()[a.probs_sent..].to_vec();
            a.probs_sent += probs.len();
            let stats = Box::new(a.run.stats());
            a.job.events.blocking_send(GenEvent::Tokens { tokens, text: released, probs, stats }).is_err()
        };
        if gone {
            a.run.cancel();
        }
        {
            let mut states = lock(&self.states);
            let state = &mut states[a.run.slot()];
            state.n_decoded = a.run.tokens().len();
            state.has_new_line |= has_new_line;
            state.processing = a.run.finish().is_none();
        }
        if a.run.finish().is_none() {
            return Some(a);
        }
        let gen = a.run.into_generation();
        self.metrics.record(&gen);
        let _ = a.job.events.blocking_send(GenEvent::Done(Box::new(gen)));
        None
    }

    /// End every active request with `message`.
    fn abort_all(&mut self, message: &str) {
        lock(&self.states).iter_mut().for_each(|s| s.processing = false);
        for a in self.slots.iter_mut().filter_map(Option::take) {
            self.metrics.failed();
            let _ = a.job.events.blocking_send(GenEvent::Error(message.to_string()));
        }
    }

    fn rebuild(&mut self) {
        self.engine = None; // free the old contexts before making new ones
        self.engine =
            self.models.engine().inspect_err(|e| tracing::error!("cannot rebuild the engine: {e}")).ok();
    }
}

/// Splits a run's text into the pieces that are safe to show as it grows.
struct TextRelease {
    stops: Vec<String>,
    longest_stop: usize,
    sent: usize,
}

impl TextRelease {
    fn new(stops: Vec<String>) -> Self {
        let longest_stop = stops.iter().map(String::len).max().unwrap_or(0);
        Self { stops, longest_stop, sent: 0 }
    }

    /// The text not released yet, up to what is final: everything once the run is over,
    /// otherwise short of an unfinished UTF-8 character (the lossy text ends in U+FFFD
    /// there) and of a tail that may still become a stop string.
    fn release(&mut self, run: &Run) -> String {
        let text = run.text();
        let end = if run.finish().is_some() { text.len() } else { self.final_end(&text) };
        let end = end.max(self.sent);
        let out = text[self.sent..end].to_string();
        self.sent = end;
        out
    }

    fn final_end(&self, text: &str) -> usize {
        let text = text.trim_end_matches(char::REPLACEMENT_CHARACTER);
        let from = text.len().saturating_sub(self.longest_stop);
        let is_stop_start = |tail: &str| self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail));
        text.char_indices()
            .map(|(i, _)| i)
            .skip_while(|&i| i < from)
            .find(|&i| is_stop_start(&text[i..]))
            .unwrap_or(text.len())
    }
}

/// The slots' states; a panic while they were held left plain data, still readable.
fn lock(states: &Mutex<Vec<SlotState>>) -> std::sync::MutexGuard<'_, Vec<SlotState>> {
    states.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a slot panicked".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_that_may_begin_a_stop_string_is_held_back() {
        let t = TextRelease::new(vec!["</end>".to_string(), "STOP".to_string()]);
        assert_eq!(t.final_end("hello </e"), 6);
        assert_eq!(t.final_end("hello ST"), 6);
        assert_eq!(t.final_end("hello S"), 6);
        assert_eq!(t.final_end("hello world"), 11);
        // A whole stop string is the engine's to cut, not held here.
        assert_eq!(t.final_end("a STOP"), 6);
    }

    #[test]
    fn an_unfinished_character_is_held_back() {
        let t = TextRelease::new(Vec::new());
        let text = String::from_utf8_lossy(b"caf\xc3");
        assert_eq!(t.final_end(&text), 3);
        assert_eq!(t.final_end("café"), "café".len());
    }
}
