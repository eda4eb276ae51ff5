// `with = expr` is the only option of `#[reducer(..)]`.
use keel_graph::State;

#[derive(Clone, State)]
struct Counter {
    #[reducer(keel_graph::reducer::Sum<u32>, init = 3)]
    total: u32,
}

fn main() {}
