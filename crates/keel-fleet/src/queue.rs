//! The run queue: submit, status, cancel; and the claim/lease protocol workers use.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use keel_agent::Stop;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_postgres::error::SqlState;
use uuid::Uuid;

use crate::error::FleetError;
use crate::input::RunInput;
use crate::schema::{self, check_schema, quote_ident};

/// The default schema of the queue's tables (the checkpointer's default too).
pub const DEFAULT_SCHEMA: &str = "public";
/// How many times a run is claimed at most before it is failed (a run whose workers
/// keep dying with it).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// The default number of pooled connections of [`Queue::connect`].
pub const DEFAULT_POOL_SIZE: usize = 16;

/// A run's id: a UUID v7 (time-ordered), printed and parsed in its usual text form.
///
/// ```
/// use keel_fleet::RunId;
/// let id: RunId = "0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80".parse()?;
/// assert_eq!(id.to_string(), "0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80");
/// # Ok::<(), keel_fleet::ParseRunIdError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(Uuid);

impl RunId {
    fn new() -> Self {
        RunId(Uuid::now_v7())
    }

    /// The UUID.
    pub fn as_uuid(&self) -> &Uuid {
        &self.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Text that is not a run id.
#[derive(Debug, thiserror::Error)]
#[error("{text:?} is not a run id (a UUID such as 0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80)")]
pub struct ParseRunIdError {
    text: String,
}

impl FromStr for RunId {
    type Err = ParseRunIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s.trim())
            .map(RunId)
            .map_err(|_| ParseRunIdError { text: s.to_owned() })
    }
}

/// What a second run on a busy thread (one with a queued or running run) does:
/// LangGraph's "double texting" options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Policy {
    /// Refuse it: [`FleetError::ThreadBusy`] names the run in the way (the default).
    #[default]
    Reject,
    /// Queue it behind the thread's runs; it starts when they have ended.
    Enqueue,
    /// Cancel the thread's running run (it stops at its next step boundary, keeping
    /// its steps) and its queued runs, and run this one next.
    Interrupt,
}

impl Policy {
    /// `reject`, `enqueue` or `interrupt`.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Reject => "reject",
            Policy::Enqueue => "enqueue",
            Policy::Interrupt => "interrupt",
        }
    }
}

impl FromStr for Policy {
    type Err = FleetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "reject" => Ok(Policy::Reject),
            "enqueue" => Ok(Policy::Enqueue),
            "interrupt" => Ok(Policy::Interrupt),
            other => Err(FleetError::Config {
                reason: format!("unknown policy {other:?}: write reject, enqueue or interrupt"),
            }),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a finished run ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RunResult {
    /// The model's final answer, if it gave one.
    pub answer: Option<String>,
    /// Why the run stopped early (a step ceiling, empty replies), if it did.
    pub stop: Option<Stop>,
    /// Whether it paused at an interrupt (a tool awaiting approval): submit a run with
    /// [`RunInput::resume`] to answer it.
    pub interrupted: bool,
    /// Supersteps the last attempt made.
    pub supersteps: u64,
}

/// Where a run is.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum RunStatus {
    /// Waiting for a worker (or for the thread's earlier runs).
    Queued,
    /// A worker holds it.
    Running {
        /// The worker (`name/slot`).
        worker: String,
        /// When this worker claimed it (database time).
        since: SystemTime,
        /// When its lease ends unless renewed (database time).
        lease_until: SystemTime,
        /// Whether the lease has expired by the database's clock (the worker died or
        /// lost the database; the next claim takes the run over).
        lease_expired: bool,
        /// Whether a cancel was requested (the worker stops at its next step boundary).
        cancel_requested: bool,
    },
    /// Finished.
    Done {
        /// The outcome.
        result: RunResult,
        /// When.
        finished_at: SystemTime,
    },
    /// Failed; the thread stays at its last checkpoint.
    Failed {
        /// Why.
        error: String,
        /// When.
        finished_at: SystemTime,
    },
    /// Cancelled before it finished; the thread keeps the steps it made.
    Cancelled {
        /// Why, if known (e.g. `interrupted by run <id>`).
        reason: Option<String>,
        /// When.
        finished_at: SystemTime,
    },
}

impl RunStatus {
    /// `queued`, `running`, `done`, `failed` or `cancelled`.
    pub fn name(&self) -> &'static str {
        match self {
            RunStatus::Queued => "queued",
            RunStatus::Running { .. } => "running",
            RunStatus::Done { .. } => "done",
            RunStatus::Failed { .. } => "failed",
            RunStatus::Cancelled { .. } => "cancelled",
        }
    }

    /// Whether the run has ended (done, failed or cancelled).
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            RunStatus::Done { .. } | RunStatus::Failed { .. } | RunStatus::Cancelled { .. }
        )
    }
}

/// One run as [`Queue::status`] and [`Queue::runs`] report it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RunInfo {
    /// Its id.
    pub id: RunId,
    /// Its thread.
    pub thread: String,
    /// Its place among the thread's runs (1, 2, ...).
    pub seq: i64,
    /// Where it is.
    pub status: RunStatus,
    /// The policy it was submitted with.
    pub policy: Policy,
    /// How many times a worker claimed it.
    pub attempts: u32,
    /// The most claims it gets.
    pub max_attempts: u32,
    /// When it was submitted (database time).
    pub submitted_at: SystemTime,
}

/// Settings of a [`Queue`].
///
/// ```
/// use std::time::Duration;
/// use keel_fleet::{Policy, QueueOptions};
///
/// let options = QueueOptions::new()
///     .schema("agents")?
///     .pool_size(8)
///     .max_attempts(3)
///     .policy(Policy::Enqueue);
/// assert_eq!(options.get_schema(), "agents");
/// # Ok::<(), keel_fleet::FleetError>(())
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct QueueOptions {
    schema: String,
    pool_size: usize,
    statement_timeout: Option<Duration>,
    max_attempts: u32,
    policy: Policy,
}

impl Default for QueueOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl QueueOptions {
    /// Schema `public`, 16 connections, 30 s statements, 5 attempts, [`Policy::Reject`].
    pub fn new() -> Self {
        QueueOptions {
            schema: DEFAULT_SCHEMA.to_owned(),
            pool_size: DEFAULT_POOL_SIZE,
            statement_timeout: Some(Duration::from_secs(30)),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            policy: Policy::Reject,
        }
    }

    /// The schema of the queue's tables (put it beside the checkpointer's): at most 63
    /// bytes, no NUL.
    pub fn schema(mut self, schema: impl Into<String>) -> Result<Self, FleetError> {
        let schema = schema.into();
        check_schema(&schema)?;
        self.schema = schema;
        Ok(self)
    }

    /// Connections [`Queue::connect`] opens at most (at least 1).
    #[must_use]
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The per-statement timeout of [`Queue::connect`]'s connections (`None`: the
    /// server's).
    #[must_use]
    pub fn statement_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// How many claims a run gets before it is failed (at least 1).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The policy of [`Queue::submit`].
    #[must_use]
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The schema.
    pub fn get_schema(&self) -> &str {
        &self.schema
    }
}

/// A durable run queue on PostgreSQL: runs submitted to threads, claimed by
/// [`Worker`](crate::Worker)s under leases. Cheap to clone (one pool).
#[derive(Clone)]
pub struct Queue {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    schema: String,
    options: QueueOptions,
    sql: Statements,
}

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("schema", &self.inner.schema)
            .finish_non_exhaustive()
    }
}

/// A run a worker claimed: what it needs to run it and to prove it still holds it.
#[derive(Debug, Clone)]
pub(crate) struct Claimed {
    pub(crate) thread: String,
    pub(crate) run: RunId,
    pub(crate) token: Uuid,
    pub(crate) attempts: u32,
    pub(crate) input: Value,
    pub(crate) input_applied: bool,
    /// When the claim was sent: the lease runs at least until this plus the lease.
    pub(crate) sent_at: Instant,
    /// Whether it was taken over from a worker whose lease had lapsed.
    pub(crate) takeover: bool,
}

/// What a renewal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// Still ours; whether a cancel was requested.
    Held { cancel_requested: bool },
    /// Someone else holds it, or it ended.
    Lost,
}

impl Queue {
    /// A queue over a new pool for `url` (a `postgres://` URL or `key=value` pairs),
    /// schema `public`. Connections open lazily. TLS follows the string's `sslmode` as
    /// libpq does with the `tls` feature; without it, connections go without TLS even
    /// where the server offers it (unlike `psql`), and a string that requires TLS is
    /// refused with [`FleetError::ConnectionString`] (see `keel_postgres_tls`).
    pub fn connect(url: &str) -> Result<Self, FleetError> {
        Self::connect_with(url, QueueOptions::new())
    }

    /// A queue over a new pool, with options.
    pub fn connect_with(url: &str, options: QueueOptions) -> Result<Self, FleetError> {
        let (mut pg, tls) = keel_postgres_tls::ConnectionString::parse(url)?.into_parts();
        if pg.get_application_name().is_none() {
            pg.application_name("keel-fleet");
        }
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(Duration::from_secs(10));
        }
        if let Some(timeout) = options.statement_timeout {
            let millis = timeout.as_millis().max(1);
            let joined = match pg.get_options() {
                Some(existing) if !existing.trim().is_empty() => {
                    format!("{existing} -c statement_timeout={millis}")
                }
                _ => format!("-c statement_timeout={millis}"),
            };
            pg.options(&joined);
        }
        let manager = Manager::from_config(
            pg,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(options.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(60)))
            .create_timeout(Some(Duration::from_secs(15)))
            .build()
            .map_err(|e| FleetError::Config {
                reason: format!("cannot build the connection pool: {e}"),
            })?;
        Self::from_pool(pool, options)
    }

    /// A queue over an existing pool (e.g. the checkpointer's, or one with a connector
    /// of your own).
    pub fn from_pool(pool: Pool, options: QueueOptions) -> Result<Self, FleetError> {
        check_schema(&options.schema)?;
        Ok(Queue {
            inner: Arc::new(Inner {
                pool,
                schema: options.schema.clone(),
                sql: Statements::new(&options.schema),
                options,
            }),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The schema of the queue's tables.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// `result`, with a query that found none of the queue's tables turned into
    /// [`FleetError::NotSetUp`] (the schema was never set up).
    fn explained<T>(&self, result: Result<T, FleetError>) -> Result<T, FleetError> {
        match result {
            Err(FleetError::Query(e)) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => {
                Err(FleetError::NotSetUp {
                    schema: self.inner.schema.clone(),
                })
            }
            other => other,
        }
    }

    /// Creates or upgrades the queue's tables (and the schema); returns the versions
    /// applied. Idempotent and safe from many processes at once (an advisory lock).
    /// Fails with [`FleetError::SchemaTooNew`] on a schema a newer build wrote.
    pub async fn setup(&self) -> Result<Vec<i32>, FleetError> {
        let mut client = self.inner.pool.get().await?;
        let client: &mut tokio_postgres::Client = &mut client;
        schema::migrate(client, &self.inner.schema).await
    }

    /// Checks that the schema holds this build's version, changing nothing:
    /// [`FleetError::NotSetUp`], [`FleetError::SchemaTooOld`] or
    /// [`FleetError::SchemaTooNew`] otherwise. Workers call it before they claim.
    pub async fn check(&self) -> Result<(), FleetError> {
        let client = self.inner.pool.get().await?;
        schema::check(&**client, &self.inner.schema).await
    }

    /// Submits a run to `thread` with the queue's policy ([`QueueOptions::policy`],
    /// default [`Policy::Reject`]); returns its id. The run is stored when this
    /// returns.
    pub async fn submit(&self, thread: &str, input: RunInput) -> Result<RunId, FleetError> {
        self.submit_with(thread, input, self.inner.options.policy)
            .await
    }

    /// Submits a run with a policy for a busy thread.
    ///
    /// A run with a goal is refused with [`FleetError::GoalTaken`] when a goal run of
    /// the thread reached it, or (but under [`Policy::Interrupt`], which cancels them)
    /// one is queued or running: the thread would have its goal before this run starts,
    /// and a goal is written once.
    pub async fn submit_with(
        &self,
        thread: &str,
        input: RunInput,
        policy: Policy,
    ) -> Result<RunId, FleetError> {
        let result = async {
            keel_offload::ThreadId::new(thread).map_err(|e| FleetError::BadThreadId {
                thread: thread.to_owned(),
                reason: e.to_string(),
            })?;
            let run = RunId::new();
            let input_goal = input.get_goal().is_some();
            let stored = input
                .with_ids(&run.to_string())
                .encode()
                .map_err(FleetError::Encode)?
                .to_string();
            let max_attempts = i32::try_from(self.inner.options.max_attempts).unwrap_or(i32::MAX);
            let sql = &self.inner.sql;
            let mut client = self.inner.pool.get().await?;
            let tx = client.transaction().await?;
            let seq: i64 = tx
                .query_one(&tx.prepare_cached(&sql.lock_thread).await?, &[&thread])
                .await?
                .get(0);
            if input_goal {
                // A goal is written once: one already on the thread, or in a run that
                // runs before this one, would fail this run on its worker.
                let goals = tx
                    .query(&tx.prepare_cached(&sql.goal_runs).await?, &[&thread])
                    .await?;
                // An interrupt cancels the queued ones and stops a running one, so then
                // only a goal that reached the thread stands in the way.
                let taken = goals
                    .iter()
                    .find(|row| policy != Policy::Interrupt || row.get::<_, bool>(1));
                if let Some(row) = taken {
                    return Err(FleetError::GoalTaken {
                        thread: thread.to_owned(),
                        run: RunId(row.get(0)),
                    });
                }
            }
            let busy = tx
                .query(&tx.prepare_cached(&sql.in_flight).await?, &[&thread])
                .await?;
            match policy {
                Policy::Reject => {
                    if let Some((run, status)) = busy.first().map(in_flight_run) {
                        return Err(FleetError::ThreadBusy {
                            thread: thread.to_owned(),
                            run,
                            status,
                            more: busy.len() - 1,
                        });
                    }
                }
                Policy::Enqueue => {}
                Policy::Interrupt => {
                    if !busy.is_empty() {
                        let reason = format!("interrupted by run {run}");
                        tx.execute(
                            &tx.prepare_cached(&sql.interrupt_running).await?,
                            &[&thread, &reason],
                        )
                        .await?;
                        tx.execute(
                            &tx.prepare_cached(&sql.interrupt_queued).await?,
                            &[&thread, &reason],
                        )
                        .await?;
                    }
                }
            }
            tx.execute(
                &tx.prepare_cached(&sql.insert).await?,
                &[
                    &thread,
                    run.as_uuid(),
                    &seq,
                    &policy.as_str(),
                    &stored,
                    &max_attempts,
                ],
            )
            .await?;
            tx.commit().await?;
            Ok::<_, FleetError>(run)
        }
        .await;
        self.explained(result)
    }

    /// Where a run is.
    pub async fn status(&self, run: RunId) -> Result<RunInfo, FleetError> {
        let result = async {
            let client = self.inner.pool.get().await?;
            let row = client
                .query_opt(
                    &client.prepare_cached(&self.inner.sql.status).await?,
                    &[run.as_uuid()],
                )
                .await?
                .ok_or(FleetError::UnknownRun { run })?;
            info_of(&row)
        }
        .await;
        self.explained(result)
    }

    /// A thread's runs, in submission order.
    pub async fn runs(&self, thread: &str) -> Result<Vec<RunInfo>, FleetError> {
        let result = async {
            let client = self.inner.pool.get().await?;
            client
                .query(
                    &client.prepare_cached(&self.inner.sql.runs).await?,
                    &[&thread],
                )
                .await?
                .iter()
                .map(info_of)
                .collect()
        }
        .await;
        self.explained(result)
    }

    /// Up to `limit` threads the queue has runs of, in id order, after the id `after`
    /// (a page: pass the last id of one page to get the next). Threads whose runs were
    /// cancelled or failed before their first checkpoint are here and in no
    /// checkpointer.
    pub async fn thread_ids(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<String>, FleetError> {
        let result = async {
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let client = self.inner.pool.get().await?;
            let rows = client
                .query(
                    &client.prepare_cached(&self.inner.sql.thread_ids).await?,
                    &[&after, &limit],
                )
                .await?;
            rows.iter()
                .map(|r| r.try_get(0).map_err(FleetError::from))
                .collect()
        }
        .await;
        self.explained(result)
    }

    /// Removes a thread's runs from the queue (their history and results), as
    /// deleting the thread's checkpoints leaves them. Refused with
    /// [`FleetError::ThreadActive`] while a run of the thread is queued or running:
    /// cancel it and let it end first. Returns how many runs were removed; an unknown
    /// thread removes none.
    pub async fn forget_thread(&self, thread: &str) -> Result<u64, FleetError> {
        let result = async {
            let sql = &self.inner.sql;
            let mut client = self.inner.pool.get().await?;
            let tx = client.transaction().await?;
            // Locks the thread against a submit racing the delete (submit locks it too).
            let known = tx
                .query_opt(&tx.prepare_cached(&sql.lock_existing).await?, &[&thread])
                .await?;
            if known.is_none() {
                return Ok(0);
            }
            let busy = tx
                .query(&tx.prepare_cached(&sql.in_flight).await?, &[&thread])
                .await?;
            if let Some((run, status)) = busy.first().map(in_flight_run) {
                return Err(FleetError::ThreadActive {
                    thread: thread.to_owned(),
                    run,
                    status,
                });
            }
            let removed = tx
                .execute(&tx.prepare_cached(&sql.forget_runs).await?, &[&thread])
                .await?;
            tx.execute(&tx.prepare_cached(&sql.forget_thread).await?, &[&thread])
                .await?;
            tx.commit().await?;
            Ok::<_, FleetError>(removed)
        }
        .await;
        self.explained(result)
    }

    /// Deletes the threads idle for longer than `idle_for` (no checkpoint since), at
    /// most `limit` per call, unless a run of theirs is queued or running here: for
    /// each, its runs are removed from the queue ([`Queue::forget_thread`], which
    /// refuses while one is in flight), then its checkpoints and offloaded files
    /// ([`Agent::delete_thread`](keel_agent::Agent::delete_thread)). This is the TTL
    /// sweep for a fleet: [`Agent::sweep_idle`](keel_agent::Agent::sweep_idle) looks at
    /// checkpoints alone, and would delete a thread whose run waits for a worker. Call
    /// it again while it returns `limit` threads in all (deleted and kept) to sweep
    /// everything.
    ///
    /// A run submitted for a thread between its removal from the queue and the delete
    /// of its checkpoints finds the thread gone (a new thread under the same id).
    pub async fn sweep_idle(
        &self,
        agent: &keel_agent::Agent,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Swept, FleetError> {
        let mut swept = Swept::default();
        for thread in agent.idle_threads(idle_for, limit).await? {
            match self.forget_thread(&thread).await {
                Ok(_) => {
                    agent.delete_thread(&thread).await?;
                    swept.deleted.push(thread);
                }
                Err(FleetError::ThreadActive { run, status, .. }) => {
                    swept.kept.push(InFlight {
                        thread,
                        run,
                        status,
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(swept)
    }

    /// Cancels a run: a queued one at once; a running one stops at its next step
    /// boundary (its worker marks it cancelled). An ended run is left as it is. Returns
    /// the run as it is after the call.
    pub async fn cancel(&self, run: RunId) -> Result<RunInfo, FleetError> {
        let result = async {
            let client = self.inner.pool.get().await?;
            let reason = "cancelled".to_owned();
            let row = client
                .query_opt(
                    &client.prepare_cached(&self.inner.sql.cancel).await?,
                    &[run.as_uuid(), &reason],
                )
                .await?
                .ok_or(FleetError::UnknownRun { run })?;
            info_of(&row)
        }
        .await;
        self.explained(result)
    }

    /// Claims the next run for `worker`: first a running run whose lease expired (a
    /// takeover, or a failure when it had all its attempts), then the oldest queued run
    /// of a thread with no running run and no earlier queued one.
    pub(crate) async fn claim(
        &self,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<Claimed>, FleetError> {
        let lease_ms = lease.as_secs_f64() * 1000.0;
        let client = self.inner.pool.get().await?;
        loop {
            let token = Uuid::new_v4();
            let sent_at = Instant::now();
            let row = client
                .query_opt(
                    &client.prepare_cached(&self.inner.sql.takeover).await?,
                    &[&worker, &token, &lease_ms],
                )
                .await?;
            if let Some(row) = row {
                let status: String = row.get(6);
                if status == "running" {
                    return Ok(Some(Claimed {
                        takeover: true,
                        ..claimed_of(&row, token, sent_at)
                    }));
                }
                tracing::warn!(run = %RunId(row.get(1)), "a run used up its attempts and failed");
                continue;
            }
            let sent_at = Instant::now();
            let row = match client
                .query_opt(
                    &client.prepare_cached(&self.inner.sql.claim).await?,
                    &[&worker, &token, &lease_ms],
                )
                .await
            {
                Ok(row) => row,
                // Another worker made a run of the same thread running between this
                // statement's snapshot and its update: the index refused the second.
                Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => continue,
                Err(e) => return Err(e.into()),
            };
            return Ok(row.map(|row| claimed_of(&row, token, sent_at)));
        }
    }

    /// Extends a held lease by `lease` from now (database time) and reads the cancel
    /// flag.
    pub(crate) async fn renew(
        &self,
        claimed: &Claimed,
        lease: Duration,
    ) -> Result<Renewal, FleetError> {
        let lease_ms = lease.as_secs_f64() * 1000.0;
        let client = self.inner.pool.get().await?;
        let row = client
            .query_opt(
                &client.prepare_cached(&self.inner.sql.renew).await?,
                &[
                    &claimed.thread,
                    claimed.run.as_uuid(),
                    &claimed.token,
                    &lease_ms,
                ],
            )
            .await?;
        Ok(match row {
            Some(row) => Renewal::Held {
                cancel_requested: row.get(0),
            },
            None => Renewal::Lost,
        })
    }

    /// Whether `claimed`'s lease is still the run's (status running, same token).
    pub(crate) async fn holds(&self, claimed: &Claimed) -> Result<bool, FleetError> {
        let client = self.inner.pool.get().await?;
        Ok(client
            .query_opt(
                &client.prepare_cached(&self.inner.sql.holds).await?,
                &[&claimed.thread, claimed.run.as_uuid(), &claimed.token],
            )
            .await?
            .is_some())
    }

    /// Records that the run's input reached its thread.
    pub(crate) async fn mark_applied(&self, claimed: &Claimed) -> Result<bool, FleetError> {
        self.finish(&self.inner.sql.applied, claimed, None).await
    }

    /// Marks a held run done; `false` if the lease was no longer ours.
    pub(crate) async fn complete(
        &self,
        claimed: &Claimed,
        result: &RunResult,
    ) -> Result<bool, FleetError> {
        let result = serde_json::to_string(result).map_err(FleetError::Encode)?;
        self.finish(&self.inner.sql.complete, claimed, Some(&result))
            .await
    }

    /// Marks a held run failed with `error`.
    pub(crate) async fn fail(&self, claimed: &Claimed, error: &str) -> Result<bool, FleetError> {
        let error = error.to_owned();
        self.finish(&self.inner.sql.fail, claimed, Some(&error))
            .await
    }

    /// Marks a held run cancelled.
    pub(crate) async fn cancelled(&self, claimed: &Claimed) -> Result<bool, FleetError> {
        self.finish(&self.inner.sql.cancelled, claimed, None).await
    }

    /// Puts a held run back in the queue (a worker shutting down); the attempt does not
    /// count. A run with a cancel requested is marked cancelled instead.
    pub(crate) async fn release(&self, claimed: &Claimed) -> Result<bool, FleetError> {
        self.finish(&self.inner.sql.release, claimed, None).await
    }

    async fn finish(
        &self,
        sql: &str,
        claimed: &Claimed,
        value: Option<&(dyn tokio_postgres::types::ToSql + Sync)>,
    ) -> Result<bool, FleetError> {
        let client = self.inner.pool.get().await?;
        let sql = client.prepare_cached(sql).await?;
        let n = match value {
            Some(v) => {
                client
                    .execute(
                        &sql,
                        &[&claimed.thread, claimed.run.as_uuid(), &claimed.token, v],
                    )
                    .await?
            }
            None => {
                client
                    .execute(
                        &sql,
                        &[&claimed.thread, claimed.run.as_uuid(), &claimed.token],
                    )
                    .await?
            }
        };
        Ok(n == 1)
    }
}

fn claimed_of(row: &tokio_postgres::Row, token: Uuid, sent_at: Instant) -> Claimed {
    Claimed {
        thread: row.get(0),
        run: RunId(row.get(1)),
        token,
        attempts: u32::try_from(row.get::<_, i32>(2)).unwrap_or(0),
        input: serde_json::from_str(row.get::<_, &str>(4)).unwrap_or(Value::Null),
        input_applied: row.get(5),
        sent_at,
        takeover: false,
    }
}

/// The columns `info_of` reads, in order.
const INFO_COLUMNS: &str = "thread_id, run_id, seq, status, policy, submitted_at, attempts, \
    max_attempts, worker_id, claimed_at, lease_until, coalesce(lease_until < now(), false), \
    cancel_requested, cancel_reason, result::text, error, finished_at";

fn info_of(row: &tokio_postgres::Row) -> Result<RunInfo, FleetError> {
    let id = RunId(row.try_get(1)?);
    let corrupt = |what: String| FleetError::Corrupt { run: id, what };
    let status_name: String = row.try_get(3)?;
    let finished_at: Option<SystemTime> = row.try_get(16)?;
    let finished =
        || finished_at.ok_or_else(|| corrupt(format!("a {status_name} run without finished_at")));
    let status = match status_name.as_str() {
        "queued" => RunStatus::Queued,
        "running" => RunStatus::Running {
            worker: row.try_get::<_, Option<String>>(8)?.unwrap_or_default(),
            since: row
                .try_get::<_, Option<SystemTime>>(9)?
                .ok_or_else(|| corrupt("a running run without claimed_at".into()))?,
            lease_until: row
                .try_get::<_, Option<SystemTime>>(10)?
                .ok_or_else(|| corrupt("a running run without lease_until".into()))?,
            lease_expired: row.try_get(11)?,
            cancel_requested: row.try_get(12)?,
        },
        "done" => {
            let result: Option<&str> = row.try_get(14)?;
            let result = result
                .ok_or_else(|| corrupt("a done run without a result".into()))
                .and_then(|v| {
                    serde_json::from_str(v).map_err(|e| corrupt(format!("its result: {e}")))
                })?;
            RunStatus::Done {
                result,
                finished_at: finished()?,
            }
        }
        "failed" => RunStatus::Failed {
            error: row.try_get::<_, Option<String>>(15)?.unwrap_or_default(),
            finished_at: finished()?,
        },
        "cancelled" => RunStatus::Cancelled {
            reason: row.try_get(13)?,
            finished_at: finished()?,
        },
        other => return Err(corrupt(format!("unknown status {other:?}"))),
    };
    let policy: String = row.try_get(4)?;
    Ok(RunInfo {
        id,
        thread: row.try_get(0)?,
        seq: row.try_get(2)?,
        status,
        policy: policy
            .parse()
            .map_err(|_| corrupt(format!("unknown policy {policy:?}")))?,
        attempts: u32::try_from(row.try_get::<_, i32>(6)?).unwrap_or(0),
        max_attempts: u32::try_from(row.try_get::<_, i32>(7)?).unwrap_or(0),
        submitted_at: row.try_get(5)?,
    })
}

/// A row of the `in_flight` statement: the run and its status (`running` or `queued`).
fn in_flight_run(row: &tokio_postgres::Row) -> (RunId, &'static str) {
    let status: String = row.get(1);
    let status = if status == "running" {
        "running"
    } else {
        "queued"
    };
    (RunId(row.get(0)), status)
}

/// Every statement, with the schema spliced in once.
struct Statements {
    lock_thread: String,
    lock_existing: String,
    thread_ids: String,
    forget_runs: String,
    forget_thread: String,
    in_flight: String,
    goal_runs: String,
    interrupt_running: String,
    interrupt_queued: String,
    insert: String,
    status: String,
    runs: String,
    cancel: String,
    takeover: String,
    claim: String,
    renew: String,
    holds: String,
    applied: String,
    complete: String,
    fail: String,
    cancelled: String,
    release: String,
}

impl Statements {
    fn new(schema: &str) -> Self {
        let s = quote_ident(schema);
        let runs = format!("{s}.keel_fleet_runs");
        let threads = format!("{s}.keel_fleet_threads");
        // The lease a worker holds: its run, its token, still running.
        let held = "thread_id = $1 AND run_id = $2 AND lease_token = $3 AND status = 'running'";
        let claimed =
            "thread_id, run_id, attempts, max_attempts, input::text, input_applied, status";
        Statements {
            lock_thread: format!(
                "INSERT INTO {threads} AS t (thread_id, next_seq) VALUES ($1, 1) \
                 ON CONFLICT (thread_id) DO UPDATE SET next_seq = t.next_seq + 1 \
                 RETURNING t.next_seq"
            ),
            lock_existing: format!("SELECT 1 FROM {threads} WHERE thread_id = $1 FOR UPDATE"),
            thread_ids: format!(
                "SELECT thread_id FROM {threads} WHERE $1::text IS NULL OR thread_id > $1 \
                 ORDER BY thread_id LIMIT $2"
            ),
            forget_runs: format!("DELETE FROM {runs} WHERE thread_id = $1"),
            forget_thread: format!("DELETE FROM {threads} WHERE thread_id = $1"),
            in_flight: format!(
                "SELECT run_id, status FROM {runs} \
                 WHERE thread_id = $1 AND status IN ('queued', 'running') ORDER BY seq"
            ),
            // The runs of a thread whose goal reached it, or may still: a goal run that
            // was applied, or is queued or running.
            goal_runs: format!(
                "SELECT run_id, input_applied FROM {runs} \
                 WHERE thread_id = $1 AND input -> 'input' ? 'goal' \
                   AND (input_applied OR status IN ('queued', 'running')) ORDER BY seq"
            ),
            interrupt_running: format!(
                "UPDATE {runs} SET cancel_requested = true, \
                 cancel_reason = coalesce(cancel_reason, $2) \
                 WHERE thread_id = $1 AND status = 'running'"
            ),
            interrupt_queued: format!(
                "UPDATE {runs} SET status = 'cancelled', finished_at = now(), \
                 cancel_reason = coalesce(cancel_reason, $2) \
                 WHERE thread_id = $1 AND status = 'queued'"
            ),
            insert: format!(
                "INSERT INTO {runs} (thread_id, run_id, seq, status, policy, input, max_attempts) \
                 VALUES ($1, $2, $3, 'queued', $4, $5::text::jsonb, $6)"
            ),
            status: format!("SELECT {INFO_COLUMNS} FROM {runs} WHERE run_id = $1"),
            runs: format!("SELECT {INFO_COLUMNS} FROM {runs} WHERE thread_id = $1 ORDER BY seq"),
            cancel: format!(
                "UPDATE {runs} SET \
                   status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END, \
                   finished_at = CASE WHEN status = 'queued' THEN now() ELSE finished_at END, \
                   cancel_requested = cancel_requested OR status = 'running', \
                   cancel_reason = CASE WHEN status IN ('queued', 'running') \
                                   THEN coalesce(cancel_reason, $2) ELSE cancel_reason END \
                 WHERE run_id = $1 RETURNING {INFO_COLUMNS}"
            ),
            // A run whose lease expired by the database's clock. With attempts left it
            // changes hands (new worker, token, lease); without, it fails.
            takeover: format!(
                "WITH c AS ( \
                   SELECT thread_id, run_id FROM {runs} \
                   WHERE status = 'running' AND lease_until < now() \
                   ORDER BY lease_until LIMIT 1 FOR UPDATE SKIP LOCKED) \
                 UPDATE {runs} u SET \
                   status = CASE WHEN u.attempts >= u.max_attempts THEN 'failed' ELSE 'running' END, \
                   error = CASE WHEN u.attempts >= u.max_attempts THEN format( \
                     'gave up after %s attempts: the lease of worker %s expired without the run ending (a worker died running it each time)', \
                     u.attempts, u.worker_id) END, \
                   finished_at = CASE WHEN u.attempts >= u.max_attempts THEN now() END, \
                   worker_id = CASE WHEN u.attempts >= u.max_attempts THEN u.worker_id ELSE $1 END, \
                   lease_token = CASE WHEN u.attempts >= u.max_attempts THEN u.lease_token ELSE $2 END, \
                   claimed_at = CASE WHEN u.attempts >= u.max_attempts THEN u.claimed_at ELSE now() END, \
                   lease_until = CASE WHEN u.attempts >= u.max_attempts THEN NULL \
                                 ELSE now() + $3::float8 * interval '1 millisecond' END, \
                   attempts = CASE WHEN u.attempts >= u.max_attempts THEN u.attempts ELSE u.attempts + 1 END \
                 FROM c WHERE u.thread_id = c.thread_id AND u.run_id = c.run_id \
                 RETURNING {}",
                prefixed("u", claimed)
            ),
            // The oldest queued run of a thread with nothing running and nothing queued
            // before it; skip runs another worker is claiming.
            claim: format!(
                "WITH c AS ( \
                   SELECT r.thread_id, r.run_id FROM {runs} r \
                   WHERE r.status = 'queued' \
                     AND NOT EXISTS (SELECT 1 FROM {runs} b \
                                     WHERE b.thread_id = r.thread_id AND b.status = 'running') \
                     AND NOT EXISTS (SELECT 1 FROM {runs} e \
                                     WHERE e.thread_id = r.thread_id AND e.status = 'queued' \
                                       AND e.seq < r.seq) \
                   ORDER BY r.submitted_at, r.seq LIMIT 1 \
                   FOR UPDATE OF r SKIP LOCKED) \
                 UPDATE {runs} u SET status = 'running', worker_id = $1, lease_token = $2, \
                   claimed_at = now(), lease_until = now() + $3::float8 * interval '1 millisecond', \
                   attempts = u.attempts + 1 \
                 FROM c WHERE u.thread_id = c.thread_id AND u.run_id = c.run_id \
                 RETURNING {}",
                prefixed("u", claimed)
            ),
            renew: format!(
                "UPDATE {runs} SET lease_until = now() + $4::float8 * interval '1 millisecond' \
                 WHERE {held} RETURNING cancel_requested"
            ),
            holds: format!("SELECT 1 FROM {runs} WHERE {held}"),
            applied: format!("UPDATE {runs} SET input_applied = true WHERE {held}"),
            complete: format!(
                "UPDATE {runs} SET status = 'done', result = $4::text::jsonb, finished_at = now(), \
                 lease_until = NULL WHERE {held}"
            ),
            fail: format!(
                "UPDATE {runs} SET status = 'failed', error = $4, finished_at = now(), \
                 lease_until = NULL WHERE {held}"
            ),
            cancelled: format!(
                "UPDATE {runs} SET status = 'cancelled', finished_at = now(), lease_until = NULL, \
                 cancel_reason = coalesce(cancel_reason, 'cancelled') WHERE {held}"
            ),
            release: format!(
                "UPDATE {runs} SET \
                   status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END, \
                   finished_at = CASE WHEN cancel_requested THEN now() END, \
                   worker_id = CASE WHEN cancel_requested THEN worker_id END, \
                   claimed_at = CASE WHEN cancel_requested THEN claimed_at END, \
                   lease_token = NULL, lease_until = NULL, \
                   attempts = CASE WHEN cancel_requested THEN attempts ELSE greatest(attempts - 1, 0) END \
                 WHERE {held}"
            ),
        }
    }
}

fn prefixed(alias: &str, columns: &str) -> String {
    columns
        .split(", ")
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What [`Queue::sweep_idle`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Swept {
    /// The threads deleted, in id order.
    pub deleted: Vec<String>,
    /// The idle threads kept for a run of theirs in flight.
    pub kept: Vec<InFlight>,
}

/// An idle thread [`Queue::sweep_idle`] kept: the run of it that is in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InFlight {
    /// The thread.
    pub thread: String,
    /// Its run that is queued or running.
    pub run: RunId,
    /// That run's status (`queued` or `running`).
    pub status: &'static str,
}
