// LangGraph.js peer of keel-graph's loop benchmark (crates/keel-graph/examples/bench_loop.rs)
// and of its SQLite and Postgres variants: the workload of xtask/peers/langgraph_loop.py.
//
// One node in a self-loop for N steps; each step appends one ~220-byte AIMessage through
// messagesStateReducer and bumps a plain (last-value) counter. Prints one JSON line per
// (saver, N) with the median steps/s over the repetitions.
//
// Usage: node loop.mjs SAVER REPS N [N ...]
//   SAVER: none | memory | sqlite:full | sqlite:normal | postgres
//
//   none, memory  no checkpointer / MemorySaver, LangGraph.js's default durability (as
//                 the Python peer runs them)
//   sqlite:SYNC   SqliteSaver (@langchain/langgraph-checkpoint-sqlite) on a fresh file per
//                 repetition, durability "sync", on a better-sqlite3 connection opened
//                 with journal_mode=WAL and synchronous=SYNC (the saver's setup() sets WAL
//                 itself and leaves synchronous alone). After the last repetition the WAL is
//                 checkpointed (TRUNCATE) and the file's size reported.
//   postgres      PostgresSaver (@langchain/langgraph-checkpoint-postgres) on DATABASE_URL,
//                 durability "sync", a fresh schema per repetition; after the last one it
//                 reports the saver tables' pg_total_relation_size (indexes and TOAST
//                 included, checkpoint_migrations left out; the schema holds only that
//                 thread) and the session's synchronous_commit. KEEL_BENCH_SESSION labels
//                 the output.
//
// Before the measured repetitions, one untimed 50-step run on the same saver warms the JIT
// up (`KEEL_BENCH_WARMUP=0` skips it), so that the first repetition is not charged for
// compiling LangGraph.js.

import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { performance } from "node:perf_hooks";

import { AIMessage } from "@langchain/core/messages";
import { Annotation, END, MemorySaver, messagesStateReducer, START, StateGraph } from "@langchain/langgraph";
import { PostgresSaver } from "@langchain/langgraph-checkpoint-postgres";
import { SqliteSaver } from "@langchain/langgraph-checkpoint-sqlite";
import Database from "better-sqlite3";
import pg from "pg";

const State = Annotation.Root({
  messages: Annotation({ reducer: messagesStateReducer, default: () => [] }),
  count: Annotation({ reducer: (_, right) => right, default: () => 0 }),
});

/** About 220 characters of text, varying per step. */
function text(step) {
  let s = `step ${step}: `;
  while (s.length < 220) s += "the agent read the file, ran the tests and noted the result; ";
  return s.slice(0, 220);
}

function build(n, saver) {
  return new StateGraph(State)
    .addNode("step", (state) => ({ messages: [new AIMessage(text(state.count))], count: state.count + 1 }))
    .addEdge(START, "step")
    .addConditionalEdges("step", (state) => (state.count < n ? "step" : END), ["step", END])
    .compile(saver ? { checkpointer: saver } : {});
}

function median(xs) {
  const v = [...xs].sort((a, b) => a - b);
  const mid = Math.floor(v.length / 2);
  return v.length % 2 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

/** The saver's tables' total size in `schema` (what the Python peer measures). */
async function relationBytes(client, schema) {
  const r = await client.query(
    `SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint AS bytes
       FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
      WHERE n.nspname = $1 AND c.relkind = 'r' AND c.relname <> 'checkpoint_migrations'`,
    [schema],
  );
  return Number(r.rows[0].bytes);
}

/**
 * One run of `n` steps on a fresh saver of `kind`. Returns steps/s, and with `measure`
 * what the saver holds afterwards.
 */
async function runOnce(kind, n, rep, measure) {
  const [saverKind, synchronous] = kind.split(":");
  const threadId = `bench-${rep}`;
  let saver = null;
  let durability;
  const extra = {};
  let done = async () => {};
  if (saverKind === "memory") {
    saver = new MemorySaver();
  } else if (saverKind === "sqlite") {
    if (!["full", "normal"].includes(synchronous)) throw new Error(`sqlite:${synchronous}: expected full or normal`);
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "lgjs-loop-"));
    const file = path.join(dir, "bench.db");
    const db = new Database(file);
    db.pragma("journal_mode = WAL");
    db.pragma(`synchronous = ${synchronous.toUpperCase()}`);
    saver = new SqliteSaver(db);
    durability = "sync";
    done = async () => {
      if (measure) {
        extra.synchronous = synchronous;
        extra.journal_mode = db.pragma("journal_mode", { simple: true });
        extra.synchronous_pragma = db.pragma("synchronous", { simple: true });
        db.pragma("wal_checkpoint(TRUNCATE)");
        extra.file_bytes = fs.statSync(file).size;
      }
      db.close();
      fs.rmSync(dir, { recursive: true, force: true });
    };
  } else if (saverKind === "postgres") {
    const url = process.env.DATABASE_URL;
    if (!url) throw new Error("postgres needs DATABASE_URL");
    const schema = `lgjs_loop_${process.pid}`;
    const client = new pg.Client({ connectionString: url });
    await client.connect();
    await client.query(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
    saver = PostgresSaver.fromConnString(url, { schema });
    await saver.setup();
    durability = "sync";
    done = async () => {
      if (measure) {
        extra.relation_bytes = await relationBytes(client, schema);
        // What the saver's own connections run with (the URL's options apply to them).
        const probe = new pg.Client({ connectionString: url });
        await probe.connect();
        extra.synchronous_commit = (await probe.query("SHOW synchronous_commit")).rows[0].synchronous_commit;
        await probe.end();
      }
      await saver.end();
      await client.query(`DROP SCHEMA "${schema}" CASCADE`);
      await client.end();
    };
  } else if (saverKind !== "none") {
    throw new Error(`unknown saver ${kind}`);
  }
  const graph = build(n, saver);
  const config = { recursionLimit: n + 10 };
  if (saver) config.configurable = { thread_id: threadId };
  if (durability) config.durability = durability;
  const start = performance.now();
  const out = await graph.invoke({ messages: [], count: 0 }, config);
  const secs = (performance.now() - start) / 1000;
  if (out.count !== n || out.messages.length !== n) {
    throw new Error(`ran ${out.count} steps with ${out.messages.length} messages, expected ${n}`);
  }
  await done();
  return { rate: n / secs, extra };
}

async function main() {
  const [kind, reps, ...sizes] = process.argv.slice(2);
  if (!kind || !reps || sizes.length === 0) throw new Error("usage: node loop.mjs SAVER REPS N [N ...]");
  const session = process.env.KEEL_BENCH_SESSION ?? "default";
  if (process.env.KEEL_BENCH_WARMUP !== "0") await runOnce(kind, 50, "warmup", false);
  const [saverName] = kind.split(":");
  for (const n of sizes.map(Number)) {
    const rates = [];
    let extra = {};
    for (let rep = 0; rep < Number(reps); rep += 1) {
      if (global.gc) global.gc();
      const r = await runOnce(kind, n, rep, rep + 1 === Number(reps));
      rates.push(r.rate);
      if (rep + 1 === Number(reps)) extra = r.extra;
    }
    const m = median(rates);
    const line = {
      impl: "langgraphjs",
      bench: "loop",
      saver: saverName,
      n,
      steps_per_s: Math.round(m * 10) / 10,
      us_per_step: Math.round((1e7 / m)) / 10,
      ...extra,
    };
    if (saverName === "postgres") line.session = session;
    process.stdout.write(`${JSON.stringify(line)}\n`);
  }
}

main().catch((e) => {
  process.stderr.write(`${e.stack ?? e}\n`);
  process.exit(1);
});
