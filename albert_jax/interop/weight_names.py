"""The one name table between albert_jax, HuggingFace (PyTorch) and official TF1 weights.

Pure mapping, no file access: `layout(config)` lists every albert_jax parameter with its HF
`state_dict` key and its official TF1 variable name (as google-research/albert's modeling.py
names them), with the reshapes between the stored 2-D matrices and our head-split kernels:

  query/key/value kernel   ours [H,N,D]  <- TF [H,H] (in, out)   <- HF weight [H,H] (out, in)
  query/key/value bias     ours [N,D]    <- [H]
  attention output kernel  ours [N,D,H]  <- TF [H,H]             <- HF weight [H,H]
  other dense kernels      ours [in,out] <- TF [in,out]          <- HF weight [out,in]
  SOP classifier kernel    ours [H,2]    <- TF output_weights [2,H], HF weight [2,H]
  LayerNorm scale / bias   ours          <- TF gamma / beta      <- HF weight / bias

The official and HF layouts are ALBERT's "all-shared within a group" (`sharing="all"`); other
sharing strategies have no equivalent there and raise `ValueError`.

"Params" here is the variables tree that goes into `model.apply`: `{"params": {...}}` of plain
(unboxed) numpy arrays. Functions also accept the inner `{...}` tree and jax arrays.

`import_tensors` is the importer both foreign formats share (`hf_checkpoint`, `tf1_checkpoint`):
missing or mis-shaped tensors raise one `ValueError` listing all of them; extra tensors are
logged (warning) with their names. The pooler, the MLM head and the SOP head
(`OPTIONAL_PARTS`) may be absent on import: an absent part is left out and reported, and
`load_pretrained` initializes it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from albert_jax import trees
from albert_jax.model.config import ModelConfig

__all__ = [
    "OPTIONAL_PARTS",
    "HF_TASK_HEADS",
    "Entry",
    "Stored",
    "layout",
    "task_layout",
    "check_shared",
    "check_projection",
    "import_tensors",
    "flatten_params",
    "unflatten_params",
    "missing_parts",
    "to_numpy",
    "format_problems",
    "unreadable",
]

# One logger for every conversion message, whichever module emits it (users filter on it).
log = logging.getLogger("albert_jax.convert")

# Sub-trees of variables["params"] that a checkpoint may lack (they get initialized on load).
OPTIONAL_PARTS = ("albert/pooler", "predictions", "sop_classifier")


# ------------------------------------------------------------------------------- name table
@dataclasses.dataclass(frozen=True)
class Stored:
    """How one tensor is stored in a foreign checkpoint."""

    name: str
    shape: tuple[int, ...]
    transposed: bool  # stored as [out, in] (PyTorch Linear, TF output_weights)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One albert_jax parameter and its HF / TF1 counterparts."""

    path: str  # under variables["params"], "/"-joined
    shape: tuple[int, ...]
    hf: Stored
    tf: Stored
    part: str  # one of OPTIONAL_PARTS, or "" for the always-required backbone

    def stored(self, fmt: str) -> Stored:
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


def _kernel(path, in_shape, out_shape, hf, tf, part="", tf_transposed=False) -> Entry:
    """A dense kernel: ours [*in_shape, *out_shape]; HF [out, in]; TF [in, out] (or [out, in])."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    tf_shape = (n_out, n_in) if tf_transposed else (n_in, n_out)
    return Entry(
        path,
        (*in_shape, *out_shape),
        Stored(hf, (n_out, n_in), True),
        Stored(tf, tf_shape, tf_transposed),
        part,
    )


def _vector(path, shape, hf, tf, part="") -> Entry:
    """A bias or LayerNorm parameter: ours `shape` (e.g. [N,D]); stored flat."""
    flat = (math.prod(shape),)
    return Entry(path, tuple(shape), Stored(hf, flat, False), Stored(tf, flat, False), part)


def _table(path, shape, hf, tf) -> Entry:
    """An embedding table [rows, E], stored as is."""
    return Entry(path, tuple(shape), Stored(hf, shape, False), Stored(tf, shape, False), "")


def _dense(path, in_shape, out_shape, hf, tf, part="") -> list[Entry]:
    """Kernel + bias of a dense layer; `hf` is the module prefix, `tf` the TF scope."""
    return [
        _kernel(f"{path}/kernel", in_shape, out_shape, f"{hf}.weight", f"{tf}/kernel", part),
        _vector(f"{path}/bias", out_shape, f"{hf}.bias", f"{tf}/bias", part),
    ]


def _layer_norm(path, width, hf, tf, part="") -> list[Entry]:
    return [
        _vector(f"{path}/scale", (width,), f"{hf}.weight", f"{tf}/gamma", part),
        _vector(f"{path}/bias", (width,), f"{hf}.bias", f"{tf}/beta", part),
    ]


def check_shared(config: ModelConfig, what: str) -> None:
    if config.sharing != "all":
        raise ValueError(
            f"{what}: ModelConfig.sharing={config.sharing!r} has no HF / official TF layout "
            "(those checkpoints share every sub-block within a group); only sharing='all' "
            "converts"
        )


def layout(config: ModelConfig) -> list[Entry]:
    """Every parameter of `AlbertForPreTraining(config)` (sharing="all") with its HF/TF names."""
    check_shared(config, "checkpoint conversion")
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
                # The official FFN output scope is nested inside `intermediate/` (modeling.py).
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


#: The HF transformers task classes a fine-tuning head exports to: {class: (our head sub-tree,
#: its HF module, its official TF1 scope)}. The official fine-tuning scripts name the classifier
#: `output_weights` / `output_bias` (classifier_utils.py, race_utils.py) and the SQuAD v1 span
#: layer `cls/squad/output_*` (squad_utils.py), all stored [out, in].
HF_TASK_HEADS: dict[str, tuple[str, str, str]] = {
    "AlbertForSequenceClassification": ("classifier", "classifier", ""),
    "AlbertForMultipleChoice": ("classifier", "classifier", ""),
    "AlbertForQuestionAnswering": ("qa_outputs", "qa_outputs", "cls/squad/"),
}


def task_layout(config: ModelConfig, hf_class: str, num_outputs: int) -> list[Entry]:
    """Every parameter of the HF task model `hf_class` (a key of `HF_TASK_HEADS`) with its
    HF / TF1 names: the backbone of `layout` without the MLM and SOP heads, and without the
    pooler for `AlbertForQuestionAnswering` (HF builds that one without it), then the head, a
    dense kernel ours [H, num_outputs] (HF weight [num_outputs, H]) and bias [num_outputs]:
    num_labels for sequence classification (1: regression), 1 for multiple choice (a score
    per option), 2 for spans (start, end)."""
    ours, hf, tf = HF_TASK_HEADS[hf_class]
    keep = ("",) if hf_class == "AlbertForQuestionAnswering" else ("", "albert/pooler")
    entries = [e for e in layout(config) if e.part in keep]
    H = config.hidden_size
    return entries + [
        _kernel(f"{ours}/kernel", (H,), (num_outputs,), f"{hf}.weight", f"{tf}output_weights",
                tf_transposed=True),
        _vector(f"{ours}/bias", (num_outputs,), f"{hf}.bias", f"{tf}output_bias"),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ tree helpers
def flatten_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """`{"params": {...}}` (or the inner tree) -> {"albert/embeddings/...": array}."""
    if set(params) == {"params"}:
        params = params["params"]
    return trees.flatten(params)


def unflatten_params(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a/b/c": x} -> `{"params": {"a": {"b": {"c": x}}}}` (the tree `model.apply` takes)."""
    return {"params": trees.unflatten(flat)}


def missing_parts(params: Mapping[str, Any]) -> list[str]:
    """Which of `OPTIONAL_PARTS` (pooler, MLM head, SOP head) `params` lacks."""
    flat = flatten_params(params)
    return [p for p in OPTIONAL_PARTS if not any(k.startswith(p + "/") for k in flat)]


def to_numpy(x: Any) -> np.ndarray:
    """numpy / jax / torch (CPU) array -> numpy; torch bfloat16 is upcast exactly to float32."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def format_problems(what: str, missing: list[str], mismatched: list[str]) -> str:
    """One error message listing every missing and every mis-shaped tensor."""
    lines = [f"{what}: {len(missing)} missing and {len(mismatched)} mis-shaped tensor(s)"]
    lines += [f"  missing: {name}" for name in missing]
    lines += [f"  shape mismatch: {m}" for m in mismatched]
    return "\n".join(lines)


def unreadable(path: Any, what: str, reason: str | BaseException) -> ValueError:
    """The one error for a weights file that cannot be parsed (truncated, corrupt, or not the
    format its name says): it names the file, what it should be and why. Callers raise it
    `from` the original error, which stays chained for the full detail."""
    if isinstance(reason, BaseException):
        reason = f"{type(reason).__name__}: {reason}"
    return ValueError(f"{path}: not a readable {what}: {reason}")


# ------------------------------------------------------------------------- generic importer
def import_tensors(
    entries: list[Entry],
    fmt: str,
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
    dtype: np.dtype,
    source: str,
    ignored: Iterable[str] = (),
) -> dict[str, Any]:
    """Reads every entry from a foreign checkpoint (name -> shape map + reader) into
    `{"params": ...}` of `dtype` arrays in our shapes.

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
        flat[e.path] = e.to_ours(to_numpy(read(s.name)), fmt).astype(dtype, copy=False)
    if missing or mismatched:
        raise ValueError(format_problems(source, missing, mismatched))
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
    return unflatten_params(flat)


def check_projection(config: ModelConfig, has_projection: bool, source: str) -> None:
    """A checkpoint with the E->H projection needs a config that has one."""
    if has_projection and not config.has_embedding_projection:
        raise ValueError(
            f"{source} has embedding_hidden_mapping_in but the config has no E->H projection "
            f"(embedding_size == hidden_size == {config.hidden_size}); set "
            "ModelConfig.always_project_embeddings=True"
        )
