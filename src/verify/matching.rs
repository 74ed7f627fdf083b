//! Acceptance by matching: keep drafted tokens while they equal the target's own token at that
//! row (its argmax at temperature 0, its law sampled with that position's draw above), so the
//! output is plain decoding's, token for token.

use super::Accepted;
use crate::draft::DraftTree;

/// Walks the tree from the anchor: while the target's own token at the current row is the
/// token of a child, descend into that child (the first one in node order if siblings
/// repeat a token). `target_token(row)` is the target's token at verify-batch row `row`
/// (0 = anchor, `i + 1` = node `i`); it is only called for rows on the accepted path.
pub fn accept_matching<E>(
    tree: &DraftTree,
    mut target_token: impl FnMut(usize) -> Result<i32, E>,
) -> Result<Accepted, E> {
    let mut nodes = Vec::new();
    let mut current: Option<usize> = None;
    loop {
        let row = current.map_or(0, |node| node + 1);
        let predicted = target_token(row)?;
        match tree.children(current).find(|&child| tree.nodes[child].token == predicted) {
            Some(child) => {
                nodes.push(child);
                current = Some(child);
            }
            None => return Ok(Accepted { nodes, bonus: predicted }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::{DraftNode, Origin};
    use std::cell::RefCell;

    fn walk(tree: &DraftTree, target_argmax: impl Fn(usize) -> i32) -> Accepted {
        accept_matching(tree, |row| Ok::<_, ()>(target_argmax(row))).unwrap()
    }

    fn node(token: i32, parent: Option<usize>, depth: usize) -> DraftNode {
        DraftNode { token, parent, depth, cand: 0, q: 1.0, origin: Origin::Drafter }
    }

    #[test]
    fn chain_accepts_every_prefix_length() {
        for len in 1..=16usize {
            let draft: Vec<i32> = (0..len as i32).map(|i| 1000 + i).collect();
            let tree = DraftTree::chain(&draft);
            for accept in 0..=len {
                // The target agrees with the draft on rows 0..accept, then says 7 (never drafted),
                // or, once the whole chain matched, its bonus 9999 at the last row.
                let asked = RefCell::new(Vec::new());
                let target = |row: usize| {
                    asked.borrow_mut().push(row);
                    if row < accept {
                        draft[row]
                    } else if row == len {
                        9999
                    } else {
                        7
                    }
                };
                let result = walk(&tree, target);
                assert_eq!(
                    result.nodes,
                    (0..accept).collect::<Vec<_>>(),
                    "len {len} accept {accept}"
                );
                assert_eq!(result.bonus, if accept == len { 9999 } else { 7 });
                assert_eq!(*asked.borrow(), (0..=accept).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn empty_draft_commits_only_the_bonus() {
        let result = walk(&DraftTree::default(), |_| 42);
        assert_eq!(result, Accepted { nodes: vec![], bonus: 42 });
    }

    /// anchor -> {0: 10, 1: 11, 2: 12}; 11 -> {3: 20, 4: 21}; 12 -> {5: 30}; 21 -> {6: 40}
    fn branching_tree() -> DraftTree {
        DraftTree {
            nodes: vec![
                node(10, None, 1),
                node(11, None, 1),
                node(12, None, 1),
                node(20, Some(1), 2),
                node(21, Some(1), 2),
                node(30, Some(2), 2),
                node(40, Some(4), 3),
            ],
        }
    }

    #[test]
    fn tree_follows_a_later_branch() {
        let tree = branching_tree();
        // Row 0 -> 11 (node 1), row 2 -> 21 (node 4), row 5 -> 40 (node 6), row 7 -> bonus 50.
        let target = |row: usize| match row {
            0 => 11,
            2 => 21,
            5 => 40,
            7 => 50,
            _ => panic!("row {row} is off the accepted path"),
        };
        assert_eq!(walk(&tree, target), Accepted { nodes: vec![1, 4, 6], bonus: 50 });
    }

    #[test]
    fn tree_stops_where_no_child_matches() {
        let tree = branching_tree();
        let target = |row: usize| match row {
            0 => 12,
            3 => 31,
            _ => panic!("row {row} is off the accepted path"),
        };
        assert_eq!(walk(&tree, target), Accepted { nodes: vec![2], bonus: 31 });
        assert_eq!(walk(&tree, |_| 99), Accepted { nodes: vec![], bonus: 99 });
    }

    #[test]
    fn repeated_sibling_token_takes_the_first_child() {
        let tree = DraftTree {
            nodes: vec![
                node(5, None, 1),
                node(5, None, 1),
                node(6, Some(1), 2),
                node(6, Some(0), 2),
            ],
        };
        let result = walk(&tree, |row| if row == 0 { 5 } else { 6 });
        assert_eq!(result.nodes, vec![0, 3]);
        assert_eq!(result.bonus, 6);
    }
}
