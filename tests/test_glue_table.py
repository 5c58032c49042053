"""The GLUE table (albert_jax/glue_table.py): the CLI fine-tunes a tiny init on a local task
(sentiment_rt, for real) and writes the table files with the metric of the task's
eval_results.json; a second sweep reads the results instead of retraining; a task with a missing
data file is recorded and makes the CLI exit non-zero; the reader takes both eval_results.json
formats (one seed, N seeds)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
from conftest import xla_flags
from test_finetune import TINY_MODEL, VOCAB_SIZE, tiny_tokenizer_path

from albert_jax import glue_table
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.pretrained import save_model_dir
from albert_jax.tasks import registry
from configs.finetune import LOCAL_PRESETS, get_config
from configs.finetune import TASKS as CONFIG_TASKS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds, not minutes, on 2 cores: 6 steps of 32 sentences of <= 32 tokens, then the whole dev
# set (1109 sentences); applied to every task, as the CLI does.
OVERRIDES = (
    "--config.num_train_steps=6",
    "--config.warmup_steps=1",
    "--config.learning_rate=1e-3",
    "--config.batch_size=32",
    "--config.eval_batch_size=64",
    "--config.max_seq_length=32",
    "--config.log_every_steps=3",
    "--config.data.max_train_examples=200",
)


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory, shared_data) -> str:
    """A tiny ALBERT model dir (albert_jax layout: N(0, 0.07) weights, unit LayerNorm scales,
    zero biases; shapes traced, nothing compiled) with the tests' 2000-piece tokenizer."""
    config = ModelConfig(vocab_size=VOCAB_SIZE, **TINY_MODEL)
    model = AlbertForPreTraining(config)
    shapes = jax.eval_shape(lambda k: nn.meta.unbox(init_params(model, k)), jax.random.key(0))
    rng = np.random.default_rng(0)

    def value(path, leaf):
        name = jax.tree_util.keystr(path)
        if "bias" in name:
            return np.zeros(leaf.shape, np.float32)
        if "scale" in name:
            return np.ones(leaf.shape, np.float32)
        return (config.initializer_range * rng.standard_normal(leaf.shape)).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(value, shapes)
    directory = str(tmp_path_factory.mktemp("glue_table") / "albert_tiny")
    save_model_dir(directory, params, config, tiny_tokenizer_path(tmp_path_factory, shared_data))
    return directory


@pytest.fixture(scope="module")
def local_data(tmp_path_factory, shared_data) -> str:
    """A --local_data root: sentiment_rt's real files (linked), and an nli_vitaminc directory
    without its files."""
    root = tmp_path_factory.mktemp("local_data")
    (root / "sentiment_rt").mkdir()
    for name in ("train.jsonl.gz", "dev.jsonl.gz"):
        source = os.path.join(shared_data, "tasks", "sentiment_rt", name)
        os.symlink(source, root / "sentiment_rt" / name)
    (root / "nli_vitaminc").mkdir()
    return str(root)


def run_cli(init: str, tasks: str, workdir: str, local_data: str) -> subprocess.CompletedProcess:
    """`python -m albert_jax.glue_table` on one CPU device (the tests' 8 virtual devices would
    only add SPMD compilation and device transfers to these tiny runs)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    command = [
        sys.executable, "-m", "albert_jax.glue_table", f"--init={init}", f"--tasks={tasks}",
        f"--workdir={workdir}", f"--local_data={local_data}", *OVERRIDES,
    ]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def sweep(init_dir, local_data, tmp_path_factory) -> str:
    """The first sweep: sentiment_rt fine-tuned by the CLI; its workdir."""
    workdir = str(tmp_path_factory.mktemp("sweep"))
    proc = run_cli(init_dir, "sentiment_rt", workdir, local_data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| Model | sentiment_rt | Avg |" in proc.stdout  # the table is printed too
    return workdir


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def test_table_of_a_local_task(sweep, init_dir):
    written = _read(os.path.join(sweep, glue_table.TABLE_JSON))
    assert written["failed"] == [] and written["not_run"] == []
    assert written["columns"] == [{"task": "sentiment_rt", "column": "sentiment_rt"}]
    entry = written["results"]["sentiment_rt"]
    results = _read(os.path.join(sweep, "sentiment_rt", "eval_results.json"))
    assert results["task"] == "sentiment_rt" and results["step"] == 6
    assert entry["status"] == "ok" and entry["reused"] is False and entry["num_seeds"] == 1
    assert entry["metric"] == "accuracy" and entry["value"] == results["accuracy"]
    assert entry["score"] == pytest.approx(100 * results["accuracy"])
    assert written["average"] == pytest.approx(entry["score"])  # the mean of one column

    lines = _lines(os.path.join(sweep, glue_table.TABLE_MD))
    assert lines[:2] == ["| Model | sentiment_rt | Avg |", "|---|---:|---:|"]
    score = f"{entry['score']:.1f}"
    assert lines[2] == f"| albert_tiny | {score} | {score} |"
    assert "WNLI" not in "\n".join(lines)  # no GLUE task, no GLUE note
    print("\n".join(lines))


def test_rerun_reads_results_instead_of_training(sweep, init_dir, local_data):
    """In this process (8 devices): nothing is trained, the files of the run stay untouched."""
    names = ("eval_results.json", "metrics.jsonl", "checkpoints")
    run = os.path.join(sweep, "sentiment_rt")
    stamps = [os.stat(os.path.join(run, n)).st_mtime_ns for n in names]
    first = _read(os.path.join(sweep, glue_table.TABLE_JSON))
    again = glue_table.run_table(
        init_dir, ["sentiment_rt"], sweep, OVERRIDES, local_data=local_data
    )
    assert again["results"]["sentiment_rt"]["reused"] is True
    assert again["results"]["sentiment_rt"]["value"] == first["results"]["sentiment_rt"]["value"]
    assert [os.stat(os.path.join(run, n)).st_mtime_ns for n in names] == stamps
    # A run of another init (or other overrides) is refused before anything runs, naming both
    # configs, not mixed into this row.
    with pytest.raises(ValueError, match=r"point sentiment_rt: .* holds a run of another config "
                       r"\(init: '.*albert_tiny' there, '.*albert_tiny_other' here\)"):  # fmt: skip
        glue_table.run_table(init_dir + "_other", ["sentiment_rt"], sweep, OVERRIDES,
                             local_data=local_data)  # fmt: skip
    assert [os.stat(os.path.join(run, n)).st_mtime_ns for n in names] == stamps


def test_cli_records_a_failed_task_and_exits_nonzero(sweep, init_dir, local_data):
    """The CLI in the first sweep's workdir: sentiment_rt is read (not re-run), nli_vitaminc's
    files are missing: its error is in the JSON, "—" in the table, and the exit status is 1."""
    first = _read(os.path.join(sweep, "sentiment_rt", "eval_results.json"))
    proc = run_cli(init_dir, "nli_vitaminc,sentiment_rt", sweep, local_data)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "point sentiment_rt: finished before, not re-run" in proc.stderr
    written = _read(os.path.join(sweep, glue_table.TABLE_JSON))
    assert written["failed"] == ["nli_vitaminc"] and written["average"] is None
    failed = written["results"]["nli_vitaminc"]
    assert failed["status"] == "failed" and "ValueError" in failed["error"]
    assert "nli_vitaminc/train.jsonl.gz" in failed["error"]
    assert written["results"]["sentiment_rt"]["value"] == first["accuracy"]
    lines = _lines(os.path.join(sweep, glue_table.TABLE_MD))
    assert lines[0] == "| Model | nli_vitaminc | sentiment_rt | Avg |"
    assert lines[2] == f"| albert_tiny | — | {100 * first['accuracy']:.1f} | — |"
    assert any(line.startswith("nli_vitaminc failed: ValueError") for line in lines)
    assert lines[2] in proc.stdout


def test_read_score_both_formats():
    one_seed = {
        "task": "mnli",
        "validation_matched/accuracy": 0.8,
        "validation_mismatched/accuracy": 0.7,
        "validation_matched/num_examples": 10,
    }
    score = glue_table.read_score(one_seed, "mnli")
    assert (score.metric, score.value, score.num_seeds) == ("validation_matched/accuracy", 0.8, 1)
    assert score.per_seed is None and score.secondary == {"MNLI-mm": pytest.approx(70.0)}
    assert glue_table.read_score({"accuracy": 0.5}, "sst2").value == 0.5
    assert glue_table.read_score({"f1": 71.5, "exact_match": 60.0}, "squad_v1").value == 71.5
    with pytest.raises(ValueError, match="matthews_corrcoef"):
        glue_table.read_score({"accuracy": 0.5}, "cola")

    seeds = {
        "task": "cola", "num_seeds": 3, "seeds": [0, 1, 2],
        "per_seed": {"0": {"matthews_corrcoef": 0.1}, "1": {"matthews_corrcoef": 0.3},
                     "2": {"matthews_corrcoef": float("nan")}},
        "median": {"matthews_corrcoef": 0.2}, "mean": {"matthews_corrcoef": 0.2},
        "std": {"matthews_corrcoef": 0.1}, "min": {"matthews_corrcoef": 0.1},
        "max": {"matthews_corrcoef": 0.3},
        "failed_seeds": [{"seed": 2, "reason": "diverged (non-finite parameters)"}],
    }  # fmt: skip
    score = glue_table.read_score(seeds, "cola")
    assert (score.metric, score.value, score.num_seeds) == ("matthews_corrcoef", 0.2, 3)
    assert score.per_seed == {"0": 0.1, "1": 0.3, "2": None}
    assert score.failed_seeds == seeds["failed_seeds"]
    # No seed with a finite value: the metric is absent from the median, the value is None.
    nan_seeds = {**seeds, "median": {}, "per_seed": {"0": {"matthews_corrcoef": float("nan")}}}
    assert glue_table.read_score(nan_seeds, "cola").value is None

    # A table of such results: columns in the paper's order, the medians in the row and their
    # mean as Avg, the seeds in the notes.
    cola = {"status": "ok", "score": 20.0, "secondary": {}, "per_seed": score.per_seed,
            "failed_seeds": score.failed_seeds, "task": "cola", "column": "CoLA"}  # fmt: skip
    mnli = {"status": "ok", "score": 81.0, "secondary": {"MNLI-mm": 80.5}, "task": "mnli"}
    table = glue_table.make_table(
        "/ckpt/albert_base", ["cola", "mnli"], {"cola": cola, "mnli": mnli}, 3
    )
    assert table["average"] == pytest.approx(50.5)
    markdown = glue_table.render_markdown(table).splitlines()
    assert markdown[0] == "| Model | MNLI | CoLA | Avg |"
    assert markdown[2] == "| albert_base (median of 3 seeds) | 81.0 | 20.0 | 50.5 |"
    assert "Other official metrics: MNLI-mm 80.5." in markdown
    assert "CoLA per seed: 0: 10.0, 1: 30.0, 2: —." in markdown
    assert "CoLA seed 2 failed: diverged (non-finite parameters)." in markdown
    assert "WNLI is left out, as in the paper's dev-set rows." in markdown


def test_tasks_and_configs(local_data):
    # Every task of configs/finetune.py has a column, read under one of its official metrics;
    # MNLI's columns name its two eval splits (the prefixes of its metrics).
    assert set(glue_table.HEADLINES) == set(CONFIG_TASKS)
    assert set(glue_table.LOCAL_FILES) == set(LOCAL_PRESETS)
    for task, headline in glue_table.HEADLINES.items():
        assert headline.metric in registry.get_task(task).metrics, task
    mnli_sets = [glue_table.HEADLINES["mnli"].eval_set, glue_table.SECONDARY["mnli"][0].eval_set]
    assert get_config("task=mnli").data.eval_split.split(",") == mnli_sets
    assert glue_table.expand_tasks("glue") == list(glue_table.GLUE_ORDER)
    assert glue_table.table_order(["sentiment_rt", "cola", "mnli"]) == [
        "mnli",
        "cola",
        "sentiment_rt",
    ]
    for spec, match in (
        ("wnli", "unknown task 'wnli'"),
        ("rte,rte", "named twice"),
        ("", "no task"),
    ):
        with pytest.raises(ValueError, match=match):
            glue_table.expand_tasks(spec)
    config = glue_table.task_config(
        "sentiment_rt", "/ckpt", ["--config.num_train_steps=7", "--config.length_buckets=false"],
        local_data=local_data,
    )  # fmt: skip
    assert config.num_train_steps == 7 and config.length_buckets is False
    assert config.data.eval_files == os.path.join(local_data, "sentiment_rt", "dev.jsonl.gz")
    assert config.learning_rate == get_config("task=sentiment_rt").learning_rate  # the preset
    rte = glue_table.task_config("rte", "/ckpt", local_data=local_data)
    assert rte.data.train_files == "" and rte.num_train_steps == 800  # TFDS, paper preset
    # An unknown field is named as `python -m albert_jax.main` names it (cli.py).
    unknown = "task rte: config: unknown field 'num_trian_steps' in --config.num_trian_steps=7"
    with pytest.raises(ValueError, match=re.escape(unknown + "; did you mean 'num_train_steps'?")):
        glue_table.task_config("rte", "/ckpt", ["--config.num_trian_steps=7"])
    with pytest.raises(ValueError, match="num_train_steps=x"):
        glue_table.task_config("rte", "/ckpt", ["--config.num_train_steps=x"])
    # N > 1 seeds need config.num_seeds; one seed leaves the config as it is.
    bare = ml_collections.ConfigDict({"seed": 0})
    glue_table.set_num_seeds(bare, 1)
    assert "num_seeds" not in bare
    with pytest.raises(ValueError, match="config.num_seeds"):
        glue_table.set_num_seeds(bare, 3)
    seeded = ml_collections.ConfigDict({"seed": 0, "num_seeds": 1})
    glue_table.set_num_seeds(seeded, 3)
    assert seeded.num_seeds == 3
