"""Differential test vectors for keel's `AddMessages`, produced by LangGraph itself.

Run by `cargo xtask gen-vectors` inside the peer virtualenv (target/peers-venv), which
pins langgraph and langchain-core. Each case holds a `left` list (the state) and a
`right` list (one node's write) as LangChain message dicts (`model_dump()`), and what
LangGraph's own `add_messages(left, right)` returned: the merged list, or the error.

Ids that LangGraph assigns at random (to messages written without one) cannot be
compared as strings. For every output message the vector records where it came from
(`from`: "left" or "right", and its `index` in that list), and `generated_id: true`
with `"id": null` when LangGraph made the id up. The Rust test then requires keel's
output message at that position to carry the id keel assigned to that same input
message, and every such id to be non-empty and unique.

Cases are drawn from a fixed seed, so the file only changes when LangGraph's behaviour,
the pinned versions, or this script change. Cases named `divergent-*` show where keel
deliberately differs (see keel-reducer's crate docs); the Rust test lists them.

Usage: python add_messages_vectors.py OUT.json
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import sys
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages

SEED = 20260412
RANDOM_CASES = 320
UNKNOWN_ID_ERROR = re.compile(
    r"^Attempting to delete a message with an ID that doesn't exist \('(?P<id>.*)'\)$"
)

WORDS = [
    "list", "the", "files", "in", "config", "ok", "done", "error:", "retry",
    "résumé", "naïve", "数据", "émoji 🚀", "line\nbreak", "tab\tsep", '"quoted"',
    "path/to/app.toml", "{not json}", "",
]
TOOL_NAMES = ["ls", "read_file", "grep", "write_file", "search_web", "run"]


class Gen:
    """Random LangChain messages from one seeded RNG."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.counter = 0

    def fresh_id(self) -> str:
        self.counter += 1
        # Mix short ids with UUID-shaped ones, as real histories have both.
        if self.rng.random() < 0.3:
            r = self.rng.getrandbits(128)
            h = f"{r:032x}"
            return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-a{h[17:20]}-{h[20:32]}"
        return f"msg-{self.counter}"

    def text(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(0, 5)))

    def content(self) -> str | list[dict[str, Any]]:
        if self.rng.random() < 0.8:
            return self.text()
        parts: list[dict[str, Any]] = []
        for _ in range(self.rng.randint(1, 3)):
            kind = self.rng.random()
            if kind < 0.6:
                parts.append({"type": "text", "text": self.text()})
            elif kind < 0.85:
                parts.append(
                    {"type": "image_url", "image_url": {"url": f"https://example.com/{self.rng.randint(0, 99)}.png"}}
                )
            else:
                parts.append({"type": "text", "text": self.text(), "cache_control": {"type": "ephemeral"}})
        return parts

    def tool_call_id(self) -> str:
        return f"call_{self.rng.randint(0, 9999):04d}"

    def args(self) -> dict[str, Any]:
        args: dict[str, Any] = {}
        for key in self.rng.sample(["path", "query", "n", "flags", "nested"], self.rng.randint(0, 3)):
            if key == "n":
                args[key] = self.rng.randint(-5, 500)
            elif key == "flags":
                args[key] = [self.rng.choice(["-l", "-a", "-r"]) for _ in range(self.rng.randint(0, 2))]
            elif key == "nested":
                args[key] = {"deep": {"ok": self.rng.random() < 0.5, "none": None}}
            else:
                args[key] = self.text()
        return args

    def message(self, mid: str | None, kind: str | None = None) -> BaseMessage:
        kind = kind or self.rng.choice(["human", "human", "ai", "ai", "tool", "system"])
        name = self.rng.choice(["alice", "agent", "ls"]) if self.rng.random() < 0.15 else None
        extra: dict[str, Any] = {}
        if self.rng.random() < 0.1:
            extra["additional_kwargs"] = {"trace": self.rng.randint(0, 9)}
        if kind == "human":
            return HumanMessage(content=self.content(), id=mid, name=name, **extra)
        if kind == "system":
            return SystemMessage(content=self.content(), id=mid, name=name, **extra)
        if kind == "tool":
            status = "error" if self.rng.random() < 0.2 else "success"
            artifact = {"bytes": self.rng.randint(0, 10**6)} if self.rng.random() < 0.1 else None
            return ToolMessage(
                content=self.content(),
                tool_call_id=self.tool_call_id(),
                id=mid,
                name=name,
                status=status,
                artifact=artifact,
                **extra,
            )
        tool_calls = [
            {"name": self.rng.choice(TOOL_NAMES), "args": self.args(), "id": self.tool_call_id(), "type": "tool_call"}
            for _ in range(self.rng.choice([0, 0, 1, 1, 2, 3]))
        ]
        invalid = []
        if self.rng.random() < 0.1:
            invalid.append(
                {"name": self.rng.choice(TOOL_NAMES), "args": '{"path": "a', "id": self.tool_call_id(),
                 "error": None, "type": "invalid_tool_call"}
            )
        if self.rng.random() < 0.1:
            extra["response_metadata"] = {"model_name": "scripted", "finish_reason": "tool_calls"}
        usage = None
        if self.rng.random() < 0.15:
            i, o = self.rng.randint(1, 900), self.rng.randint(1, 300)
            usage = {"input_tokens": i, "output_tokens": o, "total_tokens": i + o}
        content = "" if tool_calls and self.rng.random() < 0.5 else self.content()
        return AIMessage(
            content=content,
            id=mid,
            name=name,
            tool_calls=tool_calls,
            invalid_tool_calls=invalid,
            usage_metadata=usage,
            **extra,
        )

    def maybe_id(self, p_none: float) -> str | None:
        return None if self.rng.random() < p_none else self.fresh_id()


def remove(mid: str) -> RemoveMessage:
    return RemoveMessage(id=mid)


def random_case(g: Gen) -> tuple[list[BaseMessage], list[BaseMessage]]:
    rng = g.rng
    left = [g.message(g.maybe_id(0.2)) for _ in range(rng.randint(0, 8))]
    existing = [m.id for m in left if m.id is not None]
    right: list[BaseMessage] = []
    added: list[str] = []
    for _ in range(rng.randint(0, 8)):
        r = rng.random()
        if r < 0.22:
            right.append(g.message(None))  # new, LangGraph assigns the id
        elif r < 0.40:
            mid = g.fresh_id()
            added.append(mid)
            right.append(g.message(mid))  # new, with its own id
        elif r < 0.55 and existing:
            right.append(g.message(rng.choice(existing)))  # replaces in place
        elif r < 0.63 and added:
            right.append(g.message(rng.choice(added)))  # duplicate id within right
        elif r < 0.75 and (existing or added):
            right.append(remove(rng.choice(existing + added)))  # remove a present id
        elif r < 0.80:
            right.append(remove(g.fresh_id()))  # unknown id: an error
        elif r < 0.86 and existing:
            mid = rng.choice(existing)
            right += [remove(mid), g.message(mid)]  # removal cancelled by a re-add
        elif r < 0.90:
            mid = g.fresh_id()
            right += [g.message(mid), remove(mid)]  # added and removed in one write
        else:
            right.append(g.message(None, kind="tool"))
    if rng.random() < 0.18:
        # A remove-all somewhere, followed by 0-4 new messages with distinct ids (keel
        # and LangGraph differ on removals and repeated ids after it: divergent-* cases).
        pos = rng.randint(0, len(right))
        tail = [g.message(g.maybe_id(0.4)) for _ in range(rng.choice([0, 0, 1, 2, 3, 4]))]
        head = right[:pos] + [remove(REMOVE_ALL_MESSAGES)]
        if rng.random() < 0.25:
            head += right[pos:] + [remove(REMOVE_ALL_MESSAGES)]
        right = head + tail
    return left, right


def H(content: str, mid: str | None = None) -> HumanMessage:  # noqa: N802
    return HumanMessage(content=content, id=mid)


def A(content: str, mid: str | None = None, calls: list[dict[str, Any]] | None = None) -> AIMessage:  # noqa: N802
    return AIMessage(content=content, id=mid, tool_calls=calls or [])


def named_cases() -> list[tuple[str, list[BaseMessage], list[BaseMessage]]]:
    """Hand-written cases: every rule once, by name."""
    ls = [{"name": "ls", "args": {"path": "."}, "id": "call_1", "type": "tool_call"}]
    return [
        ("empty-both", [], []),
        ("empty-right", [H("a", "1")], []),
        ("empty-left", [], [H("a", "1"), H("b")]),
        ("left-without-ids", [H("a"), A("b")], [H("c", "3")]),
        ("append", [H("a", "1")], [A("b", "2")]),
        ("replace-in-place", [H("a", "1"), A("b", "2"), H("c", "3")], [A("B", "2")]),
        ("replace-changes-type", [H("a", "1"), A("b", "2")], [SystemMessage(content="sys", id="1")]),
        ("duplicate-new-ids-in-right", [H("a", "1")], [H("x", "9"), H("y", "9")]),
        ("remove-existing", [H("a", "1"), H("b", "2"), H("c", "3")], [remove("2")]),
        ("remove-twice-in-one-write", [H("a", "1"), H("b", "2")], [remove("1"), remove("1")]),
        ("remove-unknown-id", [H("a", "1")], [H("b", "2"), remove("nope")]),
        ("remove-before-add-in-one-write", [H("a", "1")], [remove("2"), H("b", "2")]),
        ("add-then-remove-in-one-write", [H("a", "1")], [H("b", "2"), remove("2")]),
        ("remove-then-readd-keeps-position", [H("a", "1"), H("b", "2"), H("c", "3")], [remove("1"), A("A", "1")]),
        ("readd-then-remove", [H("a", "1"), H("b", "2")], [A("A", "1"), remove("1")]),
        ("remove-all-only", [H("a", "1"), H("b", "2")], [remove(REMOVE_ALL_MESSAGES)]),
        ("remove-all-on-empty", [], [remove(REMOVE_ALL_MESSAGES)]),
        ("remove-all-then-list", [H("a", "1")], [remove(REMOVE_ALL_MESSAGES), H("s"), A("t", "t1")]),
        ("remove-all-then-reuse-old-id", [H("a", "1")], [remove(REMOVE_ALL_MESSAGES), H("again", "1")]),
        ("ops-before-remove-all-ignored", [H("a", "1")], [remove("nope"), H("x", "1"), remove(REMOVE_ALL_MESSAGES), H("z", "z")]),
        ("two-remove-alls", [H("a", "1")], [remove(REMOVE_ALL_MESSAGES), H("x", "x"), remove(REMOVE_ALL_MESSAGES), H("y", "y")]),
        (
            "tool-call-round-trip",
            [SystemMessage(content="be careful", id="s"), H("list files", "u")],
            [A("", "a", ls), ToolMessage(content="a.txt", tool_call_id="call_1", id="t", name="ls")],
        ),
        (
            "replace-tool-result",
            [A("", "a", ls), ToolMessage(content="[truncated]", tool_call_id="call_1", id="t")],
            [ToolMessage(content="a.txt\nb.txt", tool_call_id="call_1", id="t", status="error")],
        ),
        # keel differs on purpose below (see keel-reducer's crate docs).
        ("divergent-duplicate-ids-after-remove-all", [H("a", "1")], [remove(REMOVE_ALL_MESSAGES), H("one", "b"), H("two", "b")]),
        ("divergent-remove-after-remove-all-added", [H("a", "1")], [remove(REMOVE_ALL_MESSAGES), H("b", "b"), remove("b")]),
        ("divergent-remove-after-remove-all-unknown", [H("a", "1")], [remove(REMOVE_ALL_MESSAGES), remove("1")]),
    ]


def run_case(name: str, left: list[BaseMessage], right: list[BaseMessage]) -> dict[str, Any]:
    """Dumps the inputs, calls LangGraph's add_messages, and records what it returned."""
    sources: dict[int, tuple[str, int, bool]] = {}
    for side, msgs in (("left", left), ("right", right)):
        for i, m in enumerate(msgs):
            assert id(m) not in sources, f"{name}: one message object used twice"
            sources[id(m)] = (side, i, m.id is None)
    case: dict[str, Any] = {
        "name": name,
        "left": [m.model_dump() for m in left],
        "right": [m.model_dump() for m in right],
    }
    try:
        merged = add_messages(left, right)
    except ValueError as e:
        match = UNKNOWN_ID_ERROR.match(str(e))
        if match is None:
            raise RuntimeError(f"{name}: unexpected error from add_messages: {e!r}") from e
        case["expected"] = {"error": {"kind": "unknown_message_id", "id": match["id"]}}
        return case
    out = []
    generated: set[str] = set()
    for m in merged:
        side, i, had_no_id = sources[id(m)]  # add_messages returns the input objects
        dumped = m.model_dump()
        if had_no_id:
            assert isinstance(m.id, str) and m.id and m.id not in generated, f"{name}: bad generated id"
            generated.add(m.id)
            dumped["id"] = None
        out.append({"from": side, "index": i, "generated_id": had_no_id, "message": dumped})
    case["expected"] = {"ok": out}
    return case


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    cases = [run_case(name, left, right) for name, left, right in named_cases()]
    for n in range(RANDOM_CASES):
        g = Gen(random.Random(SEED * 1000 + n))
        left, right = random_case(g)
        cases.append(run_case(f"random-{n:03d}", left, right))
    header = {
        "generator": "xtask/peers/add_messages_vectors.py",
        "langgraph": importlib.metadata.version("langgraph"),
        "langchain_core": importlib.metadata.version("langchain-core"),
        "seed": SEED,
    }
    lines = [json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases]
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write("{\n")
        for k, v in header.items():
            f.write(f"{json.dumps(k)}: {json.dumps(v)},\n")
        f.write('"cases": [\n' + ",\n".join(lines) + "\n]}\n")
    errors = sum(1 for c in cases if "error" in c["expected"])
    print(f"wrote {len(cases)} cases ({errors} expect an error) to {sys.argv[1]}")


if __name__ == "__main__":
    main()
