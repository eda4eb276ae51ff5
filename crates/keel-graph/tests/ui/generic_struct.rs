// A state is a concrete schema: no generic parameters.
use keel_graph::State;

#[derive(Clone, State)]
struct Holder<T> {
    value: T,
}

fn main() {}
