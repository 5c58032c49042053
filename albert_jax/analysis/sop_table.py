"""The paper's Table 5 as a cross-evaluation: models pretrained with none / NSP / SOP, each
evaluated on both sentence-level tasks (NSP and SOP) and on MLM.

    python -m albert_jax.analysis.sop_table --workdirs=DIR_NONE,DIR_NSP,DIR_SOP --output=DIR
    python -m albert_jax.analysis.sop_table --config=configs/table5.py --workdir=DIR

The first form evaluates finished runs; the second is the sweep: it pretrains the config once
per objective of `OBJECTIVE_ROWS` in DIR/<objective> (a finished run is not re-run, a stopped
one resumes; the runs after the first take its tokenizer, so all three read the same tokens),
then evaluates them into DIR.

The evaluation data of task T is the held-out split of the runs' data (`config.data.eval_split`)
built with `objective=T` and the evaluation seed of the runs, so the SOP column of the SOP run is
its own training-time evaluation. The runs must agree on everything else that shapes those
batches (the data config and the tokenizer): the rows then see the same held-out text. The
SOP / NSP head's 2-way output is read as the task's label (0 in order / next, 1 swapped /
random); the MLM-only run's head was never trained and is measured all the same (the paper's
"None" row: about chance). Each cell also splits the accuracy by label and by kind of pair
(`pretrain.heldout.eval_metrics`: `eval_sop_accuracy_<split>`). Single process; the model runs
unsharded on the default device (tiny and base models).

Writes DIR/sop_table.json (every metric of every cell, the runs' steps and workdirs) and
DIR/sop_table.md (the 3x2 table + MLM accuracy, then the per-kind accuracies).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags, logging

from albert_jax import files
from albert_jax.run_config import RUN_CONFIG_FILE
from albert_jax.runtime import cli

TASKS = ("nsp", "sop")  # the evaluation columns, as objectives of the data pipeline
OBJECTIVE_ROWS = ("none", "nsp", "sop")  # what the sweep trains, in the paper's row order
TABLE_JSON = "sop_table.json"
TABLE_MD = "sop_table.md"
# The kinds of pair each task's data holds (instances.PAIR_KINDS names), in table order.
TASK_KINDS = {
    "nsp": ("in_order", "random_document"),
    "sop": ("in_order", "swapped", "split_in_order", "split_swapped", "random_document"),
}


# ---------------------------------------------------------------------------------- reading
def read_run(workdir: str) -> tuple[Any, Any]:
    """(the run's config as a ConfigDict, `load_pretrained(workdir)`: its latest checkpoint).

    Raises:
      ValueError: `workdir` has no config.json (not a pretraining workdir) or no checkpoint.
    """
    import ml_collections

    from albert_jax.pretrained import load_pretrained

    path = files.as_path(workdir) / RUN_CONFIG_FILE
    if not path.exists():
        raise ValueError(f"--workdirs: {workdir} has no {RUN_CONFIG_FILE}: not a training run")
    config = ml_collections.ConfigDict(files.read_json(path))
    if "task" in config:
        raise ValueError(f"--workdirs: {workdir} is a fine-tuning run, not a pretraining run")
    return config, load_pretrained(workdir)


def data_config_for(config: Any, task: str) -> Any:
    """The run's `DataConfig` with `objective=task`, built in this process (no workers)."""
    from albert_jax.data.data_config import DataConfig

    return DataConfig.from_config(config, objective=task, num_workers=0)


def check_comparable(runs: Sequence[tuple[str, Any, Any]]) -> None:
    """The runs must build the same evaluation batches for a task: the same data config
    (objective aside) and the same tokenizer.

    Raises:
      ValueError: naming the first differing field (or the tokenizer) and both workdirs.
    """

    def batch_fields(config: Any) -> dict[str, Any]:
        data = data_config_for(config, "sop")
        return {"sources": data.sources, "data_dir": data.data_dir, **data.semantic(),
                "eval_split": config.data.eval_split}  # fmt: skip

    first_dir, first_config, first = runs[0]
    reference = batch_fields(first_config)
    for workdir, config, loaded in runs[1:]:
        other = batch_fields(config)
        for field, value in other.items():
            if value != reference[field]:
                raise ValueError(
                    f"--workdirs: {workdir} and {first_dir} differ in data field {field!r} "
                    f"({value!r} vs {reference[field]!r}): their evaluation data would differ"
                )
        if loaded.tokenizer is None or first.tokenizer is None:
            raise ValueError(f"--workdirs: {workdir} or {first_dir} has no tokenizer.model")
        if loaded.tokenizer.fingerprint != first.tokenizer.fingerprint:
            raise ValueError(
                f"--workdirs: {workdir} and {first_dir} have different tokenizers; train them "
                "with the same one (--config.data.tokenizer=PATH)"
            )


# ------------------------------------------------------------------------------- evaluating
def held_out_batches(config: Any, tokenizer: Any, task: str, num_batches: int) -> list[dict]:
    """The run's held-out batches of `task` ("nsp" | "sop"): `num_batches` batches of the
    run's shapes, `example_weight` and `pair_kind` included."""
    from albert_jax.data import pipeline

    data = data_config_for(config, task)
    return list(
        pipeline.make_eval_iterator(
            data, tokenizer, split=config.data.eval_split, num_batches=num_batches
        )
    )


def cross_evaluate(workdirs: Sequence[str], *, eval_batches: int = 0) -> dict[str, Any]:
    """Every run of `workdirs` on every task of `TASKS`. `eval_batches` 0: the first run's
    `config.eval_batches`. Returns the table (see `render_markdown`)."""
    import jax

    from albert_jax.pretrain.heldout import evaluate_batches, make_eval_step

    if not workdirs:
        raise ValueError("--workdirs: no run given")
    runs = [(w, *read_run(w)) for w in workdirs]
    check_comparable(runs)
    _, first_config, first = runs[0]
    num_batches = eval_batches or int(first_config.eval_batches)
    # The same batches for every run (`check_comparable`: they would build the same).
    batches = {
        task: held_out_batches(first_config, first.tokenizer, task, num_batches) for task in TASKS
    }
    steps: dict[Any, Any] = {}  # one compiled eval step per architecture
    rows = []
    for workdir, config, loaded in runs:
        if loaded.config not in steps:
            eval_sums = make_eval_step(loaded.model, sentence_order=True)
            steps[loaded.config] = jax.jit(eval_sums)
        cells = {}
        for task in TASKS:
            logging.info("evaluating %s (trained with %s) on %s", workdir, config.objective, task)
            cells[task] = evaluate_batches(steps[loaded.config], loaded.params, batches[task])
        rows.append({"trained": config.objective, "workdir": workdir, "step": loaded.step, **cells})
    sequences = int(sum(len(b["input_ids"]) for b in batches[TASKS[0]]))
    return {"tasks": list(TASKS), "eval_batches": num_batches, "sequences": sequences,
            "rows": rows}  # fmt: skip


# --------------------------------------------------------------------------------- the table
def _pct(metrics: Mapping[str, float], key: str) -> str:
    value = metrics.get(key)
    return "—" if value is None else f"{100 * value:.1f}"


def render_markdown(table: Mapping[str, Any]) -> str:
    """The 3x2 table (rows: trained with; columns: MLM accuracy on the SOP data, NSP and SOP
    accuracy), then the accuracy of each task's kinds of pair; values in %."""
    lines = [
        f"Held-out: {table['eval_batches']} batches ({table['sequences']} sequences) per task.",
        "",
        "| trained with | steps | MLM acc | NSP acc | SOP acc |",
        "|---|---|---|---|---|",
    ]
    for row in table["rows"]:
        cells = [_pct(row["sop"], "eval_mlm_accuracy")]
        cells += [_pct(row[t], "eval_sop_accuracy") for t in TASKS]
        lines.append(f"| {row['trained']} | {row['step']} | " + " | ".join(cells) + " |")
    columns = [(t, k) for t in TASKS for k in TASK_KINDS[t]]
    present = [
        (t, k) for t, k in columns if any(f"eval_sop_accuracy_{k}" in r[t] for r in table["rows"])
    ]
    lines += [
        "",
        "By kind of pair (accuracy %; label 1 = swapped / random document, label 0 otherwise):",
        "",
        "| trained with | " + " | ".join(f"{t.upper()} {k}" for t, k in present) + " |",
        "|---|" + "---|" * len(present),
    ]
    for row in table["rows"]:
        cells = [_pct(row[t], f"eval_sop_accuracy_{k}") for t, k in present]
        lines.append(f"| {row['trained']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(table: Mapping[str, Any], output: str) -> None:
    """DIR/sop_table.json and DIR/sop_table.md."""
    root = files.as_path(output)
    root.mkdir(parents=True, exist_ok=True)
    files.write_json(root / TABLE_JSON, table)
    files.write_atomic(root / TABLE_MD, render_markdown(table))


# -------------------------------------------------------------------------------- the sweep
def run_sweep(config: Any, workdir: str) -> list[str]:
    """Pretrains `config` once per objective of `OBJECTIVE_ROWS` in WORKDIR/<objective>: a
    sweep (`albert_jax.sweep.runner`) of the objective, so finished runs are read, a stopped one
    resumes, and all three read one tokenizer (trained once unless `config.data.tokenizer`
    names one). Returns the run workdirs, or [] when a preemption notice stopped a run (the
    same command resumes it).

    Raises:
      ValueError: a run failed (its error; the other runs were still trained).
    """
    from albert_jax.sweep import runner as sweep
    from albert_jax.sweep.grid import Point

    points = [Point(objective, fields=(("objective", objective),)) for objective in OBJECTIVE_ROWS]
    configs = []
    for objective in OBJECTIVE_ROWS:
        configs.append(copy.deepcopy(config))
        configs[-1].objective = objective
    root = files.run_directory(workdir)
    sweep.share_tokenizers(configs, root)
    run = sweep.Sweep(root, points, configs, describe="Table 5: objective none / nsp / sop",
                      group="none")  # fmt: skip
    table = sweep.run_sweep(run)
    if table["failed"]:
        errors = "; ".join(f"{r['name']}: {r['error']}" for r in table["points"] if r["error"])
        raise ValueError(f"pretraining failed ({errors}); run the same command again")
    if table["not_finished"]:
        return []
    return [run.workdir(point) for point in points]


# --------------------------------------------------------------------------------------- CLI
def _define_flags() -> None:
    """Defined only when run as a program, so importing this module adds no flag."""
    from ml_collections import config_flags

    flags.DEFINE_list("workdirs", None, "Finished pretraining runs to evaluate (comma-separated).")
    flags.DEFINE_string("output", None, "Where sop_table.json / .md go (with --workdirs).")
    config_flags.DEFINE_config_file(
        "config", None, "The sweep's pretraining config (e.g. configs/table5.py).", lock_config=True
    )
    flags.DEFINE_string("workdir", None, "Sweep directory (with --config): DIR/<objective>, table.")
    flags.DEFINE_integer("eval_batches", 0, "Held-out batches per task (0: the runs' own).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    FLAGS = flags.FLAGS
    sweep = FLAGS.config is not None
    if sweep == bool(FLAGS.workdirs) or (sweep and not FLAGS.workdir):
        raise app.UsageError("give --workdirs and --output, or --config and --workdir")
    if not sweep and not FLAGS.output:
        raise app.UsageError("--workdirs needs --output")
    output = FLAGS.workdir if sweep else FLAGS.output
    workdirs = run_sweep(FLAGS.config, FLAGS.workdir) if sweep else FLAGS.workdirs
    if not workdirs:
        logging.warning("stopped by preemption; run the same command again to finish")
        return
    table = cross_evaluate(workdirs, eval_batches=FLAGS.eval_batches)
    write_table(table, output)
    logging.info("table: %s", files.as_path(output) / TABLE_MD)
    sys.stdout.write(render_markdown(table))


def run() -> None:
    _define_flags()
    cli.run(main)


if __name__ == "__main__":
    run()
