"""HF task models -> ONNX (`convert --to=onnx`): `model.onnx` beside a `convert --to=hf` export.

`export_onnx(HF_DIR)` loads the HF task model that `hf_task_export` wrote (its Auto class, by
config.json's `architectures`) and writes it with `torch.onnx.export` as `HF_DIR/model.onnx`,
one self-contained file (weights inside) that onnxruntime runs without torch or transformers:

  class                             inputs (int64)              outputs (float32)
  AlbertForSequenceClassification   [batch, sequence]           logits [batch, K]
  AlbertForMultipleChoice           [batch, choices, sequence]  logits [batch, choices]
  AlbertForQuestionAnswering        [batch, sequence]           start_logits, end_logits
                                                                [batch, sequence]

The inputs are `input_ids`, `attention_mask` and `token_type_ids`, in that order. Every
batch, choices and sequence dimension is symbolic: one file serves any batch, any number of
options and any length up to the model's positions. The names are HF's own (the model's forward
arguments and output fields), so the export's tokenizer (`AutoTokenizer` of HF_DIR) feeds it as
it is: `session.run(None, dict(tokenizer(texts, padding=True, return_tensors="np")))`.
Padding is HF's: a padded position's span logits are scores, not masked (ours are -1e30).

The exporter is torch's `torch.export`-based one (`dynamo=True`, ONNX opset `OPSET`), measured
against the TorchScript one (`dynamo=False`) on torch 2.13: see `_export_program`. Sources
without a task head (HF `AlbertForPreTraining` dirs) are refused, naming the classes that
export: the ONNX file is a task model for serving, as `albert_jax.export`'s artifact is.

A `gs://` HF_DIR (or `onnx_path`) is read into a local temp dir, exported there and copied
back (`albert_jax.files`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from typing import Any

from albert_jax import files

__all__ = ["INPUTS", "ONNX_CLASSES", "ONNX_FILE", "OPSET", "export_onnx", "onnx_outputs"]

ONNX_FILE = "model.onnx"
#: The default (ai.onnx) opset of the file: torch 2.13's own default, the newest its
#: TorchScript exporter writes too, and run by onnxruntime >= 1.17.
OPSET = 20
#: The graph's inputs, in order (all int64; a model's forward arguments of the same names).
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
#: HF class -> (its transformers Auto class, the graph's outputs in order).
ONNX_CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "AlbertForSequenceClassification": ("AutoModelForSequenceClassification", ("logits",)),
    "AlbertForMultipleChoice": ("AutoModelForMultipleChoice", ("logits",)),
    "AlbertForQuestionAnswering": (
        "AutoModelForQuestionAnswering",
        ("start_logits", "end_logits"),
    ),
}
# Files of the HF dir the export reads (a gs:// dir: copied to a local one first).
_MODEL_FILES = ("config.json", "model.safetensors")


def onnx_outputs(hf_class: str) -> tuple[str, ...]:
    """The output names of `hf_class`'s ONNX graph ("logits", or start / end logits)."""
    return ONNX_CLASSES[hf_class][1]


def _hf_class(hf_dir: str) -> str:
    """The task class of the HF dir's config.json; ValueError for one without an ONNX export."""
    config = files.read_json(files.as_path(hf_dir) / "config.json")
    architectures = config.get("architectures") or [None]
    hf_class = architectures[0]
    if hf_class not in ONNX_CLASSES:
        raise ValueError(
            f"{hf_dir}: its model is {hf_class}, which has no task head to serve; classes that "
            f"export to ONNX: {', '.join(ONNX_CLASSES)} (convert a fine-tuning workdir)"
        )
    return hf_class


def export_onnx(hf_dir: str, onnx_path: str | None = None) -> str:
    """Writes the HF task model in `hf_dir` (a `convert --to=hf` export, local or gs://) as
    ONNX to `onnx_path` (default: HF_DIR/model.onnx); returns the path written.

    Raises:
      ValueError: `hf_dir` holds no config.json, or a class without an ONNX export.
    """
    target = onnx_path or f"{hf_dir.rstrip('/')}/{ONNX_FILE}"
    hf_class = _hf_class(hf_dir)
    if files.is_local(hf_dir) and files.is_local(target):
        os.makedirs(os.path.dirname(files.absolute(target)), exist_ok=True)
        _export(hf_dir, hf_class, files.absolute(target))
        return target
    with tempfile.TemporaryDirectory(prefix="albert_onnx_") as tmp:
        local_dir = hf_dir
        if not files.is_local(hf_dir):
            local_dir = os.path.join(tmp, "hf")
            for name in _MODEL_FILES:
                files.copy(files.as_path(hf_dir) / name, os.path.join(local_dir, name))
        written = os.path.join(tmp, ONNX_FILE)
        _export(local_dir, hf_class, written)
        files.copy(written, target)
    return target


def _forward(model: Any, outputs: tuple[str, ...]) -> Any:
    """The HF model as a module of the three inputs returning its `outputs` as a tuple (what
    the exporter takes), in eval mode."""
    import torch

    class Forward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                return_dict=True,
            )
            return tuple(out[name] for name in outputs)

    # Eval mode on the wrapper itself: the TorchScript exporter restores the wrapper's mode
    # after exporting, recursively, and a wrapper left in train mode put the model back into
    # dropout (its outputs then ~0.1 off those of the file).
    return Forward().eval()


def _example(hf_class: str) -> tuple[Any, ...]:
    """Example inputs to trace: batch 2, 3 options, 11 tokens (distinct sizes, none 0 or 1,
    which torch.export would specialize), the last tokens of a row padded, two segments."""
    import torch

    shape = (2, 3, 11) if hf_class == "AlbertForMultipleChoice" else (2, 11)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 100, shape, generator=generator)
    attention_mask = torch.ones(shape, dtype=torch.long)
    attention_mask[0, ..., 8:] = 0
    token_type_ids = torch.zeros(shape, dtype=torch.long)
    token_type_ids[..., 5:] = 1
    return input_ids, attention_mask, token_type_ids


def _export(hf_dir: str, hf_class: str, path: str) -> None:
    """`hf_dir`'s model (local) -> the ONNX file `path` (local)."""
    import transformers

    auto, outputs = ONNX_CLASSES[hf_class]
    # "eager" attention: see _export_program for what SDPA's graph looks like.
    model = getattr(transformers, auto).from_pretrained(hf_dir, attn_implementation="eager")
    forward = _forward(model.eval(), outputs)
    _export_program(forward, _example(hf_class), hf_class, outputs, path)


def _export_program(
    forward: Any, example: tuple[Any, ...], hf_class: str, outputs: tuple[str, ...], path: str
) -> None:
    """`torch.onnx.export` of `forward` with symbolic batch / choices / sequence dimensions.

    Exporter: `dynamo=True` (torch.export), measured on torch 2.13 / onnxruntime 1.32 against
    `dynamo=False` (TorchScript tracing with `dynamic_axes`). Correctness: on the three task
    classes of tiny fine-tuned runs, each traced at one shape and run at batch 1-5 and 2-128
    tokens, padded and not, both files give HF's outputs within 1e-6: neither breaks the
    dynamic axes here. The graph: ALBERT-base (sentiment_rt) after onnxruntime's
    ORT_ENABLE_ALL optimizations is 308 nodes from the dynamo export of eager attention
    (LayerNorm + residual fused into SkipLayerNormalization, GELU into FastGelu), 452 from the
    TorchScript one (neither fused), 431 and 559 with SDPA attention (its scaling decomposed
    into Sqrt / Mul / Cast nodes); batch 32 ran at the same sentences/s within noise for all
    four (the matmuls dominate). So: dynamo with eager attention, the leanest graph, from
    torch's maintained exporter (the TorchScript one warns it is deprecated since torch 2.9),
    which refuses a dimension it cannot keep symbolic instead of fixing it in the trace. Its
    costs: onnxscript among the dependencies and an export of ~10-20 s for base (TorchScript:
    ~4 s). `external_data=False`: one file (base is ~47 MB, far below protobuf's 2 GB).
    """
    import torch

    choices = hf_class == "AlbertForMultipleChoice"
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    dims = {0: batch, 1: torch.export.Dim("choices"), 2: sequence} if choices else {
        0: batch, 1: sequence,
    }  # fmt: skip
    # The exporter's progress lines (stdout), its warnings about the names it gives the
    # dimensions and its log lines about torchvision's ops (absent): the CLI prints one line.
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                forward,
                example,
                path,
                dynamo=True,
                input_names=list(INPUTS),
                output_names=list(outputs),
                dynamic_shapes={name: dims for name in INPUTS},
                opset_version=OPSET,
                external_data=False,
                verbose=False,
            )
    finally:
        exporter_log.setLevel(level)
