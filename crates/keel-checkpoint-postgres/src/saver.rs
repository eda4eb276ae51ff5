//! The saver.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use keel_checkpoint::support::{self, DeltaLink, DeltaLinks};
use keel_checkpoint::{
    ChannelDelta, ChannelVersion, Checkpoint, CheckpointError, CheckpointId, CheckpointMetadata,
    CheckpointSummary, CheckpointTuple, Checkpointer, ListOptions, PendingWrite, PutRequest,
    ThreadInfo, ThreadKey,
};
use serde_json::{Map, Value};
use tokio_postgres::Row;
use uuid::Uuid;

use crate::codec::{
    JsonText, MAX_NAME_BYTES, RawJson, check_jsonb_map, check_text, check_thread, decode_versions,
    encode_versions, id_of, jsonb_storable, seq_from_sql, seq_to_sql, to_json, uuid_of,
};
use crate::config::{PostgresConfig, check_schema};
use crate::error::{PostgresError, put_error, query_error};
use crate::schema;
use crate::sql::Statements;

/// Rows fetched per page by [`Checkpointer::list`].
const LIST_PAGE: usize = 128;
/// Threads deleted per batch by [`PostgresSaver::sweep_idle`] (the inherent method).
const SWEEP_BATCH: usize = 256;
/// Sorts after every UUID v7 (the "no upper bound" cursor of `list`).
const MAX_UUID: Uuid = Uuid::max();

/// A [`Checkpointer`] on PostgreSQL, over a pool of connections.
///
/// Cheap to clone; clones share the pool. Each call borrows one pooled connection for
/// its duration and nothing else is shared, so concurrency scales with the pool size.
/// See the [crate docs](crate) for the schema and how fencing works.
#[derive(Clone)]
pub struct PostgresSaver {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    schema: String,
    sql: Statements,
    /// The versions of the newest checkpoint this saver put in each namespace: `keel_put`
    /// confirms the head under its lock, so references to them need no lookup.
    heads: Mutex<support::HeadVersions>,
    /// The links of the deltas this saver put, so a prune need not read the kept
    /// chains back.
    links: Mutex<DeltaLinks>,
}

/// Namespaces whose head versions a saver remembers ([`support::HeadVersions`]).
const HEAD_VERSIONS: usize = 4096;

impl std::fmt::Debug for PostgresSaver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresSaver")
            .field("schema", &self.inner.schema)
            .field("pool", &self.inner.pool.status())
            .finish()
    }
}

/// Bytes and rows one thread occupies, from
/// [`PostgresSaver::thread_storage`]: the sum of `pg_column_size` over its rows (as
/// stored, after compression; indexes and page overhead not included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ThreadStorage {
    /// Bytes of checkpoint rows.
    pub checkpoint_bytes: u64,
    /// Bytes of channel-delta rows (updates and snapshots).
    pub delta_bytes: u64,
    /// Bytes of pending-write rows.
    pub write_bytes: u64,
    /// Bytes of head rows.
    pub head_bytes: u64,
    /// Checkpoints stored.
    pub checkpoints: u64,
    /// Channel deltas stored.
    pub deltas: u64,
    /// Deltas that carry a snapshot.
    pub snapshots: u64,
}

impl ThreadStorage {
    /// All bytes together.
    pub fn total_bytes(&self) -> u64 {
        self.checkpoint_bytes + self.delta_bytes + self.write_bytes + self.head_bytes
    }
}

impl PostgresSaver {
    /// A saver over a new connection pool. Connections open lazily; this checks the
    /// settings but does not contact the server (the first call, e.g.
    /// [`setup`](Self::setup), does).
    pub fn connect(config: &PostgresConfig) -> Result<Self, PostgresError> {
        let manager = Manager::from_config(
            config.session_config(),
            config.tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.pool_wait))
            .create_timeout(Some(Duration::from_secs(15)))
            .build()
            .map_err(|e| PostgresError::Config {
                reason: format!("cannot build the connection pool: {e}"),
            })?;
        Self::with_links(pool, &config.schema, config.delta_links)
    }

    /// A saver over an existing pool (e.g. one with a connector of your own), with its tables in
    /// `schema`.
    pub fn from_pool(pool: Pool, schema: &str) -> Result<Self, PostgresError> {
        Self::with_links(pool, schema, crate::config::DEFAULT_DELTA_LINKS)
    }

    fn with_links(pool: Pool, schema: &str, links: usize) -> Result<Self, PostgresError> {
        check_schema(schema)?;
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                schema: schema.to_owned(),
                sql: Statements::new(schema),
                heads: Mutex::new(support::HeadVersions::new(HEAD_VERSIONS)),
                links: Mutex::new(DeltaLinks::new(links)),
            }),
        })
    }

    /// Creates or upgrades keel's tables: applies the migrations the schema lacks (see
    /// [`migrate`](crate::migrate)); returns the versions applied. Idempotent, and safe
    /// to call from many processes at once.
    pub async fn setup(&self) -> Result<Vec<i32>, PostgresError> {
        let mut client = self.inner.pool.get().await?;
        let client: &mut tokio_postgres::Client = &mut client;
        schema::migrate(client, &self.inner.schema).await
    }

    /// The newest migration applied to the schema, read only (nothing is created or
    /// upgraded): `None` when the schema has no keel tables, and
    /// [`PostgresError::SchemaTooNew`] when a newer keel migrated it, so a reader (an
    /// admin listing under a read-only role) never misreads rows written in a format
    /// it does not know.
    pub async fn schema_version(&self) -> Result<Option<i32>, PostgresError> {
        let client = self.inner.pool.get().await?;
        schema::applied_version(&**client, &self.inner.schema).await
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The schema of keel's tables.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// Deletes every idle thread, however many, and returns how many it deleted: the
    /// same rule as [`Checkpointer::sweep_idle`] (newest checkpoint, over all
    /// namespaces, older than `idle_for` by its id's time), applied in batches of 256
    /// with one cutoff until a batch comes back short. A thread that takes a new
    /// checkpoint while being swept is kept. It deletes checkpoints only: an agent's
    /// offloaded files stay in their store (`Agent::sweep_idle` deletes those too;
    /// with a fleet, `Queue::sweep_idle`).
    ///
    /// This method shadows the trait's bounded one on a `PostgresSaver`; to delete at
    /// most `limit` threads per call, call
    /// `Checkpointer::sweep_idle(&saver, idle_for, limit)` (through
    /// `Arc<dyn Checkpointer>` and generic code, the trait's is the one called).
    pub async fn sweep_idle(&self, idle_for: Duration) -> Result<usize, CheckpointError> {
        let cutoff = uuid_of(&support::idle_cutoff(idle_for))?;
        let mut deleted = 0;
        loop {
            let batch = self.sweep(cutoff, SWEEP_BATCH).await?.len();
            deleted += batch;
            if batch < SWEEP_BATCH {
                return Ok(deleted);
            }
        }
    }

    /// Deletes up to `limit` threads whose every head sorts below `cutoff`; their ids.
    ///
    /// Candidates come from the heads index, oldest first; each is deleted in its own
    /// transaction after locking its heads and checking them again, so a thread that
    /// took a checkpoint meanwhile is skipped. Rounds go on until `limit` threads are
    /// deleted or a round finds no thread it has not tried, so a call that returns
    /// fewer than `limit` found no other idle thread.
    async fn sweep(&self, cutoff: Uuid, limit: usize) -> Result<Vec<String>, CheckpointError> {
        let mut deleted = Vec::new();
        let mut tried = HashSet::new();
        while deleted.len() < limit {
            let want = limit - deleted.len();
            let candidates: Vec<String> = {
                let client = self.client().await?;
                let stmt = self.prepare(&client, &self.inner.sql.idle_threads).await?;
                let want = i64::try_from(want).unwrap_or(i64::MAX);
                client
                    .query(&stmt, &[&cutoff, &want])
                    .await
                    .map_err(|e| self.query_error(e))?
                    .iter()
                    .map(|row| row.try_get::<_, String>(0).map_err(corrupt))
                    .collect::<Result<_, _>>()?
            };
            // Every idle head was in this round: whatever was not deleted is not idle.
            let exhausted = candidates.len() < want;
            let mut new = false;
            for thread_id in candidates {
                if deleted.len() == limit {
                    break;
                }
                // A thread comes once per idle namespace, and one tried before is no
                // longer idle (or was deleted by someone else and made again).
                if !tried.insert(thread_id.clone()) {
                    continue;
                }
                new = true;
                if self.delete(&thread_id, Some(cutoff)).await? {
                    deleted.push(thread_id);
                }
            }
            if exhausted || !new {
                break;
            }
        }
        Ok(deleted)
    }

    /// What `thread_id` occupies in the tables (all namespaces).
    pub async fn thread_storage(&self, thread_id: &str) -> Result<ThreadStorage, CheckpointError> {
        check_thread(thread_id, "")?;
        let client = self.client().await?;
        let stmt = self.prepare(&client, &self.inner.sql.thread_bytes).await?;
        let row = client
            .query_one(&stmt, &[&thread_id])
            .await
            .map_err(|e| self.query_error(e))?;
        let n = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap_or(0);
        Ok(ThreadStorage {
            checkpoint_bytes: n(0),
            delta_bytes: n(1),
            write_bytes: n(2),
            head_bytes: n(3),
            checkpoints: n(4),
            deltas: n(5),
            snapshots: n(6),
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, CheckpointError> {
        Ok(self.inner.pool.get().await.map_err(PostgresError::from)?)
    }

    async fn prepare(
        &self,
        client: &deadpool_postgres::Client,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, CheckpointError> {
        client
            .prepare_cached(sql)
            .await
            .map_err(|e| self.query_error(e))
    }

    fn query_error(&self, error: tokio_postgres::Error) -> CheckpointError {
        query_error(&self.inner.schema, error)
    }

    /// Deletes `thread_id`; with `idle_before`, only if every namespace's head still
    /// sorts below it once locked. Returns whether it deleted.
    async fn delete(
        &self,
        thread_id: &str,
        idle_before: Option<Uuid>,
    ) -> Result<bool, CheckpointError> {
        let mut client = self.client().await?;
        let sql = &self.inner.sql;
        let lock = self.prepare(&client, &sql.lock_heads).await?;
        let mut deletes = Vec::with_capacity(sql.delete.len());
        for text in &sql.delete {
            deletes.push(self.prepare(&client, text).await?);
        }
        let tx = client
            .transaction()
            .await
            .map_err(|e| self.query_error(e))?;
        let cutoff = idle_before.unwrap_or(MAX_UUID);
        let heads = tx
            .query(&lock, &[&thread_id, &cutoff])
            .await
            .map_err(|e| self.query_error(e))?;
        if idle_before.is_some() {
            let mut idle = !heads.is_empty();
            for row in &heads {
                idle &= row.try_get::<_, Option<bool>>(1).map_err(corrupt)? == Some(true);
            }
            if !idle {
                tx.rollback().await.map_err(|e| self.query_error(e))?;
                return Ok(false);
            }
        }
        for stmt in &deletes {
            tx.execute(stmt, &[&thread_id])
                .await
                .map_err(|e| self.query_error(e))?;
        }
        tx.commit().await.map_err(|e| self.query_error(e))?;
        self.links().forget_thread(thread_id);
        Ok(true)
    }

    async fn list_page(
        &self,
        thread: &ThreadKey,
        cursor: Uuid,
        filter: &str,
        page: i64,
    ) -> Result<Vec<Row>, CheckpointError> {
        let client = self.client().await?;
        let stmt = self.prepare(&client, &self.inner.sql.list_page).await?;
        client
            .query(
                &stmt,
                &[
                    &thread.thread_id,
                    &thread.ns,
                    &cursor,
                    &JsonText(filter),
                    &page,
                ],
            )
            .await
            .map_err(|e| self.query_error(e))
    }
}

/// The checkpoint and metadata columns (0..=6) of a row, as `get` and `list` select them.
fn summary_of(row: &Row) -> Result<(Checkpoint, CheckpointMetadata), CheckpointError> {
    let id = id_of(row.try_get(0).map_err(corrupt)?)?;
    let parent = row
        .try_get::<_, Option<Uuid>>(1)
        .map_err(corrupt)?
        .map(id_of)
        .transpose()?;
    let created_at = u64::try_from(row.try_get::<_, i64>(2).map_err(corrupt)?).unwrap_or(0);
    let metadata: CheckpointMetadata = row
        .try_get::<_, RawJson<'_>>(3)
        .map_err(corrupt)?
        .parse("metadata")?;
    let channel_versions = decode_versions(&id, row.try_get(4).map_err(corrupt)?)?;
    let versions_seen = match row.try_get::<_, Option<RawJson<'_>>>(5).map_err(corrupt)? {
        Some(raw) => raw.parse("versions seen")?,
        None => BTreeMap::new(),
    };
    let pending_sends = match row.try_get::<_, Option<RawJson<'_>>>(6).map_err(corrupt)? {
        Some(raw) => raw.parse("pending sends")?,
        None => Vec::new(),
    };
    Ok((
        Checkpoint {
            id,
            parent,
            created_at,
            channel_versions,
            versions_seen,
            pending_sends,
        },
        metadata,
    ))
}

fn corrupt(error: tokio_postgres::Error) -> CheckpointError {
    CheckpointError::Corrupt {
        what: format!("unexpected column value: {error}"),
    }
}

/// A row of `prune_chains`: channel, writer id and the delta's link.
fn link_of(row: &Row) -> Result<(String, String, DeltaLink), CheckpointError> {
    let channel: String = row.try_get(0).map_err(corrupt)?;
    let writer: Uuid = row.try_get(1).map_err(corrupt)?;
    let seq = seq_from_sql(row.try_get(2).map_err(corrupt)?)?;
    let snapshot: bool = row.try_get(3).map_err(corrupt)?;
    let base_writer: Option<Uuid> = row.try_get(4).map_err(corrupt)?;
    let base_seq: Option<i64> = row.try_get(5).map_err(corrupt)?;
    let base = match (base_writer, base_seq) {
        (Some(w), Some(s)) => Some((id_of(w)?.as_str().to_owned(), seq_from_sql(s)?)),
        _ => None,
    };
    Ok((
        channel,
        id_of(writer)?.as_str().to_owned(),
        DeltaLink::new(seq, snapshot, base),
    ))
}

fn tuple_of(thread: &ThreadKey, row: &Row) -> Result<CheckpointTuple, CheckpointError> {
    let (checkpoint, metadata) = summary_of(row)?;
    let get_vec = |i: usize| {
        row.try_get::<_, Option<Vec<Option<Uuid>>>>(i)
            .map_err(corrupt)
    };
    let channels: Vec<String> = row
        .try_get::<_, Option<Vec<String>>>(7)
        .map_err(corrupt)?
        .unwrap_or_default();
    let writers = row
        .try_get::<_, Option<Vec<Uuid>>>(8)
        .map_err(corrupt)?
        .unwrap_or_default();
    let seqs = row
        .try_get::<_, Option<Vec<i64>>>(9)
        .map_err(corrupt)?
        .unwrap_or_default();
    let base_writers = get_vec(10)?.unwrap_or_default();
    let base_seqs = row
        .try_get::<_, Option<Vec<Option<i64>>>>(11)
        .map_err(corrupt)?
        .unwrap_or_default();
    let updates = row
        .try_get::<_, Option<Vec<Option<RawJson<'_>>>>>(12)
        .map_err(corrupt)?
        .unwrap_or_default();
    let snapshots = row
        .try_get::<_, Option<Vec<Option<RawJson<'_>>>>>(13)
        .map_err(corrupt)?
        .unwrap_or_default();
    let n = channels.len();
    if [
        writers.len(),
        seqs.len(),
        base_writers.len(),
        base_seqs.len(),
        updates.len(),
        snapshots.len(),
    ]
    .iter()
    .any(|&len| len != n)
    {
        return Err(CheckpointError::Corrupt {
            what: "chain columns of different lengths".into(),
        });
    }
    // (channel, writer) → delta, for `support::build_chain`.
    let mut deltas: HashMap<(String, CheckpointId), ChannelDelta> = HashMap::with_capacity(n);
    let rows = channels
        .into_iter()
        .zip(writers)
        .zip(seqs)
        .zip(base_writers.into_iter().zip(base_seqs))
        .zip(updates.into_iter().zip(snapshots));
    for ((((channel, writer), seq), (base_writer, base_seq)), (updates, snapshot)) in rows {
        let writer = id_of(writer)?;
        let base = match (base_writer, base_seq) {
            (Some(w), Some(s)) => Some(ChannelVersion::new(seq_from_sql(s)?, id_of(w)?)),
            _ => None,
        };
        let snapshot: Option<Value> = snapshot.map(|s| s.parse("snapshot")).transpose()?;
        let updates: Vec<Value> = match (&snapshot, updates) {
            (None, Some(u)) => u.parse("delta updates")?,
            _ => Vec::new(), // not needed: a chain starts at the snapshot
        };
        let delta = ChannelDelta {
            channel: channel.clone(),
            version: ChannelVersion::new(seq_from_sql(seq)?, writer.clone()),
            base,
            updates,
            snapshot,
        };
        deltas.insert((channel, writer), delta);
    }
    let mut chains = BTreeMap::new();
    for (channel, version) in &checkpoint.channel_versions {
        let chain = support::build_chain(channel, version, |writer| {
            Ok(deltas.get(&(channel.clone(), writer.clone())))
        })?;
        chains.insert(channel.clone(), chain);
    }

    let task_ids = row
        .try_get::<_, Option<Vec<String>>>(14)
        .map_err(corrupt)?
        .unwrap_or_default();
    let task_paths = row
        .try_get::<_, Option<Vec<String>>>(15)
        .map_err(corrupt)?
        .unwrap_or_default();
    let write_channels = row
        .try_get::<_, Option<Vec<String>>>(16)
        .map_err(corrupt)?
        .unwrap_or_default();
    let values = row
        .try_get::<_, Option<Vec<RawJson<'_>>>>(17)
        .map_err(corrupt)?
        .unwrap_or_default();
    let mut pending_writes = Vec::with_capacity(task_ids.len());
    for (((task_id, task_path), channel), value) in task_ids
        .into_iter()
        .zip(task_paths)
        .zip(write_channels)
        .zip(values)
    {
        pending_writes.push(PendingWrite {
            task_id,
            task_path,
            channel,
            value: value.parse("pending write")?,
        });
    }
    Ok(CheckpointTuple {
        thread: thread.clone(),
        checkpoint,
        metadata,
        channels: chains,
        pending_writes,
    })
}

/// The metadata filter of `list` as a containment pattern, or `None` when no stored
/// row can match it. `writes` contains by itself (`["a"]` is in `["a", "b"]`), except
/// that `[]` matches every row, also those with no `writes` key, so it is left out of
/// the pattern; `CheckpointMetadata::matches` decides on each row fetched.
fn list_filter(options: &ListOptions) -> Result<Option<String>, CheckpointError> {
    if !jsonb_storable(&options.metadata) {
        return Ok(None);
    }
    match options.metadata.get("writes") {
        Some(Value::Array(nodes)) if nodes.is_empty() => {
            let mut pattern = options.metadata.clone();
            pattern.shift_remove("writes");
            to_json(&pattern, "metadata filter").map(Some)
        }
        _ => to_json(&options.metadata, "metadata filter").map(Some),
    }
}

struct ListState {
    cursor: Uuid,
    remaining: usize,
    done: bool,
}

impl PostgresSaver {
    fn links(&self) -> std::sync::MutexGuard<'_, DeltaLinks> {
        self.inner
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn heads(&self) -> std::sync::MutexGuard<'_, support::HeadVersions> {
        self.inner
            .heads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Checks and encodes a put (no I/O). `keel_put` checks that the head is
    /// `expected_head` before the references the head versions cannot vouch for.
    fn encode_put<'r>(&self, request: &'r PutRequest) -> Result<PutArgs<'r>, CheckpointError> {
        PutArgs::encode(request, &self.heads())
    }

    /// Runs `keel_put` with `args` on `client` (a pooled connection or a transaction),
    /// then remembers the request's head versions.
    async fn run_put(
        &self,
        client: &impl tokio_postgres::GenericClient,
        stmt: &tokio_postgres::Statement,
        request: &PutRequest,
        args: PutArgs<'_>,
    ) -> Result<(), CheckpointError> {
        args.execute(client, stmt)
            .await
            .map_err(|e| put_error(&self.inner.schema, &request.expected_head, e))?;
        self.heads().remember(request);
        self.links().remember(request);
        Ok(())
    }

    /// `put_many`'s one transaction. On an error nothing of the batch is stored and the
    /// head versions it remembered are forgotten.
    async fn put_batch(&self, requests: &[PutRequest]) -> Result<(), CheckpointError> {
        for request in requests {
            support::validate_put(request)?;
        }
        let mut client = self.client().await?;
        let stmt = self.prepare(&client, &self.inner.sql.put).await?;
        let result = async {
            let tx = client
                .transaction()
                .await
                .map_err(|e| self.query_error(e))?;
            for request in requests {
                // Remembered before the commit: forgotten below if the batch fails.
                self.run_put(&*tx, &stmt, request, self.encode_put(request)?)
                    .await?;
            }
            tx.commit().await.map_err(|e| self.query_error(e))
        }
        .await;
        if result.is_err() {
            self.heads().clear();
        }
        result
    }
}

/// A put's arguments to `keel_put`, encoded and checked (no I/O).
struct PutArgs<'r> {
    request: &'r PutRequest,
    metadata: String,
    versions: String,
    versions_seen: Option<String>,
    pending_sends: Option<String>,
    id: Uuid,
    parent: Option<Uuid>,
    expected: Option<Uuid>,
    created_at: i64,
    d_channel: Vec<&'r str>,
    d_seq: Vec<i64>,
    d_base_writer: Vec<Option<Uuid>>,
    d_base_seq: Vec<Option<i64>>,
    d_updates: Vec<String>,
    d_snapshot: Vec<Option<String>>,
    r_channel: Vec<&'r str>,
    r_writer: Vec<Uuid>,
    r_seq: Vec<i64>,
}

impl<'r> PutArgs<'r> {
    /// Checks and encodes `request` (already through `validate_put`); `heads` decides
    /// which references `keel_put` must look up.
    fn encode(
        request: &'r PutRequest,
        heads: &support::HeadVersions,
    ) -> Result<Self, CheckpointError> {
        let PutRequest {
            thread,
            checkpoint,
            metadata,
            deltas,
            expected_head,
        } = request;
        check_thread(&thread.thread_id, &thread.ns)?;
        for channel in checkpoint.channel_versions.keys() {
            check_text("channel name", channel, Some(MAX_NAME_BYTES))?;
        }
        check_jsonb_map("checkpoint metadata", &metadata.extra)?;
        for node in &metadata.writes {
            check_text("checkpoint metadata writes", node, None)?;
        }
        let n = deltas.len();
        let mut args = PutArgs {
            request,
            metadata: to_json(metadata, "checkpoint metadata")?,
            versions: encode_versions(checkpoint)?,
            versions_seen: (!checkpoint.versions_seen.is_empty())
                .then(|| to_json(&checkpoint.versions_seen, "versions seen"))
                .transpose()?,
            pending_sends: (!checkpoint.pending_sends.is_empty())
                .then(|| to_json(&checkpoint.pending_sends, "pending sends"))
                .transpose()?,
            id: uuid_of(&checkpoint.id)?,
            parent: checkpoint.parent.as_ref().map(uuid_of).transpose()?,
            expected: expected_head.as_ref().map(uuid_of).transpose()?,
            created_at: i64::try_from(checkpoint.created_at).unwrap_or(i64::MAX),
            d_channel: Vec::with_capacity(n),
            d_seq: Vec::with_capacity(n),
            d_base_writer: Vec::with_capacity(n),
            d_base_seq: Vec::with_capacity(n),
            d_updates: Vec::with_capacity(n),
            d_snapshot: Vec::with_capacity(n),
            r_channel: Vec::new(),
            r_writer: Vec::new(),
            r_seq: Vec::new(),
        };
        for delta in deltas {
            args.d_channel.push(delta.channel.as_str());
            args.d_seq.push(seq_to_sql(delta.version.seq)?);
            args.d_base_writer.push(
                delta
                    .base
                    .as_ref()
                    .map(|b| uuid_of(&b.writer))
                    .transpose()?,
            );
            args.d_base_seq
                .push(delta.base.as_ref().map(|b| seq_to_sql(b.seq)).transpose()?);
            args.d_updates
                .push(to_json(&delta.updates, "delta updates")?);
            args.d_snapshot.push(
                delta
                    .snapshot
                    .as_ref()
                    .map(|s| to_json(s, "snapshot"))
                    .transpose()?,
            );
        }
        for (channel, version) in heads.to_check(request) {
            args.r_channel.push(channel);
            args.r_writer.push(uuid_of(&version.writer)?);
            args.r_seq.push(seq_to_sql(version.seq)?);
        }
        Ok(args)
    }

    /// Runs `keel_put` (statement `stmt`) on `client`.
    async fn execute(
        &self,
        client: &impl tokio_postgres::GenericClient,
        stmt: &tokio_postgres::Statement,
    ) -> Result<u64, tokio_postgres::Error> {
        let thread = &self.request.thread;
        let d_updates: Vec<JsonText<'_>> = self.d_updates.iter().map(|s| JsonText(s)).collect();
        let d_snapshot: Vec<Option<JsonText<'_>>> = self
            .d_snapshot
            .iter()
            .map(|s| s.as_deref().map(JsonText))
            .collect();
        client
            .execute(
                stmt,
                &[
                    &thread.thread_id,
                    &thread.ns,
                    &self.id,
                    &self.parent,
                    &self.created_at,
                    &JsonText(&self.metadata),
                    &JsonText(&self.versions),
                    &self.versions_seen.as_deref().map(JsonText),
                    &self.pending_sends.as_deref().map(JsonText),
                    &self.expected,
                    &self.d_channel,
                    &self.d_seq,
                    &self.d_base_writer,
                    &self.d_base_seq,
                    &d_updates,
                    &d_snapshot,
                    &self.r_channel,
                    &self.r_writer,
                    &self.r_seq,
                ],
            )
            .await
    }
}

#[async_trait]
impl Checkpointer for PostgresSaver {
    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> Result<Option<CheckpointTuple>, CheckpointError> {
        check_thread(&thread.thread_id, &thread.ns)?;
        let id = id.map(uuid_of).transpose()?;
        let client = self.client().await?;
        let stmt = self.prepare(&client, &self.inner.sql.get).await?;
        let row = client
            .query_opt(&stmt, &[&thread.thread_id, &thread.ns, &id])
            .await
            .map_err(|e| self.query_error(e))?;
        row.map(|row| tuple_of(thread, &row)).transpose()
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> BoxStream<'a, Result<CheckpointSummary, CheckpointError>> {
        let start = || -> Result<Option<(String, Uuid)>, CheckpointError> {
            check_thread(&thread.thread_id, &thread.ns)?;
            let Some(filter) = list_filter(&options)? else {
                return Ok(None);
            };
            let cursor = options.before.as_ref().map(uuid_of).transpose()?;
            Ok(Some((filter, cursor.unwrap_or(MAX_UUID))))
        };
        let (filter, cursor) = match start() {
            Ok(Some(start)) => start,
            Ok(None) => return stream::empty().boxed(),
            Err(e) => return stream::once(async move { Err(e) }).boxed(),
        };
        let filter = Arc::new(filter);
        let exact: Arc<Map<String, Value>> = Arc::new(options.metadata.clone());
        let state = ListState {
            cursor,
            remaining: options.limit.unwrap_or(usize::MAX),
            done: false,
        };
        stream::unfold(state, move |mut state| {
            let filter = Arc::clone(&filter);
            let exact = Arc::clone(&exact);
            async move {
                if state.done || state.remaining == 0 {
                    return None;
                }
                // Without metadata filters every row counts, so fetch just what is left.
                let page = if exact.is_empty() {
                    state.remaining.min(LIST_PAGE)
                } else {
                    LIST_PAGE
                };
                let page_i64 = i64::try_from(page).unwrap_or(i64::MAX);
                let rows = match self
                    .list_page(thread, state.cursor, &filter, page_i64)
                    .await
                {
                    Ok(rows) => rows,
                    Err(e) => {
                        state.done = true;
                        return Some((vec![Err(e)], state));
                    }
                };
                if rows.len() < page {
                    state.done = true;
                }
                let mut out = Vec::with_capacity(rows.len());
                for row in &rows {
                    if state.remaining == 0 {
                        break;
                    }
                    match summary_of(row) {
                        Ok((checkpoint, metadata)) => {
                            match uuid_of(&checkpoint.id) {
                                Ok(uuid) => state.cursor = uuid,
                                Err(e) => {
                                    state.done = true;
                                    out.push(Err(e));
                                    break;
                                }
                            }
                            if metadata.matches(&exact) {
                                state.remaining -= 1;
                                out.push(Ok(CheckpointSummary {
                                    thread: thread.clone(),
                                    checkpoint,
                                    metadata,
                                }));
                            }
                        }
                        Err(e) => {
                            state.done = true;
                            out.push(Err(e));
                            break;
                        }
                    }
                }
                Some((out, state))
            }
        })
        .flat_map(stream::iter)
        .boxed()
    }

    async fn put(&self, request: PutRequest) -> Result<(), CheckpointError> {
        support::validate_put(&request)?;
        let args = self.encode_put(&request)?;
        let client = self.client().await?;
        let stmt = self.prepare(&client, &self.inner.sql.put).await?;
        self.run_put(&**client, &stmt, &request, args).await
    }

    /// The batch in one transaction: one commit (one WAL flush) for all of it. If a
    /// request fails, the transaction rolls back and the batch is put again one by one,
    /// so the requests before the failing one are stored and its error is returned.
    async fn put_many(&self, requests: Vec<PutRequest>) -> Result<(), CheckpointError> {
        if requests.len() > 1 && self.put_batch(&requests).await.is_ok() {
            return Ok(());
        }
        for request in requests {
            self.put(request).await?;
        }
        Ok(())
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), CheckpointError> {
        check_thread(&thread.thread_id, &thread.ns)?;
        let keys = support::write_keys(&writes);
        let mut task_ids = Vec::with_capacity(writes.len());
        let mut channels = Vec::with_capacity(writes.len());
        let mut idx = Vec::with_capacity(writes.len());
        let mut paths = Vec::with_capacity(writes.len());
        let mut values = Vec::with_capacity(writes.len());
        for (key, write) in keys.iter().zip(&writes) {
            check_text("task id", &key.task_id, Some(MAX_NAME_BYTES))?;
            check_text("write channel", &key.channel, Some(MAX_NAME_BYTES))?;
            check_text("task path", &write.task_path, None)?;
            task_ids.push(key.task_id.as_str());
            channels.push(key.channel.as_str());
            idx.push(
                i32::try_from(key.index).map_err(|_| CheckpointError::Invalid {
                    reason: "more than 2^31 writes of one task to one channel".into(),
                })?,
            );
            paths.push(write.task_path.as_str());
            values.push(to_json(&write.value, "pending write")?);
        }
        let values: Vec<JsonText<'_>> = values.iter().map(|v| JsonText(v)).collect();
        let id = uuid_of(checkpoint)?;
        let client = self.client().await?;
        let stmt = self.prepare(&client, &self.inner.sql.put_writes).await?;
        let row = client
            .query_one(
                &stmt,
                &[
                    &thread.thread_id,
                    &thread.ns,
                    &id,
                    &task_ids,
                    &channels,
                    &idx,
                    &paths,
                    &values,
                ],
            )
            .await
            .map_err(|e| self.query_error(e))?;
        if row.get::<_, i64>(0) == 0 {
            return Err(CheckpointError::NotFound {
                what: format!("checkpoint {checkpoint} of thread {thread}"),
            });
        }
        Ok(())
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), CheckpointError> {
        check_thread(thread_id, "")?;
        self.delete(thread_id, None).await.map(|_| ())
    }

    /// One transaction in two round trips. The first locks the head row, deletes all
    /// but the newest `keep_last` checkpoints with their writes (and the head row when
    /// none is kept), and reads the kept checkpoints' versions. The saver then walks
    /// their delta chains in the links it remembers, and the second deletes every
    /// delta written before the oldest kept checkpoint that no chain reaches. When a
    /// link is not remembered (a delta another saver put, or this one forgot), one
    /// more round trip reads the links of the kept chains from the database first.
    async fn prune(&self, thread: &ThreadKey, keep_last: usize) -> Result<usize, CheckpointError> {
        check_thread(&thread.thread_id, &thread.ns)?;
        let sql = &self.inner.sql;
        let client = self.client().await?;
        let lock = self.prepare(&client, &sql.lock_thread).await?;
        let checkpoints = self.prepare(&client, &sql.prune_checkpoints).await?;
        let writes = self.prepare(&client, &sql.prune_writes).await?;
        let head = self.prepare(&client, &sql.prune_head).await?;
        let kept = self.prepare(&client, &sql.prune_kept).await?;
        let chains = self.prepare(&client, &sql.prune_chains).await?;
        let deltas = self.prepare(&client, &sql.prune_deltas).await?;
        let keep = i64::try_from(keep_last).unwrap_or(i64::MAX);
        let key: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&thread.thread_id, &thread.ns];
        let err = |e| query_error(&self.inner.schema, e);
        // The transaction is opened and ended by statements pipelined with the others:
        // two round trips in all. Until it has ended, the guard keeps the connection
        // out of the pool (an error or a cancelled prune closes it, and the server
        // rolls the transaction back).
        let tx = OpenTransaction(Some(client));
        let c = tx.client()?;
        // Run in this order: the head row lock first orders the prune after (or before)
        // any put in flight, and each later statement's snapshot is taken after it. Its
        // commit does not wait for the WAL flush: should the server crash before it, the
        // prune is undone and the next one deletes the same rows (nothing a prune
        // deletes is needed, and nothing else changes).
        let keep_args: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&thread.thread_id, &thread.ns, &keep];
        let (_, _, removed, _, _, kept) = futures::try_join!(
            c.batch_execute("BEGIN; SET LOCAL synchronous_commit = off"),
            c.query(&lock, &key),
            c.execute(&checkpoints, &keep_args),
            c.execute(&writes, &key),
            c.execute(&head, &key),
            c.query(&kept, &key),
        )
        .map_err(err)?;
        if removed == 0 {
            // The oldest kept checkpoint did not move: no delta became prunable.
            c.batch_execute("COMMIT").await.map_err(err)?;
            tx.ended();
            return Ok(0);
        }
        let mut tips = Vec::new();
        let mut oldest: Option<Uuid> = None;
        for row in &kept {
            let id: Uuid = row.try_get(0).map_err(corrupt)?;
            oldest = Some(oldest.map_or(id, |o| o.min(id)));
            let versions = decode_versions(&id_of(id)?, row.try_get(1).map_err(corrupt)?)?;
            for (channel, version) in versions {
                tips.push((channel, version.writer.as_str().to_owned()));
            }
        }
        // Every link from memory, else (`Err`) the links the database reads back.
        let known = {
            let links = self.links();
            support::walk_chains(tips.clone(), |channel, writer| {
                links
                    .get(thread, channel, writer)
                    .cloned()
                    .map(Some)
                    .ok_or(())
            })
        };
        let reached = match known {
            Ok(reached) => reached,
            Err(()) => {
                let rows = c.query(&chains, &key).await.map_err(err)?;
                let mut read = HashMap::with_capacity(rows.len());
                for row in &rows {
                    let (channel, writer, link) = link_of(row)?;
                    read.insert((channel, writer), link);
                }
                // A delta the database did not find ends its chain, as in `get`.
                let reached = support::walk_chains(tips, |channel, writer| {
                    Ok::<_, ()>(read.get(&(channel.to_owned(), writer.to_owned())).cloned())
                })
                .unwrap_or_default();
                let mut links = self.links();
                for ((channel, writer), link) in read {
                    links.learn(thread, channel, writer, link);
                }
                reached
            }
        };
        let cutoff = oldest.map(|o| o.to_string());
        let (mut channels, mut writers) = (Vec::new(), Vec::new());
        for (channel, ids) in &reached {
            for writer in ids {
                if cutoff.as_deref().is_some_and(|c| writer.as_str() < c) {
                    channels.push(channel.as_str());
                    writers.push(Uuid::parse_str(writer).map_err(|_| {
                        CheckpointError::Corrupt {
                            what: format!("remembered writer id {writer:?}"),
                        }
                    })?);
                }
            }
        }
        // Pipelined with the COMMIT, which rolls the transaction back should the
        // DELETE fail; either way the transaction has ended once the COMMIT went through.
        let args: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&thread.thread_id, &thread.ns, &oldest, &channels, &writers];
        let (deleted, committed) =
            futures::join!(c.execute(&deltas, &args), c.batch_execute("COMMIT"));
        committed.map_err(err)?;
        tx.ended();
        deleted.map_err(err)?;
        self.links()
            .forget_pruned(thread, cutoff.as_deref(), &reached);
        Ok(usize::try_from(removed).unwrap_or(usize::MAX))
    }

    /// Candidates from a range scan of the `keel_heads_head` index below the cutoff,
    /// oldest first; each deleted by thread id in its own transaction once its heads
    /// are locked and still idle. No statement joins rows of two threads.
    async fn sweep_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, CheckpointError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let cutoff = uuid_of(&support::idle_cutoff(idle_for))?;
        self.sweep(cutoff, limit).await
    }

    async fn list_threads(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ThreadInfo>, CheckpointError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let client = self.client().await?;
        let stmt = self.prepare(&client, &self.inner.sql.list_threads).await?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = client
            .query(&stmt, &[&after, &limit])
            .await
            .map_err(|e| self.query_error(e))?;
        rows.iter()
            .map(|row| {
                let thread_id: String = row.try_get(0).map_err(corrupt)?;
                let head: Uuid = row.try_get(1).map_err(corrupt)?;
                let namespaces: i64 = row.try_get(2).map_err(corrupt)?;
                Ok(ThreadInfo::new(
                    thread_id,
                    id_of(head)?,
                    usize::try_from(namespaces).unwrap_or(0),
                ))
            })
            .collect()
    }
}

/// A pooled connection inside a transaction opened by a pipelined `BEGIN`. Goes back
/// to the pool only through [`ended`](Self::ended), once the transaction has ended;
/// dropped before that (an error, or the future cancelled), it takes the connection out
/// of the pool and closes it, so no later caller gets a connection inside a
/// transaction, and the server rolls the transaction back.
struct OpenTransaction(Option<deadpool_postgres::Client>);

impl OpenTransaction {
    fn client(&self) -> Result<&deadpool_postgres::ClientWrapper, CheckpointError> {
        self.0.as_deref().ok_or_else(|| {
            CheckpointError::Backend("the transaction's connection was already released".into())
        })
    }

    /// Puts the connection back in the pool, once the transaction has ended.
    fn ended(mut self) {
        drop(self.0.take());
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(deadpool_postgres::Client::take(client));
        }
    }
}
