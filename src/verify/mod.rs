//! Verification: which drafted tokens the target accepts after decoding the draft.
//!
//! The verify batch is the anchor (row 0) followed by the draft tree's nodes in order
//! (node `i` at row `i + 1`), so the target's output at a row is its prediction for the
//! token that follows that row's path.

pub mod greedy;
pub mod rejection;

pub use greedy::accept_greedy;
pub use rejection::verify_tree;

/// The outcome of verifying one draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Accepted node indices, from the anchor's child down: one path of the tree.
    pub nodes: Vec<usize>,
    /// The target's own next token after the accepted path (always committed): its argmax
    /// at temperature 0, else drawn from its law (or the residual of the rejected drafts).
    pub bonus: i32,
}
