"""The launch/README journey with every path on gs://, against the local Cloud Storage emulator
(the session fixture `gcs`, tests/gcs.py): what a user of a TPU pod runs, in order.

1. `python -m albert_jax.data.builders --sources=demo --data_dir=gs://.../tfds` (TFRecord: the
   data dir is not local).
2. Tiny pretraining on that data dir with a gs:// workdir: a straight 6-step run that trains its
   tokenizer into the workdir and tokenizes into the default per-host cache (a local $HOME,
   never the working directory), and a run with `data.tokenizer=gs://...` and a gs:// cache dir
   that is SIGTERMed after step 3 and restarted: both end bit for bit alike (params, optimizer
   state, per-step losses, so the data position too).
3. `load_pretrained` of the gs:// workdir and of one step dir; `convert --to=hf` from gs:// to
   gs:// and `--from=hf` back.
4. Fine-tuning sentiment_rt with `init=gs://...`, a gs:// workdir and task files on gs://: a
   straight run and a SIGTERM + restart end alike (params, optimizer state, predictions).
5. A missing gs:// init or task file: ValueError naming it, before anything is compiled.

Every run has its working directory in an empty local directory, checked to be still empty
afterwards: a gs:// path must never silently become a local one.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import pytest
from gcs import assert_local_unchanged
from test_finetune import _override
from test_train import (
    REPO,
    assert_trees_equal,
    compile_counter,  # noqa: F401 (a fixture)
    final_state,
    losses_by_step,
    small_overrides,
    tiny_command,
)

from albert_jax import checkpointing, load_pretrained, metrics_writer
from albert_jax.finetune import train as finetune
from albert_jax.runtime import checkpoint_dirs
from configs.finetune import get_config as finetune_config

pytestmark = pytest.mark.slow

STEPS = 6  # pretraining and fine-tuning steps
SIGTERM_STEP = 3
SHARED_TASK = ("tasks", "sentiment_rt")
EVAL_EXAMPLES = 32


def _cwd(tmp_path_factory, name: str) -> str:
    """A fresh empty directory to run in (checked with `assert_local_unchanged`)."""
    return str(tmp_path_factory.mktemp(name))


def _subprocess(gcs, args: list[str], cwd: str, env: dict | None = None, timeout: int = 600):
    """Runs `args` in `cwd` with the emulator's environment; the repository importable."""
    env = gcs.subprocess_env(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _bucket_names(gcs, prefix: str) -> list[str]:
    return [name[len(prefix) :] for name in gcs.list(prefix)]


# ----------------------------------------------------------------------------------------------
# 1. The demo dataset, built into a gs:// data dir


@pytest.fixture(scope="module")
def dataset(gcs, tmp_path_factory):
    cwd = _cwd(tmp_path_factory, "build_cwd")
    data_dir = gcs.url("journey/tfds")
    args = [sys.executable, "-m", "albert_jax.data.builders", "--sources=demo"]
    proc = _subprocess(gcs, [*args, f"--data_dir={data_dir}"], cwd)
    return {"data_dir": data_dir, "proc": proc, "cwd": cwd}


def test_demo_dataset_is_built_into_the_bucket(gcs, dataset):
    proc = dataset["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = _bucket_names(gcs, "journey/tfds/")
    assert any(re.search(r"\.tfrecord-\d{5}-of-\d{5}$", n) and "-train." in n for n in names), names
    assert any("-validation.tfrecord-" in n for n in names), names
    assert not [n for n in names if "array_record" in n], names
    assert any(n.endswith("/dataset_info.json") for n in names), names
    [report] = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert report["prepared"] and report["data_dir"].startswith(dataset["data_dir"]), report
    assert report["splits"]["train"] > 0 and report["splits"]["validation"] > 0, report
    assert_local_unchanged(dataset["cwd"])


# ----------------------------------------------------------------------------------------------
# 2. Tiny pretraining: straight, and SIGTERM + restart


@pytest.fixture(scope="module")
def pretraining(gcs, dataset, tmp_path_factory):
    assert dataset["proc"].returncode == 0, dataset["proc"].stderr[-4000:]
    cwd = _cwd(tmp_path_factory, "pretrain_cwd")
    home = _cwd(tmp_path_factory, "pretrain_home")  # the per-host cache: ~/.cache/albert_jax
    straight, chain = gcs.url("journey/pt_straight"), gcs.url("journey/pt_chain")
    corpus = {"sources": "demo", "data_dir": dataset["data_dir"]}
    base = small_overrides(
        {**corpus, "tokenizer": None},
        num_train_steps=STEPS,
        checkpoint_every_steps=2,
        **{"data.tokenizer_max_sentences": 3000},
    )
    del base["data.tokenizer"]  # the straight run trains its own, into the gs:// workdir
    chained = {
        **base,
        "data.tokenizer": f"{straight}/{checkpointing.TOKENIZER_FILE}",
        "data.cache_dir": gcs.url("journey/cache"),
    }

    def run(workdir, overrides):
        args, env = tiny_command(
            workdir,
            overrides,
            8,
            HOME=home,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )
        config = os.path.join(REPO, "configs", "pretrain.py")
        args = [a.replace("configs/pretrain.py", config, 1) for a in args]
        return _subprocess(gcs, args, cwd, env)

    out = {"straight": straight, "chain": chain, "cwd": cwd, "home": home}
    out["straight_proc"] = run(straight, base)
    out["sigterm_proc"] = run(chain, {**chained, "debug.sigterm_after_step": SIGTERM_STEP})
    with checkpointing.Checkpointer(chain, read_only=True) as ckpt:
        out["after_sigterm_steps"] = ckpt.all_steps()
    out["restart_proc"] = run(chain, chained)
    return out


def test_pretraining_writes_everything_to_the_bucket(gcs, pretraining):
    proc = pretraining["straight_proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = _bucket_names(gcs, "journey/pt_straight/")
    for name in (
        checkpointing.TOKENIZER_FILE,
        "config.json",
        metrics_writer.METRICS_FILE,
        metrics_writer.LEARNING_CURVE_FILE,
    ):
        assert name in names, (name, names)
    assert any(n.startswith("tensorboard/events.out.tfevents") for n in names), names
    for step in (2, 4, 6):
        assert any(n.startswith(f"checkpoints/{step}/params/") for n in names), (step, names)
    assert sorted(losses_by_step(pretraining["straight"])) == list(range(1, STEPS + 1))
    config = json.loads(gcs.read("journey/pt_straight/config.json"))
    assert config["data"]["data_dir"] == gcs.url("journey/tfds")
    # The tokenized cache: the per-host default (a gs:// data dir) for the straight run ...
    local_cache = os.path.join(pretraining["home"], ".cache", "albert_jax", "albert_jax_cache")
    assert any(name.startswith("demo.") for name in os.listdir(local_cache))
    assert not gcs.list("journey/tfds/albert_jax_cache")  # not beside a gs:// data dir
    # ... and the configured gs:// cache dir for the chained one (entries committed).
    assert any(n.endswith("/stats.json") for n in _bucket_names(gcs, "journey/cache/demo."))
    assert_local_unchanged(pretraining["cwd"])


def test_pretraining_sigterm_and_restart_is_bit_exact(gcs, pretraining):
    for key in ("sigterm_proc", "restart_proc"):
        proc = pretraining[key]
        assert proc.returncode == 0, (key, proc.stderr[-4000:])
    assert "preempted" in pretraining["sigterm_proc"].stderr
    assert pretraining["after_sigterm_steps"] == [2, SIGTERM_STEP]
    assert f"resumed at step {SIGTERM_STEP}" in pretraining["restart_proc"].stderr
    straight, chain = pretraining["straight"], pretraining["chain"]
    params, opt_state = final_state(straight, STEPS)
    params_chain, opt_state_chain = final_state(chain, STEPS)
    assert_trees_equal(params, params_chain)
    assert_trees_equal(opt_state, opt_state_chain)
    assert losses_by_step(chain) == losses_by_step(straight)
    assert gcs.read("journey/pt_chain/tokenizer.model") == gcs.read(
        "journey/pt_straight/tokenizer.model"
    )
    assert_local_unchanged(pretraining["cwd"])


# ----------------------------------------------------------------------------------------------
# 3. load_pretrained and convert, gs:// to gs://


@pytest.fixture(scope="module")
def converted(gcs, pretraining, tmp_path_factory):
    assert pretraining["straight_proc"].returncode == 0, pretraining["straight_proc"].stderr[-4000:]
    cwd = _cwd(tmp_path_factory, "convert_cwd")
    src, hf, back = (gcs.url(f"journey/{name}") for name in ("pt_straight", "hf", "back"))
    convert = [sys.executable, "-m", "albert_jax.convert"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = {"cwd": cwd, "hf": hf, "back": back}
    out["to_hf"] = _subprocess(gcs, [*convert, "--to=hf", f"--src={src}", f"--dst={hf}"], cwd, env)
    out["from_hf"] = _subprocess(
        gcs, [*convert, "--from=hf", f"--src={hf}", f"--dst={back}"], cwd, env
    )
    return out


def test_load_pretrained_workdir_and_step_dir(gcs, pretraining, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workdir = pretraining["straight"]
    params = final_state(workdir, STEPS)[0]
    text = "it was a truth universally acknowledged"
    for path in (workdir, f"{workdir}/{checkpoint_dirs.CHECKPOINTS_DIR}/{STEPS}"):
        loaded = load_pretrained(path)
        assert loaded.step == STEPS and loaded.source == "albert_jax", path
        assert loaded.config.hidden_size == 32 and loaded.config.vocab_size == 1000
        assert_trees_equal(loaded.params, params)
        assert loaded.tokenizer is not None, path
        assert loaded.tokenizer_path == f"{workdir}/{checkpointing.TOKENIZER_FILE}"
        assert len(loaded.tokenizer.encode(text)) > 3
    assert_local_unchanged(str(tmp_path))


def test_convert_to_hf_and_back_on_gcs(gcs, pretraining, converted, tmp_path, monkeypatch):
    for key in ("to_hf", "from_hf"):
        proc = converted[key]
        assert proc.returncode == 0, (key, proc.stderr[-4000:])
    assert_local_unchanged(converted["cwd"])
    names = _bucket_names(gcs, "journey/hf/")
    assert "config.json" in names and "model.safetensors" in names, names
    monkeypatch.chdir(tmp_path)
    original = load_pretrained(pretraining["straight"])
    for path in (converted["hf"], converted["back"]):
        loaded = load_pretrained(path)
        assert loaded.config.hidden_size == original.config.hidden_size, path
        assert_trees_equal(loaded.params, original.params)
        assert loaded.tokenizer is not None, path
        assert loaded.tokenizer.encode("a truth") == original.tokenizer.encode("a truth")
    assert load_pretrained(converted["back"]).source == "albert_jax"
    assert_local_unchanged(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# 4. Fine-tuning from gs:// into gs:// on task files in gs://


@pytest.fixture(scope="module")
def task_files(gcs, shared_data):
    """sentiment_rt's train file and EVAL_EXAMPLES dev sentences (labels 1, 0, 1, ...: the dev
    file starts with a run of positives) in the bucket, gzipped as in shared/data."""
    directory = os.path.join(shared_data, *SHARED_TASK)
    with open(os.path.join(directory, "train.jsonl.gz"), "rb") as f:
        gcs.write("journey/sentiment_rt/train.jsonl.gz", f.read())
    with gzip.open(os.path.join(directory, "dev.jsonl.gz"), "rt", encoding="utf-8") as f:
        dev = [json.loads(line) for line in f]
    by_label = {label: [ex for ex in dev if ex["label"] == label] for label in (0, 1)}
    mixed = [by_label[1 - i % 2][i // 2] for i in range(EVAL_EXAMPLES)]
    text = "".join(json.dumps(ex) + "\n" for ex in mixed)
    gcs.write("journey/sentiment_rt/dev.jsonl.gz", gzip.compress(text.encode("utf-8")))
    return tuple(gcs.url(f"journey/sentiment_rt/{n}") for n in ("train.jsonl.gz", "dev.jsonl.gz"))


def _finetune_config(init: str, task_files: tuple[str, str], **overrides):
    config = finetune_config(f"task=sentiment_rt,init={init}")
    _override(
        config,
        {
            "data.train_files": task_files[0],
            "data.eval_files": task_files[1],
            "data.max_train_examples": 64,
            "data.max_eval_examples": EVAL_EXAMPLES,
            "model.hidden_dropout_prob": 0.1,  # the dropout keys must resume too
            "batch_size": 16,
            "eval_batch_size": 32,
            "max_seq_length": 32,
            "num_train_steps": STEPS,
            "warmup_steps": 2,
            "log_every_steps": 1,
            "checkpoint_every_steps": 2,
            "keep_checkpoints": 5,
            **overrides,
        },
    )
    return config


@pytest.fixture(scope="module")
def finetuned(gcs, pretraining, task_files, tmp_path_factory):
    assert pretraining["straight_proc"].returncode == 0, pretraining["straight_proc"].stderr[-4000:]
    cwd = _cwd(tmp_path_factory, "finetune_cwd")
    init = pretraining["straight"]
    straight, chain = gcs.url("journey/ft_straight"), gcs.url("journey/ft_chain")
    out = {"cwd": cwd, "straight": straight, "chain": chain}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        out["straight_results"] = finetune.finetune_and_evaluate(
            _finetune_config(init, task_files), straight
        )
        stop = _finetune_config(init, task_files, **{"debug.sigterm_after_step": SIGTERM_STEP})
        out["stopped"] = finetune.finetune_and_evaluate(stop, chain)
        with checkpointing.Checkpointer(chain, read_only=True) as ckpt:
            out["stopped_steps"] = ckpt.all_steps()
        out["stopped_names"] = _bucket_names(gcs, "journey/ft_chain/")
        out["chain_results"] = finetune.finetune_and_evaluate(
            _finetune_config(init, task_files), chain
        )
    return out


def _predictions(gcs, name: str) -> list[dict]:
    text = gcs.read(f"journey/{name}/predictions.jsonl").decode()
    return [json.loads(line) for line in text.splitlines()]


def test_finetuning_sigterm_and_restart_is_bit_exact(gcs, pretraining, finetuned):
    straight, chain = finetuned["straight_results"], finetuned["chain_results"]
    stopped = finetuned["stopped"]
    assert stopped["preempted"] and stopped["step"] == SIGTERM_STEP
    assert finetuned["stopped_steps"] == [2, SIGTERM_STEP]  # the periodic save, the SIGTERM one
    assert finetune.EVAL_RESULTS_FILE not in finetuned["stopped_names"]
    assert not chain["preempted"] and chain["step"] == STEPS
    assert straight["init"]["source"] == "albert_jax"
    assert straight["init"]["path"] == pretraining["straight"]
    assert straight["init"]["missing"] == ["classifier/bias", "classifier/kernel"]
    assert chain["init"] == straight["init"]
    for i in (0, 1):  # params, optimizer state
        want, got = (final_state(finetuned[k], STEPS)[i] for k in ("straight", "chain"))
        assert_trees_equal(want, got)
    losses = losses_by_step(finetuned["straight"])
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses_by_step(finetuned["chain"]) == losses
    predictions = _predictions(gcs, "ft_straight")
    assert [p["label"] for p in predictions] == [1, 0] * (EVAL_EXAMPLES // 2)
    assert _predictions(gcs, "ft_chain") == predictions
    saved = {}
    for name in ("ft_straight", "ft_chain"):
        saved[name] = json.loads(gcs.read(f"journey/{name}/{finetune.EVAL_RESULTS_FILE}"))
        written = saved[name].pop("prediction_files")
        assert written == [gcs.url(f"journey/{name}/predictions.jsonl")], written
    assert saved["ft_straight"]["num_examples"] == EVAL_EXAMPLES
    assert saved["ft_chain"] == saved["ft_straight"]
    names = _bucket_names(gcs, "journey/ft_straight/")
    for name in (checkpointing.TOKENIZER_FILE, "config.json", metrics_writer.METRICS_FILE):
        assert name in names, (name, names)
    assert_local_unchanged(finetuned["cwd"])


# ----------------------------------------------------------------------------------------------
# 5. Bad gs:// input fails at once


def test_missing_gcs_inputs_are_named_before_compilation(
    gcs,
    pretraining,
    task_files,
    compile_counter,  # noqa: F811 (test_train's fixture, imported above)
    tmp_path,
    monkeypatch,
):
    monkeypatch.chdir(tmp_path)
    missing_init = gcs.url("journey/no_such_run")
    missing_file = gcs.url("journey/sentiment_rt/no_such_train.jsonl.gz")
    cases = [
        (_finetune_config(missing_init, task_files), missing_init),
        (_finetune_config(pretraining["straight"], (missing_file, task_files[1])), missing_file),
    ]
    for config, missing in cases:
        workdir = gcs.url("journey/ft_bad")
        compile_counter.active, compile_counter.count = True, 0
        try:
            with pytest.raises(ValueError, match=re.escape(missing)):
                finetune.finetune_and_evaluate(config, workdir)
        finally:
            compile_counter.active = False
        assert compile_counter.count == 0, missing
        assert not gcs.list("journey/ft_bad/checkpoints/")
    assert_local_unchanged(str(tmp_path))
