"""Unshare / reshare a checkpoint's layers (`python -m albert_jax.convert --unshare|--reshare`).

`unshare` turns any shared layout (all-shared, grouped, inner groups, attention- or FFN-only
sharing) into `sharing="none"` with one group of one block: layer j of the result is a copy of
the block the source ran at its j-th block application, so the function is unchanged (the
effective depth L x inner_group_num becomes `num_hidden_layers`). Pretraining (`init_from`) or
fine-tuning (`init`) continues from it with every layer free to move on its own.

`reshare` is the opposite research baseline: the mean over the layers of a not-shared
checkpoint becomes the one block of an all-shared model of the same depth. Outputs change;
`output_difference` measures how much, on a fixed probe batch.

Parameter layout (`albert_jax.model.albert`): the block `inner_group_i` of group g lives under
`albert/encoder/group_{g}/inner_group_{i}/{attention,ffn}/...`; an unshared sub-block carries a
leading axis of `layers_per_group`, which the layer's index within its group selects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from albert_jax import files
from albert_jax.interop.weight_names import flatten_params, to_numpy, unflatten_params
from albert_jax.model.albert import AlbertForPreTraining
from albert_jax.model.config import ModelConfig

__all__ = [
    "applied_blocks",
    "unshare",
    "reshare",
    "probe_batch",
    "model_outputs",
    "output_difference",
    "convert_sharing",
    "REPORT_FILES",
]

GROUPS_PREFIX = "albert/encoder/group_"
# The JSON report the CLI writes next to the converted checkpoint, per direction.
REPORT_FILES = {"unshare": "unshare_report.json", "reshare": "reshare_report.json"}


def _block_prefix(group: int, inner: int) -> str:
    return f"{GROUPS_PREFIX}{group}/inner_group_{inner}/"


def _stacked_parts(config: ModelConfig) -> tuple[str, ...]:
    """The sub-blocks ("attention", "ffn") that carry a layer axis under `config.sharing`."""
    return {"all": (), "attention": ("ffn",), "ffn": ("attention",), "none": ("attention", "ffn")}[
        config.sharing
    ]


def applied_blocks(params: Mapping[str, Any], config: ModelConfig) -> list[dict[str, np.ndarray]]:
    """The weights of every block application of one forward pass, in the order they run.

    Returns `config.effective_depth` (= L x inner_group_num) dicts {"attention/query/kernel":
    array, ..., "ffn/output/bias": array} of host arrays without a layer axis: application
    j = l x inner_group_num + i runs block `inner_group_i` of layer l's group, at the slice of
    l within its group for the sub-blocks that are not shared. Shared weights are the same
    array object in every application that runs them.

    Raises:
      ValueError: listing the encoder weights `config` needs that `params` lacks, or whose
        layer axis is not `layers_per_group` long.
    """
    flat = {k: to_numpy(v) for k, v in flatten_params(params).items()}
    stacked = _stacked_parts(config)
    per_group = config.layers_per_group
    blocks: list[list[dict[str, np.ndarray]]] = []  # [group][inner] -> sub-tree (layer axis kept)
    problems = []
    for g in range(config.num_hidden_groups):
        blocks.append([])
        for i in range(config.inner_group_num):
            prefix = _block_prefix(g, i)
            block = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
            if not block:
                problems.append(f"no weights under {prefix}")
            for name, value in block.items():
                if name.split("/")[0] in stacked and (value.ndim == 0 or len(value) != per_group):
                    problems.append(
                        f"{prefix}{name}: shape {value.shape}, expected a leading layer axis of "
                        f"{per_group} (sharing={config.sharing!r})"
                    )
            blocks[g].append(block)
    names = {frozenset(b) for group in blocks for b in group if b}
    if len(names) > 1:
        problems.append(f"the blocks hold different weight names: {sorted(map(sorted, names))}")
    if problems:
        raise ValueError(
            f"encoder weights do not fit the ModelConfig (num_hidden_groups="
            f"{config.num_hidden_groups}, inner_group_num={config.inner_group_num}, sharing="
            f"{config.sharing!r}): " + "; ".join(problems)
        )
    applied = []
    for layer in range(config.num_hidden_layers):
        g, index = divmod(layer, per_group)
        for block in blocks[g]:
            applied.append(
                {k: v[index] if k.split("/")[0] in stacked else v for k, v in block.items()}
            )
    return applied


def _with_blocks(
    params: Mapping[str, Any], blocks: Mapping[str, np.ndarray]
) -> dict[str, dict[str, Any]]:
    """`params` with its encoder groups replaced by one group of one block, `blocks`
    ({"attention/query/kernel": array, ...}); embeddings, projection and heads kept as they are
    (host arrays)."""
    kept = {
        k: to_numpy(v) for k, v in flatten_params(params).items() if not k.startswith(GROUPS_PREFIX)
    }
    kept.update({_block_prefix(0, 0) + name: value for name, value in blocks.items()})
    return unflatten_params(kept)


def unshare(params: Mapping[str, Any], config: ModelConfig) -> tuple[dict[str, Any], ModelConfig]:
    """(params, config) -> the same function as `sharing="none"`, one group of one block.

    `params` is `{"params": {...}}` (or the inner tree); the result's encoder weights are
    [effective_depth, ...] stacks of the blocks the source ran (`applied_blocks`), its other
    weights the source's, as host arrays. The config keeps every other field (runtime ones too).

    Raises:
      ValueError: when `config` is already unshared (sharing="none", one group, one block), or
        the params do not fit it.
    """
    if (config.sharing, config.num_hidden_groups, config.inner_group_num) == ("none", 1, 1):
        raise ValueError(
            "unshare: the checkpoint is already unshared (sharing='none', num_hidden_groups=1, "
            "inner_group_num=1): every layer has its own weights; nothing to do"
        )
    applied = applied_blocks(params, config)
    stacked = {name: np.stack([block[name] for block in applied]) for name in applied[0]}
    unshared = config.replace(
        sharing="none",
        num_hidden_layers=config.effective_depth,
        num_hidden_groups=1,
        inner_group_num=1,
    )
    return _with_blocks(params, stacked), unshared


def reshare(params: Mapping[str, Any], config: ModelConfig) -> tuple[dict[str, Any], ModelConfig]:
    """(params, config) of a not-shared model -> one all-shared block, the mean of its layers.

    A research baseline (the function changes; see `output_difference`): every weight of the
    shared block is the mean over the `effective_depth` layers (computed in float64, stored in
    the source dtype); the result has `sharing="all"`, one group of one block, the same depth.

    Raises:
      ValueError: when `config.sharing` is not "none" (its layers already share weights), or
        the params do not fit it.
    """
    if config.sharing != "none":
        raise ValueError(
            f"reshare: the checkpoint has sharing={config.sharing!r}; reshare averages the layers "
            "of a not-shared checkpoint (sharing='none') into one block. To change which "
            "sub-blocks are shared, unshare it first (--unshare), then reshare"
        )
    applied = applied_blocks(params, config)
    mean = {
        name: np.mean(
            np.stack([block[name] for block in applied]), axis=0, dtype=np.float64
        ).astype(applied[0][name].dtype)
        for name in applied[0]
    }
    shared = config.replace(
        sharing="all",
        num_hidden_layers=config.effective_depth,
        num_hidden_groups=1,
        inner_group_num=1,
    )
    return _with_blocks(params, mean), shared


# --------------------------------------------------------------------------------- outputs
def probe_batch(
    config: ModelConfig, seed: int = 0, batch: int = 2, seq_len: int = 32, predictions: int = 4
) -> dict[str, np.ndarray]:
    """A fixed batch of random token ids on which two models are compared: input_ids,
    segment_ids, input_mask [batch, S] and masked_lm_positions [batch, P] (int32), S = seq_len
    capped at max_position_embeddings, P = predictions capped at half of S. The second row is
    padded to half its length; the second half of each row's tokens is segment B."""
    rng = np.random.default_rng(seed)
    seq = min(seq_len, config.max_position_embeddings)
    lengths = np.array([seq] + [max(seq // 2, 1)] * (batch - 1))  # S, S/2, S/2, ...
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    ids = (rng.integers(0, config.vocab_size, (batch, seq)) * mask).astype(np.int32)
    segments = ((np.arange(seq)[None, :] >= lengths[:, None] // 2) * mask).astype(np.int32)
    count = max(1, min(predictions, seq // 2))
    # Distinct real positions of each row (every row has at least S/2 >= count of them).
    positions = np.stack([np.sort(rng.choice(n, count, replace=False)) for n in lengths])
    positions = positions.astype(np.int32)
    return {
        "input_ids": ids,
        "segment_ids": segments,
        "input_mask": mask,
        "masked_lm_positions": positions,
    }


def model_outputs(
    params: Any, config: ModelConfig, batch: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """{"mlm_logits" [B,P,V], "sop_logits" [B,2], "sequence_output" [B,S,H]} of the
    pretraining model on `batch` (`probe_batch`), run op by op (`jax.disable_jit`).

    Op by op, because that compares the functions two parameter layouts define: every primitive
    runs alone on the same inputs, so an exact copy of a model gives exactly its outputs. Under
    `jit`, XLA compiles a loop over shared (loop-invariant) weights and one over stacked,
    per-layer weights into different fusions, and the float32 results then differ in the last
    bits (up to ~1e-6 on the unit-scale hidden states on CPU, XLA of jax 0.10).
    """
    with jax.disable_jit():
        out = AlbertForPreTraining(config).apply(
            params,
            batch["input_ids"],
            batch["segment_ids"],
            batch["input_mask"],
            batch["masked_lm_positions"],
        )
        return {k: np.asarray(out[k]) for k in ("mlm_logits", "sop_logits", "sequence_output")}


def output_difference(
    source: tuple[Any, ModelConfig],
    result: tuple[Any, ModelConfig],
    batch: Mapping[str, np.ndarray],
) -> dict[str, float]:
    """How far `result`'s outputs are from `source`'s, both (params, config), on `batch`
    (`probe_batch`; both run by `model_outputs`): the max abs difference of mlm_logits
    [B,P,V], sop_logits [B,2] and the real (unpadded) rows of sequence_output [B,S,H]; the
    relative L2 change of those rows; the share of masked positions whose top MLM prediction
    is the same."""
    a, b = (
        {k: v.astype(np.float64) for k, v in model_outputs(*model, batch).items()}
        for model in (source, result)
    )
    real = np.asarray(batch["input_mask"], bool)
    seq_a, seq_b = a["sequence_output"][real], b["sequence_output"][real]
    return {
        "mlm_logits_max_abs_diff": float(np.abs(a["mlm_logits"] - b["mlm_logits"]).max()),
        "sop_logits_max_abs_diff": float(np.abs(a["sop_logits"] - b["sop_logits"]).max()),
        "sequence_output_max_abs_diff": float(np.abs(seq_a - seq_b).max()),
        "sequence_output_relative_l2": float(
            np.linalg.norm(seq_a - seq_b) / max(np.linalg.norm(seq_a), 1e-30)
        ),
        "mlm_top1_agreement": float(
            np.mean(a["mlm_logits"].argmax(-1) == b["mlm_logits"].argmax(-1))
        ),
    }


# ------------------------------------------------------------------------------ checkpoints
def _describe(config: ModelConfig, params: Any) -> dict[str, Any]:
    fields = ("sharing", "num_hidden_layers", "num_hidden_groups", "inner_group_num")
    parameters = sum(int(np.size(v)) for v in flatten_params(params).values())
    return {**{f: getattr(config, f) for f in fields}, "parameters": parameters}


def convert_sharing(src: str, dst: str, direction: str, seed: int = 0) -> dict[str, Any]:
    """Unshares (`direction="unshare"`) or reshares ("reshare") the checkpoint at `src` (any
    layout `load_pretrained` reads; local or gs://) into an albert_jax model dir at `dst` (what
    `load_pretrained`, pretraining's `init_from` and fine-tuning's `init` read), tokenizer
    included; writes `dst/REPORT_FILES[direction]` and returns that report: both configs, the
    parameter counts, and `output_difference` on `probe_batch(seed)` in float32.

    Raises:
      ValueError: `direction` is neither, or as `unshare` / `reshare` / `load_pretrained`.
    """
    from albert_jax.pretrained import load_pretrained, save_model_dir

    if direction not in REPORT_FILES:
        raise ValueError(f"direction={direction!r} is not one of {tuple(REPORT_FILES)}")
    loaded = load_pretrained(src)
    transform = unshare if direction == "unshare" else reshare
    params, config = transform(loaded.variables, loaded.config)
    save_model_dir(dst, params, config, tokenizer_path=loaded.tokenizer_path)
    # The figures are taken in float32 whatever the checkpoint computes in, so that an exact
    # unshare reads 0 and a reshare's change is not hidden under bfloat16 rounding; with the
    # XLA attention, which every backend has (the runtime fields leave the function as it is).
    fp32 = {"dtype": "float32", "param_dtype": "float32", "attention_impl": "xla"}
    cast = lambda p: jax.tree.map(lambda x: np.asarray(x, np.float32), p)
    probe = probe_batch(config, seed)
    difference = output_difference(
        (cast(loaded.variables), loaded.config.replace(**fp32)),
        (cast(params), config.replace(**fp32)),
        probe,
    )
    report = {
        "direction": direction,
        "src": src,
        "dst": dst,
        "source": _describe(loaded.config, loaded.variables),
        "result": _describe(config, params),
        "initialized_in_source": list(loaded.initialized),
        "probe": {"seed": seed, **{k: list(v.shape) for k, v in probe.items()}},
        "output_difference": difference,
    }
    files.write_json(str(files.as_path(dst) / REPORT_FILES[direction]), report, indent=2)
    return report
