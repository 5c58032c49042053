"""What the config files share (big_vision style `get_config(arg)`): the arg parser and the
optimizer, mesh and loop blocks that pretraining and fine-tuning configs both have. Each block
sets its fields, with their one-line comments, on the config it is given; what differs between
the two kinds of run is an argument."""

from __future__ import annotations

from typing import Any

import ml_collections


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """Parses `"k=v,k2=v2,flag"` into a ConfigDict typed like `defaults`.

    Keys not in `defaults` raise `ValueError` naming the key, so a typo in
    `--config=configs/pretrain.py:sise=base` fails before anything is built. A bare key sets a
    boolean default to True.
    """
    result = ml_collections.ConfigDict(defaults)
    if not arg:
        return result
    for item in arg.split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in defaults:
            raise ValueError(f"unknown config arg key {key!r}; known keys: {sorted(defaults)}")
        default = defaults[key]
        if not sep:
            if not isinstance(default, bool):
                raise ValueError(f"config arg {key!r} needs a value ({key}=...)")
            result[key] = True
            continue
        result[key] = _coerce(key, value.strip(), default)
    return result


def _coerce(key: str, value: str, default: Any) -> Any:
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"config arg {key}={value!r} is not a boolean")
    if isinstance(default, int):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"config arg {key}={value!r} is not an integer") from None
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"config arg {key}={value!r} is not a number") from None
    return value


def add_optimizer(
    c: ml_collections.ConfigDict,
    optimizer: str,
    *,
    learning_rate: float,
    warmup_steps: int,
    num_train_steps: int,
) -> None:
    """The optimizer fields (albert_jax.optim): the official settings of both optimizers
    (lamb_optimizer.py, optimization.py) beside the schedule a run chooses."""
    c.optimizer = optimizer  # lamb (pretraining) | adamw (fine-tuning)
    c.learning_rate = learning_rate  # peak learning rate
    c.warmup_steps = warmup_steps  # linear warmup from 0
    c.num_train_steps = num_train_steps  # total updates
    c.lr_poly_power = 1.0  # decay power after warmup (1 = linear to 0)
    c.weight_decay = 0.01  # decoupled decay, not on LayerNorm / bias
    c.grad_clip_norm = 1.0  # global-norm clipping before the optimizer (official)
    c.b1 = 0.9  # LAMB / Adam beta1
    c.b2 = 0.999  # LAMB / Adam beta2
    c.eps = 1e-6  # LAMB / Adam epsilon (official)


def add_mesh(c: ml_collections.ConfigDict, data: int = -1, fsdp: int = 1, tensor: int = 1) -> None:
    """`config.mesh`: the (data, fsdp, tensor) device mesh; -1 fills with the remaining
    devices."""
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = data  # data-parallel replicas
    c.mesh.fsdp = fsdp  # parameter/optimizer sharding (the batch is split over it too)
    c.mesh.tensor = tensor  # tensor parallel (heads, mlp, vocab)
    # True: data / fsdp / tensor chosen for the devices and the model (the least model
    # parallelism that divides every sharded dimension and leaves HBM for activations; logged)
    c.mesh.auto = False
    # Groups joined by the slower network, data parallel across them (fsdp / tensor inside
    # one): 0 = the TPU slices of a multi-slice job (1 elsewhere); N = N slices, or on CPU /
    # GPU hosts N processes, one group each.
    c.mesh.slices = 0
    # The precision each weight's gradient is summed in across devices (once a step):
    # float32 as the optimizer state; bfloat16 halves the bytes sent, and each device's
    # partial gradient is rounded to 8 bits of mantissa before the sum.
    c.mesh.gradient_reduction_dtype = "float32"


def add_loop(
    c: ml_collections.ConfigDict,
    *,
    log_every_steps: int,
    eval_every_steps: int,
    checkpoint_every_steps: int,
    keep_checkpoints: int,
) -> None:
    """The loop's fields (albert_jax.loop): seed, cadences, checkpoints kept, resume, the
    compilation cache, and `config.debug` with the hook every run has."""
    c.seed = 0  # initialization, dropout and data order
    c.log_every_steps = log_every_steps  # metrics.jsonl / TensorBoard cadence
    # Evaluate every N steps and after the last (0: fine-tuning only at the end; pretraining never)
    c.eval_every_steps = eval_every_steps
    # Save every N steps (async Orbax; 0: only the final and preemption saves)
    c.checkpoint_every_steps = checkpoint_every_steps
    c.keep_checkpoints = keep_checkpoints  # keep the last k
    c.resume_strict = False  # an unreadable latest checkpoint stops the run (else: the one before)
    # JAX's persistent compilation cache (runtime/compile_cache.py): "" = WORKDIR/compilation_cache
    # (or $JAX_COMPILATION_CACHE_DIR), a path (local or gs://), or "none". A restart reads its
    # compiled programs from there instead of compiling again.
    c.compilation_cache_dir = ""

    # --- debugging hooks (0 = off); the tests use them to exercise preemption, resume, crashes
    c.debug = ml_collections.ConfigDict()
    c.debug.sigterm_after_step = 0  # process 0 sends itself SIGTERM after this step
