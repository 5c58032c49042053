"""The README's step 6 end to end: a fine-tuned tiny model (test_hf_export's sentiment_rt run,
two seeds, fine-tuned from scratch on the real task files) shipped by the commands a user
types — `convert --to=onnx` (the HF export with model.onnx beside it), `export` (the StableHLO
artifact), `predict` from the artifact and from the workdir — and the same label for every
sentence of the whole sentiment_rt dev file from ours in process, the artifact, transformers'
`pipeline` and onnxruntime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO
from test_finetune import task_files
from test_hf_export import read_jsonl, sentiment  # noqa: F401
from test_serving import dev_records


def _cli(module: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"albert_jax.{module}", *args], cwd=REPO, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def _finish(proc: subprocess.Popen) -> str:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


def test_a_fine_tuned_model_ships_four_ways_with_the_same_labels(sentiment, shared_data,
                                                                 tmp_path):  # fmt: skip
    import onnxruntime
    import transformers

    workdir, _ = sentiment
    hf, art, dev = tmp_path / "hf", tmp_path / "serving", task_files(shared_data, "sentiment_rt")[1]
    exports = [
        _cli("convert", "--to=onnx", f"--src={workdir}", f"--dst={hf}"),
        _cli("export", f"--src={workdir}", f"--dst={art}"),
    ]
    converted, exported = (_finish(p) for p in exports)
    # Both pick the run's best seed by its accuracy, and say so.
    seed = json.loads((art / "manifest.json").read_text())["source"]["run_seed"]
    assert f"seed {seed} (best accuracy" in converted and f"seed {seed} (best accuracy" in exported
    assert json.loads((hf / "config.json").read_text())["albert_jax"]["run_seed"] == seed
    predictions = [
        _cli("predict", f"--src={art}", f"--input={dev}", f"--output={tmp_path / 'art.jsonl'}"),
        _cli("predict", f"--src={workdir}", f"--run_seed={seed}", f"--input={dev}",
             f"--output={tmp_path / 'ours.jsonl'}"),
    ]  # fmt: skip
    for proc in predictions:
        assert "wrote 1,109 predictions" in _finish(proc)
    artifact = read_jsonl(tmp_path / "art.jsonl")
    ours = read_jsonl(tmp_path / "ours.jsonl")
    sentences = [r["sentence"] for r in dev_records(shared_data, "sentiment_rt")]
    assert [r["id"] for r in artifact] == [f"dev-{i}" for i in range(len(sentences))]

    classify = transformers.pipeline("text-classification", model=str(hf), device="cpu")
    pipeline = [a["label"] for a in classify(sentences, truncation=True, batch_size=64)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf))
    session = onnxruntime.InferenceSession(str(hf / "model.onnx"))
    id2label = json.loads((hf / "config.json").read_text())["id2label"]
    onnx = []
    for start in range(0, len(sentences), 64):
        batch = tokenizer(sentences[start : start + 64], padding=True, truncation=True,
                          return_tensors="np")  # fmt: skip
        inputs = {i.name: batch[i.name].astype(np.int64) for i in session.get_inputs()}
        (logits,) = session.run(["logits"], inputs)
        onnx += [id2label[str(i)] for i in logits.argmax(-1)]

    labels = {
        "ours": [r["label"] for r in ours],
        "StableHLO artifact": [r["label"] for r in artifact],
        "HF pipeline": pipeline,
        "onnxruntime": onnx,
    }
    for name, got in labels.items():
        agree = np.mean([a == b for a, b in zip(got, labels["ours"], strict=True)])
        print(f"{name}: {len(got)} sentences, {agree:.4f} agree with ours")
        assert agree == 1.0, name
