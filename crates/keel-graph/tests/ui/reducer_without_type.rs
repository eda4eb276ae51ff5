// `#[reducer]` needs the reducer type.
use keel_graph::State;

#[derive(Clone, State)]
struct Counter {
    #[reducer]
    total: u32,
}

fn main() {}
