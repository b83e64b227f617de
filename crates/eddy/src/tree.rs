//! Token-tree topology shared by verification (target forward over a tree), drafting and the accept walk.
//!
//! Nodes are numbered `0..n` in topological order: every node's parent has a smaller index. A node whose
//! parent is [`NO_PARENT`] hangs directly off the committed sequence (depth 0, the position right after
//! the last committed token). In a verify pass node 0 is the root: the last sampled token, not yet in the
//! KV cache; its descendants are draft tokens. A node at depth `d` sits at absolute position `n_past + d`
//! and attends to the committed rows plus its ancestors (root first) and itself — the ancestor mask of
//! SpecInfer (Miao et al. 2023, §4.2) and DDTree (`docs/speculation.md`).

use crate::error::{Error, Result};

/// Parent of a node attached directly to the committed sequence.
pub const NO_PARENT: usize = usize::MAX;

/// Root-to-node paths of every node of a tree (flattened), from which depths and ancestor masks follow.
#[derive(Debug, Clone, Default)]
pub struct TreePaths {
    offsets: Vec<usize>,
    nodes: Vec<u32>,
}

impl TreePaths {
    /// Paths for `parents` (`parents[i] < i` or [`NO_PARENT`]).
    ///
    /// Errors: a parent index that is not smaller than its child's.
    pub fn new(parents: &[usize]) -> Result<TreePaths> {
        let mut p = TreePaths::default();
        p.rebuild(parents)?;
        Ok(p)
    }

    /// [`TreePaths::new`] into `self`, reusing its allocations (the decode loop's per-step trees).
    ///
    /// Errors: as [`TreePaths::new`] (then `self` holds a prefix of the tree).
    pub fn rebuild(&mut self, parents: &[usize]) -> Result<()> {
        let p = self;
        p.offsets.clear();
        p.nodes.clear();
        p.offsets.push(0);
        for (i, &par) in parents.iter().enumerate() {
            if par != NO_PARENT {
                if par >= i {
                    return Err(Error::Input(format!("bad tree: node {i} has parent {par}, which does not precede it")));
                }
                let (a, b) = (p.offsets[par], p.offsets[par + 1]);
                p.nodes.extend_from_within(a..b);
            }
            p.nodes.push(i as u32);
            p.offsets.push(p.nodes.len());
        }
        Ok(())
    }

    /// The chain `0 → 1 → … → n−1` (a plain batch of consecutive tokens).
    pub fn chain(n: usize) -> TreePaths {
        let parents: Vec<usize> = (0..n).map(|i| if i == 0 { NO_PARENT } else { i - 1 }).collect();
        TreePaths::new(&parents).expect("a chain is a valid tree")
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// True for the empty tree.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Node indices from the topmost ancestor to `i` inclusive (length `depth(i) + 1`).
    pub fn path(&self, i: usize) -> &[u32] {
        &self.nodes[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Depth of node `i` (0 for a node attached to the committed sequence).
    pub fn depth(&self, i: usize) -> usize {
        self.offsets[i + 1] - self.offsets[i] - 1
    }

    /// Ancestor mask: `mask[i][j]` is true when node `i` attends to node `j` (`j` is `i` or an ancestor).
    pub fn ancestor_mask(&self) -> Vec<Vec<bool>> {
        (0..self.len())
            .map(|i| {
                let mut row = vec![false; self.len()];
                for &j in self.path(i) {
                    row[j as usize] = true;
                }
                row
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_depths_and_mask() {
        //      0
        //    1   2
        //   3 4   5
        let parents = [NO_PARENT, 0, 0, 1, 1, 2];
        let t = TreePaths::new(&parents).unwrap();
        assert_eq!(t.len(), 6);
        assert_eq!(t.path(4), &[0, 1, 4]);
        assert_eq!(t.path(5), &[0, 2, 5]);
        assert_eq!((0..6).map(|i| t.depth(i)).collect::<Vec<_>>(), vec![0, 1, 1, 2, 2, 2]);
        let m = t.ancestor_mask();
        assert!(m[4][0] && m[4][1] && m[4][4] && !m[4][2] && !m[4][3] && !m[4][5]);
        assert!(m[5][2] && !m[5][1]);
        // Each row is its parent's row plus itself.
        for i in 1..6 {
            for (j, &seen) in m[i].iter().enumerate() {
                assert_eq!(seen, m[parents[i]][j] || i == j);
            }
        }
        let c = TreePaths::chain(4);
        assert_eq!(c.path(3), &[0, 1, 2, 3]);
        // Two nodes hanging off the committed sequence (a draft tree below a committed root).
        let f = TreePaths::new(&[NO_PARENT, NO_PARENT, 1]).unwrap();
        assert_eq!((f.depth(0), f.depth(1), f.depth(2)), (0, 0, 1));
        assert!(TreePaths::new(&[NO_PARENT, 1]).is_err());
        assert!(TreePaths::new(&[NO_PARENT, 2, 0]).is_err());
    }
}
