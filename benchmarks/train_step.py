"""Training-step throughput and MFU: our jitted step vs HF Flax, HF PyTorch and KerasHub ALBERT.

`python benchmarks/train_step.py --size=base --batch=8 --seq=128 --json` prints one JSON line.
Every contender runs the same protocol in the same process: the official
architecture of `--size`, no dropout, a batch of `--batch` sequences of `--seq` tokens with
`--preds` masked positions each, forward + backward of MLM loss (on the masked positions) +
sentence-order loss, then an AdamW update. After `--warmup` untimed steps each, the contenders
take turns, one step each, for `--steps` rounds, and the median step time of each is reported:
interleaving spreads the drift of a shared machine over all of them, so same-run ratios hold.

- ours: `pretrain.model_half.make_train_step` (the step `train_and_evaluate` runs) on one device,
  with the optimizer switched to AdamW; the MLM head runs on the gathered masked positions only,
  and the last layer on the 1 + P rows the heads read ([CLS] and the masked positions).
  Measured twice: the default config (`nn.scan` over the layers, `remat_policy="dots"`) and
  `ours_unrolled` (`model.scan_layers=False`).
- hf_flax: transformers 4.x `FlaxAlbertForPreTraining` (computes MLM logits at every position;
  the loss then reads the masked ones), optax AdamW, one `jax.jit` with donated state.
- hf_torch: transformers `AlbertForPreTraining` with `labels` = -100 outside the masked
  positions, `torch.optim.AdamW`, eval mode (no dropout), on the GPU when torch sees one, else
  on all CPU cores; in bfloat16 under `torch.autocast` with SDPA attention
  (`benchmarks/torch_peer.py`).
- kerashub: keras-hub's `AlbertBackbone` + `MaskedLMHead` on the masked positions + a `Dense(2)`
  SOP head, Keras 3 on the JAX backend, built from ours' model config (same parameter count:
  `kerashub_params` = `ours_params`); `model.stateless_call(..., training=True)` inside one
  `jax.jit` with the HF Flax peer's optax AdamW (`benchmarks/kerashub_peer.py`). Skipped, with a
  note, when keras-hub is not installed (`pip install -e ".[peers]"`).

`X_over_Y` = the median over rounds of Y's step time / X's step time in the same round.

`--variant NAME='{"scan": false, "remat": "none", "compiler_options": {...}}'` (repeatable)
adds `ours_NAME`: ours with `model.scan_layers`, `model.remat_policy` and XLA compiler options
(`jax.jit(...).lower(...).compile(compiler_options=...)`, this program only; e.g.
`{"xla_cpu_enable_concurrency_optimized_scheduler": false}`) changed, and
`ours_NAME_over_ours`: an A/B of a change to ours' step, interleaved with the others.

`--dtype=bfloat16` is mixed precision for every contender: float32 parameters and optimizer
state, bfloat16 matmuls (ours: `model.dtype`; HF Flax: its `dtype`; HF PyTorch: autocast);
KerasHub is then left out. `--attention` is ours' `model.attention_impl` (`cudnn`: the fused
kernel, GPU only). `--profile=DIR` traces `--profile_steps` more steps of ours after the timed
rounds and adds `ours_profile`, the op totals per step (`benchmarks/trace_summary.py`).

MFU counts model FLOPs honestly (`albert_jax.model.flops`): every layer
application, attention, the E→H projection, the MLM head on the predicted positions only, the
pooler and SOP classifier, training = 3 × forward; the last layer counts its keys and values at
all S tokens and the rest at the 1 + P rows the loss reads, which is what the task needs (and
what ours computes). The same model FLOPs are credited to every
contender, so MFU ratios equal throughput ratios. On a CPU the peak is the matmul FLOP/s (in
`--dtype`) that `jax.jit(jnp.matmul)` reaches in this process (`--peak_size`), measured before
and after the contenders (best of both), since a CPU has no trustworthy spec-sheet figure; on an
accelerator it is the device's spec-sheet dense peak in `--dtype` (`flops.device_peak_flops`:
989 TFLOP/s for an H200 in bfloat16), and the measured matmul is reported beside it. When torch
is installed, `torch_matmul_peak_gflops` reports the same square matmul through `torch.matmul`
on torch's device, measured alongside: the ceiling of the PyTorch peer (MFU stays against the
peak above).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Keras picks its backend at its first import, which transformers may do before the KerasHub
# peer is built: the peer is a JAX contender, so Keras must come up on JAX.
os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from albert_jax.model import flops
from albert_jax.model.albert import AlbertForPreTraining  # noqa: E402
from albert_jax.model.config import ModelConfig, model_config_from  # noqa: E402
from albert_jax.pretrain import model_half  # noqa: E402
from albert_jax.sharding import LOGICAL_AXIS_RULES, create_mesh  # noqa: E402
from benchmarks import kerashub_peer, torch_peer, trace_summary  # noqa: E402
from configs import pretrain  # noqa: E402

LEARNING_RATE = 1e-4  # constant: the schedule does not change the work of a step
WEIGHT_DECAY = 0.01


def make_batch(batch: int, seq: int, preds: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """One synthetic pretraining batch in the pipeline's layout (numpy, [batch, seq] etc.).

    Token ids are random (the work of a step does not depend on them); two segments of equal
    length, no padding, `preds` distinct masked positions per sequence.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, size=(batch, seq), dtype=np.int32)
    segment = np.zeros((batch, seq), np.int32)
    segment[:, seq // 2 :] = 1
    positions = np.sort(
        np.stack([rng.choice(np.arange(1, seq - 1), preds, replace=False) for _ in range(batch)]),
        axis=1,
    ).astype(np.int32)
    return dict(
        input_ids=ids,
        segment_ids=segment,
        input_mask=np.ones((batch, seq), np.int32),
        masked_lm_positions=positions,
        masked_lm_ids=np.take_along_axis(ids, positions, 1),
        masked_lm_weights=np.ones((batch, preds), np.float32),
        sentence_order_label=rng.integers(0, 2, size=(batch,), dtype=np.int32),
    )


def time_interleaved(
    steps: dict[str, Callable[[], Any]], warmup: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds of each contender's steps, timed in turns: round r runs one step of each.

    The warm-up steps take turns too: the contenders share the process's heap, and the
    memory a contender's first steps take and free moves the others' big buffers (on a CPU,
    a fine-tuning step of ours faulted its 1.1 GB of temporaries in again for two rounds
    after HF's first steps, when HF ran in the same process), so the timed rounds start once
    every contender has run.
    Every `step` must block until its result is ready.
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(theirs: list[float], ours: list[float]) -> float:
    """The median over rounds of their step time / ours in the same round: ours' throughput
    over theirs, paired by round so that a slow round (a neighbour's burst) slows both alike."""
    return statistics.median(t / o for t, o in zip(theirs, ours, strict=True))


def ours_config(args: argparse.Namespace, scan: bool = True) -> Any:
    """The pretraining config ours runs: `size`'s, at the benchmark's shapes, AdamW."""
    config = pretrain.get_config(f"size={args.size}")
    config.batch_size = args.batch
    config.seq_len = args.seq
    config.max_predictions_per_seq = args.preds
    config.optimizer = "adamw"
    config.learning_rate = LEARNING_RATE
    config.warmup_steps = 0
    config.weight_decay = WEIGHT_DECAY
    if args.remat:
        config.model.remat_policy = args.remat
    config.model.dtype = args.dtype
    config.model.attention_impl = args.attention
    config.model.scan_layers = scan
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    return config


def ours(
    args: argparse.Namespace,
    batch: dict[str, Any],
    scan: bool,
    remat: str = "",
    compiler_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    config = ours_config(args, scan)
    if remat:
        config.model.remat_policy = remat
    model_config = model_config_from(config)
    model = AlbertForPreTraining(model_config)
    mesh = create_mesh((1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        tx, _, shardings, initialize = model_half.create_train_state(config, model, mesh)
        state = initialize()
        params = sum(int(x.size) for x in jax.tree.leaves(state.params))
        step_fn = jax.jit(
            model_half.make_train_step(config, model, tx),
            in_shardings=(shardings, None),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )
        device_batch = jax.device_put(batch, jax.devices()[0])
        start = time.perf_counter()
        compiled = step_fn.lower(state, device_batch).compile(compiler_options=compiler_options)
        compile_s = time.perf_counter() - start
        holder = [state]

    def step() -> None:
        holder[0], metrics = compiled(holder[0], device_batch)
        jax.block_until_ready(metrics["loss"])

    return dict(step=step, compile_s=compile_s, compiled=compiled, params=params)


def hf_config(args: argparse.Namespace) -> Any:
    from transformers import AlbertConfig

    preset = ModelConfig.preset(args.size)
    return AlbertConfig(
        vocab_size=preset.vocab_size,
        embedding_size=preset.embedding_size,
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        intermediate_size=preset.intermediate_size,
        max_position_embeddings=preset.max_position_embeddings,
        hidden_act="gelu_new",  # the official tanh-approximate GELU, as ours
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )


def peer_adamw() -> optax.GradientTransformation:
    """The JAX peers' AdamW: the hyper-parameters of ours and of the PyTorch peer."""
    return optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-6, weight_decay=WEIGHT_DECAY)


def peer_loss(mlm_logits: jax.Array, sop_logits: jax.Array, b: dict[str, Any]) -> jax.Array:
    """MLM cross-entropy at the masked positions (logits [B, P, V]) + SOP cross-entropy."""
    mlm = optax.softmax_cross_entropy_with_integer_labels(mlm_logits, b["masked_lm_ids"])
    mlm = jnp.sum(mlm * b["masked_lm_weights"]) / jnp.sum(b["masked_lm_weights"])
    sop = optax.softmax_cross_entropy_with_integer_labels(sop_logits, b["sentence_order_label"])
    return mlm + jnp.mean(sop)


def jitted_peer(train_step: Callable, state: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """A contender from a pure `train_step(state, batch) -> (state, loss)`: one `jax.jit` with
    the state donated, compiled (timed) before the rounds."""
    jitted = jax.jit(train_step, donate_argnums=(0,))
    device_batch = jax.device_put(batch, jax.devices()[0])
    start = time.perf_counter()
    compiled = jitted.lower(state, device_batch).compile()
    compile_s = time.perf_counter() - start
    holder = [state]

    def step() -> None:
        holder[0], loss = compiled(holder[0], device_batch)
        jax.block_until_ready(loss)

    return dict(step=step, compile_s=compile_s, compiled=compiled)


def hf_flax(args: argparse.Namespace, batch: dict[str, Any]) -> dict[str, Any] | None:
    try:
        from transformers import FlaxAlbertForPreTraining
    except ImportError:
        return None
    model = FlaxAlbertForPreTraining(
        hf_config(args), input_shape=(1, args.seq), seed=0, dtype=getattr(jnp, args.dtype)
    )
    module = model.module
    tx = peer_adamw()
    params = model.params
    position_ids = np.broadcast_to(np.arange(args.seq, dtype=np.int32), (args.batch, args.seq))

    def train_step(state, b):
        params, opt_state = state

        def loss_fn(p):
            out = module.apply(
                {"params": p},
                b["input_ids"],
                b["input_mask"],
                b["segment_ids"],
                position_ids,
                deterministic=True,
            )
            # HF computes MLM logits at every position; the loss reads the masked ones.
            logits = jnp.take_along_axis(
                out.prediction_logits, b["masked_lm_positions"][..., None], 1
            )
            return peer_loss(logits, out.sop_logits, b)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jitted_peer(train_step, (params, tx.init(params)), batch)


def kerashub(args: argparse.Namespace, batch: dict[str, Any]) -> dict[str, Any] | None:
    """KerasHub's `AlbertBackbone` + `MaskedLMHead` + SOP `Dense(2)` (`kerashub_peer.py`)."""
    if args.dtype != "float32":
        print("kerashub skipped: the peer is built in float32 only", file=sys.stderr)
        return None
    # Ours' model config, so both have the same parameters (`*_params` in the JSON).
    model = kerashub_peer.build_model(model_config_from(ours_config(args)))
    if model is None:
        return None
    train_step, state = kerashub_peer.make_train_step(model, peer_adamw(), peer_loss)
    return dict(jitted_peer(train_step, state, batch), params=kerashub_peer.num_params(model))


def hf_torch(args: argparse.Namespace, batch: dict[str, Any]) -> dict[str, Any] | None:
    return torch_peer.hf_torch(hf_config(args), batch, args.dtype, LEARNING_RATE, WEIGHT_DECAY)


VARIANT_FIELDS = ("scan", "remat", "compiler_options")


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME={"scan": ..., "remat": ..., "compiler_options": {...}}` -> (NAME, the dict)."""
    name, _, spec = text.partition("=")
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--variant {text!r}: NAME must be an identifier")
    try:
        fields = json.loads(spec)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--variant {name}: not JSON ({error})") from None
    unknown = sorted(set(fields) - set(VARIANT_FIELDS)) if isinstance(fields, dict) else [spec]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--variant {name}: unknown {unknown}; a JSON object of {list(VARIANT_FIELDS)}"
        )
    return name, fields


def profile_ours(step: Callable[[], None], directory: str, steps: int) -> dict[str, Any]:
    """`steps` steps of ours under `jax.profiler.trace(directory)`: their op totals per step.

    A profiler that fails (no CUPTI, an unreadable trace) gives {"error": ...} in the result
    rather than losing the timings measured before it."""
    try:
        with jax.profiler.trace(directory):
            for _ in range(steps):
                step()
        return trace_summary.summarize(trace_summary.newest_trace(directory), steps)
    except Exception as error:  # reported in the JSON, next to the timings
        return {"error": f"{type(error).__name__}: {error}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--size", default="base", choices=pretrain.SIZES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--preds", type=int, default=20, help="masked positions per sequence")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    parser.add_argument("--remat", default="", help="our model.remat_policy (default: config's)")
    parser.add_argument(
        "--no_unrolled", action="store_true", help="skip ours with scan_layers=False"
    )
    parser.add_argument("--peak_size", type=int, default=2048, help="square matmul for the peak")
    parser.add_argument("--no_hf", action="store_true", help="skip both HF peers")
    parser.add_argument("--no_kerashub", action="store_true", help="skip the KerasHub peer")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attention", default="xla", help="ours' model.attention_impl")
    parser.add_argument("--profile", default="", help="trace steps of ours to this directory")
    parser.add_argument("--profile_steps", type=int, default=3)
    parser.add_argument(
        "--variant", type=parse_variant, action="append", default=[],
        help='ours_NAME: NAME={"scan": bool, "remat": str, "compiler_options": {...}}',
    )  # fmt: skip
    args = parser.parse_args()
    names = [name for name, _ in args.variant]
    if len(set(names)) < len(names) or "unrolled" in names:  # ours_NAME must be a new contender
        parser.error(f"--variant names must be unique and not 'unrolled': {names}")

    model_config = ModelConfig.preset(args.size)
    batch = make_batch(args.batch, args.seq, args.preds, model_config.vocab_size)
    step_flops = model_half.train_step_flops(model_config, args.batch, args.seq, args.preds)
    peaks = [flops.measure_matmul_peak(args.peak_size, 5, args.dtype)]
    torch_peak_before = None
    if not args.no_hf:
        torch_peak_before = torch_peer.matmul_peak(args.peak_size, 5, args.dtype)

    # ours: the default config (nn.scan over the layers: compile time independent of depth);
    # ours_unrolled: model.scan_layers=False, a Python loop over the layers (same math and
    # parameters; XLA:CPU schedules straight-line code better than a loop body).
    runs = {"ours": ours(args, batch, scan=True)}
    if not args.no_unrolled:
        runs["ours_unrolled"] = ours(args, batch, scan=False)
    for name, fields in args.variant:
        runs[f"ours_{name}"] = ours(
            args,
            batch,
            scan=fields.get("scan", True),
            remat=fields.get("remat", ""),
            compiler_options=fields.get("compiler_options"),
        )
    if not args.no_hf:
        for name, fn in (("hf_flax", hf_flax), ("hf_torch", hf_torch)):
            run = fn(args, batch)
            if run is not None:
                runs[name] = run
    if not args.no_kerashub:
        run = kerashub(args, batch)
        if run is not None:
            runs["kerashub"] = run
    times = time_interleaved({k: r["step"] for k, r in runs.items()}, args.warmup, args.steps)
    peaks.append(flops.measure_matmul_peak(args.peak_size, 5, args.dtype))
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    # A CPU's measured matmul rate; an accelerator's spec-sheet peak in the compute dtype.
    peak = max(peaks) if on_cpu else flops.device_peak_flops(device, args.dtype)
    torch_peaks = []
    if torch_peak_before is not None:  # torch is installed and the peers ran
        torch_peaks = [torch_peak_before, torch_peer.matmul_peak(args.peak_size, 5, args.dtype)]
    profile = None
    if args.profile:
        profile = profile_ours(runs["ours"]["step"], args.profile, args.profile_steps)

    result: dict[str, Any] = {
        "benchmark": "train_step",
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "dtype": args.dtype,
        "attention": args.attention,
        "size": args.size,
        "batch": args.batch,
        "seq": args.seq,
        "preds": args.preds,
        "cpu_cores": os.cpu_count(),
        "model_gflop_per_step": round(step_flops / 1e9, 2),
        "mfu_peak_gflops": round(peak / 1e9, 1),
        "mfu_peak_source": "measured matmul" if on_cpu else "spec sheet",
        "matmul_peak_gflops": round(max(peaks) / 1e9, 1),
        "matmul_peak_gflops_before_after": [round(p / 1e9, 1) for p in peaks],
    }
    if torch_peaks:
        result["torch_matmul_peak_gflops"] = round(max(torch_peaks) / 1e9, 1)
        result["torch_matmul_peak_gflops_before_after"] = [round(p / 1e9, 1) for p in torch_peaks]
    for name, run in runs.items():
        median = statistics.median(times[name])
        result[f"{name}_step_s"] = round(median, 4)
        result[f"{name}_seq_per_s"] = round(args.batch / median, 3)
        result[f"{name}_mfu"] = round(step_flops / median / peak, 3)
        if run["compile_s"]:
            result[f"{name}_compile_s"] = round(run["compile_s"], 1)
        if "params" in run:
            result[f"{name}_params"] = run["params"]
        for key in ("device", "attention"):
            if key in run:
                result[f"{name}_{key}"] = run[key]
    for name in ("ours", "ours_unrolled"):
        for peer in ("hf_flax", "hf_torch", "kerashub"):
            if name in runs and peer in runs:
                result[f"{name}_over_{peer}"] = round(paired_ratio(times[peer], times[name]), 3)
    for name, _ in args.variant:
        variant = f"ours_{name}"
        result[f"{variant}_over_ours"] = round(paired_ratio(times["ours"], times[variant]), 3)
    if profile is not None:
        result["ours_profile"] = profile
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
