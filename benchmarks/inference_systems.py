"""The systems `benchmarks/inference.py` times, each from raw sentences to labels: ours
(`Served.predict`, in process or from the StableHLO artifact), HF PyTorch and BERT-base
(`TorchSystem`), onnxruntime (`OnnxSystem`); the torch and onnxruntime ones in processes of
their own (`Spawned`), which time their own calls.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

BERT_BASE = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2,
)  # fmt: skip
# Ours' feature names -> HF's input names.
OURS_INPUTS = {"input_ids": "input_ids", "segment_ids": "token_type_ids",
               "input_mask": "attention_mask"}  # fmt: skip


def _softmax_labels(logits: np.ndarray) -> list[int]:
    """What a caller wants of the logits: probabilities and the label (as ours' records)."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities = z / z.sum(-1, keepdims=True)
    return probabilities.argmax(-1).tolist()


class TorchSystem:
    """HF ALBERT from the export, or BERT-base (random init), on `threads` torch threads."""

    def __init__(self, hf_dir: str, threads: int, bert: bool = False):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        if bert:
            torch.manual_seed(0)
            config = transformers.BertConfig(**BERT_BASE, num_labels=2)
            self.model = transformers.AutoModelForSequenceClassification.from_config(
                config, attn_implementation="sdpa"
            )
            self.clip = BERT_BASE["vocab_size"] - 1
        else:
            self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
                hf_dir, attn_implementation="sdpa"
            )
            self.clip = None
        self.model.eval()
        self.info = {
            "params": int(sum(p.numel() for p in self.model.parameters())),
            "attention": self.model.config._attn_implementation,
            "activation": self.model.config.hidden_act,
            "threads": torch.get_num_threads(),
        }

    def forward(self, arrays: dict[str, np.ndarray]) -> None:
        """The model alone on token ids already padded ({HF input name: [B, S] int64})."""
        batch = {k: self.torch.from_numpy(v) for k, v in arrays.items()}
        with self.torch.inference_mode():
            self.model(**batch).logits.numpy()

    def __call__(self, sentences: list[str]) -> tuple[list[int], int]:
        batch = self.tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
        if self.clip is not None:  # ALBERT's ids in BERT's vocabulary
            batch["input_ids"] = batch["input_ids"].clamp_(max=self.clip)
        with self.torch.inference_mode():
            logits = self.model(**batch).logits.numpy()
        return _softmax_labels(logits), int(batch["input_ids"].shape[1])


class OnnxSystem:
    """onnxruntime on the export's model.onnx, CPU provider, `threads` intra-op threads."""

    def __init__(self, hf_dir: str, threads: int):
        import onnxruntime as ort
        import transformers

        from albert_jax.interop.onnx_export import INPUTS, ONNX_FILE

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            os.path.join(hf_dir, ONNX_FILE), options, providers=["CPUExecutionProvider"]
        )
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        self.inputs = INPUTS
        self.info = {"threads": threads, "version": ort.__version__}

    def forward(self, arrays: dict[str, np.ndarray]) -> None:
        self.session.run(["logits"], arrays)

    def __call__(self, sentences: list[str]) -> tuple[list[int], int]:
        batch = self.tokenizer(sentences, padding=True, truncation=True, return_tensors="np")
        feeds = {k: batch[k].astype(np.int64) for k in self.inputs}
        [logits] = self.session.run(["logits"], feeds)
        return _softmax_labels(logits), int(feeds["input_ids"].shape[1])


class OursSystem:
    """`Served.predict` on records of the raw sentences (in_process or the artifact)."""

    def __init__(self, served: Any, batch_size: int):
        self.served, self.batch_size = served, batch_size

    def forward(self, arrays: dict[str, np.ndarray]) -> None:
        """The jitted model alone (`Served.functions["predict"]`) on padded token ids."""
        ours = {name: arrays[hf].astype(np.int32) for name, hf in OURS_INPUTS.items()}
        np.asarray(self.served.functions["predict"](ours)["logits"])

    def __call__(self, sentences: list[str]) -> tuple[list[int], int]:
        records = [{"id": str(i), "sentence": s} for i, s in enumerate(sentences)]
        out = self.served.predict(records, batch_size=self.batch_size)
        return [r["label_index"] for r in out], 0


_SYSTEMS = {"hf": TorchSystem, "bert": TorchSystem, "onnxruntime": OnnxSystem}


def _worker(conn: Any, name: str, kwargs: dict[str, Any]) -> None:
    """A spawned system: built once, then ("run", sentences) -> (seconds, labels, width)."""
    try:
        system = _SYSTEMS[name](**kwargs)
        conn.send(("ok", system.info))
    except Exception:  # noqa: BLE001 - reported in the parent
        conn.send(("error", traceback.format_exc()))
        return
    while (request := conn.recv())[0] != "stop":
        try:
            start = time.perf_counter()
            if request[0] == "forward":
                system.forward(request[1])
                conn.send(("ok", time.perf_counter() - start))
                continue
            labels, width = system(request[1])
            conn.send(("ok", (time.perf_counter() - start, labels, width)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class Spawned:
    """A system in a process of its own, timing its own calls."""

    def __init__(self, name: str, **kwargs: Any):
        context = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, name, kwargs), daemon=True)
        self.process.start()
        self.info = self._answer()

    def _answer(self) -> Any:
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"system {self.name}: {value}")
        return value

    def __call__(self, sentences: list[str]) -> tuple[float, list[int], int]:
        self.conn.send(("run", sentences))
        return self._answer()

    def forward(self, arrays: dict[str, np.ndarray]) -> float:
        self.conn.send(("forward", arrays))
        return self._answer()

    def close(self) -> None:
        self.conn.send(("stop",))
        self.process.join()


def timed(system: Callable[[list[str]], tuple[list[int], int]]) -> Callable[..., tuple]:
    """An in-process system as a Spawned one answers: (seconds, labels, width)."""

    def call(sentences: list[str]) -> tuple[float, list[int], int]:
        start = time.perf_counter()
        labels, width = system(sentences)
        return time.perf_counter() - start, labels, width

    return call
