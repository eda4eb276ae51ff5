// The same harness compiles a correct state, so the failures above are the derive's.
use keel_graph::State;
use keel_graph::reducer::Sum;

#[derive(Clone, State)]
#[state(crate = "keel_graph")]
struct Counter {
    #[reducer(Sum<u32>)]
    total: u32,
    note: String,
}

fn main() {
    let _update = CounterUpdate::default().total(3).note("hi".to_owned());
}
