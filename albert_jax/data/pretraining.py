"""Pretraining examples: documents -> sentences -> token stream -> A/B instances -> masked batch.

Follows the official ALBERT `create_pretraining_data.py`:

* `tokenize_documents`: each document is split into sentences (`sentences.split_sentences`),
  normalized and tokenized; empty sentences and empty documents are dropped (and counted).
  The result is a `TokenizedCorpus`: one flat token array plus sentence and document offsets.
* `create_instances`: per document, a target length `max_seq_length - 3` (with probability
  `short_seq_prob` drawn as `randint(2, max)`); sentences are accumulated into a chunk until the
  target is reached; A = the first `a_end = randint(1, len(chunk) - 1)` sentences.
  - `sop`: A/B swapped with p=0.5 (label 1), in order otherwise (label 0). A one-sentence chunk
    (a sentence at least as long as the target, the last sentence of a document, a one-sentence
    document) depends on `single_segment`:
    `"split"` (default, our deviation): the sentence is cut at a uniformly random token boundary
    into A and B, then kept in order or swapped with p=0.5 like any chunk (a 1-token sentence
    cannot be cut: skipped and counted as `instances_unsplittable`); its truncation trims only
    the outer ends, so the two sides stay adjacent at the cut;
    `"random_b"` (the reference): B comes from a random other document, always label 1.
  - `nsp`: with p=0.5 (or for a one-sentence chunk) B starts at a random sentence of another
    document (label 1); the unused sentences of the chunk are put back.
  - `none`: A/B always in order (label 0), a one-sentence chunk makes `[CLS] A [SEP]` alone.
  `truncate_seq_pair` trims the longer side one token at a time, front or back with p=0.5.
  An instance is a row of token ranges into the corpus, so an epoch costs a few ints per
  instance and tokens are gathered only when a batch is built.
* `build_batch`: `[CLS] A [SEP] B [SEP]` + segment ids + padding, then whole-word n-gram masking
  (`masking.mask_whole_word_ngrams`) drawn from the generator passed in.

Why `"split"` is the default for SOP: the reference gives every one-sentence chunk label 1 with
a B from another document, so the labels are not balanced (label 1 on 53-56% of the instances
of the demo corpus, 59% on the State of the Union addresses), and these instances
can be solved by topic prediction alone, the very signal SOP replaces NSP to avoid (paper
Sec. 4.6). Cutting the sentence keeps every instance a same-document order question with
exactly p=0.5 for each label. `objective="nsp"` keeps the reference behaviour in any mode.

Other deliberate differences from the reference, all randomness-only: our generators are numpy's
(seeded, reproducible) instead of Python's `random` plus the unseeded global `np.random`; a
random other document is drawn uniformly among the other documents (the reference retries up to
10 times and may rarely keep the same one); the truncation draws the number of front/back cuts
per side from the same Binomial(k, 1/2) instead of one coin per token.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from albert_jax import files, line_reading
from albert_jax.data import masking, sentences

if TYPE_CHECKING:
    from albert_jax.data.tokenizer import Tokenizer

OBJECTIVES = ("sop", "nsp", "none")

# Columns of an instance table [N, 6] (int64).
A_LO, A_HI, B_LO, B_HI, LABEL, KIND = range(6)
# KIND: how B was chosen. SPLIT_*: A and B are the two sides of one sentence cut in two.
IN_ORDER, SWAPPED, RANDOM_B, SPLIT_IN_ORDER, SPLIT_SWAPPED = 0, 1, 2, 3, 4
# The name of each KIND code (index = code), as the batch feature `pair_kind` and the split
# evaluation metrics (`eval_sop_accuracy_<name>`) spell it.
PAIR_KINDS = ("in_order", "swapped", "random_document", "split_in_order", "split_swapped")
# What `create_instances(objective="sop")` does with a one-sentence chunk (module docstring).
SINGLE_SEGMENT_MODES = ("split", "random_b")
# Everything that is counted (dropped, repaired or truncated items included).
COUNTERS = (
    "documents",
    "documents_empty",
    "documents_one_sentence",
    "non_utf8_replaced",
    "sentences",
    "sentences_empty_dropped",
    "long_sentences_chunked",
    "tokens",
    "instances",
    "instances_truncated",
    "instances_random_b",
    "instances_split_sentence",
    "instances_unsplittable",
    "epochs",
)


@dataclass(frozen=True)
class TokenizedCorpus:
    """Documents as one token stream.

    tokens: [T] (uint16 or int32) all sentences back to back; sentence_starts: [n_sent+1] int64
    token offsets; doc_starts: [n_doc+1] int64 sentence offsets. Sentences and documents are
    never empty.
    """

    tokens: np.ndarray
    sentence_starts: np.ndarray
    doc_starts: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_sentences(self) -> int:
        return len(self.sentence_starts) - 1

    def document_tokens(self, d: int) -> np.ndarray:
        """All tokens of document `d`, [n] in sentence order."""
        lo = self.sentence_starts[self.doc_starts[d]]
        hi = self.sentence_starts[self.doc_starts[d + 1]]
        return self.tokens[lo:hi]

    def document_of_token(self, token_index: np.ndarray) -> np.ndarray:
        """Document index of each global token offset."""
        sent = np.searchsorted(self.sentence_starts, token_index, side="right") - 1
        return np.searchsorted(self.doc_starts, sent, side="right") - 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def tokenize_document(
    text: str | bytes, tokenizer: Tokenizer, counters: Counter
) -> list[list[int]]:
    """One document -> its non-empty sentences as id lists (counters updated)."""
    sents = sentences.split_sentences(text, counters)
    encoded = [ids for ids in tokenizer.encode_batch(sents) if ids] if sents else []
    counters["sentences"] += len(encoded)
    counters["sentences_empty_dropped"] += len(sents) - len(encoded)
    return encoded


def concat_documents(docs: Iterable[list[list[int]]], vocab_size: int) -> TokenizedCorpus:
    """Tokenized documents (lists of sentences) -> `TokenizedCorpus`; empty docs dropped."""
    dtype = token_dtype(vocab_size)
    chunks: list[np.ndarray] = []
    sent_lens: list[int] = []
    doc_sizes: list[int] = []
    for doc in docs:
        if not doc:
            continue
        doc_sizes.append(len(doc))
        for s in doc:
            sent_lens.append(len(s))
        chunks.append(np.fromiter((t for s in doc for t in s), dtype=dtype))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    sentence_starts = np.zeros(len(sent_lens) + 1, np.int64)
    np.cumsum(sent_lens, out=sentence_starts[1:])
    doc_starts = np.zeros(len(doc_sizes) + 1, np.int64)
    np.cumsum(doc_sizes, out=doc_starts[1:])
    return TokenizedCorpus(tokens, sentence_starts, doc_starts)


def tokenize_documents(
    documents: Iterable[dict | str | bytes], tokenizer: Tokenizer, counters: Counter | None = None
) -> TokenizedCorpus:
    """Documents (`{"title", "text"}` dicts, or raw text) -> `TokenizedCorpus`.

    Counts in `counters`: documents, documents_empty, documents_one_sentence, sentences,
    sentences_empty_dropped, long_sentences_chunked, non_utf8_replaced.
    """
    counters = Counter() if counters is None else counters

    def gen() -> Iterator[list[list[int]]]:
        for doc in documents:
            yield tokenize_one(doc, tokenizer, counters)

    return concat_documents(gen(), tokenizer.vocab_size)


def tokenize_one(
    doc: dict | str | bytes, tokenizer: Tokenizer, counters: Counter
) -> list[list[int]]:
    """Tokenizes one document and counts what was dropped."""
    text = doc.get("text", "") if isinstance(doc, dict) else doc
    counters["documents"] += 1
    encoded = tokenize_document(text, tokenizer, counters)
    if not encoded:
        counters["documents_empty"] += 1
    elif len(encoded) == 1:
        counters["documents_one_sentence"] += 1
    return encoded


def iter_raw_text_documents(
    source: str | bytes | io.IOBase,
    *,
    limits: line_reading.LineLimits = line_reading.DEFAULT_LINE_LIMITS,
    counters: Counter | None = None,
) -> Iterator[dict]:
    """Reads the official raw format: one sentence per line, a blank line between documents.

    `source` is a path (local or `gs://`; gzip / bzip2 detected from the content), bytes, or a
    binary file object (left open). Bytes that are not UTF-8 are kept as bytes in "text" so
    that `tokenize_documents` replaces and counts them. Lines are read within `limits`
    (`line_reading.read_lines`); `counters` counts `lines_too_long` and `blank_runs_too_long`.
    """
    name = source if isinstance(source, str) else getattr(source, "name", "<bytes>")
    on_skip = (
        None if counters is None else lambda r, _: counters.update([line_reading.SKIP_COUNTERS[r]])
    )
    if isinstance(source, bytes):
        stream: Any = contextlib.nullcontext(io.BytesIO(source))
    elif isinstance(source, str):
        stream = files.open_binary(source)
    else:
        stream = contextlib.nullcontext(source)
    lines: list[bytes] = []

    def flush() -> dict:
        raw = b"\n".join(lines)
        try:
            text: str | bytes = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw
        return {"title": "", "text": text}

    with stream as f:
        for _, line in line_reading.read_lines(f, str(name), limits, on_skip):
            line = line.rstrip(b"\r")
            if line.strip():
                lines.append(line)
            elif lines:
                yield flush()
                lines = []
        if lines:
            yield flush()


def iter_jsonl_documents(
    path: str,
    *,
    limits: line_reading.LineLimits = line_reading.DEFAULT_LINE_LIMITS,
    counters: Counter | None = None,
) -> Iterator[dict]:
    """`{"title", "text"}` records of a (gzip) JSON Lines file, local or `gs://`; lines are
    read within `limits`, counted in `counters` like `iter_raw_text_documents`'."""
    on_skip = (
        None if counters is None else lambda r, _: counters.update([line_reading.SKIP_COUNTERS[r]])
    )
    with files.open_binary(path) as raw:
        for _, line in line_reading.read_lines(raw, path, limits, on_skip):
            if line.strip():
                yield json.loads(line.decode("utf-8", errors="replace"))


# --------------------------------------------------------------------------------------------
# Instances
# --------------------------------------------------------------------------------------------


def truncate_counts(
    len_a: np.ndarray, len_b: np.ndarray, max_num_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """How many tokens `truncate_seq_pair` removes from A and from B.

    The reference removes one token at a time from the longer side (B on ties) until the pair
    fits; the counts only depend on the lengths.
    """
    excess = np.maximum(len_a + len_b - max_num_tokens, 0)
    diff = np.abs(len_a - len_b)
    first = np.minimum(excess, diff)  # from the longer side until both are equal
    rest = excess - first  # then alternately, B first
    a_longer = len_a > len_b
    cut_a = np.where(a_longer, first, 0) + rest // 2
    cut_b = np.where(a_longer, 0, first) + (rest + 1) // 2
    return cut_a, cut_b


_SENTENCE_GROUP = 1 << 16


def _random_b(
    ss: np.ndarray, ds: np.ndarray, d: int, u_doc: float, u_start: float, target: int
) -> tuple[int, int]:
    """Segment B for a random next: sentences of another document (uniform), from a uniform
    start sentence, until `target` tokens or that document's end. Returns its token range."""
    n_doc = len(ds) - 1
    r = d
    if n_doc > 1:
        r = int(u_doc * (n_doc - 1))
        r += r >= d
    r_first, r_end = int(ds[r]), int(ds[r + 1])
    start = r_first + int(u_start * (r_end - r_first))
    b_lo = int(ss[start])
    k = int(np.searchsorted(ss[start + 1 : r_end + 1], b_lo + target, side="left"))
    return b_lo, int(ss[start + 1 + min(k, r_end - 1 - start)])


def create_instances(
    corpus: TokenizedCorpus,
    rng: np.random.Generator,
    *,
    max_seq_length: int,
    short_seq_prob: float = 0.1,
    objective: str = "sop",
    single_segment: str = "split",
    counters: Counter | None = None,
) -> np.ndarray:
    """One pass (epoch) over all documents -> shuffled instance table [N, 6] int64.

    Columns `A_LO, A_HI, B_LO, B_HI` are token ranges into `corpus.tokens` (after truncation),
    `LABEL` the sentence-order / next-sentence label, `KIND` one of IN_ORDER / SWAPPED /
    RANDOM_B / SPLIT_IN_ORDER / SPLIT_SWAPPED. `single_segment` ("split" | "random_b") is what
    SOP does with a one-sentence chunk (see the module docstring); "nsp" and "none" ignore it.
    Counts `instances`, `instances_truncated`, `instances_random_b`,
    `instances_split_sentence` and `instances_unsplittable` (1-token chunks skipped by "split")
    in `counters`.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES} (got {objective!r})")
    if single_segment not in SINGLE_SEGMENT_MODES:
        raise ValueError(
            f"single_segment must be one of {SINGLE_SEGMENT_MODES} (got {single_segment!r})"
        )
    max_num_tokens = max_seq_length - 3
    if max_num_tokens < 2:
        raise ValueError(f"max_seq_length must be >= 5 (got {max_seq_length})")
    n_doc = corpus.num_documents
    if n_doc == 0:
        raise ValueError("create_instances: the corpus has no documents")
    ss = np.asarray(corpus.sentence_starts)
    ds = np.asarray(corpus.doc_starts)
    split_single = objective == "sop" and single_segment == "split"

    # Per-document draws up front; per-sentence draws (a chunk is keyed by its first sentence,
    # which is unique) for one group of documents at a time, so memory stays bounded and the
    # Python loop only does integer bookkeeping on plain lists. A one-sentence chunk has no use
    # for `u_a_end` (A is the whole sentence) nor, in SOP, for `u_coin` (B is random): "split"
    # draws its cut and its swap from those, so both modes consume the generator identically.
    short = rng.random(n_doc) < short_seq_prob
    targets = np.where(short, rng.integers(2, max_num_tokens + 1, n_doc), max_num_tokens)
    targets = targets.tolist()
    rows: list[tuple[int, int, int, int, int, int]] = []
    unsplittable = 0
    g0 = 0
    while g0 < n_doc:
        # Documents [g0, g1): at most _SENTENCE_GROUP sentences (at least one document).
        g1 = max(g0 + 1, int(np.searchsorted(ds, ds[g0] + _SENTENCE_GROUP, "right")) - 1)
        s0, s1 = int(ds[g0]), int(ds[g1])
        u_a_end, u_coin, u_doc, u_start = rng.random((4, s1 - s0)).tolist()
        ss_g = ss[s0 : s1 + 1].tolist()  # token offsets of this group's sentences (- s0)
        for d in range(g0, g1):
            target = targets[d]
            first_sent, end_sent = int(ds[d]) - s0, int(ds[d + 1]) - s0
            i = first_sent
            while i < end_sent:
                # Accumulate sentences [i, j] until the target length or the document's end.
                base = ss_g[i]
                m = bisect.bisect_left(ss_g, base + target, i + 1, end_sent + 1) - (i + 1)
                j = i + min(m, end_sent - 1 - i)
                n_chunk = j - i + 1
                a_end = 1 if n_chunk < 2 else 1 + int(u_a_end[i] * (n_chunk - 1))
                a_lo, a_hi = base, ss_g[i + a_end]
                next_i = j + 1
                if n_chunk == 1 and split_single:
                    # The sentence's two sides at a uniform boundary: both >= 1 token.
                    if a_hi - a_lo < 2:
                        unsplittable += 1
                    else:
                        cut = a_lo + 1 + int(u_a_end[i] * (a_hi - a_lo - 1))
                        if u_coin[i] < 0.5:
                            rows.append((cut, a_hi, a_lo, cut, 1, SPLIT_SWAPPED))
                        else:
                            rows.append((a_lo, cut, cut, a_hi, 0, SPLIT_IN_ORDER))
                    i = next_i
                    continue
                random_b = n_chunk == 1 and objective != "none"
                if objective == "nsp" and not random_b and u_coin[i] < 0.5:
                    random_b = True
                if random_b:
                    b_lo, b_hi = _random_b(ss, ds, d, u_doc[i], u_start[i], target - (a_hi - a_lo))
                    rows.append((a_lo, a_hi, b_lo, b_hi, 1, RANDOM_B))
                    next_i = i + a_end  # put the unused sentences of the chunk back
                elif n_chunk == 1:  # objective == "none": A alone
                    rows.append((a_lo, a_hi, a_hi, a_hi, 0, IN_ORDER))
                else:
                    b_lo, b_hi = a_hi, ss_g[j + 1]
                    if objective == "sop" and u_coin[i] < 0.5:
                        rows.append((b_lo, b_hi, a_lo, a_hi, 1, SWAPPED))
                    else:
                        rows.append((a_lo, a_hi, b_lo, b_hi, 0, IN_ORDER))
                i = next_i
        g0 = g1
    if not rows:
        raise ValueError(
            f"create_instances: no instance in {n_doc} documents: every chunk is a 1-token "
            f"sentence, which single_segment='split' cannot cut ({unsplittable} skipped)"
        )

    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    len_a = table[:, A_HI] - table[:, A_LO]
    len_b = table[:, B_HI] - table[:, B_LO]
    cut_a, cut_b = truncate_counts(len_a, len_b, max_num_tokens)
    front_a = rng.binomial(cut_a, 0.5)
    front_b = rng.binomial(cut_b, 0.5)
    # A cut sentence is trimmed only at its outer ends (the front of its first side, the back of
    # its second), so the pair stays one contiguous window whose A/B boundary is the cut: random
    # front/back cuts would open a hole between the two sides.
    kind = table[:, KIND]
    front_a = np.where(kind == SPLIT_IN_ORDER, cut_a, np.where(kind == SPLIT_SWAPPED, 0, front_a))
    front_b = np.where(kind == SPLIT_IN_ORDER, 0, np.where(kind == SPLIT_SWAPPED, cut_b, front_b))
    table[:, A_LO] += front_a
    table[:, A_HI] -= cut_a - front_a
    table[:, B_LO] += front_b
    table[:, B_HI] -= cut_b - front_b
    if counters is not None:
        counters["instances"] += len(table)
        counters["instances_truncated"] += int(np.count_nonzero(cut_a + cut_b))
        counters["instances_random_b"] += int(np.count_nonzero(kind == RANDOM_B))
        counters["instances_split_sentence"] += int(np.count_nonzero(kind >= SPLIT_IN_ORDER))
        counters["instances_unsplittable"] += unsplittable
    return table[rng.permutation(len(table))]


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def assemble(
    corpora: Sequence[TokenizedCorpus],
    source_index: np.ndarray,
    rows: np.ndarray,
    seq_len: int,
    *,
    cls_id: int = 2,
    sep_id: int = 3,
    pad_id: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Instance rows [B,6] (of `corpora[source_index[b]]`) -> input_ids, segment_ids [B,S]
    int32 and lengths [B]. Layout `[CLS] A [SEP] B [SEP]` (or `[CLS] A [SEP]` if B is empty)."""
    # A plain loop of slice copies: measured faster than a vectorized [B,S] gather here.
    B = len(rows)
    input_ids = np.full((B, seq_len), pad_id, np.int32)
    segment_ids = np.zeros((B, seq_len), np.int32)
    lengths = np.zeros(B, np.int64)
    token_arrays = [c.tokens for c in corpora]
    for b, (k, (a_lo, a_hi, b_lo, b_hi)) in enumerate(
        zip(np.asarray(source_index).tolist(), np.asarray(rows)[:, :4].tolist(), strict=True)
    ):
        tokens = token_arrays[k]
        la, lb = a_hi - a_lo, b_hi - b_lo
        n = 2 + la + (lb + 1 if lb else 0)
        if n > seq_len:
            raise ValueError(f"instance of {n} tokens does not fit seq_len={seq_len}")
        row = input_ids[b]
        row[0] = cls_id
        row[1 : 1 + la] = tokens[a_lo:a_hi]
        row[1 + la] = sep_id
        if lb:
            row[2 + la : 2 + la + lb] = tokens[b_lo:b_hi]
            row[2 + la + lb] = sep_id
            segment_ids[b, 2 + la : n] = 1
        lengths[b] = n
    return input_ids, segment_ids, lengths


def build_batch(
    corpora: Sequence[TokenizedCorpus],
    source_index: np.ndarray,
    rows: np.ndarray,
    rng: np.random.Generator,
    *,
    seq_len: int,
    max_predictions_per_seq: int,
    word_start: np.ndarray,
    masked_lm_prob: float = 0.15,
    ngram: int = 3,
    cls_id: int = 2,
    sep_id: int = 3,
    mask_id: int = 4,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Instance rows -> one fixed-shape batch (the batch contract of `albert_jax.data.pipeline`).

    Returns input_ids, segment_ids, input_mask [B,S] int32; masked_lm_positions,
    masked_lm_ids [B,P] int32; masked_lm_weights [B,P] float32; sentence_order_label [B] int32;
    pair_kind [B] int32 (how B was chosen: a code of `PAIR_KINDS`; for evaluation diagnostics,
    training does not read it).
    """
    input_ids, segment_ids, lengths = assemble(
        corpora, source_index, rows, seq_len, cls_id=cls_id, sep_id=sep_id, pad_id=pad_id
    )
    masked = masking.mask_whole_word_ngrams(
        input_ids,
        lengths,
        word_start,
        rng,
        max_predictions=max_predictions_per_seq,
        masked_lm_prob=masked_lm_prob,
        mask_id=mask_id,
        special_ids=(cls_id, sep_id),
        ngram=ngram,
    )
    input_mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
    return {
        "input_ids": masked.input_ids,
        "segment_ids": segment_ids,
        "input_mask": input_mask,
        "masked_lm_positions": masked.positions,
        "masked_lm_ids": masked.ids,
        "masked_lm_weights": masked.weights,
        "sentence_order_label": rows[:, LABEL].astype(np.int32),
        "pair_kind": rows[:, KIND].astype(np.int32),
    }
