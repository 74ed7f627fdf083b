//! Generation slots. Engine work never runs on the async runtime: each slot is a worker
//! thread owning its own [`Engine`] (built from the shared, once-loaded models), pulling
//! requests from one bounded queue and answering through a channel per request.
//!
//! Handlers only see [`Scheduler::submit`] and the [`GenEvent`]s, so this decoding core can
//! be replaced by one that batches every slot into one drafter and one target decode per
//! cycle without touching them.
use super::metrics::Metrics;
use crate::engine::{self, Engine, EngineConfig, GenerateOptions, Generation, Run};
use crate::llama::{Model, Token};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use tokio::sync::mpsc;

/// Events a request may hold before its slot waits for the client to read them.
const EVENT_BUFFER: usize = 64;

pub struct GenRequest {
    pub prompt: Vec<Token>,
    pub opts: GenerateOptions,
}

/// What a slot reports, in order: `Tokens` per decode cycle, then `Done` or `Error`.
/// Dropping the receiver cancels the request: its slot stops after the current cycle.
#[derive(Debug)]
pub enum GenEvent {
    /// Tokens committed by one cycle and the text they release: whole UTF-8 characters
    /// only, never a possible beginning of a stop string (held back until resolved).
    Tokens {
        tokens: Vec<Token>,
        text: String,
    },
    Done(Generation),
    Error(String),
}

#[derive(Debug, thiserror::Error)]
#[error("every slot is busy and the queue is full")]
pub struct QueueFull;

/// What a slot needs to build (and rebuild) its engine.
#[derive(Clone)]
pub struct SlotModels {
    pub target: Arc<Model>,
    pub drafter: Option<Arc<Model>>,
    pub cfg: EngineConfig,
}

impl SlotModels {
    fn engine(&self) -> engine::Result<Engine> {
        Engine::from_models(self.target.clone(), self.drafter.clone(), &self.cfg)
    }
}

/// Facts about the slots' engines, read once they are built.
#[derive(Debug, Clone, Copy)]
pub struct SlotInfo {
    /// Context of each slot, as llama.cpp made it.
    pub n_ctx: usize,
    /// Block size the drafter was trained with, if there is a drafter.
    pub trained_block: Option<usize>,
}

struct Job {
    req: GenRequest,
    events: mpsc::Sender<GenEvent>,
}

pub struct Scheduler {
    /// `None` only while dropping: closing the queue is what stops the workers.
    queue: Option<mpsc::Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    info: SlotInfo,
}

impl Scheduler {
    /// Start `slots` workers behind a queue of `queue` waiting requests; returns once every
    /// engine is built, or with the first failure.
    pub fn start(models: SlotModels, slots: usize, queue: usize, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        anyhow::ensure!(slots >= 1 && queue >= 1, "need at least one slot and one queue place");
        let (tx, rx) = mpsc::channel::<Job>(queue);
        let rx = Arc::new(Mutex::new(rx));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let mut workers = Vec::with_capacity(slots);
        for slot in 0..slots {
            let (models, rx, metrics, ready) = (models.clone(), rx.clone(), metrics.clone(), ready_tx.clone());
            let worker = std::thread::Builder::new().name(format!("dflash2-slot-{slot}")).spawn(move || {
                if let Some(worker) = Worker::build(slot, models, metrics, ready) {
                    worker.serve(&rx);
                }
            })?;
            workers.push(worker);
        }
        drop(ready_tx);
        let mut info = None;
        for _ in 0..slots {
            match ready_rx.recv() {
                Ok(Ok(i)) => info = Some(i),
                Ok(Err(e)) => anyhow::bail!("cannot build a slot's engine: {e}"),
                Err(_) => anyhow::bail!("a slot died while building its engine"),
            }
        }
        let info = info.expect("slots >= 1 reported");
        Ok(Self { queue: Some(tx), workers, info })
    }

    /// Queue a request; fails at once when every slot is busy and the queue is full.
    pub fn submit(&self, req: GenRequest) -> Result<mpsc::Receiver<GenEvent>, QueueFull> {
        let (events, rx) = mpsc::channel(EVENT_BUFFER);
        let queue = self.queue.as_ref().expect("the queue is open until drop");
        queue.try_send(Job { req, events }).map_err(|_| QueueFull)?;
        Ok(rx)
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.as_ref().map_or(0, |q| q.max_capacity() - q.capacity())
    }

    pub fn slots(&self) -> usize {
        self.workers.len()
    }

    pub fn info(&self) -> SlotInfo {
        self.info
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // Closing the queue ends each worker once its current request is over.
        self.queue.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

struct Worker {
    slot: usize,
    models: SlotModels,
    metrics: Arc<Metrics>,
    /// `None` after a panic left it in an unknown state and rebuilding failed.
    engine: Option<Engine>,
}

impl Worker {
    fn build(
        slot: usize,
        models: SlotModels,
        metrics: Arc<Metrics>,
        ready: std::sync::mpsc::Sender<Result<SlotInfo, String>>,
    ) -> Option<Self> {
        match models.engine() {
            Ok(engine) => {
                let info =
                    SlotInfo { n_ctx: engine.n_ctx(), trained_block: engine.drafter().map(|d| d.trained_block()) };
                let _ = ready.send(Ok(info));
                Some(Self { slot, models, metrics, engine: Some(engine) })
            }
            Err(e) => {
                let _ = ready.send(Err(e.to_string()));
                None
            }
        }
    }

    fn serve(mut self, queue: &Mutex<mpsc::Receiver<Job>>) {
        loop {
            // Held only while waiting (a guard in the loop head would live through the job).
            let next = queue.lock().unwrap_or_else(PoisonError::into_inner).blocking_recv();
            let Some(job) = next else { return }; // the queue closed: shutting down
            if job.events.is_closed() {
                continue; // the client left while its request waited
            }
            let metrics = self.metrics.clone();
            let _busy = metrics.busy();
            if self.engine.is_none() {
                self.rebuild(); // a failed rebuild is retried with each request
            }
            let outcome = match self.engine.as_mut() {
                Some(engine) => catch_unwind(AssertUnwindSafe(|| run_job(engine, &job))),
                None => Ok(Err(engine::EngineError::Config("this slot cannot build its engine (see the log)".into()))),
            };
            let event = match outcome {
                Ok(Ok(gen)) => {
                    self.metrics.record(&gen);
                    GenEvent::Done(gen)
                }
                Ok(Err(e)) => {
                    self.metrics.failed();
                    tracing::warn!(slot = self.slot, "generation failed: {e}");
                    // The cache may be half-updated: start the next request from an empty one.
                    if self.engine.as_mut().is_some_and(|en| en.reset().is_err()) {
                        self.rebuild();
                    }
                    GenEvent::Error(e.to_string())
                }
                Err(panic) => {
                    self.metrics.failed();
                    let what = panic_message(&panic);
                    tracing::error!(slot = self.slot, "generation panicked: {what}");
                    self.rebuild();
                    GenEvent::Error(format!("internal error: {what}"))
                }
            };
            let _ = job.events.blocking_send(event);
        }
    }

    fn rebuild(&mut self) {
        self.engine = None; // free the old context before making a new one
        self.engine = self
            .models
            .engine()
            .inspect_err(|e| tracing::error!(slot = self.slot, "cannot rebuild the engine: {e}"))
            .ok();
    }
}

/// Drive one request to its end, streaming each cycle's tokens; a client that went away
/// (its receiver dropped) cancels the run at the next cycle boundary.
fn run_job(engine: &mut Engine, job: &Job) -> engine::Result<Generation> {
    let mut run = engine.start(&job.req.prompt, &job.req.opts)?;
    let mut text = TextRelease::new(&job.req.opts.stop);
    let mut fresh = run.tokens().to_vec();
    loop {
        let released = text.release(&run);
        let gone = if fresh.is_empty() && released.is_empty() {
            job.events.is_closed()
        } else {
            job.events.blocking_send(GenEvent::Tokens { tokens: fresh, text: released }).is_err()
        };
        if gone {
            run.cancel();
        }
        if run.finish().is_some() {
            return Ok(run.into_generation());
        }
        fresh = engine.step(&mut run)?;
    }
}

/// Splits a run's text into the pieces that are safe to show as it grows.
struct TextRelease<'a> {
    stops: &'a [String],
    longest_stop: usize,
    sent: usize,
}

impl<'a> TextRelease<'a> {
    fn new(stops: &'a [String]) -> Self {
        Self { stops, longest_stop: stops.iter().map(String::len).max().unwrap_or(0), sent: 0 }
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
        let stops = ["</end>".to_string(), "STOP".to_string()];
        let t = TextRelease::new(&stops);
        assert_eq!(t.final_end("hello </e"), 6);
        assert_eq!(t.final_end("hello ST"), 6);
        assert_eq!(t.final_end("hello S"), 6);
        assert_eq!(t.final_end("hello world"), 11);
        // A whole stop string is the engine's to cut, not held here.
        assert_eq!(t.final_end("a STOP"), 6);
    }

    #[test]
    fn an_unfinished_character_is_held_back() {
        let t = TextRelease::new(&[]);
        let text = String::from_utf8_lossy(b"caf\xc3");
        assert_eq!(t.final_end(&text), 3);
        assert_eq!(t.final_end("café"), "café".len());
    }
}
