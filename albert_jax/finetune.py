"""Fine-tuning and evaluation: `finetune_and_evaluate(config, workdir)`.

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
SIGTERM (caught by the loop in a single process; with several processes, JAX's preemption
service makes them agree on a step, which Orbax reports) saves a checkpoint at a step boundary
and returns `{"preempted": True, ...}` without evaluating (a notice during the last step just
lets the run finish); `checkpoint_every_steps` adds periodic saves for crashes without a notice.

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

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import checkpointing, heads, metrics_writer, optim
from albert_jax.config import ModelConfig
from albert_jax.convert import unflatten_params
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, create_mesh
from albert_jax.tasks import registry
from albert_jax.tasks.batching import Features, eval_batches, train_batch
from albert_jax.tasks.kinds import TaskKind, get_kind
from albert_jax.tasks.local import ReadStats
from albert_jax.tasks.registry import TaskSpec
from albert_jax.train_config import mesh_layout
from albert_jax.train_step import TrainState, put_batch

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
# ModelConfig fields a fine-tuning config may change on a pretrained model; the others define
# the architecture and come from the checkpoint.
RUNTIME_MODEL_FIELDS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dtype",
    "param_dtype",
    "remat_policy",
    "scan_layers",
)


# Every field the loop reads; anything else in a config is a typo (see `validate_config`).
KNOWN_FIELDS: dict[str, tuple[str, ...]] = {
    "": (
        "task", "init", "size", "model", "classifier_dropout", "data", "max_seq_length",
        "max_qa_length", "max_query_length", "doc_stride", "max_answer_length", "n_best_size",
        "start_n_top", "end_n_top", "null_threshold", "optimizer", "learning_rate", "batch_size",
        "eval_batch_size", "num_train_steps", "num_train_epochs", "warmup_steps",
        "warmup_fraction", "lr_poly_power", "weight_decay", "grad_clip_norm", "b1", "b2", "eps",
        "mesh", "seed", "log_every_steps", "eval_every_steps", "checkpoint_every_steps",
        "keep_checkpoints", "debug",
    ),
    "data": (
        "train_files", "eval_files", "data_dir", "train_split", "eval_split", "race_levels",
        "tokenizer", "max_train_examples", "max_eval_examples",
    ),
    "mesh": ("data", "fsdp", "tensor"),
    "debug": ("sigterm_after_step",),
}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Config


def _keys(node: Any) -> set[str]:
    return set(node.keys()) if hasattr(node, "keys") else set()


def validate_config(config: Any) -> TaskSpec:
    """Checks a fine-tuning config before anything is read or compiled.

    Raises ValueError naming the field: unknown fields (see KNOWN_FIELDS; configs/finetune.py
    sets exactly these), an unknown task, bad sizes, non-positive steps or batch sizes.
    """
    spec = registry.get_task(config.task)
    for section, known in KNOWN_FIELDS.items():
        node = config if not section else config[section]
        unknown = sorted(_keys(node) - set(known))
        if unknown:
            where = f"config.{section}." if section else "config."
            names = [where + k for k in unknown]
            raise ValueError(f"unknown fields {names}; known: {sorted(known)}")
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(_keys(config.model) - model_fields)
    if unknown:
        raise ValueError(
            f"config.model has unknown fields {unknown}; known: {sorted(model_fields)}"
        )
    if config.init:
        fixed = sorted(_keys(config.model) - set(RUNTIME_MODEL_FIELDS))
        if fixed:
            raise ValueError(
                f"config.model.{fixed[0]} cannot change a pretrained model (init={config.init!r});"
                f" only {RUNTIME_MODEL_FIELDS} may be set"
            )
    for name in ("batch_size", "eval_batch_size", "max_seq_length", "log_every_steps"):
        if int(config[name]) < 1:
            raise ValueError(f"config.{name} must be >= 1, got {config[name]}")
    if config.num_train_epochs <= 0 and config.num_train_steps < 0:
        raise ValueError(f"config.num_train_steps must be >= 0, got {config.num_train_steps}")
    if not 0.0 <= config.classifier_dropout < 1.0:
        raise ValueError(
            f"config.classifier_dropout must be in [0, 1), got {config.classifier_dropout}"
        )
    if not 0.0 <= config.warmup_fraction < 1.0:
        raise ValueError(f"config.warmup_fraction must be in [0, 1), got {config.warmup_fraction}")
    return spec


def _model_config(
    config: Any, pretrained_config: ModelConfig | None, vocab_size: int
) -> ModelConfig:
    overrides = dict(config.model.to_dict() if hasattr(config.model, "to_dict") else config.model)
    if pretrained_config is not None:
        model_config = pretrained_config.replace(**overrides)
    else:
        overrides.setdefault("vocab_size", vocab_size)
        model_config = ModelConfig.preset(config.size, **overrides)
    if config.max_seq_length > model_config.max_position_embeddings:
        raise ValueError(
            f"config.max_seq_length={config.max_seq_length} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
        )
    if model_config.vocab_size < vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} pieces but the model only {model_config.vocab_size} "
            "embeddings: use the checkpoint's tokenizer (unset config.data.tokenizer)"
        )
    return model_config


# ----------------------------------------------------------------------------------------------
# Model, inputs and losses


def build_model(spec: TaskSpec, model_config: ModelConfig, config: Any) -> nn.Module:
    """The task model of `spec` (its kind's head, heads.py) with the config's head settings."""
    return get_kind(spec.kind).build_model(model_config, spec, config)


def _dummy_batch(spec: TaskSpec, features: Features, rows: int) -> dict[str, np.ndarray]:
    """{name: [rows, ...]} copies of the first feature's model inputs: the shapes of a batch."""
    arrays = features.arrays
    return {k: arrays[k][:1].repeat(rows, 0) for k in get_kind(spec.kind).model_inputs}


# ----------------------------------------------------------------------------------------------
# Parameters: sharded init and the pretrained backbone


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


def _flatten(tree: PyTree) -> dict[str, Any]:
    return {optim.path_to_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


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


def _head_weights_of(path: str) -> dict[str, np.ndarray]:
    """Task-head weights stored in one of our training checkpoints (another fine-tuning run);
    `load_pretrained` keeps only the pretraining model, so they are read here directly, as
    host arrays whatever mesh or device count wrote them."""
    from albert_jax.pretrained import detect_layout

    layout = detect_layout(path)
    if layout == "workdir":
        workdir, step = path, None
    elif layout == "step_dir":
        # WORKDIR/checkpoints/<step>: the manager of WORKDIR reads it.
        step_dir = os.path.abspath(path)
        parent, name = os.path.split(os.path.normpath(step_dir))
        if os.path.basename(parent) != checkpointing.CHECKPOINTS_DIR or not name.isdigit():
            logging.warning(
                "%s is a step dir outside a WORKDIR/%s/<step> layout: its task-head weights "
                "are not read (they are initialized and reported as missing)",
                path, checkpointing.CHECKPOINTS_DIR,
            )  # fmt: skip
            return {}
        workdir, step = os.path.dirname(parent), int(name)
    else:
        return {}
    with checkpointing.Checkpointer(workdir, read_only=True) as ckpt:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            return {}
        tree = ckpt.restore_numpy(step, "params")
    tree = tree.get("params", tree) if isinstance(tree, dict) else tree
    pretraining_parts = ("albert/", "predictions/", "sop_classifier/")
    return {k: v for k, v in _flatten(tree).items() if not k.startswith(pretraining_parts)}


def _load_checkpoint(config: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """(Pretrained, {path: array} of the weights the checkpoint really holds)."""
    from albert_jax.pretrained import load_pretrained

    pretrained = load_pretrained(config.init, seed=config.seed)
    flat = _flatten(pretrained.params["params"])
    # Parts load_pretrained had to initialize were not in the checkpoint.
    absent = tuple(part + "/" for part in pretrained.initialized)
    stored = {k: np.asarray(v) for k, v in flat.items() if not k.startswith(absent)}
    stored.update(_head_weights_of(config.init))
    return pretrained, stored


# ----------------------------------------------------------------------------------------------
# The run


def _check_batch(name: str, value: int, mesh: Mesh) -> None:
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    if value % split or value % jax.process_count():
        raise ValueError(
            f"config.{name}={value} must be divisible by the {split} data-parallel devices and "
            f"the {jax.process_count()} processes"
        )


def _put(batch: Mapping[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """A global host batch [B, ...] (every process reads all of it) -> global arrays; each
    process contributes its rows [p·B/n, (p+1)·B/n)."""
    global_batch = len(next(iter(batch.values())))
    rows, p = global_batch // jax.process_count(), jax.process_index()
    local = {k: v[p * rows : (p + 1) * rows] for k, v in batch.items()}
    return put_batch(local, sharding, global_batch)


def _fetch(tree: PyTree) -> PyTree:
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def _optimizer_config(config: Any, num_train_steps: int) -> dict[str, Any]:
    warmup = config.warmup_steps
    if config.warmup_fraction > 0:
        warmup = int(round(config.warmup_fraction * num_train_steps))
    warmup = min(int(warmup), num_train_steps)
    fields = ("optimizer", "learning_rate", "weight_decay", "grad_clip_norm", "b1", "b2", "eps",
              "lr_poly_power")  # fmt: skip
    return {
        **{k: config[k] for k in fields},
        "warmup_steps": warmup,
        "num_train_steps": max(num_train_steps, 1),
    }


class _FineTuner:
    """State, compiled functions, data and outputs of one fine-tuning run (under the mesh)."""

    def __init__(self, config: Any, workdir: str, spec: TaskSpec, mesh: Mesh):
        self.config, self.workdir, self.spec, self.mesh = config, workdir, spec, mesh
        self.is_main = jax.process_index() == 0
        _check_batch("batch_size", config.batch_size, mesh)
        _check_batch("eval_batch_size", config.eval_batch_size, mesh)

        # --- checkpoint, tokenizer and model config
        pretrained, self.stored = (None, {}) if not config.init else _load_checkpoint(config)
        self.tokenizer, tokenizer_path = self._tokenizer(pretrained)
        self.model_config = _model_config(
            config, pretrained.config if pretrained else None, self.tokenizer.vocab_size
        )
        self.init_source = (pretrained.source, config.init) if pretrained else ("scratch", "")
        self.model = build_model(spec, self.model_config, config)
        if self.is_main and tokenizer_path:
            target = os.path.join(workdir, checkpointing.TOKENIZER_FILE)
            if os.path.abspath(tokenizer_path) != target:
                shutil.copyfile(tokenizer_path, target)

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
        if len(self.train_features) == 0 and self._num_train_steps() > 0:
            raise ValueError(f"no training examples for task {config.task!r}")
        self.total_steps = self._num_train_steps()
        self.train_fingerprint = _fingerprint(self.train_features)
        self.tx = optim.make_optimizer(_optimizer_config(config, self.total_steps))
        self.batch_sharding = batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())

    # ------------------------------------------------------------------------------ helpers
    def _tokenizer(self, pretrained: Any) -> tuple[Any, str | None]:
        from albert_jax.data.tokenizer import Tokenizer

        path = self.config.data.tokenizer
        if path:
            if not os.path.isfile(path):
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

    def _features_for_init(self) -> Features:
        return self.train_features if len(self.train_features) else self.eval_features[0]

    @property
    def kind(self) -> TaskKind:
        """The task's kind (tasks/kinds.py): head, model inputs, loss, scoring, outputs."""
        return get_kind(self.spec.kind)

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

    def _check_data_state(self, saved: Any, step: int) -> None:
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

    # --------------------------------------------------------------------------- parameters
    def create_state(self) -> tuple[TrainState, TrainState, dict[str, Any] | None, int]:
        """(state, state shardings, init report (`InitReport.as_dict`; when resumed, the one
        saved by the first start, None in checkpoints that lack it), start step)."""
        spec, config = self.spec, self.config
        dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        dummy = _dummy_batch(spec, self._features_for_init(), dp)

        def init(rng: jax.Array) -> PyTree:
            return _init_variables(spec, self.model, rng, dummy)["params"]

        boxed = jax.eval_shape(init, jax.random.key(config.seed))
        param_shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(boxed), self.mesh, LOGICAL_AXIS_RULES
        )
        abstract = jax.tree.map(
            lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
            boxed,
            is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
        )
        abstract_opt = jax.eval_shape(self.tx.init, abstract)
        opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            abstract_opt,
            param_shardings,
            transform_non_params=lambda _: self.replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        shardings = TrainState(
            step=self.replicated, params=param_shardings, opt_state=opt_shardings
        )

        plan = checkpointing.plan_resume(self.workdir)
        if plan.kind == "workdir":
            with checkpointing.Checkpointer(self.workdir, read_only=True) as ckpt:
                restored = ckpt.restore(
                    plan.step,
                    checkpointing.abstract_like(abstract, param_shardings),
                    checkpointing.abstract_like(abstract_opt, opt_shardings),
                )
            self._check_data_state(restored.data, restored.step)
            step = jax.device_put(np.int32(restored.step), self.replicated)
            logging.info("resumed fine-tuning at step %d from %s", restored.step, self.workdir)
            state = TrainState(step=step, params=restored.params, opt_state=restored.opt_state)
            # The init report of the run's first start (what the checkpoint provided).
            return state, shardings, restored.meta.get("init"), restored.step

        key = jax.random.key(config.seed)
        if config.init:
            flat_abstract = _flatten(abstract)
            merged, loaded, missing, unexpected = merge_pretrained(flat_abstract, self.stored)
            flat_shardings = _flatten(param_shardings)

            def init_missing(rng: jax.Array) -> dict[str, jax.Array]:
                # Only the weights the checkpoint lacks (a task head): XLA drops the
                # initializers of everything else, whose random init would cost most of the
                # compilation; each kept weight gets the value a full init would give it.
                flat = _flatten(nn.meta.unbox(init(rng)))
                return {k: flat[k] for k in missing}

            initialized = {}
            if missing:
                out_shardings = {k: flat_shardings[k] for k in missing}
                initialized = jax.jit(init_missing, out_shardings=out_shardings)(key)
            placed = {
                k: initialized[k] if k in initialized
                else jax.device_put(np.asarray(v, flat_abstract[k].dtype), flat_shardings[k])
                for k, v in merged.items()
            }  # fmt: skip
            params = jax.tree.map(lambda _, x: x, abstract, unflatten_params(placed)["params"])
            source, path = self.init_source
            report = InitReport(path, source, loaded, missing, unexpected)
            logging.info("init from %s checkpoint %s: %d weights loaded", source, path, len(loaded))
            if missing:
                logging.warning(
                    "initialized %d weights the checkpoint lacks: %s", len(missing), missing
                )
            if unexpected:
                logging.warning("%d checkpoint weights unused: %s", len(unexpected), unexpected)
        else:
            init_all = jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=param_shardings)
            params = init_all(key)
            report = InitReport("", "scratch", [], sorted(_flatten(params)), [])
        opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(params)
        step = jax.device_put(np.int32(0), self.replicated)
        state = TrainState(step=step, params=params, opt_state=opt_state)
        return state, shardings, report.as_dict(), 0

    # -------------------------------------------------------------------------- step / eval
    def compile(self, shardings: TrainState) -> None:
        kind, model, tx = self.kind, self.model, self.tx
        dropout_key = jax.random.key(self.config.seed + 1)

        def loss_fn(params: PyTree, batch: dict[str, jax.Array], rng: jax.Array):
            outputs = kind.apply(model, params, batch, train=True, rng=rng)
            return kind.loss(outputs, batch)

        def train_step(state: TrainState, batch: dict[str, jax.Array]):
            rng = jax.random.fold_in(dropout_key, state.step)
            grads_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (_, metrics), grads = grads_fn(state.params, batch, rng)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {
                **metrics,
                "grad_norm": optax.tree.norm(grads),
                "learning_rate": optim.current_learning_rate(opt_state),
            }
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

        def predict(params: PyTree, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return kind.apply(model, params, batch, train=False)

        self.train_step = jax.jit(
            train_step,
            in_shardings=(shardings, self.batch_sharding),
            out_shardings=(shardings, self.replicated),
            donate_argnums=0,
        )
        self.predict = jax.jit(
            predict,
            in_shardings=(shardings.params, self.batch_sharding),
            out_shardings=self.batch_sharding,
        )

    def _train_batches(self, start_step: int) -> Iterator[dict[str, jax.Array]]:
        arrays = {k: self.train_features.arrays[k] for k in self.kind.model_inputs}
        for step in range(start_step, self.total_steps):
            batch = train_batch(arrays, step, self.config.batch_size, self.config.seed)
            yield _put(batch, self.batch_sharding)

    def evaluate(self, params: PyTree) -> tuple[dict[str, Any], list[Any]]:
        """Metrics of every eval set (prefixed by the set name when there are several) and the
        predictions of each set."""
        results: dict[str, Any] = {}
        all_predictions = []
        keys = self.kind.predict_inputs  # labels stay on the host
        for eval_set, features in zip(self.eval_sets, self.eval_features, strict=True):
            if not len(features):
                raise ValueError(f"eval set {eval_set.name!r} has no examples")
            arrays = {k: features.arrays[k] for k in keys}
            gathered: dict[str, list[np.ndarray]] = {}
            for batch in eval_batches(arrays, self.config.eval_batch_size):
                real = batch.pop("example_weight") > 0
                out = _fetch(self.predict(params, _put(batch, self.batch_sharding)))
                for k, v in out.items():
                    gathered.setdefault(k, []).append(np.asarray(v)[real])
            outputs = {k: np.concatenate(v) for k, v in gathered.items()}
            metrics, predictions = self.kind.score(
                eval_set, features, outputs, self.config, self.spec
            )
            prefix = f"{eval_set.name}/" if len(self.eval_sets) > 1 else ""
            results.update({prefix + k: v for k, v in metrics.items()})
            results[prefix + "num_examples"] = len(eval_set.examples)
            all_predictions.append(predictions)
        return results, all_predictions

    # ----------------------------------------------------------------------------- outputs
    def write_predictions(self, predictions: list[Any]) -> list[str]:
        """Each eval set's prediction files (the kind's; suffixed _<k> when there are several);
        returns the paths written."""
        written = []
        for k, (eval_set, preds) in enumerate(zip(self.eval_sets, predictions, strict=True)):
            suffix = f"_{k}" if len(self.eval_sets) > 1 else ""
            written += self.kind.write_predictions(self.workdir, suffix, eval_set, preds)
        return written

    def data_report(self) -> dict[str, Any]:
        def read(stats: Any) -> dict[str, Any]:
            return {"read": stats.read, "kept": stats.kept, "skipped": dict(stats.skipped),
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


def _fingerprint(features: Features) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the feature arrays."""
    digest = hashlib.sha256()
    for name in sorted(features.arrays):
        array = np.ascontiguousarray(features.arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _init_variables(
    spec: TaskSpec, model: nn.Module, rng: jax.Array, batch: Mapping[str, np.ndarray]
) -> PyTree:
    """Variables of the task model, initialized on a dummy batch of the real shapes."""
    return get_kind(spec.kind).init_variables(model, rng, batch)


def _write_json(path: str, content: Any) -> str:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def finetune_and_evaluate(config: Any, workdir: str) -> dict[str, Any]:
    """Fine-tunes `config.init` on `config.task` and evaluates it; returns the eval results
    (also written to WORKDIR/eval_results.json; see the module docstring).

    Raises:
      ValueError: a bad config or data (before anything is compiled).
      FloatingPointError: a non-finite training loss.
    """
    spec = validate_config(config)
    workdir = os.path.abspath(workdir)
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
    mesh = create_mesh(*mesh_layout(config))
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        return _run(_FineTuner(config, workdir, spec, mesh))


def _run(tuner: _FineTuner) -> dict[str, Any]:
    config, workdir = tuner.config, tuner.workdir
    state, shardings, report, start_step = tuner.create_state()
    tuner.compile(shardings)
    writer = metrics_writer.MetricsWriter(workdir, enabled=tuner.is_main)
    writer.rewind(start_step)  # metric lines past the checkpoint are redone
    total = tuner.total_steps
    every = config.checkpoint_every_steps or max(total, 1)
    checkpointer = checkpointing.Checkpointer(
        workdir, every_steps=every, keep=config.keep_checkpoints
    )
    meta = {
        "model_config": tuner.model_config.to_dict(),
        "task": config.task,
        "head": heads.head_name(tuner.model),
        "num_labels": tuner.spec.num_labels,
        "config": json.loads(config.to_json_best_effort()),
        "init": report,
    }
    sigterm_after = int(config.debug.sigterm_after_step)
    single_process = jax.process_count() == 1
    # Single process: SIGTERM sets a flag read at step boundaries. Multi-process: JAX's
    # preemption service owns SIGTERM and every process agrees on the save step (Orbax).
    signal_flag = checkpointing.PreemptionSignal() if single_process else None
    results: dict[str, Any] = {}
    preempted = False
    try:
        logging.info("fine-tuning %s: steps %d..%d", config.task, start_step + 1, total)
        interval_start, interval_step = time.perf_counter(), start_step
        step = start_step
        # Nothing else may be in flight when the steps start, and at most two steps are: each
        # step waits for the loss of the one before. (XLA:CPU runs the collectives of virtual
        # devices on a shared thread pool; a deep queue of multi-device programs can starve a
        # rendezvous until it aborts the process.)
        jax.block_until_ready(state)
        previous: tuple[int, jax.Array] | None = None
        with signal_flag or contextlib.nullcontext():
            for step, batch in enumerate(tuner._train_batches(start_step), start=start_step + 1):
                state, metrics = tuner.train_step(state, batch)
                if previous is not None:
                    _check_finite(*previous)
                previous = (step, metrics["loss"])
                if step == sigterm_after:  # debugging hook: a preemption notice after this step
                    checkpointing.send_preemption_notice()
                preempted = signal_flag is not None and signal_flag.requested
                log_now = step % config.log_every_steps == 0 or step == total
                eval_now = bool(config.eval_every_steps) and step % config.eval_every_steps == 0
                save_now = preempted or step == total or checkpointer.should_save(step)
                record: dict[str, Any] = {}
                if log_now or save_now or eval_now:
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    _check_finite(step, values["loss"])  # never checkpoint a non-finite state
                    now = time.perf_counter()
                    elapsed = max(now - interval_start, 1e-9)
                    rate = config.batch_size * (step - interval_step) / elapsed
                    interval_start, interval_step = now, step
                    record = {**values, "examples_per_sec": rate}
                if eval_now and step != total:
                    eval_results, _ = tuner.evaluate(state.params)
                    record.update(
                        {f"eval_{k}": v for k, v in eval_results.items() if _is_number(v)}
                    )
                if record:
                    writer.write(step, record)
                    logging.info("step %d/%d: %s", step, total, _short(record))
                if save_now:
                    checkpointer.save(
                        step, params=state.params, opt_state=state.opt_state,
                        data=tuner.data_state(step), meta={**meta, "step": step},
                        force=preempted or step == total,
                    )  # fmt: skip
                if not single_process and checkpointer.reached_preemption(step):
                    preempted = True
                if preempted:
                    if step < total:
                        logging.warning("preempted: checkpoint of step %d saved, exiting", step)
                        break
                    preempted = False  # the last step: finish the run normally
        if preempted:
            checkpointer.wait()
            return {"task": config.task, "step": step, "preempted": True,
                    "checkpoint_step": checkpointer.latest_step()}  # fmt: skip
        if total == 0 and start_step == 0:
            checkpointer.save(
                0, params=state.params, opt_state=state.opt_state, data=tuner.data_state(0),
                meta={**meta, "step": 0}, force=True,
            )  # fmt: skip
        eval_results, predictions = tuner.evaluate(state.params)
        writer.write(max(step, start_step), {f"eval_{k}": v for k, v in eval_results.items()
                                            if _is_number(v)})  # fmt: skip
        results = {"task": config.task, "step": int(max(step, start_step)), **eval_results}
        results["data"] = tuner.data_report()
        if report is not None:
            results["init"] = report
        elif os.path.exists(os.path.join(workdir, EVAL_RESULTS_FILE)):
            # A checkpoint written before init reports went into `meta`: the first attempt's.
            with open(os.path.join(workdir, EVAL_RESULTS_FILE), encoding="utf-8") as f:
                results["init"] = json.load(f).get("init")
        results["preempted"] = False
        if tuner.is_main:
            results["prediction_files"] = tuner.write_predictions(predictions)
            _write_json(os.path.join(workdir, EVAL_RESULTS_FILE), results)
        logging.info("eval: %s", _short({k: v for k, v in eval_results.items() if _is_number(v)}))
    finally:
        checkpointer.close()
        writer.close()
    return results


def _check_finite(step: int, loss: Any) -> None:
    loss = float(loss)
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"non-finite loss {loss} at step {step}; lower config.learning_rate"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(record: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
    )
