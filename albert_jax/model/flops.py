"""Analytic training FLOPs of ALBERT (and BERT) and model FLOPs utilization (MFU).

Counting rules, for one sequence of S tokens with P predicted positions:
- every one of the L × inner_group_num layer applications costs its full matmuls: parameter
  sharing saves memory and all-reduce bytes, not FLOPs;
- a layer: Q, K, V, O projections 4·H² and the FFN 2·H·F (F = intermediate_size) multiply-adds
  per token, plus the attention scores Q·Kᵀ and the context softmax·V, 2·S²·H multiply-adds
  per sequence;
- when only T rows of the last layer are read (pretraining: [CLS] and the P masked positions,
  T = 1 + P, `last_layer_positions`), that application computes keys and values at all S
  tokens (2·H² each) but queries, O, FFN and attention at T rows only, and is counted so;
- the factorized embedding's E→H projection, E·H per token (absent when E = H, as in the
  official TF model and BERT);
- the MLM head on the P gathered positions only: transform H·E, then the tied decoder E·V;
- the pooler H² and the SOP classifier 2·H, once per sequence;
- a multiply-add is 2 FLOPs, and training = 3 × forward (backward = 2 × forward).
Elementwise work (LayerNorm, softmax, GELU, embedding lookups) is left out, as is the extra
forward pass of rematerialization: MFU counts model FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

TRAIN_FORWARD_MULTIPLIER = 3


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The config fields FLOPs depend on (any object with these attributes works as well)."""

    vocab_size: int
    embedding_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    inner_group_num: int = 1


#: Official shapes (paper Table 1, the official albert_config.json files); BERT has no
#: factorization (E = H) and V = 30522.
REFERENCE_SHAPES: dict[str, ModelShape] = {
    "albert-base": ModelShape(30000, 128, 768, 12, 12, 3072),
    "albert-large": ModelShape(30000, 128, 1024, 24, 16, 4096),
    "albert-xlarge": ModelShape(30000, 128, 2048, 24, 16, 8192),
    "albert-xxlarge": ModelShape(30000, 128, 4096, 12, 64, 16384),
    "bert-base": ModelShape(30522, 768, 768, 12, 12, 3072),
    "bert-large": ModelShape(30522, 1024, 1024, 24, 16, 4096),
}


@dataclasses.dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of one sequence, by component."""

    layer_matmuls: float  # Q/K/V/O + FFN over all layer applications
    attention: float  # scores + context over all layer applications
    embedding_projection: float  # E -> H
    mlm_head: float  # transform + tied decoder at the predicted positions
    pooler_sop: float  # pooler + sentence-order classifier

    @property
    def total(self) -> float:
        return (
            self.layer_matmuls
            + self.attention
            + self.embedding_projection
            + self.mlm_head
            + self.pooler_sop
        )

    @property
    def attention_share(self) -> float:
        return self.attention / self.total


_SHAPE_FIELDS = (
    "vocab_size",
    "embedding_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def forward_flops_per_sequence(
    config: Any,
    seq_len: int,
    max_predictions_per_seq: int,
    last_layer_positions: int | None = None,
) -> ForwardFlops:
    """Forward FLOPs of one sequence.

    Args:
      config: object with `vocab_size, embedding_size, hidden_size, num_hidden_layers,
        intermediate_size` and optionally `inner_group_num` (default 1), e.g. a ModelConfig.
      seq_len: S, tokens per sequence (padding included: it is computed).
      max_predictions_per_seq: P, gathered MLM positions per sequence (seq_len if the head runs
        on every position).
      last_layer_positions: T, the rows at which the last layer application runs (1 + P in
        the pretraining step, which reads only [CLS] and the masked positions); None = S.
    """
    for field in _SHAPE_FIELDS:
        if not hasattr(config, field):
            raise ValueError(f"config is missing the field {field!r}")
        _positive_int(field, getattr(config, field))
    V, E, H = config.vocab_size, config.embedding_size, config.hidden_size
    F, L = config.intermediate_size, config.num_hidden_layers  # F: FFN (intermediate) width
    inner = _positive_int("inner_group_num", getattr(config, "inner_group_num", 1))
    S = _positive_int("seq_len", seq_len)
    P = max_predictions_per_seq
    if isinstance(P, bool) or not isinstance(P, int) or P < 0:
        raise ValueError(f"max_predictions_per_seq must be an int >= 0, got {P!r}")

    T = S if last_layer_positions is None else last_layer_positions
    T = _positive_int("last_layer_positions", T)  # rows as computed: may exceed S (repeats)

    full = L * inner - 1  # applications over all S tokens; then the last one, at T rows
    return ForwardFlops(
        layer_matmuls=2.0 * (full * S * (4 * H * H + 2 * H * F) + S * 2 * H * H)
        + 2.0 * T * (2 * H * H + 2 * H * F),
        attention=2.0 * (full * S + T) * 2 * S * H,
        embedding_projection=2.0 * S * E * H if E != H else 0.0,
        mlm_head=2.0 * P * (H * E + E * V),
        pooler_sop=2.0 * (H * H + 2 * H),
    )


def train_flops_per_sequence(
    config: Any,
    seq_len: int,
    max_predictions_per_seq: int,
    last_layer_positions: int | None = None,
) -> float:
    """Training FLOPs (forward + backward) of one sequence: 3 × forward."""
    forward = forward_flops_per_sequence(
        config, seq_len, max_predictions_per_seq, last_layer_positions
    )
    return TRAIN_FORWARD_MULTIPLIER * forward.total


def train_flops_per_step(
    config: Any,
    batch_size: int,
    seq_len: int,
    max_predictions_per_seq: int,
    last_layer_positions: int | None = None,
) -> float:
    """Model FLOPs of one training step over the global batch (all devices together).
    `last_layer_positions` as in `forward_flops_per_sequence`."""
    _positive_int("batch_size", batch_size)
    return batch_size * train_flops_per_sequence(
        config, seq_len, max_predictions_per_seq, last_layer_positions
    )


# ----------------------------------------------------------------------------------------------
# Peaks

# Dense peak FLOP/s per GPU by `device_kind` (first matching substring wins, so specific names
# come first): (bf16, float32), vendor data sheets; float32 is the non-tensor-core figure (TF32
# is a different mode). TPUs' peaks are `tpu.slices.GENERATIONS`' (per chip, shared by the
# devices of a chip); there float32 runs as one bf16 pass at JAX's default matmul precision,
# so the bf16 peak applies.
_GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("h200", 989e12, 67e12),
    ("h100 pcie", 756e12, 51e12),
    ("h100", 989e12, 67e12),
    ("a100", 312e12, 19.5e12),
)
_DTYPES = ("bfloat16", "float32")


@functools.cache
def measure_cpu_matmul_peak(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a jitted float32 [size, size] matmul on the CPU, best of `repeats` (cached).

    CPUs have no spec-sheet peak worth trusting (turbo, AVX-512 down-clocking, shared vCPUs), so
    CPU MFU is measured against what a large GEMM actually achieves on the same machine.
    """
    return measure_matmul_peak(size, repeats, "float32", jax.devices("cpu")[0])


def measure_matmul_peak(
    size: int, repeats: int = 5, dtype: str = "float32", device: Any = None
) -> float:
    """FLOP/s of a jitted [size, size] matmul in `dtype` on `device` (default: JAX's first),
    best of `repeats`: what a large GEMM reaches there, beside a spec-sheet peak."""
    _positive_int("size", size)
    device = device if device is not None else jax.devices()[0]
    keys = jax.random.split(jax.random.key(0))
    a, b = (
        jax.device_put(jax.random.normal(k, (size, size), getattr(jnp, dtype)), device)
        for k in keys
    )
    matmul = jax.jit(jnp.matmul)
    return square_matmul_flops(lambda: matmul(a, b).block_until_ready(), size, repeats)


def square_matmul_flops(matmul: Callable[[], Any], size: int, repeats: int) -> float:
    """FLOP/s of `matmul()`, a blocking [size, size] x [size, size] product, best of `repeats`
    after one untimed call (which compiles and warms the caches). Any library's matmul fits,
    so peers are measured with the same protocol."""
    _positive_int("repeats", repeats)
    matmul()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def device_peak_flops(device: Any = None, dtype: str = "bfloat16") -> float:
    """Peak dense FLOP/s of one device.

    Args:
      device: a `jax.Device`, a `device_kind` string (e.g. "TPU v4", "NVIDIA H100 80GB HBM3"), or
        None for `jax.devices()[0]`.
      dtype: "bfloat16" or "float32" (matmul input dtype).
    Returns:
      FLOP/s; for a CPU, `measure_cpu_matmul_peak()` whatever the dtype.
    Raises:
      ValueError for an unknown accelerator: pass the peak to `mfu` yourself.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if device is None:
        device = jax.devices()[0]
    if isinstance(device, str):
        kind, platform = device, ""
    else:
        kind, platform = device.device_kind, device.platform
    kind_lower = kind.lower()
    if platform == "cpu" or kind_lower == "cpu":
        return measure_cpu_matmul_peak()
    from albert_jax.tpu.slices import DEVICE_KINDS, GENERATIONS

    if kind in DEVICE_KINDS:  # a v2 / v3 device is one of its chip's two cores
        generation = GENERATIONS[DEVICE_KINDS[kind]]
        return generation.peak_bf16_per_chip / generation.devices_per_chip
    for key, bf16, fp32 in _GPU_PEAKS:
        if key in kind_lower:
            return bf16 if dtype == "bfloat16" else fp32
    raise ValueError(
        f"device_kind {kind!r} has no known peak; pass the peak FLOP/s to mfu() explicitly"
    )


def mfu(flops_per_step: float, step_seconds: float, num_devices: int, peak: float) -> float:
    """Model FLOPs utilization: flops_per_step / (step_seconds · num_devices · peak per device)."""
    if flops_per_step < 0:
        raise ValueError(f"flops_per_step must be >= 0, got {flops_per_step}")
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    _positive_int("num_devices", num_devices)
    if peak <= 0:
        raise ValueError(f"peak must be > 0, got {peak}")
    return flops_per_step / (step_seconds * num_devices * peak)
