//! How many threads a decode gets, chosen from what decodes take on this machine right now.
//!
//! llama.cpp computes on an OpenMP team whose threads spin at every barrier. When another busy
//! process holds a core, a team as large as the machine waits at each barrier for a thread the
//! kernel has not scheduled: on 2 cores beside a 2-thread job, a 2-thread SmolLM2 step ran at
//! 2-4 tok/s where 1 thread ran at 73 (BENCHMARKS.md). So the thread count is not fixed: the
//! governor keeps a moving average of decode time per kind of decode and batch-size class for
//! each candidate count, now and then times a decode with the other candidate, and moves to it
//! when it is clearly faster. A jump in the current count's time (contention starting) triggers
//! a probe at once. The thread count never changes what a decode computes (each output is
//! computed by one thread; `tests/batch_invariance.rs` checks it bit for bit), only how fast.

/// Decodes of one class between two probes of the other candidate, at first and at most. At
/// first: of the half team while the full team runs, rarely (contention shows first as the full
/// team's slowdown, which probes at once, so these probes only watch for a milder kind, and on a
/// quiet machine every one of them is a slower step: 3% of a 128-token answer when they began
/// after 2 decodes); of the full team while the half team runs, soon (to return as soon as the
/// machine has room again).
const FIRST_PROBE_OF_FEWER: u32 = 64;
const FIRST_PROBE_OF_MORE: u32 = 2;
const MAX_PROBE_INTERVAL: u32 = 512;
/// Probes of a losing count may cost this share of the time, at most: under contention one
/// decode of the full team can take a hundred quick ones (2.5 s against 13 ms measured), so
/// after such a probe the next waits until it is paid for.
const PROBE_BUDGET: f64 = 0.03;
const MAX_BUDGET_INTERVAL: u32 = 1 << 14;
/// Decodes in one probe: under contention decode times are heavy-tailed (mostly quick, now and
/// then a whole scheduler slice), so one decode says little and the mean of several decides.
const PROBE_LEN: u32 = 4;
/// A probe wins when it takes less than this share of the current count's time.
const CLEARLY_FASTER: f64 = 0.8;
/// The current count is probed against the other at once when it takes this many times its
/// best average (the machine got busier).
const SLOWDOWN: f64 = 2.0;

#[derive(Debug, Clone, Default)]
struct Class {
    /// Moving average of ms per decode for each candidate.
    ms: [Option<f64>; 2],
    /// The best average the current candidate had.
    best: Option<f64>,
    until_probe: u32,
    interval: u32,
    /// Decodes of the running probe: count and summed ms.
    probe_n: u32,
    probe_ms: f64,
}

#[derive(Debug, Clone)]
pub struct ThreadGovernor {
    /// Candidate thread counts: the configured one and half of it.
    candidates: [i32; 2],
    current: usize,
    /// Per kind of decode (a drafter's feature injection and its block decode cost differently at
    /// the same rows), batch-size classes: 1, 2, 3-4, 5-8, ... rows.
    classes: Vec<(&'static str, Vec<Class>)>,
    /// Whether a team of this many threads would not fit beside what else runs now: a probe
    /// of the larger team is put off while it would not (it would cost seconds).
    crowded: fn(i32) -> bool,
}

/// Decodes to wait before probing again so that a probe that cost `extra_ms` more than
/// decodes of `cur_ms` would have stays within the budget.
fn wait_to_pay(extra_ms: f64, cur_ms: f64) -> f64 {
    (extra_ms.max(0.0) / (PROBE_BUDGET * cur_ms.max(1e-3))).min(f64::from(MAX_BUDGET_INTERVAL))
}

/// Whether `team` threads would not fit beside the tasks running now: `/proc/loadavg`'s
/// runnable count (the task reading it included, which is the team's own first thread).
fn team_would_crowd(team: i32) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runnable = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().nth(3).and_then(|f| f.split('/').next()?.parse::<usize>().ok()))
        .unwrap_or(1);
    runnable.saturating_sub(1) + team as usize > cores
}

fn class_of(rows: usize) -> usize {
    rows.max(1).next_power_of_two().trailing_zeros() as usize
}

impl ThreadGovernor {
    /// None when there is nothing to choose (one thread). `busy_elsewhere`: threads other
    /// processes keep running now, `cores` the machine's; when the full team would not fit
    /// beside them the governor starts with the smaller count (its first probes would cost
    /// seconds there).
    pub fn new(n_threads: i32, crowded: fn(i32) -> bool) -> Option<Self> {
        (n_threads > 1).then(|| Self {
            candidates: [n_threads, (n_threads / 2).max(1)],
            current: usize::from(crowded(n_threads)),
            classes: Vec::new(),
            crowded,
        })
    }

    /// A governor that reads how crowded the machine is from `/proc/loadavg` (Linux; never
    /// crowded elsewhere).
    pub fn for_machine(n_threads: i32) -> Option<Self> {
        Self::new(n_threads, team_would_crowd)
    }

    /// Decodes before the first probe of the other candidate from the current one.
    fn first_interval(&self) -> u32 {
        if self.candidates[1 - self.current] < self.candidates[self.current] {
            FIRST_PROBE_OF_FEWER
        } else {
            FIRST_PROBE_OF_MORE
        }
    }

    fn class(&mut self, rows: usize, kind: &'static str) -> &mut Class {
        let c = class_of(rows);
        let first = self.first_interval();
        let at = match self.classes.iter().position(|(k, _)| *k == kind) {
            Some(at) => at,
            None => {
                self.classes.push((kind, Vec::new()));
                self.classes.len() - 1
            }
        };
        let classes = &mut self.classes[at].1;
        if classes.len() <= c {
            classes.resize(c + 1, Class { until_probe: first, interval: first, ..Class::default() });
        }
        &mut classes[c]
    }

    /// Threads for the next decode of `rows` rows of this kind.
    pub fn threads_for(&mut self, rows: usize, kind: &'static str) -> i32 {
        let (current, other) = (self.current, 1 - self.current);
        let (bigger, crowded, team) = (self.candidates[other] > self.candidates[current], self.crowded, self.candidates[other]);
        let class = self.class(rows, kind);
        let mut probe = class.until_probe == 0;
        if probe && class.probe_n == 0 && bigger && crowded(team) {
            // no room for the larger team now: look again later
            class.interval = (class.interval * 2).min(MAX_PROBE_INTERVAL);
            class.until_probe = class.interval;
            probe = false;
        }
        self.candidates[if probe { other } else { current }]
    }

    /// The decode of `rows` rows of this kind with `threads` threads took `ms`.
    pub fn record(&mut self, rows: usize, kind: &'static str, threads: i32, ms: f64) {
        let current = self.current;
        let Some(which) = self.candidates.iter().position(|&t| t == threads) else { return };
        let class = self.class(rows, kind);
        let avg = class.ms[which].map_or(ms, |a| a + 0.25 * (ms - a));
        class.ms[which] = Some(avg);
        if which == current {
            class.best = Some(class.best.map_or(avg, |b| b.min(avg)));
            class.until_probe = class.until_probe.saturating_sub(1);
            if class.best.is_some_and(|b| avg > SLOWDOWN * b) {
                class.until_probe = 0; // the machine got busier: look at the other count now
            }
            return;
        }
        class.probe_n += 1;
        class.probe_ms += ms;
        let cur = class.ms[current];
        // a probe decode no quicker than the current average ends the probe: it lost
        let lost = cur.is_none_or(|c| ms >= c);
        if class.probe_n < PROBE_LEN && !lost {
            return;
        }
        let mean = class.probe_ms / f64::from(class.probe_n);
        let extra_ms = class.probe_ms - f64::from(class.probe_n) * cur.unwrap_or(mean);
        (class.probe_n, class.probe_ms) = (0, 0.0);
        let faster = !lost && cur.is_some_and(|c| mean < CLEARLY_FASTER * c);
        if faster {
            // every class moves together: contention is the machine's, not a batch size's
            self.current = which;
            let first = self.first_interval();
            for c in self.classes.iter_mut().flat_map(|(_, classes)| classes.iter_mut()) {
                c.best = c.ms[which];
                c.interval = first;
                c.until_probe = first;
                (c.probe_n, c.probe_ms) = (0, 0.0);
            }
        } else {
            let paid_for = cur.map_or(0.0, |c| wait_to_pay(extra_ms, c));
            class.interval = (class.interval * 2).min(MAX_PROBE_INTERVAL).max(paid_for as u32);
            class.until_probe = class.interval;
        }
    }

    /// The thread count decodes run with now.
    #[cfg(test)]
    fn current(&self) -> i32 {
        self.candidates[self.current]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet(_: i32) -> bool {
        false
    }

    /// Run `n` decodes of `rows` rows where a decode with `t` threads takes `cost(t)` ms.
    fn run(g: &mut ThreadGovernor, n: usize, rows: usize, cost: impl Fn(i32) -> f64) -> Vec<i32> {
        (0..n)
            .map(|_| {
                let t = g.threads_for(rows, "step");
                g.record(rows, "step", t, cost(t));
                t
            })
            .collect()
    }

    #[test]
    fn one_thread_has_no_governor() {
        assert!(ThreadGovernor::new(1, quiet).is_none());
    }

    #[test]
    fn keeps_the_full_team_when_it_is_faster_and_probes_ever_more_rarely() {
        let mut g = ThreadGovernor::new(2, quiet).unwrap();
        let used = run(&mut g, 2000, 1, |t| if t == 2 { 10.0 } else { 16.0 });
        assert_eq!(g.current(), 2);
        let probes = used.iter().filter(|&&t| t == 1).count();
        assert!(probes <= 8, "{probes} probe decodes in 2000");
        // a short answer on a quiet machine pays for at most one probe decode
        let first = used.iter().position(|&t| t == 1).unwrap();
        assert!(first >= 64 && used[..128].iter().filter(|&&t| t == 1).count() <= 1, "{used:?}");
    }

    #[test]
    fn moves_to_fewer_threads_when_contention_makes_the_team_crawl_and_back_when_it_ends() {
        let mut g = ThreadGovernor::new(2, quiet).unwrap();
        run(&mut g, 100, 1, |t| if t == 2 { 10.0 } else { 16.0 });
        assert_eq!(g.current(), 2);
        // a busy neighbour: the 2-thread team crawls (the measured 25x), 1 thread is unhurt
        let used = run(&mut g, 20, 1, |t| if t == 2 { 250.0 } else { 16.0 });
        assert_eq!(g.current(), 1, "{used:?}");
        assert!(used.iter().filter(|&&t| t == 2).count() <= 5, "reacted within a few decodes: {used:?}");
        // the neighbour leaves: a later probe finds the team fast again
        run(&mut g, 2000, 1, |t| if t == 2 { 10.0 } else { 16.0 });
        assert_eq!(g.current(), 2);
    }

    #[test]
    fn batch_sizes_are_timed_apart() {
        let mut g = ThreadGovernor::new(2, quiet).unwrap();
        // single steps and 16-row verifies alternate; their times differ 8x but neither
        // class's time may be read as the other's slowdown
        for _ in 0..500 {
            for rows in [1, 16] {
                let t = g.threads_for(rows, "step");
                let base = if rows == 1 { 10.0 } else { 80.0 };
                g.record(rows, "step", t, if t == 2 { base } else { base * 1.6 });
            }
        }
        assert_eq!(g.current(), 2);
    }

    #[test]
    fn kinds_of_decode_are_timed_apart() {
        // a drafter cycle: a feature injection of 8 rows (as quick on 1 thread as on 2) and a
        // block decode of 8 rows (2 threads 1.35x faster) alternate; read as one class, the
        // cheap injections probed on 1 thread would look faster than the class's average
        let mut g = ThreadGovernor::new(2, quiet).unwrap();
        let mut blocks = Vec::new();
        for _ in 0..500 {
            for (kind, two, one) in [("injection", 0.3, 0.3), ("block", 1.6, 2.2)] {
                let t = g.threads_for(8, kind);
                g.record(8, kind, t, if t == 2 { two } else { one });
                if kind == "block" {
                    blocks.push(t);
                }
            }
        }
        assert_eq!(g.current(), 2);
        assert!(blocks.iter().filter(|&&t| t == 1).count() <= 8, "blocks on 1 thread: {blocks:?}");
    }

    #[test]
    fn prompts_of_varied_lengths_in_one_class_still_find_the_faster_team() {
        // a bulk prefill (`dflash2 dataset`): one decode per conversation, 260 to 510 rows (one
        // class), each row 1 ms with 2 threads and 1.4 ms with 1; the run started crowded
        let mut g = ThreadGovernor::new(2, |_| true).unwrap();
        g.crowded = quiet;
        let mut rows = 260;
        for _ in 0..400 {
            rows = 260 + (rows * 7919 + 13) % 251; // lengths in no order
            let t = g.threads_for(rows, "prompt");
            g.record(rows, "prompt", t, rows as f64 * if t == 2 { 1.0 } else { 1.4 });
        }
        assert_eq!(g.current(), 2);
    }

    #[test]
    fn a_crowded_machine_starts_with_the_smaller_team_and_never_probes_the_larger_while_crowded() {
        let mut g = ThreadGovernor::new(2, |_| true).unwrap();
        assert_eq!(g.current(), 1);
        let used = run(&mut g, 3000, 1, |t| if t == 2 { 250.0 } else { 16.0 });
        assert!(used.iter().all(|&t| t == 1), "probed a team with no room");
        assert_eq!(ThreadGovernor::new(2, quiet).unwrap().current(), 2);
        // once the machine is quiet the larger team is found again
        g.crowded = quiet;
        run(&mut g, 3000, 1, |t| if t == 2 { 10.0 } else { 16.0 });
        assert_eq!(g.current(), 2);
    }
}
