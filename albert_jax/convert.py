"""Checkpoint interop: HuggingFace (PyTorch) <-> albert_jax, official TF1 -> albert_jax.

One name table (`_layout`) maps every albert_jax parameter to its HF `state_dict` key and its
official TF1 variable name (ALBERT_REFERENCE.md Sec. 4), with the reshapes between the stored
2-D matrices and our head-split kernels:

  query/key/value kernel   ours [H,N,D]  <- TF [H,H] (in, out)   <- HF weight [H,H] (out, in)
  query/key/value bias     ours [N,D]    <- [H]
  attention output kernel  ours [N,D,H]  <- TF [H,H]             <- HF weight [H,H]
  other dense kernels      ours [in,out] <- TF [in,out]          <- HF weight [out,in]
  SOP classifier kernel    ours [H,2]    <- TF output_weights [2,H], HF weight [2,H]
  LayerNorm scale / bias   ours          <- TF gamma / beta      <- HF weight / bias

The official and HF layouts are ALBERT's "all-shared within a group" (`sharing="all"`); other
sharing strategies have no equivalent there and raise `ValueError`.

"Params" here is the variables tree that goes into `model.apply`: `{"params": {...}}` of plain
(unboxed) numpy arrays. Converters also accept the inner `{...}` tree and jax arrays.

Missing or mis-shaped tensors raise one `ValueError` listing all of them; extra tensors are
logged (warning) with their names; optimizer slots and `global_step` are logged as ignored.
The pooler, the MLM head and the SOP head are optional on import (an HF `AlbertModel` or
`AlbertForMaskedLM` checkpoint lacks some): an absent part is left out and reported, and
`load_pretrained` initializes it.

CLI:
  python -m albert_jax.convert --from=hf --src=HF_DIR --dst=MODEL_DIR
  python -m albert_jax.convert --from=tf --src=OFFICIAL_DIR_OR_CKPT_PREFIX --dst=MODEL_DIR
  python -m albert_jax.convert --to=hf --src=MODEL_DIR_OR_WORKDIR --dst=HF_DIR
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from albert_jax.config import ModelConfig

__all__ = [
    "OPTIONAL_PARTS",
    "hf_state_dict_to_params",
    "params_to_hf_state_dict",
    "to_hf_config",
    "load_hf_state_dict",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "tf_checkpoint_to_params",
    "find_tf_checkpoint",
    "find_spm_model",
    "load_tf_dir",
    "missing_parts",
    "flatten_params",
    "unflatten_params",
]

log = logging.getLogger(__name__)

# Sub-trees of variables["params"] that a checkpoint may lack (they get initialized on load).
OPTIONAL_PARTS = ("albert/pooler", "predictions", "sop_classifier")

# HF keys that duplicate another tensor (the tied MLM decoder) and non-parameter buffers.
_HF_ALIASES = {
    "predictions.decoder.weight": "albert.embeddings.word_embeddings.weight",
    "predictions.decoder.bias": "predictions.bias",
}
_HF_BUFFERS = re.compile(r"(^|\.)embeddings\.(position_ids|token_type_ids)$")
# Training-only TF variables: optimizer slots / accumulators, step counters, loss scaling.
_TF_IGNORED = re.compile(
    r"(^|/)(global_step|beta1_power|beta2_power|good_steps|loss_scale|current_loss_scale)$"
    r"|/(adam|lamb)_[mv]$"
    r"|(^|/)(AdamWeightDecayOptimizer|LAMBOptimizer)(_\d+)?(/|$)"
)
_HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# ------------------------------------------------------------------------------- name table
@dataclasses.dataclass(frozen=True)
class _Stored:
    """How one tensor is stored in a foreign checkpoint."""

    name: str
    shape: tuple[int, ...]
    transposed: bool  # stored as [out, in] (PyTorch Linear, TF output_weights)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One albert_jax parameter and its HF / TF1 counterparts."""

    path: str  # under variables["params"], "/"-joined
    shape: tuple[int, ...]
    hf: _Stored
    tf: _Stored
    part: str  # one of OPTIONAL_PARTS, or "" for the always-required backbone

    def stored(self, fmt: str) -> _Stored:
        return self.hf if fmt == "hf" else self.tf

    def to_ours(self, x: np.ndarray, fmt: str) -> np.ndarray:
        """Stored array -> our shape (transpose [out,in] matrices, split heads)."""
        if self.stored(fmt).transposed:
            x = x.T
        return x.reshape(self.shape)

    def to_stored(self, x: np.ndarray, fmt: str) -> np.ndarray:
        """Our array -> the stored shape (inverse of `to_ours`)."""
        s = self.stored(fmt)
        if s.transposed:
            return np.ascontiguousarray(x.reshape(s.shape[::-1]).T)
        return np.ascontiguousarray(x.reshape(s.shape))


def _kernel(path, in_shape, out_shape, hf, tf, part="", tf_transposed=False) -> _Entry:
    """A dense kernel: ours [*in_shape, *out_shape]; HF [out, in]; TF [in, out] (or [out, in])."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    tf_shape = (n_out, n_in) if tf_transposed else (n_in, n_out)
    return _Entry(
        path,
        (*in_shape, *out_shape),
        _Stored(hf, (n_out, n_in), True),
        _Stored(tf, tf_shape, tf_transposed),
        part,
    )


def _vector(path, shape, hf, tf, part="") -> _Entry:
    """A bias or LayerNorm parameter: ours `shape` (e.g. [N,D]); stored flat."""
    flat = (math.prod(shape),)
    return _Entry(path, tuple(shape), _Stored(hf, flat, False), _Stored(tf, flat, False), part)


def _table(path, shape, hf, tf) -> _Entry:
    """An embedding table [rows, E], stored as is."""
    return _Entry(path, tuple(shape), _Stored(hf, shape, False), _Stored(tf, shape, False), "")


def _dense(path, in_shape, out_shape, hf, tf, part="") -> list[_Entry]:
    """Kernel + bias of a dense layer; `hf` is the module prefix, `tf` the TF scope."""
    return [
        _kernel(f"{path}/kernel", in_shape, out_shape, f"{hf}.weight", f"{tf}/kernel", part),
        _vector(f"{path}/bias", out_shape, f"{hf}.bias", f"{tf}/bias", part),
    ]


def _layer_norm(path, width, hf, tf, part="") -> list[_Entry]:
    return [
        _vector(f"{path}/scale", (width,), f"{hf}.weight", f"{tf}/gamma", part),
        _vector(f"{path}/bias", (width,), f"{hf}.bias", f"{tf}/beta", part),
    ]


def _check_shared(config: ModelConfig, what: str) -> None:
    if config.sharing != "all":
        raise ValueError(
            f"{what}: ModelConfig.sharing={config.sharing!r} has no HF / official TF layout "
            "(those checkpoints share every sub-block within a group); only sharing='all' "
            "converts"
        )


def _layout(config: ModelConfig) -> list[_Entry]:
    """Every parameter of `AlbertForPreTraining(config)` (sharing="all") with its HF/TF names."""
    _check_shared(config, "checkpoint conversion")
    V, E, H = config.vocab_size, config.embedding_size, config.hidden_size
    N, D, F = config.num_attention_heads, config.head_dim, config.intermediate_size
    emb_hf, emb_tf = "albert.embeddings", "bert/embeddings"
    entries = [
        _table("albert/embeddings/word_embeddings", (V, E), f"{emb_hf}.word_embeddings.weight",
               f"{emb_tf}/word_embeddings"),
        _table("albert/embeddings/position_embeddings", (config.max_position_embeddings, E),
               f"{emb_hf}.position_embeddings.weight", f"{emb_tf}/position_embeddings"),
        _table("albert/embeddings/token_type_embeddings", (config.type_vocab_size, E),
               f"{emb_hf}.token_type_embeddings.weight", f"{emb_tf}/token_type_embeddings"),
        *_layer_norm("albert/embeddings/LayerNorm", E, f"{emb_hf}.LayerNorm",
                     f"{emb_tf}/LayerNorm"),
    ]  # fmt: skip
    if config.has_embedding_projection:
        entries += _dense(
            "albert/encoder/embedding_hidden_mapping_in", (E,), (H,),
            "albert.encoder.embedding_hidden_mapping_in",
            "bert/encoder/embedding_hidden_mapping_in",
        )  # fmt: skip
    for g in range(config.num_hidden_groups):
        for i in range(config.inner_group_num):
            ours = f"albert/encoder/group_{g}/inner_group_{i}"
            hf = f"albert.encoder.albert_layer_groups.{g}.albert_layers.{i}"
            tf = f"bert/encoder/transformer/group_{g}/inner_group_{i}"
            for name in ("query", "key", "value"):
                entries += _dense(
                    f"{ours}/attention/{name}",
                    (H,),
                    (N, D),
                    f"{hf}.attention.{name}",
                    f"{tf}/attention_1/self/{name}",
                )
            entries += [
                *_dense(f"{ours}/attention/output", (N, D), (H,), f"{hf}.attention.dense",
                        f"{tf}/attention_1/output/dense"),
                *_layer_norm(f"{ours}/attention/LayerNorm", H, f"{hf}.attention.LayerNorm",
                             f"{tf}/LayerNorm"),
                *_dense(f"{ours}/ffn/intermediate", (H,), (F,), f"{hf}.ffn",
                        f"{tf}/ffn_1/intermediate/dense"),
                # The official FFN output scope is nested inside `intermediate/` (Sec. 4).
                *_dense(f"{ours}/ffn/output", (F,), (H,), f"{hf}.ffn_output",
                        f"{tf}/ffn_1/intermediate/output/dense"),
                *_layer_norm(f"{ours}/ffn/LayerNorm", H, f"{hf}.full_layer_layer_norm",
                             f"{tf}/LayerNorm_1"),
            ]  # fmt: skip
    entries += [
        *_dense("albert/pooler", (H,), (H,), "albert.pooler", "bert/pooler/dense",
                part="albert/pooler"),
        *_dense("predictions/dense", (H,), (E,), "predictions.dense",
                "cls/predictions/transform/dense", part="predictions"),
        *_layer_norm("predictions/LayerNorm", E, "predictions.LayerNorm",
                     "cls/predictions/transform/LayerNorm", part="predictions"),
        _vector("predictions/output_bias", (V,), "predictions.bias", "cls/predictions/output_bias",
                part="predictions"),
        _kernel("sop_classifier/classifier/kernel", (H,), (2,), "sop_classifier.classifier.weight",
                "cls/seq_relationship/output_weights", part="sop_classifier", tf_transposed=True),
        _vector("sop_classifier/classifier/bias", (2,), "sop_classifier.classifier.bias",
                "cls/seq_relationship/output_bias", part="sop_classifier"),
    ]  # fmt: skip
    return entries


# ------------------------------------------------------------------------------ tree helpers
def flatten_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """`{"params": {...}}` (or the inner tree) -> {"albert/embeddings/...": array}."""
    if set(params) == {"params"}:
        params = params["params"]
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}/{key}" if prefix else str(key))
        else:
            flat[prefix] = getattr(node, "value", node)  # tolerate flax Partitioned boxes

    walk(params, "")
    return flat


def unflatten_params(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a/b/c": x} -> `{"params": {"a": {"b": {"c": x}}}}` (the tree `model.apply` takes)."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return {"params": tree}


def missing_parts(params: Mapping[str, Any]) -> list[str]:
    """Which of `OPTIONAL_PARTS` (pooler, MLM head, SOP head) `params` lacks."""
    flat = flatten_params(params)
    return [p for p in OPTIONAL_PARTS if not any(k.startswith(p + "/") for k in flat)]


def _to_numpy(x: Any) -> np.ndarray:
    """numpy / jax / torch (CPU) array -> numpy; torch bfloat16 is upcast exactly to float32."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _format_problems(what: str, missing: list[str], mismatched: list[str]) -> str:
    lines = [f"{what}: {len(missing)} missing and {len(mismatched)} mis-shaped tensor(s)"]
    lines += [f"  missing: {name}" for name in missing]
    lines += [f"  shape mismatch: {m}" for m in mismatched]
    return "\n".join(lines)


# ------------------------------------------------------------------------- generic importer
@dataclasses.dataclass
class _ImportReport:
    absent_parts: list[str]
    unexpected: list[str]
    ignored: list[str]


def _import(
    entries: list[_Entry],
    fmt: str,
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
    dtype: np.dtype,
    source: str,
    ignored: Iterable[str] = (),
) -> tuple[dict[str, Any], _ImportReport]:
    """Reads every entry from a foreign checkpoint (name -> shape map + reader).

    An optional part none of whose tensors is present is skipped; anything else missing, or any
    shape mismatch, is collected and raised together.
    """
    present_parts = {e.part for e in entries if e.part and e.stored(fmt).name in shapes}
    absent = [p for p in OPTIONAL_PARTS if p not in present_parts]
    missing, mismatched, used = [], [], set()
    flat: dict[str, np.ndarray] = {}
    for e in entries:
        s = e.stored(fmt)
        if e.part in absent:
            continue
        if s.name not in shapes:
            missing.append(s.name)
            continue
        used.add(s.name)
        if tuple(shapes[s.name]) != s.shape:
            mismatched.append(f"{s.name}: checkpoint {tuple(shapes[s.name])}, expected {s.shape}")
            continue
        flat[e.path] = e.to_ours(_to_numpy(read(s.name)), fmt).astype(dtype, copy=False)
    if missing or mismatched:
        raise ValueError(_format_problems(source, missing, mismatched))
    ignored = sorted(ignored)
    unexpected = sorted(set(shapes) - used - set(ignored))
    if absent:
        log.warning("%s: no %s in the checkpoint (left out; initialize them)", source, absent)
    if ignored:
        log.info(
            "%s: ignored %d variable(s) (optimizer state, buffers, tied copies): %s",
            source,
            len(ignored),
            ignored,
        )
    if unexpected:
        log.warning(
            "%s: %d checkpoint tensor(s) not used by AlbertForPreTraining: %s",
            source,
            len(unexpected),
            unexpected,
        )
    return unflatten_params(flat), _ImportReport(absent, unexpected, ignored)


def _projection_check(config: ModelConfig, has_projection: bool, source: str) -> None:
    if has_projection and not config.has_embedding_projection:
        raise ValueError(
            f"{source} has embedding_hidden_mapping_in but the config has no E->H projection "
            f"(embedding_size == hidden_size == {config.hidden_size}); set "
            "ModelConfig.always_project_embeddings=True"
        )


# ---------------------------------------------------------------------------------- HF side
def _normalize_hf_keys(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Adds the `albert.` prefix that base-model (`AlbertModel`) checkpoints lack."""
    out = {}
    for key, value in state_dict.items():
        if key.startswith(("embeddings.", "encoder.", "pooler.")):
            key = "albert." + key
        out[key] = value
    return out


def hf_state_dict_to_params(state_dict: Mapping[str, Any], config: ModelConfig) -> dict[str, Any]:
    """HF `AlbertForPreTraining` / `AlbertModel` state dict -> `{"params": {...}}` (numpy).

    Keys may carry the `albert.` prefix or not. The tied decoder copies
    (`predictions.decoder.weight` / `.bias`) are checked against the tensors they duplicate.
    Absent heads are left out and logged (see `missing_parts`). Values are cast to
    `config.param_dtype`.
    """
    source = "HF state dict"
    sd = _normalize_hf_keys(state_dict)
    _projection_check(config, "albert.encoder.embedding_hidden_mapping_in.weight" in sd, source)
    ignored = [k for k in sd if _HF_BUFFERS.search(k)]
    for alias, canonical in _HF_ALIASES.items():
        if alias not in sd:
            continue
        if canonical not in sd:
            sd[canonical] = sd[alias]  # only the decoder copy was saved: it is the tensor
        elif not np.array_equal(_to_numpy(sd[alias]), _to_numpy(sd[canonical])):
            # HF ties them on load too, so the canonical tensor is what HF would run with.
            log.warning("%s: %s differs from %s; using the latter (tied)", source, alias, canonical)
        ignored.append(alias)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    params, _ = _import(
        _layout(config), "hf", shapes, sd.__getitem__, config.weight_dtype, source, ignored
    )
    return params


def params_to_hf_state_dict(
    params: Mapping[str, Any], config: ModelConfig, *, tied_duplicates: bool = False
) -> dict[str, np.ndarray]:
    """`{"params": ...}` -> HF `AlbertForPreTraining` state dict of numpy arrays.

    HF always has the E->H projection: a config without one (official E == H) gets an identity
    kernel and zero bias, which computes the same function. `tied_duplicates=True` also emits
    `predictions.decoder.{weight,bias}` (needed by `load_state_dict(strict=True)`; `save_pretrained`
    files leave them out). Missing, mis-shaped or extra parameters raise `ValueError`.
    """
    _check_shared(config, "params_to_hf_state_dict")
    flat = {k: _to_numpy(v) for k, v in flatten_params(params).items()}
    entries = _layout(config)
    missing, mismatched = [], []
    out: dict[str, np.ndarray] = {}
    for e in entries:
        if e.path not in flat:
            missing.append(e.path)
        elif flat[e.path].shape != e.shape:
            mismatched.append(f"{e.path}: params {flat[e.path].shape}, expected {e.shape}")
        else:
            out[e.hf.name] = e.to_stored(flat[e.path], "hf")
    extra = sorted(set(flat) - {e.path for e in entries})
    if missing or mismatched or extra:
        msg = _format_problems("params_to_hf_state_dict", missing, mismatched)
        if extra:
            msg += "\n" + "\n".join(f"  no HF equivalent: {p}" for p in extra)
        raise ValueError(msg)
    if not config.has_embedding_projection:
        # E == H here, so the identity is square and leaves the embeddings unchanged.
        dtype = out["albert.embeddings.word_embeddings.weight"].dtype
        H = config.hidden_size
        out["albert.encoder.embedding_hidden_mapping_in.weight"] = np.eye(H, dtype=dtype)
        out["albert.encoder.embedding_hidden_mapping_in.bias"] = np.zeros(H, dtype=dtype)
    if tied_duplicates:
        for alias, canonical in _HF_ALIASES.items():
            out[alias] = out[canonical]
    return out


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> HF `config.json` contents for `AlbertForPreTraining`."""
    _check_shared(config, "to_hf_config")
    return {
        "architectures": ["AlbertForPreTraining"],
        "model_type": "albert",
        **config.to_official_json(),
        "layer_norm_eps": config.layer_norm_eps,
        # HF applies this dropout to the pooled output before its SOP / sequence-classification
        # heads; 0.1 is HF's default and the official fine-tuning classifier dropout.
        "classifier_dropout_prob": 0.1,
        "position_embedding_type": "absolute",
        # The official sentencepiece ids: <pad>=0, [CLS]=2, [SEP]=3.
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
    }


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a `.safetensors` file as numpy (bfloat16 via ml_dtypes)."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    bf16: list[str] = []
    with safe_open(path, framework="numpy") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            if f.get_slice(key).get_dtype() == "BF16":
                bf16.append(key)  # numpy has no bfloat16: read those bytes ourselves below
            else:
                out[key] = f.get_tensor(key)
    if bf16:
        import ml_dtypes

        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for key in bf16:
            begin, end = header[key]["data_offsets"]
            count = (end - begin) // 2
            data = np.fromfile(
                path, dtype=ml_dtypes.bfloat16, count=count, offset=8 + header_len + begin
            )
            out[key] = data.reshape(header[key]["shape"])
    return out


def _read_torch_bin(path: str) -> dict[str, np.ndarray]:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: _to_numpy(v) for k, v in state.items()}


def load_hf_state_dict(hf_dir: str) -> dict[str, np.ndarray]:
    """Reads the weights of an HF model dir: `model.safetensors` (numpy; no torch needed),
    a sharded `model.safetensors.index.json`, or `pytorch_model.bin` (torch, weights_only)."""
    for name in _HF_WEIGHT_FILES:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            continue
        read = _read_safetensors if ".safetensors" in name else _read_torch_bin
        if not name.endswith(".index.json"):
            return read(path)
        with open(path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, np.ndarray] = {}
        for shard in shards:
            state.update(read(os.path.join(hf_dir, shard)))
        return state
    raise ValueError(f"{hf_dir}: no HF weights found (looked for {', '.join(_HF_WEIGHT_FILES)})")


def load_hf_checkpoint(hf_dir: str) -> tuple[ModelConfig, dict[str, Any]]:
    """HF dir (`config.json` + weights) -> (ModelConfig, `{"params": ...}`).

    The config gets `always_project_embeddings=True` (HF always has the projection) and float32
    dtypes (HF's `dtype` field is a storage type, not our compute dtype).
    """
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{hf_dir}: no config.json (not an HF model dir)")
    with open(config_path, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type != "albert":
        raise ValueError(f"{config_path}: model_type={model_type!r}, expected 'albert'")
    config = ModelConfig.from_json(config_path, dtype="float32", param_dtype="float32")
    return config, hf_state_dict_to_params(load_hf_state_dict(hf_dir), config)


def save_hf_checkpoint(
    params: Mapping[str, Any],
    config: ModelConfig,
    hf_dir: str,
    *,
    tokenizer_path: str | None = None,
) -> None:
    """Writes `config.json` + `model.safetensors` loadable by HF `AlbertForPreTraining`
    (and `spiece.model`, the HF name of the sentencepiece model, when given)."""
    from safetensors.numpy import save_file

    state = params_to_hf_state_dict(params, config)
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_hf_config(config), f, indent=2, sort_keys=True)
    # `format: pt` is what HF's loader expects in the safetensors metadata.
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_path:
        shutil.copyfile(tokenizer_path, os.path.join(hf_dir, "spiece.model"))
    log.info("wrote HF checkpoint (%d tensors) to %s", len(state), hf_dir)


# ---------------------------------------------------------------------------------- TF side
def tf_checkpoint_to_params(ckpt_prefix: str, config: ModelConfig) -> dict[str, Any]:
    """Official TF1 checkpoint (`model.ckpt-N` prefix) -> `{"params": ...}` (numpy).

    Names as in google-research/albert; a TF-Hub `module/` prefix is detected and stripped.
    Optimizer slots (`*/adam_m`, `*/lamb_v`, ...) and `global_step` are ignored (logged);
    other unused variables (e.g. fine-tuning heads) are logged as a warning.
    """
    import tensorflow as tf

    if not tf.io.gfile.exists(ckpt_prefix + ".index"):
        raise ValueError(f"{ckpt_prefix}: no TF checkpoint ({ckpt_prefix}.index does not exist)")
    reader = tf.train.load_checkpoint(ckpt_prefix)
    raw_shapes = reader.get_variable_to_shape_map()
    hub = any(name.startswith("module/") for name in raw_shapes)
    strip = (lambda n: n.removeprefix("module/")) if hub else (lambda n: n)
    names = {strip(n): n for n in raw_shapes}
    shapes = {n: tuple(raw_shapes[raw]) for n, raw in names.items()}
    source = f"TF checkpoint {ckpt_prefix}" + (" (TF-Hub module/ prefix)" if hub else "")
    _projection_check(config, "bert/encoder/embedding_hidden_mapping_in/kernel" in shapes, source)
    ignored = [n for n in shapes if _TF_IGNORED.search(n)]
    params, _ = _import(
        _layout(config),
        "tf",
        shapes,
        lambda n: reader.get_tensor(names[n]),
        config.weight_dtype,
        source,
        ignored,
    )
    return params


def find_tf_checkpoint(tf_dir: str) -> str:
    """The checkpoint prefix in an official dir: the `checkpoint` file's latest, else
    `model.ckpt-best`, else the highest-numbered `*.ckpt-N`."""
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(tf_dir)
    if latest:
        return latest
    prefixes = [p.removesuffix(".index") for p in glob.glob(os.path.join(tf_dir, "*.index"))]
    if not prefixes:
        raise ValueError(f"{tf_dir}: no TF checkpoint (no *.index file)")
    best = [p for p in prefixes if p.endswith("ckpt-best")]
    if best:
        return best[0]

    def step(prefix: str) -> int:
        m = re.search(r"-(\d+)$", prefix)
        return int(m.group(1)) if m else -1

    chosen = max(prefixes, key=step)
    if len(prefixes) > 1:
        log.info("%s: %d checkpoints, using %s", tf_dir, len(prefixes), chosen)
    return chosen


def load_tf_dir(tf_dir: str) -> tuple[ModelConfig, dict[str, Any], str | None]:
    """Official release dir (`albert_config.json`, `model.ckpt-*`, `30k-clean.model`) ->
    (ModelConfig, `{"params": ...}`, sentencepiece model path or None)."""
    config_path = os.path.join(tf_dir, "albert_config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{tf_dir}: no albert_config.json (not an official ALBERT dir)")
    config = ModelConfig.from_json(config_path)
    params = tf_checkpoint_to_params(find_tf_checkpoint(tf_dir), config)
    return config, params, find_spm_model(tf_dir, ("30k-clean.model",))


def find_spm_model(directory: str, preferred: Iterable[str]) -> str | None:
    """`directory/<preferred name>`, else the only `*.model` file there, else None."""
    for name in preferred:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    candidates = sorted(glob.glob(os.path.join(directory, "*.model")))
    if len(candidates) > 1:
        log.warning("%s: several sentencepiece models %s; using none", directory, candidates)
    return candidates[0] if len(candidates) == 1 else None


# ---------------------------------------------------------------------------------------- CLI
def _define_flags() -> None:
    """Flags are defined only when run as a program, so importing this module adds none."""
    from absl import flags

    flags.DEFINE_enum(
        "from",
        None,
        ["hf", "tf"],
        "Import into an albert_jax model dir: from an HF dir (hf), or from an official TF1 dir "
        "or checkpoint prefix (tf).",
    )
    flags.DEFINE_enum(
        "to",
        None,
        ["hf"],
        "Export an albert_jax checkpoint (model dir, workdir or step dir) to an HF "
        "AlbertForPreTraining dir (config.json + model.safetensors).",
    )
    flags.DEFINE_string("src", None, "Source: a dir, or a TF checkpoint prefix for --from=tf.")
    flags.DEFINE_string("dst", None, "Destination dir (created).")
    flags.DEFINE_string(
        "config",
        None,
        "albert_config.json for --from=tf when --src is a checkpoint prefix "
        "(default: the albert_config.json next to it).",
    )
    flags.DEFINE_string(
        "tokenizer",
        None,
        "Sentencepiece model to bundle (default: the one found next to the source, if any).",
    )
    flags.mark_flags_as_required(["src", "dst"])


def main(argv: list[str]) -> None:
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    FLAGS = flags.FLAGS
    direction_from, direction_to = FLAGS["from"].value, FLAGS.to
    if (direction_from is None) == (direction_to is None):
        raise app.UsageError("give exactly one of --from=hf|tf or --to=hf")
    src, dst = FLAGS.src, FLAGS.dst
    from albert_jax.pretrained import load_pretrained, save_model_dir

    tokenizer = FLAGS.tokenizer
    if direction_from == "hf":
        config, params = load_hf_checkpoint(src)
        tokenizer = tokenizer or find_spm_model(src, ("spiece.model",))
    elif direction_from == "tf":
        if os.path.isdir(src):
            config, params, found = load_tf_dir(src)
        else:
            config_path = FLAGS.config or os.path.join(os.path.dirname(src), "albert_config.json")
            if not os.path.exists(config_path):
                raise app.UsageError(f"--from=tf: no {config_path}; pass --config")
            config = ModelConfig.from_json(config_path)
            params, found = tf_checkpoint_to_params(src, config), None
        tokenizer = tokenizer or found
    else:
        loaded = load_pretrained(src)
        save_hf_checkpoint(
            loaded.params, loaded.config, dst, tokenizer_path=tokenizer or loaded.tokenizer_path
        )
        print(f"wrote HF AlbertForPreTraining checkpoint to {dst}")
        return
    missing = missing_parts(params)
    if missing:
        print(f"note: the source has no {missing}; load_pretrained will initialize them")
    save_model_dir(dst, params, config, tokenizer_path=tokenizer)
    n = sum(v.size for v in flatten_params(params).values())
    print(f"wrote albert_jax model dir ({n:,} parameters) to {dst}")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
