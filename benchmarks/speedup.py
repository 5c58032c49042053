"""The paper's Table 2 speed-up column on this hardware: BERT and ALBERT training throughput
relative to BERT-large.

`python benchmarks/speedup.py --json` prints one JSON line (the table goes to stderr).
Every model runs the pretraining step of `train_and_evaluate` (`albert_jax.pretrain.train`: forward,
backward of MLM on `--preds` masked positions + SOP, global-norm clip, LAMB over all
parameters; the default config: `nn.scan` over the layers, `remat_policy="dots"`, no dropout)
on one device, at `--batch` sequences of `--seq_len` tokens, on the same synthetic batch:

- bert-base / bert-large: BERT's shapes (`albert_jax.model.flops.REFERENCE_SHAPES`: E = H,
  V = 30522, no E→H projection), every layer its own weights (`sharing="none"`);
- albert-base / large / xlarge / xxlarge: the official ALBERT shapes (E = 128, V = 30000), all
  layers sharing one weight set (`sharing="all"`).

All models are compiled first (compile time reported apart) and run `--warmup` untimed
steps; then come `--rounds` rounds in which every model in turn gets a freshly initialized
state and runs one timed step, so the drift of a shared machine falls on all of them alike and
only one model's state (BERT-large's: 5.4 GB) is in memory at a time. `seq_per_s` = batch /
median step time; `speedup_vs_bert_large` = the median over rounds of (BERT-large's step time /
the model's step time in the same round), a paired ratio that a slow round cannot skew the way
it skews two independent medians. `flop_speedup` = BERT-large's model FLOPs per step / the
model's (`albert_jax.model.flops`): what a machine whose step time is its FLOPs would show.

The paper (arXiv 1909.11942 v6, Table 2) measured TPU v3 pods at batch 4096 and seq 512, where
the gradient all-reduce grows with the parameter count and sharing shrinks it. One device has
no all-reduce; what grows with the parameter count there is LAMB's memory-bound pass over the
parameters, gradients and moments, a fixed cost per step that a small batch makes large.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from albert_jax.model import flops
from albert_jax.model.albert import AlbertForPreTraining  # noqa: E402
from albert_jax.model.config import model_config_from  # noqa: E402
from albert_jax.pretrain import model_half  # noqa: E402
from albert_jax.sharding import LOGICAL_AXIS_RULES, create_mesh  # noqa: E402
from benchmarks.train_step import make_batch, paired_ratio  # noqa: E402
from configs import pretrain  # noqa: E402

REFERENCE = "bert-large"
# Paper Table 2 (arXiv 1909.11942 v6), "Speedup" column: pretraining throughput relative to
# BERT-large on Cloud TPU v3, batch 4096, seq 512 (../shared/reference/PERF_ANCHORS.md §1,
# which has ALBERT-large 1.7 and xxlarge 0.3 from cited sources and the other three from memory).
PAPER_SPEEDUP = {
    "bert-base": 4.7,
    "bert-large": 1.0,
    "albert-base": 5.6,
    "albert-large": 1.7,
    "albert-xlarge": 0.6,
    "albert-xxlarge": 0.3,
}
MODELS = tuple(PAPER_SPEEDUP)
# Cross-layer sharing of each family: BERT has none, ALBERT shares everything (paper Table 2).
SHARING = {"bert": "none", "albert": "all"}
SHAPE_FIELDS = (
    "vocab_size",
    "embedding_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "inner_group_num",
)


def run_config(name: str, args: argparse.Namespace) -> Any:
    """The pretraining config (configs/pretrain.py, LAMB) of model `name` at the batch shape."""
    family, size = name.split("-")
    config = pretrain.get_config(f"size={size},sharing={SHARING[family]}")
    shape = flops.REFERENCE_SHAPES[name]
    for field in SHAPE_FIELDS:
        config.model[field] = getattr(shape, field)
    config.model.dtype = args.dtype
    config.batch_size = args.batch
    config.seq_len = args.seq_len
    config.max_predictions_per_seq = args.preds
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    return config


class ModelRun:
    """The AOT-compiled pretraining step of model `name` on one device, and its state.

    The state (params, LAMB moments) exists only between `load()` and `unload()`: with every
    model's state resident at once (BERT-large's alone is 5.4 GB in float32) a run needs
    ~14 GB of host memory."""

    def __init__(self, name: str, args: argparse.Namespace, batch: dict[str, Any]):
        config = run_config(name, args)
        model_config = model_config_from(config)
        model = AlbertForPreTraining(model_config)
        device = jax.devices()[0]
        self.mesh = create_mesh((1, 1, 1), [device])
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
            tx, abstract, shardings, self._initialize = model_half.create_train_state(
                config, model, self.mesh
            )
            step_fn = jax.jit(
                model_half.make_train_step(config, model, tx),
                in_shardings=(shardings, None),
                out_shardings=(shardings, None),
                donate_argnums=(0,),
            )
            self.batch = jax.device_put(batch, device)
            start = time.perf_counter()
            self._compiled = step_fn.lower(abstract, self.batch).compile()
            self.compile_s = time.perf_counter() - start
        self.params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
        self.step_flops = model_half.train_step_flops(
            model_config, args.batch, args.seq_len, args.preds
        )
        self._state: Any = None

    def load(self) -> None:
        """A freshly initialized state (untimed)."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
            self._state = jax.block_until_ready(self._initialize())

    def step(self) -> float:
        """Seconds of one update of the loaded state (donated), until its loss is ready."""
        start = time.perf_counter()
        self._state, metrics = self._compiled(self._state, self.batch)
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - start

    def unload(self) -> None:
        self._state = None


def time_rounds(runs: dict[str, ModelRun], warmup: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of each model's timed steps, [rounds] per model.

    First each model runs `warmup` untimed steps (an executable's first run is slower). Then in
    every round each model in turn is loaded, timed for one step and unloaded: the models take
    turns (as `time_interleaved` in benchmarks/train_step.py), so a shared machine's drift
    falls on all alike, and only one model's state is in memory at a time. A step right after
    `load()` takes as long as a later one: the state's buffers are written by the
    initialization and donated to the step."""
    for run in runs.values():
        run.load()
        for _ in range(warmup):
            run.step()
        run.unload()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run.load()
            times[name].append(run.step())
            run.unload()
    return times


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table, the paper's column beside ours."""
    lines = [
        "| model | params | compile (s) | step (s) | seq/s | speed-up | FLOP ratio | paper |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['model']} | {row['params'] / 1e6:.0f}M | {row['compile_s']:.1f} "
            f"| {row['step_s']:.2f} | {row['seq_per_s']:.3f} "
            f"| **{row['speedup_vs_bert_large']:.2f}×** | {row['flop_speedup']:.2f}× "
            f"| {row['paper_speedup']}× |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--preds", type=int, default=20, help="masked positions per sequence")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in PAPER_SPEEDUP]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {MODELS}")
    if REFERENCE not in args.models:
        parser.error(f"--models must include {REFERENCE}, the reference of every speed-up")
    for flag in ("seq_len", "batch", "preds", "rounds"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.preds > args.seq_len - 2:
        parser.error(f"--preds ({args.preds}) must be <= --seq_len - 2 (no [CLS], last token)")
    return args


def main() -> None:
    args = parse_args()
    load_start = os.getloadavg()[0]
    # One batch for all: token ids below the smaller vocabulary (ALBERT's 30000).
    vocab = min(flops.REFERENCE_SHAPES[m].vocab_size for m in args.models)
    batch = make_batch(args.batch, args.seq_len, args.preds, vocab)
    runs = {}
    for name in args.models:
        runs[name] = ModelRun(name, args, batch)
        print(f"compiled {name}: {runs[name].compile_s:.1f} s", file=sys.stderr, flush=True)
    times = time_rounds(runs, args.warmup, args.rounds)

    reference = times[REFERENCE]
    rows = []
    for name, run in runs.items():
        median = statistics.median(times[name])
        paired = paired_ratio(reference, times[name])
        rows.append(
            dict(
                model=name,
                seq_per_s=round(args.batch / median, 4),
                speedup_vs_bert_large=round(paired, 3),
                paper_speedup=PAPER_SPEEDUP[name],
                flop_speedup=round(runs[REFERENCE].step_flops / run.step_flops, 3),
                step_s=round(median, 3),
                step_s_per_round=[round(t, 3) for t in times[name]],
                compile_s=round(run.compile_s, 1),
                params=run.params,
                gflop_per_step=round(run.step_flops / 1e9, 1),
            )
        )
    result = {
        "benchmark": "speedup",
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": 1,  # every model on one device: no gradient all-reduce
        "cpu_cores": os.cpu_count(),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "preds": args.preds,
        "dtype": args.dtype,
        "optimizer": "lamb",
        "warmup": args.warmup,
        "rounds": args.rounds,
        "speedup_method": "median over rounds of bert-large step time / model step time",
        "paper_setting": "Cloud TPU v3, batch 4096, seq 512 (arXiv 1909.11942 v6, Table 2)",
        "load_average_start": round(load_start, 2),
        "load_average_end": round(os.getloadavg()[0], 2),
        # ru_maxrss is KiB on Linux: every model's state stays resident for the interleaving.
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
        "rows": rows,
    }
    if args.json:
        print(table(result), file=sys.stderr, flush=True)
        print(json.dumps(result), flush=True)
    else:
        print(table(result))
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
