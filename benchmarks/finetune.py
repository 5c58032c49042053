"""Fine-tuning throughput: our fine-tuning step (packed rows) vs HF PyTorch, dynamic padding.

`python benchmarks/finetune.py --json` prints one JSON line (`--size=tiny` for a quick check).
Examples/s of ours against transformers' `AlbertForSequenceClassification` (PyTorch), on the
same sentences (the sentiment_rt training set of the shared data, an SST-2 stand-in), the same
model (the `--size` preset, random init, vocabulary of a tokenizer trained on those sentences)
and the same hyperparameters (the paper's SST-2 preset: batch 32, ALBERT dropout 0, classifier
dropout 0.1, AdamW, clip 1.0, linear warmup / decay), at `max_seq_length` 512 and 128. Every
contender trains on the same rows in the same steps:

- ours: the real fine-tuning code path. `albert_jax.finetune.train.fine_tuning` built from
  `configs/finetune.py:task=sentiment_rt`, the state of `train_state.create_state`, and
  `train_state.make_step(objective.model.loss, ...)` jitted as `albert_jax/loop.py` jits it (in/out
  shardings, state donated, under `jax.set_mesh` and the logical axis rules); each step's
  batch comes from `objective.data.next_batch(step)`, placed by `sharding.put_batch`. `next_batch`
  packs the batch's examples into rows (`config.pack_examples`, tasks/packing.py: rows of a
  length bucket >= 128 tokens, attention within each example), so a step runs over about the
  real tokens. Every shape the steps use is compiled and run once before any is timed
  (`ours_compile_s_<L>`, by "rows x tokens"). `--buckets` adds `ours_buckets`: the same
  without packing, each batch cut to its length bucket (the shortest 32·2^k <= max_seq_length
  holding its longest row).
- hf: `AlbertForSequenceClassification` in train mode (classifier dropout 0.1) on the same rows,
  each cut to its real tokens and collated by `transformers.DataCollatorWithPadding` (HF's
  default dynamic padding: every batch padded to its own longest row), `torch.optim.AdamW` with
  the preset's lr / betas / eps / weight decay and no decay on biases and LayerNorm weights,
  clip 1.0 and `get_linear_schedule_with_warmup`: what HF's `Trainer` does per step.
  Torch runs one model per thread count of `--hf_threads` (default 1 and the CPU count; its
  own default is `torch_default_threads`), and the faster one in each round is the peer: on a
  shared CPU torch's OpenMP threads can lose more to waiting on each other than they gain.

A timed step is what a training loop does per step: the batch of step s (ours: `next_batch`
+ `put_batch`; HF: collation into tensors) and one update, until the loss is on the host.
After `--warmup` untimed rounds (three; with HF in its own process 1, 3 and 6 gave the same
ratio within noise: 1.58, 1.57, 1.51 at 512 on the 2-core Xeon), the contenders take turns, one
step each, for `--rounds` rounds (round r = step warmup + r for all). `ours_over_hf_<L>` is the
median over rounds of (HF's step time / ours), i.e. an examples/s ratio paired within a round,
which cancels the drift of a shared machine; `*_step_s_<L>` are medians. Ours' process keeps
the memory XLA frees after a step for the next, as `albert_jax.main` does for a fine-tuning run
on a CPU-only host (`process_setup.keep_freed_host_memory`, `host_memory_kept`); HF's
contenders run in a process of their own (`TorchProcess`) under glibc's defaults, as HF's
Trainer does.
`--same_length` adds `hf_same_length`: HF on the same rows padded to the length bucket, whose
ratio against `ours_buckets` (`ours_buckets_over_hf_same_length_<L>`) is the per-token speed
alone. Mixed precision:
`--override=model.dtype=bfloat16` runs ours in bf16 (fp32 parameters and optimizer), and
`--hf_bf16` adds HF as Trainer's `bf16=True` runs it on a CPU (the forward pass under
`torch.autocast("cpu", torch.bfloat16)`), `ours_over_hf_bf16_<L>` the ratio against it.

Keys per length L: `ours_over_hf_L` (against the faster torch thread count, round by round),
`ours_over_hf_default_threads_L` (against torch at its default thread count),
`{ours,hf,hf_<n>t}_step_s_L` and `_examples_per_s_L`, the tokens a row costs each side
per example (`ours_tokens_per_row_L`: packed rows x tokens / batch; `hf_tokens_per_row_L`:
the batch's longest row; `buckets_tokens_per_row_L`: the length bucket) and the real ones
(`real_tokens_per_row_L`), `buckets_L`, `ours_compile_s_L` per shape and, with `--buckets`,
`ours_buckets_over_hf_L`.

N seeds in one program against N runs (`seeds4_over_sequential`): benchmarks/finetune_seeds.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

from albert_jax.finetune.settings import validate_config  # noqa: E402
from albert_jax.finetune.train import fine_tuning  # noqa: E402
from albert_jax.run_config import mesh_layout  # noqa: E402
from albert_jax.runtime import process_setup  # noqa: E402
from albert_jax.sharding import LOGICAL_AXIS_RULES, batch_sharding, put_batch  # noqa: E402
from albert_jax.tasks.batching import train_batch, trim_to_bucket  # noqa: E402
from albert_jax.train_state import create_state, make_step  # noqa: E402
from benchmarks.finetune_torch_peer import TorchProcess  # noqa: E402
from benchmarks.train_step import paired_ratio, time_interleaved  # noqa: E402
from configs import finetune as finetune_configs  # noqa: E402
from configs import pretrain  # noqa: E402

TASK = "sentiment_rt"
PRESET = "sst2"  # the paper's SST-2 hyperparameters (lr, batch, steps, warmup, dropout)
DATA = os.path.join(os.path.dirname(REPO), "shared", "data")


def train_sentences(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["sentence"] for line in f if line.strip()]


def make_tokenizer(args: argparse.Namespace, workdir: str) -> str:
    """The sentencepiece model: `--tokenizer`, or one trained on the training sentences."""
    if args.tokenizer:
        return args.tokenizer
    from albert_jax.data.tokenizer import train_tokenizer

    texts = train_sentences(os.path.join(args.data, "tasks", TASK, "train.jsonl.gz"))
    return train_tokenizer(
        texts, os.path.join(workdir, "spm"), args.vocab_size, hard_vocab_limit=False
    )


def set_dotted(config: Any, assignment: str) -> None:
    """`--override` entries: "model.scan_layers=False" sets config.model.scan_layers."""
    key, value = assignment.split("=", 1)
    *parents, name = key.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    old = node[name]
    node[name] = value.lower() in ("1", "true") if isinstance(old, bool) else type(old)(value)


def make_config(args: argparse.Namespace, tokenizer: str, max_seq_length: int) -> Any:
    """The fine-tuning config of ours: sentiment_rt data, the SST-2 preset, `--size`."""
    config = finetune_configs.get_config(f"task={TASK},init=")
    preset = finetune_configs.get_config(f"task={PRESET},init=")
    for field in ("learning_rate", "num_train_steps", "warmup_steps"):
        config[field] = preset[field]
    config.model.hidden_dropout_prob = preset.model.hidden_dropout_prob
    config.model.attention_probs_dropout_prob = preset.model.attention_probs_dropout_prob
    config.classifier_dropout = preset.classifier_dropout
    config.size = args.size
    config.data.train_files = os.path.join(args.data, "tasks", TASK, "train.jsonl.gz")
    config.data.eval_files = os.path.join(args.data, "tasks", TASK, "dev.jsonl.gz")
    config.data.tokenizer = tokenizer
    config.max_seq_length = max_seq_length
    config.batch_size = args.batch
    config.pack_examples = True  # ours is the packed step (and `--buckets` the unpacked one)
    if pretrain.get_config(f"size={args.size}").model.get("max_position_embeddings", 512) < (
        max_seq_length
    ):  # tiny: 128 positions
        config.model.max_position_embeddings = max_seq_length
    for assignment in filter(None, args.override.split(",")):
        set_dotted(config, assignment)
    return config


class Ours:
    """The fine-tuning step of `loop.Loop` on one fine-tuning objective, batches from its data
    half's `next_batch`; `compile(steps)` compiles every batch shape those steps use. Must be
    built under `jax.set_mesh(mesh)` and the logical axis rules, as the loop does."""

    def __init__(self, config: Any, workdir: str, mesh: Any):
        spec = validate_config(config)
        self.objective = objective = fine_tuning(config, workdir, spec, mesh)
        model = objective.model
        layout = create_state(model, mesh, int(config.seed), model.num_seeds)
        self.state = layout.initialize(model.initial_weights({}))  # init="": all fresh
        self.sharding = batch_sharding(mesh)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.jitted = jax.jit(
            make_step(
                model.loss,
                layout.tx,
                microbatches=model.microbatches,
                seed=int(config.seed),
                num_seeds=model.num_seeds,
            ),
            in_shardings=(layout.shardings, self.sharding),
            out_shardings=(layout.shardings, replicated),
            donate_argnums=0,
        )
        self.compiled: dict[str, Any] = {}  # by batch shape "rows x tokens"
        self.compile_s: dict[str, float] = {}

    def batch(self, step: int) -> dict[str, jax.Array]:
        host = self.objective.data.next_batch(step)
        return put_batch(host, self.sharding, self.objective.data.global_batch)

    def compile(self, steps: list[int]) -> None:
        """Compiles each batch shape of `steps` and runs it once on a copy of the state: an
        executable's first run pays one-time costs (XLA:CPU's set-up and first-touch memory,
        0.5-1.2 s for base on the 2-core Xeon, ~25-45% of a step), which a run of hundreds
        of steps pays once per shape and a timed step should not include."""
        for step in steps:
            batch = self.batch(step)
            shape = "x".join(map(str, batch["input_ids"].shape))  # rows x tokens
            if shape not in self.compiled:
                start = time.perf_counter()
                self.compiled[shape] = self.jitted.lower(self.state, batch).compile()
                self.compile_s[shape] = time.perf_counter() - start
                scratch = jax.tree.map(jnp.copy, self.state)  # donated to the first run
                jax.block_until_ready(self.compiled[shape](scratch, batch))

    def step(self, step: int) -> float:
        batch = self.batch(step)
        shape = "x".join(map(str, batch["input_ids"].shape))
        self.state, metrics = self.compiled[shape](self.state, batch)
        return float(metrics["loss"])  # waits for the step


def unpadded_rows(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """A host batch of ours → HF features: each row cut to its real tokens."""
    lengths = batch["input_mask"].sum(axis=1)
    return [
        {
            "input_ids": batch["input_ids"][i, :n].tolist(),
            "token_type_ids": batch["segment_ids"][i, :n].tolist(),
            "attention_mask": batch["input_mask"][i, :n].tolist(),
            "label": int(batch["label"][i]),
        }
        for i, n in enumerate(lengths)
    ]


def in_turn(run: Callable[[int], Any], steps: list[int]) -> Callable[[], Any]:
    """`run` as a `time_interleaved` step: its i-th call runs training step `steps[i]`, so
    round r of every contender is the same batch."""
    order = iter(steps)
    return lambda: run(next(order))


def measure_length(
    args: argparse.Namespace,
    tokenizer: str,
    length: int,
    workdir: str,
    torch_process: TorchProcess,
) -> dict[str, Any]:
    """Every contender at max_seq_length `length` (HF's in `torch_process`); the result keys
    end in `_<length>`."""
    warmup_steps = list(range(1, args.warmup + 1))
    timed_steps = list(range(args.warmup + 1, args.warmup + args.rounds + 1))
    config = make_config(args, tokenizer, length)
    mesh = mesh_layout(config).create()  # every device of the process
    steps = warmup_steps + timed_steps
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        ours = Ours(config, workdir, mesh)  # packed rows (config.pack_examples)
        ours.compile(steps)
        contenders: dict[str, Callable[[int], Any]] = {"ours": ours.step}
        if args.buckets:
            unpacked = config.copy_and_resolve_references()
            unpacked.pack_examples = False
            ours_buckets = Ours(unpacked, f"{workdir}/buckets", mesh)
            ours_buckets.compile(steps)
            contenders["ours_buckets"] = ours_buckets.step
        objective = ours.objective
        # HF's rows: the examples of ours' steps, each cut to its real tokens.
        arrays = objective.data.task_data.train_arrays
        batches = {s: train_batch(arrays, s - 1, args.batch, config.seed) for s in steps}
        rows = {s: unpadded_rows(b) for s, b in batches.items()}
        bucket = {s: trim_to_bucket(b, ("input_mask",))[1] for s, b in batches.items()}
        ours_tokens = {s: ours.batch(s)["input_ids"].size / args.batch for s in steps}
        hf_args = {"config": config, "model_config": objective.model.model_config,
                   "tokenizer": tokenizer, "labels": objective.data.spec.num_labels}  # fmt: skip
        for threads in args.hf_threads:
            hf = torch_process.build(f"hf_{threads}t", **hf_args, threads=threads)
            contenders[f"hf_{threads}t"] = lambda s, hf=hf: hf(rows[s])
            if args.hf_bf16:
                hf_bf16 = torch_process.build(
                    f"hf_bf16_{threads}t", **hf_args, threads=threads, bf16=True
                )
                contenders[f"hf_bf16_{threads}t"] = lambda s, hf=hf_bf16: hf(rows[s])
            if args.same_length:
                contenders[f"hf_same_length_{threads}t"] = lambda s, hf=hf: hf(rows[s], bucket[s])
        turns = {name: in_turn(run, steps) for name, run in contenders.items()}
        times = time_interleaved(turns, args.warmup, args.rounds)

    def fastest(kind: str) -> list[float]:  # per round, the faster torch thread count
        runs = [times[f"{kind}_{n}t"] for n in args.hf_threads]
        return [min(r) for r in zip(*runs, strict=True)]

    times["hf"] = fastest("hf")
    if args.hf_bf16:
        times["hf_bf16"] = fastest("hf_bf16")
    if args.same_length:
        times["hf_same_length"] = fastest("hf_same_length")
    result: dict[str, Any] = {
        f"real_tokens_per_row_{length}": round(
            float(np.mean([batches[s]["input_mask"].sum(1).mean() for s in timed_steps])), 2
        ),
        f"ours_tokens_per_row_{length}": float(np.mean([ours_tokens[s] for s in timed_steps])),
        f"buckets_tokens_per_row_{length}": float(np.mean([bucket[s] for s in timed_steps])),
        f"hf_tokens_per_row_{length}": float(
            np.mean([max(len(r["input_ids"]) for r in rows[s]) for s in timed_steps])
        ),
        f"buckets_{length}": sorted({int(bucket[s]) for s in timed_steps}),
        f"ours_compile_s_{length}": {k: round(v, 1) for k, v in ours.compile_s.items()},
    }
    if args.buckets:
        result[f"ours_buckets_over_hf_{length}"] = round(
            paired_ratio(times["hf"], times["ours_buckets"]), 3
        )
    for name, seconds in times.items():
        result[f"{name}_step_s_{length}"] = round(statistics.median(seconds), 3)
        if not name.startswith("hf_same_length"):
            result[f"{name}_examples_per_s_{length}"] = round(
                args.batch / statistics.median(seconds), 2
            )
    result[f"ours_over_hf_{length}"] = round(paired_ratio(times["hf"], times["ours"]), 3)
    if args.hf_bf16:
        result[f"ours_over_hf_bf16_{length}"] = round(
            paired_ratio(times["hf_bf16"], times["ours"]), 3
        )
    default = f"hf_{args.torch_default_threads}t"
    if default in times:
        result[f"ours_over_hf_default_threads_{length}"] = round(
            paired_ratio(times[default], times["ours"]), 3
        )
    if args.same_length and args.buckets:  # the same tokens each side: per-token speed
        result[f"ours_buckets_over_hf_same_length_{length}"] = round(
            paired_ratio(times["hf_same_length"], times["ours_buckets"]), 3
        )
    return result


def main() -> None:
    # Ours' process as `albert_jax.main` sets it up, before a backend starts; HF's contenders
    # run in a process of their own (TorchProcess) under glibc's defaults, as HF's Trainer does.
    host_memory_kept = process_setup.keep_freed_host_memory()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--size", default="base", choices=pretrain.SIZES)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lengths", default="512,128", help="max_seq_length values")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (0: 3, tiny 10)")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed rounds (one step per contender each)"
    )
    parser.add_argument(
        "--hf_threads", default="", help="torch thread counts to run (default: 1,CPU count)"
    )
    parser.add_argument(
        "--same_length", action="store_true", help="add HF padded to the length bucket"
    )
    parser.add_argument(
        "--buckets", action="store_true", help="add ours on length buckets (no packing)"
    )
    parser.add_argument(
        "--hf_bf16", action="store_true", help="add HF under torch.autocast(bfloat16)"
    )
    parser.add_argument("--override", default="", help="k=v,... on our config (e.g. dtype)")
    parser.add_argument("--data", default=DATA, help="the shared data directory")
    parser.add_argument("--tokenizer", default="", help="sentencepiece model (default: train)")
    parser.add_argument("--vocab_size", type=int, default=30000, help="of the trained tokenizer")
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    import torch

    cores = os.cpu_count() or 1
    args.rounds = args.rounds or (10 if args.size == "tiny" else 3)
    args.torch_default_threads = torch.get_num_threads()
    threads = args.hf_threads or ",".join(str(n) for n in sorted({1, cores}))
    args.hf_threads = [int(n) for n in threads.split(",")]

    start = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "finetune",
        "task": TASK,
        "preset": PRESET,
        "size": args.size,
        "batch": args.batch,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "cpu_cores": cores,
        "torch_default_threads": args.torch_default_threads,
        "hf_threads": args.hf_threads,
        "load_average_start": round(os.getloadavg()[0], 2),
        "host_memory_kept": host_memory_kept,
    }
    if args.override:
        result["override"] = args.override
    torch_process = TorchProcess()
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer = make_tokenizer(args, workdir)
        from albert_jax.data.tokenizer import Tokenizer

        result["vocab_size"] = Tokenizer(tokenizer).vocab_size
        for length in (int(x) for x in args.lengths.split(",")):
            measured = measure_length(args, tokenizer, length, f"{workdir}/{length}", torch_process)
            print(json.dumps(measured), file=sys.stderr, flush=True)  # each length as it ends
            result.update(measured)
    torch_process.close()
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    result["total_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
