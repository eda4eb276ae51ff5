//! placeholder, replaced below
fn main() {}
