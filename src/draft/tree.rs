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
    /// the `q(x)` of rejection sampling when the token was sampled.
    pub q: f32,
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
