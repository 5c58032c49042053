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

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from albert_jax.model.config import ModelConfig
from albert_jax.model.layers import (
    Dense,
    FactorizedEmbedding,
    FeedForward,
    LayerNorm,
    SelfAttention,
    activation,
    add_bias,
    gather_positions,
)

__all__ = [
    "AlbertLayer",
    "AlbertGroup",
    "SharedEncoder",
    "AlbertModel",
    "MaskedLMHead",
    "SentenceOrderHead",
    "AlbertForPreTraining",
    "init_params",
]

Array = jax.Array


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
        pack_ids: Array | None = None,
    ) -> Array:
        """x [B,S,E], input_mask [B,S] (1 real, 0 pad) -> [B,S,H] (or [B,Q,H] at
        `query_positions`). `pack_ids` [B,S] (packed rows: 1, 2, ... per example, 0 pad): a
        token attends only to the tokens of its own example."""
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
        if pack_ids is not None:  # [B,1,S,S]: and only those of the query's own example
            mask = mask & (pack_ids[:, None, :, None] == pack_ids[:, None, None, :])

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
        pooled_only: bool = False,
        position_ids: Array | None = None,
        pack_ids: Array | None = None,
        cls_positions: Array | None = None,
    ) -> dict[str, Array]:
        """input_ids [B,S] -> {"sequence_output" [B,S,H], "pooled_output" [B,H]}.

        With `output_positions` [B,Q] int, the last layer runs only at [CLS] (for the pooler)
        and these positions, and "gathered_output" [B,Q,H] (the rows of the full
        sequence_output at output_positions) replaces "sequence_output".

        `pooled_only=True` (classification and multiple-choice heads, which read nothing else):
        the last layer runs only at [CLS], and only "pooled_output" is returned. The same
        pooled vector, for 1/L less of the encoder's work at L layers: of the last
        application only the key and value projections run at every position (1/6 of its
        matmul FLOPs at ALBERT's 4H FFN).

        Packed rows (tasks/packing.py; with `pooled_only`): `position_ids` and `pack_ids` [B,S]
        and `cls_positions` [B,Q], the [CLS] of each example of a row; "pooled_output" is then
        [B,Q,H], one per example slot, each what the example gives alone.
        """
        if segment_ids is None:
            segment_ids = jnp.zeros_like(input_ids)
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        if pooled_only and output_positions is not None:
            raise ValueError("pooled_only=True reads no output_positions")
        if cls_positions is not None and not pooled_only:
            raise ValueError("cls_positions (packed rows) needs pooled_only=True")
        if pack_ids is not None and cls_positions is None:
            raise ValueError("pack_ids (packed rows) come with their cls_positions")
        x = self.embeddings(input_ids, segment_ids, deterministic, position_ids)
        if cls_positions is not None:
            rows = self.encoder(x, input_mask, deterministic, cls_positions, pack_ids)  # [B,Q,H]
            return {"pooled_output": jnp.tanh(self.pooler(rows))}
        if pooled_only:  # [CLS] only: no other position is read
            output_positions = jnp.zeros((input_ids.shape[0], 0), jnp.int32)
        if output_positions is None:
            sequence_output = self.encoder(x, input_mask, deterministic)
            cls, outputs = sequence_output[:, 0], {"sequence_output": sequence_output}
        else:
            positions = output_positions.astype(jnp.int32)
            cls_position = jnp.zeros((positions.shape[0], 1), jnp.int32)  # also when Q = 0
            cls_first = jnp.concatenate([cls_position, positions], axis=1)
            rows = self.encoder(x, input_mask, deterministic, cls_first)  # [B,1+Q,H]
            cls, outputs = rows[:, 0], {} if pooled_only else {"gathered_output": rows[:, 1:]}
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
        # The bias gradient sums every masked position of the batch: in float32 (add_bias).
        return add_bias(embeddings.attend(h), bias)


class SentenceOrderHead(nn.Module):
    """SOP (or NSP) classifier on the pooled [CLS] vector: [B,H] -> [B,2]. No dropout (official)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, pooled: Array) -> Array:
        cfg = self.config
        return Dense((cfg.hidden_size,), (2,), ("embed", None), cfg, name="classifier")(pooled)


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
