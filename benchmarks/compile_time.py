"""Train-step compile time vs depth: ours (nn.scan over shared layers) vs HF Flax ALBERT.

`python benchmarks/compile_time.py --json` prints one JSON line. For each depth L (12, 48, 96;
H=256, all layers shared) it jit-compiles one full training step (forward, backward, LAMB
update) and reports the seconds spent in lowering + XLA compilation. HF's
`FlaxAlbertForPreTraining` (transformers 4.x) unrolls the layer loop in Python, so its program
grows with L; ours scans one broadcast parameter set, so it should not. Each depth is compiled
`--repeats` times, round-robin, and the fastest compile counts: on a shared machine a single
compile moves by 10-30% with the load, more than depth moves ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from albert_jax.model.albert import AlbertForPreTraining, init_params  # noqa: E402
from albert_jax.model.config import ModelConfig  # noqa: E402
from albert_jax.model.losses import masked_lm_loss, sentence_order_loss  # noqa: E402
from albert_jax.optim import lamb, warmup_polynomial_decay  # noqa: E402

DEPTHS = (12, 48, 96)
SHAPE = dict(
    vocab_size=30000,
    embedding_size=128,
    hidden_size=256,
    num_attention_heads=4,
    intermediate_size=1024,
)


def _batch(batch: int, seq: int, preds: int) -> dict[str, jax.Array]:
    ids = jnp.ones((batch, seq), jnp.int32)
    return dict(
        input_ids=ids,
        segment_ids=jnp.zeros_like(ids),
        input_mask=jnp.ones_like(ids),
        masked_lm_positions=jnp.zeros((batch, preds), jnp.int32),
        masked_lm_ids=jnp.ones((batch, preds), jnp.int32),
        masked_lm_weights=jnp.ones((batch, preds), jnp.float32),
        sentence_order_label=jnp.zeros((batch,), jnp.int32),
    )


def _compile_seconds(step: Callable, *args: Any) -> float:
    start = time.perf_counter()
    jax.jit(step, donate_argnums=(0,)).lower(*args).compile()
    return time.perf_counter() - start


def _train_step(apply_logits: Callable, tx: optax.GradientTransformation) -> Callable:
    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            mlm, sop = apply_logits(p, batch)
            mlm_loss = masked_lm_loss(mlm, batch["masked_lm_ids"], batch["masked_lm_weights"])
            return mlm_loss + sentence_order_loss(sop, batch["sentence_order_label"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def ours(layers: int, batch: dict[str, jax.Array]) -> float:
    cfg = ModelConfig(num_hidden_layers=layers, **SHAPE)
    model = AlbertForPreTraining(cfg)
    params = jax.eval_shape(lambda: nn.meta.unbox(init_params(model, jax.random.key(0))))
    tx = lamb(warmup_polynomial_decay(1e-3, 10, 100))
    opt_state = jax.eval_shape(tx.init, params)

    def apply_logits(p, b):
        out = model.apply(
            p,
            b["input_ids"],
            b["segment_ids"],
            b["input_mask"],
            b["masked_lm_positions"],
            return_sequence_output=False,  # as the training step: last block at read rows
        )
        return out["mlm_logits"], out["sop_logits"]

    return _compile_seconds(_train_step(apply_logits, tx), (params, opt_state), batch)


def hf_flax(layers: int, batch: dict[str, jax.Array]) -> float | None:
    """HF transformers 4.x FlaxAlbertForPreTraining, same shapes; None if not importable."""
    try:
        from transformers import AlbertConfig, FlaxAlbertForPreTraining
    except ImportError:
        return None
    config = AlbertConfig(num_hidden_layers=layers, hidden_act="gelu_new", **SHAPE)
    model = FlaxAlbertForPreTraining(config, _do_init=False)
    module = model.module
    seq = batch["input_ids"].shape[1]
    params = jax.eval_shape(lambda: model.init_weights(jax.random.key(0), (1, seq)))
    tx = lamb(warmup_polynomial_decay(1e-3, 10, 100))
    opt_state = jax.eval_shape(tx.init, params)

    def apply_logits(p, b):
        out = module.apply(
            {"params": p},
            b["input_ids"],
            b["input_mask"],
            b["segment_ids"],
            jnp.broadcast_to(jnp.arange(seq), b["input_ids"].shape),
            deterministic=True,
        )
        # HF computes MLM logits at every position; gather the masked ones for the same loss.
        mlm = jnp.take_along_axis(out.prediction_logits, b["masked_lm_positions"][..., None], 1)
        return mlm, out.sop_logits

    return _compile_seconds(_train_step(apply_logits, tx), (params, opt_state), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no_hf", action="store_true", help="skip the HF Flax peer")
    parser.add_argument("--repeats", type=int, default=3, help="compiles per depth (min counts)")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    batch = _batch(args.batch, args.seq, 20)

    def fastest(
        compile_seconds: Callable[[int, dict[str, jax.Array]], float | None],
    ) -> list[float | None]:
        """Min over repeats per depth; the depths take turns so drift hits all of them."""
        times: list[list[float]] = [[] for _ in depths]
        for _ in range(args.repeats):
            for i, d in enumerate(depths):
                seconds = compile_seconds(d, batch)
                if seconds is None:  # peer not installed
                    return [None] * len(depths)
                times[i].append(seconds)
        return [round(min(t), 3) for t in times]

    ours(depths[0], batch)  # warm up tracing caches so the first depth is not penalised
    result: dict[str, Any] = {
        "benchmark": "compile_time",
        "backend": jax.default_backend(),
        "hidden_size": SHAPE["hidden_size"],
        "depths": depths,
        "repeats": args.repeats,
        "ours_s": fastest(ours),
    }
    hf = None if args.no_hf else fastest(hf_flax)
    if hf is not None and all(t is not None for t in hf):
        result["hf_flax_s"] = hf
    base = depths[0]
    for name in ("ours", "hf_flax"):
        times = result.get(f"{name}_s")
        if times:
            for d, t in zip(depths[1:], times[1:], strict=True):
                result[f"{name}_ratio_{d}_{base}"] = round(t / times[0], 3)
    if "hf_flax_s" in result:
        result["hf_over_ours_at_max_depth"] = round(
            result["hf_flax_s"][-1] / result["ours_s"][-1], 2
        )
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
