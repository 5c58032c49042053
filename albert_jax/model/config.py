"""`ModelConfig`: the ALBERT hyper-parameters, with presets and official / HF JSON readers.

Field names follow the official `albert_config.json`, so a released config reads as is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from albert_jax import files

SHARING_STRATEGIES = ("all", "attention", "ffn", "none")
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh")
REMAT_POLICIES = (
    "none",  # keep every activation (fastest, most memory)
    "full",  # keep only the layer inputs; recompute the whole layer in the backward pass
    "dots",  # keep every matmul output
    "dots_no_batch",  # keep matmul outputs without batch dims (i.e. weights-only products)
    "minimal",  # keep the Q/K/V and attention-output projections (named checkpoints)
    "save_attention_out",  # keep only the attention sub-block outputs (named checkpoints)
)
DTYPES = ("float32", "bfloat16", "float16")

# The official configs (google-research/albert, mirrored as albert-*-v2 on the HF hub).
# v2 models use no dropout; v1 base/large/xlarge used 0.1 (override if you need v1).
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=512,
        embedding_size=64,
        max_position_embeddings=128,
    ),
    "base": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    ),
    "large": dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    ),
    "xlarge": dict(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192
    ),
    "xxlarge": dict(
        hidden_size=4096, num_hidden_layers=12, num_attention_heads=64, intermediate_size=16384
    ),
}
PRESETS = tuple(_PRESETS)
# Fields that change how a model is computed, stored or regularized, not the function its
# weights define: a fine-tuning config may change them on a pretrained model, and a resumed run
# on its checkpoint. The others define the architecture.
RUNTIME_FIELDS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dtype",
    "param_dtype",
    "remat_policy",
    "scan_layers",
    "attention_impl",
)
# How attention is computed: "xla" our einsums (any backend, attention-probs dropout);
# "dot_product" `jax.nn.dot_product_attention`, which picks the backend's best (XLA, or cuDNN's
# fused kernel where it applies); "cudnn" that fused kernel or an error (GPU only).
ATTENTION_IMPLS = ("xla", "dot_product", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """ALBERT hyper-parameters (official names) plus the JAX-side knobs.

    Sharing semantics (official `modeling.py`): the `num_hidden_layers` layer applications are
    split into `num_hidden_groups` consecutive groups; every layer of group g runs the same
    `inner_group_num` blocks in order, so the effective depth is L x inner_group_num.
    `sharing` says which sub-blocks are shared across the layers of a group: "all" (ALBERT),
    "attention" or "ffn" (the paper's Table 4 ablations; the other sub-block gets one weight set
    per layer) or "none" (BERT-style).
    """

    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu_new"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    num_hidden_groups: int = 1
    inner_group_num: int = 1
    layer_norm_eps: float = 1e-12
    sharing: str = "all"
    # The official code creates the E->H projection only when E != H; HF always creates it.
    # Set True to load an HF checkpoint with E == H.
    always_project_embeddings: bool = False
    scan_layers: bool = True
    remat_policy: str = "none"
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str = "xla"

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raises `ValueError` naming the offending field (called on construction)."""
        positive = (
            "vocab_size",
            "embedding_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
            "num_hidden_groups",
            "inner_group_num",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_hidden_layers % self.num_hidden_groups:
            raise ValueError(
                f"ModelConfig.num_hidden_layers ({self.num_hidden_layers}) must be divisible by "
                f"num_hidden_groups ({self.num_hidden_groups})"
            )
        for name, allowed in (
            ("sharing", SHARING_STRATEGIES),
            ("hidden_act", ACTIVATIONS),
            ("remat_policy", REMAT_POLICIES),
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
            ("attention_impl", ATTENTION_IMPLS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r} is not one of {allowed}"
                )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {p}")
        if self.attention_impl != "xla" and self.attention_probs_dropout_prob > 0:
            raise ValueError(
                f"ModelConfig.attention_impl={self.attention_impl!r} has no dropout on the "
                "attention probabilities: set attention_probs_dropout_prob=0 (ALBERT's presets "
                "do) or attention_impl='xla'"
            )
        for name in ("initializer_range", "layer_norm_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # NaN fails `<= 0` too
                raise ValueError(f"ModelConfig.{name} must be a finite number > 0, got {value}")

    # ------------------------------------------------------------------------- derived values
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layers_per_group(self) -> int:
        return self.num_hidden_layers // self.num_hidden_groups

    @property
    def effective_depth(self) -> int:
        """Number of transformer-block applications in one forward pass."""
        return self.num_hidden_layers * self.inner_group_num

    @property
    def has_embedding_projection(self) -> bool:
        return self.always_project_embeddings or self.embedding_size != self.hidden_size

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    # ------------------------------------------------------------------------ construction
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """`ModelConfig.preset("base", sharing="none")`: the official sizes (E=128, V=30000)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown model size {name!r}; choose one of {PRESETS}")
        return cls(**{**_PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        return cls(**d)

    def architecture_differences(self, saved: Mapping[str, Any]) -> list[str]:
        """`"field: checkpoint X, config Y"` for each architecture field (not `RUNTIME_FIELDS`)
        in which `saved` (a checkpoint's `model_config` dict) differs from this config; a field
        the checkpoint does not record (older checkpoints) is taken at its default."""
        defaults = ModelConfig().to_dict()
        return [
            f"{name}: checkpoint {saved.get(name, defaults[name])!r}, config {value!r}"
            for name, value in self.to_dict().items()
            if name not in RUNTIME_FIELDS and saved.get(name, defaults[name]) != value
        ]

    def with_depth(self, num_hidden_layers: int) -> ModelConfig:
        """This model run `num_hidden_layers` times instead (the paper's Table 2 / Fig. 2 depth
        question): the same weights, only the number of layer applications changes.

        Only weights that do not depend on the depth allow it: `sharing="all"`, where each
        group's blocks serve every layer of the group (no layer axis in the parameter tree).
        The layers still split evenly into the checkpoint's `num_hidden_groups` groups.

        Raises:
          ValueError: naming model.num_hidden_layers, when the model keeps weights per layer
            (sharing != "all") or the depth is not a positive multiple of num_hidden_groups.
        """
        n, groups = num_hidden_layers, self.num_hidden_groups
        if n == self.num_hidden_layers:
            return self
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"model.num_hidden_layers must be a positive integer, got {n!r}")
        if self.sharing != "all":
            per_layer = {"none": "every sub-block", "attention": "the FFN", "ffn": "attention"}
            raise ValueError(
                f"model.num_hidden_layers={n}: this model (sharing={self.sharing!r}) keeps one "
                f"weight set of {per_layer[self.sharing]} per layer, for its "
                f"{self.num_hidden_layers} layers; only an all-shared model (sharing='all') runs "
                f"at another depth. Keep model.num_hidden_layers={self.num_hidden_layers}"
            )
        if n % groups:
            raise ValueError(
                f"model.num_hidden_layers={n} must be a multiple of num_hidden_groups={groups}: "
                f"each of the model's {groups} weight groups runs num_hidden_layers / "
                f"num_hidden_groups consecutive layers (e.g. {groups * max(n // groups, 1)})"
            )
        return self.replace(num_hidden_layers=n)

    @classmethod
    def from_json(cls, path: str, **overrides: Any) -> ModelConfig:
        """Reads an official `albert_config.json` or an HF `config.json`.

        Official TF configs say `"gelu"` but TF's `gelu` is the tanh approximation, so it is read
        as `gelu_new`; HF configs are taken literally (their `gelu` is the exact erf form).
        Keys that the official code ignores (`down_scale_factor`, `net_structure_type`, ...) are
        dropped. `path` may be local or remote (`gs://`); a missing file raises ValueError.
        """
        raw = files.read_json(path)
        is_hf = "model_type" in raw or "architectures" in raw
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        if not is_hf and kwargs.get("hidden_act") == "gelu":
            kwargs["hidden_act"] = "gelu_new"
        if is_hf:
            if raw.get("position_embedding_type", "absolute") != "absolute":
                raise ValueError(
                    f"{path}: position_embedding_type={raw['position_embedding_type']!r} is not "
                    "supported (ALBERT uses absolute learned positions)"
                )
            # HF always has the E->H projection, also when E == H.
            kwargs.setdefault("always_project_embeddings", True)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_official_json(self) -> dict[str, Any]:
        """The fields of an official `albert_config.json`."""
        keys = [
            "vocab_size",
            "embedding_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "hidden_act",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "max_position_embeddings",
            "type_vocab_size",
            "initializer_range",
            "num_hidden_groups",
            "inner_group_num",
        ]
        return {k: getattr(self, k) for k in keys}


def save_json(config: ModelConfig, path: str) -> None:
    """Writes `config.to_dict()` as JSON to `path` (local or remote; atomically)."""
    files.write_json(path, config.to_dict(), indent=2)


def model_config_from(config: Any) -> ModelConfig:
    """The `ModelConfig` of a run config (`configs/pretrain.py`): the `size` preset with the
    fields of `config.model` applied on top. Unknown fields raise `ValueError` naming them."""
    overrides = dict(config.model.to_dict() if hasattr(config.model, "to_dict") else config.model)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"config.model has unknown fields {unknown}; known: {sorted(names)}")
    return ModelConfig.preset(config.size, **overrides)
