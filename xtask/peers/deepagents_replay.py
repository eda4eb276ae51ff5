"""Deep Agents peer of keel's compaction replay (`cargo xtask bench compaction`).

For each recorded run listed in `<work>/input/manifest.json` (written by keel-compaction's
`replay_peer` example from the same selection keel's replay uses) and each window, this
builds a real `deepagents.create_deep_agent(...)` and drives it through the recording:

- its model is `ReplayChatModel`, a LangChain `BaseChatModel` that answers the k-th
  agent call with the run's k-th recorded assistant message (text and tool calls);
- its tools are stubs with the recorded tool names; each returns the recorded result
  of the tool call it is given (looked up by tool-call id);
- the run's system message is the agent's `system_prompt`; the user messages before the
  first assistant turn are the first input, and the user messages after each recorded
  text-only reply (where the agent's run ends) are the next input, on one thread with
  an in-memory checkpointer, so Deep Agents' summarization state carries over.

The window is forced through the model's profile: `profile={"max_input_tokens": W}`.
With that, `create_deep_agent` picks its own context-management defaults
(`deepagents.middleware.summarization.compute_summarization_defaults`): summarize when
the conversation reaches 0.85 W tokens and keep the newest 0.10 W; and the middleware
also summarizes when a request is over its input budget (0.95 W less the configured
output tokens, none here). Deep Agents counts those tokens with its default counter
(`count_tokens_approximately`, about 4 characters a token, the system prompt and tool
schemas included); keel's scorer counts every prompt with o200k_base afterwards.
Everything else is Deep Agents' default (large tool results over 20,000 tokens go to
its filesystem, the evicted history to `/conversation_history/...`).

Deep Agents' summarizer calls the same model. `ReplayChatModel` recognises those calls
(LangChain's `lc_source: summarization` run metadata, or its summary prompt's opening)
and answers with a short fixed placeholder, so Deep Agents' summaries carry no facts:
its recall is a lower bound. The summarizer's prompt and reply are logged, and the
scorer counts them as keel's summarizer calls are counted (prompt tokens uncached,
reply at the output price).

Every prompt the main model receives is written, as OpenAI-format messages, to
`<work>/<W>/<dataset>/<file>.jsonl`: one `{"kind": "prompt", "turn": k, "messages": [...]}`
line per recorded turn, `{"kind": "summary", "turn": k, "messages": [...], "summary":
"...", "summarized": n}` for each summarizer call (before turn k, over n messages), and a closing `{"kind": "end", ...}` with
what could not be replayed (an `error`, turns the agent never asked for, user messages
that came between a tool call and the next reply and so had no place to go).

Usage: python deepagents_replay.py <work-dir> <window> [<window> ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import defaultdict, deque
from pathlib import Path
from typing import Annotated, Any

from deepagents import create_deep_agent
from langchain.agents.middleware.summarization import DEFAULT_SUMMARY_PROMPT
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, convert_to_openai_messages
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import InjectedToolCallId, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

PLACEHOLDER_SUMMARY = "(placeholder summary written by the replay harness; the earlier conversation is in the offloaded history)"
SUMMARY_PROMPT_HEAD = DEFAULT_SUMMARY_PROMPT.strip().splitlines()[0:2]


def text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


class Recorder:
    """Where the model's calls go: the JSONL file and the replay position."""

    def __init__(self, path: Path, turns: list[AIMessage]) -> None:
        self.file = path.open("w", encoding="utf-8")
        self.turns = turns
        self.served = 0
        self.extra_calls = 0
        self.summaries = 0

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False))
        self.file.write("\n")

    def close(self) -> None:
        self.file.close()


def is_summary_request(messages: list[BaseMessage], run_manager: Any) -> bool:
    metadata = getattr(run_manager, "metadata", None) or {}
    if metadata.get("lc_source") == "summarization":
        return True
    if len(messages) == 1 and isinstance(messages[0], HumanMessage):
        head = text_of(messages[0].content).strip().splitlines()[0:2]
        return head == SUMMARY_PROMPT_HEAD
    return False


class ReplayChatModel(BaseChatModel):
    """Answers each agent call with the next recorded assistant message."""

    recorder: Any = None

    @property
    def _llm_type(self) -> str:
        return "keel-replay"

    def bind_tools(self, tools: Any, **kwargs: Any) -> ReplayChatModel:  # noqa: ARG002
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,  # noqa: ARG002
        run_manager: Any = None,
        **kwargs: Any,  # noqa: ARG002
    ) -> ChatResult:
        rec: Recorder = self.recorder
        if is_summary_request(messages, run_manager):
            rec.summaries += 1
            prompt = "".join(text_of(m.content) for m in messages)
            rec.write(
                {
                    "kind": "summary",
                    "turn": rec.served,
                    "messages": convert_to_openai_messages(messages),
                    "summary": PLACEHOLDER_SUMMARY,
                    # LangChain renders each message to summarize as `<message type=...>`.
                    "summarized": prompt.count('<message type="'),
                }
            )
            reply = AIMessage(content=PLACEHOLDER_SUMMARY)
        elif rec.served < len(rec.turns):
            rec.write({"kind": "prompt", "turn": rec.served, "messages": convert_to_openai_messages(messages)})
            reply = rec.turns[rec.served].model_copy(deep=True)
            rec.served += 1
        else:
            # The recording ended with tool calls: the agent asks once more; end its run.
            rec.extra_calls += 1
            reply = AIMessage(content="")
        return ChatResult(generations=[ChatGeneration(message=reply)])


def assistant_message(m: dict[str, Any]) -> AIMessage:
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", {})
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw)
        except json.JSONDecodeError:
            args = {"arguments": raw}
        if not isinstance(args, dict):
            args = {"arguments": args}
        calls.append({"name": fn.get("name", ""), "args": args, "id": c.get("id", "")})
    return AIMessage(content=text_of(m.get("content")), tool_calls=calls)


def stub_tool(name: str, results: dict[str, deque[str]]) -> StructuredTool:
    def replay(tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        queue = results.get(tool_call_id)
        if queue:
            return queue.popleft()
        return f"(no recorded result for {name} call {tool_call_id})"

    return StructuredTool.from_function(replay, name=name, description=f"Recorded tool `{name}`.")


def drive(run: dict[str, Any], window: int, out: Path) -> dict[str, Any]:
    messages: list[dict[str, Any]] = run["messages"]
    system = next((text_of(m.get("content")) for m in messages if m.get("role") == "system"), None)
    results: dict[str, deque[str]] = defaultdict(deque)
    names: list[str] = []
    turns: list[AIMessage] = []
    # Inputs: before the first assistant turn, and after each text-only reply.
    inputs: list[list[HumanMessage]] = [[]]
    desync = 0
    last_had_calls = False
    for m in messages:
        role = m.get("role")
        if role == "system":
            continue
        if role == "assistant":
            ai = assistant_message(m)
            turns.append(ai)
            for c in ai.tool_calls:
                if c["name"] not in names:
                    names.append(c["name"])
            last_had_calls = bool(ai.tool_calls)
            inputs.append([])
        elif role == "tool":
            results[m.get("tool_call_id") or ""].append(text_of(m.get("content")))
        elif last_had_calls and turns:
            # A user message between a tool call and the next reply: the agent calls
            # the model straight after its tools, so it has no place to go.
            desync += 1
        else:
            inputs[-1].append(HumanMessage(content=text_of(m.get("content"))))

    rec = Recorder(out, turns)
    model = ReplayChatModel(profile={"max_input_tokens": window}, recorder=rec)
    started = time.perf_counter()
    error = None
    try:
        agent = create_deep_agent(
            model=model,
            tools=[stub_tool(n, results) for n in names],
            system_prompt=system,
            checkpointer=InMemorySaver(),
        )
        config = {"configurable": {"thread_id": run["id"]}, "recursion_limit": 100_000}
        agent.invoke({"messages": inputs[0]}, config)
        while rec.served < len(turns):
            before = rec.served
            agent.invoke({"messages": inputs[rec.served]}, config)
            if rec.served == before:
                error = f"the agent made no model call at turn {before}"
                break
    except Exception as e:  # noqa: BLE001 — a failed run is reported, not fatal
        error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        print(f"{run['id']} at window {window}: {error}", file=sys.stderr)
        if os.environ.get("KEEL_PEER_DEBUG"):
            traceback.print_exc(file=sys.stderr)
    end = {
        "kind": "end",
        "turns": rec.served,
        "expected": len(turns),
        "summaries": rec.summaries,
        "extra_calls": rec.extra_calls,
        "desync": desync,
        "seconds": round(time.perf_counter() - started, 3),
        "error": error,
    }
    rec.write(end)
    rec.close()
    return end


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    work = Path(sys.argv[1])
    windows = [int(w) for w in sys.argv[2:]]
    manifest = json.loads((work / "input" / "manifest.json").read_text(encoding="utf-8"))
    for window in windows:
        started = time.perf_counter()
        failed = 0
        for entry in manifest:
            run = json.loads((work / "input" / entry["file"]).read_text(encoding="utf-8"))
            out = work / str(window) / f"{entry['file'].removesuffix('.json')}.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            end = drive(run, window, out)
            failed += end["error"] is not None
        print(
            json.dumps({"window": window, "runs": len(manifest), "failed": failed, "seconds": round(time.perf_counter() - started, 1)}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
