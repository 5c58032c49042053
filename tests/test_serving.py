"""The StableHLO serving artifact (`albert_jax.export`, `albert_jax.serving`) and batch
prediction (`albert_jax.predict`) on the tiny runs test_hf_export fine-tunes on the real local
task sets: the artifact predicts what the model in process predicts (within 1e-5, fp32) and
what the run's own evaluation predicted, from raw records of the task's eval files, loaded
without the model code; bad requests are one-line errors and bad lines are skipped and counted.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, run_cli
from test_finetune import task_files
from test_hf_export import (  # noqa: F401
    cosmos,
    read_jsonl,
    sentiment,
    sentiment_score,
    squad,
    squad_v2,
)

from albert_jax import export, predict, serving
from albert_jax.tasks import local

CLOSE = 1e-5  # fp32: the artifact against the jitted model in process


def dev_records(shared_data: str, task: str) -> list[dict]:
    """The raw records of a local task's dev file (SQuAD: one {"id", "question", "context"}
    per question), as a user would hand them to `predict`."""
    path = task_files(shared_data, task)[1]
    if task == "squad_shifts":
        return [
            {"id": e.id, "question": e.question, "context": e.context}
            for e in local.read_squad(path)
        ]
    with gzip.open(path, "rt") as f:
        return [{"id": f"dev-{i}", **json.loads(line)} for i, line in enumerate(f)]


def compare(mine: list[dict], theirs: list[dict], exact: tuple[str, ...], close: tuple[str, ...]):
    """Asserts record by record: `exact` keys equal, `close` keys within CLOSE."""
    assert [r["id"] for r in mine] == [r["id"] for r in theirs]
    for key in exact:
        assert [r[key] for r in mine] == [r[key] for r in theirs], key
    for key in close:  # per record: probabilities over 3 or 4 options are ragged
        pairs = zip(mine, theirs, strict=True)
        worst = max(float(np.max(np.abs(np.subtract(a[key], b[key])))) for a, b in pairs)
        assert worst < CLOSE, (key, worst)


# ------------------------------------------------------------------------------------ tests
def test_the_artifact_serves_what_the_model_does(sentiment, shared_data, tmp_path):
    workdir, _ = sentiment
    with open(os.path.join(workdir, "eval_results.json")) as f:
        scores = {int(s): m["accuracy"] for s, m in json.load(f)["per_seed"].items()}
    best = max(sorted(scores), key=scores.get)
    manifest = export.export_artifact(workdir, str(tmp_path / "art"))
    assert manifest["platforms"] == ["cpu", "cuda", "tpu"]
    assert manifest["source"]["run_seed"] == best
    assert manifest["labels"] == ["negative", "positive"]
    assert manifest["fields"] == {"text_a": "sentence"} and manifest["max_seq_length"] == 32
    assert sorted(manifest["functions"]) == ["embed", "predict"]

    served, model = serving.load(str(tmp_path / "art")), export.in_process(workdir)
    records = dev_records(shared_data, "sentiment_rt")  # 1109 sentences of mixed length
    mine = served.predict(records)
    compare(mine, model.predict(records), ("label", "label_index"), ("probabilities",))
    # ...and the labels the run's own evaluation wrote for its best seed.
    written = read_jsonl(os.path.join(workdir, f"seed_{best}", "predictions.jsonl"))
    by_id = {r["id"]: r["label_index"] for r in mine}
    assert len(written) == 128 and all(by_id[r["id"]] == r["prediction"] for r in written)
    # Odd batch sizes (a short last batch padded) give the same outputs.
    compare(served.predict(records[:45], batch_size=7), mine[:45], ("label",), ("score",))
    texts = [r["sentence"] for r in records[:70]]
    for pooling in serving.POOLINGS:
        a, b = served.embed(texts, pooling), model.embed(texts, pooling)
        assert a.shape == (70, 64) and np.max(np.abs(a - b)) < CLOSE


@pytest.mark.parametrize(
    "run, task, exact, close",
    [
        ("sentiment_score", "sentiment_rt", (), ("score",)),
        ("cosmos", "mc_cosmosqa", ("choice",), ("probabilities",)),
        ("squad", "squad_shifts", ("answer",), ("probability",)),
        ("squad_v2", "squad_shifts", ("answer", "best_span"), ("no_answer_probability",)),
    ],
)
def test_every_kind_serves_from_its_eval_file(run, task, exact, close, request, shared_data,
                                               tmp_path):  # fmt: skip
    workdir, config = request.getfixturevalue(run)
    export.export_artifact(workdir, str(tmp_path / "art"), platforms=("cpu",))
    served = serving.load(str(tmp_path / "art"))
    records = dev_records(shared_data, task)
    if task == "squad_shifts":  # the questions the run evaluated, and more
        with open(os.path.join(workdir, "predictions.json")) as f:
            answers = json.load(f)
        records = [r for r in records if r["id"] in answers] + records[:16]
    records = records[:300]
    mine = served.predict(records)
    compare(mine, export.in_process(workdir).predict(records), exact, close)
    evaluated = {r["id"]: r for r in mine}
    if task == "squad_shifts":  # the run's own predictions.json
        assert len(answers) in (4, 24)
        assert all(evaluated[q]["answer"] == a for q, a in answers.items())
        return
    for row in read_jsonl(os.path.join(workdir, "predictions.jsonl")):
        if row["id"] in evaluated:
            value = evaluated[row["id"]][exact[0] if exact else "score"]
            assert abs(value - row["prediction"]) < 1e-4, row


def test_serving_loads_no_model_code_and_the_encoder_exports(sentiment, tmp_path):
    import jax

    from albert_jax import load_pretrained
    from albert_jax.model.albert import AlbertForPreTraining, init_params
    from albert_jax.pretrained import read_checkpoint, save_model_dir

    workdir, _ = sentiment
    export.export_artifact(workdir, str(tmp_path / "art"), run_seed=0, platforms=("cpu",))
    code = (
        "import sys; from albert_jax import serving\n"
        f"s = serving.load({str(tmp_path / 'art')!r})\n"
        "print(s.predict([{'id': 'a', 'sentence': 'A gem of a film.'}])[0]['label'])\n"
        "heavy = ('flax', 'optax', 'orbax', 'albert_jax.model', 'albert_jax.finetune.train',"
        " 'albert_jax.tasks.kinds')\n"
        "print(sorted({m.split('.')[0] if m.startswith(heavy[:3]) else m for m in sys.modules"
        " if m.startswith(heavy)}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    label, loaded = done.stdout.strip().splitlines()[-2:]
    assert label in ("negative", "positive") and loaded == "[]", done.stdout

    # A pretraining checkpoint (a model dir) exports its encoder, which embeds as the model
    # code does: the last layer's [CLS] state of `load_pretrained`'s AlbertForPreTraining.
    config = read_checkpoint(workdir, run_seed=0).config
    variables = init_params(AlbertForPreTraining(config), jax.random.key(3))
    save_model_dir(str(tmp_path / "pt"), jax.tree.map(np.asarray, variables), config,
                   tokenizer_path=os.path.join(workdir, "tokenizer.model"))  # fmt: skip
    manifest = export.export_artifact(str(tmp_path / "pt"), str(tmp_path / "enc"),
                                      max_seq_length=48, platforms=("cpu",))  # fmt: skip
    assert manifest["kind"] == "encoder" and list(manifest["functions"]) == ["embed"]
    encoder = serving.load(str(tmp_path / "enc"))
    texts = ["It is a truth universally acknowledged.", "Short.", "x " * 80]
    albert = load_pretrained(str(tmp_path / "pt"))
    features = encoder.featurize([encoder.example({"text": t}, str(i)) for i, t in
                                  enumerate(texts)]).arrays  # fmt: skip
    assert features["input_mask"].sum(1).max() == 48  # the long one cut to max_seq_length
    out = albert.model.apply(
        albert.variables, features["input_ids"], features["segment_ids"], features["input_mask"]
    )
    expected = np.asarray(out["sequence_output"])[:, 0]
    assert np.max(np.abs(encoder.embed(texts, "cls") - expected)) < CLOSE


def test_predict_streams_a_file_and_counts_bad_lines(sentiment, shared_data, tmp_path):
    workdir, _ = sentiment
    export.export_artifact(workdir, str(tmp_path / "art"), run_seed=1, platforms=("cpu",))
    path = task_files(shared_data, "sentiment_rt")[1]
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()[:200]
    bad = ['{"id": "x", "text": "the wrong field"}', "not json", '{"sentence": 7}']
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:  # lines 51, 102, 153 are bad
        f.write("\n".join(lines[:50] + bad[:1] + lines[50:100] + bad[1:2] + lines[100:150]
                          + bad[2:] + lines[150:]) + "\n")  # fmt: skip
    out = tmp_path / "out.jsonl"
    done = run_cli(
        "predict", f"--src={tmp_path / 'art'}", f"--input={tmp_path / 'in.jsonl.gz'}",
        f"--output={out}", "--chunk=64", "--batch_size=16", "--progress_every_s=0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped in.jsonl.gz:51: missing field 'sentence'" in done.stderr
    assert "skipped in.jsonl.gz:153: bad type 'sentence'" in done.stderr
    assert "predict: 203/203 lines (100%)" in done.stderr, done.stderr
    assert "wrote 200 predictions" in done.stdout
    assert "skipped 3 lines (bad type 'sentence': 1, invalid json: 1, missing field " in done.stdout
    rows = read_jsonl(out)
    # Ids are the generated ones (the records have none), counting every line as read.
    expected = [f"in-{i}" for i in range(203) if i not in (50, 101, 152)]
    assert [r["id"] for r in rows] == expected
    records = [{"id": i, **json.loads(x)} for i, x in zip(expected, lines, strict=True)]
    model = export.in_process(workdir, run_seed=1)
    compare(rows, model.predict(records), ("label",), ("probabilities",))

    # Embeddings from the fine-tuning workdir itself (in process), one line each.
    done = run_cli(
        "predict", f"--src={workdir}", "--run_seed=1", f"--input={tmp_path / 'in.jsonl.gz'}",
        f"--output={tmp_path / 'emb.jsonl'}", "--embed=mean",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    vectors = np.array([r["embedding"] for r in read_jsonl(tmp_path / "emb.jsonl")])
    texts = [r["sentence"] for r in records]
    assert vectors.shape == (200, 64)
    assert np.max(np.abs(vectors - model.embed(texts, "mean"))) < CLOSE


def test_export_and_predict_on_gcs(sentiment, gcs, shared_data, tmp_path):
    workdir, _ = sentiment
    art, data = gcs.url("serving/art"), gcs.url("serving/in.jsonl")
    env = gcs.subprocess_env()
    done = subprocess.run(
        [sys.executable, "-m", "albert_jax.export", f"--src={workdir}", f"--dst={art}",
         "--run_seed=0", "--platforms=cpu"],
        cwd=REPO, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote the classification model of task 'sentiment_rt' (step 12, seed 0" in done.stdout
    records = dev_records(shared_data, "sentiment_rt")[:100]
    from albert_jax import files

    files.write_atomic(data, "".join(json.dumps(r) + "\n" for r in records))
    served = predict.load_model(art)
    report = predict.predict_file(served, data, gcs.url("serving/out.jsonl"))
    assert report["written"] == 100 and not report["skipped"]
    rows = [json.loads(x) for x in files.as_path(gcs.url("serving/out.jsonl")).read_text()
            .splitlines()]  # fmt: skip
    compare(rows, export.in_process(workdir, run_seed=0).predict(records), ("label",), ())


def test_bad_requests_are_one_line_errors(sentiment, tmp_path):
    workdir, _ = sentiment
    art = tmp_path / "art"
    export.export_artifact(workdir, str(art), run_seed=0, platforms=("cpu",))
    newer = tmp_path / "newer"
    newer.mkdir()
    for p in art.iterdir():
        (newer / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((art / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    (tmp_path / "in.jsonl").write_text('{"sentence": "fine"}\n')
    cases = {
        "occupied": (
            "export", [f"--src={workdir}", f"--dst={art}", "--run_seed=0"],
            f"--dst={art} already holds embed.jaxexport, manifest.json",
        ),
        "too long": (
            "export", [f"--src={workdir}", f"--dst={tmp_path / 'long'}", "--run_seed=0",
                       "--max_seq_length=4096"],
            "--max_seq_length=4096: the model has 128 positions",
        ),
        "newer": (
            "predict", [f"--src={newer}", f"--input={tmp_path / 'in.jsonl'}",
                        f"--output={tmp_path / 'o.jsonl'}"],
            "serving format version 99 (written by albert_jax 0.1.0); this albert_jax (0.1.0) "
            "reads versions up to 1: upgrade albert_jax",
        ),
        "no input": (
            "predict", [f"--src={art}", f"--input={tmp_path / 'none.jsonl'}",
                        f"--output={tmp_path / 'o.jsonl'}"],
            "none.jsonl: no such file",
        ),
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", f"albert_jax.{module}", *args], cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for name, (module, args, _) in cases.items()
    }  # fmt: skip
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1, (name, stderr[-3000:])
        assert cases[name][2] in errors[0], (name, errors[0])
    assert not (tmp_path / "long").exists() and not (tmp_path / "o.jsonl").exists()
