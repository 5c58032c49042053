"""`convert --to=onnx` (albert_jax.interop.onnx_export): the tiny fine-tuned runs of
test_hf_export (same fixtures, built once a session) exported to `model.onnx`, run by
onnxruntime on the run's own eval features (its eval file) at batch and sequence sizes other
than the ones traced, give our logits within 1e-4 (fp32) and the labels, choices and answers
the run's own evaluation predicted; the classifier through the CLI, also on raw text through
the export's tokenizer; the multiple-choice export from a gs:// HF dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO, run_convert
from test_hf_export import (
    TOLERANCE,
    assert_spans_match,
    cosmos,  # noqa: F401 (a fixture)
    ours,
    read_jsonl,
    sentiment,  # noqa: F401 (a fixture)
    squad,  # noqa: F401 (a fixture)
)

from albert_jax import files
from albert_jax.finetune import train as finetune
from albert_jax.interop.hf_task_export import export_hf_task_model, fine_tuning_run
from albert_jax.interop.onnx_export import INPUTS, ONNX_FILE, OPSET, export_onnx
from albert_jax.pretrained import read_checkpoint
from albert_jax.tasks import registry

# Our feature names -> the ONNX graph's inputs (HF's names).
FEEDS = {"input_ids": "input_ids", "input_mask": "attention_mask", "segment_ids": "token_type_ids"}


def session(path: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def onnx_outputs(sess, arrays: dict, rows, choices: int | None = None) -> dict:
    """onnxruntime's outputs on `rows` of our features, cut to their longest real row (and to
    the first `choices` options): the file runs at shapes other than the traced one."""
    mask = arrays["input_mask"][rows]
    length = int(np.max(np.nonzero(mask.reshape(-1, mask.shape[-1]).any(0))[0])) + 1
    feeds = {}
    for ours_name, name in FEEDS.items():
        value = arrays[ours_name][rows][..., :length]
        if choices is not None:
            value = value[:, :choices]
        feeds[name] = value.astype(np.int64)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def eval_features(workdir: str, config, run_seed: int | None = None):
    """The run's eval set (its eval file, max_eval_examples as the run read it), featurized."""
    checkpoint = read_checkpoint(workdir, run_seed=run_seed)
    [eval_set] = registry.read_eval(config.task, config.data)
    features = registry.featurize(config.task, eval_set.examples, checkpoint.tokenizer, config)
    return eval_set.examples, features


def assert_graph(path: str, outputs: list[str], choices: bool = False) -> None:
    import onnx

    model = onnx.load(path)
    assert {o.domain: o.version for o in model.opset_import}.get("") == OPSET
    dims = ["batch", "choices", "sequence"] if choices else ["batch", "sequence"]
    inputs = [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input]
    assert inputs == [(name, onnx.TensorProto.INT64) for name in INPUTS]
    for i in model.graph.input:
        assert [d.dim_param for d in i.type.tensor_type.shape.dim] == dims
    assert [o.name for o in model.graph.output] == outputs


def test_classifier_cli_to_onnx(sentiment, tmp_path):  # noqa: F811
    import transformers

    workdir, config = sentiment
    with open(os.path.join(workdir, finetune.EVAL_RESULTS_FILE)) as f:
        scores = {int(s): m["accuracy"] for s, m in json.load(f)["per_seed"].items()}
    best = max(sorted(scores), key=scores.get)
    # A source without a task head (an HF dir: not a fine-tuning run) is refused in one line,
    # nothing written; run beside the export below.
    hf_dir, refused = tmp_path / "hf_only", tmp_path / "refused"
    export_hf_task_model(fine_tuning_run(workdir), str(hf_dir), run_seed=best)
    refusal = subprocess.Popen(
        [sys.executable, "-m", "albert_jax.convert", "--to=onnx", f"--src={hf_dir}",
         f"--dst={refused}"], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    dst = tmp_path / "onnx"
    done = run_convert("--to=onnx", f"--src={workdir}", f"--dst={dst}")
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.splitlines()
    assert line.startswith(
        f"wrote ONNX {ONNX_FILE} (opset {OPSET}) beside the HF AlbertForSequenceClassification "
        f"export of task 'sentiment_rt' (step {config.num_train_steps}, seed {best} (best "
        "accuracy"
    ), line
    assert line.endswith(f" in {dst}"), line
    assert {p.name for p in dst.iterdir()} >= {
        ONNX_FILE, "config.json", "model.safetensors", "spiece.model", "tokenizer.json",
    }  # fmt: skip
    assert_graph(str(dst / ONNX_FILE), ["logits"])

    # The run's eval features, in batches of 1, 7 and the rest, each cut to its longest row.
    examples, features = eval_features(workdir, config, run_seed=best)
    arrays = features.arrays
    mine = ours(workdir, config, arrays, run_seed=best)["logits"]
    sess = session(str(dst / ONNX_FILE))
    n = len(examples)
    parts = [onnx_outputs(sess, arrays, rows)["logits"] for rows in
             (slice(0, 1), slice(1, 8), slice(8, n))]  # fmt: skip
    theirs = np.concatenate(parts)
    diff = float(np.max(np.abs(theirs - mine)))
    print(f"sentiment_rt seed {best}: {n} eval examples, max |logit diff| {diff:.2e}")
    assert theirs.shape == mine.shape and diff < TOLERANCE
    np.testing.assert_array_equal(theirs.argmax(-1), mine.argmax(-1))
    written = read_jsonl(os.path.join(workdir, f"seed_{best}", "predictions.jsonl"))
    assert [r["id"] for r in written] == [e.id for e in examples]
    assert [r["prediction"] for r in written] == theirs.argmax(-1).tolist()

    # Raw text through the export's own tokenizer (padding to the batch's longest): the same.
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(dst))
    encoded = tokenizer([e.text_a for e in examples], padding=True, truncation=True,
                        return_tensors="np")  # fmt: skip
    [raw] = sess.run(["logits"], {k: encoded[k].astype(np.int64) for k in INPUTS})
    assert float(np.max(np.abs(raw - mine))) < TOLERANCE

    _, stderr = refusal.communicate(timeout=300)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert refusal.returncode != 0 and len(errors) == 1, stderr[-3000:]
    assert f"--to=onnx: {hf_dir} is no fine-tuning run" in errors[0], errors[0]
    assert not refused.exists()


def test_multiple_choice_exports_from_gcs(cosmos, tmp_path, gcs):  # noqa: F811
    workdir, config = cosmos
    local = tmp_path / "hf"
    export_hf_task_model(fine_tuning_run(workdir), str(local))
    remote = gcs.url(f"onnx_export/{os.getpid()}/hf")
    for name in ("config.json", "model.safetensors"):  # what the export reads
        files.copy(local / name, f"{remote}/{name}")
    assert export_onnx(remote) == f"{remote}/{ONNX_FILE}"
    path = tmp_path / ONNX_FILE
    files.copy(f"{remote}/{ONNX_FILE}", path)
    assert_graph(str(path), ["logits"], choices=True)

    _, features = eval_features(workdir, config)
    arrays = features.arrays
    mine = ours(workdir, config, arrays)["logits"]  # [N, 4]; padding options -1e30
    sess = session(str(path))
    # HF has no option mask: each question goes in with its real options only (3 or 4).
    options = arrays["option_mask"].sum(1)
    predicted, diff = np.zeros(len(options), int), 0.0
    for count in np.unique(options):
        rows = np.flatnonzero(options == count)
        theirs = onnx_outputs(sess, arrays, rows, choices=int(count))["logits"]
        diff = max(diff, float(np.max(np.abs(theirs - mine[rows, :count]))))
        predicted[rows] = theirs.argmax(-1)
    print(f"mc_cosmosqa: {len(options)} questions, max |logit diff| {diff:.2e}")
    assert set(options.tolist()) == {3, 4} and diff < TOLERANCE
    rows = read_jsonl(os.path.join(workdir, "predictions.jsonl"))
    assert [r["prediction"] for r in rows] == predicted.tolist()


def test_span_head_exports_to_onnx(squad, tmp_path):  # noqa: F811
    workdir, config = squad
    export_hf_task_model(fine_tuning_run(workdir), str(tmp_path))
    path = export_onnx(str(tmp_path))
    assert path == f"{tmp_path}/{ONNX_FILE}"
    assert_graph(path, ["start_logits", "end_logits"])

    _, features = eval_features(workdir, config)
    arrays = features.arrays
    mine = ours(workdir, config, arrays)
    out = onnx_outputs(session(path), arrays, slice(None))
    assert_spans_match(out, mine, features, config, workdir)
