"""ALBERT in Flax linen: factorized embeddings, cross-layer sharing via `nn.scan`, MLM + SOP heads.

Shapes: B batch, S sequence, E embedding size, H hidden size, N heads, D = H/N head size,
I intermediate size, V vocabulary, P predictions per sequence, L layers per group.

One pretraining forward pass, as in the paper (Sec. 3.1):
  ids [B,S] -> FactorizedEmbedding [B,S,E] -> E->H projection [B,S,H]
  -> SharedEncoder: the same block applied L times (nn.scan, parameters broadcast) [B,S,H]
  -> pooler (tanh on [CLS]) [B,H] -> SentenceOrderHead [B,2]
  -> gather masked positions [B,P,H] -> MaskedLMHead (H->E, LN, tied E->V decoder) [B,P,V]
The training step (`return_sequence_output=False`) runs the last block only at [CLS] and the
masked positions instead: the encoder then returns [B,1+P,H], the rows the heads read.

Every parameter is created through `nn.with_logical_partitioning`, with the logical axis names
of `albert_jax.sharding` (`vocab, embed, embed_factor, mlp, heads, kv, layers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from albert_jax.config import ModelConfig

__all__ = [
    "ModelConfig",
    "Dense",
    "LayerNorm",
    "FactorizedEmbedding",
    "SelfAttention",
    "FeedForward",
    "AlbertLayer",
    "AlbertGroup",
    "SharedEncoder",
    "AlbertModel",
    "MaskedLMHead",
    "SentenceOrderHead",
    "AlbertForPreTraining",
    "activation",
]

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


def _kernel_init(config: ModelConfig) -> nn.initializers.Initializer:
    # TF's truncated_normal_initializer: N(0, sigma^2) cut at 2 sigma, not re-scaled.
    return nn.initializers.truncated_normal(stddev=config.initializer_range)


def _stacked_param(
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


def _select_layer(w: Array, stack: int | None, layer_idx: Array | int | None) -> Array:
    """Picks this layer's slice of a stacked (unshared) weight; shared weights pass through."""
    if stack is None:
        return w
    if layer_idx is None:
        raise ValueError("a stacked (unshared) parameter needs the layer index")
    # jnp.asarray: params may arrive as numpy arrays, which cannot be indexed by a tracer.
    return jnp.asarray(w)[layer_idx]


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
        """(kernel [*in_shape, *out_shape], bias [*out_shape] or None) of this layer, in the
        compute dtype. Callers that fuse several projections into one matmul use this."""
        cfg = self.config
        n_in = len(self.in_shape)
        kernel = _stacked_param(
            self,
            "kernel",
            _kernel_init(cfg),
            (*self.in_shape, *self.out_shape),
            self.axes,
            self.stack,
            cfg.weight_dtype,
        )
        kernel = _select_layer(kernel, self.stack, layer_idx).astype(cfg.compute_dtype)
        if not self.use_bias:
            return kernel, None
        bias = _stacked_param(
            self,
            "bias",
            nn.initializers.zeros_init(),
            self.out_shape,
            self.axes[n_in:],
            self.stack,
            cfg.weight_dtype,
        )
        return kernel, _select_layer(bias, self.stack, layer_idx).astype(cfg.compute_dtype)

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
        # step was 6-11% slower. (The fused Q/K/V einsum in SelfAttention showed no such gain.)
        y = x.astype(kernel.dtype).reshape(-1, k) @ kernel.reshape(k, n)
        y = y.reshape(*lead, *self.out_shape)
        return y if bias is None else y + bias


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
        scale = _stacked_param(
            self,
            "scale",
            nn.initializers.ones_init(),
            (self.features,),
            (self.axis_name,),
            self.stack,
            cfg.weight_dtype,
        )
        bias = _stacked_param(
            self,
            "bias",
            nn.initializers.zeros_init(),
            (self.features,),
            (self.axis_name,),
            self.stack,
            cfg.weight_dtype,
        )
        scale = _select_layer(scale, self.stack, layer_idx)
        bias = _select_layer(bias, self.stack, layer_idx)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + cfg.layer_norm_eps)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(cfg.compute_dtype)


def _embedding_param(module: nn.Module, name: str, rows: int, axes: tuple, cfg: ModelConfig):
    init = nn.with_logical_partitioning(_kernel_init(cfg), axes)
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

    def __call__(self, input_ids: Array, segment_ids: Array, deterministic: bool) -> Array:
        """input_ids, segment_ids [B,S] int -> embeddings [B,S,E]."""
        cfg = self.config
        seq_len = input_ids.shape[-1]
        if seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds ModelConfig.max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        x = jnp.take(self.word_embeddings, input_ids, axis=0)
        x = x + jnp.take(self.token_type_embeddings, segment_ids, axis=0)
        x = x + self.position_embeddings[None, :seq_len]
        x = nn.with_logical_constraint(x, ("act_batch", "act_seq", "act_embed"))
        x = self.LayerNorm(x.astype(cfg.compute_dtype))
        return self.dropout(x, deterministic=deterministic)

    def attend(self, x: Array) -> Array:
        """Tied decoder: x [..., E] -> logits [..., V] = x . word_embeddings^T."""
        table = self.word_embeddings.astype(self.config.compute_dtype)
        return jnp.einsum("...e,ve->...v", x.astype(self.config.compute_dtype), table)


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
        """x [B,S,H], mask [B,1,1,S] bool (True = attend) -> [B,S,H].

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
        # Stacked on a new axis (not concatenated along heads) so that a tensor-parallel heads
        # sharding carries over unchanged.
        kernel = jnp.stack([w for w, _ in weights], axis=1)  # [H, 3, N, D]
        bias = jnp.stack([b for _, b in weights], axis=0)[:, None, :, None, :]  # [3, 1, N, 1, D]

        # Heads before positions ([B, N, S, D]): both attention matmuls are then plain batched
        # GEMMs over (B, N) without transposes (2x faster on CPU than [B, S, N, D]).
        def project(h: Array, which: slice) -> list[Array]:
            """h [B,T,H] -> the [B,N,T,D] projections `which` of (query, key, value)."""
            out = jnp.einsum("bsh,hcnd->cbnsd", h.astype(cfg.compute_dtype), kernel[:, which])
            return list(out + bias[which])

        if query_positions is None:
            q, k, v = project(x, slice(0, 3))
        else:
            # Only some positions are read downstream: project just their queries, attend
            # from them to every key, and carry only their rows (the residual included).
            k, v = project(x, slice(1, 3))
            x = gather_positions(x, query_positions)  # [B,Q,H]
            (q,) = project(x, slice(0, 1))
        q, k, v = (
            checkpoint_name(t, f"{name}_proj")
            for t, name in zip((q, k, v), ("query", "key", "value"), strict=True)
        )
        scores = jnp.einsum("bnqd,bnkd->bnqk", q, k) / jnp.sqrt(D).astype(q.dtype)
        scores = jnp.where(mask, scores, jnp.asarray(MASK_ADDER, scores.dtype))
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        if not deterministic and cfg.attention_probs_dropout_prob > 0.0:
            probs = nn.Dropout(cfg.attention_probs_dropout_prob)(probs, deterministic=False)
        context = jnp.einsum("bnqk,bnkd->bqnd", probs, v)  # [B, S (or Q), N, D]
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


class AlbertLayer(nn.Module):
    """One transformer block (official `attention_ffn_block`): attention then FFN, post-LN."""

    config: ModelConfig
    attention_stack: int | None = None
    ffn_stack: int | None = None

    @nn.compact
    def __call__(
        self,
        x: Array,
        mask: Array,
        layer_idx: Array | int | None,
        deterministic: bool,
        query_positions: Array | None = None,
    ) -> Array:
        """x [B,S,H] -> [B,S,H] (or [B,Q,H] at `query_positions` [B,Q], see SelfAttention)."""
        x = SelfAttention(self.config, self.attention_stack, name="attention")(
            x, mask, layer_idx, deterministic, query_positions
        )
        return FeedForward(self.config, self.ffn_stack, name="ffn")(x, layer_idx, deterministic)


class AlbertGroup(nn.Module):
    """What one layer application runs: the group's `inner_group_num` blocks in order.

    `__call__` is the scan body: (carry x, mask, layer_idx) -> (x, None). `blocks` is the same
    computation as a plain method, which `nn.scan` leaves untransformed: the encoder calls it
    on the scanned instance (same parameters) for a last application that is read only at some
    positions.
    """

    config: ModelConfig
    deterministic: bool = True

    def __call__(self, x: Array, mask: Array, layer_idx: Array | int) -> tuple[Array, None]:
        """Scan body: x [B,S,H] -> (x [B,S,H], None)."""
        return self.blocks(x, mask, layer_idx), None

    @nn.compact
    def blocks(
        self,
        x: Array,
        mask: Array,
        layer_idx: Array | int,
        query_positions: Array | None = None,
    ) -> Array:
        """x [B,S,H] -> [B,S,H]; with `query_positions` [B,Q], the last block runs only at
        those positions -> [B,Q,H] (the blocks before it feed its keys, so they run at all S)."""
        cfg = self.config
        unshared = cfg.layers_per_group
        attention_stack = None if cfg.sharing in ("all", "attention") else unshared
        ffn_stack = None if cfg.sharing in ("all", "ffn") else unshared
        last = cfg.inner_group_num - 1
        for i in range(cfg.inner_group_num):
            x = AlbertLayer(cfg, attention_stack, ffn_stack, name=f"inner_group_{i}")(
                x, mask, layer_idx, self.deterministic, query_positions if i == last else None
            )
        return x


def remat_policy(name: str) -> Callable[..., bool] | None:
    """`remat_policy` -> a `jax.checkpoint` policy (None: save nothing, recompute all)."""
    policies = jax.checkpoint_policies
    return {
        "full": None,
        "dots": policies.checkpoint_dots,
        "dots_no_batch": policies.checkpoint_dots_with_no_batch_dims,
        "minimal": policies.save_only_these_names(
            "query_proj", "key_proj", "value_proj", "attention_out"
        ),
        "save_attention_out": policies.save_only_these_names("attention_out"),
    }[name]


class SharedEncoder(nn.Module):
    """E->H projection, then `num_hidden_layers` applications of the (shared) group blocks.

    With `scan_layers` each group is one `nn.scan` whose parameters are broadcast
    (`variable_broadcast="params"`): one weight set serves every layer, so neither the parameter
    count nor the compiled program grows with depth. Unshared sub-blocks (sharing != "all")
    keep a leading layer axis that the scan's layer index selects. `scan_layers=False` unrolls the
    same computation in Python (same parameter tree) for verification.

    `query_positions` [B,Q] int: only these rows of the output are wanted (pretraining reads
    [CLS] and the masked positions). The last block then runs its queries, attention, output
    projection and FFN at them only (keys and values still at all S): the same rows as the full
    output, for ~70% (S=128) to ~80% (S=512) less of that block's FLOPs at Q = 21.
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: Array,
        input_mask: Array,
        deterministic: bool,
        query_positions: Array | None = None,
    ) -> Array:
        """x [B,S,E], input_mask [B,S] (1 real, 0 pad) -> [B,S,H] (or [B,Q,H] at
        `query_positions`)."""
        cfg = self.config
        if cfg.has_embedding_projection:
            project = Dense(
                (cfg.embedding_size,),
                (cfg.hidden_size,),
                ("embed_factor", "embed"),
                cfg,
                name="embedding_hidden_mapping_in",
            )
            x = project(x)
        x = nn.with_logical_constraint(x, ("act_batch", "act_seq", "act_embed"))
        mask = input_mask.astype(bool)[:, None, None, :]  # [B,1,1,S]: keys that may be attended

        group_cls: Any = AlbertGroup
        if cfg.remat_policy != "none":
            group_cls = nn.remat(
                AlbertGroup,
                prevent_cse=not cfg.scan_layers,  # scan already stops CSE across iterations
                policy=remat_policy(cfg.remat_policy),
                # `blocks`, which `__call__` runs: the split-off last application below is
                # rematerialized like every other one.
                methods=["blocks"],
            )
        layers = cfg.layers_per_group
        for g in range(cfg.num_hidden_groups):
            # The very last application is split off when only some rows are wanted.
            split_last = query_positions is not None and g == cfg.num_hidden_groups - 1
            full = layers - 1 if split_last else layers  # applications over all S positions
            if cfg.scan_layers:
                scanned = nn.scan(
                    group_cls,
                    variable_broadcast="params",
                    split_rngs={"params": False, "dropout": True},
                    in_axes=(nn.broadcast, 0),
                    length=full,
                )
                group = scanned(cfg, deterministic, name=f"group_{g}")
                if full:
                    x, _ = group(x, mask, jnp.arange(full, dtype=jnp.int32))
            else:
                group = group_cls(cfg, deterministic, name=f"group_{g}")
                for layer_idx in range(full):
                    x, _ = group(x, mask, layer_idx)
            if split_last:
                # `blocks` is not scanned: one more application, same weights, fewer rows.
                x = group.blocks(x, mask, layers - 1, query_positions)
        return x


class AlbertModel(nn.Module):
    """Embeddings + shared encoder + pooler. Returns `sequence_output` (or `gathered_output`)
    and `pooled_output`."""

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.embeddings = FactorizedEmbedding(cfg)
        self.encoder = SharedEncoder(cfg)
        self.pooler = Dense((cfg.hidden_size,), (cfg.hidden_size,), ("embed", "mlp"), cfg)

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        deterministic: bool = True,
        output_positions: Array | None = None,
    ) -> dict[str, Array]:
        """input_ids [B,S] -> {"sequence_output" [B,S,H], "pooled_output" [B,H]}.

        With `output_positions` [B,Q] int, the last layer runs only at [CLS] (for the pooler)
        and these positions, and "gathered_output" [B,Q,H] (the rows of the full
        sequence_output at output_positions) replaces "sequence_output".
        """
        if segment_ids is None:
            segment_ids = jnp.zeros_like(input_ids)
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        x = self.embeddings(input_ids, segment_ids, deterministic)
        if output_positions is None:
            sequence_output = self.encoder(x, input_mask, deterministic)
            cls, outputs = sequence_output[:, 0], {"sequence_output": sequence_output}
        else:
            positions = output_positions.astype(jnp.int32)
            cls_first = jnp.concatenate([jnp.zeros_like(positions[:, :1]), positions], axis=1)
            rows = self.encoder(x, input_mask, deterministic, cls_first)  # [B,1+Q,H]
            cls, outputs = rows[:, 0], {"gathered_output": rows[:, 1:]}
        return {**outputs, "pooled_output": jnp.tanh(self.pooler(cls))}


class MaskedLMHead(nn.Module):
    """Masked-LM head on gathered positions: dense H->E, activation, LayerNorm, tied decoder.

    The decoder reuses the E-wide word embeddings (so it is V x E, not V x H) plus a bias.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, embeddings: FactorizedEmbedding) -> Array:
        """x [B,P,H] -> logits [B,P,V]."""
        cfg = self.config
        h = Dense(
            (cfg.hidden_size,), (cfg.embedding_size,), ("embed", "embed_factor"), cfg, name="dense"
        )(x)
        h = activation(cfg.hidden_act)(h)
        h = LayerNorm(cfg.embedding_size, "embed_factor", cfg, name="LayerNorm")(h)
        bias = self.param(
            "output_bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
            (cfg.vocab_size,),
            cfg.weight_dtype,
        )
        return embeddings.attend(h) + bias.astype(cfg.compute_dtype)


class SentenceOrderHead(nn.Module):
    """SOP (or NSP) classifier on the pooled [CLS] vector: [B,H] -> [B,2]. No dropout (official)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, pooled: Array) -> Array:
        cfg = self.config
        return Dense((cfg.hidden_size,), (2,), ("embed", None), cfg, name="classifier")(pooled)


def gather_positions(sequence: Array, positions: Array) -> Array:
    """sequence [B,S,H], positions [B,P] int -> [B,P,H]."""
    return jnp.take_along_axis(sequence, positions[..., None].astype(jnp.int32), axis=1)


class AlbertForPreTraining(nn.Module):
    """ALBERT with the MLM and sentence-order heads (the pretraining model).

    `apply(variables, input_ids, segment_ids, input_mask, masked_lm_positions,
    deterministic=True)` returns {"mlm_logits" [B,P,V], "sop_logits" [B,2],
    "sequence_output" [B,S,H], "pooled_output" [B,H]}. Without `masked_lm_positions`, MLM logits
    are computed at every position ([B,S,V]), e.g. for fill-mask.

    `return_sequence_output=False` (the pretraining step's setting) drops "sequence_output":
    the heads read only [CLS] and the P masked positions, so the last block runs its queries,
    attention, output projection and FFN at those 1 + P rows only (same logits and gradients;
    at P=20 that skips 70% of the block's FLOPs at S=128, 82% at S=512).
    """

    config: ModelConfig

    def setup(self) -> None:
        self.albert = AlbertModel(self.config)
        self.predictions = MaskedLMHead(self.config)
        self.sop_classifier = SentenceOrderHead(self.config)

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        masked_lm_positions: Array | None = None,
        deterministic: bool = True,
        return_sequence_output: bool = True,
    ) -> dict[str, Array]:
        if not return_sequence_output:
            if masked_lm_positions is None:
                raise ValueError("return_sequence_output=False needs masked_lm_positions")
            out = self.albert(
                input_ids, segment_ids, input_mask, deterministic, masked_lm_positions
            )
            masked = out.pop("gathered_output")
        else:
            out = self.albert(input_ids, segment_ids, input_mask, deterministic)
            seq = out["sequence_output"]
            # Gather first: the head then runs on P (=20) positions instead of S (=512).
            masked = (
                seq if masked_lm_positions is None else gather_positions(seq, masked_lm_positions)
            )
        return {
            **out,
            "mlm_logits": self.predictions(masked, self.albert.embeddings),
            "sop_logits": self.sop_classifier(out["pooled_output"]),
        }


def init_params(
    model: nn.Module, rng: Array, batch_size: int = 1, seq_len: int = 8, num_predictions: int = 2
) -> Any:
    """Initializes `model` (AlbertModel or AlbertForPreTraining) on dummy inputs; returns the
    variables with logical-partitioning boxes (use `nn.meta.unbox` for plain arrays)."""
    ids = jnp.zeros((batch_size, seq_len), jnp.int32)
    kwargs: dict[str, Any] = {}
    if isinstance(model, AlbertForPreTraining):
        kwargs["masked_lm_positions"] = jnp.zeros((batch_size, num_predictions), jnp.int32)
    return model.init(rng, ids, ids, jnp.ones_like(ids), **kwargs)
