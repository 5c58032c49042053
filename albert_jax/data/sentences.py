"""Document text -> sentences, with a real sentence-boundary model (Bling Fire).

Bling Fire (`pip install blingfire`, MIT) ships its sentence-breaking model inside the wheel, so
nothing is downloaded at run time (nltk's punkt would need a download). Paragraphs are the
"\\n"-separated lines of a document; a paragraph that is already one sentence (the official
one-sentence-per-line format) stays one sentence.
"""

from __future__ import annotations

from collections import Counter

# A "sentence" longer than this (e.g. a table row or a line with no punctuation) is cut at the
# last space before the limit (hard cut if there is none), so one line can never make an
# instance that is all truncation. ~2000 characters is ~500 pieces, one full 512 sequence.
MAX_SENTENCE_CHARS = 2000


def clean_text(text: str | bytes, counters: Counter | None = None) -> str:
    """Returns valid UTF-8 text: bytes are decoded with U+FFFD for bad sequences, lone
    surrogates are replaced. Counts `non_utf8_replaced` documents in `counters`."""
    if isinstance(text, bytes):
        decoded = text.decode("utf-8", errors="replace")
        if counters is not None and "\ufffd" in decoded and b"\xef\xbf\xbd" not in text:
            counters["non_utf8_replaced"] += 1
        return decoded
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        if counters is not None:
            counters["non_utf8_replaced"] += 1
        return text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def chunk_long_sentence(sentence: str, max_chars: int = MAX_SENTENCE_CHARS) -> list[str]:
    """Cuts `sentence` into pieces of at most `max_chars`, preferably at spaces."""
    out = []
    rest = sentence
    while len(rest) > max_chars:
        cut = rest.rfind(" ", max_chars // 2, max_chars + 1)
        if cut <= 0:
            cut = max_chars
        out.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    if rest:
        out.append(rest)
    return [s for s in out if s]


def split_sentences(
    text: str | bytes,
    counters: Counter | None = None,
    max_chars: int = MAX_SENTENCE_CHARS,
) -> list[str]:
    """Splits a document's text into sentences.

    Lines ("\\n") are paragraphs (or sentences, in the official raw format); each non-blank line
    is split by Bling Fire. Over-long sentences are chunked (counted as
    `long_sentences_chunked`).
    """
    # Imported here, not with the module: the training step imports this module (for its
    # constants), and accelerator images that only train have no blingfire.
    import blingfire

    text = clean_text(text, counters)
    out: list[str] = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        for sentence in blingfire.text_to_sentences(line).split("\n"):
            sentence = sentence.strip()
            if not sentence:
                continue
            if len(sentence) > max_chars:
                if counters is not None:
                    counters["long_sentences_chunked"] += 1
                out.extend(chunk_long_sentence(sentence, max_chars))
            else:
                out.append(sentence)
    return out
