"""Pretraining instances: one epoch over a `TokenizedCorpus` -> a shuffled table of sentence
pairs (segment A, segment B, label), as token ranges into the corpus.

Follows the official ALBERT `create_pretraining_data.py`. `create_instances`: per document, a
target length `max_seq_length - 3` (with probability `short_seq_prob` drawn as
`randint(2, max)`); sentences are accumulated into a chunk until the target is reached;
A = the first `a_end = randint(1, len(chunk) - 1)` sentences.
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
instance and tokens are gathered only when a batch is built (`batches.py`).

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
from collections import Counter

import numpy as np

from albert_jax.data.corpus import TokenizedCorpus

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
