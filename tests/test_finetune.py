"""Fine-tuning end to end on real local data: a tiny model is pretrained with
`train.train_and_evaluate`, then fine-tuned on sentiment_rt, mc_cosmosqa and SQuAD-Shifts;
init from HF and official-TF1 checkpoints; the config file.

Shared with test_heads.py / test_notebook.py: `tiny_tokenizer_path` and `pretrained_workdir`
build their artifacts once per session under pytest's base temp dir (cached on disk, so every
test module that asks gets the same files).
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import build_once, run_main, session_dir

from albert_jax.finetune import settings as finetune_config
from albert_jax.finetune import train as finetune
from albert_jax.pretrained import load_pretrained
from albert_jax.sharding import create_mesh
from albert_jax.tasks import local, registry, squad_eval
from configs.finetune import TASKS as CONFIG_TASKS
from configs.finetune import get_config

# The tiny model of these tests (H 64, 2 layers, sequences <= 128). Its init is scaled to its
# width: the official 0.02 suits H = 768 (0.02 * sqrt(768) ~ 0.55 per projection); at H = 64 it
# would make every attention output ~10x weaker relative to the residual, so [CLS] would hardly
# see the sentence and fine-tuning would sit on a plateau. 0.07 ~ 0.02 * sqrt(768 / 64).
TINY_MODEL = dict(
    embedding_size=32,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    initializer_range=0.07,
)
VOCAB_SIZE = 2000


# -------------------------------------------------------------------- shared session artifacts
def _corpus_texts(shared_data: str, docs_per_corpus: int) -> list[str]:
    from albert_jax.data import corpus, sentences

    texts = []
    for name in ("brown", "austen"):
        path = os.path.join(shared_data, "corpora", f"{name}.jsonl.gz")
        for doc in itertools.islice(corpus.iter_jsonl_documents(path), docs_per_corpus):
            texts.extend(sentences.split_sentences(doc["text"]))
    return texts


def tiny_tokenizer_path(tmp_path_factory, shared_data: str) -> str:
    """A real 2000-piece sentencepiece model trained on Brown + Austen text (once per session)."""
    from albert_jax.data.tokenizer import train_tokenizer

    prefix = session_dir(tmp_path_factory) / "finetune_spm" / "spm"
    build_once(
        prefix.with_suffix(".model"),
        lambda: train_tokenizer(
            _corpus_texts(shared_data, 40), str(prefix), VOCAB_SIZE, max_sentences=8000
        ),
    )
    return f"{prefix}.model"


def pretrained_workdir(tmp_path_factory, shared_data: str, sharing: str = "all") -> str:
    """A tiny ALBERT pretrained briefly (MLM + SOP, LAMB) by the real pretraining loop on a slice
    of the Austen + Brown corpora; our checkpoint layout under WORKDIR/checkpoints/<step>/."""
    from albert_jax.pretrain import train
    from configs.pretrain import get_config as pretrain_config

    root = session_dir(tmp_path_factory)
    workdir = root / f"finetune_pretrained_{sharing}"
    tokenizer = tiny_tokenizer_path(tmp_path_factory, shared_data)
    corpus = root / "finetune_corpus.jsonl.gz"

    def write_corpus() -> None:
        with gzip.open(corpus, "wt", encoding="utf-8") as f:
            for name in ("austen", "brown"):
                path = os.path.join(shared_data, "corpora", f"{name}.jsonl.gz")
                with gzip.open(path, "rt", encoding="utf-8") as src:
                    for line in itertools.islice(src, 30):
                        f.write(line)

    def pretrain() -> None:
        build_once(corpus, write_corpus)
        train.train_and_evaluate(config, str(workdir))

    config = pretrain_config(f"size=tiny,sharing={sharing},data=documents={corpus}")
    for key, value in {**TINY_MODEL, "vocab_size": VOCAB_SIZE}.items():
        config.model[key] = value
    config.seq_len, config.batch_size, config.max_predictions_per_seq = 64, 32, 10
    # LAMB at the tiny preset's 5e-3 drives such a short run into MLM's unigram phase, where
    # every position (so [CLS]) says the same; 1e-3 keeps the sentence visible to fine-tuning.
    config.num_train_steps, config.warmup_steps, config.learning_rate = 60, 10, 1e-3
    config.log_every_steps, config.eval_every_steps, config.eval_batches = 10, 30, 2
    config.checkpoint_every_steps = 60
    config.data.data_dir = str(root / "finetune_tfds")  # the corpus, built once for both
    config.data.tokenizer = tokenizer
    config.data.num_workers = 0

    # One lock for every `sharing`: their runs build the same TFDS corpus on first use.
    def built() -> bool:
        return (workdir / "metrics.jsonl").exists() and (workdir / "checkpoints").exists()

    build_once(root / "finetune_pretrained", pretrain, done=built)
    return str(workdir)


def task_files(shared_data: str, task: str) -> tuple[str, str]:
    d = os.path.join(shared_data, "tasks", task)
    if task == "squad_shifts":
        return os.path.join(d, "new_wiki_v1.0.json.gz"), os.path.join(d, "nyt_v1.0.json.gz")
    return os.path.join(d, "train.jsonl.gz"), os.path.join(d, "dev.jsonl.gz")


def small_config(task: str, init: str, shared_data: str, **overrides):
    config = get_config(f"task={task},init={init}")
    config.data.train_files, config.data.eval_files = task_files(shared_data, task)
    config.log_every_steps = 25
    _override(config, overrides)
    return config


def tiny_scratch_config(task: str, tokenizer: str, **overrides):
    """`configs/finetune.py:task=TASK` from scratch (no init) on TINY_MODEL, for seconds-long
    runs: 12 AdamW steps of 32 sequences of 32 tokens, dropout on, params sharded over a
    (data 2, fsdp 2, tensor 2) mesh of the 8 test devices, a checkpoint every 4 steps.

    Tests that keep these shapes (the resume runs, glue/sst2 from catalog files) compile the
    same programs, which the session's compilation cache (conftest) then compiles once.
    """
    config = get_config(f"task={task}")
    config.size = "tiny"
    for key, value in TINY_MODEL.items():
        config.model[key] = value
    config.model.hidden_dropout_prob = config.model.attention_probs_dropout_prob = 0.1
    config.data.tokenizer = tokenizer
    config.num_train_steps, config.warmup_steps, config.learning_rate = 12, 2, 1e-3
    config.batch_size, config.eval_batch_size, config.max_seq_length = 32, 64, 32
    config.log_every_steps, config.checkpoint_every_steps, config.keep_checkpoints = 1, 4, 5
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
    _override(config, overrides)
    return config


def _override(config, overrides: dict) -> None:
    """Sets dotted keys ("data.max_train_examples") of a ConfigDict."""
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value


def _read_results(workdir) -> dict:
    with open(os.path.join(workdir, finetune.EVAL_RESULTS_FILE)) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ config
def test_config_presets_and_errors():
    cola = get_config("task=cola,init=/ckpt")
    assert (cola.learning_rate, cola.batch_size, cola.num_train_steps) == (1e-5, 16, 5336)
    assert (cola.warmup_steps, cola.max_seq_length, cola.classifier_dropout) == (320, 512, 0.1)
    qqp = get_config("task=qqp")
    assert qqp.model.hidden_dropout_prob == 0.1 and qqp.batch_size == 128
    v2 = get_config("task=squad_v2")
    assert (v2.learning_rate, v2.batch_size, v2.num_train_epochs) == (5e-5, 48, 2)
    assert (v2.warmup_fraction, v2.doc_stride, v2.max_query_length) == (0.1, 128, 64)
    race = get_config("task=race")
    assert (race.num_train_steps, race.max_qa_length, race.optimizer) == (12000, 128, "adamw")
    assert set(CONFIG_TASKS) <= set(registry.TASKS)
    # Every task's config passes the checks and has the same fields: the config file is the
    # list of the fields a fine-tuning config may have, whatever its task.
    first = get_config(f"task={CONFIG_TASKS[0]}")
    for task in CONFIG_TASKS:
        config = get_config(f"task={task}")
        finetune_config.validate_config(config)
        for section in ("", "model", "data", "mesh", "debug"):
            node, reference = (config[section], first[section]) if section else (config, first)
            assert set(node.keys()) == set(reference.keys()), (task, section)
    with pytest.raises(ValueError, match="sise"):
        get_config("task=rte,sise=1")
    with pytest.raises(ValueError, match="task='nope'"):
        get_config("task=nope")
    config = get_config("task=sentiment_rt,init=/x")
    config.learning_rte = 1.0
    with pytest.raises(ValueError, match="config.learning_rte"):
        finetune_config.validate_config(config)
    config = get_config("task=sentiment_rt,init=/x")
    config.data.trian_files = "a"
    with pytest.raises(ValueError, match="config.data.trian_files"):
        finetune_config.validate_config(config)
    config = get_config("task=sentiment_rt,init=/x")
    config.model.hidden_size = 128
    with pytest.raises(ValueError, match="hidden_size cannot change a pretrained model"):
        finetune_config.validate_config(config)
    # Picking a run of the init, or weights not to load from it, needs an init.
    config = get_config("task=sentiment_rt")
    config.init_run_seed = 2
    with pytest.raises(ValueError, match="config.init_run_seed=2 needs a config.init"):
        finetune_config.validate_config(config)
    config = get_config("task=sentiment_rt,init=/x")
    config.init_dont_load = "classifier/.*,albert/(pooler"
    with pytest.raises(ValueError, match=r"init_dont_load: 'albert/\(pooler' is no regular"):
        finetune_config.validate_config(config)


def test_local_task_needs_files(tmp_path):
    config = get_config("task=sentiment_rt")
    config.data.tokenizer = None
    with pytest.raises(ValueError, match="train_files"):
        registry.read_train("sentiment_rt", config.data)


# -------------------------------------------------------------------------- local fine-tuning
# The sentiment_rt run from the pretrained tiny model (test_seeds runs its four seeds, packed;
# at max_seq_length 40 the default does not pack). Keep 500 steps: measured, 350 gave seed 0
# 0.629 but a four-seed median of 0.596 (test_seeds' within-a-point check fails), 250 left a
# seed at the majority class (0.569 for seed 0): fewer steps are still mid-learning, where
# seeds differ.
SENTIMENT_SETTINGS = dict(
    learning_rate=3e-4, num_train_steps=500, warmup_steps=50, eval_batch_size=256,
    max_seq_length=40,
)  # fmt: skip


def sentiment_pretrained_run(tmp_path_factory, shared_data: str) -> str:
    """The one-seed run (test_seeds compares seed 0 of four packed seeds with it), on one
    device (`run_cli`): 500 steps, the suite's longest single run."""
    init = pretrained_workdir(tmp_path_factory, shared_data)
    make = functools.partial(small_config, "sentiment_rt", init, shared_data, **SENTIMENT_SETTINGS)
    return _cached_run(tmp_path_factory, "finetune_sentiment_rt", make, cli=True)


def run_cli(config, workdir) -> dict:
    """`config` run by `python -m albert_jax.main` on one CPU device, optimized
    (conftest.run_main): the suite's runs of hundreds of steps, and the evaluations whose
    predictions must equal theirs (same device count and flags, so the same arithmetic); its
    eval_results.json."""
    arg = f"configs/finetune.py:task={config.task},init={config.init}"
    run_main(config, arg, workdir, optimize=True)
    return _read_results(workdir)


def test_sentiment_rt_beats_the_majority_class(tmp_path_factory, shared_data, tmp_path):
    workdir = Path(sentiment_pretrained_run(tmp_path_factory, shared_data))
    results = on_disk = _read_results(workdir)
    print("sentiment_rt dev:", {k: results[k] for k in ("accuracy", "majority_accuracy")})
    assert results["num_examples"] == 1109 and results["step"] == 500
    assert results["accuracy"] > results["majority_accuracy"] + 0.05
    init = on_disk["init"]
    assert init["source"] == "albert_jax"
    assert init["missing"] == ["classifier/bias", "classifier/kernel"]
    assert any(p.startswith("predictions/") for p in init["unexpected"])
    assert any(p.startswith("sop_classifier/") for p in init["unexpected"])
    assert on_disk["data"]["train"]["featurization"]["examples"] == 8431
    with open(workdir / "predictions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1109
    assert np.mean([r["prediction"] == r["label"] for r in rows]) == pytest.approx(
        results["accuracy"]
    )
    # The fine-tuned backbone is a regular checkpoint...
    loaded = load_pretrained(str(workdir))
    assert loaded.step == 500 and loaded.tokenizer is not None
    # ...and fine-tuning from it again finds the task head too: evaluating it without any
    # training reproduces the accuracy.
    again = small_config(
        "sentiment_rt", str(workdir), shared_data, num_train_steps=0, eval_batch_size=256,
        max_seq_length=40,
    )  # fmt: skip
    again.data.train_files = ""  # evaluation only: no training data needed
    replay = run_cli(again, str(tmp_path / "replay"))  # as the run evaluated: one device
    assert replay["init"]["missing"] == []
    assert replay["accuracy"] == pytest.approx(results["accuracy"], abs=1e-6)
    # Batches padded to max_seq_length (no length buckets) predict exactly the same.
    again.length_buckets = False
    run_cli(again, str(tmp_path / "padded"))
    with open(tmp_path / "padded" / "predictions.jsonl") as f:
        assert [json.loads(line) for line in f] == rows


def cosmos_config(init: str, shared_data: str, **overrides):
    """The mc_cosmosqa run of these tests (test_catalog_tasks evaluates its model on RACE)."""
    settings = dict(
        learning_rate=1e-3, num_train_steps=250, warmup_steps=25, batch_size=16,
        eval_batch_size=64, max_seq_length=64, max_qa_length=24,
    )  # fmt: skip
    return small_config("mc_cosmosqa", init, shared_data, **{**settings, **overrides})


def squad_shifts_config(init: str, shared_data: str, **overrides):
    """The SQuAD-Shifts run of these tests: train on new_wiki, evaluate on nyt (test_catalog_tasks
    repeats it through TFDS squad/v1.1 files)."""
    settings = dict(
        learning_rate=1e-3, num_train_steps=60, warmup_steps=6, batch_size=16,
        eval_batch_size=64, max_seq_length=128, doc_stride=64, max_query_length=24,
    )  # fmt: skip
    settings.update({"data.max_train_examples": 400, "data.max_eval_examples": 120})
    return small_config("squad_shifts", init, shared_data, **{**settings, **overrides})


def _cached_run(tmp_path_factory, name: str, make_config, cli: bool = False) -> str:
    """Runs `finetune_and_evaluate(make_config(), DIR/name)` once per session (DIR: conftest's
    `session_dir`, shared by the xdist workers, like `pretrained_workdir`), so other test
    modules reuse the run; returns the workdir. `cli`: through `run_cli` (one device) instead
    of in this process (the tests' 8 devices, as the runs that tests repeat in-process need).
    A run left unfinished by an earlier failure resumes from its checkpoint."""
    workdir = session_dir(tmp_path_factory) / name
    run = run_cli if cli else finetune.finetune_and_evaluate
    build_once(workdir / finetune.EVAL_RESULTS_FILE, lambda: run(make_config(), str(workdir)))
    return str(workdir)


def cosmos_run(tmp_path_factory, shared_data: str) -> str:
    """mc_cosmosqa fine-tuned from the pretrained tiny model (workdir), on one device."""
    init = pretrained_workdir(tmp_path_factory, shared_data)
    make = functools.partial(cosmos_config, init, shared_data)
    return _cached_run(tmp_path_factory, "finetune_cosmos", make, cli=True)


def squad_shifts_run(tmp_path_factory, shared_data: str) -> str:
    """SQuAD-Shifts fine-tuned from the pretrained tiny model (workdir)."""
    init = pretrained_workdir(tmp_path_factory, shared_data)
    make = functools.partial(squad_shifts_config, init, shared_data)
    return _cached_run(tmp_path_factory, "finetune_squad_shifts", make)


def sentiment_tiny_config(tokenizer: str, shared_data: str, **overrides):
    """tiny_scratch_config on 200 sentiment_rt train / 128 dev sentences (max_*_examples: a
    fixed random subset of each file). 200 / 32 = 6 steps an epoch: the 12 steps span two
    epochs (two data permutations)."""
    train, dev = task_files(shared_data, "sentiment_rt")
    return tiny_scratch_config(
        "sentiment_rt", tokenizer,
        **{"data.train_files": train, "data.eval_files": dev, "data.max_train_examples": 200,
           "data.max_eval_examples": 128, **overrides},
    )  # fmt: skip


def sentiment_tiny_run(tmp_path_factory, shared_data: str) -> str:
    """The sentiment_tiny_config run (the resume tests' straight run; glue/sst2 written from the
    same records must reproduce it bit for bit)."""
    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    make = functools.partial(sentiment_tiny_config, spm, shared_data)
    return _cached_run(tmp_path_factory, "finetune_tiny_sentiment", make)


def test_mc_cosmosqa_beats_chance(tmp_path_factory, shared_data):
    results = _read_results(cosmos_run(tmp_path_factory, shared_data))
    print("mc_cosmosqa dev:", {k: results[k] for k in ("accuracy", "chance_accuracy")})
    assert results["num_examples"] == 621 and results["step"] == 250
    assert 0.30 < results["chance_accuracy"] < 0.31  # 3 or 4 options per question
    assert results["accuracy"] > results["chance_accuracy"] + 0.03


def test_squad_shifts_end_to_end(tmp_path_factory, shared_data):
    workdir = squad_shifts_run(tmp_path_factory, shared_data)
    results = _read_results(workdir)
    print("squad_shifts nyt:", {k: results[k] for k in ("exact_match", "f1")})
    assert results["total"] == 120 and results["missing_predictions"] == 0
    assert 0.0 <= results["exact_match"] <= results["f1"] <= 100.0
    with open(os.path.join(workdir, "predictions.json")) as f:
        predictions = json.load(f)
    examples = local.read_squad(task_files(shared_data, "squad_shifts")[1])
    examples = [examples[i] for i in registry.subset(len(examples), 120)]  # max_eval_examples
    assert set(predictions) == {e.id for e in examples}
    # Every prediction is an exact substring of its context (offsets map back to the original).
    contexts = {e.id: e.context for e in examples}
    assert all(text in contexts[qid] for qid, text in predictions.items())
    assert sum(bool(t) for t in predictions.values()) > 100
    # The evaluator, run on the written file, reports the same numbers.
    dataset = registry.squad.squad_json(examples, "v1.1")
    assert squad_eval.evaluate(dataset, predictions)["f1"] == pytest.approx(results["f1"])


# ------------------------------------------------------------------------- foreign checkpoints
def _hf_checkpoint(directory, tokenizer_path: str) -> str:
    os.environ.setdefault("USE_TF", "0")
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AlbertConfig(vocab_size=VOCAB_SIZE, hidden_act="gelu_new", **TINY_MODEL)
    transformers.AlbertForPreTraining(config).save_pretrained(directory)
    shutil.copyfile(tokenizer_path, os.path.join(directory, "spiece.model"))
    return str(directory)


def _official_names(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random tensors under the official google-research/albert variable names."""
    V, E, H, F = VOCAB_SIZE, TINY_MODEL["embedding_size"], TINY_MODEL["hidden_size"], 128
    P = TINY_MODEL["max_position_embeddings"]
    block = "bert/encoder/transformer/group_0/inner_group_0"
    shapes = {
        "bert/embeddings/word_embeddings": (V, E),
        "bert/embeddings/token_type_embeddings": (2, E),
        "bert/embeddings/position_embeddings": (P, E),
        "bert/embeddings/LayerNorm/gamma": (E,),
        "bert/embeddings/LayerNorm/beta": (E,),
        "bert/encoder/embedding_hidden_mapping_in/kernel": (E, H),
        "bert/encoder/embedding_hidden_mapping_in/bias": (H,),
        **{f"{block}/attention_1/self/{p}/kernel": (H, H) for p in ("query", "key", "value")},
        **{f"{block}/attention_1/self/{p}/bias": (H,) for p in ("query", "key", "value")},
        f"{block}/attention_1/output/dense/kernel": (H, H),
        f"{block}/attention_1/output/dense/bias": (H,),
        f"{block}/LayerNorm/gamma": (H,),
        f"{block}/LayerNorm/beta": (H,),
        f"{block}/ffn_1/intermediate/dense/kernel": (H, F),
        f"{block}/ffn_1/intermediate/dense/bias": (F,),
        f"{block}/ffn_1/intermediate/output/dense/kernel": (F, H),
        f"{block}/ffn_1/intermediate/output/dense/bias": (H,),
        f"{block}/LayerNorm_1/gamma": (H,),
        f"{block}/LayerNorm_1/beta": (H,),
        "bert/pooler/dense/kernel": (H, H),
        "bert/pooler/dense/bias": (H,),
        "cls/predictions/transform/dense/kernel": (H, E),
        "cls/predictions/transform/dense/bias": (E,),
        "cls/predictions/transform/LayerNorm/gamma": (E,),
        "cls/predictions/transform/LayerNorm/beta": (E,),
        "cls/predictions/output_bias": (V,),
        "cls/seq_relationship/output_weights": (2, H),
        "cls/seq_relationship/output_bias": (2,),
    }
    return {
        name: (1.0 if name.endswith("gamma") else 0.0)
        + 0.02 * rng.standard_normal(shape).astype(np.float32)
        for name, shape in shapes.items()
    }


def _tf1_checkpoint(directory, tokenizer_path: str) -> str:
    """An official-layout dir: albert_config.json, model.ckpt-N (TF1 Saver), 30k-clean.model."""
    import tensorflow as tf

    os.makedirs(directory, exist_ok=True)
    official = {
        **TINY_MODEL,
        "vocab_size": VOCAB_SIZE,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "num_hidden_groups": 1,
        "inner_group_num": 1,
    }
    with open(os.path.join(directory, "albert_config.json"), "w") as f:
        json.dump(official, f)
    graph = tf.Graph()
    with graph.as_default():
        values = _official_names(np.random.default_rng(0))
        variables = [tf.compat.v1.Variable(v, name=n) for n, v in values.items()]
        variables.append(tf.compat.v1.train.get_or_create_global_step())
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            saver.save(session, os.path.join(directory, "model.ckpt"), global_step=3)
    shutil.copyfile(tokenizer_path, os.path.join(directory, "30k-clean.model"))
    return str(directory)


@pytest.mark.parametrize("source", ["hf", "tf"])
def test_init_from_foreign_checkpoints(source, tmp_path, tmp_path_factory, shared_data):
    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    make = _hf_checkpoint if source == "hf" else _tf1_checkpoint
    init = make(tmp_path / source, spm)
    if source == "hf":
        # squad_v2 (the XLNet-style head) on SQuAD-format data: the whole v2 path in a few steps.
        task, num_eval = "squad_v2", 16
        config = small_config(
            "squad_shifts", init, shared_data,
            num_train_steps=4, warmup_steps=1, learning_rate=1e-4, batch_size=8,
            eval_batch_size=16, max_seq_length=96, max_query_length=16, doc_stride=48,
            **{"data.max_train_examples": 24, "data.max_eval_examples": 16},
        )  # fmt: skip
        config.task = task
    else:
        # The tiny sentiment run with the TF1 weights instead of a random init: the official
        # layout gives the same architecture, so the run reuses its compiled train step.
        task, num_eval = "sentiment_rt", 128
        config = sentiment_tiny_config(spm, shared_data)
        for field in TINY_MODEL:  # the architecture now comes from albert_config.json
            del config.model[field]
        config.init = init
    results = finetune.finetune_and_evaluate(config, str(tmp_path / "run"))
    init_report = results["init"]
    assert init_report["source"] == source and init_report["loaded"] > 20
    head = "squad_v2/" if task == "squad_v2" else "classifier/"
    assert init_report["missing"] and all(p.startswith(head) for p in init_report["missing"])
    assert {p.split("/")[0] for p in init_report["unexpected"]} == {"predictions", "sop_classifier"}
    if task == "squad_v2":
        assert results["version"] == "2.0" and results["total"] == 16
        assert "best_f1" in results and "HasAns_f1" in results
        with open(tmp_path / "run" / "na_probs.json") as f:
            na_probs = json.load(f)
        assert len(na_probs) == 16 and all(0.0 <= p <= 1.0 for p in na_probs.values())
    else:
        assert results["num_examples"] == num_eval and 0.0 <= results["accuracy"] <= 1.0
        assert results["step"] == 12


def test_init_with_another_tokenizer_is_refused(tmp_path_factory, shared_data, tmp_path):
    """A data.tokenizer other than the checkpoint's, no larger than its vocabulary, read the
    pretrained embeddings through unrelated ids without a word."""
    from albert_jax.data.tokenizer import train_tokenizer

    init = pretrained_workdir(tmp_path_factory, shared_data)
    other = tmp_path / "other"
    train_tokenizer(_corpus_texts(shared_data, 10), str(other), 1000, max_sentences=3000)
    config = small_config("sentiment_rt", init, shared_data)
    config.data.tokenizer = f"{other}.model"
    expected = f"config.data.tokenizer='{other}.model' is not the tokenizer of the checkpoint"
    with pytest.raises(ValueError, match=re.escape(expected)):
        finetune.finetune_and_evaluate(config, str(tmp_path / "run"))
    config.data.tokenizer = tiny_tokenizer_path(tmp_path_factory, shared_data)  # the same one
    config.data.allow_other_tokenizer = False
    spec = finetune_config.validate_config(config)
    mesh = create_mesh((-1, 1, 1))
    assert finetune.fine_tuning(
        config, str(tmp_path / "same"), spec, mesh
    ).data.tokenizer.vocab_size


def test_a_workdir_of_another_run_kind_is_refused_naming_both(
    tmp_path_factory, shared_data, tmp_path
):
    """#58: fine-tuning into a pretraining workdir was refused with advice to delete its
    (healthy) checkpoints, and a task change on resume named only a data fingerprint."""
    pretraining = str(tmp_path / "pretraining")
    shutil.copytree(pretrained_workdir(tmp_path_factory, shared_data), pretraining)
    config = small_config("sentiment_rt", pretraining, shared_data)
    expected = (
        f"cannot resume {pretraining} at step 60: it holds the checkpoints of a pretraining "
        f"run, and this config fine-tunes task 'sentiment_rt'; to fine-tune from it, pass "
        f"--config.init={pretraining} and a new --workdir. Its checkpoints are fine"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        finetune.finetune_and_evaluate(config, pretraining)

    sentiment = str(tmp_path / "sentiment")
    shutil.copytree(sentiment_tiny_run(tmp_path_factory, shared_data), sentiment)
    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    train, dev = task_files(shared_data, "nli_vitaminc")
    config = tiny_scratch_config(
        "nli_vitaminc", spm,
        **{"data.train_files": train, "data.eval_files": dev, "data.max_train_examples": 64,
           "data.max_eval_examples": 32},
    )  # fmt: skip
    expected = (
        "it holds the checkpoints of a fine-tuning run of task 'sentiment_rt', and this config "
        "fine-tunes task 'nli_vitaminc'; use a new --workdir (or --config.task=sentiment_rt to "
        "continue that run)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        finetune.finetune_and_evaluate(config, sentiment)
