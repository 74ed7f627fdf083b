//! Verification: which drafted tokens the target accepts after decoding the draft.
//!
//! The verify batch is the anchor (row 0) followed by the draft tree's nodes in order
//! (node `i` at row `i + 1`), so the target's output at a row is its prediction for the
//! token that follows that row's path.

pub mod greedy;
pub mod rejection;

pub use greedy::{accept_greedy, Accepted};
