// A tuple struct has no field names to make channels of.
use keel_graph::State;

#[derive(Clone, State)]
struct Pair(u32, String);

fn main() {}
