// The configuration structs gain fields as the engine grows: outside keel-graph they
// are made with their constructors and setters, never with a struct literal.
fn main() {
    let _ = keel_graph::RunConfig {
        thread_id: None,
        ..Default::default()
    };
    let _ = keel_graph::RetryPolicy {
        max_attempts: 2,
        ..Default::default()
    };
    let _ = keel_graph::NodeOptions {
        timeout: None,
        ..Default::default()
    };
    let _ = keel_graph::StreamMode {
        values: true,
        ..Default::default()
    };
}
