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

    /// The nodes in blocks of `size` neighbours, each with the keys any of its nodes sees.
    pub fn query_blocks(&self, size: usize) -> Vec<QueryBlock> {
        (0..self.len())
            .step_by(size.max(1))
            .map(|start| {
                let end = (start + size.max(1)).min(self.len());
                let mut seen: Vec<(usize, usize)> = (start..end).flat_map(|i| self.visible(i)).collect();
                seen.sort_unstable();
                let mut keys: Vec<(usize, usize)> = Vec::new(); // [from, to) while merging
                for (from, to) in seen {
                    match keys.last_mut() {
                        Some(last) if from <= last.1 => last.1 = last.1.max(to + 1),
                        _ => keys.push((from, to + 1)),
                    }
                }
                QueryBlock { start, end, keys: keys.into_iter().map(|(from, to)| (from, to - from)).collect() }
            })
            .collect()
    }
}

/// Queries of a packed tree attended to together: nodes `start..end` and, as ascending disjoint
/// runs `(first node, length)`, every key one of them sees. In depth-first order neighbours share
/// their ancestors, so a block's keys are its own nodes and a few chains above them: attention
/// block by block multiplies against those instead of the whole tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueryBlock {
    pub start: usize,
    pub end: usize,
    pub keys: Vec<(usize, usize)>,
}

impl QueryBlock {
    /// Every node of a tree of `n`, seeing every node (the mask does the rest).
    pub fn whole(n: usize) -> Self {
        Self { start: 0, end: n, keys: vec![(0, n)] }
    }

    pub fn key_count(&self) -> usize {
        self.keys.iter().map(|k| k.1).sum()
    }

    /// Where node `node`, one of the block's keys, sits among them.
    pub fn key_index(&self, node: usize) -> usize {
        let run = self.keys.partition_point(|&(first, _)| first <= node).saturating_sub(1);
        self.keys[..run].iter().map(|k| k.1).sum::<usize>() + node - self.keys[run].0
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

    #[test]
    fn a_query_block_holds_exactly_the_keys_its_nodes_see() {
        let seqs: [&[u32]; 5] = [&[1, 2, 3, 4, 5, 6], &[1, 2, 3, 9, 9], &[1, 2, 7, 8, 9, 10], &[1, 6, 6], &[4, 4, 4]];
        let tree = PrefixTree::new(&seqs);
        for size in [1, 2, 3, 5, tree.len()] {
            let blocks = tree.links.query_blocks(size);
            assert_eq!(blocks.iter().map(|b| b.end - b.start).sum::<usize>(), tree.len(), "every node once");
            for b in &blocks {
                let keys: Vec<usize> = b.keys.iter().flat_map(|&(first, n)| first..first + n).collect();
                assert!(keys.windows(2).all(|w| w[0] < w[1]), "ascending, disjoint: {keys:?}");
                let wanted: Vec<usize> =
                    (0..tree.len()).filter(|&m| (b.start..b.end).any(|i| tree.links.sees(i, m))).collect();
                assert_eq!(keys, wanted, "size {size}, block {}..{}", b.start, b.end);
                for (k, &node) in keys.iter().enumerate() {
                    assert_eq!(b.key_index(node), k);
                }
            }
        }
        // A later branch's block skips the earlier branches it does not descend from.
        let last = tree.links.query_blocks(3).pop().unwrap();
        assert!(last.key_count() < tree.len());
    }
}
