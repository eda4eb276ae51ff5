// LangGraph.js peer of `cargo xtask bench agent`: keel's compacting agent loop, written
// the way a LangGraph.js user would write it (a StateGraph, a BaseChatModel, `tool()`s
// run by the prebuilt ToolNode, messagesStateReducer with RemoveMessage), on
// MemorySaver, SqliteSaver or PostgresSaver.
//
// Usage:
//   node agent.mjs --repo DIR --saver memory|sqlite|postgres --durability sync|async \
//                  --steps N [--reps R] [--url POSTGRES_URL] [--scratch DIR] [--warmup 0]
// (the URL defaults to DATABASE_URL; SqliteSaver's file goes to a fresh directory under
// --scratch, default the system's temporary directory, opened by better-sqlite3 with
// journal_mode=WAL and synchronous=NORMAL, what keel's SqliteSaver runs with by default;
// `--warmup 0` skips the untimed 50-step run on MemorySaver that warms the JIT up before
// the measured repetitions). Prints one JSON line per repetition on stdout; progress
// goes to stderr.
//
// The workload, which keel's side (xtask/src/bench/agent_keel.rs) repeats:
//
// State
//   messages    messagesStateReducer: appends; [RemoveMessage(REMOVE_ALL_MESSAGES), ...tail]
//               flushes and replaces
//   milestones  array of strings, appended; the epoch clears it
//   epoch_summary  string, last value ("" at first): keel's `epoch` (LangGraph refuses a
//               channel named like a node)
//   goal        string, last value, written once by the input
//   step        agent steps so far (model calls), last value
//
// Graph: START -> agent; agent -> tools when its message has a tool call, else END;
// tools -> compact when step % 10 == 0, else agent; compact -> epoch when there are 5
// milestones, else agent; epoch -> agent.
//
// agent    builds the prompt [System(SYSTEM), Human(goal), System("Epoch summary:\n" +
//          epoch_summary) when there is one, System("Milestone k:\n" + m) for each milestone,
//          ...messages] and calls the fake model with it. Model call i (1-based) answers
//          an AIMessage "step i: {prompt messages} messages, {prompt chars} chars in the
//          prompt" (chars = the sum of the contents' lengths) with one tool call
//          `call_i`, cycling over
//            i % 3 == 1: ls        {path: "crates"}
//            i % 3 == 2: read_file {path: "Cargo.toml", limit: 50}
//            i % 3 == 0: grep      {pattern: "fn ", path: "crates/keel-message"}
//          except call N, which answers "done after N steps" with no tool call (the run
//          ends): N model calls, N - 1 tool calls.
// tools    runs the call on the repository directory with Node's fs and appends its
//          ToolMessage:
//            ls        the directory's entries sorted by name, a directory with a
//                      trailing "/", one a line
//            read_file the first `limit` lines, each as `{n:>6}\t{line}`
//            grep      a JavaScript RegExp over the files under `path` (walked in name
//                      order, skipping .git, target and node_modules), lines as
//                      `{relative path}:{n}: {line}`, at most 50 matches
// compact  (every 10 agent steps) summarizes all messages but the last 2 with the fake
//          summarizer, writes messages [RemoveMessage(REMOVE_ALL), ...last 2] and
//          appends the summary to milestones; then prunes the thread's checkpoints to
//          the newest 5 (PostgresSaver and SqliteSaver: deletes from their tables in
//          one transaction; MemorySaver: deletes from its storage and writes).
// epoch    (at 5 milestones) folds [epoch, ...milestones] with the fake summarizer into
//          the new epoch and clears milestones.
// The fake summarizer answers at once with an extractive summary: the first line of
// each text, joined with "\n", cut to 500 characters.
//
// Per repetition: agent steps/s (model calls per second, over graph.invoke alone), wall
// seconds, supersteps (the last checkpoint's metadata.step: the nodes run, __start__
// not counted; 2N - 1 + compactions + epochs), checkpoint puts and putWrites calls, compactions and epochs, the time spent
// in the fake models and the tool functions (the "work"), runtime overhead per step
// ((wall - work) / steps), peak RSS (VmHWM, reset before each repetition, or the
// largest sampled rss where /proc is not there) and, on Postgres, the bytes the thread
// occupies at the end (sum of pg_column_size over its rows in the three tables) and the
// saver tables' total relation size; on SQLite, the database's used pages ((page_count -
// freelist_count) x page_size, as keel's side counts its file).

import fs from "node:fs";
import path from "node:path";
import { performance } from "node:perf_hooks";

import { AIMessage, HumanMessage, RemoveMessage, SystemMessage } from "@langchain/core/messages";
import { BaseChatModel } from "@langchain/core/language_models/chat_models";
import { tool } from "@langchain/core/tools";
import {
  Annotation,
  END,
  MemorySaver,
  messagesStateReducer,
  REMOVE_ALL_MESSAGES,
  START,
  StateGraph,
} from "@langchain/langgraph";
import { ToolNode } from "@langchain/langgraph/prebuilt";
import { PostgresSaver } from "@langchain/langgraph-checkpoint-postgres";
import { SqliteSaver } from "@langchain/langgraph-checkpoint-sqlite";
import Database from "better-sqlite3";
import os from "node:os";
import pg from "pg";
import { z } from "zod";

const SYSTEM =
  "You are a coding agent working in a Rust repository. Use ls, read_file and grep to " +
  "explore it, then answer. Keep going until the task is done.";
const GOAL =
  "Map the keel workspace: list its crates, read the workspace manifest, and find the " +
  "public functions of keel-message.";
const COMPACT_EVERY = 10;
const MILESTONES_PER_EPOCH = 5;
const KEEP_TAIL = 2;
const KEEP_CHECKPOINTS = 5;
const SUMMARY_CHARS = 500;
const GREP_CAP = 50;
const CLEAR = "__clear_milestones__";

function parseArgs(argv) {
  const args = { reps: 1, url: process.env.DATABASE_URL };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, "");
    const value = argv[i + 1];
    if (value === undefined) throw new Error(`--${key} needs a value`);
    args[key] = value;
  }
  for (const k of ["repo", "saver", "durability", "steps"]) {
    if (!args[k]) throw new Error(`missing --${k}`);
  }
  args.steps = Number(args.steps);
  args.reps = Number(args.reps);
  if (!["memory", "sqlite", "postgres"].includes(args.saver)) throw new Error(`unknown saver ${args.saver}`);
  if (!["sync", "async"].includes(args.durability)) throw new Error(`unknown durability ${args.durability}`);
  if (args.saver === "postgres" && !args.url) throw new Error("postgres needs --url or DATABASE_URL");
  return args;
}

// ---- time spent in the "work" (fake models and tool bodies), not in the runtime ----
const work = { ms: 0 };
function timed(f) {
  const t = performance.now();
  try {
    return f();
  } finally {
    work.ms += performance.now() - t;
  }
}

const firstLine = (text) => {
  const s = typeof text === "string" ? text : JSON.stringify(text);
  const nl = s.indexOf("\n");
  return nl < 0 ? s : s.slice(0, nl);
};
const contentChars = (m) => (typeof m.content === "string" ? m.content.length : JSON.stringify(m.content).length);

/** The fake agent model: answers at once, deterministically, from its call count. */
class FakeAgentModel extends BaseChatModel {
  constructor(steps) {
    super({});
    this.steps = steps;
    this.calls = 0;
  }
  _llmType() {
    return "fake-agent";
  }
  async _generate(messages) {
    const message = timed(() => {
      this.calls += 1;
      const i = this.calls;
      let chars = 0;
      for (const m of messages) chars += contentChars(m);
      if (i >= this.steps) return new AIMessage(`done after ${i} steps`);
      const content = `step ${i}: ${messages.length} messages, ${chars} chars in the prompt`;
      let call;
      switch (i % 3) {
        case 1:
          call = { name: "ls", args: { path: "crates" } };
          break;
        case 2:
          call = { name: "read_file", args: { path: "Cargo.toml", limit: 50 } };
          break;
        default:
          call = { name: "grep", args: { pattern: "fn ", path: "crates/keel-message" } };
      }
      return new AIMessage({ content, tool_calls: [{ ...call, id: `call_${i}`, type: "tool_call" }] });
    });
    return { generations: [{ text: typeof message.content === "string" ? message.content : "", message }] };
  }
}

/** The extractive summary of `texts`: their first lines, joined, cut to 500 characters. */
function extractive(texts) {
  return texts.map(firstLine).join("\n").slice(0, SUMMARY_CHARS);
}

/** The fake summarizer: an extractive summary of every message but the instruction. */
class FakeSummarizer extends BaseChatModel {
  _llmType() {
    return "fake-summarizer";
  }
  async _generate(messages) {
    const message = timed(() => new AIMessage(extractive(messages.slice(1).map((m) => m.content))));
    return { generations: [{ text: message.content, message }] };
  }
}

// ---- the file tools, on the real repository directory ----
function fileTools(repo) {
  const resolve = (p) => path.join(repo, p ?? ".");
  const ls = tool(
    ({ path: p }) =>
      timed(() =>
        fs
          .readdirSync(resolve(p), { withFileTypes: true })
          .map((e) => (e.isDirectory() ? `${e.name}/` : e.name))
          .sort()
          .join("\n"),
      ),
    {
      name: "ls",
      description: "List a directory of the repository.",
      schema: z.object({ path: z.string().optional().describe("A directory, relative to the repository.") }),
    },
  );
  const readFile = tool(
    ({ path: p, limit }) =>
      timed(() => {
        const lines = fs.readFileSync(resolve(p), "utf8").split("\n");
        const n = Math.min(limit ?? 100, lines.length);
        const out = [];
        for (let k = 0; k < n; k += 1) out.push(`${String(k + 1).padStart(6)}\t${lines[k]}`);
        return out.join("\n");
      }),
    {
      name: "read_file",
      description: "Read the first lines of a file of the repository, numbered from 1.",
      schema: z.object({
        path: z.string().describe("A file, relative to the repository."),
        limit: z.number().int().min(1).max(500).optional().describe("Lines to return."),
      }),
    },
  );
  const grep = tool(
    ({ pattern, path: p }) =>
      timed(() => {
        const re = new RegExp(pattern);
        const out = [];
        const walk = (rel) => {
          const abs = resolve(rel);
          const st = fs.statSync(abs);
          if (!st.isDirectory()) {
            const lines = fs.readFileSync(abs, "utf8").split("\n");
            for (let k = 0; k < lines.length && out.length < GREP_CAP; k += 1) {
              if (re.test(lines[k])) out.push(`${rel}:${k + 1}: ${lines[k]}`);
            }
            return;
          }
          const names = fs.readdirSync(abs).sort();
          for (const name of names) {
            if (out.length >= GREP_CAP) return;
            if (name === ".git" || name === "target" || name === "node_modules") continue;
            walk(path.join(rel, name));
          }
        };
        walk(p ?? ".");
        return out.join("\n");
      }),
    {
      name: "grep",
      description: `Search the files under a path for lines matching a regular expression (at most ${GREP_CAP} matches).`,
      schema: z.object({
        pattern: z.string().describe("A regular expression."),
        path: z.string().optional().describe("A file or directory, relative to the repository."),
      }),
    },
  );
  return [ls, readFile, grep];
}

// ---- pruning the thread's checkpoints to the newest 5 ----
function memoryPruner(saver) {
  return async (threadId) => {
    const ns = saver.storage[threadId]?.[""];
    if (!ns) return;
    const ids = Object.keys(ns).sort(); // uuid6 ids sort by time
    for (const id of ids.slice(0, Math.max(0, ids.length - KEEP_CHECKPOINTS))) {
      delete ns[id];
      delete saver.writes[JSON.stringify([threadId, "", id])];
    }
  };
}

function sqlitePruner(db) {
  // Checkpoints but the newest 5 and their writes (SqliteSaver keeps each checkpoint's
  // channel values inline: no blobs to collect).
  const gone = db.prepare(
    `SELECT checkpoint_id FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ''
     ORDER BY checkpoint_id DESC LIMIT -1 OFFSET ${KEEP_CHECKPOINTS}`,
  );
  const delCheckpoint = db.prepare(
    "DELETE FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?",
  );
  const delWrites = db.prepare("DELETE FROM writes WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?");
  const prune = db.transaction((threadId) => {
    for (const { checkpoint_id: id } of gone.all(threadId)) {
      delCheckpoint.run(threadId, id);
      delWrites.run(threadId, id);
    }
  });
  return async (threadId) => prune(threadId);
}

function postgresPruner(client, schema) {
  const t = (name) => `"${schema}".${name}`;
  // Checkpoints but the newest 5, their writes, then the blobs no remaining checkpoint
  // refers to (blobs are shared between checkpoints through channel_versions).
  const sql = `
    WITH gone AS (
      DELETE FROM ${t("checkpoints")}
      WHERE thread_id = $1 AND checkpoint_ns = '' AND checkpoint_id NOT IN (
        SELECT checkpoint_id FROM ${t("checkpoints")}
        WHERE thread_id = $1 AND checkpoint_ns = ''
        ORDER BY checkpoint_id DESC LIMIT ${KEEP_CHECKPOINTS})
      RETURNING checkpoint_id
    ), gone_writes AS (
      DELETE FROM ${t("checkpoint_writes")}
      WHERE thread_id = $1 AND checkpoint_ns = '' AND checkpoint_id IN (SELECT checkpoint_id FROM gone)
    )
    SELECT count(*)::int AS n FROM gone`;
  // The versions the remaining checkpoints refer to are read once, then each blob is
  // one hashed lookup. (A NOT EXISTS correlated per blob row unpacked every remaining
  // checkpoint once per blob: one such DELETE ran for minutes and took 19 GB of server
  // memory at N = 10,000.)
  const blobs = `
    WITH live AS MATERIALIZED (
      SELECT DISTINCT v.key AS channel, v.value AS version
      FROM ${t("checkpoints")} c, jsonb_each_text(c.checkpoint -> 'channel_versions') v
      WHERE c.thread_id = $1 AND c.checkpoint_ns = '' AND v.value IS NOT NULL)
    DELETE FROM ${t("checkpoint_blobs")} b
    WHERE b.thread_id = $1 AND b.checkpoint_ns = ''
      AND (b.channel, b.version) NOT IN (SELECT channel, version FROM live)`;
  return async (threadId) => {
    await client.query("BEGIN");
    try {
      await client.query(sql, [threadId]);
      await client.query(blobs, [threadId]);
      await client.query("COMMIT");
    } catch (e) {
      await client.query("ROLLBACK");
      throw e;
    }
  };
}

// ---- the graph ----
const State = Annotation.Root({
  messages: Annotation({ reducer: messagesStateReducer, default: () => [] }),
  milestones: Annotation({
    reducer: (left, right) => (right === CLEAR ? [] : left.concat(right)),
    default: () => [],
  }),
  epoch_summary: Annotation({ reducer: (_, right) => right, default: () => "" }),
  goal: Annotation({ reducer: (_, right) => right, default: () => "" }),
  step: Annotation({ reducer: (_, right) => right, default: () => 0 }),
});

function build({ steps, repo, saver, prune, counts }) {
  const model = new FakeAgentModel(steps);
  const summarizer = new FakeSummarizer({});
  const tools = new ToolNode(fileTools(repo));

  const agent = async (state) => {
    const prompt = [new SystemMessage(SYSTEM), new HumanMessage(state.goal)];
    if (state.epoch_summary) prompt.push(new SystemMessage(`Epoch summary:\n${state.epoch_summary}`));
    state.milestones.forEach((m, k) => prompt.push(new SystemMessage(`Milestone ${k + 1}:\n${m}`)));
    for (const m of state.messages) prompt.push(m);
    const reply = await model.invoke(prompt);
    return { messages: [reply], step: state.step + 1 };
  };

  const compact = async (state, config) => {
    const old = state.messages.slice(0, -KEEP_TAIL);
    const tail = state.messages.slice(-KEEP_TAIL);
    const summary = await summarizer.invoke([
      new SystemMessage("Summarize the conversation so far for the agent's memory."),
      ...old,
    ]);
    await prune(config.configurable.thread_id);
    counts.compactions += 1;
    return {
      messages: [new RemoveMessage({ id: REMOVE_ALL_MESSAGES }), ...tail],
      milestones: [summary.content],
    };
  };

  const epoch = async (state) => {
    const texts = state.epoch_summary ? [state.epoch_summary, ...state.milestones] : state.milestones;
    const folded = await summarizer.invoke([
      new SystemMessage("Fold the previous epoch and these milestones into one summary."),
      ...texts.map((t) => new HumanMessage(t)),
    ]);
    counts.epochs += 1;
    return { epoch_summary: folded.content, milestones: CLEAR };
  };

  const afterAgent = (state) => {
    const last = state.messages[state.messages.length - 1];
    return last?.tool_calls?.length ? "tools" : END;
  };
  const afterTools = (state) => (state.step % COMPACT_EVERY === 0 ? "compact" : "agent");
  const afterCompact = (state) => (state.milestones.length >= MILESTONES_PER_EPOCH ? "epoch" : "agent");

  return new StateGraph(State)
    .addNode("agent", agent)
    .addNode("tools", tools)
    .addNode("compact", compact)
    .addNode("epoch", epoch)
    .addEdge(START, "agent")
    .addConditionalEdges("agent", afterAgent, ["tools", END])
    .addConditionalEdges("tools", afterTools, ["compact", "agent"])
    .addConditionalEdges("compact", afterCompact, ["epoch", "agent"])
    .addEdge("epoch", "agent")
    .compile({ checkpointer: saver });
}

function countCalls(saver, counts) {
  const put = saver.put.bind(saver);
  const putWrites = saver.putWrites.bind(saver);
  saver.put = (...a) => {
    counts.puts += 1;
    return put(...a);
  };
  saver.putWrites = (...a) => {
    counts.put_writes += 1;
    return putWrites(...a);
  };
}

// ---- peak RSS ----
function resetPeak() {
  try {
    fs.writeFileSync("/proc/self/clear_refs", "5");
    return true;
  } catch {
    return false;
  }
}
function vmHwm() {
  try {
    const m = /VmHWM:\s+(\d+) kB/.exec(fs.readFileSync("/proc/self/status", "utf8"));
    return m ? Number(m[1]) * 1024 : null;
  } catch {
    return null;
  }
}

async function postgresBytes(client, schema, threadId) {
  const t = (name) => `"${schema}".${name}`;
  const rows = await client.query(
    `SELECT
       (SELECT coalesce(sum(pg_column_size(x.*)), 0) FROM ${t("checkpoints")} x WHERE thread_id = $1)
     + (SELECT coalesce(sum(pg_column_size(x.*)), 0) FROM ${t("checkpoint_blobs")} x WHERE thread_id = $1)
     + (SELECT coalesce(sum(pg_column_size(x.*)), 0) FROM ${t("checkpoint_writes")} x WHERE thread_id = $1)
       AS row_bytes,
       (SELECT count(*) FROM ${t("checkpoints")} WHERE thread_id = $1) AS checkpoints,
       (SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = $2 AND c.relkind = 'r' AND c.relname <> 'checkpoint_migrations')
       AS relation_bytes`,
    [threadId, schema],
  );
  const r = rows.rows[0];
  return { row_bytes: Number(r.row_bytes), relation_bytes: Number(r.relation_bytes), checkpoints_kept: Number(r.checkpoints) };
}

async function runOnce(args, rep) {
  const counts = { puts: 0, put_writes: 0, compactions: 0, epochs: 0 };
  const threadId = `agent-${rep}`;
  let saver;
  let prune;
  let client;
  let schema;
  let sqlite;
  if (args.saver === "memory") {
    saver = new MemorySaver();
    prune = memoryPruner(saver);
  } else if (args.saver === "sqlite") {
    const dir = fs.mkdtempSync(path.join(args.scratch ?? os.tmpdir(), "lgjs-agent-"));
    const db = new Database(path.join(dir, "agent.sqlite"));
    db.pragma("journal_mode = WAL");
    db.pragma("synchronous = NORMAL");
    saver = new SqliteSaver(db);
    saver.setup();
    prune = sqlitePruner(db);
    sqlite = { db, dir };
  } else {
    schema = `lgjs_agent_${process.pid}_${rep}`;
    client = new pg.Client({ connectionString: args.url });
    await client.connect();
    await client.query(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
    saver = PostgresSaver.fromConnString(args.url, { schema });
    await saver.setup();
    prune = postgresPruner(client, schema);
  }
  countCalls(saver, counts);
  const graph = build({ steps: args.steps, repo: args.repo, saver, prune, counts });
  const config = {
    configurable: { thread_id: threadId },
    recursionLimit: 3 * args.steps + 100,
    durability: args.durability,
  };

  if (global.gc) global.gc();
  const hwmReset = resetPeak();
  let sampled = process.memoryUsage().rss;
  const sampler = setInterval(() => {
    sampled = Math.max(sampled, process.memoryUsage().rss);
  }, 5);
  work.ms = 0;
  const start = performance.now();
  const out = await graph.invoke({ goal: GOAL, messages: [], step: 0 }, config);
  const wallMs = performance.now() - start;
  clearInterval(sampler);
  sampled = Math.max(sampled, process.memoryUsage().rss);
  const hwm = hwmReset ? vmHwm() : null;
  const workMs = work.ms;

  if (out.step !== args.steps) throw new Error(`ran ${out.step} agent steps, expected ${args.steps}`);
  const snapshot = await graph.getState({ configurable: { thread_id: threadId } });
  const result = {
    impl: "langgraphjs",
    backend: args.saver,
    durability: args.durability,
    steps: args.steps,
    rep,
    wall_s: wallMs / 1000,
    steps_per_s: args.steps / (wallMs / 1000),
    us_per_step: (wallMs * 1000) / args.steps,
    work_s: workMs / 1000,
    overhead_us_per_step: ((wallMs - workMs) * 1000) / args.steps,
    supersteps: snapshot.metadata?.step ?? null,
    checkpoint_puts: counts.puts,
    put_writes: counts.put_writes,
    compactions: counts.compactions,
    epochs: counts.epochs,
    final_messages: out.messages.length,
    final_milestones: out.milestones.length,
    final_epoch_chars: out.epoch_summary.length,
    peak_rss_bytes: hwm ?? sampled,
    peak_rss_source: hwm ? "VmHWM" : "sampled",
  };
  if (sqlite) {
    const { db, dir } = sqlite;
    const pages = db.pragma("page_count", { simple: true }) - db.pragma("freelist_count", { simple: true });
    const bytes = pages * db.pragma("page_size", { simple: true });
    const kept = db.prepare("SELECT count(*) AS n FROM checkpoints WHERE thread_id = ?").get(threadId).n;
    Object.assign(result, {
      file_bytes: bytes,
      checkpoints_kept: kept,
      bytes_per_step: bytes / args.steps,
      journal_mode: db.pragma("journal_mode", { simple: true }),
      synchronous_pragma: db.pragma("synchronous", { simple: true }),
    });
    db.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
  if (client) {
    const stored = await postgresBytes(client, schema, threadId);
    Object.assign(result, stored, { bytes_per_step: stored.row_bytes / args.steps });
    await saver.end();
    await client.query(`DROP SCHEMA "${schema}" CASCADE`);
    await client.end();
  }
  return result;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  args.repo = path.resolve(args.repo);
  // Warm the JIT up first (a 50-step run on MemorySaver, not reported), so that the
  // first repetition is not charged for compiling LangGraph.js.
  if (args.warmup !== "0") await runOnce({ ...args, saver: "memory", steps: 50 }, "warmup");
  for (let rep = 0; rep < args.reps; rep += 1) {
    const r = await runOnce(args, rep);
    process.stderr.write(
      `langgraphjs ${r.backend}/${r.durability} N=${r.steps} rep ${rep + 1}/${args.reps}: ` +
        `${r.steps_per_s.toFixed(0)} steps/s, ${r.wall_s.toFixed(2)} s\n`,
    );
    process.stdout.write(`${JSON.stringify(r)}\n`);
  }
}

main().catch((e) => {
  process.stderr.write(`${e.stack ?? e}\n`);
  process.exit(1);
});
