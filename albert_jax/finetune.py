"""Fine-tuning and evaluation: `finetune_and_evaluate(config, workdir)` = the one loop
(`albert_jax.loop`) + a task kind (`tasks/kinds.py`) + the pretrained init merge + outputs.

  init checkpoint (load_pretrained: ours, HF or TF1) -> backbone params `albert`
  + a freshly initialized task head (heads.py), sharded on the (data, fsdp, tensor) mesh
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
  predictions.jsonl        other tasks: {"id", "prediction", "label"} per eval example
  checkpoints/<step>/      params, opt_state, data, meta (readable by load_pretrained)
  tokenizer.model          the tokenizer used
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from albert_jax import checkpointing, files, heads, optim, trees
from albert_jax.config import ModelConfig
from albert_jax.finetune_config import (
    KNOWN_FIELDS,
    check_batch,
    model_config,
    optimizer_config,
    validate_config,
)
from albert_jax.loop import Loop
from albert_jax.sharding import create_mesh, fetch, process_rows
from albert_jax.tasks import registry
from albert_jax.tasks.batching import (
    Features,
    bucket_lengths,
    eval_batches,
    train_batch,
    trim_to_bucket,
)
from albert_jax.tasks.kinds import get_kind
from albert_jax.tasks.local import ReadStats
from albert_jax.tasks.registry import TaskSpec
from albert_jax.train_config import mesh_layout

__all__ = [
    "finetune_and_evaluate",
    "build_model",
    "validate_config",
    "merge_pretrained",
    "InitReport",
    "EVAL_RESULTS_FILE",
    "KNOWN_FIELDS",
]

PyTree = Any
EVAL_RESULTS_FILE = "eval_results.json"


def build_model(spec: TaskSpec, model_config: ModelConfig, config: Any) -> nn.Module:
    """The task model of `spec` (its kind's head, heads.py) with the config's head settings."""
    return get_kind(spec.kind).build_model(model_config, spec, config)


# ----------------------------------------------------------------------------------------------
# Parameters: the pretrained backbone


@dataclasses.dataclass
class InitReport:
    """Where the parameters came from: `loaded` / `missing` (initialized fresh) / `unexpected`
    (in the checkpoint, unused) parameter paths, "/"-joined under params."""

    path: str
    source: str
    loaded: list[str]
    missing: list[str]
    unexpected: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "loaded": len(self.loaded),
            "missing": self.missing,
            "unexpected": self.unexpected,
        }


def merge_pretrained(
    fresh: Mapping[str, Any], checkpoint: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str], list[str], list[str]]:
    """Takes every checkpoint array whose path and shape the task model has.

    Args:
      fresh: {path: array or ShapeDtypeStruct} of the task model (only shapes are read).
      checkpoint: {path: array} of what the checkpoint really holds.
    Returns:
      (merged {path: array}, loaded paths, missing paths, unexpected paths). A head weight of
      another shape (e.g. a classifier with other labels) is missing *and* unexpected.
    Raises:
      ValueError: a backbone (`albert/...`) weight has another shape than the model's.
    """
    merged, loaded, missing = {}, [], []
    for path, value in fresh.items():
        stored = checkpoint.get(path)
        if stored is not None and tuple(stored.shape) == tuple(value.shape):
            merged[path] = stored
            loaded.append(path)
            continue
        if stored is not None and path.startswith("albert/"):
            raise ValueError(
                f"checkpoint {path} has shape {tuple(stored.shape)}, the model {tuple(value.shape)}"
            )
        merged[path] = value
        missing.append(path)
    unexpected = sorted(p for p in checkpoint if p not in loaded)
    return merged, loaded, missing, unexpected


def _load_checkpoint(config: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """(Pretrained, {path: array} of the weights the checkpoint really holds)."""
    from albert_jax.pretrained import load_pretrained

    pretrained = load_pretrained(config.init, seed=config.seed)
    flat = trees.flatten(pretrained.params["params"])
    # Parts load_pretrained had to initialize were not in the checkpoint.
    absent = tuple(part + "/" for part in pretrained.initialized)
    stored = {k: np.asarray(v) for k, v in flat.items() if not k.startswith(absent)}
    # Task-head weights of another fine-tuning run: `load_pretrained` keeps only the
    # pretraining model, so they are read from its checkpoint directly.
    stored.update(checkpointing.task_head_weights(config.init))
    return pretrained, stored


# ----------------------------------------------------------------------------------------------
# The fine-tuning objective of the loop


class FineTuning:
    """One task on one init: its data and features, the task model and loss of its kind, the
    init merge, evaluation with the official metrics, and the files written at the end
    (`loop.Objective`)."""

    microbatches = 1
    flops_per_step = None
    final_eval = True  # the results of the run are the evaluation after its last step
    eval_reduces = False  # eval_fn returns per-row outputs, scored on the host

    def __init__(self, config: Any, workdir: str, spec: TaskSpec, mesh: Mesh):
        self.config, self.workdir, self.spec = config, workdir, spec
        self.kind = get_kind(spec.kind)
        check_batch("batch_size", config.batch_size, mesh)
        check_batch("eval_batch_size", config.eval_batch_size, mesh)
        self.global_batch = int(config.batch_size)
        self.eval_every_steps = int(config.eval_every_steps)

        # --- checkpoint, tokenizer and model config
        pretrained, self.stored = (None, {}) if not config.init else _load_checkpoint(config)
        self.tokenizer, tokenizer_path = self._tokenizer(pretrained)
        self.model_config = model_config(
            config, pretrained.config if pretrained else None, self.tokenizer.vocab_size
        )
        self.init_source = (pretrained.source, config.init) if pretrained else ("scratch", "")
        self.model = build_model(spec, self.model_config, config)
        if jax.process_index() == 0 and tokenizer_path:
            files.copy(tokenizer_path, files.as_path(workdir) / checkpointing.TOKENIZER_FILE)

        # --- data
        start = time.perf_counter()
        eval_only = config.num_train_steps == 0 and config.num_train_epochs <= 0
        if eval_only and not config.data.train_files:
            self.train_set = registry.EvalSet("", [], ReadStats())
        else:
            self.train_set = registry.read_train(config.task, config.data)
        self.eval_sets = registry.read_eval(config.task, config.data)
        self.train_features = registry.featurize(
            config.task, self.train_set.examples, self.tokenizer, config
        )
        self.eval_features = [
            registry.featurize(config.task, s.examples, self.tokenizer, config)
            for s in self.eval_sets
        ]
        logging.info(
            "read and featurized %d train / %s eval examples in %.1fs",
            len(self.train_set.examples),
            [len(s.examples) for s in self.eval_sets],
            time.perf_counter() - start,
        )
        for eval_set, features in zip(self.eval_sets, self.eval_features, strict=True):
            if not len(features):  # found now, not after training
                raise ValueError(f"eval set {eval_set.name!r} has no examples")
        self.total_steps = self._num_train_steps()
        if len(self.train_features) == 0 and self.total_steps > 0:
            raise ValueError(f"no training examples for task {config.task!r}")
        self.train_fingerprint = _fingerprint(self.train_features)
        self.train_arrays = {k: self.train_features.arrays[k] for k in self.kind.model_inputs}
        features = self.train_features if len(self.train_features) else self.eval_features[0]
        rows = mesh.shape["data"] * mesh.shape["fsdp"]  # the init batch splits over the mesh
        self.init_batch = {
            k: features.arrays[k][:1].repeat(rows, 0) for k in self.kind.model_inputs
        }
        self.buckets = bucket_lengths(config.max_seq_length)
        self.lengths_seen: set[int] = set()  # length buckets compiled so far
        self.report: dict[str, Any] | None = None  # InitReport.as_dict()
        self.results: dict[str, Any] = {}  # of the last evaluation
        self.predictions: list[Any] = []

    def _tokenizer(self, pretrained: Any) -> tuple[Any, str | None]:
        from albert_jax.data.tokenizer import Tokenizer

        path = self.config.data.tokenizer
        if path:
            if not files.as_path(path).is_file():
                raise ValueError(f"config.data.tokenizer={path!r} does not exist")
            return Tokenizer(path), path
        if pretrained is not None and pretrained.tokenizer is not None:
            return pretrained.tokenizer, pretrained.tokenizer_path
        raise ValueError(
            f"no tokenizer: the checkpoint {self.config.init!r} has none; set "
            "--config.data.tokenizer=PATH/TO/spm.model"
        )

    def _num_train_steps(self) -> int:
        config = self.config
        if config.num_train_epochs > 0:
            return int(
                math.ceil(config.num_train_epochs * len(self.train_features) / config.batch_size)
            )
        return int(config.num_train_steps)

    # ------------------------------------------------------------------ model, loss, weights
    def init_variables(self, rng: jax.Array) -> PyTree:
        return self.kind.init_variables(self.model, rng, self.init_batch)["params"]

    def make_optimizer(self, boxed_params: PyTree) -> optax.GradientTransformation:
        del boxed_params  # AdamW / LAMB with one trust ratio per array
        return optim.make_optimizer(optimizer_config(self.config, self.total_steps))

    def loss(self, params: PyTree, batch: Mapping[str, jax.Array], rng: jax.Array):
        outputs = self.kind.apply(self.model, params, batch, train=True, rng=rng)
        return self.kind.loss(outputs, batch)

    def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return self.kind.apply(self.model, params, batch, train=False)

    def initial_weights(self, abstract: Mapping[str, Any]) -> dict[str, Any]:
        """The checkpoint's weights the task model has (reported: loaded / missing, which the
        loop initializes / unexpected)."""
        if not self.config.init:
            self.report = InitReport("", "scratch", [], sorted(abstract), []).as_dict()
            return {}
        merged, loaded, missing, unexpected = merge_pretrained(abstract, self.stored)
        source, path = self.init_source
        self.report = InitReport(path, source, loaded, missing, unexpected).as_dict()
        logging.info("init from %s checkpoint %s: %d weights loaded", source, path, len(loaded))
        if missing:
            logging.warning(
                "initialized %d weights the checkpoint lacks: %s", len(missing), missing
            )
        if unexpected:
            logging.warning("%d checkpoint weights unused: %s", len(unexpected), unexpected)
        return {k: merged[k] for k in loaded}

    # --------------------------------------------------------------------------- data state
    def data_state(self, step: int) -> dict[str, Any]:
        """What decides the training batches after `step`, saved in every checkpoint.

        Batch s is `train_batch(features, s, batch_size, seed)`, a pure function of these, so
        a resumed run continues the exact data order of an uninterrupted one; the fingerprint
        of the training features makes a resume on other data (other files, tokenizer or
        featurization settings) an error instead of a silent change.
        """
        return {
            "step": int(step),
            "seed": int(self.config.seed),
            "batch_size": int(self.config.batch_size),
            "num_train_steps": int(self.total_steps),
            "num_train_features": len(self.train_features),
            "train_fingerprint": self.train_fingerprint,
        }

    def check_resume(self, saved: Any, step: int) -> None:
        expected = self.data_state(step)
        if not isinstance(saved, dict):
            raise ValueError(f"{self.workdir}: checkpoint {step} has no data state: {saved!r}")
        differ = sorted(k for k, v in expected.items() if k in saved and saved[k] != v)
        if differ:
            details = ", ".join(f"{k}: saved {saved[k]!r}, now {expected[k]!r}" for k in differ)
            raise ValueError(
                f"cannot resume {self.workdir} at step {step}: the run's data or schedule "
                f"changed ({details}); restore the config (config.json in the workdir) or use "
                "a new --workdir"
            )

    def start(self, step: int, saved_data: Any, meta: Mapping[str, Any] | None) -> None:
        del saved_data  # batches are a pure function of the step (`next_batch`)
        if meta is not None:  # resumed: the init report of the run's first start
            logging.info("resumed fine-tuning at step %d from %s", step, self.workdir)
            self.report = meta.get("init")
            if self.report is None:  # checkpoints written before init reports went into meta
                earlier = files.as_path(self.workdir) / EVAL_RESULTS_FILE
                self.report = files.read_json(earlier).get("init") if earlier.exists() else None

    def next_batch(self, step: int) -> dict[str, np.ndarray]:
        batch = train_batch(self.train_arrays, step - 1, self.global_batch, self.config.seed)
        return process_rows(self._cut(batch))

    def _cut(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The global batch cut to its length bucket (`config.length_buckets`); each new
        length is one more compiled shape, at most `len(bucket_lengths(max_seq_length))`."""
        if not self.config.length_buckets:
            return batch
        batch, length = trim_to_bucket(batch, self.kind.sequence_inputs)
        if length not in self.lengths_seen:
            self.lengths_seen.add(length)
            logging.info(
                "length bucket %d: compiled shapes %d of at most %d (%s)", length,
                len(self.lengths_seen), len(self.buckets), sorted(self.lengths_seen),
            )  # fmt: skip
        return batch

    def meta(self) -> dict[str, Any]:
        return {
            "task": self.config.task,
            "head": heads.head_name(self.model),
            "num_labels": self.spec.num_labels,
            "config": json.loads(self.config.to_json_best_effort()),
            "init": self.report,
        }

    # ---------------------------------------------------------------------------- evaluation
    def evaluate(self, loop: Loop, params: PyTree) -> dict[str, Any]:
        """Scores every eval set (metrics prefixed by the set name when there are several) and
        keeps the results and predictions; returns the numeric ones as `eval_*`."""
        results: dict[str, Any] = {}
        self.predictions = []
        keys = self.kind.predict_inputs  # labels stay on the host
        for eval_set, features in zip(self.eval_sets, self.eval_features, strict=True):
            arrays = {k: features.arrays[k] for k in keys}
            # Shortest rows first, so that batches of alike lengths share a short bucket; the
            # outputs are put back in feature order below.
            order = self._eval_order(arrays)
            arrays = {k: v[order] for k, v in arrays.items()}
            gathered: dict[str, list[np.ndarray]] = {}
            for batch in eval_batches(arrays, self.config.eval_batch_size):
                real = batch.pop("example_weight") > 0
                rows = len(real)
                batch = self._cut(batch)
                out = fetch(loop.eval_step(params, loop.put(process_rows(batch), rows)))
                for k, v in out.items():
                    gathered.setdefault(k, []).append(self._uncut(k, np.asarray(v)[real]))
            outputs = {k: np.concatenate(v)[np.argsort(order)] for k, v in gathered.items()}
            metrics, predictions = self.kind.score(
                eval_set, features, outputs, self.config, self.spec
            )
            prefix = f"{eval_set.name}/" if len(self.eval_sets) > 1 else ""
            results.update({prefix + k: v for k, v in metrics.items()})
            results[prefix + "num_examples"] = len(eval_set.examples)
            self.predictions.append(predictions)
        self.results = results
        return {f"eval_{k}": v for k, v in results.items() if _is_number(v)}

    def _eval_order(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """Feature rows by real length (stable), or as they are without length buckets."""
        mask = arrays["input_mask"]
        if not self.config.length_buckets:
            return np.arange(len(mask))
        return np.argsort(mask.reshape(len(mask), -1).sum(axis=1), kind="stable")

    def _uncut(self, name: str, value: np.ndarray) -> np.ndarray:
        """An output of a cut batch with its sequence axis padded back to max_seq_length, as
        the head masks padding positions (`heads.MASKED_LOGIT`)."""
        width = self.config.max_seq_length - value.shape[-1]
        if name not in self.kind.sequence_outputs or width == 0:
            return value
        pad = [(0, 0)] * (value.ndim - 1) + [(0, width)]
        return np.pad(value, pad, constant_values=heads.MASKED_LOGIT)

    # ----------------------------------------------------------------------------- outputs
    def write_predictions(self) -> list[str]:
        """Each eval set's prediction files (the kind's; suffixed _<k> when there are several);
        returns the paths written."""
        written = []
        pairs = zip(self.eval_sets, self.predictions, strict=True)
        for k, (eval_set, preds) in enumerate(pairs):
            suffix = f"_{k}" if len(self.eval_sets) > 1 else ""
            written += self.kind.write_predictions(self.workdir, suffix, eval_set, preds)
        return written

    def data_report(self) -> dict[str, Any]:
        def read(stats: Any) -> dict[str, Any]:
            return {"read": stats.read, "kept": stats.kept, "skipped": dict(stats.skipped),
                    "first_skipped": dict(stats.first_skipped),  # where: "file:line"
                    "adjusted": dict(stats.adjusted)}  # fmt: skip

        return {
            "train": {
                "files": self.train_set.name,
                **read(self.train_set.stats),
                "featurization": self.train_features.stats.as_dict(),
            },
            "eval": [
                {"set": s.name, **read(s.stats), "featurization": f.stats.as_dict()}
                for s, f in zip(self.eval_sets, self.eval_features, strict=True)
            ],
        }

    def close(self) -> None:
        pass


def _fingerprint(features: Features) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the feature arrays."""
    digest = hashlib.sha256()
    for name in sorted(features.arrays):
        array = np.ascontiguousarray(features.arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finetune_and_evaluate(config: Any, workdir: str) -> dict[str, Any]:
    """Fine-tunes `config.init` on `config.task` and evaluates it; returns the eval results
    (also written to WORKDIR/eval_results.json; see the module docstring).

    Raises:
      ValueError: a bad config or data (before anything is compiled).
      TrainingDivergedError: a non-finite loss, gradient norm or parameter norm.
    """
    spec = validate_config(config)
    workdir = files.absolute(workdir)
    mesh = create_mesh(*mesh_layout(config))
    objective = FineTuning(config, workdir, spec, mesh)
    loop = Loop(objective, config, workdir, mesh)
    try:
        summary = loop.run()
    finally:
        loop.close()
    step = int(summary["step"])
    if summary["preempted"]:
        return {"task": config.task, "step": step, "preempted": True,
                "checkpoint_step": summary["checkpoint_step"]}  # fmt: skip
    results = {"task": config.task, "step": step, **objective.results}
    results["data"] = objective.data_report()
    results["init"] = objective.report
    results["preempted"] = False
    if jax.process_index() == 0:
        results["prediction_files"] = objective.write_predictions()
        files.write_json(files.as_path(workdir) / EVAL_RESULTS_FILE, results)
    numbers = {k: v for k, v in objective.results.items() if _is_number(v)}
    logging.info("eval: %s", ", ".join(f"{k} {v:.4g}" for k, v in numbers.items()))
    return results
