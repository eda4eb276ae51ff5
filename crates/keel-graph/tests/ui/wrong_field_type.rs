// The field's type must be the reducer's value: `Sum<u64>` folds into a `u64`.
use keel_graph::State;
use keel_graph::reducer::Sum;

#[derive(Clone, State)]
struct Counter {
    #[reducer(Sum<u64>)]
    total: String,
}

fn main() {}
