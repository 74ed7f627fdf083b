//! Drafting: what the drafter proposes for one block and how a draft is picked from it.
//!
//! The drafter hands us a [`Lattice`]: for every drafted block position, K candidate
//! tokens and the transition scores from each candidate of the previous position.
//! A selection strategy turns it into a [`DraftTree`] (a single path is a tree whose
//! nodes each have one child) that the target verifies in one decode.

pub mod cost;
pub mod drafter;
pub mod lattice;
pub mod lookup;
pub mod select;
pub mod tree;

pub use lattice::Lattice;
pub use tree::{DraftNode, DraftTree, Origin};
