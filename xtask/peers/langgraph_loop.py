"""LangGraph peer of keel-graph's loop benchmark (crates/keel-graph/examples/bench_loop.rs).

One node in a self-loop for N steps; each step appends one ~220-byte AIMessage through
add_messages and bumps a plain (last-value) counter. Prints one JSON line per
(saver, N) with the median steps/s over the repetitions.

Usage: python langgraph_loop.py SAVER REPS N [N ...]
  SAVER: none | memory | sqlite:full | sqlite:normal

none and memory run with LangGraph's default durability. sqlite:SYNC is
langgraph-checkpoint-sqlite's SqliteSaver on a fresh file per repetition with
durability="sync", on a sqlite3 connection set to synchronous=SYNC before the saver
sets journal_mode=WAL in its setup(); after the last repetition the WAL is checkpointed
(TRUNCATE) and the file's size reported.
"""

import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from typing import Annotated, TypedDict

from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages


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


def run_once(saver_kind: str, n: int, rep: int, measure: bool):
    """One run of n steps on a fresh saver; returns steps/s and, with measure, storage."""
    kind, _, synchronous = saver_kind.partition(":")
    extra = {}
    tmp = None
    conn = None
    kwargs = {}
    if kind == "memory":
        saver = InMemorySaver()
    elif kind == "sqlite":
        # Imported here: the graph group installs only langgraph, the SQLite group adds
        # langgraph-checkpoint-sqlite.
        from langgraph.checkpoint.sqlite import SqliteSaver

        if synchronous not in ("full", "normal"):
            raise SystemExit(f"sqlite:{synchronous}: expected full or normal")
        tmp = tempfile.TemporaryDirectory(prefix="lg-loop-")
        path = os.path.join(tmp.name, "bench.db")
        conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
        saver = SqliteSaver(conn)
        saver.setup()  # sets journal_mode=WAL
        kwargs["durability"] = "sync"
    elif kind == "none":
        saver = None
    else:
        raise SystemExit(f"unknown saver {saver_kind}")
    graph = build(n, saver)
    config = {"recursion_limit": n + 10}
    if saver is not None:
        config["configurable"] = {"thread_id": f"bench-{rep}"}
    start = time.perf_counter()
    out = graph.invoke({"messages": [], "count": 0}, config, **kwargs)
    secs = time.perf_counter() - start
    assert out["count"] == n and len(out["messages"]) == n
    if conn is not None:
        if measure:
            extra["synchronous"] = synchronous
            extra["journal_mode"] = conn.execute("PRAGMA journal_mode").fetchone()[0]
            extra["synchronous_pragma"] = conn.execute("PRAGMA synchronous").fetchone()[0]
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            extra["file_bytes"] = os.path.getsize(path)
        conn.close()
        tmp.cleanup()
    return n / secs, extra


def main() -> None:
    saver_kind, reps, *sizes = sys.argv[1:]
    for n in map(int, sizes):
        rates = []
        extra = {}
        for rep in range(int(reps)):
            rate, extra_rep = run_once(saver_kind, n, rep, rep + 1 == int(reps))
            rates.append(rate)
            extra = extra_rep or extra
        median = statistics.median(rates)
        print(json.dumps({"impl": "langgraph", "saver": saver_kind.partition(":")[0], "n": n,
                          "steps_per_s": round(median, 1), "us_per_step": round(1e6 / median, 3),
                          **extra}),
              flush=True)


if __name__ == "__main__":
    main()
