"""Sweep points that share every array shape, trained as one program (`--sweep.group=auto`).

Points whose configs differ only in the optimizer's per-run fields (`optim.PER_RUN_FIELDS`:
learning rate, warmup, weight decay, clipping threshold, Adam's β1 / β2 / ε) compute the same
shapes: one program with a leading run axis trains them all (`train_state.Runs`). Each run starts
from its own config's seed, reads its own values of those fields as traced scalars inside the
vmapped update, and every run trains on the same batch, so the input pipeline runs once for the
group. What a point computes is what its solo run computes (the test: every logged metric
within float tolerance).

The group runs in ROOT/groups/<name>/ through the one loop (`pretrain.train.train_and_evaluate`
with `grouped_pretraining`: the model half with a run axis, `GroupedPretrainingData`), so it
checkpoints, resumes and stops on SIGTERM like any run. After its last step each point's
workdir gets what its solo run would have left (`GroupedPretrainingData.finish`): config.json,
metrics.jsonl and TensorBoard events (its own `name/run_<i>` metrics under their plain names),
the tokenizer, the learning curve, and an Orbax checkpoint of its slice of the state (params,
optimizer state, data position) that `load_pretrained` reads and a solo run of that point
resumes from. A run whose numbers went non-finite is dropped from the group's means (the loop
goes on while one run is finite) and its point is reported as diverged.

Fine-tuning points, and points that differ in anything else (sharing, depth, embedding size,
batch, seed, dropout, masking), run alone; `plan_groups` says why for each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from albert_jax import checkpointing, files, metrics_writer, optim
from albert_jax.finetune import seeds
from albert_jax.finetune.settings import optimizer_config
from albert_jax.finetune.train import EVAL_RESULTS_FILE, FineTuningData, fine_tuning
from albert_jax.loop import Loop, Objective
from albert_jax.pretrain.data_half import PretrainingData
from albert_jax.pretrain.heldout import eval_metrics, sum_eval_batches
from albert_jax.pretrain.model_half import PretrainingModel
from albert_jax.run_config import write_run_config
from albert_jax.sweep.grid import flat_fields
from albert_jax.train_state import Runs

RUN_LABEL = "run_{}"
# What may differ between the points of one program: the optimizer's per-run fields, and
# fine-tuning's warmup_fraction (which only sets warmup_steps:
# `finetune.settings.optimizer_config`).
PER_RUN = (*optim.PER_RUN_FIELDS, "warmup_fraction")
# Pretraining's fields that change a run's batches but not their shapes: points that differ in
# them group too, each run with its own input pipeline (its batches interleaved).
PER_RUN_DATA = (
    "seed", "data.masked_lm_prob", "data.short_seq_prob", "data.max_ngram",
    "data.sop_single_segment",
)  # fmt: skip


def _varying(config: Any) -> tuple[str, ...]:
    """The fields a point of this kind may differ in and still share a program."""
    return PER_RUN if "task" in config else (*PER_RUN, *PER_RUN_DATA)


def shape_key(config: Any) -> tuple[Any, ...]:
    """What must be equal for two points to share a program: every field but the per-run
    ones, whether gradients are clipped at all (a threshold of 0 turns clipping off) and
    whether any token is masked (`masked_lm_prob=0` has no MLM term and no `mlm_*` metrics)."""
    fields = flat_fields(config)
    clip = float(fields.get("grad_clip_norm", 0.0)) > 0
    masked = float(fields.get("data.masked_lm_prob", 0.15)) > 0
    varying = _varying(config)
    kept = sorted((k, json.dumps(v)) for k, v in fields.items() if k not in varying)
    return (clip, masked, *kept)


def plan_groups(
    configs: Sequence[Any], enabled: bool = True, forced: Mapping[int, str] | None = None
) -> tuple[list[list[int]], dict[int, str]]:
    """Splits points (indices into `configs`) into groups of two or more that share a program,
    and the others, each with the reason it runs alone (`forced`: points that must, and why).

    Returns:
      (groups: [[index, ...], ...], alone: {index: reason}).
    """
    alone: dict[int, str] = {}
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, config in enumerate(configs):
        if forced and i in forced:
            alone[i] = forced[i]
        elif not enabled:
            alone[i] = "--sweep.group=none"
        elif int(config.get("num_seeds", 1)) > 1:
            alone[i] = "num_seeds > 1: its seeds are one program already"
        else:
            buckets.setdefault(shape_key(config), []).append(i)
    groups = [members for members in buckets.values() if len(members) > 1]
    for members in buckets.values():
        if len(members) == 1:
            (i,) = members
            alone[i] = "no other point differs from it only in " + ", ".join(_varying(configs[i]))
            differ = _nearest_difference(configs, i)
            if differ:
                alone[i] += (
                    f" (nearest differs in {differ}, which the program's shapes or data depend on)"
                )
    return groups, alone


def _nearest_difference(configs: Sequence[Any], i: int) -> str:
    """The non-per-run fields in which point i differs from the point most like it."""
    mine = flat_fields(configs[i])
    best: list[str] | None = None
    for j, other in enumerate(configs):
        if j == i:
            continue
        theirs = flat_fields(other)
        varying = _varying(configs[i])
        differ = [k for k in sorted(set(mine) | set(theirs))
                  if k not in varying and mine.get(k) != theirs.get(k)]  # fmt: skip
        if best is None or len(differ) < len(best):
            best = differ
    return ", ".join(best or [])


def runs_of(
    values: Sequence[Mapping[str, Any]], seeds: Sequence[int], shared_batch: bool = True
) -> Runs:
    """The group's runs: each point's seed, `run_<i>` labels, one shared batch (or each its
    own, interleaved), and the per-run optimizer fields (each point's `values`) where the
    points differ."""
    differing: dict[str, np.ndarray] = {}
    for field in optim.PER_RUN_FIELDS:
        column = [v[field] for v in values]
        if len(set(column)) > 1:
            dtype = np.int32 if field == "warmup_steps" else np.float32
            differing[field] = np.asarray(column, dtype)
    return Runs(
        seeds=tuple(int(s) for s in seeds),
        labels=tuple(RUN_LABEL.format(i) for i in range(len(values))),
        shared_batch=shared_batch,
        optimizer_values=differing or None,
    )


def grouped_pretraining(
    settings: Any, mesh: Mesh, tokenizer: Any, *, point_configs: Sequence[Any],
    point_dirs: Sequence[str], point_settings: Sequence[Any],
) -> Objective:  # fmt: skip
    """Pretraining of several points as one program (see the module docstring): the group's
    settings are the first point's, with which they share every field but the per-run ones.
    Points whose data settings are the same train on one shared batch; otherwise each run has
    its own data half and the batch holds their rows interleaved."""
    shared = all(p.data == settings.data for p in point_settings)
    runs = runs_of(point_configs, [c.seed for c in point_configs], shared)
    model = PretrainingModel.from_settings(settings, mesh, runs=runs)
    members = None if shared else [PretrainingData(p, tokenizer) for p in point_settings]
    data = GroupedPretrainingData(settings, tokenizer, runs, members, point_configs, point_dirs)
    return Objective(model, data)


class GroupedPretrainingData(PretrainingData):
    """The data half of a pretraining group: the shared stream (`PretrainingData`'s), or each
    run's own (`members`) interleaved; each run scored on its held-out set."""

    def __init__(self, settings: Any, tokenizer: Any, runs: Runs,
                 members: Sequence[PretrainingData] | None, point_configs: Sequence[Any],
                 point_dirs: Sequence[str]):  # fmt: skip
        super().__init__(settings, tokenizer)
        self.runs, self.members = runs, None if members is None else list(members)
        self.point_configs, self.point_dirs = list(point_configs), list(point_dirs)
        self.global_batch *= 1 if members is None else runs.n

    def start(self, step: int, saved_data: Any, meta: Mapping[str, Any] | None) -> None:
        if self.members is None:
            return super().start(step, saved_data, meta)
        saved = saved_data.get("runs") if isinstance(saved_data, Mapping) else None
        for i, member in enumerate(self.members):
            member.start(step, saved[i] if saved else None, meta)

    def next_batch(self, step: int) -> dict[str, np.ndarray]:
        if self.members is None:
            return super().next_batch(step)
        return seeds.interleave([m.next_batch(step) for m in self.members])

    def data_state(self, step: int) -> Any:
        """The shared stream's position, or {"runs": [each run's]}."""
        if self.members is None:
            return super().data_state(step)
        return {"runs": [m.data_state(step) for m in self.members]}

    def evaluate(self, params: Any, put: Any, eval_step: Any) -> dict[str, float]:
        """Each run's eval metrics as `eval_<metric>/run_<i>`, with the baselines of its
        held-out set (shared, or each run's own: then every run is scored on each set and
        keeps its own set's sums)."""
        sets = [self] if self.members is None else self.members
        metrics: dict[str, float] = {}
        for k, part in enumerate(sets):
            batches = part.place_eval_batches(put, self.data.batch_size)
            sums = sum_eval_batches(eval_step, params, batches)
            runs = range(self.runs.n) if self.members is None else [k]
            for i in runs:
                run = {**eval_metrics({n: v[i] for n, v in sums.items()}), **part.baselines}
                metrics.update({f"{n}/{self.runs.labels[i]}": v for n, v in run.items()})
        return metrics

    def finish(self, loop: Loop) -> None:
        """Writes each point's workdir as its solo run would have left it."""
        step = int(jax.device_get(loop.state.step))
        state = self.data_state(step)
        data = [state] * self.runs.n if self.members is None else state["runs"]
        write_points(loop, self.point_configs, self.point_dirs, self.runs, data)

    def close(self) -> None:
        super().close()
        for member in self.members or ():
            member.close()


def grouped_fine_tuning(
    config: Any, workdir: str, spec: Any, mesh: Mesh, *, point_configs: Sequence[Any],
    point_dirs: Sequence[str],
) -> Objective:  # fmt: skip
    """Fine-tuning of several points (one seed each, the same seed) as one program: the task's
    batches read once, each point's own optimizer values, each scored on its own."""
    objective = fine_tuning(config, workdir, spec, mesh, data_cls=GroupedFineTuningData)
    model, data = objective.model, objective.data
    values = [optimizer_config(c, model.total_steps) for c in point_configs]
    runs = runs_of(values, [c.seed for c in point_configs])
    model.runs, model.num_seeds = runs, runs.n  # the state's leading axis; the batch is shared
    data.runs, data.num_seeds = runs, runs.n
    data.point_configs, data.point_dirs = list(point_configs), list(point_dirs)
    data.run_results_ = []
    return objective


class GroupedFineTuningData(FineTuningData):
    """The data half of a fine-tuning group: one seed's batches (shared by every run), each
    run scored as its solo run (`runs`, `point_configs`, `point_dirs`: `grouped_fine_tuning`)."""

    runs: Runs
    point_configs: list[Any]
    point_dirs: list[str]
    run_results_: list[dict[str, Any]]

    def summarize_runs(self, per_run: list[dict[str, Any]], finite: list[bool]) -> dict[str, Any]:
        """Each point's results as its solo run's; logged as `eval_<metric>/run_<i>`."""
        self.run_results_ = per_run
        self.results = {}
        return {f"eval_{k}/{label}": v for label, metrics in zip(self.runs.labels, per_run,
                                                                 strict=True)
                for k, v in metrics.items() if seeds.is_number(v)}  # fmt: skip

    def finish(self, loop: Loop, step: int) -> dict[str, Any]:
        """Each point's workdir as its solo run would have left it: eval_results.json and the
        prediction files too. Returns the group's summary."""
        write_points(loop, self.point_configs, self.point_dirs, self.runs,
                     [self.data_state(step)] * self.runs.n)  # fmt: skip
        for i, workdir in enumerate(self.point_dirs):
            results = self.run_results(step, loop.model.report, self.run_results_[i])
            if jax.process_index() == 0:
                results["prediction_files"] = self.write_run_predictions(
                    workdir, self.predictions[i]
                )
                files.write_json(files.as_path(workdir) / EVAL_RESULTS_FILE, results)
        return {"task": self.config.task, "step": step, "preempted": False,
                "points": list(self.point_dirs)}  # fmt: skip


def write_points(
    loop: Loop, point_configs: Sequence[Any], point_dirs: Sequence[str], runs: Runs,
    data: Sequence[Any],
) -> None:  # fmt: skip
    """Each point of a group gets, in its workdir, its own metrics.jsonl and TensorBoard
    events, config.json, the tokenizer, the learning curve, and (unless its state is not
    finite, as a solo run would not save one) an Orbax checkpoint of its slice of the state
    with its data position (`data[i]`) and its config in `meta`."""
    step = int(jax.device_get(loop.state.step))
    records = metrics_writer.read_metrics(loop.workdir)
    tokenizer = files.as_path(loop.workdir) / checkpointing.TOKENIZER_FILE
    for i, (config, workdir) in enumerate(zip(point_configs, point_dirs, strict=True)):
        params = jax.tree.map(lambda x, i=i: x[i], loop.state.params)
        opt_state = jax.tree.map(lambda x, i=i: x[i], loop.state.opt_state)
        if jax.process_index() == 0:
            files.as_path(workdir).mkdir(parents=True, exist_ok=True)
            writer = metrics_writer.MetricsWriter(workdir)
            writer.rewind(0)
            for record in (point_record(r, runs.labels[i]) for r in records):
                writer.write(record.pop("step"), record)
            writer.close()
            write_run_config(config, workdir)
            if tokenizer.exists():
                files.copy(tokenizer, files.as_path(workdir) / checkpointing.TOKENIZER_FILE)
            metrics_writer.plot_learning_curve(workdir)
        if not np.isfinite(float(jax.jit(optax.tree.norm)(params))):
            logging.warning("point %s diverged: no checkpoint written", workdir)
            continue
        meta = {**loop.objective.meta(), "config": json.loads(config.to_json_best_effort())}
        meta = checkpointing.checkpoint_meta(loop.model.model_config, step, **meta)
        with checkpointing.Checkpointer(workdir, keep=int(config.keep_checkpoints)) as ckpt:
            with jax.transfer_guard("allow"):
                ckpt.save(step, params=params, opt_state=opt_state, data=data[i], meta=meta,
                          force=True)  # fmt: skip
            ckpt.wait()


def point_record(record: Mapping[str, Any], label: str) -> dict[str, Any]:
    """One run's record of a group's metrics.jsonl line: its `name/<label>` values under
    `name`, and what all runs share (step, throughput, the eval baselines); the group's means
    and the other runs' values are left out."""
    suffix = "/" + label
    per_run = {k.rsplit("/", 1)[0] for k in record if "/" in k}
    out = {k: v for k, v in record.items()
           if "/" not in k and k not in per_run and k != "seeds_diverged"}  # fmt: skip
    out.update({k[: -len(suffix)]: v for k, v in record.items() if k.endswith(suffix)})
    return out


def divergence(workdir: str) -> str | None:
    """Why a grouped point failed where its solo run would have stopped: the first logged
    step of its metrics.jsonl with a non-finite (null) loss; None if there is none."""
    for r in metrics_writer.read_metrics(workdir):
        value = r.get("loss", 0.0)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return (
                f"TrainingDivergedError: non-finite loss by step {r['step']} (the other points "
                "of its program went on); lower its learning rate"
            )
    return None
