// `crate = ..` must be a path.
use keel_graph::State;

#[derive(Clone, State)]
#[state(crate = "keel graph")]
struct Counter {
    total: u32,
}

fn main() {}
