//! The candidate lattice of one drafted block.

/// Candidates and transition scores for the `n_pos` draft positions of one block.
///
/// Position `t` (0-based here) is block row `t + 1`: block row 0 holds the anchor (the
/// last committed token), rows 1.. hold the mask tokens that the drafter fills in.
///
/// * `ids[t*k + c]`: candidate `c` of position `t` (a target token id).
/// * `scores[(t*k + p)*k + c]`: score of candidate `c` at position `t` when the token at
///   position `t-1` is candidate `p` of that position. At `t = 0` the predecessor is the
///   anchor, so every `p` row is identical and strategies read row `p = 0`.
///
/// For a DFlash 2 drafter the scores are the selector's `S_t(a, c)`; for a DFlash 1
/// drafter (independent positions) they are the position's logits of the candidates,
/// repeated for every predecessor. Softmax over `c` of a score row, at temperature 1,
/// is the drafter's transition probability `a_t(p, c)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Lattice {
    pub k: usize,
    pub n_pos: usize,
    pub ids: Vec<i32>,
    pub scores: Vec<f32>,
    /// Entries repaired when read from the drafter (ids outside the vocabulary, scores that
    /// are not numbers): a drafter gone wrong, which verification makes harmless.
    pub repaired: usize,
}

impl Lattice {
    pub fn new(k: usize, n_pos: usize, ids: Vec<i32>, scores: Vec<f32>) -> Self {
        assert_eq!(ids.len(), n_pos * k, "lattice ids: expected n_pos*k entries");
        assert_eq!(scores.len(), n_pos * k * k, "lattice scores: expected n_pos*k*k entries");
        Self { k, n_pos, ids, scores, repaired: 0 }
    }

    /// Make a lattice read from a drafter safe to select from: a candidate id outside
    /// `0..n_vocab` (or not a number) becomes token 0 and can never be picked (its scores
    /// -inf), a NaN score becomes -inf. Counts the repairs in [`Lattice::repaired`].
    pub fn repair(&mut self, n_vocab: usize) {
        let k = self.k;
        for t in 0..self.n_pos {
            for c in 0..k {
                let id = self.ids[t * k + c];
                if id < 0 || id as usize >= n_vocab {
                    self.ids[t * k + c] = 0;
                    for p in 0..k {
                        self.scores[(t * k + p) * k + c] = f32::NEG_INFINITY;
                    }
                    self.repaired += 1;
                }
            }
        }
        for s in self.scores.iter_mut().filter(|s| s.is_nan()) {
            *s = f32::NEG_INFINITY;
            self.repaired += 1;
        }
    }

    /// Candidate `c` of position `t`.
    #[inline]
    pub fn id(&self, t: usize, c: usize) -> i32 {
        self.ids[t * self.k + c]
    }

    /// The K scores of position `t`'s candidates after predecessor candidate `p`.
    #[inline]
    pub fn score_row(&self, t: usize, p: usize) -> &[f32] {
        let start = (t * self.k + p) * self.k;
        &self.scores[start..start + self.k]
    }

    /// Keep only the first `n` positions (a shorter draft of the same block).
    pub fn truncated(&self, n: usize) -> Lattice {
        let n = n.min(self.n_pos);
        Lattice {
            k: self.k,
            n_pos: n,
            ids: self.ids[..n * self.k].to_vec(),
            scores: self.scores[..n * self.k * self.k].to_vec(),
            repaired: self.repaired,
        }
    }
}

/// Softmax of `scores / temperature` into `out` (same length). Temperature must be > 0.
pub fn softmax_into(scores: &[f32], temperature: f32, out: &mut [f32]) {
    debug_assert_eq!(scores.len(), out.len());
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &s) in out.iter_mut().zip(scores) {
        *o = ((s - max) / temperature).exp();
        sum += *o;
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
}

/// Index of the largest score; the first one on ties (as `std::max_element` in llama.cpp).
pub fn argmax(scores: &[f32]) -> usize {
    let mut best = 0;
    for (i, &s) in scores.iter().enumerate() {
        if s > scores[best] {
            best = i;
        }
    }
    best
}

impl Lattice {
    /// Parse the DFlash 2 lattice rows of one block as llama.cpp packs them: one row of
    /// `row_stride` floats per block token; row `i >= 1` is `[K candidate ids as float |
    /// K x K scores]`, the scores after predecessor index `j` starting at `K + j*K`.
    /// `n_block` counts the anchor row, so the lattice has `n_block - 1` positions.
    pub fn from_dflash2_rows(rows: &[f32], row_stride: usize, k: usize, n_block: usize) -> Option<Lattice> {
        if n_block < 2 || k == 0 || row_stride < k * (k + 1) || rows.len() < n_block * row_stride {
            return None;
        }
        let n_pos = n_block - 1;
        let mut ids = Vec::with_capacity(n_pos * k);
        let mut scores = Vec::with_capacity(n_pos * k * k);
        for i in 1..n_block {
            let row = &rows[i * row_stride..i * row_stride + k * (k + 1)];
            ids.extend(row[..k].iter().map(|&f| f as i32));
            scores.extend_from_slice(&row[k..]);
        }
        Some(Lattice::new(k, n_pos, ids, scores))
    }

    /// Build a lattice from independent per-position logits (a DFlash 1 drafter): the
    /// top `k` tokens of each position, their logits repeated for every predecessor.
    pub fn from_position_logits<'a>(positions: impl ExactSizeIterator<Item = &'a [f32]>, k: usize) -> Lattice {
        let n_pos = positions.len();
        let mut ids = Vec::with_capacity(n_pos * k);
        let mut scores = Vec::with_capacity(n_pos * k * k);
        for logits in positions {
            let top = top_k_indices(logits, k);
            let row: Vec<f32> = top.iter().map(|&i| logits[i]).collect();
            ids.extend(top.iter().map(|&i| i as i32));
            for _ in 0..k {
                scores.extend_from_slice(&row);
            }
        }
        Lattice::new(k, n_pos, ids, scores)
    }
}

/// Indices of the `k` largest values, largest first (lowest index first on ties, so
/// candidate 0 is the argmax that greedy decoding would pick).
pub fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(values.len());
    let mut idx: Vec<usize> = (0..values.len()).collect();
    let cmp = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repair_makes_foreign_ids_unpickable_and_nan_scores_minus_infinity() {
        // 2 positions, K = 2: ids [5, 99 (outside a 10-token vocabulary)], [-3, 7]; a NaN score
        // in a foreign id's column (repaired with it) and one in a valid column.
        let mut l = Lattice::new(2, 2, vec![5, 99, -3, 7], vec![1.0, 2.0, 0.5, f32::NAN, 3.0, f32::NAN, 1.0, 1.0]);
        l.repair(10);
        assert_eq!(l.ids, vec![5, 0, 0, 7]);
        assert_eq!(l.repaired, 3);
        for t in 0..2 {
            for p in 0..2 {
                let row = l.score_row(t, p);
                let bad = if t == 0 { 1 } else { 0 };
                assert_eq!(row[bad], f32::NEG_INFINITY, "t {t} p {p}: {row:?}");
                assert!(!row.iter().any(|s| s.is_nan()), "t {t} p {p}: {row:?}");
            }
        }
        assert_eq!(argmax(l.score_row(0, 0)), 0);
        assert_eq!(argmax(l.score_row(1, 1)), 1);
    }
}
