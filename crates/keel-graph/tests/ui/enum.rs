// An enum is not a state: a state is a struct whose fields are channels.
use keel_graph::State;

#[derive(Clone, State)]
enum Phase {
    Plan,
    Act,
}

fn main() {}
