"""Host input pipeline throughput: ours (vectorized) vs the reference algorithm in pure Python.

`python benchmarks/input_pipeline.py --json` prints one JSON line. Everything runs in this one
process, i.e. on one core:

* `tokenize_mb_per_sec`: raw text -> sentences (Bling Fire) -> ALBERT normalization ->
  SentencePiece ids -> `TokenizedCorpus` (the one-off cache build).
* `instances_per_sec`: one epoch of `create_instances` (SOP pairs, truncation, shuffle).
* per shape (seq 512 / P 20, as the paper, and seq 128 / P 20): `examples_per_sec` of
  `build_batch` (gather tokens, `[CLS] A [SEP] B [SEP]`, whole-word n-gram masking, fixed-shape
  arrays) on batches of 256 from the tokenized cache, and `reference_examples_per_sec` of the
  same work written the way the official `create_pretraining_data.py` does it (Python lists,
  one example at a time, `reference_masking.mask_one`), then padded into the same arrays.
  Rates per wall-clock second and per CPU second of this process; `speedup` = ours / reference
  in CPU time (stable when other jobs share the machine).

Without `--tokenizer` a SentencePiece model (vocab 8000) is trained on the corpora first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from albert_jax.data import batches, instances, reference_masking, sentences  # noqa: E402
from albert_jax.data.corpus import iter_jsonl_documents, tokenize_documents  # noqa: E402
from albert_jax.data.masking import MaskingSettings  # noqa: E402
from albert_jax.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402

SHARED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "corpora"
)


def reference_batch(corpus, rows, seq_len, max_predictions, word_start, vocab_size, rng):
    """The official per-example path: token lists, masking, padding; -> numpy arrays."""
    tokens = corpus.tokens
    out = {
        k: []
        for k in (
            "input_ids",
            "segment_ids",
            "input_mask",
            "masked_lm_positions",
            "masked_lm_ids",
            "masked_lm_weights",
            "sentence_order_label",
        )
    }
    for a_lo, a_hi, b_lo, b_hi, label, _ in rows.tolist():
        a = tokens[a_lo:a_hi].tolist()
        b = tokens[b_lo:b_hi].tolist()
        ids = [2, *a, 3, *b, 3]
        segment = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        ids, positions, labels, _ = reference_masking.mask_one(
            ids, word_start, rng, max_predictions=max_predictions, vocab_size=vocab_size
        )
        mask = [1] * len(ids)
        while len(ids) < seq_len:
            ids.append(0)
            segment.append(0)
            mask.append(0)
        weights = [1.0] * len(positions)
        while len(positions) < max_predictions:
            positions.append(0)
            labels.append(0)
            weights.append(0.0)
        for key, value in zip(
            out, (ids, segment, mask, positions, labels, weights, label), strict=True
        ):
            out[key].append(value)
    return {
        k: np.array(v, np.float32 if k == "masked_lm_weights" else np.int32) for k, v in out.items()
    }


def examples_per_sec(fn, n_examples: int, min_seconds: float) -> tuple[float, float]:
    """Calls fn(0), fn(1), ... for at least `min_seconds`; examples per wall-clock second and
    per CPU second of this process (the latter is robust to other load on the machine)."""
    done, start, cpu_start = 0, time.perf_counter(), time.process_time()
    for i in itertools.count():
        fn(i)
        done += n_examples
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return done / elapsed, done / (time.process_time() - cpu_start)
    raise AssertionError("unreachable")


def measure(corpus, tokenizer, seq_len: int, preds: int, B: int, seconds: float) -> dict:
    """Ours vs the pure-Python reference on the same instance batches of one epoch."""
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    table = instances.create_instances(corpus, rng, max_seq_length=seq_len)
    instances_per_sec = len(table) / (time.perf_counter() - start)
    starts = list(range(0, len(table) - B + 1, B))
    zeros = np.zeros(B, np.int64)
    word_start = tokenizer.word_start.tolist()
    py_rng = random.Random(0)

    def ours(i: int) -> None:
        lo = starts[i % len(starts)]
        batches.build_batch(
            [corpus],
            zeros,
            table[lo : lo + B],
            rng,
            seq_len=seq_len,
            masking_settings=MaskingSettings(max_predictions=preds),
            word_start=tokenizer.word_start,
        )

    def reference(i: int) -> None:
        lo = starts[i % len(starts)]
        reference_batch(
            corpus, table[lo : lo + B], seq_len, preds, word_start, tokenizer.vocab_size, py_rng
        )

    ours_wall, ours_cpu = examples_per_sec(ours, B, seconds)
    ref_wall, ref_cpu = examples_per_sec(reference, B, seconds)
    return {
        "examples_per_sec": round(ours_wall, 1),
        "examples_per_cpu_sec": round(ours_cpu, 1),
        "reference_examples_per_sec": round(ref_wall, 1),
        "reference_examples_per_cpu_sec": round(ref_cpu, 1),
        "speedup": round(ours_cpu / ref_cpu, 2),
        "instances_per_sec": round(instances_per_sec, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--tokenizer", default=None, help="SentencePiece model (else trained)")
    parser.add_argument("--corpora", default="austen,brown", help="files in shared/data/corpora")
    parser.add_argument("--corpus_dir", default=SHARED)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    args = parser.parse_args()

    docs = []
    for name in args.corpora.split(","):
        path = os.path.join(args.corpus_dir, f"{name}.jsonl.gz")
        docs.extend(iter_jsonl_documents(path))
    raw_mb = sum(len(d["text"].encode("utf-8")) for d in docs) / 1e6

    if args.tokenizer:
        tokenizer = Tokenizer(args.tokenizer)
    else:
        tmp = tempfile.mkdtemp()
        texts = (s for d in docs[::3] for s in sentences.split_sentences(d["text"]))
        tokenizer = Tokenizer(
            train_tokenizer(texts, os.path.join(tmp, "spm"), vocab_size=8000, max_sentences=100_000)
        )

    start = time.perf_counter()
    corpus = tokenize_documents(docs, tokenizer)
    tokenize_mb_per_sec = raw_mb / (time.perf_counter() - start)

    result = {
        "benchmark": "input_pipeline",
        "cores": 1,
        "batch": args.batch,
        "corpus_mb": round(raw_mb, 2),
        "corpus_tokens": int(len(corpus.tokens)),
        "vocab_size": tokenizer.vocab_size,
        "tokenize_mb_per_sec": round(tokenize_mb_per_sec, 2),
    }
    for seq_len, preds in ((512, 20), (128, 20)):
        result[f"seq{seq_len}_p{preds}"] = measure(
            corpus, tokenizer, seq_len, preds, args.batch, args.seconds
        )
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
