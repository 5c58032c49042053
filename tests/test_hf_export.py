"""`convert --to=hf` of fine-tuning runs (albert_jax.interop.hf_task_export): each head the
tiny models trained on the real local task sets is written as its transformers class, which
loads with no weight initialized afresh, gives our logits within 1e-4 (fp32) on the run's own
features, and predicts the labels our evaluation predicted (predictions.jsonl /
predictions.json) on the whole eval set; the classifiers also through `pipeline` on raw text of
the whole sentiment_rt dev file. Bad requests are one-line `error:`s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, build_once, run_convert, session_dir
from test_finetune import task_files, tiny_scratch_config, tiny_tokenizer_path

from albert_jax.finetune import train as finetune
from albert_jax.interop.hf_task_export import export_hf_task_model, fine_tuning_run
from albert_jax.interop.weight_names import unflatten_params
from albert_jax.pretrained import read_checkpoint, save_model_dir
from albert_jax.tasks import local, registry
from albert_jax.tasks.kinds import get_kind
from albert_jax.tasks.squad_predictions import predict_v1

os.environ.setdefault("USE_TF", "0")  # transformers: torch classes only
TOLERANCE = 1e-4  # fp32 logits, ours vs transformers'


# ------------------------------------------------------------------------------------- runs
def _run(tmp_path_factory, shared_data, name: str, task: str, data: str, **overrides) -> tuple:
    """(workdir, config) of a tiny fine-tuning run from scratch (test_finetune's
    `tiny_scratch_config`: 12 steps, real data), once per session."""
    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    train, dev = task_files(shared_data, data)
    config = tiny_scratch_config(
        task, spm, **{"data.train_files": train, "data.eval_files": dev, **overrides}
    )
    workdir = session_dir(tmp_path_factory) / f"hf_export_{name}"
    build_once(
        workdir / finetune.EVAL_RESULTS_FILE,
        lambda: finetune.finetune_and_evaluate(config, str(workdir)),
    )
    return str(workdir), config


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory, shared_data):
    """sentiment_rt, two seeds in one program (params [2, ...])."""
    return _run(
        tmp_path_factory, shared_data, "sentiment", "sentiment_rt", "sentiment_rt",
        num_seeds=2, **{"data.max_train_examples": 200, "data.max_eval_examples": 128},
    )  # fmt: skip


@pytest.fixture(scope="module")
def sentiment_score(tmp_path_factory, shared_data):
    """sentiment_rt_score: regression on the mean human rating."""
    return _run(
        tmp_path_factory, shared_data, "score", "sentiment_rt_score", "sentiment_rt",
        **{"data.max_train_examples": 200, "data.max_eval_examples": 128},
    )  # fmt: skip


@pytest.fixture(scope="module")
def cosmos(tmp_path_factory, shared_data):
    """mc_cosmosqa: 3 or 4 options per question (padded to 4, masked)."""
    return _run(
        tmp_path_factory, shared_data, "cosmos", "mc_cosmosqa", "mc_cosmosqa",
        num_train_steps=6, batch_size=16, max_seq_length=64, max_qa_length=24,
        **{"data.max_train_examples": 96, "data.max_eval_examples": 96},
    )  # fmt: skip


@pytest.fixture(scope="module")
def squad(tmp_path_factory, shared_data):
    """SQuAD-Shifts (v1.1 spans): new_wiki -> nyt."""
    return _run(
        tmp_path_factory, shared_data, "squad", "squad_shifts", "squad_shifts",
        num_train_steps=6, batch_size=16, max_seq_length=96, doc_stride=48,
        max_query_length=16, **{"data.max_train_examples": 64, "data.max_eval_examples": 24},
    )  # fmt: skip


@pytest.fixture(scope="module")
def squad_v2(tmp_path_factory, shared_data):
    """A SQuAD v2 head (XLNet's beam), evaluated untrained (its head saved as the run's
    model)."""
    return _run(
        tmp_path_factory, shared_data, "squad_v2", "squad_v2", "squad_shifts",
        num_train_steps=0, eval_batch_size=8, max_seq_length=64, doc_stride=32,
        max_query_length=16, **{"data.max_train_examples": 8, "data.max_eval_examples": 4},
    )  # fmt: skip


# ---------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def transformers_warnings():
    """Collects the messages transformers logs at WARNING and above (its loggers do not
    propagate to the root, so pytest's caplog would not see them)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger, handler = logging.getLogger("transformers"), Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def load_hf(auto_class: str, directory: str):
    """`transformers.<auto_class>.from_pretrained(directory)`, asserting that every weight came
    from the file (none missing, unexpected or re-initialized, nothing warned about)."""
    import transformers

    with transformers_warnings() as warnings:
        model, info = getattr(transformers, auto_class).from_pretrained(
            directory, output_loading_info=True
        )
    assert all(not v for v in info.values()), info
    assert not [w for w in warnings if "initialized" in w or "not used" in w], warnings
    return model.eval()


def ours(workdir: str, config, features: dict, run_seed: int | None = None) -> dict:
    """Our model's outputs on `features` ({name: [N, ...]}): the run's head and weights."""
    spec = registry.get_task(config.task)
    checkpoint = read_checkpoint(workdir, run_seed=run_seed)
    model = finetune.build_model(spec, checkpoint.config, config)
    params = unflatten_params(checkpoint.weights)["params"]
    kind = get_kind(spec.kind)
    apply = jax.jit(lambda p, b: kind.apply(model, p, b, train=False))
    batch = {k: features[k] for k in kind.predict_inputs}
    return {k: np.asarray(v) for k, v in apply(params, batch).items()}


def torch_inputs(features: dict, rows=slice(None)) -> dict:
    import torch

    names = {
        "input_ids": "input_ids",
        "segment_ids": "token_type_ids",
        "input_mask": "attention_mask",
    }
    return {
        hf: torch.as_tensor(np.asarray(features[k][rows]), dtype=torch.long)
        for k, hf in names.items()
    }


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def whole_dev(shared_data: str, task: str, reader: str, config, tokenizer):
    """The whole dev file of `reader` (no max_eval_examples): its examples and features."""
    examples = local.read_task(reader, task_files(shared_data, task)[1])
    spec = registry.get_task(config.task)
    return examples, get_kind(spec.kind).featurize(examples, tokenizer, config, spec).arrays


# ------------------------------------------------------------------------------------ tests
def test_classifier_of_several_seeds_exports_to_sequence_classification(
    sentiment, shared_data, tmp_path
):
    import torch
    import transformers

    workdir, config = sentiment
    with open(os.path.join(workdir, finetune.EVAL_RESULTS_FILE)) as f:
        results = json.load(f)
    scores = {int(s): m["accuracy"] for s, m in results["per_seed"].items()}
    best = max(sorted(scores), key=scores.get)

    # The CLI, without --run_seed: the best seed by accuracy, and it says which.
    dst = tmp_path / "best"
    done = run_convert("--to=hf", f"--src={workdir}", f"--dst={dst}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote HF AlbertForSequenceClassification of task 'sentiment_rt'" in done.stdout
    assert f"seed {best} (best accuracy {scores[best]:.4g} of seeds" in done.stdout, done.stdout
    hf_config = json.loads((dst / "config.json").read_text())
    assert hf_config["architectures"] == ["AlbertForSequenceClassification"]
    assert hf_config["id2label"] == {"0": "negative", "1": "positive"}
    assert hf_config["label2id"] == {"negative": 0, "positive": 1}
    assert hf_config["problem_type"] == "single_label_classification"
    assert hf_config["albert_jax"]["run_seed"] == best
    assert {p.name for p in dst.iterdir()} >= {
        "config.json", "model.safetensors", "spiece.model", "tokenizer_config.json",
        "special_tokens_map.json",
    }  # fmt: skip

    # Each seed on demand (in process): the other seed's weights, same layout.
    other = next(s for s in scores if s != best)
    run = fine_tuning_run(workdir)
    written = export_hf_task_model(run, str(tmp_path / "other"), run_seed=other)
    assert written["run_seed"] == other and written["seed_choice"] == "--run_seed"

    tokenizer = read_checkpoint(workdir, run_seed=best).tokenizer
    examples, features = whole_dev(shared_data, "sentiment_rt", "sentiment_rt", config, tokenizer)
    for seed, directory in ((best, dst), (other, tmp_path / "other")):
        model = load_hf("AutoModelForSequenceClassification", str(directory))
        with torch.no_grad():
            theirs = model(**torch_inputs(features)).logits.numpy()
        mine = ours(workdir, config, features, run_seed=seed)["logits"]
        diff = float(np.max(np.abs(theirs - mine)))
        print(
            f"sentiment_rt seed {seed}: {len(examples)} dev examples, max |logit diff| {diff:.2e}"
        )
        assert diff < TOLERANCE
        np.testing.assert_array_equal(theirs.argmax(-1), mine.argmax(-1))
    # ...and the labels the run's own evaluation wrote, example by example.
    predicted = {e.id: int(p) for e, p in zip(examples, mine.argmax(-1), strict=True)}
    written_rows = read_jsonl(os.path.join(workdir, f"seed_{other}", "predictions.jsonl"))
    assert len(written_rows) == 128
    assert all(predicted[r["id"]] == r["prediction"] for r in written_rows)

    # The exported tokenizer (what AutoTokenizer and pipelines load) gives our features' ids
    # on every sentence of the file: [CLS] ... [SEP], cut at the run's max_seq_length.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(dst))
    ids = hf_tokenizer([e.text_a for e in examples], truncation=True)["input_ids"]
    mask = features["input_mask"].astype(bool)
    assert [list(i) for i in ids] == [
        row[m].tolist() for row, m in zip(features["input_ids"], mask, strict=True)
    ]
    # The pipeline on raw text (its own tokenizer, loaded from the export) of the whole file.
    classify = transformers.pipeline("text-classification", model=str(dst), device="cpu")
    with transformers_warnings() as warnings:
        answers = classify([e.text_a for e in examples], truncation=True, batch_size=64)
    assert not [w for w in warnings if "initialized" in w], warnings
    mine = ours(workdir, config, features, run_seed=best)["logits"].argmax(-1)
    expected = [hf_config["id2label"][str(i)] for i in mine]
    agree = np.mean([a["label"] == x for a, x in zip(answers, expected, strict=True)])
    print(f"pipeline vs our eval on {len(examples)} sentences: {agree:.4f} agree")
    assert agree == 1.0


def test_regression_exports_with_problem_type_regression(sentiment_score, shared_data, tmp_path):
    import torch
    import transformers

    workdir, config = sentiment_score
    run = fine_tuning_run(workdir)
    written = export_hf_task_model(run, str(tmp_path / "hf"))
    assert written["hf_class"] == "AlbertForSequenceClassification" and written["run_seed"] is None
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["problem_type"] == "regression" and hf_config["id2label"] == {"0": "score"}
    model = load_hf("AutoModelForSequenceClassification", str(tmp_path / "hf"))
    checkpoint = read_checkpoint(workdir)
    examples, features = whole_dev(
        shared_data, "sentiment_rt", "sentiment_rt_score", config, checkpoint.tokenizer
    )
    with torch.no_grad():
        theirs = model(**torch_inputs(features)).logits.numpy()
    mine = ours(workdir, config, features)["logits"]
    diff = float(np.max(np.abs(theirs - mine)))
    print(f"sentiment_rt_score: {len(examples)} dev examples, max |output diff| {diff:.2e}")
    assert theirs.shape == (len(examples), 1) and diff < TOLERANCE
    by_id = {e.id: float(v) for e, v in zip(examples, mine[:, 0], strict=True)}
    for row in read_jsonl(os.path.join(workdir, "predictions.jsonl")):
        assert abs(by_id[row["id"]] - row["prediction"]) < TOLERANCE
    # The pipeline gives the raw score (no sigmoid), as problem_type says.
    regress = transformers.pipeline("text-classification", model=str(tmp_path / "hf"))
    answers = regress([e.text_a for e in examples], truncation=True, batch_size=64)
    assert {a["label"] for a in answers} == {"score"}
    np.testing.assert_allclose([a["score"] for a in answers], mine[:, 0], atol=TOLERANCE)


def exported(workdir, config, tmp_path, hf_class: str):
    """The run exported to tmp_path/hf as `hf_class` (asserted), loaded by its Auto class, and
    the task's eval file featurized (`.arrays`: {name: [N, ...]})."""
    written = export_hf_task_model(fine_tuning_run(workdir), str(tmp_path / "hf"))
    assert written["hf_class"] == hf_class
    model = load_hf(hf_class.replace("Albert", "AutoModel"), str(tmp_path / "hf"))
    checkpoint = read_checkpoint(workdir)
    [eval_set] = registry.read_eval(config.task, config.data)
    features = registry.featurize(config.task, eval_set.examples, checkpoint.tokenizer, config)
    return model, features


def test_multiple_choice_exports_to_multiple_choice(cosmos, tmp_path):
    import torch

    workdir, config = cosmos
    model, features = exported(workdir, config, tmp_path, "AlbertForMultipleChoice")
    arrays = features.arrays
    mine = ours(workdir, config, arrays)["logits"]  # [N, 4], padding options -1e30
    # HF has no option mask: each question goes in with its real options only.
    options = arrays["option_mask"].sum(1)
    predicted, diff = np.zeros(len(options), int), 0.0
    for count in np.unique(options):
        rows = np.flatnonzero(options == count)
        sliced = {k: arrays[k][rows][:, :count] for k in ("input_ids", "segment_ids", "input_mask")}
        with torch.no_grad():
            theirs = model(**torch_inputs(sliced)).logits.numpy()  # [n, count]
        diff = max(diff, float(np.max(np.abs(theirs - mine[rows, :count]))))
        predicted[rows] = theirs.argmax(-1)
    print(f"mc_cosmosqa: {len(options)} questions ({sorted(set(options.tolist()))} options), "
          f"max |logit diff| {diff:.2e}")  # fmt: skip
    assert set(options.tolist()) == {3, 4} and diff < TOLERANCE
    rows = read_jsonl(os.path.join(workdir, "predictions.jsonl"))
    assert [r["prediction"] for r in rows] == predicted.tolist()


def test_span_head_exports_to_question_answering(squad, tmp_path):
    import torch

    workdir, config = squad
    model, features = exported(workdir, config, tmp_path, "AlbertForQuestionAnswering")
    arrays = features.arrays
    mine = ours(workdir, config, arrays)
    with torch.no_grad():
        out = model(**torch_inputs(arrays))
    assert_spans_match({k: getattr(out, k).numpy() for k in SPAN_LOGITS}, mine, features,
                       config, workdir)  # fmt: skip


SPAN_LOGITS = ("start_logits", "end_logits")


def assert_spans_match(theirs: dict, mine: dict, features, config, workdir: str) -> None:
    """Another runtime's span logits ({name: [F, S'] for S' <= S}, padding scored, not masked)
    equal ours at the real tokens within TOLERANCE, and give the answers the run's own
    evaluation wrote (predictions.json)."""
    real = features.arrays["input_mask"].astype(bool)  # ours gives padding -1e30
    masked, diff = {}, 0.0
    for name in SPAN_LOGITS:
        logits = np.full(real.shape, -1e30, np.float32)
        logits[:, : theirs[name].shape[1]] = theirs[name]
        diff = max(diff, float(np.max(np.abs(logits - mine[name])[real])))
        masked[name] = np.where(real, logits, -1e30)
    print(f"squad_shifts: {len(real)} windows, max |logit diff| {diff:.2e}")
    assert diff < TOLERANCE
    answers = predict_v1(
        features, masked["start_logits"], masked["end_logits"], config.n_best_size,
        config.max_answer_length,
    ).answers  # fmt: skip
    with open(os.path.join(workdir, "predictions.json")) as f:
        assert answers == json.load(f)


def test_bad_exports_are_one_line_errors(sentiment, squad_v2, tmp_path):
    from albert_jax.model.albert import AlbertForPreTraining, init_params

    workdir, _ = sentiment
    v2, _ = squad_v2
    # A pretraining-only checkpoint: a model dir of the tiny model.
    checkpoint = read_checkpoint(workdir, run_seed=0)
    pretrained = tmp_path / "pretrained"
    variables = init_params(AlbertForPreTraining(checkpoint.config), jax.random.key(0))
    save_model_dir(str(pretrained), jax.tree.map(np.asarray, variables), checkpoint.config)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine\n")

    cases = {
        "v2": (
            [f"--src={v2}", f"--dst={tmp_path / 'v2'}"],
            "its span_v2 head (task 'squad_v2') has no HF transformers class; heads that "
            "export: classification -> AlbertForSequenceClassification, regression -> "
            "AlbertForSequenceClassification, multiple_choice -> AlbertForMultipleChoice, "
            "span_v1 -> AlbertForQuestionAnswering",
        ),
        "pretraining": (
            [f"--src={pretrained}", f"--dst={tmp_path / 'pt'}",
             "--hf_class=AlbertForSequenceClassification"],
            f"--hf_class=AlbertForSequenceClassification: {pretrained} holds no fine-tuned task "
            "head (a pretraining checkpoint), so it exports as AlbertForPreTraining only",
        ),
        "other class": (
            [f"--src={workdir}", f"--dst={tmp_path / 'qa'}", "--run_seed=0",
             "--hf_class=AlbertForQuestionAnswering"],
            "which exports as AlbertForSequenceClassification only",
        ),
        "no such seed": (
            [f"--src={workdir}", f"--dst={tmp_path / 'seed'}", "--run_seed=7"],
            "holds the runs of seeds [0, 1] (no run of seed 7)",
        ),
        "occupied": (
            [f"--src={workdir}", f"--dst={occupied}"],
            f"--dst={occupied} already holds notes.txt: an export dir must be new or empty",
        ),
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "albert_jax.convert", "--to=hf", *args], cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for name, (args, _) in cases.items()
    }  # fmt: skip
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1, (name, stderr[-3000:])
        assert cases[name][1] in errors[0], (name, errors[0])
    assert sorted(p.name for p in occupied.iterdir()) == ["notes.txt"]
    for name in ("v2", "pt", "qa", "seed"):
        assert not (tmp_path / name).exists(), name
