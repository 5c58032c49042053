"""N fine-tuning seeds in one program (`config.num_seeds`) against N separate runs.

`python benchmarks/finetune_seeds.py --json [--size=tiny|base] [--steps=100] [--step_only]`
prints one JSON line. The same config (configs/finetune.py:task=sentiment_rt from scratch, the
`--size` preset, batch 32, max_seq_length 128, packed rows) run two ways:

- `seeds4_step_over_sequential`: N x the median step time of the one-seed program over the
  median step time of the N-seed program (the same steps' batches, interleaved one step each,
  after a first untimed pass over them has compiled every shape they use): throughput of the
  update alone.
- `seeds4_over_sequential`: wall time of N complete one-seed runs (`finetune_and_evaluate`:
  features, compilation, `--steps` updates, evaluation, checkpoint) over one N-seed run.

`--tokenizer` gives a sentencepiece model; by default one is trained on the training sentences.
`--task_dir` holds sentiment_rt's `train.jsonl.gz` and `dev.jsonl.gz` (default: ../shared's),
`--step_only` skips the complete runs (on a machine lent for minutes, the step is the figure),
`--end_to_end_only` the step timing (whose two programs compile every shape once more). Each
complete run's seconds also go to stderr as it ends, so a run cut off by a time limit still says
how long the finished ones took. `--isolate` runs each complete run in its own process,
`--runs=many,0,1` only those (the N-seed run, one-seed runs 0 and 1). On a machine lent for
commands of minutes the isolated runs take two: the second names the first's `runs_s` with
`--earlier_runs_s='{"many": 161.8, "0": 108.1, "1": 113.9}'` and runs only the others, for
the ratio.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from albert_jax.runtime import process_setup  # noqa: E402

process_setup.keep_freed_host_memory()  # as the entry points do, before any backend starts

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from absl import logging  # noqa: E402

from albert_jax.finetune import seeds  # noqa: E402
from albert_jax.finetune import train as finetune  # noqa: E402
from albert_jax.finetune.settings import validate_config  # noqa: E402
from albert_jax.finetune.train import fine_tuning  # noqa: E402
from albert_jax.run_config import mesh_layout  # noqa: E402
from albert_jax.sharding import (  # noqa: E402
    LOGICAL_AXIS_RULES,
    batch_sharding,
    put_batch,
)
from albert_jax.train_state import create_state, make_step  # noqa: E402
from configs import finetune as finetune_configs  # noqa: E402
from configs import pretrain  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared")
TASK_DIR = os.path.join(DATA, "data", "tasks", "sentiment_rt")


def make_config(args: argparse.Namespace, tokenizer: str, num_seeds: int, seed: int = 0) -> Any:
    c = finetune_configs.get_config("task=sentiment_rt,init=")
    c.size, c.seed, c.num_seeds = args.size, seed, num_seeds
    c.data.train_files = os.path.join(args.task_dir, "train.jsonl.gz")
    c.data.eval_files = os.path.join(args.task_dir, "dev.jsonl.gz")
    c.data.tokenizer, c.data.max_eval_examples = tokenizer, args.eval_examples
    c.max_seq_length, c.batch_size, c.num_train_steps = 128, 32, args.steps
    c.log_every_steps = max(args.steps, 1)
    c.pack_examples = True  # one layout for both programs, as in docs/benchmarks.md
    return c


class Program:
    """The loop's update step (train_state.create_state / make_step, jitted with shardings and
    the state donated) on a fine-tuning objective's batches."""

    def __init__(self, config: Any, workdir: str, mesh: Any):
        self.objective = fine_tuning(config, workdir, validate_config(config), mesh)
        model = self.objective.model
        n = model.num_seeds
        layout = create_state(model, mesh, int(config.seed), n)
        self.state = layout.initialize(model.initial_weights({}))
        self.sharding = batch_sharding(mesh)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        step = make_step(model.loss, layout.tx, microbatches=1, seed=0, num_seeds=n)
        self.step_fn = jax.jit(
            step,
            in_shardings=(layout.shardings, self.sharding),
            out_shardings=(layout.shardings, replicated),
            donate_argnums=0,
        )

    def step(self, s: int) -> None:
        data = self.objective.data
        batch = put_batch(data.next_batch(s), self.sharding, data.global_batch)
        self.state, metrics = self.step_fn(self.state, batch)
        jax.block_until_ready(metrics["loss"])


def step_times(args: argparse.Namespace, tokenizer: str, workdir: str) -> dict[str, Any]:
    """Median update-step seconds of the one-seed and the N-seed program, interleaved."""
    n = args.num_seeds
    mesh = mesh_layout(make_config(args, tokenizer, 1)).create()
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        one = Program(make_config(args, tokenizer, 1), workdir + "/one", mesh)
        many = Program(make_config(args, tokenizer, n), workdir + "/many", mesh)
        # Untimed first: every step the rounds time, so each shape they use is compiled
        # (packed rows vary in number from step to step) and the timed steps only run.
        for s in range(1, 4 + args.rounds):
            one.step(s)
            many.step(s)
        times: dict[str, list[float]] = {"one": [], "many": []}
        for s in range(4, 4 + args.rounds):
            for name, program in (("one", one), ("many", many)):
                start = time.perf_counter()
                program.step(s)
                times[name].append(time.perf_counter() - start)
    one_s, many_s = (statistics.median(times[k]) for k in ("one", "many"))
    return {
        "one_seed_step_s": round(one_s, 4),
        "seeds_step_s": round(many_s, 4),
        f"seeds{n}_step_over_sequential": round(n * one_s / many_s, 3),
    }


def complete_run(
    args: argparse.Namespace, tokenizer: str, workdir: str, n: int, seed: int
) -> float:
    """Wall seconds of one complete run (`finetune_and_evaluate`) of N seeds from `seed`: in this
    process, or with `--isolate` in a fresh one, as separate jobs run: each pays Python, JAX and
    device start-up and compiles with the process's caches empty (on an H100 the first of four
    one-seed runs in one process took 93 s, the other three 49-70 s)."""
    start = time.perf_counter()
    if args.isolate:
        argv = [f"--{k}={getattr(args, k)}" for k in ("size", "steps", "eval_examples", "task_dir")]
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv,
                        f"--tokenizer={tokenizer}", f"--complete_run={n},{seed},{workdir}"],
                       check=True)  # fmt: skip
    else:
        finetune.finetune_and_evaluate(make_config(args, tokenizer, n, seed), workdir)
    return time.perf_counter() - start


def end_to_end(args: argparse.Namespace, tokenizer: str, workdir: str) -> dict[str, Any]:
    """Wall seconds of one N-seed run ("many") and of N one-seed runs (seeds 0..N-1): the ones
    `--runs` names, joined to the `--earlier_runs_s` of an earlier command; the ratio once
    every run has its seconds."""
    n = args.num_seeds
    names = args.runs.split(",")  # checked by main: "many" and seeds 0..N-1 only
    seconds: dict[str, float] = dict(args.earlier_runs_s)
    for name in names:
        if name == "many":
            run = complete_run(args, tokenizer, workdir + "/run_many", n, 0)
        else:
            run = complete_run(args, tokenizer, workdir + f"/run_one_{name}", 1, int(name))
        seconds[name] = round(run, 1)
        print(f"run {name}: {run:.1f} s", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"isolated": args.isolate, "runs_s": seconds}
    if args.earlier_runs_s:  # their seconds are given, not measured here
        result["earlier_runs"] = sorted(args.earlier_runs_s)
    if len(seconds) == n + 1:  # every run: the ratio
        sequential = sum(seconds[str(i)] for i in range(n))
        result.update(seeds_run_s=seconds["many"], sequential_runs_s=round(sequential, 1))
        result[f"seeds{n}_over_sequential"] = round(sequential / seconds["many"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--size", default="tiny", choices=pretrain.SIZES)
    parser.add_argument("--num_seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="updates of each full run")
    parser.add_argument("--rounds", type=int, default=6, help="timed steps of each program")
    parser.add_argument("--eval_examples", type=int, default=256)
    parser.add_argument("--tokenizer", default="", help="sentencepiece model (default: train)")
    parser.add_argument("--task_dir", default=TASK_DIR, help="sentiment_rt's jsonl.gz files")
    parser.add_argument("--step_only", action="store_true", help="skip the complete runs")
    parser.add_argument("--end_to_end_only", action="store_true", help="skip the step timing")
    parser.add_argument("--isolate", action="store_true", help="each complete run in a process")
    parser.add_argument("--runs", default="", help="complete runs, e.g. many,0,1 (default all)")
    parser.add_argument(
        "--earlier_runs_s",
        type=json.loads,
        default={},
        help='runs_s of an earlier command (JSON), e.g. {"many": 161.8}',
    )
    parser.add_argument("--complete_run", default="", help=argparse.SUPPRESS)  # N,SEED,WORKDIR
    args = parser.parse_args()
    if args.step_only and (
        args.end_to_end_only or args.isolate or args.runs or args.earlier_runs_s
    ):
        parser.error(
            "--step_only times no complete run: drop --end_to_end_only/--isolate/--runs/"
            "--earlier_runs_s"
        )
    every_run = ["many", *map(str, range(args.num_seeds))]
    if args.runs and not set(args.runs.split(",")) <= set(every_run):
        parser.error(f"--runs={args.runs}: names from {','.join(every_run)}")
    earlier = args.earlier_runs_s
    if not (
        isinstance(earlier, dict)
        and set(earlier) <= set(every_run)
        and all(seeds.is_number(v) and v > 0 for v in earlier.values())
    ):
        parser.error(f"--earlier_runs_s: a JSON object of seconds named {','.join(every_run)}")
    args.runs = args.runs or ",".join(k for k in every_run if k not in earlier)
    if not args.runs:
        parser.error("--earlier_runs_s holds every run: nothing is left to time")
    if set(args.runs.split(",")) & set(earlier):
        parser.error(f"--runs={args.runs} repeats runs of --earlier_runs_s")
    logging.set_verbosity(logging.WARNING)
    if args.complete_run:  # one of --isolate's processes
        n, seed, workdir = args.complete_run.split(",", 2)
        finetune.finetune_and_evaluate(
            make_config(args, args.tokenizer, int(n), int(seed)), workdir
        )
        return
    n = args.num_seeds
    result: dict[str, Any] = {"benchmark": "finetune_seeds", "size": args.size, "num_seeds": n,
                              "steps": args.steps, "backend": jax.default_backend(),
                              "devices": len(jax.devices())}  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer = args.tokenizer
        if not tokenizer:
            from albert_jax.data.tokenizer import train_tokenizer

            with gzip.open(os.path.join(args.task_dir, "train.jsonl.gz"), "rt") as f:
                texts = [json.loads(line)["sentence"] for line in f if line.strip()]
            tokenizer = train_tokenizer(texts, workdir + "/spm", 8000, hard_vocab_limit=False)
        if not args.end_to_end_only:
            result.update(step_times(args, tokenizer, workdir))
        if not args.step_only:
            result.update(end_to_end(args, tokenizer, workdir))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
