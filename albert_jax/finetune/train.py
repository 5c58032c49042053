"""Fine-tuning and evaluation: `finetune_and_evaluate(config, workdir)` = the one loop
(`albert_jax.loop`) + the objective `fine_tuning` builds: its model half `TaskModel` (a task
kind's head, `tasks/kinds.py`, with the pretrained init merged) and its data half
`FineTuningData` (the task's batches, scoring, outputs).

  init checkpoint (one read, `backbone_init.read_init`: ours, HF or TF1; of a checkpoint of
  several seeds the run of `init_run_seed`) -> backbone params `albert` + the task head
  (the checkpoint's where it has one of the same shape and `init_dont_load` does not name it,
  else freshly initialized, heads.py), sharded on the (data, fsdp, tensor) mesh
  -> AdamW with linear warmup / decay (optim.make_optimizer) on fixed-shape batches
  -> evaluation at the end (and every `eval_every_steps`) with the task's official metrics
  -> WORKDIR/eval_results.json, prediction files, an Orbax checkpoint of the fine-tuned params.

What the checkpoint provides is reported, not assumed: head weights it lacks are initialized
and listed as `missing`, checkpoint weights the task model does not use (the MLM / SOP heads,
another task's head) as `unexpected`, in the log and in eval_results.json.

Resume: a workdir that already holds a checkpoint of this run resumes from its latest one
(params, optimizer state, step and init report). Batch s is a pure function of (training
features, seed, s) and dropout keys are `fold_in(key, s)`, so the resumed run computes
bit for bit what an uninterrupted one would; the checkpoint's data state (seed, batch size,
schedule and a fingerprint of the training features) must match, or the resume is refused.
SIGTERM saves a checkpoint at a step boundary (the loop's preemption handling) and returns
`{"preempted": True, ...}` without evaluating (a notice during the last step just lets the run
finish); `checkpoint_every_steps` adds periodic saves for crashes without a notice. The
workdir, `init` and the task files may be local or gs://.

Files written (process 0):
  eval_results.json        metrics (+ counts, featurization statistics, init report)
  metrics.jsonl            train loss / learning rate / grad norm per log step, eval_* keys
  predictions.json         SQuAD: {question id: answer} (official format; v2: "" = no answer)
  na_probs.json            SQuAD v2: {question id: P(no answer)}
  nbest_predictions.json   SQuAD: n-best candidates with probabilities
  predictions.jsonl        other tasks: {"id", "prediction", "label", "eval_set"} per eval
                           example (eval_set: the file or split it came from)
  checkpoints/<step>/      params, opt_state, data, meta (readable by load_pretrained)
  tokenizer.model          the tokenizer used
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from albert_jax import checkpointing, files
from albert_jax.finetune import seeds
from albert_jax.finetune.backbone_init import read_init
from albert_jax.finetune.settings import (
    check_batch,
    dont_load_patterns,
    model_config,
    validate_config,
)
from albert_jax.finetune.task_model import TaskModel
from albert_jax.loop import Loop, Objective
from albert_jax.model.config import ModelConfig
from albert_jax.pretrained import Checkpoint
from albert_jax.run_config import loop_settings, mesh_layout
from albert_jax.runtime import compile_cache, workdir_lease
from albert_jax.sharding import fetch
from albert_jax.tasks.kinds import get_kind
from albert_jax.tasks.registry import TaskSpec
from albert_jax.tasks.task_data import TaskData

__all__ = [
    "EVAL_RESULTS_FILE", "FineTuningData", "build_model", "fine_tuning", "finetune_and_evaluate"
]  # fmt: skip

PyTree = Any
EVAL_RESULTS_FILE = "eval_results.json"


def build_model(spec: TaskSpec, model_config: ModelConfig, config: Any) -> nn.Module:
    """The task model of `spec` (its kind's head, heads.py) with the config's head settings."""
    return get_kind(spec.kind).build_model(model_config, spec, config)


# ----------------------------------------------------------------------------------------------
# The fine-tuning objective of the loop: `TaskModel` + `FineTuningData`


def fine_tuning(
    config: Any, workdir: str, spec: TaskSpec, mesh: Mesh, data_cls: type | None = None
) -> Objective:
    """One task on one init: the init checkpoint and tokenizer read once, the task model
    (`TaskModel`, the checkpoint merged into it) and its data (`FineTuningData`, or
    `data_cls`: a sweep group's)."""
    kind = get_kind(spec.kind)
    check_batch("batch_size", config.batch_size, mesh)
    check_batch("eval_batch_size", config.eval_batch_size, mesh)
    # N seeds in one program: each seed's batch of `batch_size` rows, interleaved.
    run_seeds = seeds.seeds_of(config.seed, config.num_seeds)
    checkpoint = read_init(config)  # None: from scratch
    tokenizer, tokenizer_path = _tokenizer(config, checkpoint)
    pretrained = checkpoint.config if checkpoint else None
    task_config = model_config(config, pretrained, tokenizer.vocab_size)
    if jax.process_index() == 0 and tokenizer_path:
        files.copy(tokenizer_path, files.as_path(workdir) / checkpointing.TOKENIZER_FILE)
    # Examples, features, the packing decision and every step's batch.
    rows = mesh.shape["data"] * mesh.shape["fsdp"]  # the batches split over the mesh
    task_data = TaskData(config, kind, tokenizer, run_seeds, rows, jax.process_count())
    model = TaskModel(
        config, kind, kind.build_model(task_config, spec, config), task_data.init_batch,
        task_data.total_steps, len(run_seeds), mesh, num_labels=spec.num_labels,
        checkpoint=checkpoint, dont_load=dont_load_patterns(config.get("init_dont_load", "")),
    )  # fmt: skip
    data = (data_cls or FineTuningData)(config, workdir, spec, task_data, tokenizer)
    return Objective(model, data)


def _tokenizer(config: Any, init: Checkpoint | None) -> tuple[Any, str | None]:
    """(the run's tokenizer, the file to copy into the workdir): `config.data.tokenizer`
    (which must be the checkpoint's, unless `allow_other_tokenizer`), else the checkpoint's."""
    from albert_jax.data.tokenizer import Tokenizer

    path = config.data.tokenizer
    if path:
        if not files.as_path(path).is_file():
            raise ValueError(f"config.data.tokenizer={path!r} does not exist")
        given = Tokenizer(path)
        own = init.tokenizer if init is not None else None
        allowed = bool(config.data.get("allow_other_tokenizer", False))
        if own is not None and given.fingerprint != own.fingerprint and not allowed:
            # Any vocabulary no larger than the checkpoint's loads, so ids of another
            # tokenizer would silently read unrelated pretrained embeddings.
            raise ValueError(
                f"config.data.tokenizer={path!r} is not the tokenizer of the checkpoint "
                f"{config.init!r} ({init.tokenizer_path}), whose embeddings are "
                "indexed by its ids: unset config.data.tokenizer to use the checkpoint's, "
                "or set config.data.allow_other_tokenizer=True if the ids are the same"
            )
        return given, path
    if init is not None and init.tokenizer is not None:
        return init.tokenizer, init.tokenizer_path
    raise ValueError(
        f"no tokenizer: the checkpoint {config.init!r} has none; set "
        "--config.data.tokenizer=PATH/TO/spm.model"
    )


class FineTuningData:
    """Fine-tuning's data half (`loop.DataHalf`): the task's batches (`tasks.task_data.TaskData`:
    examples, features, packing, every step's batch and the eval batches), scoring with the
    official metrics, and the files written at the end."""

    final_eval = True  # the results of the run are the evaluation after its last step

    def __init__(self, config: Any, workdir: str, spec: TaskSpec, task_data: TaskData,
                 tokenizer: Any):  # fmt: skip
        self.config, self.workdir, self.spec = config, workdir, spec
        self.kind, self.task_data, self.tokenizer = task_data.kind, task_data, tokenizer
        self.seeds = task_data.seeds
        self.num_seeds = len(self.seeds)
        self.global_batch = int(config.batch_size) * self.num_seeds
        self.total_steps = task_data.total_steps
        short = {"accuracy": "acc", "exact_match": "em"}
        self.eval_progress_fields = tuple((short.get(m, m), f"eval_{m}") for m in spec.metrics)
        self.results: dict[str, Any] = {}  # of the last evaluation
        self.predictions: list[list[Any]] = []  # [run][eval set]: each run's predictions

    # -------------------------------------------------------------------------------- data
    @property
    def packing(self) -> bool:
        """Whether training rows are packed (`config.pack_examples` or auto's decision)."""
        return self.task_data.packing

    def data_state(self, step: int) -> dict[str, Any]:
        return self.task_data.state(step)

    def check_resume(self, saved: Any, step: int) -> None:
        self.task_data.check_resume(saved, step, self.workdir)

    def start(self, step: int, saved_data: Any, meta: Mapping[str, Any] | None) -> None:
        self.task_data.resume_packing(saved_data)
        if meta is not None:
            logging.info("resumed fine-tuning at step %d from %s", step, self.workdir)

    def next_batch(self, step: int) -> dict[str, np.ndarray]:
        return self.task_data.batch(step)

    def data_report(self) -> dict[str, Any]:
        return self.task_data.report()

    def meta(self) -> dict[str, Any]:
        return {}

    # ---------------------------------------------------------------------------- evaluation
    def evaluate(self, params: PyTree, put: Any, eval_step: Any) -> dict[str, Any]:
        """Scores every eval set (metrics prefixed by the set name when there are several) and
        keeps the results and predictions; returns the numeric ones as `eval_*` (N seeds: the
        median over the seeds, and each seed's as `eval_<metric>/seed_<seed>`)."""
        runs = self.num_seeds
        per_run: list[dict[str, Any]] = [{} for _ in range(runs)]
        self.predictions = [[] for _ in range(runs)]

        def run(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
            return fetch(eval_step(params, put(batch, rows)))

        several = len(self.task_data.eval_sets) > 1
        for eval_set, features in self.task_data.eval_pairs():
            outputs = self.task_data.eval_outputs(features, run)
            prefix = f"{eval_set.name}/" if several else ""
            for i in range(runs):
                run_outputs = outputs if runs == 1 else {k: v[:, i] for k, v in outputs.items()}
                metrics, predictions = self.kind.score(
                    eval_set, features, run_outputs, self.config, self.spec
                )
                per_run[i].update({prefix + k: v for k, v in metrics.items()})
                per_run[i][prefix + "num_examples"] = len(eval_set.examples)
                self.predictions[i].append(predictions)
        if runs == 1:
            self.results = per_run[0]
            return {f"eval_{k}": v for k, v in self.results.items() if seeds.is_number(v)}
        norms = fetch(jax.jit(jax.vmap(optax.tree.norm))(params))
        return self.summarize_runs(per_run, [bool(np.isfinite(n)) for n in norms])

    def summarize_runs(self, per_run: list[dict[str, Any]], finite: list[bool]) -> dict[str, Any]:
        """N seeds' results (`seeds.summarize`: per seed and their statistics) as
        `self.results`; the logged metrics: the medians and each seed's."""
        per_seed = dict(zip(self.seeds, per_run, strict=True))
        self.results = seeds.summarize(per_seed, dict(zip(self.seeds, finite, strict=True)))
        logged = {f"eval_{k}": v for k, v in self.results["median"].items()}
        for seed, metrics in per_seed.items():
            numbers = {k: v for k, v in metrics.items() if seeds.is_number(v)}
            logged.update({f"eval_{k}/seed_{seed}": v for k, v in numbers.items()})
        return logged

    # ----------------------------------------------------------------------------- outputs
    def write_predictions(self) -> list[str]:
        """Each eval set's prediction files (the kind's; suffixed _<k> when there are several;
        N seeds: each seed's in WORKDIR/seed_<seed>/); returns the paths written."""
        written = []
        for seed, predictions in zip(self.seeds, self.predictions, strict=True):
            where = self.workdir
            if self.num_seeds > 1:
                where = str(files.as_path(self.workdir) / f"seed_{seed}")
            written += self.write_run_predictions(where, predictions)
        return written

    def write_run_predictions(self, where: str, predictions: list[Any]) -> list[str]:
        """One run's prediction files (of each eval set) in `where`."""
        files.as_path(where).mkdir(parents=True, exist_ok=True)
        written = []
        eval_sets = self.task_data.eval_sets
        for k, (eval_set, preds) in enumerate(zip(eval_sets, predictions, strict=True)):
            suffix = f"_{k}" if len(eval_sets) > 1 else ""
            written += self.kind.write_predictions(where, suffix, eval_set, preds)
        return written

    def run_results(
        self, step: int, init: Any, metrics: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """eval_results.json of a run that trained to `step`: the task, the step, the
        evaluation's results (`metrics`, or the run's), the data report and the init report
        (`init`: the model half's; the prediction files are added by the caller)."""
        metrics = self.results if metrics is None else metrics
        return {"task": self.config.task, "step": step, **metrics,
                "data": self.data_report(), "init": init, "preempted": False}  # fmt: skip

    def finish(self, loop: Loop, step: int) -> dict[str, Any]:
        """After the last step: eval_results.json (and the prediction files), N seeds' failed
        ones restarted (`config.restart_failed_seeds`); returns the results."""
        config, workdir = self.config, self.workdir
        results = self.run_results(step, loop.model.report)
        if jax.process_index() == 0:
            results["prediction_files"] = self.write_predictions()
        if self.num_seeds > 1 and results["failed_seeds"] and config.restart_failed_seeds:
            results = _restart_failed_seeds(config, workdir, results)
        if jax.process_index() == 0:
            files.write_json(files.as_path(workdir) / EVAL_RESULTS_FILE, results)
        numbers = results.get("median", results)
        numbers = {k: v for k, v in numbers.items() if seeds.is_number(v) and k != "step"}
        logging.info("eval: %s", ", ".join(f"{k} {v:.4g}" for k, v in numbers.items()))
        return results

    def close(self) -> None:
        pass


def finetune_and_evaluate(
    config: Any, workdir: str, make_objective: Callable[..., Objective] | None = None
) -> dict[str, Any]:
    """Fine-tunes `config.init` on `config.task` and evaluates it; returns the eval results
    (also written to WORKDIR/eval_results.json; see the module docstring).
    `make_objective(config, workdir, spec, mesh)` builds the objective: `fine_tuning` by
    default, a sweep group's several runs (`sweep.group.grouped_fine_tuning`).

    Raises:
      ValueError: a bad config or data (before anything is compiled).
      TrainingDivergedError: a non-finite loss, gradient norm or parameter norm.
      workdir_lease.WorkdirInUseError: another run holds `workdir` (WORKDIR/run.lease).
    """
    spec = validate_config(config)
    workdir = files.run_directory(workdir)
    with workdir_lease.hold(workdir) as lease:  # one run per workdir, before it is written
        return _finetune(config, workdir, spec, lease, make_objective or fine_tuning)


def _finetune(
    config: Any, workdir: str, spec: Any, lease: Any, make_objective: Callable[..., Objective]
) -> dict[str, Any]:
    """`finetune_and_evaluate` once the config is valid and the workdir leased."""
    settings = loop_settings(config)
    compile_cache.use_for_run(settings.compilation_cache_dir, workdir)
    # config.mesh.auto sizes the layout by the `size` preset with config.model's fields (the
    # checkpoint is read later, by the objective); an explicit mesh is checked there too.
    preset = None
    if config.mesh.get("auto", False):
        preset = model_config(config, None, ModelConfig.preset(config.size).vocab_size)
    mesh = mesh_layout(config, preset).create()
    objective = make_objective(config, workdir, spec, mesh)
    loop = Loop(objective, settings, workdir, mesh, lease=lease)
    try:
        summary = loop.run()
    finally:
        loop.close()
    step = int(summary["step"])
    if summary["preempted"]:
        return {"task": config.task, "step": step, "preempted": True,
                "checkpoint_step": summary["checkpoint_step"]}  # fmt: skip
    return objective.data.finish(loop, step)  # (the loop closed: a restart of seeds opens its own)


RESTART_DIR = "restarted_seeds"


def _restart_failed_seeds(config: Any, workdir: str, results: dict[str, Any]) -> dict[str, Any]:
    """Runs as many fresh seeds as failed (the seeds after the run's last, one program, in
    WORKDIR/restarted_seeds) and reports them in place of the failed ones: `per_seed` and the
    statistics over the kept and the new seeds, `replaced_seeds` [{"seed", "reason",
    "replaced_by", "metrics"}], `failed_seeds` those of the new seeds that failed too (one
    round)."""
    failed = results["failed_seeds"]
    restart = config.copy_and_resolve_references()
    restart.seed = max(results["seeds"]) + 1
    restart.num_seeds = len(failed)
    restart.restart_failed_seeds = False
    # The new seeds join the median: the same batch layout as the seeds they replace.
    restart.pack_examples = bool(results["data"]["train"]["packed"])
    logging.warning("restarting failed seeds %s as seeds %s",
                    [f["seed"] for f in failed],
                    seeds.seeds_of(restart.seed, restart.num_seeds))  # fmt: skip
    rerun = finetune_and_evaluate(restart, str(files.as_path(workdir) / RESTART_DIR))
    if rerun.get("preempted"):
        raise RuntimeError("preempted while restarting failed seeds; run the command again")
    return seeds.merge_restarted(results, rerun)
