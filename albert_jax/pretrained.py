"""`load_pretrained(path)`: an ALBERT model + weights (+ tokenizer) from any supported layout.

Layouts (detected in this order; `detect_layout` names them):

* **model dir** (written by `save_model_dir` and `python -m albert_jax.convert --dst`):
    DIR/model_config.json    `ModelConfig.to_dict()`
    DIR/params/              Orbax `StandardCheckpointer` checkpoint of `{"params": {...}}`
    DIR/tokenizer.model      sentencepiece model (optional)
* **training workdir** (the pretraining / fine-tuning loop writes it):
    WORKDIR/checkpoints/           an `ocp.CheckpointManager` directory
    WORKDIR/checkpoints/<step>/    items: `params` (StandardSave of the plain params tree,
                                   `{"params": {...}}` or its inner dict), `opt_state`,
                                   `data` (JsonSave, input-pipeline state), `meta` (JsonSave,
                                   `checkpoint_meta(config, step)`: at least `model_config` and
                                   `step`)
    WORKDIR/tokenizer.model        optional
  `path` may be the workdir (latest step is loaded) or one step dir.
* **HF dir**: `config.json` + `model.safetensors` (or sharded / `pytorch_model.bin`), optional
  `spiece.model`.
* **official TF1 dir**: `albert_config.json` + `model.ckpt-*` (+ `30k-clean.model`), or a bare
  checkpoint prefix next to an `albert_config.json`.

Parts a checkpoint lacks (pooler, MLM head, SOP head; e.g. an HF `AlbertModel`) are initialized
from `seed` and listed in `Pretrained.initialized`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from albert_jax import convert
from albert_jax.config import ModelConfig, save_json

__all__ = [
    "Pretrained",
    "load_pretrained",
    "save_model_dir",
    "checkpoint_meta",
    "detect_layout",
    "MODEL_CONFIG_FILE",
    "PARAMS_DIR",
    "TOKENIZER_FILE",
    "CHECKPOINTS_DIR",
    "TRAINING_ITEMS",
]

log = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
TOKENIZER_FILE = "tokenizer.model"
CHECKPOINTS_DIR = "checkpoints"
# Items of one training step dir; `params` and `meta` are what `load_pretrained` reads.
TRAINING_ITEMS = ("params", "opt_state", "data", "meta")


@dataclasses.dataclass
class Pretrained:
    """A loaded model.

    `params` is the variables tree for `model.apply(params, input_ids, ...)`, i.e.
    `{"params": {...}}`, of uncommitted jax arrays on the default device (reshard them with
    `jax.device_put(params, shardings)` for multi-device use).
    `source` is "albert_jax", "hf" or "tf"; `initialized` lists the parts (see
    `convert.OPTIONAL_PARTS`) that the checkpoint lacked and were freshly initialized.
    """

    model: Any  # albert_jax.model.AlbertForPreTraining
    params: dict[str, Any]
    config: ModelConfig
    tokenizer: Any | None  # albert_jax.data.tokenizer.Tokenizer
    source: str
    path: str
    step: int | None = None
    initialized: tuple[str, ...] = ()
    tokenizer_path: str | None = None


def checkpoint_meta(config: ModelConfig, step: int, **extra: Any) -> dict[str, Any]:
    """The `meta` item of a training checkpoint: `{"model_config", "step", **extra}`."""
    return {"model_config": config.to_dict(), "step": int(step), **extra}


def save_model_dir(
    directory: str,
    params: Mapping[str, Any],
    config: ModelConfig,
    tokenizer_path: str | None = None,
) -> None:
    """Writes a model dir (see the module docstring); an existing `params/` is replaced.

    Params are stored as numpy arrays (no device layout), so any topology can restore them.
    This is a single-process helper; a multi-host run saves through its CheckpointManager.
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    tree = convert.unflatten_params(
        {k: convert._to_numpy(v) for k, v in convert.flatten_params(params).items()}
    )
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, PARAMS_DIR), tree, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
    save_json(config, os.path.join(directory, MODEL_CONFIG_FILE))
    if tokenizer_path:
        target = os.path.join(directory, TOKENIZER_FILE)
        if os.path.abspath(tokenizer_path) != target:
            shutil.copyfile(tokenizer_path, target)


# ------------------------------------------------------------------------------- detection
def _is_step_dir(path: str) -> bool:
    return all(os.path.isdir(os.path.join(path, item)) for item in ("params", "meta"))


def detect_layout(path: str) -> str:
    """Names the layout of `path`: model_dir, workdir, step_dir, hf, tf or tf_prefix.

    Raises ValueError, listing what was looked for, when it is none of them.
    """
    if os.path.isfile(path + ".index"):
        return "tf_prefix"
    if not os.path.isdir(path):
        raise ValueError(f"load_pretrained: {path!r} does not exist")
    has = lambda *names: all(os.path.exists(os.path.join(path, n)) for n in names)
    if has(MODEL_CONFIG_FILE, PARAMS_DIR):
        return "model_dir"
    if os.path.isdir(os.path.join(path, CHECKPOINTS_DIR)):
        return "workdir"
    if _is_step_dir(path):
        return "step_dir"
    if has("config.json") and any(has(w) for w in convert._HF_WEIGHT_FILES):
        return "hf"
    if has("albert_config.json") and glob.glob(os.path.join(path, "*.index")):
        return "tf"
    raise ValueError(
        f"load_pretrained: {path!r} is not a known checkpoint layout. Looked for: an albert_jax "
        f"model dir ({MODEL_CONFIG_FILE} + {PARAMS_DIR}/), a training workdir "
        f"({CHECKPOINTS_DIR}/<step>/), a step dir (params/ + meta/), an HF dir (config.json + "
        f"one of {', '.join(convert._HF_WEIGHT_FILES)}), an official TF1 dir "
        "(albert_config.json + model.ckpt-*.index) or a TF checkpoint prefix (PREFIX.index). "
        f"Found: {sorted(os.listdir(path))[:20]}"
    )


# --------------------------------------------------------------------------------- readers
def _restore_numpy(directory: str) -> dict[str, Any]:
    """Restores a StandardCheckpointer tree as numpy, whatever device layout it was saved with."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    tree = checkpointer.metadata(directory).item_metadata.tree
    # numpy targets make Orbax read host arrays: no sharding or topology needs to match.
    target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), tree)
    restored = checkpointer.restore(directory, target)
    checkpointer.close()
    return restored


def _read_json_item(directory: str) -> Any:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
        return checkpointer.restore(directory)


def _latest_step_dir(workdir: str) -> str:
    import orbax.checkpoint as ocp

    ckpt_dir = os.path.join(os.path.abspath(workdir), CHECKPOINTS_DIR)
    with ocp.CheckpointManager(ckpt_dir) as manager:
        step = manager.latest_step()
    if step is None:
        raise ValueError(f"load_pretrained: {ckpt_dir} holds no finished checkpoint")
    return os.path.join(ckpt_dir, str(step))


def _load_step_dir(step_dir: str) -> tuple[ModelConfig, dict[str, Any], int, str | None]:
    meta = _read_json_item(os.path.join(step_dir, "meta"))
    if not isinstance(meta, dict) or "model_config" not in meta:
        raise ValueError(f"{step_dir}/meta: needs a 'model_config' entry (see checkpoint_meta)")
    config = ModelConfig.from_dict(meta["model_config"])
    params = _restore_numpy(os.path.join(step_dir, "params"))
    workdir = os.path.dirname(os.path.dirname(os.path.abspath(step_dir)))
    tokenizer = os.path.join(workdir, TOKENIZER_FILE)
    step = int(meta.get("step", os.path.basename(os.path.normpath(step_dir))))
    return config, params, step, tokenizer if os.path.isfile(tokenizer) else None


def _load_model_dir(directory: str) -> tuple[ModelConfig, dict[str, Any], str | None]:
    with open(os.path.join(directory, MODEL_CONFIG_FILE), encoding="utf-8") as f:
        config = ModelConfig.from_dict(json.load(f))
    params = _restore_numpy(os.path.join(directory, PARAMS_DIR))
    tokenizer = os.path.join(directory, TOKENIZER_FILE)
    return config, params, tokenizer if os.path.isfile(tokenizer) else None


def _load_tokenizer(path: str | None) -> Any | None:
    if path is None:
        return None
    try:
        from albert_jax.data.tokenizer import Tokenizer
    except ImportError as e:  # the data package may be unavailable in a minimal install
        log.warning("sentencepiece model %s found but no Tokenizer class (%s)", path, e)
        return None
    return Tokenizer(path)


# ------------------------------------------------------------------------------ completion
def _complete(
    params: Mapping[str, Any], config: ModelConfig, seed: int, source: str
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Checks `params` against the model `config` describes; initializes absent optional parts.

    Raises one ValueError listing every missing (required) or mis-shaped parameter.
    """
    import flax.linen as nn
    import jax

    from albert_jax.model import AlbertForPreTraining, init_params

    model = AlbertForPreTraining(config)
    seq_len = min(8, config.max_position_embeddings)
    init = lambda rng: nn.meta.unbox(init_params(model, rng, seq_len=seq_len))
    expected = convert.flatten_params(jax.eval_shape(init, jax.random.key(seed)))
    flat = convert.flatten_params(params)
    absent = [
        part
        for part in convert.OPTIONAL_PARTS
        if not any(k.startswith(part + "/") for k in flat)
        and any(k.startswith(part + "/") for k in expected)
    ]
    in_absent = lambda k: any(k.startswith(part + "/") for part in absent)
    missing = [k for k in expected if k not in flat and not in_absent(k)]
    mismatched = [
        f"{k}: checkpoint {tuple(flat[k].shape)}, expected {tuple(expected[k].shape)}"
        for k in expected
        if k in flat and tuple(flat[k].shape) != tuple(expected[k].shape)
    ]
    if missing or mismatched:
        raise ValueError(
            convert._format_problems(f"{source} vs its ModelConfig", missing, mismatched)
        )
    extra = sorted(set(flat) - set(expected))
    if extra:
        log.warning("%s: %d parameter(s) not used by the model: %s", source, len(extra), extra)
    out = {k: flat[k] for k in expected if k in flat}
    if absent:
        rng = np.random.default_rng(seed)
        for k in expected:
            if in_absent(k):
                out[k] = _initial_value(k, expected[k].shape, expected[k].dtype, config, rng)
        log.warning("%s: no %s in the checkpoint; initialized them (seed %d)", source, absent, seed)
    return convert.unflatten_params(out), tuple(absent)


def _initial_value(
    path: str, shape: tuple[int, ...], dtype: Any, config: ModelConfig, rng: np.random.Generator
) -> np.ndarray:
    """The model's own initialization, drawn in numpy for a head the checkpoint lacks.

    Same distributions as `albert_jax.model`: LayerNorm scale 1, biases 0, kernels from a normal
    with std `initializer_range` truncated at 2 std (not re-scaled, as TF). Drawn on the host so
    that no init program has to be compiled just to fill a few head weights.
    """
    name = path.rsplit("/", 1)[-1]
    if name == "scale":
        return np.ones(shape, dtype)
    if name in ("bias", "output_bias"):
        return np.zeros(shape, dtype)
    x = rng.standard_normal(shape)
    outside = np.abs(x) > 2.0
    while outside.any():  # resample the tails: a normal truncated to [-2, 2]
        x[outside] = rng.standard_normal(int(outside.sum()))
        outside = np.abs(x) > 2.0
    return (config.initializer_range * x).astype(dtype)


# ------------------------------------------------------------------------------------ entry
def load_pretrained(
    path: str,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    seed: int = 0,
) -> Pretrained:
    """Loads an albert_jax model dir / workdir / step dir, an HF dir or an official TF1 dir.

    `dtype` overrides the compute dtype (`ModelConfig.dtype`, e.g. "bfloat16"); `param_dtype`
    casts the weights (default: as stored; HF / TF weights are read as float32). `seed`
    initializes parts the checkpoint lacks.
    """
    layout = detect_layout(path)
    step = None
    if layout == "model_dir":
        config, params, tokenizer_path = _load_model_dir(path)
        source = "albert_jax"
    elif layout in ("workdir", "step_dir"):
        step_dir = _latest_step_dir(path) if layout == "workdir" else path
        config, params, step, tokenizer_path = _load_step_dir(step_dir)
        source = "albert_jax"
    elif layout == "hf":
        config, params = convert.load_hf_checkpoint(path)
        tokenizer_path = convert.find_spm_model(path, ("spiece.model", TOKENIZER_FILE))
        source = "hf"
    elif layout == "tf":
        config, params, tokenizer_path = convert.load_tf_dir(path)
        source = "tf"
    else:  # tf_prefix
        config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "albert_config.json")
        if not os.path.exists(config_path):
            raise ValueError(
                f"load_pretrained: TF checkpoint {path} has no albert_config.json next to it"
            )
        config = ModelConfig.from_json(config_path)
        params = convert.tf_checkpoint_to_params(path, config)
        tokenizer_path = convert.find_spm_model(
            os.path.dirname(os.path.abspath(path)), ("30k-clean.model",)
        )
        source = "tf"
    params, initialized = _complete(params, config, seed, f"{source} checkpoint {path}")
    if param_dtype is not None:
        config = config.replace(param_dtype=param_dtype)  # validates the name
        flat = convert.flatten_params(params)
        cast = config.weight_dtype
        params = convert.unflatten_params({k: v.astype(cast) for k, v in flat.items()})
    if dtype is not None:
        config = config.replace(dtype=dtype)

    import jax

    from albert_jax.model import AlbertForPreTraining

    return Pretrained(
        model=AlbertForPreTraining(config),
        params=jax.device_put(params),
        config=config,
        tokenizer=_load_tokenizer(tokenizer_path),
        source=source,
        path=path,
        step=step,
        initialized=initialized,
        tokenizer_path=tokenizer_path,
    )
