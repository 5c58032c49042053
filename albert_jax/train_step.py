"""The jitted pieces of pretraining: sharded state creation, the train step, the eval step.

One step (paper Sec. 4.1): a global batch of masked sequence pairs → `AlbertForPreTraining`
→ MLM + SOP (or NSP) loss → global-norm clip → LAMB with a per-layer trust ratio → new
params. Host batches become global arrays with `put_batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from albert_jax import flops, losses, optim
from albert_jax.model import AlbertForPreTraining, init_params
from albert_jax.sharding import LOGICAL_AXIS_RULES

PyTree = Any


@flax.struct.dataclass
class TrainState:
    """step: int32 scalar (updates done); params: plain params tree; opt_state: optax state."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree


def put_batch(
    batch: Mapping[str, np.ndarray], sharding: NamedSharding, global_batch: int
) -> dict[str, jax.Array]:
    """This process's rows [b, ...] → global arrays [global_batch, ...] sharded by `sharding`.

    With several processes each one passes its own rows (its data shards' batches);
    `make_array_from_process_local_data` puts them in the global rows that the process's devices
    hold, which the mesh decides: rows [p·b, (p+1)·b) for process p when the mesh lists devices
    in process order, as on CPU. (Losses are means over rows, so row order does not matter.)
    The explicit global shape turns a mesh that does not split the batch over the processes
    into an error instead of a silently smaller batch.
    """
    if jax.process_count() == 1:
        return jax.device_put(dict(batch), sharding)
    # An explicit transfer; the guard around the loop would count it as implicit.
    with jax.transfer_guard("allow"):
        return {
            k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
            for k, v in batch.items()
        }


def majority_accuracies(
    batches: list[Mapping[str, np.ndarray]], vocab_size: int
) -> dict[str, float]:
    """Accuracy of always predicting the most frequent masked token / SOP label of these
    batches: an upper bound on any constant predictor, the baseline the model must beat.

    Counts every process's batches (the counts are summed over processes) and only real
    sequences (`example_weight` > 0, padding rows have no prediction either).
    """
    ids = np.concatenate([b["masked_lm_ids"].ravel() for b in batches])
    weights = np.concatenate([b["masked_lm_weights"].ravel() for b in batches])
    labels = np.concatenate([b["sentence_order_label"] for b in batches])
    real = np.concatenate(
        [b.get("example_weight", np.ones(len(b["sentence_order_label"]))) for b in batches]
    )
    token_counts = np.bincount(ids[weights > 0], minlength=vocab_size)[:vocab_size]
    label_counts = np.bincount(labels[real > 0], minlength=2)[:2]
    counts = np.concatenate([token_counts, label_counts]).astype(np.int64)
    if jax.process_count() > 1:
        counts = np.asarray(multihost_utils.process_allgather(counts)).sum(axis=0)
    token_counts, label_counts = counts[:vocab_size], counts[vocab_size:]
    return {
        "eval_mlm_majority_accuracy": float(token_counts.max() / max(1, token_counts.sum())),
        "eval_sop_majority_accuracy": float(label_counts.max() / max(1, label_counts.sum())),
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


def train_step_flops(
    model_config: Any, batch_size: int, seq_len: int, max_predictions_per_seq: int
) -> float:
    """Model FLOPs of one `make_train_step` step over the global batch. The step asks for
    `return_sequence_output=False`, so the last layer runs at the 1 + P rows the heads read
    ([CLS] and the masked positions) and is counted there (`albert_jax.flops`)."""
    return flops.train_flops_per_step(
        model_config,
        batch_size,
        seq_len,
        max_predictions_per_seq,
        last_layer_positions=1 + max_predictions_per_seq,
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
            {"params": params},
            *_model_inputs(batch),
            deterministic=False,
            return_sequence_output=False,  # last layer only where the heads read
            rngs={"dropout": rng},
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


def _label_log_probs(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log p(label) in float32 for logits [..., C] and labels [...] → [...] (NaN for an
    out-of-range label, as `losses` does: a bad label must not pass as a clamped class)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, labels.astype(jnp.int32)[..., None], -1, mode="fill")
    return picked[..., 0]


def make_eval_step(config: Any, model: AlbertForPreTraining) -> Callable:
    """(params, batch) → weighted sums over the batch, so that batches of any count (and
    padding rows, weight 0) combine exactly.

    `batch` is a training batch plus `example_weight [B] float32` (1 real, 0 padding); padding
    rows have no MLM prediction either (`masked_lm_weights` 0).
    """
    sentence_order = config.objective != "none"

    def eval_step(params: PyTree, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        outputs = model.apply(
            {"params": params}, *_model_inputs(batch), return_sequence_output=False
        )
        weights = batch["masked_lm_weights"].astype(jnp.float32)  # [B, P]
        mlm_nll = -_label_log_probs(outputs["mlm_logits"], batch["masked_lm_ids"])
        mlm_hit = jnp.argmax(outputs["mlm_logits"], axis=-1) == batch["masked_lm_ids"]
        example = batch["example_weight"].astype(jnp.float32)  # [B]
        sums = {
            # `where`, not a product: a padding slot's value never reaches the sums.
            "mlm_loss": jnp.sum(jnp.where(weights > 0, weights * mlm_nll, 0.0)),
            "mlm_correct": jnp.sum(jnp.where(mlm_hit, weights, 0.0)),
            "predictions": jnp.sum(weights),
            "sequences": jnp.sum(example),
        }
        zero = jnp.zeros((), jnp.float32)
        if sentence_order:
            labels = batch["sentence_order_label"]
            sop_nll = -_label_log_probs(outputs["sop_logits"], labels)
            sop_hit = jnp.argmax(outputs["sop_logits"], axis=-1) == labels
            sums["sop_loss"] = jnp.sum(jnp.where(example > 0, example * sop_nll, 0.0))
            sums["sop_correct"] = jnp.sum(jnp.where(sop_hit, example, 0.0))
        else:
            sums["sop_loss"] = sums["sop_correct"] = zero
        return sums

    return eval_step


def eval_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    predictions, sequences = max(sums["predictions"], 1e-9), max(sums["sequences"], 1e-9)
    mlm_loss, sop_loss = sums["mlm_loss"] / predictions, sums["sop_loss"] / sequences
    return {
        "eval_loss": mlm_loss + sop_loss,
        "eval_mlm_loss": mlm_loss,
        "eval_sop_loss": sop_loss,
        "eval_mlm_accuracy": sums["mlm_correct"] / predictions,
        "eval_sop_accuracy": sums["sop_correct"] / sequences,
    }
