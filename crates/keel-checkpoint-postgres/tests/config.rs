//! Configuration reaches the server: pool size, statement timeout, application name.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_size_and_session_settings_apply() {
    let Some(db) = common::saver_with("config", |c| {
        c.pool_size(3)
            .statement_timeout(Some(Duration::from_millis(1500)))
    })
    .await
    else {
        return;
    };
    assert_eq!(db.saver.pool().status().max_size, 3);
    let client = db.saver.pool().get().await.unwrap();
    let timeout: String = client
        .query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(timeout, "1500ms");
    let name: String = client
        .query_one("SHOW application_name", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(name, "keel");
    // A statement over the timeout is cancelled by the server.
    let err = client
        .query_one("SELECT pg_sleep(5)", &[])
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::QUERY_CANCELED)
    );
    drop(client);
    db.drop_schema().await;
}
