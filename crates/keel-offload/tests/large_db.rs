//! A 200 MB tool result goes into SQLite and PostgreSQL without a second copy in
//! memory, and comes back with one copy (`get`) or a chunk at a time (`grep`).
//!
//! This binary counts every allocation of the process (`peak_alloc` as the global
//! allocator; the PostgreSQL connection thread's included) and holds this one test, so
//! the peaks it reads are the stores' own. SQLite allocates its page cache with its
//! own allocator, outside the count: for SQLite the numbers are the Rust side's.
//! PostgreSQL runs when `DATABASE_URL` is set (skipped with the reason otherwise,
//! failing under `CI=true`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_offload::{
    GrepOptions, Key, OffloadStore, Pattern, PostgresStore, PostgresStoreOptions, SqliteStore,
};
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

const MB: usize = 1 << 20;
const SIZE: usize = 200 * MB;

fn mb(bytes: usize) -> f64 {
    bytes as f64 / MB as f64
}

/// Puts, gets and greps `text` in `store`, printing and checking the peaks.
fn check(name: &str, store: &dyn OffloadStore, text: &str) {
    let key = Key::new("big", "large_tool_results/call_big").unwrap();
    let before = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    assert_eq!(store.put(&key, text).unwrap(), SIZE as u64);
    let put_peak = ALLOC.peak_usage().saturating_sub(before);

    let before = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let back = store.get(&key).unwrap();
    let get_peak = ALLOC.peak_usage().saturating_sub(before);
    assert!(back == text, "{name}: get returned other text");
    drop(back);

    let before = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let found = store
        .grep(
            key.thread(),
            None,
            &Pattern::new("^ *LAST ").unwrap(),
            &GrepOptions::default(),
        )
        .unwrap();
    let grep_peak = ALLOC.peak_usage().saturating_sub(before);
    assert_eq!(found.matches.len(), 1, "{name}");
    assert_eq!(found.bytes_searched, SIZE as u64);
    eprintln!(
        "{name}: 200 MB put: peak {:.1} MB above start; get: {:.1} MB; grep: {:.1} MB",
        mb(put_peak),
        mb(get_peak),
        mb(grep_peak)
    );
    assert!(
        put_peak < 16 * MB,
        "{name}: put peaked {put_peak} bytes above start"
    );
    assert!(
        get_peak < SIZE + 16 * MB,
        "{name}: get peaked {get_peak} bytes above start (a second copy?)"
    );
    assert!(
        grep_peak < 24 * MB,
        "{name}: grep peaked {grep_peak} bytes above start"
    );
    assert_eq!(store.delete_thread(key.thread()).unwrap(), 1);
}

#[test]
fn a_200_mb_result_goes_to_each_database_with_one_copy_in_memory() {
    let mut text = String::with_capacity(SIZE);
    let line = " INFO request served from cache in 3 ms, upstream healthy, queue depth 0\n";
    let mut i = 0u64;
    while text.len() + 12 + line.len() + 20 <= SIZE {
        text.push_str(&format!("{i:>12}"));
        text.push_str(line);
        i += 1;
    }
    text.push_str("LAST line\n");
    while text.len() < SIZE {
        text.push('.');
    }
    assert_eq!(text.len(), SIZE);

    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path().join("big.db")).unwrap();
    check("sqlite", &sqlite, &text);
    drop(sqlite);

    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => {
            let schema = format!("keel_offload_test_large_{}", std::process::id());
            let store = PostgresStore::connect_with(
                &url,
                PostgresStoreOptions::new().schema(schema.clone()).unwrap(),
            )
            .unwrap();
            check("postgres", &store, &text);
            drop(store);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .unwrap();
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                client
                    .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                    .await
                    .unwrap();
            });
        }
        _ => {
            let reason = "DATABASE_URL is not set (run `cargo xtask test`, which starts a throwaway PostgreSQL cluster)";
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!("CI=true but no PostgreSQL: {reason}");
            }
            eprintln!("postgres part: skipped: {reason}");
        }
    }
}
