"""A sweep's results, read from its points' workdirs alone: ROOT/sweep.json, sweep.md and
sweep.png (`python -m albert_jax.sweep ... --table_only` rebuilds them after the fact).

Each point's workdir holds `sweep_point.json` (its overrides, status, error, wall time and
group, written by the sweep) beside what its run wrote: metrics.jsonl (pretraining and
fine-tuning), eval_results.json (fine-tuning) and checkpoints. A row is made of those files:
overrides, parameter count (the paper's convention: embeddings, projection, encoder, pooler),
steps, the final and the best value of each `eval_*` metric, examples/s (the median of the
logged intervals), wall time and status.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from albert_jax import files, metrics_writer

POINT_FILE = "sweep_point.json"
SWEEP_JSON = "sweep.json"
SWEEP_MD = "sweep.md"
SWEEP_PNG = "sweep.png"
RESULTS_FILE = "eval_results.json"  # = finetune.EVAL_RESULTS_FILE
MISSING = "—"
# The metrics a table shows first, where the points have them (all eval_* are in the JSON).
HEADLINE = (
    "eval_mlm_accuracy", "eval_sop_accuracy", "eval_nsp_accuracy", "eval_loss", "eval_accuracy",
    "eval_f1", "eval_exact_match", "eval_matthews_corrcoef", "eval_pearson",
)  # fmt: skip
_SKIPPED = ("majority", "sequences", "num_examples", "_label_", "chance", "total")
_LOWER_IS_BETTER = ("loss",)


def read_point(workdir: str) -> dict[str, Any] | None:
    """The point's `sweep_point.json`, or None where there is none."""
    path = files.as_path(workdir) / POINT_FILE
    return files.read_json(path) if path.exists() else None


def write_point(workdir: str, record: Mapping[str, Any]) -> None:
    files.as_path(workdir).mkdir(parents=True, exist_ok=True)
    files.write_json(files.as_path(workdir) / POINT_FILE, dict(record))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_shown(name: str) -> bool:
    return name.startswith("eval_") and not any(s in name for s in _SKIPPED)


def row(workdir: str, point: Mapping[str, Any], parameters: int | None) -> dict[str, Any]:
    """A point's row (see the module docstring) from its workdir."""
    records = metrics_writer.read_metrics(workdir)
    evals = [r for r in records if any(_is_shown(k) for k in r)]
    final: dict[str, float] = {}
    best: dict[str, float] = {}
    for record in evals:
        for name, value in record.items():
            if not (_is_shown(name) and _finite(value)):
                continue
            final[name] = value
            lower = any(s in name for s in _LOWER_IS_BETTER)
            if name not in best or (value < best[name] if lower else value > best[name]):
                best[name] = value
    results_path = files.as_path(workdir) / RESULTS_FILE
    if results_path.exists():  # fine-tuning: the evaluation of the finished run
        results = files.read_json(results_path)
        numbers = results.get("median", results)
        final.update({f"eval_{k}": v for k, v in numbers.items()
                      if _finite(v) and _is_shown(f"eval_{k}")})  # fmt: skip
    rates = [r["examples_per_sec"] for r in records if _finite(r.get("examples_per_sec"))]
    return {
        "name": point["name"],
        "workdir": workdir,
        "args": point.get("args", {}),
        "fields": point.get("fields", {}),
        "status": point.get("status", "not_run"),
        "error": point.get("error"),
        "group": point.get("group"),
        "parameters": parameters,
        "steps": int(records[-1]["step"]) if records else 0,
        "final": final,
        "best": best,
        "examples_per_sec": statistics.median(rates) if rates else None,
        "wall_seconds": point.get("wall_seconds"),
        "curves": {
            name: [[int(r["step"]), r[name]] for r in evals if _finite(r.get(name))]
            for name in sorted(final)
            if name in best
        },  # fmt: skip
    }


def headline(rows: Sequence[Mapping[str, Any]], limit: int = 4) -> list[str]:
    """The metrics the table and the figure show: `HEADLINE` ones some point has, else any."""
    present = {k for r in rows for k in r["final"]}
    chosen = [m for m in HEADLINE if m in present]
    return (chosen or sorted(present))[:limit]


def make_table(
    config: str, rows: Sequence[Mapping[str, Any]], groups: Mapping[str, Any]
) -> dict[str, Any]:
    """ROOT/sweep.json: the command's base config, the rows, the groups, what failed."""
    return {
        "config": config,
        "points": list(rows),
        "groups": dict(groups),
        "metrics": headline(rows),
        "failed": [r["name"] for r in rows if r["status"] == "failed"],
        "not_finished": [r["name"] for r in rows if r["status"] not in ("ok", "failed")],
    }


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return MISSING
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def render_markdown(table: Mapping[str, Any]) -> str:
    """One row per point: overrides, status, parameters, steps, each headline metric as
    `final (best)`, examples/s, wall time; then the failures and the groups."""
    metrics = table["metrics"]
    header = ["point", "status", "params", "steps", *metrics, "examples/s", "wall"]
    lines = [
        f"Sweep of `{table['config']}` ({len(table['points'])} points); metrics: final (best).",
        "",
        "| " + " | ".join(header) + " |",
        "|---|---|" + "---:|" * (len(header) - 2),
    ]
    for r in table["points"]:
        params = MISSING if r["parameters"] is None else f"{r['parameters'] / 1e6:.2f}M"
        cells = [f"`{r['name']}`", r["status"], params, str(r["steps"])]
        for m in metrics:
            final, best = r["final"].get(m), r["best"].get(m)
            cell = _fmt(final)
            if best is not None and final is not None and best != final:
                cell += f" ({_fmt(best)})"
            cells.append(cell)
        cells.append(_fmt(r["examples_per_sec"], 3))
        wall = r["wall_seconds"]
        cells.append(MISSING if wall is None else metrics_writer.format_duration(wall))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for r in table["points"]:
        if r["status"] == "failed":
            lines.append(f"- `{r['name']}` failed: {' '.join(str(r['error']).split())}")
    for name, group in table["groups"].items():
        members = ", ".join(f"`{m}`" for m in group["points"])
        lines.append(f"- one program (`{name}`): {members}; wall time is the group's")
    if table["not_finished"]:
        lines.append(f"- not finished: {', '.join(table['not_finished'])} (run the command again)")
    return "\n".join(lines).rstrip() + "\n"


def plot(table: Mapping[str, Any], path: str) -> str | None:
    """ROOT/sweep.png: each headline metric's eval curve of every point, on shared axes
    (one panel a metric). None when no point has an eval curve."""
    metrics = [m for m in table["metrics"] if any(r["curves"].get(m) for r in table["points"])]
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for r in table["points"]:
            curve = r["curves"].get(metric)
            if curve:
                ax.plot([s for s, _ in curve], [v for _, v in curve], marker=".", label=r["name"])
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    metrics_writer.write_figure(fig, path)
    plt.close(fig)
    return path


def write(table: Mapping[str, Any], root: str) -> None:
    """ROOT/sweep.json, sweep.md and sweep.png (each replaced whole)."""
    root_path = files.as_path(root)
    files.write_json(root_path / SWEEP_JSON, table)
    files.write_atomic(root_path / SWEEP_MD, render_markdown(table))
    plot(table, str(root_path / SWEEP_PNG))
