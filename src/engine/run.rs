//! One generation in progress ([`Run`]): its options, sampler, output so far, statistics,
//! and the stop conditions applied as tokens land.
use super::options::GenerateOptions;
use super::stats::Stats;
use crate::llama::{Grammar, Model, Token};
use crate::sampling::{Sampler, TokenProb};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token.
    Eog,
    /// `n_predict` tokens.
    Length,
    /// A stop string.
    Stop,
    /// The context is full.
    Context,
    /// The caller's callback asked to stop.
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<Token>,
    /// One per token when `GenerateOptions::n_probs` asked for them.
    pub probs: Vec<TokenProb>,
    pub text: String,
    pub finish: FinishReason,
    pub stats: Stats,
}

/// One generation in progress: its options, sampler, output and statistics.
pub struct Run {
    pub(super) slot: usize,
    pub(super) opts: GenerateOptions,
    pub(super) sampler: Sampler,
    pub(super) stats: Stats,
    out: Output,
    /// Log-probabilities of `out.tokens` (when asked for).
    probs: Vec<TokenProb>,
    /// The grammar's state after the committed tokens (`GenerateOptions::grammar`).
    pub(super) grammar: Option<Grammar>,
    /// The last committed token, not yet decoded by the target.
    pub(super) next: Token,
    pub(super) finish: Option<FinishReason>,
    /// The engine's draft sources this generation drafts with (none: plain decoding).
    pub(super) sources: Vec<usize>,
    /// The block with the anchor, and whether each cycle's length follows the cost model
    /// (`GenerateOptions::draft`, resolved for the engine's drafter).
    pub(super) block: usize,
    pub(super) adaptive: bool,
    pub(super) t_start: Instant,
    /// When the generation ended (its timings stop there).
    t_end: Option<Instant>,
    /// The next cycle decodes `next` alone: a batch row left its choice too close to call.
    pub(super) single_next: bool,
    /// Tokens it got beyond what plain decoding would have given it in the time of the cycles
    /// that drafted (`draft::sharing`: what it may lose to other runs' drafts).
    pub(super) credit: f64,
}

impl Run {
    pub(super) fn new(slot: usize, opts: &GenerateOptions, grammar: Option<Grammar>, n_prompt: usize, t_start: Instant) -> Self {
        Self {
            slot,
            opts: opts.clone(),
            sampler: Sampler::new(opts.sampling.clone()),
            stats: Stats { n_prompt, ..Stats::default() },
            out: Output::default(),
            probs: Vec::new(),
            grammar,
            next: 0,
            finish: None,
            sources: Vec::new(),
            block: 0,
            adaptive: false,
            t_start,
            t_end: None,
            single_next: false,
            credit: 0.0,
        }
    }

    pub fn options(&self) -> &GenerateOptions {
        &self.opts
    }

    /// The engine slot (cache sequence) this generation runs in.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Why the generation ended, once it has.
    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Output tokens so far (end-of-generation tokens excluded).
    pub fn tokens(&self) -> &[Token] {
        &self.out.tokens
    }

    /// Log-probabilities of [`Run::tokens`], when asked for (`GenerateOptions::n_probs`).
    pub fn probs(&self) -> &[TokenProb] {
        &self.probs
    }

    /// Output text so far (a stop string and anything after it excluded).
    pub fn text(&self) -> String {
        self.out.text()
    }

    /// Output bytes so far (a token may end inside a UTF-8 character).
    pub fn text_bytes(&self) -> &[u8] {
        &self.out.bytes[..self.out.stop_at.unwrap_or(self.out.bytes.len())]
    }

    /// The stop string that ended the generation, if one did.
    pub fn stop_word(&self) -> Option<&str> {
        self.out.stop_word.as_deref()
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.n_generated = self.out.tokens.len();
        let end = self.t_end.unwrap_or_else(Instant::now);
        s.total_ms = (end - self.t_start).as_secs_f64() * 1e3;
        s
    }

    /// Stop the generation early (the output so far stays).
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
        self.t_end.get_or_insert_with(Instant::now);
    }

    pub fn into_generation(self) -> Generation {
        let stats = self.stats();
        Generation {
            text: self.out.text(),
            tokens: self.out.tokens,
            probs: self.probs,
            finish: self.finish.unwrap_or(FinishReason::Length),
            stats,
        }
    }

    /// Whether its drafts are verified by matching the target's own token (`Verifier`).
    pub(super) fn matching(&self) -> bool {
        self.opts.verifier.matches(self.sampler.is_greedy())
    }

    /// A verify row was too close to call (the near-tie guard): the next cycle decodes alone.
    pub(super) fn near_tie(&mut self) {
        self.stats.near_ties += 1;
        self.single_next = true;
    }

    /// The context is full: the generation ends here.
    pub(super) fn end_at_context(&mut self) {
        self.finish = Some(FinishReason::Context);
        self.t_end.get_or_insert_with(Instant::now);
    }

    /// Take newly committed tokens (and their log-probabilities, when asked for); returns
    /// the ones that made it into the output.
    pub(super) fn commit(&mut self, model: &Model, new: &[Token], probs: &[TokenProb]) -> &[Token] {
        let before = self.out.tokens.len();
        if self.finish.is_none() {
            self.finish = self.out.push(model, new, &self.opts);
            let taken = self.out.tokens.len() - before;
            self.probs.extend_from_slice(&probs[..taken.min(probs.len())]);
        }
        if self.finish.is_some() {
            self.t_end.get_or_insert_with(Instant::now);
        }
        &self.out.tokens[before..]
    }
}

/// Generated tokens and text, with the stop conditions applied as tokens land.
#[derive(Default)]
struct Output {
    tokens: Vec<Token>,
    bytes: Vec<u8>,
    /// Text length after a stop string was found (the stop string excluded).
    stop_at: Option<usize>,
    stop_word: Option<String>,
}

impl Output {
    /// Take newly committed tokens in order; returns why generation ends, if it does.
    fn push(&mut self, model: &Model, new: &[Token], opts: &GenerateOptions) -> Option<FinishReason> {
        for &t in new {
            if model.is_eog(t) {
                return Some(FinishReason::Eog);
            }
            self.tokens.push(t);
            let from = self.bytes.len();
            self.bytes.extend_from_slice(&model.token_bytes(t, opts.shown_special.contains(&t)));
            if let Some((at, word)) = find_stop(&self.bytes, from, &opts.stop) {
                self.stop_at = Some(at);
                self.stop_word = Some(word.to_string());
                return Some(FinishReason::Stop);
            }
            if self.tokens.len() >= opts.n_predict {
                return Some(FinishReason::Length);
            }
        }
        None
    }

    fn text(&self) -> String {
        let end = self.stop_at.unwrap_or(self.bytes.len());
        String::from_utf8_lossy(&self.bytes[..end]).into_owned()
    }
}

/// The earliest stop string that ends in `bytes[from..]`, and where it starts.
fn find_stop<'s>(bytes: &[u8], from: usize, stops: &'s [String]) -> Option<(usize, &'s str)> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|word| {
            let s = word.as_bytes();
            let start = from.saturating_sub(s.len() - 1);
            bytes[start..].windows(s.len()).position(|w| w == s).map(|p| (start + p, word.as_str()))
        })
        .min_by_key(|&(at, _)| at)
}

#[cfg(test)]
mod tests {
    use super::find_stop;

    #[test]
    fn stop_strings_are_found_across_token_boundaries() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        // "EN" came with an earlier token, "D" with the new one (from = 6).
        assert_eq!(find_stop(b"abc\nEND", 6, &stops), Some((4, "END")));
        assert_eq!(find_stop(b"abc\n\nx", 4, &stops), Some((3, "\n\n")));
        assert_eq!(find_stop(b"abcdef", 3, &stops), None);
        // The earliest match wins.
        assert_eq!(find_stop(b"END\n\n", 0, &stops), Some((0, "END")));
    }
}
