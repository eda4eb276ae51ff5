// What the struct literals of `struct_literals.rs` are written as.
use std::time::Duration;

use keel_graph::{Durability, NodeOptions, RetryPolicy, RunConfig, StreamMode};

fn main() {
    let config = RunConfig::thread("t")
        .with_checkpoint_ns("sub")
        .with_durability(Durability::Exit)
        .with_recursion_limit(10)
        .with_metadata("run", 7)
        .with_configurable("model", "small");
    assert_eq!(config.recursion_limit, 10);
    let retry = RetryPolicy::default()
        .max_attempts(2)
        .initial_backoff(Duration::from_millis(5))
        .multiplier(1.5)
        .max_backoff(Duration::from_secs(1));
    let options = NodeOptions::default()
        .timeout(Duration::from_secs(1))
        .retry(retry)
        .destinations(["a"]);
    assert_eq!(options.destinations, ["a"]);
    let mode = StreamMode::values().with_updates().with_debug();
    assert!(mode.values && mode.updates && mode.debug);
}
