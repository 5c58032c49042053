"""`load_pretrained(path)`: an ALBERT model + weights (+ tokenizer) from any supported layout,
local or on an object store (`gs://`): every file is read through `albert_jax.files` / epath,
checkpoints through `albert_jax.checkpointing`.

Layouts (detected in this order; `detect_layout` names them):

* **model dir** (written by `save_model_dir` and `python -m albert_jax.convert --dst`):
    DIR/model_config.json    `ModelConfig.to_dict()`
    DIR/params/              Orbax StandardSave of `{"params": {...}}` (numpy)
    DIR/tokenizer.model      sentencepiece model (optional)
* **training workdir** (the training loop writes it; layout in `albert_jax.checkpointing`):
    WORKDIR/checkpoints/<step>/    items `params`, `opt_state`, `data`, `meta` (JsonSave,
                                   `checkpoint_meta(config, step)`: at least `model_config`
                                   and `step`)
    WORKDIR/tokenizer.model        optional
  `path` may be the workdir (latest committed step is loaded) or one step dir; a step dir's
  tokenizer is its workdir's (two levels up).
* **HF dir**: `config.json` + `model.safetensors` (or sharded / `pytorch_model.bin`), optional
  `spiece.model`.
* **official TF1 dir**: `albert_config.json` + `model.ckpt-*` (+ `30k-clean.model`), or a bare
  checkpoint prefix next to an `albert_config.json`.

`read_checkpoint(path)` is the one read of any of them: the weights as stored (`Checkpoint`),
checked against the checkpoint's ModelConfig; fine-tuning inits take nothing else.
`load_pretrained` completes that into the pretraining model: parts a checkpoint lacks (pooler,
MLM head, SOP head; e.g. an HF `AlbertModel`) are initialized from `seed` and listed in
`Pretrained.initialized`, and weights beyond it (a fine-tuning run's task head) are left out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from albert_jax import files
from albert_jax.checkpointing import TOKENIZER_FILE, checkpoint_meta
from albert_jax.interop.hf_checkpoint import HF_WEIGHT_FILES, load_hf_checkpoint
from albert_jax.interop.tf1_checkpoint import (
    find_tf_checkpoint,
    index_missing,
    tf_checkpoint_to_params,
)
from albert_jax.interop.weight_names import (
    OPTIONAL_PARTS,
    flatten_params,
    format_problems,
    to_numpy,
    unflatten_params,
)
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig, save_json
from albert_jax.runtime import checkpoint_dirs
from albert_jax.runtime.checkpoint_dirs import CHECKPOINTS_DIR

__all__ = [
    "Pretrained",
    "Checkpoint",
    "load_pretrained",
    "read_checkpoint",
    "save_model_dir",
    "checkpoint_meta",
    "detect_layout",
    "load_tf_checkpoint",
    "find_spm_model",
    "MODEL_CONFIG_FILE",
    "PARAMS_DIR",
    "TOKENIZER_FILE",
    "CHECKPOINTS_DIR",
    "TRAINING_ITEMS",
]

log = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
# Items of one training step dir; `params` and `meta` are what `load_pretrained` reads.
TRAINING_ITEMS = checkpoint_dirs.ITEMS


@dataclasses.dataclass
class Pretrained:
    """A loaded model.

    `params` is the weights tree (`{"albert": ..., "predictions": ..., "sop_classifier":
    ...}`), of uncommitted jax arrays on the default device (reshard them with
    `jax.device_put(params, shardings)` for multi-device use); `variables` is what goes into
    `model.apply(variables, input_ids, ...)`, Flax's `{"params": params}`.
    `source` is "albert_jax", "hf" or "tf"; `initialized` lists the parts (see
    `weight_names.OPTIONAL_PARTS`) that the checkpoint lacked and were freshly initialized.
    """

    model: Any  # albert_jax.model.albert.AlbertForPreTraining
    params: dict[str, Any]
    config: ModelConfig
    tokenizer: Any | None  # albert_jax.data.tokenizer.Tokenizer
    source: str
    path: str
    step: int | None = None
    initialized: tuple[str, ...] = ()
    tokenizer_path: str | None = None

    @property
    def variables(self) -> dict[str, Any]:
        """`{"params": self.params}`: the first argument of `model.apply`."""
        return {"params": self.params}


@dataclasses.dataclass
class Checkpoint:
    """One read of a checkpoint (`read_checkpoint`), as stored: nothing initialized, nothing
    dropped.

    `weights` is {"a/b/c": host numpy array} of what goes under variables["params"]: the
    pretraining model's weights in `AlbertForPreTraining(config)`'s shapes (its `absent` parts,
    see `weight_names.OPTIONAL_PARTS`, left out) and, of a fine-tuning run, its task head
    (e.g. `classifier/kernel` [H, num_labels]). Of a checkpoint of several seeds, the arrays of
    the one run picked, without the leading seed axis.
    """

    config: ModelConfig
    weights: dict[str, np.ndarray]
    source: str  # "albert_jax", "hf" or "tf"
    path: str
    step: int | None
    tokenizer: Any | None  # albert_jax.data.tokenizer.Tokenizer
    tokenizer_path: str | None
    absent: tuple[str, ...]  # the OPTIONAL_PARTS it lacks whole (load_pretrained fills them)


def save_model_dir(
    directory: str,
    params: Mapping[str, Any],
    config: ModelConfig,
    tokenizer_path: str | None = None,
) -> None:
    """Writes a model dir (see the module docstring), local or remote; an existing `params/` is
    replaced.

    Params are stored as numpy arrays (no device layout), so any topology can restore them.
    This is a single-process helper; a multi-host run saves through its Checkpointer.
    """
    root = files.as_path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tree = unflatten_params({k: to_numpy(v) for k, v in flatten_params(params).items()})
    checkpoint_dirs.write_item_numpy(root / PARAMS_DIR, tree)
    save_json(config, str(root / MODEL_CONFIG_FILE))
    if tokenizer_path:
        files.copy(tokenizer_path, root / TOKENIZER_FILE)


# ------------------------------------------------------------------------------- detection
def detect_layout(path: str) -> str:
    """Names the layout of `path`: model_dir, workdir, step_dir, hf, tf or tf_prefix.

    Raises ValueError naming `path`, listing what was looked for, when it is none of them (or
    does not exist).
    """
    if files.as_path(f"{path}.index").is_file():
        return "tf_prefix"
    root = files.as_path(path)
    if not root.is_dir():
        if error := index_missing(path):  # a TF prefix whose .index is gone
            raise error
        raise ValueError(
            f"load_pretrained: {path!r} does not exist; pass a model dir, a training workdir or "
            "step dir, an HF dir or an official TF1 dir"
        )
    has = lambda *names: all((root / n).exists() for n in names)
    if has(MODEL_CONFIG_FILE, PARAMS_DIR):
        return "model_dir"
    if (root / CHECKPOINTS_DIR).is_dir():
        return "workdir"
    if checkpoint_dirs.is_step_dir(root):
        return "step_dir"
    if has("config.json") and any(has(w) for w in HF_WEIGHT_FILES):
        return "hf"
    if has("albert_config.json") and any(root.glob("*.index")):
        return "tf"
    if has("albert_config.json") and (error := index_missing(path)):
        raise error
    raise ValueError(
        f"load_pretrained: {path!r} is not a known checkpoint layout. Looked for: an albert_jax "
        f"model dir ({MODEL_CONFIG_FILE} + {PARAMS_DIR}/), a training workdir "
        f"({CHECKPOINTS_DIR}/<step>/), a step dir (params/ + meta/), an HF dir (config.json + "
        f"one of {', '.join(HF_WEIGHT_FILES)}), an official TF1 dir "
        "(albert_config.json + model.ckpt-*.index) or a TF checkpoint prefix (PREFIX.index). "
        f"Found: {sorted(p.name for p in root.iterdir())[:20]}"
    )


# --------------------------------------------------------------------------------- readers
def find_spm_model(directory: str, preferred: Iterable[str]) -> str | None:
    """`directory/<preferred name>`, else the only `*.model` file there, else None."""
    root = files.as_path(directory)
    for name in preferred:
        if (root / name).is_file():
            return str(root / name)
    candidates = sorted(str(p) for p in root.glob("*.model"))
    if len(candidates) > 1:
        log.warning("%s: several sentencepiece models %s; using none", directory, candidates)
    return candidates[0] if len(candidates) == 1 else None


def load_tf_checkpoint(
    src: str, config_path: str | None = None
) -> tuple[ModelConfig, dict[str, Any], str | None]:
    """An official TF1 release dir (`albert_config.json`, `model.ckpt-*`, `30k-clean.model`) or
    a bare checkpoint prefix, local or remote -> (ModelConfig, `{"params": ...}`, sentencepiece
    model path or None). The config is `config_path`, else the `albert_config.json` in the dir
    or next to the prefix.

    Raises:
      ValueError: naming `src` when it is neither a dir nor a prefix, or has no config.
    """
    root = files.as_path(src)
    if root.is_dir():
        directory, prefix = root, None
    elif files.as_path(f"{src}.index").is_file():
        directory, prefix = root.parent, src
    elif error := index_missing(src):
        raise error
    else:
        raise ValueError(
            f"official TF1 checkpoint: {src} does not exist (neither a dir nor a checkpoint "
            f"prefix with {src}.index)"
        )
    config_path = config_path or str(directory / "albert_config.json")
    if not files.as_path(config_path).is_file():
        raise ValueError(
            f"official TF1 checkpoint {src}: no {config_path}; pass its albert_config.json"
        )
    config = ModelConfig.from_json(config_path)
    params = tf_checkpoint_to_params(prefix or find_tf_checkpoint(src), config)
    return config, params, find_spm_model(str(directory), ("30k-clean.model",))


def _load_step_dir(
    step_dir: str, run_seed: int | None
) -> tuple[ModelConfig, dict[str, Any], int, str | None]:
    meta, params = checkpoint_dirs.read_step_dir(step_dir, run_seed)
    if "model_config" not in meta:
        raise ValueError(f"{step_dir}/meta: needs a 'model_config' entry (see checkpoint_meta)")
    config = ModelConfig.from_dict(meta["model_config"])
    step_path = files.as_path(step_dir)
    # WORKDIR/checkpoints/<step> -> WORKDIR, where the run keeps its tokenizer.
    tokenizer = step_path.parent.parent / TOKENIZER_FILE
    step = int(meta.get("step", step_path.name))
    return config, {"params": params}, step, str(tokenizer) if tokenizer.is_file() else None


def _load_model_dir(directory: str) -> tuple[ModelConfig, dict[str, Any], str | None]:
    root = files.as_path(directory)
    config = ModelConfig.from_dict(files.read_json(root / MODEL_CONFIG_FILE))
    params = checkpoint_dirs.read_item_numpy(root / PARAMS_DIR)
    tokenizer = root / TOKENIZER_FILE
    return config, params, str(tokenizer) if tokenizer.is_file() else None


def _load_tokenizer(path: str | None) -> Any | None:
    if path is None:
        return None
    try:
        from albert_jax.data.tokenizer import Tokenizer
    except ImportError as e:  # the data package may be unavailable in a minimal install
        log.warning("sentencepiece model %s found but no Tokenizer class (%s)", path, e)
        return None
    # The model's bytes through epath: the path may be remote.
    return Tokenizer(model_proto=files.as_path(path).read_bytes())


# ------------------------------------------------------------------------------ completion
def _expected(config: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """{path: ShapeDtypeStruct} of every weight of `AlbertForPreTraining(config)` (traced, not
    run: nothing is initialized)."""
    model = AlbertForPreTraining(config)
    seq_len = min(8, config.max_position_embeddings)
    init = lambda rng: nn.meta.unbox(init_params(model, rng, seq_len=seq_len))
    return flatten_params(jax.eval_shape(init, jax.random.key(0)))


def _check(weights: Mapping[str, Any], expected: Mapping[str, Any], source: str) -> tuple[str, ...]:
    """The optional parts (`OPTIONAL_PARTS`) that `weights` lacks whole.

    Raises one ValueError listing every other missing or mis-shaped weight of `expected`.
    Weights beyond `expected` (a fine-tuning run's task head) are no error.
    """
    absent = tuple(
        part
        for part in OPTIONAL_PARTS
        if not any(k.startswith(part + "/") for k in weights)
        and any(k.startswith(part + "/") for k in expected)
    )
    in_absent = lambda k: k.startswith(tuple(part + "/" for part in absent))
    missing = [k for k in expected if k not in weights and not in_absent(k)]
    mismatched = [
        f"{k}: checkpoint {tuple(weights[k].shape)}, expected {tuple(expected[k].shape)}"
        for k in expected
        if k in weights and tuple(weights[k].shape) != tuple(expected[k].shape)
    ]
    if missing or mismatched:
        raise ValueError(format_problems(f"{source} vs its ModelConfig", missing, mismatched))
    return absent


def _complete(checkpoint: Checkpoint, expected: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """`{"params": ...}` of exactly the model's weights: the checkpoint's, and its `absent`
    parts initialized from `seed`; weights the model has no use for are dropped (logged)."""
    weights, source = checkpoint.weights, f"{checkpoint.source} checkpoint {checkpoint.path}"
    extra = sorted(set(weights) - set(expected))
    if extra:
        log.warning("%s: %d parameter(s) not used by the model: %s", source, len(extra), extra)
    out = {k: weights[k] for k in expected if k in weights}
    if checkpoint.absent:
        rng = np.random.default_rng(seed)
        for k, v in expected.items():
            if k not in out:
                out[k] = _initial_value(k, v.shape, v.dtype, checkpoint.config, rng)
        log.warning(
            "%s: no %s in the checkpoint; initialized them (seed %d)",
            source, list(checkpoint.absent), seed,
        )  # fmt: skip
    return unflatten_params(out)


def _initial_value(
    path: str, shape: tuple[int, ...], dtype: Any, config: ModelConfig, rng: np.random.Generator
) -> np.ndarray:
    """The model's own initialization, drawn in numpy for a head the checkpoint lacks.

    Same distributions as `albert_jax.model.albert`: LayerNorm scale 1, biases 0, kernels
    from a normal with std `initializer_range` truncated at 2 std (not re-scaled, as TF).
    Drawn on the host so that no init program has to be compiled just to fill a few head
    weights.
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
def read_checkpoint(path: str, *, run_seed: int | None = None) -> Checkpoint:
    """One read of an albert_jax model dir / workdir / step dir, an HF dir or an official TF1
    dir, local or remote: the weights as stored (see `Checkpoint`), checked against the
    checkpoint's own ModelConfig. Fine-tuning inits read their checkpoint with this alone.

    `run_seed` picks one run of a fine-tuning checkpoint of several seeds (`config.num_seeds`).

    Raises:
      ValueError: naming `path` when it does not exist or is no known layout, listing every
        missing or mis-shaped parameter, or naming the seeds held when `run_seed` is none of
        them (or is set for a checkpoint of one model without seeded runs).
    """
    return _read(path, run_seed)[0]


def _read(path: str, run_seed: int | None) -> tuple[Checkpoint, dict[str, Any]]:
    """(`read_checkpoint`'s Checkpoint, {path: ShapeDtypeStruct} of the pretraining model)."""
    layout = detect_layout(path)
    step = None
    if layout in ("workdir", "step_dir"):
        step_dir = checkpoint_dirs.latest_step_dir(path) if layout == "workdir" else path
        config, params, step, tokenizer_path = _load_step_dir(step_dir, run_seed)
        source = "albert_jax"
    elif run_seed is not None:  # only training checkpoints record the seeds of their runs
        raise ValueError(
            f"run_seed={run_seed}: {path!r} ({layout}) holds one model, not the runs of seeds "
            "of a fine-tuning checkpoint; leave run_seed (fine-tuning: config.init_run_seed) "
            "unset"
        )
    elif layout == "model_dir":
        config, params, tokenizer_path = _load_model_dir(path)
        source = "albert_jax"
    elif layout == "hf":
        config, params = load_hf_checkpoint(path)
        tokenizer_path = find_spm_model(path, ("spiece.model", TOKENIZER_FILE))
        source = "hf"
    else:  # an official TF1 dir or checkpoint prefix
        config, params, tokenizer_path = load_tf_checkpoint(path)
        source = "tf"
    weights = {k: to_numpy(v) for k, v in flatten_params(params).items()}
    expected = _expected(config)
    absent = _check(weights, expected, f"{source} checkpoint {path}")
    checkpoint = Checkpoint(
        config=config,
        weights=weights,
        source=source,
        path=path,
        step=step,
        tokenizer=_load_tokenizer(tokenizer_path),
        tokenizer_path=tokenizer_path,
        absent=absent,
    )
    return checkpoint, expected


def load_pretrained(
    path: str,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    seed: int = 0,
    run_seed: int | None = None,
) -> Pretrained:
    """Loads an albert_jax model dir / workdir / step dir, an HF dir or an official TF1 dir,
    local or remote: `read_checkpoint`, with the parts the checkpoint lacks initialized and
    anything beyond the pretraining model (a task head) left out.

    `dtype` overrides the compute dtype (`ModelConfig.dtype`, e.g. "bfloat16"); `param_dtype`
    casts the weights (default: as stored; HF / TF weights are read as float32). `seed`
    initializes parts the checkpoint lacks. `run_seed` picks one run of a fine-tuning checkpoint
    of several seeds (`config.num_seeds`).

    Raises:
      ValueError: naming `path` when it does not exist or is no known layout, listing every
        missing or mis-shaped parameter, or naming the seeds a checkpoint holds when `run_seed`
        is none of them.
    """
    checkpoint, expected = _read(path, run_seed)
    params = _complete(checkpoint, expected, seed)
    config = checkpoint.config
    if param_dtype is not None:
        config = config.replace(param_dtype=param_dtype)  # validates the name
        flat = flatten_params(params)
        cast = config.weight_dtype
        params = unflatten_params({k: v.astype(cast) for k, v in flat.items()})
    if dtype is not None:
        config = config.replace(dtype=dtype)
    return Pretrained(
        model=AlbertForPreTraining(config),
        params=jax.device_put(params["params"]),
        config=config,
        tokenizer=checkpoint.tokenizer,
        source=checkpoint.source,
        path=path,
        step=checkpoint.step,
        initialized=checkpoint.absent,
        tokenizer_path=checkpoint.tokenizer_path,
    )
