"""The building blocks of ALBERT's layers in Flax linen: 2-D Dense matmuls, LayerNorm, the
factorized embedding, self-attention and the feed-forward block (`model.albert` stacks
them).

Shapes: B batch, S sequence, E embedding size, H hidden size, N heads, D = H/N head size,
I intermediate size, V vocabulary. Every parameter is created through
`nn.with_logical_partitioning`, with the logical axis names of `albert_jax.sharding`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from albert_jax.model.config import ModelConfig

Array = jax.Array
# The official attention mask adder: masked scores get -10000 before the softmax.
MASK_ADDER = -10000.0


def activation(name: str) -> Callable[[Array], Array]:
    """`hidden_act` -> function. `gelu_new` is TF's tanh form, which the official models use."""
    return {
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "relu": jax.nn.relu,
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "tanh": jnp.tanh,
    }[name]


def kernel_init(config: ModelConfig) -> nn.initializers.Initializer:
    # TF's truncated_normal_initializer: N(0, sigma^2) cut at 2 sigma, not re-scaled.
    return nn.initializers.truncated_normal(stddev=config.initializer_range)


def stacked_param(
    module: nn.Module,
    name: str,
    init: nn.initializers.Initializer,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    stack: int | None,
    dtype: Any,
) -> Array:
    """A parameter, with a leading `layers` axis of size `stack` when it is not shared."""
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def select_layer(w: Array, stack: int | None, layer_idx: Array | int | None) -> Array:
    """Picks this layer's slice of a stacked (unshared) weight; shared weights pass through."""
    if stack is None:
        return w
    if layer_idx is None:
        raise ValueError("a stacked (unshared) parameter needs the layer index")
    # jnp.asarray: params may arrive as numpy arrays, which cannot be indexed by a tracer.
    return jnp.asarray(w)[layer_idx]


@jax.custom_vjp
def add_bias(y: Array, bias: Array) -> Array:
    """y + bias in y's (compute) dtype, bias [*] broadcast against y's trailing dims; its
    gradient is summed over the broadcast rows in float32. (Cast first and added in bfloat16,
    the bias gradient would be a bfloat16 sum over every row of the batch: B·S terms.)"""
    return y + bias.astype(y.dtype)


def _add_bias_fwd(y: Array, bias: Array) -> tuple[Array, Array]:
    return add_bias(y, bias), bias


def _add_bias_bwd(bias: Array, g: Array) -> tuple[Array, Array]:
    lead = g.ndim - bias.ndim
    db = jnp.sum(g.astype(jnp.float32), axis=tuple(range(lead)))
    spread = tuple(i for i, n in enumerate(bias.shape) if n == 1 and db.shape[i] != 1)
    return g, jnp.sum(db, axis=spread, keepdims=True).astype(bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def target_platform() -> str:
    """The platform the program being traced is compiled for: that of the mesh's devices
    (`jax.set_mesh`), else JAX's default backend.

    Why not `jax.default_backend()` alone: a CPU machine compiling for a TPU slice
    (`albert_jax.plan`) reports "cpu" there, and a branch on it would put the CPU program into
    the pod's.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.abstract_device is not None:
        return mesh.abstract_device.platform
    return jax.default_backend()


def matmul(x: Array, w: Array) -> Array:
    """x [M, K] . w [K, N] -> [M, N], both in the compute dtype; the result in it too."""
    if x.dtype == jnp.bfloat16 and target_platform() == "cpu":
        return _bf16_matmul_cpu(x, w)
    return x @ w


def _dot_f32(a: Array, b: Array, b_contracting: int) -> Array:
    """a [M, K] . b ([K, N] if b_contracting == 0, [N, K] if 1) -> [M, N] float32."""
    dims = (((1,), (b_contracting,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# XLA:CPU runs a bfloat16 matmul on the CPU's bf16 units (YNNPACK; AMX / AVX512-BF16) only
# when it accumulates into float32 and the left operand contracts its last dim; any other
# bf16 dot is converted to float32 operands first and runs at fp32 speed (the operand
# upcaster's output in the HLO dumps). Measured on the 2-core Xeon: 1000-1400 GFLOP/s for
# those against ~260 in fp32. Autodiff's weight gradient x^T . dy contracts the rows, the
# left operand's first dim, so the backward pass states x^T as its own array: the
# optimization barrier keeps XLA from folding the transpose back into the dot.
@jax.custom_vjp
def _bf16_matmul_cpu(x: Array, w: Array) -> Array:
    return _dot_f32(x, w, 0).astype(x.dtype)


def _bf16_matmul_cpu_fwd(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
    return _bf16_matmul_cpu(x, w), (x, w)


def _bf16_matmul_cpu_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    x, w = res  # x [M, K], w [K, N], g [M, N]
    dx = _dot_f32(g, w, 1).astype(x.dtype)  # g . w^T: w contracts its last dim, no copy
    xt = jax.lax.optimization_barrier(x.T.reshape(-1)).reshape(x.shape[1], x.shape[0])
    dw = _dot_f32(xt, g, 0).astype(w.dtype)  # [K, M] . [M, N]
    return dx, dw


_bf16_matmul_cpu.defvjp(_bf16_matmul_cpu_fwd, _bf16_matmul_cpu_bwd)


class Dense(nn.Module):
    """y = x . W + b, contracting the last `len(in_shape)` dims of x.

    kernel: [*in_shape, *out_shape] (or [stack, *in_shape, *out_shape] when unshared);
    `axes` names the kernel dims for sharding. bias: [*out_shape].
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    config: ModelConfig
    stack: int | None = None
    use_bias: bool = True

    @nn.compact
    def weights(self, layer_idx: Array | int | None = None) -> tuple[Array, Array | None]:
        """(kernel [*in_shape, *out_shape] in the compute dtype, bias [*out_shape] in the
        parameter dtype, to be added with `add_bias`) of this layer. Callers that fuse several
        projections into one matmul use this."""
        cfg = self.config
        n_in = len(self.in_shape)
        kernel = stacked_param(
            self,
            "kernel",
            kernel_init(cfg),
            (*self.in_shape, *self.out_shape),
            self.axes,
            self.stack,
            cfg.weight_dtype,
        )
        kernel = select_layer(kernel, self.stack, layer_idx).astype(cfg.compute_dtype)
        if not self.use_bias:
            return kernel, None
        bias = stacked_param(
            self,
            "bias",
            nn.initializers.zeros_init(),
            self.out_shape,
            self.axes[n_in:],
            self.stack,
            cfg.weight_dtype,
        )
        return kernel, select_layer(bias, self.stack, layer_idx)

    def __call__(self, x: Array, layer_idx: Array | int | None = None) -> Array:
        """x [..., *in_shape] -> [..., *out_shape], as one [rows, K] . [K, N] matmul."""
        n_in = len(self.in_shape)
        if x.shape[x.ndim - n_in :] != self.in_shape:
            raise ValueError(f"{self.name}: input {x.shape} does not end in {self.in_shape}")
        kernel, bias = self.weights(layer_idx)
        lead = x.shape[: x.ndim - n_in]
        k, n = math.prod(self.in_shape), math.prod(self.out_shape)
        # Rows flattened first (free reshapes of contiguous dims), so the weight gradient
        # dW = x^T . dy contracts the row dim of two 2-D arrays as they lie in memory. With
        # [B, S] contracted directly, XLA on CPU copied the output gradient into a transposed
        # [features, B·S] buffer before each dW (seen in the compiled HLO), and the base train
        # step was 6-11% slower. (SelfAttention's fused Q/K/V projection does the same.)
        y = matmul(x.astype(kernel.dtype).reshape(-1, k), kernel.reshape(k, n))
        y = y.reshape(*lead, *self.out_shape)
        return y if bias is None else add_bias(y, bias)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with epsilon 1e-12 (TF's `contrib.layers.layer_norm`).

    Statistics are computed in float32 even for bfloat16 activations.
    """

    features: int
    axis_name: str
    config: ModelConfig
    stack: int | None = None

    @nn.compact
    def __call__(self, x: Array, layer_idx: Array | int | None = None) -> Array:
        cfg = self.config
        scale = stacked_param(
            self,
            "scale",
            nn.initializers.ones_init(),
            (self.features,),
            (self.axis_name,),
            self.stack,
            cfg.weight_dtype,
        )
        bias = stacked_param(
            self,
            "bias",
            nn.initializers.zeros_init(),
            (self.features,),
            (self.axis_name,),
            self.stack,
            cfg.weight_dtype,
        )
        scale = select_layer(scale, self.stack, layer_idx)
        bias = select_layer(bias, self.stack, layer_idx)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + cfg.layer_norm_eps)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(cfg.compute_dtype)


def _embedding_param(module: nn.Module, name: str, rows: int, axes: tuple, cfg: ModelConfig):
    init = nn.with_logical_partitioning(kernel_init(cfg), axes)
    return module.param(name, init, (rows, cfg.embedding_size), cfg.weight_dtype)


class FactorizedEmbedding(nn.Module):
    """Word + position + token-type embeddings of width E (not H), then LayerNorm and dropout.

    Factorizing the V x H table into V x E and E x H (the projection lives in the encoder, as in
    the official checkpoint) is ALBERT's first parameter reduction (paper Sec. 3.1).
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.word_embeddings = _embedding_param(
            self, "word_embeddings", cfg.vocab_size, ("vocab", "embed_factor"), cfg
        )
        self.position_embeddings = _embedding_param(
            self, "position_embeddings", cfg.max_position_embeddings, (None, "embed_factor"), cfg
        )
        self.token_type_embeddings = _embedding_param(
            self, "token_type_embeddings", cfg.type_vocab_size, (None, "embed_factor"), cfg
        )
        self.LayerNorm = LayerNorm(cfg.embedding_size, "embed_factor", cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array,
        deterministic: bool,
        position_ids: Array | None = None,
    ) -> Array:
        """input_ids, segment_ids [B,S] int -> embeddings [B,S,E]. Positions are 0..S-1, or
        `position_ids` [B,S] (packed rows restart them for each example)."""
        cfg = self.config
        seq_len = input_ids.shape[-1]
        if seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds ModelConfig.max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        x = jnp.take(self.word_embeddings, input_ids, axis=0)
        x = x + jnp.take(self.token_type_embeddings, segment_ids, axis=0)
        if position_ids is None:
            x = x + self.position_embeddings[None, :seq_len]
        else:
            x = x + jnp.take(self.position_embeddings, position_ids, axis=0)
        x = nn.with_logical_constraint(x, ("act_batch", "act_seq", "act_embed"))
        x = self.LayerNorm(x.astype(cfg.compute_dtype))
        return self.dropout(x, deterministic=deterministic)

    def attend(self, x: Array) -> Array:
        """Tied decoder: x [..., E] -> logits [..., V] = x . word_embeddings^T."""
        table = self.word_embeddings.astype(self.config.compute_dtype)
        return jnp.einsum("...e,ve->...v", x.astype(self.config.compute_dtype), table)


def fused_attention(q: Array, k: Array, v: Array, mask: Array, impl: str) -> Array:
    """`jax.nn.dot_product_attention` of q [B,N,Q,D], k and v [B,N,S,D] under the mask
    [B,1,1,S] or [B,1,Q,S] (True = attend) -> context [B,Q,N,D]; `impl` "cudnn" asks for
    cuDNN's fused kernel, "dot_product" lets JAX choose.

    Raises:
      ValueError: naming `model.attention_impl` when the backend has no such kernel (checked
        while tracing, before anything compiles).
    """
    if impl == "cudnn" and target_platform() != "gpu":
        raise ValueError(
            f"model.attention_impl='cudnn' needs a GPU; the target is "
            f"{target_platform()!r}: use 'xla' or 'dot_product'"
        )
    rows = q.shape[2]
    if impl == "cudnn":
        q, k, v, mask = even_lengths(q, k, v, mask)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # its layout: [B, T, N, D]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, implementation="cudnn" if impl == "cudnn" else None
    )[:, :rows]


def even_lengths(q: Array, k: Array, v: Array, mask: Array) -> tuple[Array, ...]:
    """What cuDNN's fused attention trains on: q [B,N,Q',D], k and v [B,N,S',D] and the mask
    [B,1,Q',S'] whole, with Q' and S' the even lengths at or above Q and S.

    cuDNN takes the mask as an additive bias with every query row ([B,1,1,S] is refused), and
    its backward pass with a bias needs even lengths; the last layer runs at the 1 + P rows the
    heads read, an odd count for the default P = 20. An added query row attends everywhere (a
    finite row, its output dropped); an added key is masked out of every row."""
    batch, _, rows, keys = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = jnp.broadcast_to(mask, (batch, 1, rows, keys))
    pad_rows, pad_keys = rows % 2, keys % 2
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad_rows), (0, 0)))
    k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, pad_keys), (0, 0))) for t in (k, v))
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad_rows), (0, 0)), constant_values=True)
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, pad_keys)), constant_values=False)
    return q, k, v, mask


class SelfAttention(nn.Module):
    """Multi-head self-attention + output projection + residual + post-LayerNorm.

    `stack` (not None) means this sub-block is not shared: its weights carry a leading layer axis
    and `layer_idx` picks the slice (sharing="ffn" / "none").
    """

    config: ModelConfig
    stack: int | None = None

    @nn.compact
    def __call__(
        self,
        x: Array,
        mask: Array,
        layer_idx: Array | int | None,
        deterministic: bool,
        query_positions: Array | None = None,
    ) -> Array:
        """x [B,S,H], mask [B,1,1,S] bool (True = attend; [B,1,S,S] per query, e.g. packed
        rows) -> [B,S,H].

        With `query_positions` [B,Q] int, only those positions query (keys and values still
        cover all S): -> [B,Q,H], the same rows as the full output gathered at them.
        """
        cfg = self.config
        H, N, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim

        # Q, K and V keep their own (official) parameters but run as one [H, 3N·D] matmul: a
        # bigger GEMM is faster on every backend, and fewer, larger ops in the backward pass too.
        weights = [
            Dense((H,), (N, D), ("embed", "heads", "kv"), cfg, self.stack, name=name).weights(
                layer_idx
            )
            for name in ("query", "key", "value")
        ]
        # Stacked next to the heads axis (not concatenated along it), so that a tensor-parallel
        # heads sharding carries over unchanged, heads being the major dim of [N, 3, D].
        kernel = jnp.stack([w for w, _ in weights], axis=2)  # [H, N, 3, D]
        bias = jnp.stack([b for _, b in weights], axis=0)[:, None, :, None, :]  # [3, 1, N, 1, D]

        def project(h: Array, which: slice) -> list[Array]:
            """h [B,T,H] -> the [B,N,T,D] projections `which` of (query, key, value).

            One [B·T, H] . [H, N·C·D] matmul (C: how many of the three), as `Dense` does, so
            that the weight gradient x^T . dy comes out in the kernel's own layout. As one
            einsum straight to [C, B, N, T, D], XLA on CPU computed each layer's weight
            gradient transposed and copied it back inside every consumer (the sum over the
            shared layers, the clip norm, Adam's moments): 9% of a base fine-tuning step.
            Heads then go before positions ([B, N, T, D]): both attention matmuls are plain
            batched GEMMs over (B, N) without transposes (faster on CPU than [B, T, N, D]).
            """
            w = kernel[:, :, which]
            n_out = w.shape[2]
            out = matmul(h.astype(cfg.compute_dtype).reshape(-1, H), w.reshape(H, N * n_out * D))
            out = out.reshape(*h.shape[:2], N, n_out, D).transpose(3, 0, 2, 1, 4)
            return list(add_bias(out, bias[which]))

        if query_positions is None:
            q, k, v = project(x, slice(0, 3))
        else:
            # Only some positions are read downstream: project just their queries, attend
            # from them to every key, and carry only their rows (the residual included).
            k, v = project(x, slice(1, 3))
            x = gather_positions(x, query_positions)  # [B,Q,H]
            (q,) = project(x, slice(0, 1))
            if mask.shape[2] > 1:  # a mask per query: keep the queried rows' [B,1,Q,S]
                mask = jnp.take_along_axis(mask, query_positions[:, None, :, None], axis=2)
        q, k, v = (
            checkpoint_name(t, f"{name}_proj")
            for t, name in zip((q, k, v), ("query", "key", "value"), strict=True)
        )
        if cfg.attention_impl == "xla":
            scores = jnp.einsum("bnqd,bnkd->bnqk", q, k) / jnp.sqrt(D).astype(q.dtype)
            scores = jnp.where(mask, scores, jnp.asarray(MASK_ADDER, scores.dtype))
            probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
            if not deterministic and cfg.attention_probs_dropout_prob > 0.0:
                probs = nn.Dropout(cfg.attention_probs_dropout_prob)(probs, deterministic=False)
            context = jnp.einsum("bnqk,bnkd->bqnd", probs, v)  # [B, S (or Q), N, D]
        else:
            context = fused_attention(q, k, v, mask, cfg.attention_impl)
        out = Dense((N, D), (H,), ("heads", "kv", "embed"), cfg, self.stack, name="output")
        out = checkpoint_name(out(context, layer_idx), "attention_out")
        out = nn.Dropout(cfg.hidden_dropout_prob)(out, deterministic=deterministic)
        y = LayerNorm(H, "embed", cfg, self.stack, name="LayerNorm")(x + out, layer_idx)
        return nn.with_logical_constraint(y, ("act_batch", "act_seq", "act_embed"))


class FeedForward(nn.Module):
    """H -> I (activation) -> H, residual, post-LayerNorm. `stack` as in `SelfAttention`."""

    config: ModelConfig
    stack: int | None = None

    @nn.compact
    def __call__(self, x: Array, layer_idx: Array | int | None, deterministic: bool) -> Array:
        """x [B,S,H] -> [B,S,H]."""
        cfg = self.config
        H, inner = cfg.hidden_size, cfg.intermediate_size
        h = Dense((H,), (inner,), ("embed", "mlp"), cfg, self.stack, name="intermediate")
        h = h(x, layer_idx)
        h = checkpoint_name(activation(cfg.hidden_act)(h), "mlp_activation")
        h = nn.with_logical_constraint(h, ("act_batch", "act_seq", "act_mlp"))
        out = Dense((inner,), (H,), ("mlp", "embed"), cfg, self.stack, name="output")(h, layer_idx)
        out = nn.Dropout(cfg.hidden_dropout_prob)(out, deterministic=deterministic)
        y = LayerNorm(H, "embed", cfg, self.stack, name="LayerNorm")(x + out, layer_idx)
        return nn.with_logical_constraint(y, ("act_batch", "act_seq", "act_embed"))


def gather_positions(sequence: Array, positions: Array) -> Array:
    """sequence [B,S,H], positions [B,P] int -> [B,P,H]."""
    return jnp.take_along_axis(sequence, positions[..., None].astype(jnp.int32), axis=1)
