//! A draft as a token tree rooted at the anchor (the last committed token).

/// One drafted token.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftNode {
    /// The drafted target token id.
    pub token: i32,
    /// Index of the parent node in [`DraftTree::nodes`], `None` when the parent is the anchor.
    pub parent: Option<usize>,
    /// Depth below the anchor: 1 for a child of the anchor.
    pub depth: usize,
    /// Block position this node fills (`depth - 1`) and the candidate index it took there.
    pub cand: usize,
    /// Drafter probability of this token given its parent (softmax of the lattice row),
    /// the `q(x)` of rejection sampling when the token was sampled. For a look-up node:
    /// its estimated chance of acceptance given its parent.
    pub q: f32,
    /// Which draft source proposed it.
    pub origin: Origin,
}

/// The draft source of a node: the DFlash drafter, the context look-up, or both (a
/// merged tree shares the node both proposed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Drafter,
    Lookup,
    Both,
}

impl Origin {
    pub fn from_drafter(self) -> bool {
        self != Origin::Lookup
    }

    pub fn from_lookup(self) -> bool {
        self != Origin::Drafter
    }
}

/// Nodes are stored parents-first (a parent always precedes its children), which is also
/// the order they are laid out in the verify batch after the anchor.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraftTree {
    pub nodes: Vec<DraftNode>,
}

impl DraftTree {
    /// A single path `tokens[0] -> tokens[1] -> ...` hanging off the anchor.
    pub fn chain(tokens: &[i32]) -> Self {
        let nodes = tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| DraftNode {
                token,
                parent: i.checked_sub(1),
                depth: i + 1,
                cand: 0,
                q: 1.0,
                origin: Origin::Drafter,
            })
            .collect();
        Self { nodes }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// True when every node has at most one child (a plain draft sequence).
    pub fn is_chain(&self) -> bool {
        self.nodes.iter().enumerate().all(|(i, n)| n.parent == i.checked_sub(1))
    }

    /// Children of `parent` (`None` = the anchor), in node order.
    pub fn children(&self, parent: Option<usize>) -> impl Iterator<Item = usize> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(move |(_, n)| n.parent == parent)
            .map(|(i, _)| i)
    }

    /// Tokens of the path from the anchor down to `node` (inclusive).
    pub fn path_to(&self, node: usize) -> Vec<usize> {
        let mut path = vec![node];
        let mut cur = self.nodes[node].parent;
        while let Some(p) = cur {
            path.push(p);
            cur = self.nodes[p].parent;
        }
        path.reverse();
        path
    }

    /// The path from the anchor that always takes the first child (the principal branch).
    pub fn principal_path(&self) -> Vec<usize> {
        let mut path = Vec::new();
        while let Some(child) = self.children(path.last().copied()).next() {
            path.push(child);
        }
        path
    }

    /// What each node adds to the expected accepted length: its path probability (the
    /// product of the `q`s from the anchor down to it).
    pub fn gains(&self) -> Vec<f32> {
        let mut gains: Vec<f32> = Vec::with_capacity(self.len());
        for n in &self.nodes {
            let parent = n.parent.map_or(1.0, |p| gains[p]);
            gains.push(parent * n.q);
        }
        gains
    }

    /// Leaves (nodes without children), in node order.
    pub fn leaves(&self) -> Vec<usize> {
        let mut has_child = vec![false; self.nodes.len()];
        for n in &self.nodes {
            if let Some(p) = n.parent {
                has_child[p] = true;
            }
        }
        (0..self.nodes.len()).filter(|&i| !has_child[i]).collect()
    }
}

impl DraftTree {
    /// The same tree with its nodes in depth-first order, siblings in their node order.
    ///
    /// The verify batch lays nodes out in this order. Selectors list a node's likeliest
    /// child first (best-first trees by probability, sampled trees by draw order, which is
    /// also the order rejection sampling tests them), so the principal path occupies the
    /// cache cells right after the anchor: when the target accepts (a prefix of) it, the
    /// accepted cells stay in position order once the rest is dropped.
    pub fn depth_first(&self) -> DraftTree {
        let mut order = Vec::with_capacity(self.nodes.len());
        let mut stack: Vec<usize> = self.children(None).collect();
        stack.reverse();
        while let Some(i) = stack.pop() {
            order.push(i);
            let mut kids: Vec<usize> = self.children(Some(i)).collect();
            kids.reverse();
            stack.extend(kids);
        }
        let mut new_index = vec![0usize; self.nodes.len()];
        for (new, &old) in order.iter().enumerate() {
            new_index[old] = new;
        }
        let nodes = order
            .iter()
            .map(|&old| {
                let mut n = self.nodes[old].clone();
                n.parent = n.parent.map(|p| new_index[p]);
                n
            })
            .collect();
        DraftTree { nodes }
    }
}

impl DraftTree {
    /// This tree and `other` as one: a node both propose on the same path is shared
    /// (origin `Both`, the larger `q`). The result is best-first by path probability
    /// (parents first, so any prefix is a valid draft), at most `budget` nodes.
    pub fn merge(&self, other: &DraftTree, budget: usize) -> DraftTree {
        let mut nodes = self.nodes.clone();
        // where each node of `other` landed in `nodes`
        let mut landed: Vec<usize> = Vec::with_capacity(other.len());
        for n in &other.nodes {
            let parent = n.parent.map(|p| landed[p]);
            let same = nodes.iter().position(|m| m.parent == parent && m.token == n.token);
            match same {
                Some(i) => {
                    let m = &mut nodes[i];
                    m.q = m.q.max(n.q);
                    if m.origin != n.origin {
                        m.origin = Origin::Both;
                    }
                    landed.push(i);
                }
                None => {
                    nodes.push(DraftNode { parent, ..n.clone() });
                    landed.push(nodes.len() - 1);
                }
            }
        }
        DraftTree { nodes }.best_first(budget)
    }

    /// The nodes where `keep` holds, parents remapped; a node kept must have its parent kept.
    pub fn retain(&self, keep: &[bool]) -> DraftTree {
        let mut new_index = vec![usize::MAX; self.len()];
        let mut nodes = Vec::new();
        for (old, n) in self.nodes.iter().enumerate().filter(|&(i, _)| keep[i]) {
            new_index[old] = nodes.len();
            let mut n = n.clone();
            n.parent = n.parent.map(|p| new_index[p]);
            debug_assert!(n.parent != Some(usize::MAX), "a kept node's parent was dropped");
            nodes.push(n);
        }
        DraftTree { nodes }
    }

    /// The nodes reordered by path probability, likeliest first (a child is never likelier
    /// than its parent, and the sort is stable, so parents stay first), at most `budget`.
    pub fn best_first(&self, budget: usize) -> DraftTree {
        let gains = self.gains();
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.sort_by(|&a, &b| gains[b].total_cmp(&gains[a]));
        order.truncate(budget);
        let mut new_index = vec![usize::MAX; self.len()];
        for (new, &old) in order.iter().enumerate() {
            new_index[old] = new;
        }
        let nodes = order
            .iter()
            .map(|&old| {
                let mut n = self.nodes[old].clone();
                n.parent = n.parent.map(|p| new_index[p]);
                n
            })
            .collect();
        DraftTree { nodes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(token: i32, parent: Option<usize>, depth: usize, q: f32) -> DraftNode {
        DraftNode { token, parent, depth, cand: 0, q, origin: Origin::Drafter }
    }

    #[test]
    fn a_merged_tree_shares_common_nodes_and_stays_best_first_within_budget() {
        // drafter: a(0.6) -> b(0.5); look-up: a(0.9) -> c(0.8)
        let drafter = DraftTree { nodes: vec![node(1, None, 1, 0.6), node(2, Some(0), 2, 0.5)] };
        let mut lookup = DraftTree { nodes: vec![node(1, None, 1, 0.9), node(3, Some(0), 2, 0.8)] };
        lookup.nodes.iter_mut().for_each(|n| n.origin = Origin::Lookup);
        let m = drafter.merge(&lookup, 8);
        let tokens: Vec<i32> = m.nodes.iter().map(|n| n.token).collect();
        assert_eq!(tokens, vec![1, 3, 2], "shared a, then c (0.72) before b (0.45)");
        assert_eq!(m.nodes[0].origin, Origin::Both);
        assert_eq!(m.nodes[0].q, 0.9);
        assert_eq!((m.nodes[1].origin, m.nodes[1].parent), (Origin::Lookup, Some(0)));
        assert_eq!((m.nodes[2].origin, m.nodes[2].parent), (Origin::Drafter, Some(0)));
        let cut = drafter.merge(&lookup, 2);
        assert_eq!(cut.nodes.iter().map(|n| n.token).collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn depth_first_follows_first_children_and_keeps_parents_first() {
        // Best-first order: a(0.6) b(0.4) | a's kids d(0.9) c(0.5) | b's kid e(0.9)
        let t = DraftTree {
            nodes: vec![
                node(1, None, 1, 0.6),
                node(2, None, 1, 0.4),
                node(4, Some(0), 2, 0.9),
                node(5, Some(1), 2, 0.9),
                node(3, Some(0), 2, 0.5),
            ],
        };
        let d = t.depth_first();
        let tokens: Vec<i32> = d.nodes.iter().map(|n| n.token).collect();
        assert_eq!(tokens, vec![1, 4, 3, 2, 5]);
        for (i, n) in d.nodes.iter().enumerate() {
            if let Some(p) = n.parent {
                assert!(p < i, "parent after child");
                assert_eq!(d.nodes[p].depth + 1, n.depth);
            }
        }
        assert_eq!(d.path_to(1), vec![0, 1]);
        assert_eq!(d.principal_path(), vec![0, 1]);
        assert_eq!(d.nodes[4].parent, Some(3));
        // Siblings keep their order even when a later one is likelier (a sampled tree).
        let sampled = DraftTree { nodes: vec![node(7, None, 1, 0.2), node(8, None, 1, 0.7)] };
        assert_eq!(sampled.depth_first(), sampled);
    }
}
