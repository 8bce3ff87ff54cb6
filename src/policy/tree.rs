//! Sequences packed as one prefix tree, every distinct token position once (SGLang's radix tree,
//! used for a training pass: "Prefix Grouper" and tree-packed RL batches do the same).
//!
//! A group's trajectories share far more than their first prompt: with a small action space many
//! episodes give the same answers for several turns, and their histories stay identical. Packed
//! as rows, each of them runs its whole history; packed as a tree, a position shared by k
//! trajectories runs once, attends to its ancestors only, and its gradient is the sum of its k
//! children's, exactly the sum the rows would have computed separately.
//!
//! Layout: nodes in depth-first order, so a parent comes before its children and a run of
//! single-child nodes is contiguous. A node's visible keys (its ancestors and itself) are then a
//! few contiguous ranges: `[chain_start[i], i]`, then the same from the parent of `chain_start[i]`.
use std::sync::Arc;

/// No parent: a root (the first token of its sequences).
pub const ROOT: u32 = u32::MAX;

/// How the nodes of a tree are linked, for the attention kernel and the rotary positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeLinks {
    /// The parent's index, or [`ROOT`].
    pub parent: Vec<u32>,
    /// The first node of the contiguous run of ancestors that ends at this node.
    pub chain_start: Vec<u32>,
    /// The node's position in its sequences (its RoPE position).
    pub depth: Vec<u32>,
}

impl TreeLinks {
    pub fn len(&self) -> usize {
        self.parent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parent.is_empty()
    }

    /// The ranges `[from, to]` of keys node `i` attends to, nearest first.
    pub fn visible(&self, i: usize) -> impl Iterator<Item = (usize, usize)> + Clone + '_ {
        let mut next = Some(i);
        std::iter::from_fn(move || {
            let to = next?;
            let from = self.chain_start[to] as usize;
            next = match self.parent[from] {
                ROOT => None,
                p => Some(p as usize),
            };
            Some((from, to))
        })
    }

    /// Whether node `i` sees node `j` (an ancestor or itself).
    pub fn sees(&self, i: usize, j: usize) -> bool {
        self.visible(i).any(|(from, to)| (from..=to).contains(&j))
    }
}

/// Sequences packed as a prefix tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixTree {
    /// One token per node.
    pub tokens: Vec<u32>,
    pub links: Arc<TreeLinks>,
    /// Per sequence, the node of each of its positions.
    pub nodes: Vec<Vec<u32>>,
}

impl PrefixTree {
    /// Pack `seqs`: sorted, each shares with the one before it as many leading positions as
    /// they have in common (the most it shares with any earlier one), and adds its own tail.
    pub fn new(seqs: &[&[u32]]) -> Self {
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by(|&a, &b| seqs[a].cmp(seqs[b]));
        let mut tokens = Vec::new();
        let (mut parent, mut chain_start, mut depth) = (Vec::new(), Vec::new(), Vec::new());
        let mut nodes = vec![Vec::new(); seqs.len()];
        let mut prev: Option<usize> = None;
        for &s in &order {
            let seq = seqs[s];
            let shared = match prev {
                Some(p) => seqs[p].iter().zip(seq).take_while(|(a, b)| a == b).count(),
                None => 0,
            };
            let mut own: Vec<u32> = prev.map_or_else(Vec::new, |p| nodes[p][..shared].to_vec());
            for (t, &tok) in seq.iter().enumerate().skip(shared) {
                let i = tokens.len() as u32;
                let up = if t == 0 { ROOT } else { own[t - 1] };
                tokens.push(tok);
                parent.push(up);
                chain_start.push(if up != ROOT && up + 1 == i { chain_start[up as usize] } else { i });
                depth.push(t as u32);
                own.push(i);
            }
            nodes[s] = own;
            prev = Some(s);
        }
        Self { tokens, links: Arc::new(TreeLinks { parent, chain_start, depth }), nodes }
    }

    /// Distinct positions: what a pass over the tree computes.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_positions_are_one_node_and_each_node_sees_its_ancestors() {
        let (a, b, c, d) = ([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 4], [7, 8]);
        let tree = PrefixTree::new(&[&a, &b, &c, &d]);
        assert_eq!(tree.len(), 4 + 2 + 2, "a and c are one path; b shares two positions; d none");
        assert_eq!(tree.nodes[0], tree.nodes[2]);
        for (seq, nodes) in [&a[..], &b, &c, &d].iter().zip(&tree.nodes) {
            let got: Vec<u32> = nodes.iter().map(|&n| tree.tokens[n as usize]).collect();
            assert_eq!(&got, seq, "every position keeps its token");
            for (t, &n) in nodes.iter().enumerate() {
                assert_eq!(tree.links.depth[n as usize] as usize, t);
                // A node sees exactly the nodes of its own sequence up to it.
                for m in 0..tree.len() {
                    let own = nodes[..=t].contains(&(m as u32));
                    assert_eq!(tree.links.sees(n as usize, m), own, "node {n} and {m}");
                }
            }
        }
        assert_eq!(PrefixTree::new(&[]).len(), 0);
    }
}
