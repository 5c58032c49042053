"""Inference throughput: a fine-tuned ALBERT-base classifier, ours vs HF PyTorch, onnxruntime
and BERT-base, sentences/s on real sentences at batch 32 and batch 1.

`python benchmarks/inference.py --json` prints one JSON line. The sentences are the
sentiment_rt dev file's (shared data), in file order, of mixed length: `--sentences` of them
per batch size (256 at batch 32, 64 at batch 1), cut into the same batches for every system.
Every system's time is the whole way from the raw sentences to labels: tokenization of the
batch's raw text, the forward pass, softmax and argmax (ours does all of it inside
`predict`).

- ours: `albert_jax.export.in_process(WORKDIR).predict(records, batch_size=B)`, the jitted task
  model behind `albert_jax.serving.Served`: sentencepiece tokenization, rows sorted by length,
  the batch cut to its longest row rounded up to `serving.LENGTH_STEP` (16) tokens, a short
  batch padded to a power of two.
  Every shape is compiled in the untimed warm-up pass (compile time excluded; the first pass's
  time is `ours_first_pass_s_b<B>`). XLA:CPU runs on all cores (its default).
- ours_artifact: the StableHLO artifact (`export.export_artifact(WORKDIR, DIR,
  platforms=("cpu",))`) loaded by `albert_jax.serving.load(DIR)`: the same model without the
  model code.
- hf: the `convert --to=hf` export as transformers' `AutoModelForSequenceClassification`
  (`attn_implementation="sdpa"`, float32) under `torch.inference_mode()`, fed by the export's
  fast tokenizer with `padding=True` (each batch padded to its longest sentence), torch at
  `--threads` threads (default: the CPU count).
- onnxruntime: the same export's `model.onnx` (`convert --to=onnx`, `albert_jax.interop.
  onnx_export`), CPU provider, `ORT_ENABLE_ALL` graph optimizations, `--threads` intra-op
  threads, fed by the same tokenizer.
- bert: transformers' `BertForSequenceClassification` of the bert-base configuration (hidden
  768, 12 layers, 12 heads, FFN 3072, vocabulary 30522), random init, run as hf is, on the same
  sentences tokenized by the ALBERT tokenizer (ids clipped to BERT's vocabulary): the same
  hidden size without ALBERT's factorized embedding and shared layers. `albert_over_bert_b<B>`
  (hf against bert, both torch) is what parameter sharing does to inference speed; the
  `*_params` keys what it does to the model's size. The activations differ (`*_activation`):
  ALBERT's `gelu_new` (tanh approximation) is a chain of elementwise torch ops in HF, BERT's
  `gelu` one kernel; at batch 32 × 58 tokens that chain was ~0.65 s of HF ALBERT's 2.6 s, and
  with the same activation HF ALBERT and BERT ran within 3% of each other (2-core Xeon).

The classifier is built in `--workdir` by a real fine-tuning run (`configs/finetune.py:
task=sentiment_rt`, ALBERT-base from scratch, a sentencepiece model trained on the task's
training sentences, 2 steps of 8 sentences at max_seq_length 128), then exported; a workdir
that already holds the run is reused (the exports are written again each time, by the code
measured). Its weights are barely trained: their values do not change
the work of a forward pass, so they do not change the speed.

The tokenizer is trained with `hard_vocab_limit=False`: the task's ~8.5k training sentences
hold fewer than `--vocab_size` pieces (`vocab_size` says how many; ~11k), which shrinks the
embedding table (`ours_params`) but not the work per token (one row gathered per token).

Each system runs in a process of its own (ours and ours_artifact in this one; hf, onnxruntime
and bert each in a spawned one, which times its own work: the pipe is not timed). After
`--warmup` untimed passes over the sentences, `--rounds` timed rounds follow; in a round the
systems take turns batch by batch (batch i of every system, then batch i + 1), so the drift of
a shared machine falls on all alike. Each call comes `--pause` seconds (untimed) after the one
before: onnxruntime's intra-op threads spin for ~35 ms after a run (the CPU time they burn
while idle, measured on the 2-core Xeon; XLA's and torch's threads sleep), which took that
CPU from whichever system ran next (at batch 1 it made the next system's ~70 ms calls up to
~1.5x slower). `<system>_sentences_per_s_b<B>`: the sentences over the median of the rounds'
total times; `X_over_Y_b<B>`: the median over rounds of Y's round time / X's (a sentences/s
ratio paired by round). `*_tokens_per_row_b<B>`: the mean padded width of a batch row each way
(ours: `serving.cut_length`; HF: the batch's longest), against `real_tokens_per_row_b<B>`.
`targets` are issue #68's, `targets_met` whether this run met them. `labels_agree_b<B>`: the
share of sentences whose label each system gives as ours does.

`--breakdown` adds the models alone (no tokenization, no softmax) on the same padded token ids,
at ours' width ("cut") and at HF's ("longest", each batch's longest row), interleaved as above:
`forward_<system>_<width>_s_b<B>` (median round seconds), `ours_over_<system>_forward_<width>
_b<B>` (paired ratios: the speed per token of the compiled model against torch's and
onnxruntime's, apart from padding), and `ours_tokenize_s_b<B>`, ours' tokenization alone.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("USE_TF", "0")  # transformers: torch classes only
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
from inference_systems import (  # noqa: E402
    OURS_INPUTS,
    OursSystem,
    Spawned,
    timed,
)

TASK = "sentiment_rt"
DATA = os.path.join(os.path.dirname(REPO), "shared", "data")
MAX_SEQ_LENGTH = 128
#: Issue #68's targets on the 2-core CPU: ours' sentences/s over each peer's.
TARGETS = {"ours_over_hf_b32": 1.3, "ours_over_onnxruntime_b32": 1.0, "ours_over_hf_b1": 1.0}


def paired_ratio(theirs: list[float], ours: list[float]) -> float:
    """The median over rounds of their time / ours in the same round (benchmarks/train_step)."""
    return statistics.median(t / o for t, o in zip(theirs, ours, strict=True))


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_sentences(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["sentence"] for line in f if line.strip()]


# ------------------------------------------------------------------------------ the model
def _build_run(data: str, vocab_size: int, workdir: str) -> None:
    """The fine-tuned ALBERT-base classifier in WORKDIR/finetune (a spawned process: the
    training program and its memory do not stay in the timed process)."""
    from albert_jax.data.tokenizer import train_tokenizer
    from albert_jax.finetune import train as finetune
    from configs import finetune as finetune_configs

    task_dir = os.path.join(data, "tasks", TASK)
    train, dev = os.path.join(task_dir, "train.jsonl.gz"), os.path.join(task_dir, "dev.jsonl.gz")
    spm = train_tokenizer(
        read_sentences(train), os.path.join(workdir, "spm"), vocab_size, hard_vocab_limit=False
    )
    config = finetune_configs.get_config(f"task={TASK},init=")
    config.size = "base"
    config.data.tokenizer = spm
    config.data.train_files, config.data.eval_files = train, dev
    config.data.max_eval_examples = 32  # the run's own evaluation: kept short
    config.num_train_steps, config.warmup_steps = 2, 1
    config.batch_size, config.eval_batch_size = 8, 32
    config.max_seq_length = MAX_SEQ_LENGTH
    finetune.finetune_and_evaluate(config, os.path.join(workdir, "finetune"))


def _export_all(workdir: str) -> None:
    """WORKDIR/hf (`convert --to=onnx`: the HF export and its model.onnx) and WORKDIR/artifact
    (the StableHLO artifact), from WORKDIR/finetune."""
    from albert_jax.export import export_artifact
    from albert_jax.interop.hf_task_export import export_hf_task_model, fine_tuning_run
    from albert_jax.interop.onnx_export import export_onnx

    run = os.path.join(workdir, "finetune")
    export_hf_task_model(fine_tuning_run(run), os.path.join(workdir, "hf"))
    export_onnx(os.path.join(workdir, "hf"))
    export_artifact(run, os.path.join(workdir, "artifact"), platforms=("cpu",))


def build(args: argparse.Namespace, workdir: str) -> dict[str, float]:
    """The fine-tuning run (unless WORKDIR holds it) and its exports (written afresh: an
    artifact of older code may not fit the serving code measured); seconds of each part."""
    context = multiprocessing.get_context("spawn")
    spent: dict[str, float] = {}
    for name in ("hf", "artifact"):
        shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    parts = (
        ("finetune_s", os.path.join(workdir, "finetune", "eval_results.json"), _build_run,
         (args.data, args.vocab_size, workdir)),
        ("export_s", None, _export_all, (workdir,)),
    )  # fmt: skip
    for name, done, target, target_args in parts:
        if done is not None and os.path.exists(done):
            continue
        start = time.perf_counter()
        process = context.Process(target=target, args=target_args)
        process.start()
        process.join()
        if process.exitcode:
            raise RuntimeError(f"building {name[:-2]} in {workdir} failed ({process.exitcode})")
        spent[name] = round(time.perf_counter() - start, 1)
    return spent


# ------------------------------------------------------------------------------ measuring
def measure(
    systems: dict[str, Callable[[list[str]], tuple]],
    batches: list[list[str]],
    warmup: int,
    rounds: int,
    pause: float,
) -> tuple[dict[str, list[float]], dict[str, list[int]], dict[str, list[int]], float]:
    """Round times of each system over `batches` (batch by batch in turns, `pause` seconds
    before each call), the labels and padded widths of its last round, and ours' first
    (compiling) pass in seconds."""
    first = 0.0
    for w in range(warmup):
        for batch in batches:
            for name, system in systems.items():
                time.sleep(pause)
                seconds = system(batch)[0]
                if w == 0 and name == "ours":
                    first += seconds
    times = {name: [0.0] * rounds for name in systems}
    labels: dict[str, list[int]] = {name: [] for name in systems}
    widths: dict[str, list[int]] = {name: [] for name in systems}
    for r in range(rounds):
        for batch in batches:
            for name, system in systems.items():
                time.sleep(pause)
                seconds, predicted, width = system(batch)
                times[name][r] += seconds
                if r == rounds - 1:
                    labels[name].extend(predicted)
                    widths[name].append(width)
    return times, labels, widths, first


def padded_batches(served: Any, batches: list[list[str]]) -> list[dict[str, Any]]:
    """Each batch's token ids as ours featurizes them ({HF input name: [B, 128] int64}; the
    export's tokenizer gives the same ids, tests/test_hf_export.py), with the widths it runs
    at: "cut" (ours: `serving.cut_length` of its longest row) and "longest" (HF's
    padding=True)."""
    from albert_jax.serving import cut_length

    out = []
    for batch in batches:
        examples = [served.example({"sentence": s}, str(i)) for i, s in enumerate(batch)]
        arrays = served.featurize(examples).arrays
        ids = {hf: arrays[name].astype(np.int64) for name, hf in OURS_INPUTS.items()}
        longest = int(arrays["input_mask"].sum(1).max())
        cut = cut_length(longest, arrays["input_mask"].shape[1])
        out.append({"ids": ids, "widths": {"cut": cut, "longest": longest}})
    return out


def measure_forward(
    systems: dict[str, Any],
    padded: list[dict[str, Any]],
    warmup: int,
    rounds: int,
    pause: float,
) -> dict[str, list[float]]:
    """Round times of each system's model alone ({system}_{width}) on the same padded ids,
    batch by batch in turns: the speed per token, apart from padding and tokenization."""
    times: dict[str, list[float]] = {}
    for r in range(-warmup, rounds):  # warm-up rounds compile ours' shapes
        for batch in padded:
            for width_name, width in batch["widths"].items():
                arrays = {k: np.ascontiguousarray(v[:, :width]) for k, v in batch["ids"].items()}
                for name, system in systems.items():
                    time.sleep(pause)
                    seconds = system(arrays)
                    if r >= 0:
                        key = f"{name}_{width_name}"
                        times.setdefault(key, [0.0] * rounds)[r] += seconds
    return times


def breakdown(
    args: argparse.Namespace,
    b: str,
    served: Any,
    spawned: dict[str, Spawned],
    batches: list[list[str]],
    padded: list[dict[str, Any]],
) -> dict[str, Any]:
    """`--breakdown`: each model alone (no tokenization, no post-processing) on the same
    padded ids at ours' width and at HF's (the batch's longest), and ours' tokenization alone."""
    ours = OursSystem(served, 0)

    def ours_forward(arrays: dict[str, np.ndarray]) -> float:
        start = time.perf_counter()
        ours.forward(arrays)
        return time.perf_counter() - start

    systems = {"ours": ours_forward, "hf": spawned["hf"].forward,
               "onnxruntime": spawned["onnxruntime"].forward}  # fmt: skip
    times = measure_forward(systems, padded, args.warmup, args.rounds, args.pause)
    out: dict[str, Any] = {}
    for key, seconds in times.items():
        out[f"forward_{key}_s_{b}"] = round(statistics.median(seconds), 3)
    for width in ("cut", "longest"):
        for name in ("hf", "onnxruntime"):
            out[f"ours_over_{name}_forward_{width}_{b}"] = round(
                paired_ratio(times[f"{name}_{width}"], times[f"ours_{width}"]), 3
            )
    tokenize = []
    for _ in range(args.rounds):  # ours' tokenization (records -> features), timed alone
        start = time.perf_counter()
        for batch in batches:
            served.featurize([served.example({"sentence": s}, str(i)) for i, s in enumerate(batch)])
        tokenize.append(time.perf_counter() - start)
    out[f"ours_tokenize_s_{b}"] = round(statistics.median(tokenize), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--batches", default="32,1", help="batch sizes")
    parser.add_argument(
        "--sentences", default="256,64", help="sentences timed per batch size (as --batches)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes (compiles ours)")
    parser.add_argument("--threads", type=int, default=0, help="torch / ORT threads (0: cores)")
    parser.add_argument("--workdir", default="", help="the run and exports (default: a temp dir)")
    parser.add_argument("--data", default=DATA, help="the shared data directory")
    parser.add_argument("--vocab_size", type=int, default=30000, help="of the trained tokenizer")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.1,
        help="untimed seconds before each call: onnxruntime's threads spin ~35 ms after a run",
    )
    parser.add_argument("--no_bert", action="store_true", help="leave BERT-base out")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="add the models alone on the same padded ids, at ours' and HF's widths",
    )
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batches.split(",")]
    counts = [int(n) for n in args.sentences.split(",")]
    if len(counts) != len(batch_sizes):
        parser.error("--sentences needs one count per --batches entry")
    cores = os.cpu_count() or 1
    threads = args.threads or cores

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or scratch
        os.makedirs(workdir, exist_ok=True)
        built = build(args, workdir)
        result = run(args, workdir, batch_sizes, counts, threads, cores)
    result.update(built)
    result["total_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    sys.stdout.flush()


def run(
    args: argparse.Namespace,
    workdir: str,
    batch_sizes: list[int],
    counts: list[int],
    threads: int,
    cores: int,
) -> dict[str, Any]:
    import jax
    from absl import logging

    from albert_jax import export, serving

    logging.set_verbosity(logging.WARNING)
    hf_dir = os.path.join(workdir, "hf")
    sentences = read_sentences(os.path.join(args.data, "tasks", TASK, "dev.jsonl.gz"))
    spawned = {"hf": Spawned("hf", hf_dir=hf_dir, threads=threads),
               "onnxruntime": Spawned("onnxruntime", hf_dir=hf_dir, threads=threads)}  # fmt: skip
    if not args.no_bert:
        spawned["bert"] = Spawned("bert", hf_dir=hf_dir, threads=threads, bert=True)
    in_process = export.in_process(os.path.join(workdir, "finetune"))
    artifact = serving.load(os.path.join(workdir, "artifact"))
    import onnxruntime
    import torch
    import transformers

    from albert_jax.pretrained import read_checkpoint

    ours_params = int(sum(np.size(v) for v in read_checkpoint(
        os.path.join(workdir, "finetune")).weights.values()))  # fmt: skip
    result: dict[str, Any] = {
        "benchmark": "inference",
        "task": TASK,
        "size": "base",
        "cpu": cpu_model(),
        "cpu_cores": cores,
        "backend": jax.default_backend(),
        "threads": {
            "ours": "XLA:CPU default (all cores)",
            "torch": threads,
            "onnxruntime": threads,
        },  # fmt: skip
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnxruntime": onnxruntime.__version__,
        },  # fmt: skip
        "vocab_size": in_process.tokenizer.vocab_size,
        "max_seq_length": MAX_SEQ_LENGTH,
        "tokenization_timed": True,
        "compile_excluded": True,
        "weights": "2 fine-tuning steps from scratch: weights' values do not change the work, "
        "so not the speed",
        "warmup": args.warmup,
        "rounds": args.rounds,
        "pause_s": args.pause,
        "ours_params": ours_params,
        "hf_params": spawned["hf"].info["params"],
        "hf_attention": spawned["hf"].info["attention"],
        "hf_activation": spawned["hf"].info["activation"],
        "load_average_start": round(os.getloadavg()[0], 2),
    }
    if "bert" in spawned:
        result["bert_params"] = spawned["bert"].info["params"]
        result["bert_activation"] = spawned["bert"].info["activation"]
        result["bert_over_albert_params"] = round(result["bert_params"] / result["hf_params"], 2)
    try:
        for batch_size, count in zip(batch_sizes, counts, strict=True):
            chosen = sentences[:count]
            batches = [chosen[i : i + batch_size] for i in range(0, count, batch_size)]
            systems = {
                "ours": timed(OursSystem(in_process, batch_size)),
                "ours_artifact": timed(OursSystem(artifact, batch_size)),
                **spawned,
            }
            times, labels, widths, first = measure(
                systems, batches, args.warmup, args.rounds, args.pause
            )
            b = f"b{batch_size}"
            result[f"sentences_{b}"] = count
            result[f"ours_first_pass_s_{b}"] = round(first, 2)
            for name, seconds in times.items():
                result[f"{name}_sentences_per_s_{b}"] = round(count / statistics.median(seconds), 2)
            for name in times:
                if name != "ours":
                    result[f"ours_over_{name}_{b}"] = round(
                        paired_ratio(times[name], times["ours"]), 3
                    )
            if "bert" in times:
                result[f"albert_over_bert_{b}"] = round(paired_ratio(times["bert"], times["hf"]), 3)
            for name in times:
                if name != "ours":
                    agree = np.mean(np.array(labels[name]) == np.array(labels["ours"]))
                    if name != "bert":
                        result.setdefault(f"labels_agree_{b}", {})[name] = round(float(agree), 4)
            padded = padded_batches(in_process, batches)
            real = [min(len(in_process.tokenizer.encode(s)) + 2, MAX_SEQ_LENGTH) for s in chosen]
            result[f"real_tokens_per_row_{b}"] = round(float(np.mean(real)), 1)
            for name, width in (("ours", "cut"), ("hf", "longest")):
                result[f"{name}_tokens_per_row_{b}"] = round(
                    float(np.mean([p["widths"][width] for p in padded])), 1
                )
            assert widths["hf"] == [p["widths"]["longest"] for p in padded]  # the same ids
            if args.breakdown:
                result.update(breakdown(args, b, in_process, spawned, batches, padded))
            print(json.dumps({k: v for k, v in result.items() if k.endswith(b)}),
                  file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for system in spawned.values():
            system.close()
    result["targets"] = TARGETS
    result["targets_met"] = {k: result[k] >= v for k, v in TARGETS.items() if k in result}
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    return result


if __name__ == "__main__":
    main()
