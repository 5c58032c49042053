"""ALBERT pretraining loop: `train_and_evaluate(config, workdir)`.

One step (paper Sec. 4.1): a global batch of masked sequence pairs → `AlbertForPreTraining` →
MLM + SOP (or NSP) loss → global-norm clip → LAMB with a per-layer trust ratio → new params.

How the pieces fit:
- The config is checked before anything is built or compiled (`validate_config`).
- Parameters and optimizer state are created directly in their sharded layout: `eval_shape`
  gives the boxed abstract params, their logical axes map to mesh shardings through
  `LOGICAL_AXIS_RULES`, and `jax.jit(init, out_shardings=...)` materializes each shard on its
  device (no host or single-device copy of the full model ever exists).
- The step is one `jax.jit` with explicit in/out shardings and the state donated.
- Metrics are fetched one step late: the host dispatches step s+1 before it waits for the
  numbers of step s, so the device never idles on Python. A non-finite loss, gradient norm or
  parameter norm stops the run; checkpoints are only written for states already checked finite.
- `jax.transfer_guard("disallow")` around the loop turns any implicit host↔device copy (a
  silent slowdown) into an error; batches are put on devices explicitly.
- Restarts are bit-exact: params, optimizer state and the input-pipeline position are restored,
  and randomness is `fold_in(key, step)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import checkpointing, flops, losses, metrics_writer, optim
from albert_jax.config import ModelConfig, model_config_from
from albert_jax.model import AlbertForPreTraining, init_params
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, create_mesh, resolve_mesh_shape

PyTree = Any

# Every field the loop reads; anything else in a config is a typo (see `validate_config`).
KNOWN_FIELDS: dict[str, tuple[str, ...]] = {
    "": (
        "size", "model", "objective", "data", "batch_size", "seq_len",
        "max_predictions_per_seq", "microbatches", "optimizer", "learning_rate",
        "warmup_steps", "num_train_steps", "lr_poly_power", "weight_decay", "grad_clip_norm",
        "b1", "b2", "eps", "mesh", "seed", "log_every_steps", "eval_every_steps",
        "eval_batches", "checkpoint_every_steps", "keep_checkpoints", "resume_from",
        "init_from", "debug",
    ),
    "data": (
        "sources", "data_dir", "cache_dir", "tokenizer", "short_seq_prob", "masked_lm_prob",
        "max_ngram", "num_workers", "eval_split", "tokenizer_max_sentences",
        "sop_single_segment",
    ),
    "mesh": ("data", "fsdp", "tensor"),
    "debug": ("sigterm_after_step", "sigkill_after_save_at_step", "nan_at_step"),
}  # fmt: skip
OBJECTIVES = ("sop", "nsp", "none")


class TrainingDivergedError(FloatingPointError):
    """A non-finite loss, gradient norm or parameter norm; names the step and last checkpoint."""


@flax.struct.dataclass
class TrainState:
    """step: int32 scalar (updates done); params: plain params tree; opt_state: optax state."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree


# ----------------------------------------------------------------------------------------------
# Config validation


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return default
    return default if node is None else node


def _keys(node: Any) -> list[str]:
    return list(node.keys()) if hasattr(node, "keys") else []


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """What `validate_config` derives: the model config and the mesh to build."""

    model_config: ModelConfig
    mesh_shape: tuple[int, int, int]
    devices: tuple[Any, ...]


def validate_config(config: Any) -> RunLayout:
    """Checks a pretraining config against itself and the devices; nothing is compiled.

    Raises:
      ValueError naming the field and the fix: unknown fields, bad model fields, seq_len >
      max_position_embeddings, max_predictions_per_seq > seq_len, a batch that does not split
      over the data-parallel devices, processes and microbatches, a mesh that does not fit the
      devices, bad optimizer or data fields.
    """
    if "task" in _keys(config):
        raise ValueError("config has a `task` field: that is a fine-tuning config (finetune.py)")
    for section, allowed in KNOWN_FIELDS.items():
        node = config if not section else _get(config, section, {})
        unknown = sorted(set(_keys(node)) - set(allowed))
        if unknown:
            where = f"config.{section}." if section else "config."
            raise ValueError(
                f"unknown field(s) {[where + k for k in unknown]}; known fields of "
                f"{where.rstrip('.')}: {sorted(allowed)}"
            )
    model_config = model_config_from(config)
    objective = _get(config, "objective")
    if objective not in OBJECTIVES:
        raise ValueError(f"config.objective={objective!r} must be one of {OBJECTIVES}")

    def positive(name: str, minimum: int = 1) -> int:
        value = _get(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"config.{name} must be an integer >= {minimum}, got {value!r}")
        return value

    for name in ("num_train_steps", "log_every_steps", "checkpoint_every_steps",
                 "keep_checkpoints", "eval_batches", "seq_len", "max_predictions_per_seq",
                 "batch_size", "microbatches"):  # fmt: skip
        positive(name)
    for name in ("warmup_steps", "eval_every_steps", "seed"):
        positive(name, minimum=0)
    seq_len, batch = config.seq_len, config.batch_size
    if seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"config.seq_len={seq_len} exceeds config.model.max_position_embeddings="
            f"{model_config.max_position_embeddings}: lower seq_len or raise "
            "max_position_embeddings"
        )
    if config.max_predictions_per_seq > seq_len:
        raise ValueError(
            f"config.max_predictions_per_seq={config.max_predictions_per_seq} exceeds "
            f"config.seq_len={seq_len}: lower it (the paper uses 20 at seq_len 512)"
        )
    mesh_shape, devices = _mesh_layout(config)
    dp = mesh_shape[0] * mesh_shape[1]
    processes, micro = jax.process_count(), config.microbatches
    if batch % dp:
        raise ValueError(
            f"config.batch_size={batch} is not divisible by the data-parallel size "
            f"data×fsdp={mesh_shape[0]}×{mesh_shape[1]}={dp}: use a multiple of {dp} "
            "or change config.mesh"
        )
    if batch % (processes * micro):
        raise ValueError(
            f"config.batch_size={batch} is not divisible by process_count×microbatches="
            f"{processes}×{micro}: use a multiple of {processes * micro}"
        )
    if (batch // micro) % dp:
        raise ValueError(
            f"config.microbatches={micro}: each microbatch of {batch // micro} sequences must "
            f"split over the {dp} data-parallel devices; use fewer microbatches or a larger "
            "batch_size"
        )
    optim.make_optimizer(config)  # optimizer fields (names the bad one)
    from albert_jax.data.pipeline import DataConfig

    DataConfig.from_config(config).validate(processes)
    return RunLayout(model_config, mesh_shape, devices)


def _mesh_layout(config: Any) -> tuple[tuple[int, int, int], tuple[Any, ...]]:
    shape = tuple(int(_get(config, f"mesh.{axis}", 1)) for axis in ("data", "fsdp", "tensor"))
    devices = jax.devices()
    known = math.prod(shape)
    # An explicit mesh smaller than the host (e.g. (1,1,1) on 8 devices) uses the first devices:
    # handy for single-device baselines; never across processes, where every host must take part.
    if -1 not in shape and known < len(devices) and jax.process_count() == 1 and known > 0:
        devices = devices[:known]
    try:
        resolved = resolve_mesh_shape(shape, len(devices))
    except ValueError as e:
        raise ValueError(f"config.mesh (data, fsdp, tensor)={shape}: {e}") from None
    return resolved, tuple(devices)  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# Tokenizer and data


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _find_tokenizer(directory: str | None) -> str | None:
    if not directory:
        return None
    path = epath.Path(directory) / checkpointing.TOKENIZER_FILE
    return str(path) if path.is_file() else None


def _train_tokenizer_texts(config: Any) -> Any:
    """Sentences of the train split, at most `tokenizer_max_sentences`, split by source weight."""
    from albert_jax.data import sentences, sources

    limit = int(_get(config, "data.tokenizer_max_sentences", 1_000_000))
    for src in sources.parse_sources(config.data.sources):
        quota = max(1, math.ceil(limit * src.weight))
        docs = sources.iter_documents(src, split="train", data_dir=_get(config, "data.data_dir"))
        for doc in docs:
            for sentence in sentences.split_sentences(doc["text"]):
                yield sentence
                quota -= 1
            if quota <= 0:
                break


def _write_atomically(target: str, data: bytes) -> None:
    """A reader never sees half a file: temp file + rename locally; object stores (gs://)
    publish whole objects anyway."""
    if not metrics_writer.is_local(target):
        epath.Path(target).write_bytes(data)
        return
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(target) + ".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, target)


def prepare_tokenizer(config: Any, workdir: str, extra_dirs: tuple[str | None, ...] = ()) -> Any:
    """The run's tokenizer, saved as WORKDIR/tokenizer.model (what `load_pretrained` reads).

    Order: `config.data.tokenizer`; a tokenizer already in the workdir; one found in
    `extra_dirs` (the resume_from / init_from runs); else trained on the sources on first use
    (process 0; vocabulary = config.model.vocab_size; atomic write, the others wait).
    """
    from albert_jax.data.tokenizer import Tokenizer, train_tokenizer

    target = str(epath.Path(workdir) / checkpointing.TOKENIZER_FILE)
    given = _get(config, "data.tokenizer")
    if given and not epath.Path(given).is_file():
        raise ValueError(f"config.data.tokenizer={given!r} does not exist")
    source = given or _find_tokenizer(workdir)
    for directory in extra_dirs:
        source = source or _find_tokenizer(directory)
    if jax.process_index() == 0:
        if source is None:
            vocab = model_config_from(config).vocab_size
            logging.info(
                "training a %d-piece sentencepiece model on %s", vocab, config.data.sources
            )
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                trained = train_tokenizer(
                    _train_tokenizer_texts(config),
                    os.path.join(tmp, "tokenizer"),
                    vocab_size=vocab,
                    max_sentences=int(_get(config, "data.tokenizer_max_sentences", 1_000_000)),
                    seed=config.seed,
                )
                _write_atomically(target, epath.Path(trained).read_bytes())
            logging.info("tokenizer trained in %.1fs: %s", time.perf_counter() - start, target)
        elif source != target:
            _write_atomically(target, epath.Path(source).read_bytes())
    _barrier("tokenizer")
    return Tokenizer(model_proto=epath.Path(target).read_bytes())


def _build_sources(config: Any) -> None:
    """Prepares local TFDS datasets once (process 0) before every process reads them."""
    from albert_jax.data import sources

    if jax.process_index() == 0:
        for src in sources.parse_sources(config.data.sources):
            if src.is_local:
                sources.build_source(src, data_dir=_get(config, "data.data_dir"))
    _barrier("sources")


def _put(batch: Mapping[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Host batch → global sharded arrays (explicit transfer, allowed by the transfer guard)."""
    if jax.process_count() == 1:
        return jax.device_put(dict(batch), sharding)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def majority_accuracies(batches: list[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """Accuracy of always predicting the most frequent masked token / SOP label of these
    batches: an upper bound on any constant predictor, the baseline the model must beat."""
    ids = np.concatenate([b["masked_lm_ids"].ravel() for b in batches])
    weights = np.concatenate([b["masked_lm_weights"].ravel() for b in batches])
    counts = np.bincount(ids[weights > 0])
    labels = np.concatenate([b["sentence_order_label"] for b in batches])
    return {
        "eval_mlm_majority_accuracy": float(counts.max() / max(1, counts.sum())),
        "eval_sop_majority_accuracy": float(np.bincount(labels).max() / max(1, len(labels))),
    }


# ----------------------------------------------------------------------------------------------
# State, step and evaluation


def create_train_state(
    config: Any, model: AlbertForPreTraining, mesh: Mesh
) -> tuple[optax.GradientTransformation, TrainState, TrainState, Callable[..., TrainState]]:
    """Optimizer, abstract state (ShapeDtypeStructs), state shardings and a sharded initializer.

    Must run under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`.
    """
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    init_vars = lambda rng: init_params(model, rng, batch_size=dp, seq_len=8)["params"]
    rng = jax.random.key(config.seed)
    boxed = jax.eval_shape(init_vars, rng)
    param_shardings = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(boxed), mesh, LOGICAL_AXIS_RULES
    )
    # LAMB's trust ratio is per layer for stacked (unshared) weights, read off the logical axes.
    tx = optim.make_optimizer(config, stacked=optim.stacked_from_logical_axes(boxed))
    # `.value`, not nn.meta.unbox: unbox would add a sharding constraint to a ShapeDtypeStruct.
    abstract_params = jax.tree.map(
        lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
        boxed,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Moments follow their parameter's sharding; counters and hyperparameters are replicated.
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_opt,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt
    )

    def initialize(params: PyTree | None = None) -> TrainState:
        """Fresh state; `params` (already sharded) replace the random init (init_from)."""
        if params is None:
            init = jax.jit(lambda r: nn.meta.unbox(init_vars(r)), out_shardings=param_shardings)
            params = init(rng)
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
        step = jax.device_put(np.int32(0), replicated)
        return TrainState(step=step, params=params, opt_state=opt_state)

    return tx, abstract, shardings, initialize


def _model_inputs(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, ...]:
    return (
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        batch["masked_lm_positions"],
    )


def make_train_step(
    config: Any, model: AlbertForPreTraining, tx: optax.GradientTransformation
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """(state, batch) → (state after one LAMB update, scalar metrics)."""
    sentence_order = config.objective != "none"
    microbatches = config.microbatches
    dropout_key = jax.random.key(config.seed + 1)  # independent of the init key

    def loss_fn(params: PyTree, batch: dict[str, jax.Array], rng: jax.Array | None):
        outputs = model.apply(
            {"params": params}, *_model_inputs(batch), deterministic=False, rngs={"dropout": rng}
        )
        return losses.pretraining_loss(outputs, batch, sentence_order=sentence_order)

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        rng = jax.random.fold_in(dropout_key, state.step)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        _, metrics, grads = optim.accumulate_gradients(
            grad_fn, state.params, batch, microbatches, rng
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            **metrics,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "learning_rate": optim.current_learning_rate(opt_state),
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(config: Any, model: AlbertForPreTraining) -> Callable:
    """(params, batch) → sums over the batch, so that batches of any count combine exactly."""
    sentence_order = config.objective != "none"

    def eval_step(params: PyTree, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        outputs = model.apply({"params": params}, *_model_inputs(batch), deterministic=True)
        _, m = losses.pretraining_loss(outputs, batch, sentence_order=sentence_order)
        predictions = jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))
        sequences = jnp.float32(batch["input_ids"].shape[0])
        return {
            "mlm_loss": m["mlm_loss"] * predictions,
            "mlm_correct": m["mlm_accuracy"] * predictions,
            "predictions": predictions,
            "sop_loss": m["sop_loss"] * sequences,
            "sop_correct": m["sop_accuracy"] * sequences,
            "sequences": sequences,
        }

    return eval_step


def _eval_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    predictions, sequences = max(sums["predictions"], 1e-9), max(sums["sequences"], 1e-9)
    mlm_loss, sop_loss = sums["mlm_loss"] / predictions, sums["sop_loss"] / sequences
    return {
        "eval_loss": mlm_loss + sop_loss,
        "eval_mlm_loss": mlm_loss,
        "eval_sop_loss": sop_loss,
        "eval_mlm_accuracy": sums["mlm_correct"] / predictions,
        "eval_sop_accuracy": sums["sop_correct"] / sequences,
    }


# ----------------------------------------------------------------------------------------------
# Restoring


def _load_params_only(path: str, abstract_params: PyTree, shardings: PyTree) -> PyTree:
    """Params of another model (any layout `load_pretrained` reads), placed in our shardings."""
    from albert_jax.pretrained import load_pretrained

    loaded = load_pretrained(path).params["params"]
    flat_expected = {optim.path_to_str(p): x for p, x in jax.tree.leaves_with_path(abstract_params)}
    flat_loaded = {optim.path_to_str(p): x for p, x in jax.tree.leaves_with_path(loaded)}
    problems = [f"missing {k}" for k in flat_expected if k not in flat_loaded]
    problems += [
        f"{k}: checkpoint {tuple(flat_loaded[k].shape)}, model {tuple(x.shape)}"
        for k, x in flat_expected.items()
        if k in flat_loaded and tuple(flat_loaded[k].shape) != tuple(x.shape)
    ]
    if problems:
        raise ValueError(
            f"config.init_from={path!r} does not fit the model of this config: "
            + "; ".join(problems[:10])
            + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else "")
        )
    tree = jax.tree.map(lambda x, a: np.asarray(x, a.dtype), loaded, abstract_params)
    return jax.device_put(tree, shardings)


def _data_state_for_save(iterator: Any) -> dict[str, Any]:
    """Every process's pipeline state (JsonSave writes on process 0 only, so gather first)."""
    state = iterator.get_state()
    if jax.process_count() == 1:
        return {"process_count": 1, "states": [state]}
    encoded = np.frombuffer(json.dumps(state).encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.int32(len(encoded)))))
    padded = np.zeros(length, np.uint8)
    padded[: len(encoded)] = encoded
    gathered = multihost_utils.process_allgather(padded)
    states = [json.loads(bytes(row).rstrip(b"\0").decode()) for row in np.asarray(gathered)]
    return {"process_count": jax.process_count(), "states": states}


def _positioned_iterator(make_iterator: Callable[[int], Any], saved: Any, step: int) -> Any:
    """The training iterator at `step`: from the saved pipeline state when it fits (O(1)), else
    built at `start_step=step`, which recounts the position (the batch of a step is a pure
    function of the step), e.g. after a change of process count or data config."""
    iterator = make_iterator(0)
    states = saved.get("states") if isinstance(saved, Mapping) else None
    if states and saved.get("process_count") == jax.process_count():
        try:
            iterator.set_state(states[jax.process_index()])
            if iterator.step == step:
                return iterator
            logging.warning("saved data state is at step %d, not %d", iterator.step, step)
        except ValueError as e:
            logging.warning("saved data state not usable (%s)", e)
    logging.warning("recomputing the input position of step %d", step)
    iterator.close()
    return make_iterator(step)


# ----------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class _Pending:
    """Metrics of a dispatched step, fetched one step later."""

    step: int
    metrics: dict[str, jax.Array]
    eval: dict[str, float] | None = None


def train_and_evaluate(config: Any, workdir: str) -> dict[str, Any]:
    """Pretrains ALBERT as `config` says; writes checkpoints, metrics and the tokenizer to
    `workdir`. Returns the metrics of the last logged step (plus `eval_*` of the last
    evaluation) and `preempted` (True when SIGTERM / a preemption notice stopped the run after
    saving; the caller should exit 0 so that a restart resumes).

    Raises:
      ValueError: a bad config (before anything is compiled).
      TrainingDivergedError: a non-finite loss, gradient norm or parameter norm.
    """
    layout = validate_config(config)
    model_config = layout.model_config
    workdir = checkpointing.absolute(workdir)
    if jax.process_index() == 0:
        epath.Path(workdir).mkdir(parents=True, exist_ok=True)
        (epath.Path(workdir) / "config.json").write_text(
            config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
        )

    plan = checkpointing.plan_resume(workdir, config.resume_from, config.init_from)
    logging.info("start: %s", plan)
    _build_sources(config)
    tokenizer = prepare_tokenizer(config, workdir, (config.resume_from, config.init_from))
    if tokenizer.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={model_config.vocab_size} but the tokenizer "
            f"{workdir}/{checkpointing.TOKENIZER_FILE} has {tokenizer.vocab_size} pieces: set "
            f"--config.model.vocab_size={tokenizer.vocab_size} or use another tokenizer"
        )
    mesh = create_mesh(layout.mesh_shape, devices=layout.devices)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        return _run(config, workdir, model_config, mesh, tokenizer, plan)


def _run(
    config: Any,
    workdir: str,
    model_config: ModelConfig,
    mesh: Mesh,
    tokenizer: Any,
    plan: checkpointing.ResumePlan,
) -> dict[str, Any]:
    trainer = _Trainer(config, workdir, model_config, mesh, tokenizer, plan)
    try:
        return trainer.run()
    finally:
        trainer.close()


def _peak_flops(model_config: ModelConfig, mesh: Mesh) -> tuple[float | None, int]:
    """(peak FLOP/s of one chip or None if unknown, number of chips that share the work)."""
    device = mesh.devices.flat[0]
    dtype = "bfloat16" if model_config.dtype == "bfloat16" else "float32"
    try:
        peak = flops.device_peak_flops(device, dtype)
    except ValueError as e:
        logging.warning("no MFU: %s", e)
        return None, 0
    # Virtual CPU devices of one process share the same cores: the host is the "chip".
    chips = jax.process_count() if device.platform == "cpu" else mesh.size
    return peak, chips


class _Trainer:
    """One run: state, compiled functions, data, checkpoints and metrics, between steps.

    Built and run under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(LOGICAL_AXIS_RULES)`.
    """

    LOG_KEYS = ("loss", "mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy",
                "learning_rate", "grad_norm", "param_norm")  # fmt: skip

    def __init__(
        self,
        config: Any,
        workdir: str,
        model_config: ModelConfig,
        mesh: Mesh,
        tokenizer: Any,
        plan: checkpointing.ResumePlan,
    ):
        from albert_jax.data import pipeline

        self.config, self.workdir, self.model_config = config, workdir, model_config
        self.total_steps = config.num_train_steps
        model = AlbertForPreTraining(model_config)
        self.tx, self.abstract, self.shardings, self._initialize = create_train_state(
            config, model, mesh
        )
        self.batch_sharding = batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.tokenizer_fingerprint = tokenizer.fingerprint

        # --- data: training stream and a fixed held-out set (already on the devices)
        data_cfg = pipeline.DataConfig.from_config(config)
        doc_sources = pipeline.sources_from_spec(data_cfg.sources, data_cfg.data_dir)
        where = dict(process_index=jax.process_index(), process_count=jax.process_count())
        self._make_iterator = lambda start_step: pipeline.PretrainingIterator(
            data_cfg, tokenizer, doc_sources, split="train", start_step=start_step, **where
        )
        self.eval_batches: list[dict[str, jax.Array]] = []
        self.baselines: dict[str, float] = {}
        if config.eval_every_steps > 0:
            held_out = list(
                pipeline.make_eval_iterator(
                    data_cfg, tokenizer, split=config.data.eval_split,
                    num_batches=config.eval_batches, sources=doc_sources, **where,
                )
            )  # fmt: skip
            self.baselines = majority_accuracies(held_out)
            self.eval_batches = [_put(b, self.batch_sharding) for b in held_out]

        # --- checkpoints, metrics and the starting state
        self.checkpointer = checkpointing.Checkpointer(
            workdir, every_steps=config.checkpoint_every_steps, keep=config.keep_checkpoints
        )
        self.writer = metrics_writer.MetricsWriter(workdir, enabled=jax.process_index() == 0)
        self.iterator: Any = None
        self.state, self.start_step = self._restore_or_initialize(plan)

        # --- the compiled step and evaluation
        self.train_step = jax.jit(
            make_train_step(config, model, self.tx),
            in_shardings=(self.shardings, self.batch_sharding),
            out_shardings=(self.shardings, self.replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            make_eval_step(config, model),
            in_shardings=(self.shardings.params, self.batch_sharding),
            out_shardings=self.replicated,
        )

        # --- throughput bookkeeping
        self.flops_per_step = flops.train_flops_per_step(
            model_config, config.batch_size, config.seq_len, config.max_predictions_per_seq
        )
        self.peak, self.chips = _peak_flops(model_config, mesh)
        self._interval: tuple[int, float] | None = None  # (step, time) where it started
        self._excluded = 0.0  # seconds of eval / checkpointing inside the interval
        self._last_record: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ starting
    def _restore_or_initialize(self, plan: checkpointing.ResumePlan) -> tuple[TrainState, int]:
        if plan.kind == "init_from":
            params = _load_params_only(plan.path or "", self.abstract.params, self.shardings.params)
            self.writer.rewind(0)
            self.iterator = self._make_iterator(0)
            logging.info("params initialized from %s", plan.path)
            return self._initialize(params), 0
        if plan.kind == "scratch":
            self.writer.rewind(0)  # lines of an earlier attempt that never checkpointed
            self.iterator = self._make_iterator(0)
            return self._initialize(), 0
        targets = (
            checkpointing.abstract_like(self.abstract.params, self.shardings.params),
            checkpointing.abstract_like(self.abstract.opt_state, self.shardings.opt_state),
        )
        assert plan.step is not None and plan.path is not None
        if plan.kind == "workdir":
            restored = self.checkpointer.restore(plan.step, *targets)
        else:  # resume_from: another run's full state; we go on saving into our workdir
            with checkpointing.Checkpointer(plan.path, read_only=True) as other:
                restored = other.restore(plan.step, *targets)
        state = TrainState(
            step=jax.device_put(np.int32(restored.step), self.replicated),
            params=restored.params,
            opt_state=restored.opt_state,
        )
        self.iterator = _positioned_iterator(self._make_iterator, restored.data, restored.step)
        dropped = self.writer.rewind(restored.step)
        logging.info("resumed at step %d from %s (%s); dropped %d stale metric lines",
                     restored.step, plan.path, plan.kind, dropped)  # fmt: skip
        return state, restored.step

    # ----------------------------------------------------------------------------------- loop
    def run(self) -> dict[str, Any]:
        config, total = self.config, self.total_steps
        sigterm_after = int(_get(config, "debug.sigterm_after_step", 0))
        sigkill_after_save = int(_get(config, "debug.sigkill_after_save_at_step", 0))
        nan_at = int(_get(config, "debug.nan_at_step", 0))
        single_process = jax.process_count() == 1
        if self.start_step >= total:
            logging.info("nothing to do: step %d >= num_train_steps %d", self.start_step, total)
            records = metrics_writer.read_metrics(self.workdir)
            return {**(records[-1] if records else {}), "step": self.start_step,
                    "preempted": False}  # fmt: skip

        preempted = False
        pending: _Pending | None = None
        signal_flag = checkpointing.PreemptionSignal() if single_process else None
        logging.info("training steps %d..%d", self.start_step + 1, total)
        with signal_flag or contextlib.nullcontext(), jax.transfer_guard("disallow"):
            for step in range(self.start_step + 1, total + 1):  # `step` = updates done after it
                host_batch = next(self.iterator)
                if step == nan_at:  # debugging hook: NaN weights make the MLM loss NaN
                    weights = np.full_like(host_batch["masked_lm_weights"], np.nan)
                    host_batch = {**host_batch, "masked_lm_weights": weights}
                batch = _put(host_batch, self.batch_sharding)
                self.state, metrics = self.train_step(self.state, batch)
                # Step `step` is queued; only now wait for the numbers of the one before.
                if pending is not None:
                    self._finish(pending)
                pending = _Pending(step, metrics)
                if self._eval_due(step):
                    pending.eval = self._evaluate()
                if step == sigterm_after:
                    os.kill(os.getpid(), signal.SIGTERM)
                preempted = signal_flag is not None and signal_flag.requested
                if preempted or step == total or self.checkpointer.should_save(step):
                    self._finish(pending)  # never checkpoint a state not checked finite
                    pending = None
                    self._save(step, force=preempted or step == total)
                    if step == sigkill_after_save:
                        os.kill(os.getpid(), signal.SIGKILL)
                if not single_process and self.checkpointer.reached_preemption(step):
                    preempted = True
                if preempted:
                    logging.warning("preempted: checkpoint of step %d saved, exiting", step)
                    break
            if pending is not None:
                self._finish(pending)
        self.checkpointer.wait()
        if not preempted and jax.process_index() == 0:
            metrics_writer.plot_learning_curve(self.workdir)
        return {**self._last_record, "step": step, "preempted": preempted,
                "checkpoint_step": self.checkpointer.latest_step()}  # fmt: skip

    def _eval_due(self, step: int) -> bool:
        every = self.config.eval_every_steps
        return bool(every) and (step % every == 0 or step == self.total_steps)

    def _evaluate(self) -> dict[str, float]:
        jax.block_until_ready(self.state.params)  # the training step is not eval time
        start = time.perf_counter()
        sums: dict[str, jax.Array] | None = None
        for batch in self.eval_batches:
            out = self.eval_step(self.state.params, batch)
            sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
        values = {k: float(v) for k, v in jax.device_get(sums).items()}
        self._excluded += time.perf_counter() - start
        return {**_eval_metrics(values), **self.baselines}

    def _save(self, step: int, force: bool) -> None:
        start = time.perf_counter()
        meta = {
            "model_config": self.model_config.to_dict(),
            "step": step,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "config": json.loads(self.config.to_json_best_effort()),
        }
        # Gathering the per-process data states is an explicit, rare transfer.
        with jax.transfer_guard("allow"):
            self.checkpointer.save(
                step,
                params=self.state.params,
                opt_state=self.state.opt_state,
                data=_data_state_for_save(self.iterator),
                meta=meta,
                force=force,
            )
        self._excluded += time.perf_counter() - start

    def _finish(self, pending: _Pending) -> None:
        """Fetches a step's metrics, stops on non-finite values, logs on log steps."""
        values = {k: float(v) for k, v in jax.device_get(pending.metrics).items()}
        bad = [k for k in ("loss", "grad_norm", "param_norm") if not math.isfinite(values[k])]
        if bad:
            self._diverged(pending.step, values, bad)
        now = time.perf_counter()
        if self._interval is None:  # the first step includes compilation: start timing after it
            self._interval = (pending.step, now)
            self._excluded = 0.0
        is_log_step = pending.step % self.config.log_every_steps == 0
        if not (is_log_step or pending.step == self.total_steps or pending.eval):
            return
        record: dict[str, Any] = {k: values[k] for k in self.LOG_KEYS}
        first_step, first_time = self._interval
        rate = mfu = eta = None
        if pending.step > first_step:
            step_time = max(now - first_time - self._excluded, 1e-9) / (pending.step - first_step)
            rate = self.config.batch_size / step_time
            eta = step_time * (self.total_steps - pending.step)
            if self.peak:
                mfu = flops.mfu(self.flops_per_step, step_time, self.chips, self.peak)
        self._interval, self._excluded = (pending.step, now), 0.0
        record["examples_per_sec"] = rate
        record["mfu"] = mfu
        record.update(pending.eval or {})
        self.writer.write(pending.step, record)
        self._last_record = record
        logging.info(metrics_writer.progress_line(pending.step, self.total_steps, record, eta))

    def _diverged(self, step: int, values: dict[str, float], bad: list[str]) -> None:
        self.checkpointer.wait()  # the last good checkpoint must be committed before we name it
        last = self.checkpointer.latest_step()
        where = (
            f"{self.checkpointer.step_dir(last)} (step {last})"
            if last is not None
            else "none (no checkpoint was saved before it)"
        )
        self.writer.write(step, {k: values[k] for k in self.LOG_KEYS})
        raise TrainingDivergedError(
            f"non-finite {', '.join(bad)} at step {step} (loss={values['loss']}, "
            f"grad_norm={values['grad_norm']}, param_norm={values['param_norm']}); last good "
            f"checkpoint: {where}. Lower config.learning_rate (or check the data) and restart."
        )

    def close(self) -> None:
        if self.iterator is not None:
            self.iterator.close()
        self.checkpointer.close()
        self.writer.close()
