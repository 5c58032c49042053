"""Pretraining examples: sentences, instances (SOP/NSP/none), whole-word n-gram masking."""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter

import numpy as np
import pytest

from albert_jax.data import batches, instances, line_reading, masking, reference_masking, sentences
from albert_jax.data.corpus import (
    TokenizedCorpus,
    concat_documents,
    iter_jsonl_documents,
    iter_raw_text_documents,
    tokenize_documents,
)
from albert_jax.data.instances import A_HI, A_LO, B_HI, B_LO, KIND, LABEL


@pytest.fixture(scope="module")
def austen_corpus(tokenizer, shared_data) -> TokenizedCorpus:
    docs = iter_jsonl_documents(os.path.join(shared_data, "corpora", "austen.jsonl.gz"))
    return tokenize_documents(list(itertools.islice(docs, 70)), tokenizer)


# --- sentences and documents ------------------------------------------------------------------


def test_split_sentences_uses_a_real_model():
    text = 'Mr. Smith went to Washington. He said "hi!" Then he left.\nA new paragraph'
    assert sentences.split_sentences(text) == [
        "Mr. Smith went to Washington.",
        'He said "hi!"',
        "Then he left.",
        "A new paragraph",
    ]


def test_raw_text_format_is_read():
    raw = b"First sentence here.\nSecond one, no period\n\n\nDoc two only line.\n\xff\xfe bad\n"
    docs = list(iter_raw_text_documents(raw))
    assert len(docs) == 2
    assert docs[0]["text"] == "First sentence here.\nSecond one, no period"
    assert isinstance(docs[1]["text"], bytes)  # not UTF-8: replaced (and counted) later
    counters = Counter()
    sents = sentences.split_sentences(docs[0]["text"], counters)
    assert sents == ["First sentence here.", "Second one, no period"]  # a line per sentence
    assert sentences.split_sentences(docs[1]["text"], counters)[1] == "\ufffd\ufffd bad"
    assert counters["non_utf8_replaced"] == 1


def test_raw_text_reading_is_bounded():
    # A long line is skipped without ending its document; a long blank run ends the read.
    raw = b"One.\n" + b"x" * 21 + b"\nTwo.\n\nThree.\n" + b"\n" * 5 + b"Lost.\n"
    counters = Counter()
    limits = line_reading.LineLimits(max_line_bytes=20, max_blank_lines=3)
    docs = list(iter_raw_text_documents(raw, limits=limits, counters=counters))
    assert [d["text"] for d in docs] == ["One.\nTwo.", "Three."]
    assert counters == {"lines_too_long": 1, "blank_runs_too_long": 1}


def test_bad_input_is_counted_not_fatal(tokenizer):
    long_line = "word" * 25_000  # 100k characters, no space, no punctuation
    docs = [
        {"title": "bad bytes", "text": b"Caf\xe9 au lait. It is good.\nYes."},
        {"title": "empty", "text": ""},
        {"title": "blank", "text": " \n \n"},
        {"title": "one", "text": "Just one sentence here."},
        {"title": "long", "text": long_line + "\nAnd a normal sentence."},
        {"title": "surrogate", "text": "Broken \ud800 text. Second sentence."},
    ]
    counters = Counter()
    austen_corpus = tokenize_documents(docs, tokenizer, counters)
    assert counters["documents"] == 6
    assert counters["documents_empty"] == 2
    assert counters["documents_one_sentence"] == 1
    assert counters["non_utf8_replaced"] == 2
    assert counters["long_sentences_chunked"] == 1
    assert austen_corpus.num_documents == 4
    lengths = np.diff(austen_corpus.sentence_starts)
    assert lengths.min() >= 1
    # The 100k line became ~50 sentences of at most MAX_SENTENCE_CHARS characters.
    assert austen_corpus.doc_starts[3] - austen_corpus.doc_starts[2] >= 100_000 // 2000
    table = instances.create_instances(
        austen_corpus, np.random.default_rng(0), max_seq_length=64, counters=counters
    )
    assert len(table) > 0 and counters["instances_truncated"] > 0
    assert np.all(table[:, A_HI] - table[:, A_LO] + table[:, B_HI] - table[:, B_LO] <= 61)


def test_truncate_counts_match_the_reference_loop():
    rng = random.Random(0)
    for _ in range(2000):
        la, lb, limit = rng.randint(1, 300), rng.randint(1, 300), rng.randint(2, 300)
        a, b = la, lb
        while a + b > limit:  # truncate_seq_pair, counting only
            if a > b:
                a -= 1
            else:
                b -= 1
        cut_a, cut_b = instances.truncate_counts(np.array([la]), np.array([lb]), limit)
        assert (cut_a[0], cut_b[0]) == (la - a, lb - b)


# --- instances --------------------------------------------------------------------------------


def _find(haystack: np.ndarray, needle: np.ndarray) -> np.ndarray:
    """Start offsets of `needle` in `haystack`."""
    starts = np.flatnonzero(haystack[: len(haystack) - len(needle) + 1] == needle[0])
    return np.array([s for s in starts if np.array_equal(haystack[s : s + len(needle)], needle)])


def test_sop_instances_follow_the_reference(austen_corpus, tokenizer):
    """single_segment="random_b": the official algorithm, one-sentence chunks included."""
    rng = np.random.default_rng(1)
    S = 128
    counters = Counter()
    table = instances.create_instances(
        austen_corpus, rng, max_seq_length=S, single_segment="random_b", counters=counters
    )
    la = table[:, A_HI] - table[:, A_LO]
    lb = table[:, B_HI] - table[:, B_LO]
    assert la.min() >= 1 and lb.min() >= 1 and (la + lb).max() <= S - 3
    kind, label = table[:, KIND], table[:, LABEL]
    assert set(label[kind == instances.IN_ORDER]) == {0}
    assert set(label[kind != instances.IN_ORDER]) == {1}
    # SOP: multi-sentence chunks are swapped with p=0.5.
    pairs = kind != instances.RANDOM_B
    swapped = (kind[pairs] == instances.SWAPPED).mean()
    assert abs(swapped - 0.5) < 0.02, swapped
    assert counters["instances_random_b"] == int((kind == instances.RANDOM_B).sum()) > 0
    assert counters["instances_split_sentence"] == 0
    # Hence the reference's excess of label 1: every one-sentence chunk adds one.
    assert label.mean() > 0.5 + 0.5 * (kind == instances.RANDOM_B).mean() - 0.02
    # Random B comes from another document; A and B of pairs from the same one.
    doc_a = austen_corpus.document_of_token(table[:, A_LO])
    doc_b = austen_corpus.document_of_token(table[:, B_LO])
    assert np.all(doc_a[pairs] == doc_b[pairs])
    assert np.all(doc_a[~pairs] != doc_b[~pairs])
    # Short targets: about short_seq_prob of the documents aim below the maximum.
    short = (la + lb < (S - 3) // 2).mean()
    assert 0.0 < short < 0.5

    # Black box: rebuild the token sequences of a batch and find them in the documents.
    batch_rows = table[:300]
    ids, segments, lengths = batches.assemble(
        [austen_corpus], np.zeros(300, np.int64), batch_rows, S
    )
    for b in range(300):
        row = ids[b, : lengths[b]]
        assert row[0] == tokenizer.cls_id and row[-1] == tokenizer.sep_id
        sep = int(np.flatnonzero(row == tokenizer.sep_id)[0])
        seg_a, seg_b = row[1:sep], row[sep + 1 : -1]
        assert np.all(segments[b, : sep + 1] == 0) and np.all(segments[b, sep + 1 : lengths[b]])
        d = austen_corpus.document_of_token(batch_rows[b, A_LO])
        doc = np.asarray(austen_corpus.document_tokens(d))
        where_a = _find(doc, seg_a)
        assert where_a.size, "segment A must come from its document"
        if batch_rows[b, KIND] == instances.RANDOM_B:
            continue
        where_b = _find(doc, seg_b)
        assert where_b.size
        if batch_rows[b, LABEL] == 0:  # in order: A precedes B
            assert any(y >= x + len(seg_a) for x in where_a for y in where_b)
        else:  # swapped: B precedes A in the document
            assert any(x >= y + len(seg_b) for x in where_a for y in where_b)


SPLIT_KINDS = (instances.SPLIT_IN_ORDER, instances.SPLIT_SWAPPED)


def test_sop_splits_one_sentence_chunks(austen_corpus, tokenizer):
    """Default "split": every instance is a same-document order question, label 1 iff swapped;
    a cut sentence's two sides touch (A ends where B begins when in order)."""
    S = 128
    counters = Counter()
    table = instances.create_instances(
        austen_corpus, np.random.default_rng(1), max_seq_length=S, counters=counters
    )
    reference = instances.create_instances(
        austen_corpus, np.random.default_rng(1), max_seq_length=S, single_segment="random_b"
    )
    kind, label = table[:, KIND], table[:, LABEL]
    # Same draws: the same chunks, with a cut sentence where the reference has a random B.
    assert len(table) == len(reference)
    split = np.isin(kind, SPLIT_KINDS)
    assert split.sum() == (reference[:, KIND] == instances.RANDOM_B).sum() > 0
    assert not (kind == instances.RANDOM_B).any()
    assert counters["instances_split_sentence"] == int(split.sum())
    assert counters["instances_random_b"] == counters["instances_unsplittable"] == 0
    assert counters["instances"] == len(table)
    assert np.array_equal(label == 1, np.isin(kind, (instances.SWAPPED, instances.SPLIT_SWAPPED)))
    # Fair coins: within 4 standard errors (~2k instances, ~100 of them cut sentences).
    for labels in (label, label[split]):
        assert abs(labels.mean() - 0.5) < 4 * 0.5 / np.sqrt(len(labels)), labels.mean()
    la = table[:, A_HI] - table[:, A_LO]
    lb = table[:, B_HI] - table[:, B_LO]
    assert la.min() >= 1 and lb.min() >= 1 and (la + lb).max() <= S - 3
    # A and B always come from the same document: no topic signal.
    doc_a = austen_corpus.document_of_token(table[:, A_LO])
    doc_b = austen_corpus.document_of_token(table[:, B_LO])
    assert np.array_equal(doc_a, doc_b)
    # A cut sentence: both sides inside one sentence, adjacent at the cut.
    ss = np.asarray(austen_corpus.sentence_starts)
    first = np.minimum(table[:, A_LO], table[:, B_LO])
    last = np.maximum(table[:, A_HI], table[:, B_HI]) - 1
    sent_first = np.searchsorted(ss, first, side="right") - 1
    sent_last = np.searchsorted(ss, last, side="right") - 1
    assert np.array_equal(sent_first[split], sent_last[split])
    in_order, swapped = split & (label == 0), split & (label == 1)
    assert np.array_equal(table[in_order, A_HI], table[in_order, B_LO])
    assert np.array_equal(table[swapped, B_HI], table[swapped, A_LO])
    # Two-sentence-or-more chunks: in order A before B; swapped B before A.
    pairs = ~split
    assert np.all(table[pairs & (label == 0), A_HI] <= table[pairs & (label == 0), B_LO])
    assert np.all(table[pairs & (label == 1), B_HI] <= table[pairs & (label == 1), A_LO])

    # Black box: rebuild the sequences and find them in their document.
    rows = np.concatenate([table[split][:100], table[pairs][:200]])
    ids, _, lengths = batches.assemble([austen_corpus], np.zeros(len(rows), np.int64), rows, S)
    for b in range(len(rows)):
        row = ids[b, : lengths[b]]
        sep = int(np.flatnonzero(row == tokenizer.sep_id)[0])
        seg_a, seg_b = row[1:sep], row[sep + 1 : -1]
        doc = np.asarray(
            austen_corpus.document_tokens(austen_corpus.document_of_token(rows[b, A_LO]))
        )
        where_a, where_b = _find(doc, seg_a), _find(doc, seg_b)
        assert where_a.size and where_b.size
        first_seg, second_seg = (seg_a, seg_b) if rows[b, LABEL] == 0 else (seg_b, seg_a)
        where_1, where_2 = (where_a, where_b) if rows[b, LABEL] == 0 else (where_b, where_a)
        if rows[b, KIND] in SPLIT_KINDS:  # the second side starts where the first ends
            assert any(
                np.array_equal(doc[x + len(first_seg) : x + len(row) - 3], second_seg)
                for x in where_1
            )
        else:
            assert any(y >= x + len(first_seg) for x in where_1 for y in where_2)


def _synthetic_corpus(sentence_lengths_per_doc: list[list[int]]) -> TokenizedCorpus:
    """Documents of given sentence lengths; token t of the stream has id 5 + t % 1000."""
    docs, t = [], 0
    for lengths in sentence_lengths_per_doc:
        doc = []
        for n in lengths:
            doc.append([5 + (t + k) % 1000 for k in range(n)])
            t += n
        docs.append(doc)
    return concat_documents(docs, vocab_size=2000)


def test_split_cut_is_uniform_and_truncation_keeps_the_cut():
    # 4000 one-sentence documents of 10 tokens, 30 of 1 token, one of a 300-token sentence.
    austen_corpus = _synthetic_corpus([[10]] * 4000 + [[1]] * 30 + [[300]])
    counters = Counter()
    table = instances.create_instances(
        austen_corpus,
        np.random.default_rng(0),
        max_seq_length=64,
        short_seq_prob=0.0,
        counters=counters,
    )
    assert counters["instances_unsplittable"] == 30
    assert len(table) == counters["instances_split_sentence"] == 4001
    assert np.isin(table[:, KIND], SPLIT_KINDS).all()
    label = table[:, LABEL]
    first_lo = np.minimum(table[:, A_LO], table[:, B_LO])
    cut = np.where(label == 0, table[:, A_HI], table[:, B_HI])
    # The 1-token documents (tokens 40000..40029) are in no instance.
    assert not ((first_lo >= 40000) & (first_lo < 40030)).any()
    short = first_lo < 40000
    # Cut offset within the 10-token sentence: uniform over 1..9 (~444 each, sigma ~20).
    counts = np.bincount(cut[short] - first_lo[short], minlength=10)
    assert counts[0] == 0 and counts[1:].sum() == 4000 and len(counts) == 10
    assert np.abs(counts[1:] - 4000 / 9).max() < 90, counts
    assert abs(label.mean() - 0.5) < 0.03
    # The 300-token sentence: truncated to 61 tokens only at its outer ends, the cut kept.
    (long,) = np.flatnonzero(~short)
    a_lo, a_hi, b_lo, b_hi, lab = table[long, :5]
    (lo1, hi1), (lo2, hi2) = (
        ((a_lo, a_hi), (b_lo, b_hi)) if lab == 0 else ((b_lo, b_hi), (a_lo, a_hi))
    )
    assert hi1 == lo2 and hi2 - lo1 == 61 and 40030 <= lo1 < hi1 and lo2 < hi2 <= 40330


def test_split_edge_cases_and_other_objectives(austen_corpus):
    with pytest.raises(ValueError, match="single_segment"):
        instances.create_instances(
            austen_corpus, np.random.default_rng(0), max_seq_length=128, single_segment="drop"
        )
    ones = _synthetic_corpus([[1]] * 5)
    with pytest.raises(ValueError, match="1-token"):
        instances.create_instances(ones, np.random.default_rng(0), max_seq_length=128)
    # NSP and MLM-only ignore the option: the reference's instances in both modes.
    for objective in ("nsp", "none"):
        split, ref = (
            instances.create_instances(
                austen_corpus,
                np.random.default_rng(4),
                max_seq_length=128,
                objective=objective,
                single_segment=mode,
            )
            for mode in ("split", "random_b")
        )
        assert np.array_equal(split, ref)


def test_nsp_and_none_objectives(austen_corpus):
    table = instances.create_instances(
        austen_corpus, np.random.default_rng(2), max_seq_length=128, objective="nsp"
    )
    kind, label = table[:, KIND], table[:, LABEL]
    assert not (kind == instances.SWAPPED).any()
    assert np.array_equal(label == 1, kind == instances.RANDOM_B)
    assert 0.45 < label.mean() < 0.6  # p=0.5 plus one-sentence chunks
    doc_a = austen_corpus.document_of_token(table[:, A_LO])
    doc_b = austen_corpus.document_of_token(table[:, B_LO])
    assert np.all(doc_a[label == 1] != doc_b[label == 1])
    table = instances.create_instances(
        austen_corpus, np.random.default_rng(2), max_seq_length=128, objective="none"
    )
    assert not table[:, LABEL].any() and (table[:, KIND] == instances.IN_ORDER).all()
    with pytest.raises(ValueError, match="objective"):
        instances.create_instances(
            austen_corpus, np.random.default_rng(0), max_seq_length=128, objective="mlm"
        )


@pytest.mark.parametrize("single_segment", ["split", "random_b"])
def test_instances_are_seeded(austen_corpus, single_segment):
    a, b, c = (
        instances.create_instances(
            austen_corpus,
            np.random.default_rng(seed),
            max_seq_length=128,
            single_segment=single_segment,
        )
        for seed in (5, 5, 6)
    )
    assert np.array_equal(a, b) and not np.array_equal(a, c)


# --- masking ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def masked(austen_corpus, tokenizer):
    """>= 10k real sequences (seq 128, P 20) masked by the vectorized implementation."""
    rng = np.random.default_rng(3)
    tables = [instances.create_instances(austen_corpus, rng, max_seq_length=128) for _ in range(5)]
    rows = np.concatenate(tables)[:10240]
    ids, _, lengths = batches.assemble([austen_corpus], np.zeros(len(rows), np.int64), rows, 128)
    out = masking.mask_whole_word_ngrams(
        ids, lengths, tokenizer.word_start, rng, max_predictions=20
    )
    return ids, lengths, out


def test_masking_ngram_lengths(masked):
    ids, _, out = masked
    assert len(ids) >= 10_000
    sampled = out.sampled_ngrams / out.sampled_ngrams.sum()
    # ~100k draws: the standard error is ~0.15 points, so 1 point is a loose bound.
    assert np.allclose(sampled, [6 / 11, 3 / 11, 2 / 11], atol=0.01), sampled
    accepted = out.accepted_ngrams / out.accepted_ngrams.sum()
    assert accepted[0] > accepted[1] > accepted[2] > 0


def test_masking_replacement_80_10_10(masked, tokenizer):
    ids, _, out = masked
    b, p = np.nonzero(out.weights)
    original = ids[b, out.positions[b, p]]
    assert np.array_equal(original, out.ids[b, p])
    now = out.input_ids[b, out.positions[b, p]]
    is_mask = now == tokenizer.mask_id
    kept = now == original
    random_other = ~is_mask & ~kept
    assert abs(is_mask.mean() - 0.8) < 0.015
    assert abs(kept.mean() - 0.1) < 0.015
    assert abs(random_other.mean() - 0.1) < 0.015
    # Random replacements span the whole vocabulary (special pieces included).
    assert now[random_other].max() > 0.9 * tokenizer.vocab_size
    # Nothing else changed.
    changed = out.input_ids != ids
    changed[b, out.positions[b, p]] = False
    assert not changed.any()


def test_masking_budget_and_specials(masked, tokenizer):
    ids, lengths, out = masked
    n_pred = out.weights.sum(axis=1).astype(int)
    budget = np.minimum(20, np.maximum(1, np.array([round(0.15 * n) for n in lengths])))
    assert np.all(n_pred <= budget)
    assert (n_pred == budget).mean() > 0.999
    b, p = np.nonzero(out.weights)
    pos = out.positions[b, p]
    assert not np.isin(ids[b, pos], [tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id]).any()
    assert np.all(pos < lengths[b])
    # Positions are sorted within a row and padded with zeros (weight 0).
    real = out.weights > 0
    assert np.all(real[:, :-1] >= real[:, 1:])  # real entries first
    assert np.all(np.diff(out.positions, axis=1)[real[:, 1:]] > 0)
    assert not out.positions[out.weights == 0].any() and not out.ids[out.weights == 0].any()


def test_masking_selects_whole_words(masked, tokenizer):
    """A word's pieces are masked together: every masked piece's word is masked entirely."""
    ids, lengths, out = masked
    selected = np.zeros(ids.shape, bool)
    b, p = np.nonzero(out.weights)
    selected[b, out.positions[b, p]] = True
    for row in range(500):
        tokens = ids[row, : lengths[row]]
        word, words = -1, []
        for i, t in enumerate(tokens):
            if t in (tokenizer.cls_id, tokenizer.sep_id):
                continue
            if word < 0 or tokenizer.word_start[t]:
                word += 1
                words.append([])
            words[-1].append(i)
        for pieces in words:
            flags = selected[row, pieces]
            assert flags.all() or not flags.any()


def test_masking_matches_the_pure_python_reference(masked, tokenizer):
    """Same inputs, two implementations: span-length mix and prediction counts agree."""
    ids, lengths, out = masked
    rng = random.Random(0)
    table = tokenizer.word_start.tolist()
    spans = np.zeros(3)
    n_pred = []
    n = 2000
    for row in range(n):
        _, pos, _, accepted = reference_masking.mask_one(
            ids[row, : lengths[row]].tolist(),
            table,
            rng,
            max_predictions=20,
            vocab_size=tokenizer.vocab_size,
        )
        n_pred.append(len(pos))
        for s in accepted:
            spans[s - 1] += 1
    ours = out.accepted_ngrams / out.accepted_ngrams.sum()
    assert np.allclose(spans / spans.sum(), ours, atol=0.02), (spans / spans.sum(), ours)
    assert np.array_equal(n_pred, out.weights[:n].sum(axis=1).astype(int))


def test_masking_is_seeded_and_handles_edge_rows(tokenizer):
    ids = np.zeros((3, 16), np.int32)
    ids[0, :2] = [2, 3]  # only specials: nothing to mask
    ids[1, :5] = [2, 100, 101, 102, 3]
    ids[2, :] = 200
    lengths = np.array([2, 5, 16])
    a = masking.mask_whole_word_ngrams(
        ids, lengths, tokenizer.word_start, np.random.default_rng(0), max_predictions=4
    )
    b = masking.mask_whole_word_ngrams(
        ids, lengths, tokenizer.word_start, np.random.default_rng(0), max_predictions=4
    )
    assert all(np.array_equal(x, y) for x, y in zip(a.input_ids, b.input_ids, strict=True))
    assert a.weights[0].sum() == 0
    assert a.weights[1].sum() >= 1  # budget max(1, round(0.75)) = 1
    zero = masking.mask_whole_word_ngrams(
        ids,
        lengths,
        tokenizer.word_start,
        np.random.default_rng(0),
        max_predictions=4,
        masked_lm_prob=0.0,
    )
    assert zero.weights.sum() == 0 and np.array_equal(zero.input_ids, ids)
