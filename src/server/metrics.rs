//! Server counters, rendered as Prometheus text for `GET /metrics`: this server's `dflash2_*`
//! family, and llama-server's `llamacpp:*` one for dashboards built on it.
use crate::engine::{FinishReason, Generation};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters shared by the HTTP handlers and the generation slots (all monotonic but `busy`).
#[derive(Debug, Default)]
pub struct Metrics {
    finished: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    rejected: AtomicU64,
    prompt_tokens: AtomicU64,
    /// Prompt tokens a slot's cache already held (not decoded again).
    prompt_cached: AtomicU64,
    predicted_tokens: AtomicU64,
    drafted: AtomicU64,
    draft_accepted: AtomicU64,
    cycles: AtomicU64,
    cycle_tokens: AtomicU64,
    repaired_lattices: AtomicU64,
    /// Microseconds, so that they fit in an atomic integer.
    prompt_us: AtomicU64,
    predicted_us: AtomicU64,
    busy: AtomicU64,
    /// Target decodes of the engine thread (prompts and cycles), and the slots they served.
    decodes: AtomicU64,
    decode_slots: AtomicU64,
    /// The most tokens one slot held (prompt and answer).
    n_tokens_max: AtomicU64,
    /// Verify decodes that checked a draft.
    drafts: AtomicU64,
}

/// Holds one slot busy; dropping it (even while unwinding) frees the slot in the counters.
pub struct Busy(std::sync::Arc<Metrics>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Relaxed);
    }
}

impl Metrics {
    pub fn busy(self: &std::sync::Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Relaxed);
        Busy(self.clone())
    }

    pub fn record(&self, g: &Generation) {
        let s = &g.stats;
        let done = if g.finish == FinishReason::Cancelled { &self.cancelled } else { &self.finished };
        done.fetch_add(1, Relaxed);
        self.prompt_tokens.fetch_add(s.n_prompt_decoded as u64, Relaxed);
        self.prompt_cached.fetch_add((s.n_prompt - s.n_prompt_decoded) as u64, Relaxed);
        self.n_tokens_max.fetch_max((s.n_prompt + s.n_generated) as u64, Relaxed);
        self.drafts.fetch_add(s.accepted_hist.iter().sum::<usize>() as u64, Relaxed);
        self.predicted_tokens.fetch_add(s.n_generated as u64, Relaxed);
        self.drafted.fetch_add(s.n_drafted as u64, Relaxed);
        self.draft_accepted.fetch_add(s.n_draft_accepted as u64, Relaxed);
        self.cycles.fetch_add(s.cycles as u64, Relaxed);
        self.cycle_tokens.fetch_add(s.cycle_tokens as u64, Relaxed);
        self.repaired_lattices.fetch_add(s.repaired_lattices as u64, Relaxed);
        self.prompt_us.fetch_add((s.prefill_ms * 1e3) as u64, Relaxed);
        self.predicted_us.fetch_add(((s.total_ms - s.prefill_ms).max(0.0) * 1e3) as u64, Relaxed);
    }

    /// One target decode of the engine thread, serving `slots` requests.
    pub fn decoded(&self, slots: usize) {
        self.decodes.fetch_add(1, Relaxed);
        self.decode_slots.fetch_add(slots as u64, Relaxed);
    }

    pub fn failed(&self) {
        self.failed.fetch_add(1, Relaxed);
    }

    pub fn rejected(&self) {
        self.rejected.fetch_add(1, Relaxed);
    }

    /// Prometheus text exposition; `queued` and `slots` come from the scheduler.
    pub fn render(&self, queued: usize, slots: usize) -> String {
        let get = |c: &AtomicU64| c.load(Relaxed);
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let predicted_s = get(&self.predicted_us) as f64 / 1e6;
        let prompt_s = get(&self.prompt_us) as f64 / 1e6;
        let per_second = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        let rows: [(&str, &str, &str, f64); 17] = [
            ("requests_finished_total", "counter", "Generations that ran to the end.", get(&self.finished) as f64),
            (
                "requests_cancelled_total",
                "counter",
                "Generations stopped because the client left.",
                get(&self.cancelled) as f64,
            ),
            ("requests_failed_total", "counter", "Generations that ended in an error.", get(&self.failed) as f64),
            (
                "requests_rejected_total",
                "counter",
                "Requests refused with 503 (slots and queue full).",
                get(&self.rejected) as f64,
            ),
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens decoded (cached prefixes excluded).",
                get(&self.prompt_tokens) as f64,
            ),
            ("tokens_predicted_total", "counter", "Tokens generated.", get(&self.predicted_tokens) as f64),
            ("draft_tokens_total", "counter", "Tokens drafted.", get(&self.drafted) as f64),
            (
                "draft_tokens_accepted_total",
                "counter",
                "Drafted tokens the target accepted.",
                get(&self.draft_accepted) as f64,
            ),
            ("cycles_total", "counter", "Target verify decodes.", get(&self.cycles) as f64),
            (
                "drafter_repaired_total",
                "counter",
                "Drafter outputs with token ids outside the vocabulary or scores that are not numbers (repaired; \
                 verification keeps the output the target's).",
                get(&self.repaired_lattices) as f64,
            ),
            (
                "tau",
                "gauge",
                "Mean tokens committed per target verify, bonus included.",
                ratio(get(&self.cycle_tokens), get(&self.cycles)),
            ),
            (
                "draft_acceptance_ratio",
                "gauge",
                "Accepted over drafted tokens.",
                ratio(get(&self.draft_accepted), get(&self.drafted)),
            ),
            ("prompt_seconds_total", "counter", "Time spent on prompts.", prompt_s),
            (
                "predicted_tokens_seconds",
                "gauge",
                "Generation speed of one slot: tokens generated per second generating.",
                per_second(get(&self.predicted_tokens), predicted_s),
            ),
            ("requests_queued", "gauge", "Requests waiting for a slot.", queued as f64),
            ("requests_in_flight", "gauge", "Slots generating now.", get(&self.busy) as f64),
            ("slots", "gauge", "Generation slots (--parallel).", slots as f64),
        ];
        // llama-server's names and meanings (tools/server: `metrics`)
        let llama: [(&str, &str, &str, f64); 15] = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", get(&self.prompt_tokens) as f64),
            (
                "prompt_tokens_cached_total",
                "counter",
                "Number of prompt tokens taken from a slot's cache.",
                get(&self.prompt_cached) as f64,
            ),
            ("prompt_seconds_total", "counter", "Prompt process time.", prompt_s),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.", get(&self.predicted_tokens) as f64),
            ("tokens_predicted_seconds_total", "counter", "Predict process time.", predicted_s),
            ("n_decode_total", "counter", "Total number of llama_decode() calls.", get(&self.decodes) as f64),
            ("n_tokens_max", "counter", "Largest observed n_tokens.", get(&self.n_tokens_max) as f64),
            ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens generated.", get(&self.drafted) as f64),
            (
                "spec_decode_num_accepted_tokens_total",
                "counter",
                "Draft tokens accepted by the target.",
                get(&self.draft_accepted) as f64,
            ),
            ("spec_decode_num_drafts_total", "counter", "Drafts verified by the target.", get(&self.drafts) as f64),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", per_second(get(&self.prompt_tokens), prompt_s)),
            (
                "predicted_tokens_seconds",
                "gauge",
                "Average generation throughput in tokens/s.",
                per_second(get(&self.predicted_tokens), predicted_s),
            ),
            ("requests_processing", "gauge", "Number of requests processing.", get(&self.busy) as f64),
            ("requests_deferred", "gauge", "Number of requests deferred.", queued as f64),
            (
                "n_busy_slots_per_decode",
                "gauge",
                "Average number of busy slots per llama_decode() call.",
                ratio(get(&self.decode_slots), get(&self.decodes)),
            ),
        ];
        let mut out = String::new();
        for (prefix, family) in [("dflash2_", &rows[..]), ("llamacpp:", &llama[..])] {
            for (name, kind, help, value) in family {
                let _ = writeln!(out, "# HELP {prefix}{name} {help}\n# TYPE {prefix}{name} {kind}\n{prefix}{name} {value}");
            }
        }
        out
    }
}
