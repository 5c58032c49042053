"""Serving a fine-tuned (or pretrained) ALBERT from raw text: the loader of the StableHLO
artifacts `python -m albert_jax.export` writes, and the one way text becomes predictions that
`albert_jax.predict` and the in-process model (`export.in_process`) share.

    from albert_jax import serving
    served = serving.load("gs://bucket/exports/rt")     # jax, numpy, sentencepiece: no model code
    served.predict([{"id": "a", "sentence": "A gem of a film."}])
    # -> [{"id": "a", "label": "positive", "label_index": 1, "score": ..., "probabilities": [...]}]
    served.embed(["A gem of a film."], pooling="mean")  # [N, H] float32

An artifact directory (local or gs://):

  manifest.json        `FORMAT`, `FORMAT_VERSION`, the task, its kind, label names, the input
                       fields a record carries, max_seq_length and the featurization settings,
                       the versions that wrote it, and each function's file, weights and inputs
  predict.jaxexport    `jax.export` of the task model's prediction (absent for an encoder)
  embed.jaxexport      the encoder: {"cls", "mean"} [B, H] sentence embeddings
  weights.safetensors  the arrays the functions take, by name ("albert/encoder/...")
  spiece.model         the sentencepiece model the run was trained with

Each function is serialized for CPU, CUDA and TPU with symbolic batch and sequence dimensions
(`b`, `s`): one artifact serves any batch and any length up to max_seq_length. Loading imports
no flax and none of albert_jax's model code: the functions are StableHLO and the featurizers
(`tasks/classification.py`, `multiple_choice.py`, `squad_features.py`) and SQuAD's n-best
rules (`tasks/squad_predictions.py`) are numpy.

Records and outputs by kind (`Served.fields`: the input field names, the task's own, so that a
task's eval file predicts as it is):

  classification   text_a [, text_b] -> label, label_index, score (its probability), probabilities
  regression       text_a [, text_b] -> score
  multiple_choice  context, question, options [2..C] -> choice, probabilities (over the options)
  span_v1          question, context -> answer, probability (SQuAD's n-best rules)
  span_v2          question, context -> answer ("" when judged unanswerable), best_span,
                   no_answer_probability

Rows are sorted by length, and each batch is cut to its longest row rounded up to a multiple
of `LENGTH_STEP` tokens (at most max_seq_length), so a batch of short sentences runs at 16 or
32 tokens, not max_seq_length; batches are padded to `batch_size` rows (a short last batch to
the next power of two). The shapes compiled are bounded: max_seq_length / 16 lengths for each
row count. Training buckets more coarsely (`tasks.batching`, powers of two) because each shape
there is a compilation of the whole update; a served forward compiles in a fraction of that.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from albert_jax import files
from albert_jax.data.tokenizer import Tokenizer
from albert_jax.files import BadRecordError
from albert_jax.tasks.batching import Features
from albert_jax.tasks.classification import classification_features
from albert_jax.tasks.json_records import text_field
from albert_jax.tasks.multiple_choice import multiple_choice_features
from albert_jax.tasks.records import ClassificationExample, MultipleChoiceExample, SpanExample
from albert_jax.tasks.squad_features import squad_features
from albert_jax.tasks.squad_predictions import predict_v1, predict_v2

__all__ = ["FORMAT", "FORMAT_VERSION", "Served", "load", "POOLINGS"]

FORMAT = "albert_jax.serving"
#: Bumped when an artifact's layout or meaning changes; a loader refuses newer versions.
FORMAT_VERSION = 1
MANIFEST, WEIGHTS, TOKENIZER = "manifest.json", "weights.safetensors", "spiece.model"
POOLINGS = ("cls", "mean")
DEFAULT_BATCH_SIZE = 32
#: Batches are cut to a multiple of this many tokens (the exported functions' shortest length).
LENGTH_STEP = 16

Function = Callable[[Mapping[str, np.ndarray]], Mapping[str, Any]]


def function_file(name: str) -> str:
    return f"{name}.jaxexport"


# ------------------------------------------------------------------------------- the model
@dataclasses.dataclass
class Served:
    """A model that maps records of raw text to predictions and embeddings.

    `functions` {"predict", "embed"} take {input name: [B, ...] int32} and return {output:
    [B, ...]}: the artifact's StableHLO (`load`) or the jitted model (`export.in_process`).
    """

    manifest: dict[str, Any]
    tokenizer: Tokenizer
    functions: dict[str, Function]

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def fields(self) -> dict[str, str]:
        """{role: the record's field name}: text_a, text_b (classification, regression);
        context, question, options (multiple choice); question, context (spans); text."""
        return self.manifest["fields"]

    @property
    def max_seq_length(self) -> int:
        return int(self.manifest["max_seq_length"])

    # ------------------------------------------------------------------------ records
    def example(self, record: Mapping[str, Any], example_id: str) -> Any:
        """The record as its kind's example; BadRecordError("missing_field:<name>", ...) names
        a field it lacks or has of the wrong type."""
        return _KINDS[self.kind].example(record, example_id, self.fields, self.manifest)

    def featurize(self, examples: Sequence[Any]) -> Features:
        return _KINDS[self.kind].featurize(examples, self.tokenizer, self.manifest)

    def predict(
        self, records: Sequence[Mapping[str, Any]], batch_size: int = DEFAULT_BATCH_SIZE
    ) -> list[dict[str, Any]]:
        """One {"id", ...prediction} per record (its "id", else its index), in order; a record
        without the task's fields raises BadRecordError naming the field."""
        examples = [self.example(r, str(r.get("id", i))) for i, r in enumerate(records)]
        return self.predict_examples(examples, batch_size)

    def predict_examples(
        self, examples: Sequence[Any], batch_size: int = DEFAULT_BATCH_SIZE
    ) -> list[dict[str, Any]]:
        if "predict" not in self.functions:
            raise ValueError(
                "this model is an encoder without a task head: it embeds (--embed), it does not "
                "predict labels"
            )
        kind = _KINDS[self.kind]
        features = self.featurize(examples)
        outputs = self.run("predict", features.arrays, batch_size)
        return kind.records(examples, features, outputs, self.manifest)

    def embed(
        self, texts: Sequence[str], pooling: str = "cls", batch_size: int = DEFAULT_BATCH_SIZE
    ) -> np.ndarray:
        """[N, H] float32 sentence embeddings: the last layer's [CLS] state ("cls") or the mean
        of its states over the real tokens ("mean"), texts cut to max_seq_length."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        examples = [ClassificationExample(str(i), t, None, 0) for i, t in enumerate(texts)]
        features = classification_features(examples, self.tokenizer, self.max_seq_length)
        return self.run("embed", features.arrays, batch_size)[pooling]

    # ----------------------------------------------------------------------- batches
    def run(
        self, name: str, arrays: Mapping[str, np.ndarray], batch_size: int
    ) -> dict[str, np.ndarray]:
        """`functions[name]` over the rows of `arrays` ([N, ..., S] as featurized), in length
        buckets: {output: [N, ...]} in the rows' order; sequence outputs padded back to S."""
        spec = self.manifest["functions"][name]
        inputs, sequence = spec["inputs"], tuple(spec["sequence_inputs"])
        arrays = {k: np.asarray(arrays[k], np.int32) for k in inputs}
        n = len(arrays["input_mask"])
        lengths = arrays["input_mask"].reshape(n, -1, arrays["input_mask"].shape[-1])
        order = np.argsort(-lengths.sum(-1).max(-1), kind="stable")  # longest first
        gathered: dict[str, list[np.ndarray]] = {}
        for start in range(0, n, batch_size):
            rows = order[start : start + batch_size]
            batch = _cut({k: v[rows] for k, v in arrays.items()}, sequence)
            padded = _pad_rows(batch, batch_size if n > batch_size else _pow2(len(rows)))
            out = self.functions[name](padded)
            for k, v in out.items():
                gathered.setdefault(k, []).append(np.asarray(v)[: len(rows)])
        if n == 0:
            return {}
        inverse = np.empty_like(order)
        inverse[order] = np.arange(n)
        width = arrays["input_ids"].shape[-1]
        result = {}
        for k, parts in gathered.items():
            if k in spec.get("sequence_outputs", ()):  # [B, s] of each bucket -> [B, S]
                parts = [_pad_last(p, width, spec["masked_logit"]) for p in parts]
            result[k] = np.concatenate(parts)[inverse]
        return result


def cut_length(longest: int, width: int) -> int:
    """The length a batch whose longest row has `longest` tokens runs at: the next multiple of
    `LENGTH_STEP` (at least one step), at most `width` (max_seq_length)."""
    return min(max(-(-longest // LENGTH_STEP), 1) * LENGTH_STEP, width)


def _cut(batch: Mapping[str, np.ndarray], sequence: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The batch with its `sequence` arrays ([B, ..., S]) cut to `cut_length` of its longest
    row: rows are padded at the end, so the cut columns hold only padding."""
    mask = batch["input_mask"]
    width = mask.shape[-1]
    used = np.flatnonzero(mask.reshape(-1, width).any(axis=0))
    length = cut_length(int(used[-1]) + 1 if len(used) else 1, width)
    return {k: v[..., :length] if k in sequence else v for k, v in batch.items()}


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pad_rows(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Rows of zeros up to `rows` (an all-padding row's outputs are dropped)."""
    out = {}
    for k, v in batch.items():
        pad = rows - len(v)
        out[k] = np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) if pad else v
    return out


def _pad_last(value: np.ndarray, width: int, fill: float) -> np.ndarray:
    pad = width - value.shape[-1]
    if pad <= 0:
        return value
    return np.concatenate([value, np.full((*value.shape[:-1], pad), fill, value.dtype)], -1)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


# -------------------------------------------------------------------------------- kinds
class _Kind(abc.ABC):
    """Records -> examples -> features, and outputs -> one dict per example, of one kind
    (`manifest` carries the fields and settings)."""

    @abc.abstractmethod
    def example(self, record: Mapping[str, Any], example_id: str, fields: dict, manifest: dict):
        """The record's example; BadRecordError naming a field it lacks."""

    @abc.abstractmethod
    def featurize(self, examples: Sequence[Any], tokenizer: Tokenizer, manifest: dict) -> Features:
        """Examples -> the featurizer's arrays ([N, ..., S] int32)."""

    @abc.abstractmethod
    def records(self, examples, features, outputs, manifest) -> list[dict[str, Any]]:
        """One {"id", ...} per example, from the outputs over the features' rows."""


class _Classification(_Kind):
    regression = False

    def example(self, record, example_id, fields, manifest):
        text_a = text_field(record, fields["text_a"])
        pair = fields.get("text_b")
        text_b = None
        if pair is not None and (pair in record or pair not in manifest["optional_fields"]):
            text_b = text_field(record, pair)
        return ClassificationExample(example_id, text_a, text_b, 0)

    def featurize(self, examples, tokenizer, manifest) -> Features:
        return classification_features(
            examples, tokenizer, manifest["max_seq_length"], regression=self.regression
        )

    def records(self, examples, features, outputs, manifest):
        probabilities = _softmax(outputs["logits"].astype(np.float64))
        labels = manifest["labels"]
        out = []
        for example, p in zip(examples, probabilities, strict=True):
            i = int(np.argmax(p))
            out.append({
                "id": example.id, "label": labels[i], "label_index": i, "score": float(p[i]),
                "probabilities": [float(x) for x in p],
            })  # fmt: skip
        return out


class _Regression(_Classification):
    regression = True

    def records(self, examples, features, outputs, manifest):
        return [
            {"id": e.id, "score": float(v)}
            for e, v in zip(examples, outputs["logits"][:, 0], strict=True)
        ]


class _MultipleChoice(_Kind):
    def example(self, record, example_id, fields, manifest):
        context = text_field(record, fields["context"])
        question = text_field(record, fields["question"])
        name, most = fields["options"], int(manifest["num_choices"])
        options = record.get(name)
        if name not in record:
            raise BadRecordError(f"missing_field:{name}")
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise BadRecordError(f"bad_type:{name}")
        if not 2 <= len(options) <= most:
            raise BadRecordError(f"options_not_2_to_{most}:{name}")
        padding = most - len(options)
        return MultipleChoiceExample(
            example_id, context, question, tuple(options) + ("",) * padding,
            (1,) * len(options) + (0,) * padding, 0,
        )  # fmt: skip

    def featurize(self, examples, tokenizer, manifest) -> Features:
        return multiple_choice_features(
            examples, tokenizer, manifest["max_seq_length"], manifest["max_qa_length"]
        )

    def records(self, examples, features, outputs, manifest):
        out = []
        for example, logits in zip(examples, outputs["logits"], strict=True):
            real = int(sum(example.option_mask))
            p = _softmax(logits[:real].astype(np.float64))
            i = int(np.argmax(p))
            out.append({"id": example.id, "choice": i, "probabilities": [float(x) for x in p]})
        return out


class _Span(_Kind):
    version = 1

    def example(self, record, example_id, fields, manifest):
        question = text_field(record, fields["question"])
        context = text_field(record, fields["context"])
        return SpanExample(example_id, "", question, context, (), False)

    def featurize(self, examples, tokenizer, manifest) -> Features:
        return squad_features(
            examples, tokenizer, manifest["max_seq_length"], manifest["doc_stride"],
            manifest["max_query_length"],
        )  # fmt: skip

    def records(self, examples, features, outputs, manifest):
        n_best, longest = manifest["n_best_size"], manifest["max_answer_length"]
        if self.version == 1:
            found = predict_v1(
                features, outputs["start_logits"], outputs["end_logits"], n_best, longest
            )
            nbest = found.nbest_json()
            return [
                {
                    "id": e.id,
                    "answer": found.answers[e.id],
                    "probability": nbest[e.id][0]["probability"] if nbest[e.id] else 0.0,
                }
                for e in examples
            ]
        found = predict_v2(features, outputs, n_best, longest, manifest["null_threshold"])
        return [
            {
                "id": e.id,
                "answer": found.answers[e.id],
                "best_span": found.best_non_null[e.id],
                "no_answer_probability": float(found.na_probs[e.id]),
            }
            for e in examples
        ]


class _SpanV2(_Span):
    version = 2


class _Encoder(_Classification):
    """A model without a task head: embeddings only (`Served.embed`)."""

    def example(self, record, example_id, fields, manifest):
        return ClassificationExample(example_id, text_field(record, fields["text"]), None, 0)

    def records(self, examples, features, outputs, manifest):
        raise ValueError("an encoder has no predictions, only embeddings")


_KINDS: dict[str, _Kind] = {
    "classification": _Classification(),
    "regression": _Regression(),
    "multiple_choice": _MultipleChoice(),
    "span_v1": _Span(),
    "span_v2": _SpanV2(),
    "encoder": _Encoder(),
}


# ---------------------------------------------------------------------------- the loader
def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """The manifest, or ValueError when it is no serving manifest or is of a newer format
    version than this loader reads."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{where}: not an albert_jax serving artifact (no {FORMAT!r} format)")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        written = manifest.get("versions", {}).get("albert_jax", "unknown")
        from albert_jax import __version__

        raise ValueError(
            f"{where}: serving format version {version} (written by albert_jax {written}); "
            f"this albert_jax ({__version__}) reads versions up to {FORMAT_VERSION}: upgrade "
            "albert_jax to load it, or export the run again with this one"
        )
    if manifest.get("kind") not in _KINDS:
        raise ValueError(f"{where}: unknown kind {manifest.get('kind')!r}; known: {sorted(_KINDS)}")
    return manifest


def load(path: str) -> Served:
    """The artifact at `path` (local or gs://), ready on the default device.

    Raises:
      ValueError: `path` holds no artifact, one of a newer format version, or one not
        serialized for this platform (naming the platforms it was).
    """
    import jax
    from jax import export
    from safetensors.numpy import load as load_safetensors

    directory = files.as_path(path)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(
            f"{path}: no {MANIFEST}; not a serving artifact (write one with "
            "`python -m albert_jax.export --src=WORKDIR --dst=DIR`)"
        )
    manifest = check_manifest(json.loads(manifest_path.read_text()), path)
    weights = load_safetensors((directory / WEIGHTS).read_bytes())
    platform = jax.default_backend()
    functions: dict[str, Function] = {}
    for name, spec in manifest["functions"].items():
        exported = export.deserialize(bytearray((directory / spec["file"]).read_bytes()))
        wanted = "cuda" if platform == "gpu" else platform
        if wanted not in exported.platforms:
            raise ValueError(
                f"{path}: {spec['file']} was serialized for {list(exported.platforms)}, not "
                f"{wanted}; export it again with --platforms={wanted}"
            )
        arrays = [jax.device_put(weights[k]) for k in spec["weights"]]
        functions[name] = _caller(jax.jit(exported.call), arrays)
    tokenizer = Tokenizer(str(directory / TOKENIZER), lower=bool(manifest.get("lower_case", True)))
    return Served(manifest=manifest, tokenizer=tokenizer, functions=functions)


def _caller(call: Callable, weights: list) -> Function:
    return lambda inputs: call(weights, dict(inputs))
