"""The official masking written the straightforward way, one example at a time in pure Python.

This mirrors how `create_pretraining_data.py` computes `create_masked_lm_predictions` (lists of
candidate words, a list of n-gram candidates per start, `shuffle`, per-token 80/10/10), with
our seeded `random.Random` in place of the unseeded global `np.random`. It is the peer of the
vectorized `masking.mask_whole_word_ngrams` in `benchmarks/input_pipeline.py` and the tests
compare the two distributions; the training pipeline does not use it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def mask_one(
    tokens: Sequence[int],
    word_start: Sequence[bool],
    rng: random.Random,
    *,
    max_predictions: int,
    masked_lm_prob: float = 0.15,
    vocab_size: int,
    mask_id: int = 4,
    special_ids: tuple[int, ...] = (2, 3),
    ngram: int = 3,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """One unpadded sequence -> (output tokens, positions, labels, accepted span word counts)."""
    words: list[list[int]] = []
    for i, tok in enumerate(tokens):
        if tok in special_ids:
            continue
        if words and not word_start[tok]:
            words[-1].append(i)
        else:
            words.append([i])
    output = list(tokens)
    budget = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    weights = [1.0 / n for n in range(1, ngram + 1)]
    total = sum(weights)
    probs = [w / total for w in weights]
    candidates = [[words[i : i + n] for n in range(1, ngram + 1)] for i in range(len(words))]
    rng.shuffle(candidates)
    covered: set[int] = set()
    masked: list[tuple[int, int]] = []
    spans: list[int] = []
    for cand in candidates:
        if len(masked) >= budget:
            break
        n = rng.choices(range(1, ngram + 1), weights=probs)[0]
        index_set = [i for word in cand[n - 1] for i in word]
        while len(masked) + len(index_set) > budget and n > 1:
            n -= 1
            index_set = [i for word in cand[n - 1] for i in word]
        if len(masked) + len(index_set) > budget:
            continue
        if any(i in covered for i in index_set):
            continue
        spans.append(len(cand[n - 1]))
        for i in index_set:
            covered.add(i)
            if rng.random() < 0.8:
                output[i] = mask_id
            elif rng.random() < 0.5:
                output[i] = tokens[i]
            else:
                output[i] = rng.randint(0, vocab_size - 1)
            masked.append((i, tokens[i]))
    masked.sort()
    return output, [i for i, _ in masked], [t for _, t in masked], spans
