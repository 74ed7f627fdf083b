//! Drafting: the draft sources behind one interface ([`source::DraftSource`]), the arbiter
//! that turns their proposals into one draft, and the cost model both consult.
//!
//! The DFlash drafter hands us a [`Lattice`]: for every drafted block position, K candidate
//! tokens and the transition scores from each candidate of the previous position. A
//! selection strategy (`select`) turns it into a [`DraftTree`] (a single path is a tree
//! whose nodes each have one child) that the target verifies in one decode. The context
//! look-up proposes what followed earlier occurrences of the last tokens; llama.cpp's own
//! drivers propose their drafts as they are. With several slots busy, `sharing` sizes the drafts of
//! one verify batch together.

pub mod arbiter;
pub mod config;
pub mod cost;
pub mod dflash;
pub mod drafter;
pub mod lattice;
pub mod lookup;
pub mod select;
pub mod sharing;
pub mod source;
pub mod tree;
pub mod upstream;

pub use lattice::Lattice;
pub use tree::{DraftNode, DraftTree, Origin};
