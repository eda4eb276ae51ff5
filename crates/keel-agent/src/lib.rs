//! keel-agent (in progress)
