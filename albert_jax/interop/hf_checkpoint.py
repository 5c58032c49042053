"""HuggingFace (PyTorch) `AlbertForPreTraining` checkpoints <-> albert_jax params.

The state-dict conversions are pure (names and shapes from `weight_names.layout`); the dir
readers and writers take local or `gs://` paths, all through `albert_jax.files` / epath:

    HF_DIR/config.json                                 HF `AlbertConfig`
    HF_DIR/model.safetensors | model.safetensors.index.json + shards
          | pytorch_model.bin | pytorch_model.bin.index.json + shards
    HF_DIR/spiece.model                                sentencepiece model (optional)

Weights are read as bytes (no local file needed): safetensors by the `safetensors` library
(numpy, bfloat16 via ml_dtypes, no torch), `.bin` files by `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import logging
import re
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from albert_jax import files
from albert_jax.interop.weight_names import (
    Entry,
    check_projection,
    check_shared,
    flatten_params,
    format_problems,
    import_tensors,
    layout,
    to_numpy,
    unreadable,
)
from albert_jax.model.config import ModelConfig

__all__ = [
    "HF_WEIGHT_FILES",
    "hf_state_dict_to_params",
    "params_to_hf_state_dict",
    "to_hf_config",
    "read_safetensors",
    "load_hf_state_dict",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
]

# One logger for every conversion message, whichever module emits it (users filter on it).
log = logging.getLogger("albert_jax.convert")

# HF keys that duplicate another tensor (the tied MLM decoder) and non-parameter buffers.
HF_ALIASES = {
    "predictions.decoder.weight": "albert.embeddings.word_embeddings.weight",
    "predictions.decoder.bias": "predictions.bias",
}
HF_BUFFERS = re.compile(r"(^|\.)embeddings\.(position_ids|token_type_ids)$")
HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# ------------------------------------------------------------------------ state-dict mapping
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
    check_projection(config, "albert.encoder.embedding_hidden_mapping_in.weight" in sd, source)
    ignored = [k for k in sd if HF_BUFFERS.search(k)]
    for alias, canonical in HF_ALIASES.items():
        if alias not in sd:
            continue
        if canonical not in sd:
            sd[canonical] = sd[alias]  # only the decoder copy was saved: it is the tensor
        elif not np.array_equal(to_numpy(sd[alias]), to_numpy(sd[canonical])):
            # HF ties them on load too, so the canonical tensor is what HF would run with.
            log.warning("%s: %s differs from %s; using the latter (tied)", source, alias, canonical)
        ignored.append(alias)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    return import_tensors(
        layout(config), "hf", shapes, sd.__getitem__, config.weight_dtype, source, ignored
    )


def params_to_hf_state_dict(
    params: Mapping[str, Any],
    config: ModelConfig,
    *,
    tied_duplicates: bool = False,
    entries: list[Entry] | None = None,
) -> dict[str, np.ndarray]:
    """`{"params": ...}` -> HF `AlbertForPreTraining` state dict of numpy arrays (or, with
    `entries` = `weight_names.task_layout(...)`, the state dict of that HF task model).

    HF always has the E->H projection: a config without one (official E == H) gets an identity
    kernel and zero bias, which computes the same function. `tied_duplicates=True` also emits
    `predictions.decoder.{weight,bias}` (needed by `load_state_dict(strict=True)`; `save_pretrained`
    files leave them out). Missing, mis-shaped or extra parameters raise `ValueError`.
    """
    check_shared(config, "params_to_hf_state_dict")
    flat = {k: to_numpy(v) for k, v in flatten_params(params).items()}
    entries = layout(config) if entries is None else entries
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
        msg = format_problems("params_to_hf_state_dict", missing, mismatched)
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
        for alias, canonical in HF_ALIASES.items():
            if canonical in out:  # task layouts have no MLM decoder to tie
                out[alias] = out[canonical]
    return out


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> HF `config.json` contents for `AlbertForPreTraining`."""
    check_shared(config, "to_hf_config")
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


# ------------------------------------------------------------------------------------- files
# safetensors dtype names -> numpy (bfloat16 through ml_dtypes, which numpy lacks).
_SAFETENSORS_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U8": "u1", "BOOL": "?",
}  # fmt: skip


def _truncation(data: bytes) -> str | None:
    """Why `data` is a cut-off safetensors file, or None. The library calls a cut-off file
    "invalid header length" or "file not fully covered"; a user needs to hear "truncated"."""
    if len(data) < 8:
        return f"truncated: {len(data)} bytes, less than its 8-byte header size"
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        return f"truncated: its header needs {header_len} bytes, {len(data) - 8} follow"
    try:
        header = json.loads(data[8 : 8 + header_len])
        ends = [(int(v["data_offsets"][1]), k) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # malformed rather than cut off: the library's reason says how
    available = len(data) - 8 - header_len
    end, name = max(ends, default=(0, ""))
    if end > available:
        return f"truncated: tensor {name} ends at data byte {end}, the file holds {available}"
    return None


def read_safetensors(data: bytes, source: str = "safetensors") -> dict[str, np.ndarray]:
    """All tensors of a `.safetensors` file's bytes as numpy arrays (bfloat16 as
    `ml_dtypes.bfloat16`). The `safetensors` library parses and validates the file (offsets
    that overlap, leave gaps or run past the end are refused); `source` names the file in
    errors: a truncated or malformed file raises one ValueError (`weight_names.unreadable`)."""
    import safetensors

    what = "safetensors file"
    try:
        tensors = safetensors.deserialize(data)
    except safetensors.SafetensorError as e:
        reason = _truncation(data) or str(e).removeprefix("Error while deserializing: ")
        raise unreadable(source, what, reason) from e
    out: dict[str, np.ndarray] = {}
    for name, info in tensors:
        dtype_name = info["dtype"]
        if dtype_name == "BF16":
            import ml_dtypes

            dtype = np.dtype(ml_dtypes.bfloat16)
        elif dtype_name in _SAFETENSORS_DTYPES:
            dtype = np.dtype(_SAFETENSORS_DTYPES[dtype_name])
        else:
            raise ValueError(
                f"{source}: tensor {name} has dtype {dtype_name}, which numpy cannot hold; "
                "convert the checkpoint to float32 or bfloat16"
            )
        out[name] = np.frombuffer(info["data"], dtype).reshape(info["shape"])
    return out


def _read_weights(path: Any) -> dict[str, np.ndarray]:
    """One weights file (an epath.Path, local or remote) -> {name: numpy array}; a file that
    cannot be parsed raises one ValueError naming it."""
    data = path.read_bytes()
    if path.name.endswith(".safetensors"):
        return read_safetensors(data, str(path))
    import torch

    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch reports a bad file as one of many types (zip, pickle, ...)
        raise unreadable(path, "PyTorch state dict", e) from e
    if not isinstance(state, Mapping):
        raise unreadable(path, "PyTorch state dict", f"holds a {type(state).__name__}")
    return {k: to_numpy(v) for k, v in state.items()}


def _require_dir(path: str, what: str) -> Any:
    """`files.as_path(path)`, or ValueError naming `path` when it is not a directory."""
    directory = files.as_path(path)
    if not directory.is_dir():
        raise ValueError(f"{what}: {path} does not exist (or is not a directory)")
    return directory


def load_hf_state_dict(hf_dir: str) -> dict[str, np.ndarray]:
    """Reads the weights of an HF model dir (local or remote): `model.safetensors` (numpy; no
    torch needed), a sharded `model.safetensors.index.json`, or `pytorch_model.bin` (torch,
    weights_only)."""
    directory = _require_dir(hf_dir, "HF checkpoint")
    for name in HF_WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return _read_weights(path)
        index = files.read_json(path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise unreadable(path, "weights index", "no 'weight_map' object")
        state: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).is_file():
                raise ValueError(f"{path} names the shard {shard}, which is not in {hf_dir}")
            state.update(_read_weights(directory / shard))
        return state
    raise ValueError(f"{hf_dir}: no HF weights found (looked for {', '.join(HF_WEIGHT_FILES)})")


def load_hf_checkpoint(hf_dir: str) -> tuple[ModelConfig, dict[str, Any]]:
    """HF dir (`config.json` + weights, local or remote) -> (ModelConfig, `{"params": ...}`).

    The config gets `always_project_embeddings=True` (HF always has the projection) and float32
    dtypes (HF's `dtype` field is a storage type, not our compute dtype).
    """
    config_path = str(_require_dir(hf_dir, "HF checkpoint") / "config.json")
    if not files.as_path(config_path).is_file():
        raise ValueError(f"{hf_dir}: no config.json (not an HF model dir)")
    model_type = files.read_json(config_path).get("model_type")
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
    (and `spiece.model`, the HF name of the sentencepiece model, when given) into `hf_dir`,
    local or remote (created; each file replaced atomically)."""
    from safetensors.numpy import save

    state = params_to_hf_state_dict(params, config)
    directory = files.as_path(hf_dir)
    files.write_json(directory / "config.json", to_hf_config(config), indent=2)
    # `format: pt` is what HF's loader expects in the safetensors metadata.
    files.write_atomic(directory / "model.safetensors", save(state, metadata={"format": "pt"}))
    if tokenizer_path:
        files.copy(tokenizer_path, directory / "spiece.model")
    log.info("wrote HF checkpoint (%d tensors) to %s", len(state), hf_dir)
