//! The compiled graph's structure: nodes by position ([`NodeIx`]), what each leads to
//! (edges, routers), breakpoints, and joins.

use super::*;

/// A node of a compiled graph, by position. Made only by [`Inner::new`] from positions
/// in its `nodes` (and looked up by name in `index`, which holds the same positions);
/// `nodes` never changes afterwards, so a `NodeIx` is always in range for its graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct NodeIx(usize);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    Node(NodeIx),
    End,
}

pub(super) struct JoinIdx {
    pub(super) sources: Vec<NodeIx>,
    pub(super) target: Target,
}

/// Where a node (or `START`) leads: its static edges and its routers.
pub(super) struct Outgoing<S: State> {
    pub(super) edges: Vec<Target>,
    pub(super) routers: Vec<RouterSpec<S>>,
}

impl<S: State> Default for Outgoing<S> {
    fn default() -> Self {
        Outgoing {
            edges: Vec::new(),
            routers: Vec::new(),
        }
    }
}

/// A node with everything the engine looks up for it.
pub(super) struct Node<S: State> {
    pub(super) spec: NodeSpec<S>,
    pub(super) out: Outgoing<S>,
    pub(super) interrupt_before: bool,
    pub(super) interrupt_after: bool,
}

pub(crate) struct Inner<S: State> {
    pub(super) nodes: Vec<Node<S>>,
    pub(super) index: HashMap<String, NodeIx>,
    pub(super) start: Outgoing<S>,
    pub(super) joins: Vec<JoinIdx>,
    pub(super) checkpointer: Option<Arc<dyn Checkpointer>>,
}

impl<S: State> Inner<S> {
    /// Indexes a graph `compile` has checked (an unknown name is still a typed error).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        nodes: Vec<NodeSpec<S>>,
        edges: Vec<(String, String)>,
        joins: Vec<Join>,
        routers: Vec<(String, RouterSpec<S>)>,
        checkpointer: Option<Arc<dyn Checkpointer>>,
        interrupt_before: Vec<String>,
        interrupt_after: Vec<String>,
    ) -> Result<Self, BuildError> {
        let index: HashMap<String, NodeIx> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.to_string(), NodeIx(i)))
            .collect();
        // `compile` checked every name before: this is for a graph built otherwise.
        let unknown = |n: &str| {
            let mut nodes: Vec<String> = index.keys().cloned().collect();
            nodes.sort();
            BuildError::UnknownNode {
                name: n.to_owned(),
                used_in: "the graph".to_owned(),
                nodes,
            }
        };
        let lookup = |n: &str| index.get(n).copied().ok_or_else(|| unknown(n));
        let target = |n: &str| {
            if n == END {
                Ok(Target::End)
            } else {
                lookup(n).map(Target::Node)
            }
        };
        let mut entries: Vec<Node<S>> = nodes
            .into_iter()
            .map(|spec| Node {
                spec,
                out: Outgoing::default(),
                interrupt_before: false,
                interrupt_after: false,
            })
            .collect();
        let mut start = Outgoing::default();
        for (f, t) in &edges {
            let t = target(t)?;
            let out = if f == START {
                &mut start
            } else {
                &mut entries.get_mut(lookup(f)?.0).ok_or_else(|| unknown(f))?.out
            };
            if !out.edges.contains(&t) {
                out.edges.push(t);
            }
        }
        for (f, r) in routers {
            let out = if f == START {
                &mut start
            } else {
                &mut entries
                    .get_mut(lookup(&f)?.0)
                    .ok_or_else(|| unknown(&f))?
                    .out
            };
            out.routers.push(r);
        }
        let joins = joins
            .iter()
            .map(|j| {
                Ok(JoinIdx {
                    sources: j
                        .sources
                        .iter()
                        .map(|s| lookup(s))
                        .collect::<Result<_, BuildError>>()?,
                    target: target(&j.target)?,
                })
            })
            .collect::<Result<_, BuildError>>()?;
        for n in &interrupt_before {
            entries
                .get_mut(lookup(n)?.0)
                .ok_or_else(|| unknown(n))?
                .interrupt_before = true;
        }
        for n in &interrupt_after {
            entries
                .get_mut(lookup(n)?.0)
                .ok_or_else(|| unknown(n))?
                .interrupt_after = true;
        }
        Ok(Inner {
            nodes: entries,
            index,
            start,
            joins,
            checkpointer,
        })
    }

    /// The node at `n`.
    // In range: a `NodeIx` is a position in `nodes` (see `NodeIx`).
    #[allow(clippy::indexing_slicing)]
    pub(super) fn node(&self, n: NodeIx) -> &Node<S> {
        &self.nodes[n.0]
    }

    /// The name of the node at `n`.
    pub(super) fn name(&self, n: NodeIx) -> &Arc<str> {
        &self.node(n).spec.name
    }

    /// Where `from` leads (`None` = `START`), and its name.
    pub(super) fn outgoing(&self, from: Option<NodeIx>) -> (&Outgoing<S>, &str) {
        match from {
            None => (&self.start, START),
            Some(n) => {
                let node = self.node(n);
                (&node.out, &node.spec.name)
            }
        }
    }
}
