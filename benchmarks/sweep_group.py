"""Points of one shape as one program against the same points run one after the other.

`python benchmarks/sweep_group.py --json [--steps=500] [--rounds=1]` prints one JSON line. The
sweep `python -m albert_jax.sweep --config=configs/pretrain.py:size=tiny
--sweep.learning_rate=0.005,0.01,0.02,0.04` (the tiny demo pretraining on the shipped corpus,
`--steps` updates each, its evaluation and checkpoints), run two ways in fresh processes and
fresh roots, taking turns `--rounds` times:

- grouped (`--sweep.group=auto`): the four points as one program;
- sequential (`--sweep.group=none`): four runs in a row in one process.

Figures: `group4_over_sequential`, the sequential command's wall time over the grouped one's
(median of the rounds; end to end: start-up, data, compilation, training, evaluation, the
points' checkpoints), and `group4_step_throughput`, four times the grouped run's examples/s
over the median of the sequential runs' (the logged steady-state rates: the update alone).
A first untimed sweep of one step builds the demo data and trains the tokenizer that every
timed run then reads (`--config.data.tokenizer`), so no side pays for them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNING_RATES = "0.005,0.01,0.02,0.04"


def sweep(root: str, group: str, steps: int, tokenizer: str | None, rates: str = LEARNING_RATES
          ) -> float:  # fmt: skip
    """Wall seconds of one `python -m albert_jax.sweep` of the learning rates."""
    argv = [sys.executable, "-m", "albert_jax.sweep", "--config=configs/pretrain.py:size=tiny",
            f"--root={root}", f"--sweep.learning_rate={rates}", f"--sweep.group={group}",
            f"--config.num_train_steps={steps}", f"--config.eval_every_steps={steps}",
            f"--config.checkpoint_every_steps={steps}",
            f"--config.warmup_steps={min(50, steps - 1)}"]  # fmt: skip
    if tokenizer:
        argv.append(f"--config.data.tokenizer={tokenizer}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def rates(root: str) -> list[float]:
    """Each point's median logged examples/s (sweep.json)."""
    with open(os.path.join(root, "sweep.json")) as f:
        return [p["examples_per_sec"] for p in json.load(f)["points"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--steps", type=int, default=500, help="updates of each point")
    parser.add_argument("--rounds", type=int, default=1, help="grouped / sequential pairs")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="sweep_group_bench_")
    sweep(os.path.join(work, "warmup"), "none", 1, None, rates="0.005")
    tokenizer = os.path.join(work, "warmup", "learning_rate=0.005", "tokenizer.model")
    walls: dict[str, list[float]] = {"auto": [], "none": []}
    step_ratios = []
    for r in range(args.rounds):
        roots = {}
        for group in ("auto", "none"):
            roots[group] = os.path.join(work, f"{group}_{r}")
            walls[group].append(sweep(roots[group], group, args.steps, tokenizer))
            print(f"round {r} {group}: {walls[group][-1]:.1f} s", file=sys.stderr, flush=True)
        grouped, sequential = rates(roots["auto"]), rates(roots["none"])
        step_ratios.append(
            len(grouped) * statistics.median(grouped) / statistics.median(sequential)
        )
    auto, none = statistics.median(walls["auto"]), statistics.median(walls["none"])
    result = {
        "benchmark": "sweep_group",
        "points": len(LEARNING_RATES.split(",")),
        "steps": args.steps,
        "grouped_s": round(auto, 1),
        "sequential_s": round(none, 1),
        "group4_over_sequential": round(none / auto, 3),
        "group4_step_throughput": round(statistics.median(step_ratios), 3),
        "rounds": args.rounds,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
