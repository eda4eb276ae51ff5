//! Where things go when they leave an agent's context — stored first, and found again.
//!
//! The one abstraction is [`OffloadStore`]: a namespace of text files per thread, with
//! `put`, `append`, `get`, line ranges, `list`, `grep` and `delete`. Keys are a
//! [`ThreadId`] and a [`StorePath`], validated when built, so `../../etc/passwd`, an
//! absolute path, a NUL byte or a 4 KB name never reach the disk. Four backends pass
//! one conformance suite ([`conformance`], feature `conformance`):
//!
//! | backend | feature | where the files live |
//! |---|---|---|
//! | [`FsStore`] | `fs` (default) | a directory: atomic writes, append-only appends, configurable fsync, symbolic links never followed |
//! | [`MemoryStore`] | — | memory, optionally with a byte limit |
//! | [`SqliteStore`] | `sqlite` | a SQLite file, possibly the checkpointer's: one file for checkpoints and archive |
//! | [`PostgresStore`] | `postgres` | PostgreSQL, beside the checkpointer's tables: every worker of a fleet reads what any other offloaded |
//!
//! The database backends keep a value as a row per file and its bytes in chunks of at
//! most 1 MiB, keyed by thread id first, so a 200 MB result is never held twice and
//! an append never rewrites what is stored; [`OffloadStore::delete_thread`] removes a
//! thread's rows in one transaction.
//!
//! Everything else in the crate is built on a store and used by the compaction engine
//! and the agent loop (invariant 2 of keel's `docs/architecture.md`: whatever leaves the
//! context is stored first and can be found again):
//!
//! * **Policies** — pure steps from messages to edited messages plus a record of what
//!   was stored ([`PolicyOutcome`]). [`EvictLargeResults`] moves tool results over
//!   20,000 tokens (counted by a [`TokenCounter`](keel_token::TokenCounter)) to
//!   `large_tool_results/<tool_call_id>` (`<tool_call_id>~2`, … when the thread used
//!   the id before: a policy never overwrites what is stored) and leaves a stub with
//!   the head and tail;
//!   [`TruncateArguments`] replaces long arguments of old `write_file`/`edit_file`
//!   calls by pointers once the context is 85% full, once, so the prompt prefix stays
//!   stable for provider caches; [`Archive`] appends messages to the thread's JSON Lines
//!   history before they leave, and fetches them by id, range or grep. When storing
//!   fails (disk full, permission denied), a policy leaves the message as it was and
//!   reports the error.
//! * **Retrieval tools** — [`RetrievalTools`] gives the agent `ls`, `read_file` and
//!   `grep` over its thread's files, with JSON schemas and capped output.
//! * **Lineages** — a run forked from an older checkpoint writes into the same thread.
//!   A [`Lineage`] (kept in each checkpoint's state) says how much of the thread's
//!   files that checkpoint has seen; a [`LineageStore`] shows the store as one lineage
//!   sees it (the archive as of the fork point plus the fork's own records) and writes
//!   apart, into `.keel/forks/<id>/`, only when another branch stored past the fork
//!   point. [`collect_garbage`] removes what no surviving checkpoint sees.
//!
//! All store operations block (plain `std::fs`, SQLite calls, a wait for
//! [`PostgresStore`]'s connection thread); async callers run them on a blocking
//! thread — see [`OffloadStore`]. [`PostgresStore`] also works, without panicking,
//! when called straight from a runtime's worker.
//!
//! # Example
//!
//! ```
//! # #[cfg(feature = "fs")] {
//! use std::sync::Arc;
//! use keel_offload::message::{Message, ToolCall};
//! use keel_offload::{
//!     Archive, EvictLargeResults, FsStore, Fsync, OffloadStore, PolicyEnv, RetrievalTools, ThreadId,
//! };
//! use keel_offload::token::ApproxCounter;
//! use serde_json::json;
//!
//! let dir = tempfile::tempdir()?;
//! let store = Arc::new(FsStore::new(dir.path())?.with_fsync(Fsync::Never));
//! let thread = ThreadId::new("thread-1")?;
//! let counter = ApproxCounter::new();
//!
//! // A tool returned 30,000 lines of test output: far over 20,000 tokens.
//! let output: String = (1..=30_000).map(|i| format!("test case {i} ... ok\n")).collect();
//! let history = vec![
//!     Message::user("Run the test suite.").with_id("m1"),
//!     Message::assistant("")
//!         .with_id("m2")
//!         .with_tool_calls(vec![ToolCall::new("call_7", "run_tests", json!({}))]),
//!     Message::tool("call_7", output).with_id("m3"),
//! ];
//!
//! // 1. Evict: the result goes to the store, a stub stays in context.
//! let env = PolicyEnv::new(&*store, &thread, &counter);
//! let out = EvictLargeResults::new().apply(history, &env);
//! assert!(out.is_complete());
//! let stub = out.messages[2].text().into_owned();
//! assert!(stub.contains("stored in full at large_tool_results/call_7"));
//! assert!(stub.contains(" 30000\ttest case 30000 ... ok"));
//!
//! // 2. The agent reads it back with the retrieval tools.
//! let tools = RetrievalTools::new(store.clone(), thread.clone());
//! let call = ToolCall::new("call_8", "grep", json!({"pattern": r"case 1234\b"}));
//! assert_eq!(tools.execute(&call)?, "large_tool_results/call_7:1234: test case 1234 ... ok");
//!
//! // 3. Compaction archives the first two messages before they leave the context.
//! let archive = Archive::new(store.clone());
//! let out = archive.archive_and_remove(out.messages, 0..2, &thread);
//! assert_eq!(out.messages.len(), 1);
//! assert_eq!(archive.get(&thread, "m1")?.unwrap().message.text(), "Run the test suite.");
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// Without `fs` the docs still name `FsStore`; the links resolve with it.
#![cfg_attr(
    not(all(feature = "fs", feature = "sqlite", feature = "postgres")),
    allow(rustdoc::broken_intra_doc_links)
)]

mod archive;
#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod db;
mod error;
#[cfg(feature = "fs")]
mod fs;
mod key;
mod lineage;
mod memory;
mod policy;
#[cfg(feature = "postgres")]
mod postgres;
mod scan;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;
mod tools;

pub use archive::{Appended, Archive, ArchiveGrep, ArchivedMessage};
#[cfg(feature = "postgres")]
pub use deadpool_postgres::Pool as PostgresPool;
pub use error::{KeyKind, KeyProblem, OffloadError, Shown};
#[cfg(feature = "fs")]
pub use fs::{FsStore, Fsync};
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
/// The token counters (keel-token) that [`PolicyEnv`] takes to price text, re-exported
/// so a user of this crate alone needs no second dependency:
/// `keel_offload::token::ApproxCounter`. Exact counts for OpenAI models need keel-token's
/// `tiktoken` feature (add `keel-token` with `features = ["tiktoken"]`, or turn on this
/// crate's `tiktoken` feature); sizing results for eviction needs no more than the
/// estimate.
pub use keel_token as token;
pub use key::{Key, MAX_COMPONENT_BYTES, MAX_PATH_BYTES, StorePath, ThreadId, safe_component};
pub use lineage::{Collected, LINEAGE_DIR, LINEAGE_KEY, Lineage, LineageStore, collect_garbage};
pub use memory::MemoryStore;
pub use policy::{
    EvictLargeResults, Failure, MAX_MINIFY_BYTES, METADATA_KEY, PolicyEnv, PolicyOutcome, Stored,
    StoredWhat, TruncateArguments, minify_json, minify_json_results,
};
#[cfg(feature = "postgres")]
pub use postgres::{
    DEFAULT_POSTGRES_POOL_SIZE, POSTGRES_SCHEMA_VERSION, PostgresStore, PostgresStoreOptions,
};
#[cfg(feature = "sqlite")]
pub use sqlite::{SQLITE_SCHEMA_VERSION, SqliteStore, SqliteStoreOptions};
pub use store::{
    Entry, GrepMatch, GrepOptions, GrepOutcome, Line, LineRange, Lines, OffloadStore, Pattern,
};
pub use tools::{GREP, LS, READ_FILE, RetrievalTools, ToolError, ToolLimits, output_room};
