"""Where a profiled step's time goes: the op totals of a `jax.profiler` trace, per step.

`python benchmarks/trace_summary.py DIR --steps=3` reads the newest `*.trace.json.gz` under DIR,
local or gs:// (what `jax.profiler.trace(DIR)` writes; `benchmarks/train_step.py --profile=DIR`
makes one of `--profile_steps` steps of ours) and prints one JSON object: for each timeline
(process / thread, e.g. XLA:CPU's worker threads or a GPU stream; threads of one pool are one
timeline, their times summed) its busy milliseconds per step, and for the busiest ones their top
ops, with trailing instance numbers merged (`fusion.12` and `fusion.7` are both `fusion`), so a
kind of op reads as one line. Spans that only wrap others (the executor's, Python's `$file:line`
frames) are left out so nothing is counted twice.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from albert_jax import files  # noqa: E402

# Spans that contain the ops rather than being ops: counting them would count the ops twice.
_WRAPPERS = re.compile(r"^(\$|ThunkExecutor|PjitFunction|Slinky|Wait:|TfrtCpu|PjRt)")
_INSTANCE = re.compile(r"[/.\-\d_]+$")


def newest_trace(directory: str) -> str:
    """The newest trace `jax.profiler.trace(directory)` wrote (DIR/plugins/profile/RUN/
    HOST.trace.json.gz), local or gs://."""
    paths = files.glob(f"{directory.rstrip('/')}/plugins/profile/*/*.trace.json.gz")
    if not paths:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {directory}")
    return str(max(paths, key=lambda p: files.stat(p)[1]))


def summarize(path: str, steps: int, timelines: int = 4, ops: int = 12) -> dict[str, Any]:
    """{"timelines": [{"name", "threads", "busy_ms_per_step", "events_per_step", "top_ops": [{"op",
    "ms_per_step", "count_per_step"}]}]}, busiest first; ops only for the first `timelines`."""
    with files.open_binary(path) as f:  # gunzipped
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    per_line: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    members: dict[str, set] = collections.defaultdict(set)
    for e in events:
        if e.get("ph") != "X" or _WRAPPERS.match(e["name"]):
            continue
        thread = _INSTANCE.sub("", threads.get((e["pid"], e.get("tid")), str(e.get("tid"))))
        line = f"{processes.get(e['pid'], e['pid'])} / {thread}"
        members[line].add((e["pid"], e.get("tid")))
        op = _INSTANCE.sub("", e["name"])
        per_line[line][op] += e.get("dur", 0)
        counts[line][op] += 1
    rows = sorted(per_line.items(), key=lambda kv: -sum(kv[1].values()))
    out = []
    for i, (line, totals) in enumerate(rows):
        row: dict[str, Any] = {
            "name": line,
            "threads": len(members[line]),
            "busy_ms_per_step": round(sum(totals.values()) / 1e3 / steps, 2),
            "events_per_step": round(sum(counts[line].values()) / steps, 1),
        }
        if i < timelines:
            row["top_ops"] = [
                {"op": op, "ms_per_step": round(us / 1e3 / steps, 2),
                 "count_per_step": round(counts[line][op] / steps, 1)}
                for op, us in totals.most_common(ops)
            ]  # fmt: skip
        out.append(row)
    return {"trace": path, "steps": steps, "timelines": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="what jax.profiler.trace wrote to")
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds")
    parser.add_argument("--timelines", type=int, default=4, help="timelines with their top ops")
    parser.add_argument("--ops", type=int, default=12, help="top ops per timeline")
    args = parser.parse_args()
    summary = summarize(newest_trace(args.directory), args.steps, args.timelines, args.ops)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
