"""Optimizers for ALBERT: LAMB for pretraining, AdamW for fine-tuning, their schedules and
clipping (gradient accumulation over microbatches: `train_state.accumulate_gradients`).

Both optimizers follow the official TF code (google-research/albert `lamb_optimizer.py`,
`optimization.py`; BERT's `AdamWeightDecayOptimizer`) rather than the textbook versions:

- No bias correction of the Adam moments. The official code never had it; with a linear warmup
  the first, tiny-learning-rate steps already absorb the start-up bias, and matching the
  reference makes published learning rates transfer unchanged.
- Weight decay is added to the Adam direction (decoupled from the gradient moments), before the
  trust ratio.
- A variable whose name matches an `exclude` regex (searched, not matched) gets neither weight
  decay nor a trust ratio: LayerNorm scales/biases, every `*bias` (so the MLM `output_bias` too);
  embeddings are decayed.

Parameters are addressed by their pytree path joined with "/" (e.g.
"albert/encoder/layer/attention/LayerNorm/scale"), which plays the role of the TF variable name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from albert_jax.trees import path_to_str

PyTree = Any

#: Regexes of the official `exclude_from_weight_decay` (also excluded from layer adaptation).
DEFAULT_EXCLUDE: tuple[str, ...] = ("LayerNorm", "layer_norm", "bias")

#: Which leaves carry a leading stacked-layers axis: a predicate on (path, leaf), a collection of
#: regexes searched in the path, or None (no stacked leaves).
StackedSpec = Callable[[str, Any], bool] | Collection[str] | None

OPTIMIZERS = ("lamb", "adamw")


# ----------------------------------------------------------------------------------------------
# Paths and masks


def _is_boxed(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _check_unboxed(params: PyTree) -> None:
    # A boxed leaf would be flattened into its `.value` and silently change every path; better to
    # say what to do.
    if any(_is_boxed(x) for x in jax.tree_util.tree_leaves(params, is_leaf=_is_boxed)):
        raise ValueError(
            "params contain flax.linen.Partitioned boxes; call nn.meta.unbox(params) before "
            "building masks or calling the optimizer"
        )


def _map_with_path(fn: Callable[[str, Any], Any], tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(path_to_str(p), x), tree)


def decay_mask(params: PyTree, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> PyTree:
    """True for leaves that get weight decay and a LAMB trust ratio.

    Args:
      params: plain (unboxed) params pytree.
      exclude: regexes searched in each leaf's "a/b/c" path; a hit means no decay, ratio 1.
    Returns:
      A pytree of Python bools with the structure of `params`.
    """
    _check_unboxed(params)
    patterns = [re.compile(p) for p in exclude]
    return _map_with_path(lambda path, _: not any(p.search(path) for p in patterns), params)


def _stacked_predicate(stacked: StackedSpec) -> Callable[[str, Any], bool]:
    if stacked is None:
        return lambda path, leaf: False
    if callable(stacked):
        return stacked
    if isinstance(stacked, str):
        raise ValueError("stacked must be a collection of regexes, not a single string")
    patterns = [re.compile(p) for p in stacked]
    return lambda path, leaf: any(p.search(path) for p in patterns)


def stacked_mask(params: PyTree, stacked: StackedSpec = None) -> PyTree:
    """True for leaves whose leading axis stacks per-layer weights (shape [L, ...])."""
    _check_unboxed(params)
    predicate = _stacked_predicate(stacked)

    def flag(path: str, leaf: Any) -> bool:
        is_stacked = bool(predicate(path, leaf))
        if is_stacked and len(getattr(leaf, "shape", ())) < 1:
            raise ValueError(f"stacked: leaf {path!r} is a scalar, it has no layers axis")
        return is_stacked

    return _map_with_path(flag, params)


def stacked_from_logical_axes(
    boxed_params: PyTree, axis_name: str = "layers", run_axis: str = "seeds"
) -> Callable[[str, Any], bool]:
    """A `stacked` predicate read from Flax logical-axis metadata instead of guessed from shapes.

    Args:
      boxed_params: params still wrapped in `nn.Partitioned` (e.g. `model.init(...)["params"]`
        before `nn.meta.unbox`).
      axis_name: logical name of the stacked axis (our sharding rules call it "layers").
      run_axis: a leading axis of several runs in one program (`train_state.SEED_AXIS`), which
        the optimizer never sees (it runs once per run, under `jax.vmap`): skipped.
    Returns:
      predicate(path, leaf) -> True when that leaf's first logical axis is `axis_name`; paths are
      those of the unboxed tree.
    """
    names: set[str] = set()
    flat, _ = jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=_is_boxed)
    for path, leaf in flat:
        axes = getattr(leaf, "names", None) if _is_boxed(leaf) else None
        if axes and axes[0] == run_axis:
            axes = axes[1:]
        if axes and axes[0] == axis_name:
            names.add(path_to_str(path))
    frozen = frozenset(names)
    return lambda path, leaf: path in frozen


# ----------------------------------------------------------------------------------------------
# Schedules


def warmup_polynomial_decay(
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    power: float = 1.0,
    end_lr: float = 0.0,
) -> optax.Schedule:
    """Official ALBERT schedule: `lr·step/warmup` while step < warmup, else polynomial decay.
    `base_lr` and `warmup_steps` may be traced scalars (a sweep group's per-run values).

    The decay is `(lr − end)·(1 − min(step, total)/total)^power + end`, counted from step 0 (not
    from the end of warmup), exactly as `tf.train.polynomial_decay` is used in `optimization.py`;
    so the learning rate jumps slightly down at the end of warmup.
    """
    if all(isinstance(v, (int, float)) for v in (base_lr, warmup_steps)):  # else traced
        if base_lr <= 0:
            raise ValueError(f"learning_rate must be > 0, got {base_lr}")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warmup_steps must be in [0, num_train_steps], got {warmup_steps}")
    if total_steps <= 0:
        raise ValueError(f"num_train_steps must be > 0, got {total_steps}")
    if power <= 0:
        raise ValueError(f"lr_poly_power must be > 0, got {power}")

    def schedule(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        frac = jnp.minimum(step, total_steps) / total_steps
        decayed = (base_lr - end_lr) * (1.0 - frac) ** power + end_lr
        if isinstance(warmup_steps, int) and warmup_steps == 0:
            return decayed
        # A traced warmup (a sweep group's per-run value) may be 0: the division is then
        # never selected, and max(., 1) keeps it finite.
        divisor = warmup_steps if isinstance(warmup_steps, int) else jnp.maximum(warmup_steps, 1)
        warmup = base_lr * step / divisor
        return jnp.where(step < warmup_steps, warmup, decayed)

    return schedule


def warmup_linear_decay(
    base_lr: float, warmup_steps: int, total_steps: int, end_lr: float = 0.0
) -> optax.Schedule:
    """BERT/ALBERT fine-tuning schedule: linear warmup, then linear decay to `end_lr`."""
    return warmup_polynomial_decay(base_lr, warmup_steps, total_steps, power=1.0, end_lr=end_lr)


# ----------------------------------------------------------------------------------------------
# Transformations optax lacks in the exact official form


class AdamMomentsState(NamedTuple):
    """First and second moments, same structure and dtype as the params."""

    mu: PyTree
    nu: PyTree


def scale_by_adam_without_bias_correction(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6
) -> optax.GradientTransformation:
    """u = m/(√v + ε) with m, v the raw exponential moving averages (official LAMB / AdamW).

    `optax.scale_by_adam` always bias-corrects, which the official optimizers never did; the
    difference is large in the first ~1/(1−β2) = 1000 steps.
    """

    def init_fn(params: PyTree) -> AdamMomentsState:
        return AdamMomentsState(mu=optax.tree.zeros_like(params), nu=optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g), state.nu, updates)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        mu = optax.tree.cast_like(mu, state.mu)
        nu = optax.tree.cast_like(nu, state.nu)
        return direction, AdamMomentsState(mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _norm(x: jax.Array, stacked: bool) -> jax.Array:
    # Norms in float32 even for bf16 params: squares of many small values underflow in bf16.
    x = x.astype(jnp.float32)
    axes = tuple(range(1, x.ndim)) if stacked else None
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=axes, keepdims=stacked))


def scale_by_layerwise_trust_ratio(
    exclude: Sequence[str] = DEFAULT_EXCLUDE, stacked: StackedSpec = None
) -> optax.GradientTransformation:
    """Multiplies each variable's update u by r = ‖w‖/‖u‖ (1 if either norm is 0; no clamp).

    Variables matching `exclude` keep r = 1 (official `exclude_from_layer_adaptation` defaults to
    the weight-decay exclusions). A stacked leaf [L, ...] gets one ratio per layer slice, so a
    model that stores unshared layers stacked updates exactly like one that stores them apart.
    Unlike `optax.scale_by_trust_ratio`, which has no exclusions and one ratio per leaf.
    """

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(optax.NO_PARAMS_MSG)
        adapt = decay_mask(params, exclude)
        per_layer = stacked_mask(params, stacked)

        def scale(u, w, adapt_leaf, stacked_leaf):
            if not adapt_leaf:
                return u
            w_norm, u_norm = _norm(w, stacked_leaf), _norm(u, stacked_leaf)
            ratio = jnp.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
            return (ratio * u).astype(u.dtype)

        return jax.tree.map(scale, updates, params, adapt, per_layer), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


# ----------------------------------------------------------------------------------------------
# Optimizers


def _lamb_transform(
    learning_rate: float,
    weight_decay: float,
    b1: float,
    b2: float,
    eps: float,
    exclude: Sequence[str],
    stacked: StackedSpec,
    layerwise_adaptation: bool,
) -> optax.GradientTransformation:
    mask = lambda params: decay_mask(params, exclude)
    parts = [
        scale_by_adam_without_bias_correction(b1, b2, eps),
        optax.add_decayed_weights(weight_decay, mask=mask),
    ]
    if layerwise_adaptation:
        parts.append(scale_by_layerwise_trust_ratio(exclude, stacked))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


# Hyperparameters that are not logged or changed during training; everything else injected.
_STATIC = ("b1", "b2", "eps", "exclude", "stacked", "layerwise_adaptation")


def _injected(
    schedule: optax.ScalarOrSchedule,
    weight_decay: float,
    b1: float,
    b2: float,
    eps: float,
    exclude: Sequence[str],
    stacked: StackedSpec,
    layerwise_adaptation: bool,
) -> optax.GradientTransformation:
    # inject_hyperparams keeps the current learning rate in the state so it can be logged; its
    # dtype is pinned to float32 because by default it follows the params, and in bfloat16
    # 1e-6-scale learning rates lose most of their digits.
    return optax.inject_hyperparams(
        _lamb_transform, static_args=_STATIC, hyperparam_dtype=jnp.float32
    )(
        learning_rate=schedule,
        weight_decay=weight_decay,
        b1=b1,
        b2=b2,
        eps=eps,
        exclude=tuple(exclude),
        stacked=stacked,
        layerwise_adaptation=layerwise_adaptation,
    )


def lamb(
    learning_rate_schedule: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    stacked: StackedSpec = None,
) -> optax.GradientTransformation:
    """Official ALBERT LAMB (no clipping; `make_optimizer` adds it in front).

    Per variable w with gradient g:
      m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
      u = m/(√v + ε) + wd·w                    (wd only where not excluded)
      r = ‖w‖/‖u‖ if both > 0 else 1            (r = 1 where excluded; per layer if stacked)
      w ← w − lr·r·u
    """
    return _injected(learning_rate_schedule, weight_decay, b1, b2, eps, exclude, stacked, True)


def adamw(
    learning_rate_schedule: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
) -> optax.GradientTransformation:
    """BERT/ALBERT `AdamWeightDecayOptimizer`: LAMB without the trust ratio.

    u = m/(√v + ε) + wd·w  (no bias correction; wd only where not excluded);  w ← w − lr·u
    """
    return _injected(learning_rate_schedule, weight_decay, b1, b2, eps, exclude, None, False)


def current_learning_rate(opt_state: optax.OptState) -> jax.Array:
    """The learning rate applied by the most recent update (schedule(0) before the first one)."""
    # `hyperparams_states` holds the schedule's own state under the same key; skip it.
    lr = optax.tree_utils.tree_get(
        opt_state, "learning_rate", filtering=lambda path, value: not isinstance(value, tuple)
    )
    if lr is None:
        raise ValueError(
            "opt_state has no injected learning_rate; build the optimizer with lamb(), adamw() "
            "or make_optimizer()"
        )
    return lr


def _field(config: Any, name: str) -> Any:
    try:
        return config[name]
    except (KeyError, AttributeError, TypeError):
        try:
            return getattr(config, name)
        except AttributeError:
            raise ValueError(f"optimizer config is missing the field {name!r}") from None


def _check_number(name: str, value: Any, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):  # NaN passes every comparison below
        raise ValueError(f"{name} must be a finite number, got {value}")
    if value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return float(value)


# The optimizer fields whose values may differ between the runs of one program (a sweep
# group, `train_state.Runs`): numbers the update reads, not shapes. Every other field of the
# optimizer (its name, num_train_steps, lr_poly_power, clipping on or off) shapes the program.
PER_RUN_FIELDS = (
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "grad_clip_norm",
    "b1",
    "b2",
    "eps",
)


def optimizer_values(config: Any) -> dict[str, Any]:
    """The checked optimizer fields of `config`: {"optimizer", "learning_rate",
    "warmup_steps", "num_train_steps", "weight_decay", "grad_clip_norm", "b1", "b2", "eps",
    "lr_poly_power"}. Raises ValueError naming a missing or out-of-range field."""
    name = _field(config, "optimizer")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    values: dict[str, Any] = {"optimizer": name}
    values["learning_rate"] = _check_number("learning_rate", _field(config, "learning_rate"), 0.0)
    for field in ("warmup_steps", "num_train_steps"):
        value = _field(config, field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{field} must be an int, got {value!r}")
        values[field] = value
    values["weight_decay"] = _check_number("weight_decay", _field(config, "weight_decay"), 0.0)
    values["grad_clip_norm"] = _check_number(
        "grad_clip_norm", _field(config, "grad_clip_norm"), 0.0
    )
    values["b1"] = _check_number("b1", _field(config, "b1"), 0.0, 1.0)
    values["b2"] = _check_number("b2", _field(config, "b2"), 0.0, 1.0)
    values["eps"] = _check_number("eps", _field(config, "eps"), 0.0)
    values["lr_poly_power"] = _check_number("lr_poly_power", _field(config, "lr_poly_power"), 0.0)
    return values


def make_optimizer(
    config: Any, *, stacked: StackedSpec = None, per_run: Mapping[str, jax.Array] | None = None
) -> optax.GradientTransformation:
    """Global-norm clipping followed by LAMB or AdamW with the warmup + polynomial-decay schedule.

    Args:
      config: ConfigDict (or any mapping/object) with fields `optimizer` ("lamb" | "adamw"),
        `learning_rate`, `warmup_steps`, `num_train_steps`, `weight_decay`, `grad_clip_norm`
        (0 disables clipping), `b1`, `b2`, `eps`, `lr_poly_power`.
      stacked: which leaves stack layers along axis 0 (see `lamb`); ignored by AdamW.
      per_run: values of `PER_RUN_FIELDS` that replace the config's (scalars traced inside the
        update of one run of several, `train_state.Runs`); clipping stays as the config has it.
    Raises:
      ValueError naming the field, for a missing or out-of-range value.
    """
    checked = optimizer_values(config)
    v = {**checked, **(per_run or {})}
    schedule = warmup_polynomial_decay(
        v["learning_rate"], v["warmup_steps"], v["num_train_steps"], power=v["lr_poly_power"]
    )
    common = dict(weight_decay=v["weight_decay"], b1=v["b1"], b2=v["b2"], eps=v["eps"])
    if v["optimizer"] == "lamb":
        optimizer = lamb(schedule, stacked=stacked, **common)
    else:
        optimizer = adamw(schedule, **common)
    if checked["grad_clip_norm"] == 0.0:
        return optimizer
    # The official code clips the (per-core) gradient before the optimizer; here the gradient is
    # already the global mean, so this is one global-norm clip of the true batch gradient.
    return optax.chain(optax.clip_by_global_norm(v["grad_clip_norm"]), optimizer)
