//! Verification: which drafted tokens the target accepts after decoding the draft.
//!
//! The verify batch is the anchor (row 0) followed by the draft tree's nodes in order
//! (node `i` at row `i + 1`), so the target's output at a row is its prediction for the
//! token that follows that row's path. `matching` and `rejection` are the algorithms over a
//! tree; `rows` is the target's law at a row; `target` runs them against the target.

pub mod matching;
pub mod rejection;
pub mod rows;
pub mod target;

pub use matching::accept_matching;
pub use rejection::verify_tree;
pub use rows::{constrained_argmax, masked, own_token, States};
pub use target::{in_order, Check, Drafted, Law, Verdict, Verifier, MAX_TREE_LEAVES};

/// The outcome of verifying one draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Accepted node indices, from the anchor's child down: one path of the tree.
    pub nodes: Vec<usize>,
    /// The target's own next token after the accepted path (always committed): its argmax
    /// at temperature 0, else drawn from its law (or, by rejection sampling, the residual of
    /// the rejected drafts).
    pub bonus: i32,
}
