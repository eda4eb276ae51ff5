"""LangGraph peer of keel-checkpoint-postgres's loop benchmark
(crates/keel-checkpoint-postgres/examples/bench_postgres.rs).

The graph benchmark's workload (xtask/peers/langgraph_loop.py): one node in a self-loop
for N steps, each step appending one ~220-byte AIMessage through add_messages and bumping
a counter, checkpointed by langgraph-checkpoint-postgres's PostgresSaver with sync
durability. Each repetition runs on a fresh schema; after the last one it measures what
the thread occupies: pg_total_relation_size of the saver's tables (indexes and TOAST
included; the schema holds only that thread). Prints one JSON line per N with the median
steps/s.

Usage: DATABASE_URL=... python langgraph_postgres.py REPS N [N ...]
Set KEEL_BENCH_SESSION to label the output (e.g. the synchronous_commit setting).
"""

import json
import os
import statistics
import sys
import time
from typing import Annotated, TypedDict

import psycopg
from langchain_core.messages import AIMessage
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from psycopg.rows import dict_row


class Loop(TypedDict):
    messages: Annotated[list, add_messages]
    count: int


def text(step: int) -> str:
    s = f"step {step}: "
    while len(s) < 220:
        s += "the agent read the file, ran the tests and noted the result; "
    return s[:220]


def build(n: int, saver):
    def step(state: Loop):
        return {"messages": [AIMessage(text(state["count"]))], "count": state["count"] + 1}

    def route(state: Loop):
        return "step" if state["count"] < n else END

    g = StateGraph(Loop)
    g.add_node("step", step)
    g.add_edge(START, "step")
    g.add_conditional_edges("step", route)
    return g.compile(checkpointer=saver)


def relation_bytes(conn, schema: str) -> int:
    row = conn.execute(
        """SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint AS bytes
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = %s AND c.relkind = 'r' AND c.relname <> 'checkpoint_migrations'""",
        (schema,),
    ).fetchone()
    return int(row["bytes"])


def main() -> None:
    reps, *sizes = sys.argv[1:]
    url = os.environ["DATABASE_URL"]
    session = os.environ.get("KEEL_BENCH_SESSION", "default")
    schema = f"lg_bench_{os.getpid()}"
    for n in map(int, sizes):
        rates = []
        stored = None
        for rep in range(int(reps)):
            with psycopg.connect(url, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                conn.execute(f'CREATE SCHEMA "{schema}"')
                conn.execute(f'SET search_path TO "{schema}"')
                saver = PostgresSaver(conn)
                saver.setup()
                graph = build(n, saver)
                config = {"recursion_limit": n + 10, "configurable": {"thread_id": f"bench-{rep}"}}
                start = time.perf_counter()
                out = graph.invoke({"messages": [], "count": 0}, config, durability="sync")
                secs = time.perf_counter() - start
                assert out["count"] == n
                rates.append(n / secs)
                if rep + 1 == int(reps):
                    stored = relation_bytes(conn, schema)
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        median = statistics.median(rates)
        print(json.dumps({"impl": "langgraph", "bench": "loop", "session": session, "n": n,
                          "steps_per_s": round(median, 1), "us_per_step": round(1e6 / median, 1),
                          "relation_bytes": stored}), flush=True)


if __name__ == "__main__":
    main()
