//! The free extents ordered by age, for "youngest-neighbour fit": a treap keyed by
//! `(age, offset)` in which every node knows the longest extent in its subtree, so the youngest
//! free extent that holds a request is one walk from the root.
//!
//! ```text
//!              (age 9, len 4)  max 64          walk for need 32: the right subtree's max is
//!             /              \                 under 32, the root itself is too short, the
//!   (age 3, len 64) max 64   (age 12, len 8)   left subtree holds 64: go left. Each step
//!                             max 8            decides from one node: O(depth).
//! ```
//!
//! Nodes live in one `Vec` (indices, no pointers, no `unsafe`); freed slots are reused.
//! Priorities come from a fixed SplitMix64 sequence that no input influences, so the expected
//! depth is O(log n) for every sequence of operations.

/// No node.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node {
    /// `(age << 64) | offset`: unique, since free extents have distinct offsets.
    key: u128,
    len: u64,
    /// The longest `len` in this subtree.
    longest: u64,
    prio: u64,
    kids: [u32; 2],
}

#[derive(Debug, Clone)]
pub(super) struct ByAge {
    nodes: Vec<Node>,
    spare: Vec<u32>,
    root: u32,
    rng: u64,
}

/// The tree's key for a free extent.
pub(super) fn key(age: u64, offset: u64) -> u128 {
    (u128::from(age) << 64) | u128::from(offset)
}

impl ByAge {
    pub(super) fn new() -> ByAge {
        ByAge {
            nodes: Vec::new(),
            spare: Vec::new(),
            root: NIL,
            rng: 0x853c_49e6_748f_ea9b,
        }
    }

    /// The longest free extent (0 when there is none).
    pub(super) fn longest(&self) -> u64 {
        self.longest_of(self.root)
    }

    /// The free extent with the greatest key whose length is at least `need`:
    /// `(key, len)`, or `None` when no free extent is that long.
    pub(super) fn youngest_fit(&self, need: u64) -> Option<(u128, u64)> {
        let mut t = self.root;
        if self.longest_of(t) < need {
            return None;
        }
        // Invariant: the subtree at `t` holds an extent of at least `need`.
        loop {
            let n = &self.nodes[t as usize];
            if self.longest_of(n.kids[1]) >= need {
                t = n.kids[1];
            } else if n.len >= need {
                return Some((n.key, n.len));
            } else {
                t = n.kids[0];
            }
        }
    }

    pub(super) fn insert(&mut self, key: u128, len: u64) {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let node = Node {
            key,
            len,
            longest: len,
            prio: z ^ (z >> 31),
            kids: [NIL, NIL],
        };
        let n = match self.spare.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                // Node indices are u32: 4 G free extents would need far more memory than
                // any arena's metadata has.
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.root = self.insert_at(self.root, n);
    }

    /// Removes the node with `key`; false if there is none.
    pub(super) fn remove(&mut self, key: u128) -> bool {
        let before = self.spare.len();
        self.root = self.remove_at(self.root, key);
        self.spare.len() > before
    }

    /// Number of nodes.
    pub(super) fn len(&self) -> usize {
        self.nodes.len() - self.spare.len()
    }

    /// Every `(key, len)` in key order; for checks.
    pub(super) fn entries(&self) -> Vec<(u128, u64)> {
        let mut out = Vec::with_capacity(self.len());
        let mut stack = Vec::new();
        let mut t = self.root;
        while t != NIL || !stack.is_empty() {
            while t != NIL {
                stack.push(t);
                t = self.nodes[t as usize].kids[0];
            }
            if let Some(s) = stack.pop() {
                let n = &self.nodes[s as usize];
                out.push((n.key, n.len));
                t = n.kids[1];
            }
        }
        out
    }

    /// Checks the heap order on priorities and every node's `longest`; panics on the first
    /// broken one. For tests (the key order is checked through [`ByAge::entries`]).
    pub(super) fn check(&self) {
        self.check_at(self.root);
    }

    fn check_at(&self, t: u32) -> u64 {
        if t == NIL {
            return 0;
        }
        let n = &self.nodes[t as usize];
        let mut longest = n.len;
        for k in n.kids {
            if k != NIL {
                assert!(self.nodes[k as usize].prio <= n.prio, "heap order broken");
            }
            longest = longest.max(self.check_at(k));
        }
        assert_eq!(n.longest, longest, "stale subtree maximum");
        longest
    }

    fn longest_of(&self, t: u32) -> u64 {
        if t == NIL {
            0
        } else {
            self.nodes[t as usize].longest
        }
    }

    fn pull(&mut self, t: u32) {
        let [l, r] = self.nodes[t as usize].kids;
        let longest = self.longest_of(l).max(self.longest_of(r));
        let n = &mut self.nodes[t as usize];
        n.longest = n.len.max(longest);
    }

    /// Inserts node `n` into the subtree at `t`; returns the subtree's new root.
    fn insert_at(&mut self, t: u32, n: u32) -> u32 {
        if t == NIL {
            return n;
        }
        let side = usize::from(self.nodes[n as usize].key > self.nodes[t as usize].key);
        let c = self.insert_at(self.nodes[t as usize].kids[side], n);
        self.nodes[t as usize].kids[side] = c;
        if self.nodes[c as usize].prio > self.nodes[t as usize].prio {
            // Rotate `c` above `t`.
            self.nodes[t as usize].kids[side] = self.nodes[c as usize].kids[1 - side];
            self.nodes[c as usize].kids[1 - side] = t;
            self.pull(t);
            self.pull(c);
            c
        } else {
            self.pull(t);
            t
        }
    }

    fn remove_at(&mut self, t: u32, key: u128) -> u32 {
        if t == NIL {
            return NIL;
        }
        let k = self.nodes[t as usize].key;
        if key == k {
            let [l, r] = self.nodes[t as usize].kids;
            self.spare.push(t);
            return self.merge(l, r);
        }
        let side = usize::from(key > k);
        let c = self.remove_at(self.nodes[t as usize].kids[side], key);
        self.nodes[t as usize].kids[side] = c;
        self.pull(t);
        t
    }

    /// Joins two subtrees, every key of `a` below every key of `b`.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if self.nodes[a as usize].prio > self.nodes[b as usize].prio {
            let r = self.merge(self.nodes[a as usize].kids[1], b);
            self.nodes[a as usize].kids[1] = r;
            self.pull(a);
            a
        } else {
            let l = self.merge(a, self.nodes[b as usize].kids[0]);
            self.nodes[b as usize].kids[0] = l;
            self.pull(b);
            b
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        /// Against a BTreeMap and a linear scan.
        #[test]
        fn matches_a_scan(ops in proptest::collection::vec((0u8..3, 0u64..64, 1u64..100), 1..400)) {
            let mut t = ByAge::new();
            let mut m: BTreeMap<u128, u64> = BTreeMap::new();
            for (op, k, v) in ops {
                let k = u128::from(k);
                match op {
                    0 => if let std::collections::btree_map::Entry::Vacant(e) = m.entry(k) {
                        e.insert(v);
                        t.insert(k, v);
                    },
                    1 => prop_assert_eq!(t.remove(k), m.remove(&k).is_some()),
                    _ => {
                        let want = m.iter().rev().find(|(_, &l)| l >= v).map(|(&k, &l)| (k, l));
                        prop_assert_eq!(t.youngest_fit(v), want);
                    }
                }
                t.check();
                prop_assert_eq!(t.entries(), m.iter().map(|(&k, &l)| (k, l)).collect::<Vec<_>>());
                prop_assert_eq!(t.longest(), m.values().copied().max().unwrap_or(0));
                prop_assert_eq!(t.len(), m.len());
            }
        }
    }
}
