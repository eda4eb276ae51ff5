//! The statements the saver prepares, for one schema.

use keel_checkpoint::PendingWrite;

use crate::config::quote_ident;

/// Every statement, with the schema filled in (quoted).
#[derive(Debug)]
pub(crate) struct Statements {
    pub put: String,
    pub get: String,
    pub list_page: String,
    pub put_writes: String,
    pub lock_thread: String,
    pub lock_heads: String,
    pub delete: [String; 4],
    pub prune_checkpoints: String,
    pub prune_writes: String,
    pub prune_kept: String,
    pub prune_chains: String,
    pub prune_deltas: String,
    pub prune_head: String,
    pub idle_threads: String,
    pub list_threads: String,
    pub thread_bytes: String,
}

impl Statements {
    pub(crate) fn new(schema: &str) -> Self {
        let s = quote_ident(schema);
        // How a stored version names its writer: a bare seq means "this checkpoint".
        let writer = "CASE json_typeof(v.value) WHEN 'number' THEN c.checkpoint_id \
                      ELSE (v.value->>1)::uuid END";
        Self {
            put: format!(
                "SELECT {s}.keel_put($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
                 $11, $12, $13, $14, $15, $16, $17, $18, $19)"
            ),
            // One statement, one snapshot: the checkpoint, the chain of every channel
            // (followed back to the newest snapshot), and its pending writes. Each link
            // is a LATERAL primary-key lookup, so no plan can scan the thread's deltas
            // once per link.
            get: format!(
                "WITH RECURSIVE
                 cp AS (
                     SELECT c.checkpoint_id, c.parent, c.created_at, c.metadata, c.versions,
                            c.versions_seen, c.pending_sends
                     FROM {s}.keel_checkpoints c
                     WHERE c.thread_id = $1 AND c.ns = $2
                       AND c.checkpoint_id = coalesce($3::uuid, (
                           SELECT h.head FROM {s}.keel_heads h
                           WHERE h.thread_id = $1 AND h.ns = $2))
                 ),
                 tips AS (
                     SELECT v.key AS channel, {writer} AS writer
                     FROM cp c, json_each(c.versions) v
                 ),
                 chain AS (
                     SELECT d.channel, d.writer, d.seq, d.base_writer, d.base_seq,
                            d.updates, d.snapshot
                     FROM tips t CROSS JOIN LATERAL (
                         SELECT x.channel, x.writer, x.seq, x.base_writer, x.base_seq,
                                x.updates, x.snapshot
                         FROM {s}.keel_deltas x
                         WHERE x.thread_id = $1 AND x.ns = $2
                           AND x.writer = t.writer AND x.channel = t.channel
                         LIMIT 1) d
                     UNION ALL
                     SELECT d.channel, d.writer, d.seq, d.base_writer, d.base_seq,
                            d.updates, d.snapshot
                     FROM chain k CROSS JOIN LATERAL (
                         SELECT x.channel, x.writer, x.seq, x.base_writer, x.base_seq,
                                x.updates, x.snapshot
                         FROM {s}.keel_deltas x
                         WHERE x.thread_id = $1 AND x.ns = $2
                           AND x.writer = k.base_writer AND x.channel = k.channel
                           AND x.seq < k.seq
                         LIMIT 1) d
                     WHERE k.snapshot IS NULL
                 )
                 SELECT cp.checkpoint_id, cp.parent, cp.created_at, cp.metadata, cp.versions,
                        cp.versions_seen, cp.pending_sends,
                        ch.channels, ch.writers, ch.seqs, ch.base_writers, ch.base_seqs,
                        ch.updates, ch.snapshots,
                        w.task_ids, w.task_paths, w.channels, w.values
                 FROM cp
                 CROSS JOIN LATERAL (
                     SELECT array_agg(channel) AS channels, array_agg(writer) AS writers,
                            array_agg(seq) AS seqs, array_agg(base_writer) AS base_writers,
                            array_agg(base_seq) AS base_seqs,
                            array_agg(CASE WHEN snapshot IS NULL THEN updates END) AS updates,
                            array_agg(snapshot) AS snapshots
                     FROM chain) ch
                 CROSS JOIN LATERAL (
                     SELECT array_agg(x.task_id ORDER BY x.ord) AS task_ids,
                            array_agg(x.task_path ORDER BY x.ord) AS task_paths,
                            array_agg(x.channel ORDER BY x.ord) AS channels,
                            array_agg(x.value ORDER BY x.ord) AS values
                     FROM {s}.keel_writes x
                     WHERE x.thread_id = $1 AND x.ns = $2
                       AND x.checkpoint_id = cp.checkpoint_id) w"
            ),
            // Keyset pagination, newest first; `$4` pre-filters by containment, the
            // exact metadata match is done in Rust.
            list_page: format!(
                "SELECT checkpoint_id, parent, created_at, metadata, versions, versions_seen,
                        pending_sends
                 FROM {s}.keel_checkpoints
                 WHERE thread_id = $1 AND ns = $2 AND checkpoint_id < $3 AND metadata @> $4
                 ORDER BY checkpoint_id DESC
                 LIMIT $5"
            ),
            put_writes: format!(
                "WITH cp AS (
                     SELECT 1 FROM {s}.keel_checkpoints
                     WHERE thread_id = $1 AND ns = $2 AND checkpoint_id = $3
                     FOR KEY SHARE
                 ),
                 ins AS (
                     INSERT INTO {s}.keel_writes AS x
                         (thread_id, ns, checkpoint_id, task_id, channel, idx, task_path, value)
                     SELECT $1, $2, $3, w.task_id, w.channel, w.idx, w.task_path, w.value
                     FROM cp, unnest($4::text[], $5::text[], $6::int4[], $7::text[], $8::json[])
                          WITH ORDINALITY AS w(task_id, channel, idx, task_path, value, n)
                     ORDER BY w.n
                     ON CONFLICT (thread_id, ns, checkpoint_id, task_id, channel, idx)
                     DO UPDATE SET task_path = excluded.task_path, value = excluded.value
                     WHERE x.channel IN ('{}', '{}', '{}')
                 )
                 SELECT count(*) FROM cp",
                PendingWrite::ERROR,
                PendingWrite::INTERRUPT,
                PendingWrite::RESUME
            ),
            lock_thread: format!(
                "SELECT head FROM {s}.keel_heads WHERE thread_id = $1 AND ns = $2 FOR UPDATE"
            ),
            // Locks every head of the thread; says for each whether it sorts below the
            // sweep's cutoff `$2` (NULL for a head row without a head).
            lock_heads: format!(
                "SELECT ns, head < $2 FROM {s}.keel_heads WHERE thread_id = $1 FOR UPDATE"
            ),
            delete: [
                format!("DELETE FROM {s}.keel_writes WHERE thread_id = $1"),
                format!("DELETE FROM {s}.keel_deltas WHERE thread_id = $1"),
                format!("DELETE FROM {s}.keel_checkpoints WHERE thread_id = $1"),
                format!("DELETE FROM {s}.keel_heads WHERE thread_id = $1"),
            ],
            prune_checkpoints: format!(
                "DELETE FROM {s}.keel_checkpoints
                 WHERE thread_id = $1 AND ns = $2 AND checkpoint_id NOT IN (
                     SELECT checkpoint_id FROM {s}.keel_checkpoints
                     WHERE thread_id = $1 AND ns = $2
                     ORDER BY checkpoint_id DESC LIMIT $3)"
            ),
            prune_writes: format!(
                "DELETE FROM {s}.keel_writes x
                 WHERE x.thread_id = $1 AND x.ns = $2 AND NOT EXISTS (
                     SELECT 1 FROM {s}.keel_checkpoints c
                     WHERE c.thread_id = $1 AND c.ns = $2 AND c.checkpoint_id = x.checkpoint_id)"
            ),
            // The links of every delta a remaining checkpoint's chain reaches (the same
            // walk as `get`: back along base links to the newest snapshot), for a prune
            // whose saver does not remember them all.
            prune_chains: format!(
                "WITH RECURSIVE
                 tips AS (
                     SELECT DISTINCT v.key AS channel, {writer} AS writer
                     FROM {s}.keel_checkpoints c, json_each(c.versions) v
                     WHERE c.thread_id = $1 AND c.ns = $2
                 ),
                 needed AS (
                     SELECT d.channel, d.writer, d.seq, d.base_writer, d.base_seq, d.snap
                     FROM tips t CROSS JOIN LATERAL (
                         SELECT x.channel, x.writer, x.seq, x.base_writer, x.base_seq,
                                x.snapshot IS NOT NULL AS snap
                         FROM {s}.keel_deltas x
                         WHERE x.thread_id = $1 AND x.ns = $2
                           AND x.writer = t.writer AND x.channel = t.channel
                         LIMIT 1) d
                     UNION
                     SELECT d.channel, d.writer, d.seq, d.base_writer, d.base_seq, d.snap
                     FROM needed n CROSS JOIN LATERAL (
                         SELECT x.channel, x.writer, x.seq, x.base_writer, x.base_seq,
                                x.snapshot IS NOT NULL AS snap
                         FROM {s}.keel_deltas x
                         WHERE x.thread_id = $1 AND x.ns = $2
                           AND x.writer = n.base_writer AND x.channel = n.channel
                           AND x.seq < n.seq
                         LIMIT 1) d
                     WHERE NOT n.snap
                 )
                 SELECT channel, writer, seq, snap, base_writer, base_seq FROM needed"
            ),
            // The checkpoints a prune keeps, read after it deleted the others.
            prune_kept: format!(
                "SELECT checkpoint_id, versions FROM {s}.keel_checkpoints
                 WHERE thread_id = $1 AND ns = $2"
            ),
            // Deletes the deltas written before the oldest kept checkpoint `$3` (all of
            // them when it is NULL) but those the kept chains reach, `$4`/`$5` as
            // (channel, writer) pairs. A kept checkpoint's own deltas are on its chain,
            // so only older ones can go. `NOT IN` over the pairs is one hashed lookup
            // a row.
            prune_deltas: format!(
                "DELETE FROM {s}.keel_deltas d
                 WHERE d.thread_id = $1 AND d.ns = $2 AND ($3::uuid IS NULL OR d.writer < $3)
                   AND (d.channel, d.writer) NOT IN (
                       SELECT k.channel, k.writer FROM unnest($4::text[], $5::uuid[]) AS k(channel, writer))"
            ),
            prune_head: format!(
                "DELETE FROM {s}.keel_heads h
                 WHERE h.thread_id = $1 AND h.ns = $2 AND NOT EXISTS (
                     SELECT 1 FROM {s}.keel_checkpoints c WHERE c.thread_id = $1 AND c.ns = $2)"
            ),
            // Heads below the cutoff `$1`, oldest first, of threads with no head at or
            // above it: a range of the `keel_heads_head` index, then one primary-key
            // probe per row into the same thread's heads (no row of another thread is
            // read for it). A thread comes once per idle namespace.
            idle_threads: format!(
                "SELECT h.thread_id FROM {s}.keel_heads h
                 WHERE h.head < $1 AND NOT EXISTS (
                     SELECT 1 FROM {s}.keel_heads f
                     WHERE f.thread_id = h.thread_id AND (f.head IS NULL OR f.head >= $1))
                 ORDER BY h.head
                 LIMIT $2"
            ),
            // A range of the heads primary key, grouped by thread.
            list_threads: format!(
                "SELECT thread_id, max(head::text)::uuid, count(*) FROM {s}.keel_heads
                 WHERE head IS NOT NULL AND ($1::text IS NULL OR thread_id > $1)
                 GROUP BY thread_id ORDER BY thread_id LIMIT $2"
            ),
            thread_bytes: format!(
                "SELECT
                   (SELECT coalesce(sum(pg_column_size(c.*)), 0)::bigint FROM {s}.keel_checkpoints c
                     WHERE c.thread_id = $1),
                   (SELECT coalesce(sum(pg_column_size(d.*)), 0)::bigint FROM {s}.keel_deltas d
                     WHERE d.thread_id = $1),
                   (SELECT coalesce(sum(pg_column_size(w.*)), 0)::bigint FROM {s}.keel_writes w
                     WHERE w.thread_id = $1),
                   (SELECT coalesce(sum(pg_column_size(h.*)), 0)::bigint FROM {s}.keel_heads h
                     WHERE h.thread_id = $1),
                   (SELECT count(*) FROM {s}.keel_checkpoints c WHERE c.thread_id = $1),
                   (SELECT count(*) FROM {s}.keel_deltas d WHERE d.thread_id = $1),
                   (SELECT count(*) FROM {s}.keel_deltas d WHERE d.thread_id = $1
                      AND d.snapshot IS NOT NULL)"
            ),
        }
    }
}
