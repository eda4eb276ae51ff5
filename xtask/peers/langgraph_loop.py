"""LangGraph peer of keel-graph's loop benchmark (crates/keel-graph/examples/bench_loop.rs).

One node in a self-loop for N steps; each step appends one ~220-byte AIMessage through
add_messages and bumps a plain (last-value) counter. Prints one JSON line per
(saver, N) with the median steps/s over the repetitions.

Usage: python langgraph_loop.py SAVER REPS N [N ...]   (SAVER: none | memory)
"""

import json
import statistics
import sys
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


def main() -> None:
    saver_kind, reps, *sizes = sys.argv[1:]
    for n in map(int, sizes):
        rates = []
        for rep in range(int(reps)):
            saver = InMemorySaver() if saver_kind == "memory" else None
            graph = build(n, saver)
            config = {"recursion_limit": n + 10}
            if saver is not None:
                config["configurable"] = {"thread_id": f"bench-{rep}"}
            start = time.perf_counter()
            out = graph.invoke({"messages": [], "count": 0}, config)
            secs = time.perf_counter() - start
            assert out["count"] == n
            rates.append(n / secs)
        median = statistics.median(rates)
        print(json.dumps({"impl": "langgraph", "saver": saver_kind, "n": n,
                          "steps_per_s": round(median), "us_per_step": round(1e6 / median, 3)}),
              flush=True)


if __name__ == "__main__":
    main()
