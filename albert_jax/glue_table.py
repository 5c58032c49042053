"""The GLUE table: one init fine-tuned on a list of tasks, one row in the paper's layout.

    python -m albert_jax.glue_table --init=PATH --tasks=glue --workdir=DIR [--num_seeds=5]

Task T runs `finetune.finetune_and_evaluate` in DIR/T with `configs/finetune.py:task=T,init=PATH`
(the paper's presets), the `--config.X=V` overrides (every task) and, for local tasks, the files
under `--local_data` (`LOCAL_FILES`). A task whose DIR/T holds eval_results.json is read, not
re-run. A failed task is recorded (error in the JSON, "—" in the table), the sweep goes on, and
the command exits non-zero at the end. DIR/glue_table.md: each task's headline metric in % (the
median for N > 1 seeds) and the average, then notes (other official metrics, per-seed values,
failures); DIR/glue_table.json: the same with raw values, metric keys, per-seed values, failed
seeds, errors and workdirs. Columns follow the paper's GLUE dev table (Lan et al. 2020, Table
9: MNLI, QNLI, QQP, RTE, SST, MRPC, CoLA, STS: MNLI matched accuracy, QQP / MRPC accuracy, CoLA
Matthews correlation, STS-B Pearson), then SQuAD / RACE, then the local tasks as given. WNLI
has no column: the paper's dev rows leave it out, and configs/finetune.py has no WNLI preset.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags, logging

from albert_jax import files
from albert_jax.runtime import cli, process_setup
from configs import finetune as finetune_configs

RESULTS_FILE = "eval_results.json"  # = finetune.EVAL_RESULTS_FILE (not imported: jax-free)
TABLE_MD = "glue_table.md"
TABLE_JSON = "glue_table.json"
MISSING = "—"


@dataclasses.dataclass(frozen=True)
class Headline:
    """A task's column: `metric` read from eval_results.json (from eval set `eval_set` when
    the run has several), shown ×`scale` (GLUE metrics are fractions, SQuAD's percentages)."""

    column: str
    metric: str
    eval_set: str = ""
    scale: float = 100.0

    @property
    def key(self) -> str:  # its name in eval_results.json of a run with several eval sets
        return f"{self.eval_set}/{self.metric}" if self.eval_set else self.metric


# The paper's GLUE dev columns, in its order.
GLUE_ORDER = ("mnli", "qnli", "qqp", "rte", "sst2", "mrpc", "cola", "stsb")
HEADLINES: dict[str, Headline] = {
    "mnli": Headline("MNLI", "accuracy", "validation_matched"),
    "qnli": Headline("QNLI", "accuracy"),
    "qqp": Headline("QQP", "accuracy"),
    "rte": Headline("RTE", "accuracy"),
    "sst2": Headline("SST", "accuracy"),
    "mrpc": Headline("MRPC", "accuracy"),
    "cola": Headline("CoLA", "matthews_corrcoef"),
    "stsb": Headline("STS", "pearson"),
    "squad_v1": Headline("SQuAD1.1", "f1", scale=1.0),
    "squad_v2": Headline("SQuAD2.0", "f1", scale=1.0),
    "race": Headline("RACE", "accuracy"),
    "sentiment_rt": Headline("sentiment_rt", "accuracy"),
    "sentiment_rt_score": Headline("sentiment_rt_score", "pearson"),
    "nli_vitaminc": Headline("nli_vitaminc", "accuracy"),
    "mc_cosmosqa": Headline("mc_cosmosqa", "accuracy"),
    "squad_shifts": Headline("squad_shifts", "f1", scale=1.0),
}
# The other official metrics, in the notes under the table (and in the JSON).
SECONDARY: dict[str, tuple[Headline, ...]] = {
    "mnli": (Headline("MNLI-mm", "accuracy", "validation_mismatched"),),
    "qqp": (Headline("QQP F1", "f1"),),
    "mrpc": (Headline("MRPC F1", "f1"),),
    "stsb": (Headline("STS Spearman", "spearman"),),
    "sentiment_rt_score": (Headline("sentiment_rt_score Spearman", "spearman"),),
    "squad_v1": (Headline("SQuAD1.1 EM", "exact_match", scale=1.0),),
    "squad_v2": (Headline("SQuAD2.0 EM", "exact_match", scale=1.0),),
    "squad_shifts": (Headline("squad_shifts EM", "exact_match", scale=1.0),),
}
# Local tasks' (train, eval) files under --local_data: the layout of shared/data/tasks.
# sentiment_rt_score reads sentiment_rt's files (their `score` field); SQuAD-Shifts has four
# domains and no train/dev split: train on new_wiki, evaluate on nyt (as the tests do).
LOCAL_FILES: dict[str, tuple[str, str]] = {
    "sentiment_rt": ("sentiment_rt/train.jsonl.gz", "sentiment_rt/dev.jsonl.gz"),
    "sentiment_rt_score": ("sentiment_rt/train.jsonl.gz", "sentiment_rt/dev.jsonl.gz"),
    "nli_vitaminc": ("nli_vitaminc/train.jsonl.gz", "nli_vitaminc/dev.jsonl.gz"),
    "mc_cosmosqa": ("mc_cosmosqa/train.jsonl.gz", "mc_cosmosqa/dev.jsonl.gz"),
    "squad_shifts": ("squad_shifts/new_wiki_v1.0.json.gz", "squad_shifts/nyt_v1.0.json.gz"),
}


# ----------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class TaskScore:
    """A task's headline from eval_results.json: `value` as stored (the median over seeds for
    N > 1; None when no seed has a finite one), `metric` the key it was read under."""

    metric: str
    value: float | None
    num_seeds: int = 1
    per_seed: dict[str, float | None] | None = None  # {"<seed>": value}, N > 1 only
    failed_seeds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    secondary: dict[str, float | None] = dataclasses.field(default_factory=dict)  # ×scale


def _number(value: Any) -> float | None:
    """A finite float, else None (NaN / inf / missing / not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _metric_key(keys: Sequence[str], headline: Headline) -> str:
    """The key `headline` is stored under: "<set>/<metric>" with several eval sets (MNLI's
    matched / mismatched), "<metric>" with one."""
    candidates = list(dict.fromkeys([headline.key, headline.metric]))
    for key in candidates:
        if key in keys:
            return key
    raise ValueError(
        f"eval results have no {' or '.join(map(repr, candidates))}; metrics: {sorted(keys)}"
    )


def read_score(results: Mapping[str, Any], task: str) -> TaskScore:
    """The headline (and secondary metrics) of `task` from its eval_results.json content, in
    either format: one seed (metrics as top-level keys) or N > 1 seeds (`per_seed`, `median`,
    ..., `failed_seeds`; the headline is the median). ValueError: no headline metric there."""
    headline = HEADLINES[task]
    num_seeds = int(results.get("num_seeds", 1) or 1)
    if num_seeds > 1:
        metrics = dict(results.get("median", {}))
        per_seed_results = results.get("per_seed", {})
        # A metric no seed has a finite value of is absent from the median: look it up in the
        # seeds' own results too, so that the failure says "no finite value", not "no key".
        keys = {*metrics, *(k for r in per_seed_results.values() for k in r)}
    else:
        metrics, per_seed_results, keys = results, {}, set(results)
    key = _metric_key(sorted(keys), headline)
    score = TaskScore(metric=key, value=_number(metrics.get(key)), num_seeds=num_seeds)
    if num_seeds > 1:
        score.per_seed = {s: _number(r.get(key)) for s, r in per_seed_results.items()}
        score.failed_seeds = list(results.get("failed_seeds", []))
    for extra in SECONDARY.get(task, ()):
        try:
            value = _number(metrics.get(_metric_key(sorted(keys), extra)))
        except ValueError:  # e.g. MNLI evaluated on one split only
            continue
        score.secondary[extra.column] = None if value is None else value * extra.scale
    return score


# ----------------------------------------------------------------------------------- configs
def expand_tasks(spec: str) -> list[str]:
    """Comma-separated task names; `glue` stands for the paper's eight GLUE tasks.

    Raises:
      ValueError: an unknown or repeated task.
    """
    tasks: list[str] = []
    for name in (t.strip() for t in spec.split(",")):
        for task in GLUE_ORDER if name == "glue" else (name,) if name else ():
            if task not in HEADLINES:
                known = ", ".join(["glue", *HEADLINES])
                raise ValueError(f"--tasks: unknown task {task!r}; known: {known}")
            if task in tasks:
                raise ValueError(f"--tasks: {task!r} is named twice")
            tasks.append(task)
    if not tasks:
        raise ValueError("--tasks: no task given")
    return tasks


def table_order(tasks: Sequence[str]) -> list[str]:
    """The paper's GLUE columns first (its order), then the other tasks as given."""
    return [t for t in GLUE_ORDER if t in tasks] + [t for t in tasks if t not in GLUE_ORDER]


def set_num_seeds(config: Any, num_seeds: int) -> None:
    """Sets `config.num_seeds` for N > 1 only, so that one-seed sweeps run on configs without
    the field. Raises ValueError when N > 1 is asked and the config has no such field."""
    if num_seeds < 1:
        raise ValueError(f"--num_seeds={num_seeds}: must be at least 1")
    if num_seeds > 1 and "num_seeds" not in config:
        raise ValueError(
            f"--num_seeds={num_seeds} needs the fine-tuning config field config.num_seeds "
            "(configs/finetune.py), which this version does not have; use --num_seeds=1"
        )
    if num_seeds > 1:
        config.num_seeds = num_seeds


def task_config(
    task: str,
    init: str,
    overrides: Sequence[str] = (),
    *,
    num_seeds: int = 1,
    local_data: str | None = None,
) -> Any:
    """`configs/finetune.py:task=TASK,init=INIT` with the local task's files under
    `local_data`, `num_seeds` and the `--config.X=V` overrides (main.py's syntax, parsed by
    ml_collections against this task's config, so the types and field names are checked).

    Raises:
      ValueError: an unknown field or a bad value in an override, or num_seeds (above).
    """
    config = finetune_configs.get_config(f"task={task},init={init}")
    if local_data and task in LOCAL_FILES:
        root = files.as_path(local_data)
        train, dev = LOCAL_FILES[task]
        config.data.train_files, config.data.eval_files = str(root / train), str(root / dev)
    set_num_seeds(config, num_seeds)
    return cli.override_config(config, overrides, where=f"task {task}: ")


# ------------------------------------------------------------------------------------ running
def run_table(init: str, tasks: Sequence[str], workdir: str, overrides: Sequence[str] = (), *,
              num_seeds: int = 1, local_data: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Fine-tunes `init` on each task in WORKDIR/<task>, writes WORKDIR/glue_table.{md,json}
    (process 0) after every task and returns the table (the JSON's content).

    A sweep (`albert_jax.sweep.runner`) with the task as the swept config arg, its points named by
    the task: every config is built before anything runs (a bad override or task fails at
    once); a finished task is read, not re-run; a task whose directory holds a run of another
    config (another init, other overrides) is refused before anything runs, naming both; a
    failed task is recorded and the others go on; a preemption stops the sweep, and the same
    command resumes it.
    """
    from albert_jax.sweep import runner as sweep
    from albert_jax.sweep import table as sweep_table
    from albert_jax.sweep.grid import Point

    configs = [task_config(t, init, overrides, num_seeds=num_seeds, local_data=local_data)
               for t in tasks]  # fmt: skip
    points = [Point(t, (("task", t), ("init", init))) for t in tasks]
    run = sweep.Sweep(files.run_directory(workdir), points, configs,
                      describe=f"configs/finetune.py:init={init}", group="none")  # fmt: skip
    reused = {p.name for p in points
              if (sweep_table.read_point(run.workdir(p)) or {}).get("status") == "ok"}  # fmt: skip

    def table() -> dict[str, Any]:
        entries = {
            t: task_entry(t, run.workdir(p), t in reused)
            for t, p in zip(tasks, points, strict=True)
        }
        made = make_table(init, tasks, entries, num_seeds)
        if sweep.is_first_process():  # after each task: a sweep killed midway keeps its rows
            write_table(made, workdir)
        return made

    run.after_point = table
    sweep.run_sweep(run)
    return table()


def task_entry(task: str, workdir: str, reused: bool) -> dict[str, Any]:
    """A task's entry of the table, from its workdir: the score of its eval_results.json
    (`read_score`), or its status and error as the sweep recorded them."""
    from albert_jax.sweep import table as sweep_table

    entry: dict[str, Any] = {"task": task, "column": HEADLINES[task].column, "workdir": workdir}
    point = sweep_table.read_point(workdir) or {}
    status = point.get("status", "not_run")
    if status == "failed":
        return {**entry, "status": "failed", "error": point.get("error")}
    if status != "ok":
        return {**entry, "status": "preempted" if status == "preempted" else "not_run"}
    try:
        score = read_score(files.read_json(files.as_path(workdir) / RESULTS_FILE), task)
    except (ValueError, OSError) as e:
        return {**entry, "status": "failed", "error": f"{type(e).__name__}: {cli.one_line(e)}"}
    shown = None if score.value is None else score.value * HEADLINES[task].scale
    entry.update(status="ok", reused=reused, metric=score.metric, value=score.value,
                 score=shown, num_seeds=score.num_seeds, secondary=score.secondary)  # fmt: skip
    if score.per_seed is not None:
        entry.update(per_seed=score.per_seed, failed_seeds=score.failed_seeds)
    return entry


# ---------------------------------------------------------------------------------- the table
def row_label(init: str) -> str:
    """The init's directory name (with its parent when it is a step number)."""
    if not init:
        return "from scratch"  # init="" fine-tunes a randomly initialized `config.size` model
    path = files.as_path(init)
    return f"{path.parent.name}/{path.name}" if path.name.isdigit() else path.name


def make_table(
    init: str, tasks: Sequence[str], entries: Mapping[str, dict[str, Any]], num_seeds: int
) -> dict[str, Any]:
    """The JSON table: columns in the paper's order, each task's entry, the average of the
    headline scores (None unless every task has a finite one)."""
    order = table_order(tasks)
    scores = [entries[t].get("score") for t in order]
    complete = all(s is not None for s in scores)
    return {
        "init": init,
        "row": row_label(init),
        "num_seeds": num_seeds,
        "columns": [{"task": t, "column": HEADLINES[t].column} for t in order],
        "results": {t: entries[t] for t in order},
        "average": sum(scores) / len(scores) if complete else None,
        "average_over": order,
        "failed": [t for t in order if entries[t]["status"] == "failed"],
        "not_run": [t for t in order if entries[t]["status"] in ("preempted", "not_run")],
    }


def _fmt(value: float | None) -> str:
    return MISSING if value is None else f"{value:.1f}"


def render_markdown(table: Mapping[str, Any]) -> str:
    """The row in the paper's layout, then notes: the metrics, secondary metrics, per-seed
    values, failed seeds and failed tasks."""
    results = table["results"]
    order = [c["task"] for c in table["columns"]]
    seeds = f" (median of {table['num_seeds']} seeds)" if table["num_seeds"] > 1 else ""
    header = ["Model", *(HEADLINES[t].column for t in order), "Avg"]
    cells = [f"{table['row']}{seeds}", *(_fmt(results[t].get("score")) for t in order)]
    cells.append(_fmt(table["average"]))
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" + "---:|" * (len(header) - 1),
        "| " + " | ".join(cells) + " |",
        "",
        f"Dev-set scores in % of `{table['init']}`; "
        + "; ".join(f"{HEADLINES[t].column}: {HEADLINES[t].key}" for t in order)
        + ". Avg: mean of the columns.",
    ]
    if any(t in GLUE_ORDER for t in order):
        lines.append("WNLI is left out, as in the paper's dev-set rows.")
    secondary = [
        f"{k} {_fmt(v)}" for t in order for k, v in results[t].get("secondary", {}).items()
    ]
    if secondary:
        lines.append("Other official metrics: " + ", ".join(secondary) + ".")
    for t in order:
        entry, scale = results[t], HEADLINES[t].scale
        if entry.get("per_seed"):
            values = ", ".join(
                f"{s}: {_fmt(None if v is None else v * scale)}"
                for s, v in entry["per_seed"].items()
            )
            lines.append(f"{HEADLINES[t].column} per seed: {values}.")
        for failed in entry.get("failed_seeds", []):
            lines.append(f"{HEADLINES[t].column} seed {failed['seed']} failed: {failed['reason']}.")
        if entry["status"] == "failed":
            lines.append(f"{HEADLINES[t].column} failed: {' '.join(entry['error'].split())}")
        elif entry["status"] != "ok":
            lines.append(f"{HEADLINES[t].column}: {entry['status']} (run the command again).")
    return "\n".join(lines) + "\n"


def write_table(table: Mapping[str, Any], workdir: str) -> None:
    """Writes WORKDIR/glue_table.md and .json (each atomically)."""
    files.write_atomic(files.as_path(workdir) / TABLE_MD, render_markdown(table))
    files.write_json(files.as_path(workdir) / TABLE_JSON, table)


# --------------------------------------------------------------------------------------- CLI
def _define_flags() -> None:
    """Flags are defined only when run as a program, so importing this module adds none (and
    the package's other CLIs can be imported beside it)."""
    flags.DEFINE_string("init", None, "Checkpoint to fine-tune (anything load_pretrained reads).")
    flags.DEFINE_string("tasks", "glue", "Comma-separated tasks; `glue` = the paper's eight.")
    flags.DEFINE_string("workdir", None, "Sweep directory: one subdirectory per task, the table.")
    flags.DEFINE_integer("num_seeds", 1, "Seeds per task (config.num_seeds); the table: medians.")
    flags.DEFINE_string(
        "local_data", None, "Root of the local tasks' files (LOCAL_FILES), e.g. shared/data/tasks."
    )
    flags.mark_flags_as_required(["init", "workdir"])


CONFIG_PREFIX = "--config."
_overrides: list[str] = []  # the --config.X=V arguments, taken out before absl parses


def parse_flags(argv: list[str]) -> list[str]:
    """absl parsing of the other flags; `--config.X=V` overrides are kept for each task's
    config (they apply to every task)."""
    _overrides[:] = [a for a in argv[1:] if a.startswith(CONFIG_PREFIX)]
    bad = [a for a in _overrides if "=" not in a]
    if bad:
        raise ValueError(f"write overrides as --config.FIELD=VALUE, got {bad}")
    return cli.parse_flags([a for a in argv if not a.startswith(CONFIG_PREFIX)])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    FLAGS = flags.FLAGS
    tasks = expand_tasks(FLAGS.tasks)
    process_setup.initialize_distributed()  # several processes: each runs the same sweep
    table = run_table(FLAGS.init, tasks, FLAGS.workdir, _overrides,
                      num_seeds=FLAGS.num_seeds, local_data=FLAGS.local_data)  # fmt: skip
    logging.info("table: %s", files.as_path(FLAGS.workdir) / TABLE_MD)
    print(render_markdown(table), flush=True)
    if table["not_run"]:
        logging.warning("stopped by preemption; run the same command again to finish")
    if table["failed"]:
        logging.error("failed tasks: %s (see %s)", table["failed"], TABLE_JSON)
        sys.exit(1)


def run() -> None:
    process_setup.keep_freed_host_memory()  # a CPU-only host; before JAX starts its backend
    _define_flags()
    cli.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
