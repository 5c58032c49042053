"""notebooks/restore_and_explore.ipynb runs headless (nbclient, kernel python3) on checkpoints
the tests train themselves (an all-shared and a not-shared tiny model) and writes its figures."""

from __future__ import annotations

import json
import os

import nbformat
import pytest
from nbclient import NotebookClient
from test_finetune import pretrained_workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "restore_and_explore.ipynb")
FIGURES = (
    "sentence_similarity.png",
    "pretraining_curves.png",
    "figure2_layer_transitions.png",
)


def _kernel_available() -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return "python3" in KernelSpecManager().find_kernel_specs()


def test_notebook_runs_on_our_checkpoints(tmp_path, tmp_path_factory, shared_data, monkeypatch):
    if not _kernel_available():
        pytest.fail("no 'python3' Jupyter kernel: run `python -m ipykernel install --user`")
    shared = pretrained_workdir(tmp_path_factory, shared_data, sharing="all")
    not_shared = pretrained_workdir(tmp_path_factory, shared_data, sharing="none")
    out = tmp_path / "figures"
    # The kernel inherits this environment (and conftest's CPU settings).
    monkeypatch.setenv("ALBERT_NOTEBOOK_CKPT", shared)
    monkeypatch.setenv("ALBERT_NOTEBOOK_CKPT_NOT_SHARED", not_shared)
    monkeypatch.setenv("ALBERT_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=170, kernel_name="python3", resources={"metadata": {"path": REPO}}
    )
    client.execute()  # raises CellExecutionError on any failing cell

    for name in FIGURES:
        path = out / name
        assert path.exists() and path.stat().st_size > 5000, name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "figure2_layer_transitions.json") as f:
        stats = json.load(f)
    assert len(stats) == 2  # the all-shared and the not-shared model
    for values in stats.values():
        assert len(values["l2"]) == len(values["cosine"]) == 2  # one per layer
        assert all(v > 0 for v in values["l2"]) and all(-1 <= c <= 1 for c in values["cosine"])
    # Figures are also shown inline, and the fill-mask cell printed its guesses.
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == len(FIGURES)
    assert any("->" in o.get("text", "") for o in outputs)
