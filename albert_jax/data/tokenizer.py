"""SentencePiece tokenizer with ALBERT's text normalization, special ids and whole-word table.

Compatibility with the official `30k-clean.model` (google-research/albert `tokenization.py`):

* `preprocess_text` is the official one: collapse whitespace, NFKD, drop combining marks,
  lower-case. The official ALBERT code does *not* rewrite quotes; HuggingFace's `AlbertTokenizer`
  (and XLNet) additionally replace ``` `` ``` and `''` by `"`. That is available with
  `replace_quotes=True` but is off by default so ids match the official pipeline.
* `Tokenizer.encode` is the official `encode_ids`: plain `SentencePieceProcessor` pieces on the
  normalized text, plus the official digit-comma quirk: a piece such as `▁1990,` is re-encoded as
  the pieces of `1990` followed by `,` (the leading `▁` is removed again when the original piece
  had none). We implement the quirk as the code reads for text strings (Python 2 / HuggingFace
  semantics); under Python 3 the official code compares bytes with str there, which we do not copy.
* `word_start[V]` is `_is_start_piece_sp` of `create_pretraining_data.py`.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import sentencepiece as spm

from albert_jax import files

PAD, UNK, CLS, SEP, MASK = "<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"
SPIECE_UNDERLINE = "▁"
# Official spm_train flags (google-research/albert README).
CONTROL_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")
USER_DEFINED_SYMBOLS = ("(", ")", '"', "-", ".", "–", "£", "€")
# `_is_start_piece_sp`: ASCII punctuation as written in the official set literal. The literal
# repeats `\"` where an apostrophe was probably meant, so `'` is *not* in it (kept on purpose).
# Its `€`/`£` entries are bytes under Python 3 and never match a str piece; such pieces are
# still word starts through the "contains a character outside [a-z] ∪ set" branch.
_START_PUNCTUATION = frozenset('!"#$%&()*+,-./:;?@[\\]^_`{|}~')
_ENGLISH = frozenset("abcdefghijklmnopqrstuvwxyz")


def preprocess_text(text: str, lower: bool = True, *, replace_quotes: bool = False) -> str:
    """ALBERT text normalization (official `tokenization.preprocess_text`).

    Collapses runs of whitespace to one space and strips the ends, applies NFKD and drops
    combining marks (accents), then lower-cases. `replace_quotes=True` also maps ``` `` ``` and
    `''` to `"` like HuggingFace's `AlbertTokenizer` (not done by the official code).
    """
    out = " ".join(text.split())
    if replace_quotes:
        out = out.replace("``", '"').replace("''", '"')
    # ASCII is invariant under NFKD and has no combining marks: skip the per-character pass.
    if not out.isascii():
        out = unicodedata.normalize("NFKD", out)
        out = "".join(c for c in out if not unicodedata.combining(c))
    if lower:
        out = out.lower()
    return out


def is_start_piece(piece: str) -> bool:
    """Whether a SentencePiece piece starts a whole word (official `_is_start_piece_sp`).

    True if the piece starts with `▁` or `<`, is a single official punctuation character, or
    contains a character whose lower case is neither in [a-z] nor in that punctuation set
    (digits, apostrophes, non-Latin letters...).
    """
    if piece.startswith(SPIECE_UNDERLINE) or piece.startswith("<") or piece in _START_PUNCTUATION:
        return True
    allowed = _ENGLISH | _START_PUNCTUATION
    return not all(c.lower() in allowed for c in piece)


class Tokenizer:
    """A SentencePiece model with ALBERT conventions.

    Ids: `<pad>`=0, `<unk>`=1, `[CLS]`=2, `[SEP]`=3, `[MASK]`=4 (checked at load time).
    `word_start` is a bool array `[vocab_size]` (see `is_start_piece`).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        model_proto: bytes | None = None,
        lower: bool = True,
        replace_quotes: bool = False,
    ):
        if (model_path is None) == (model_proto is None):
            raise ValueError("Tokenizer: pass exactly one of model_path or model_proto")
        if model_path is not None:
            model_path = os.fspath(model_path)
            if not files.as_path(model_path).is_file():
                raise ValueError(f"Tokenizer: model_path {model_path!r} does not exist")
            # SentencePiece loads a serialized proto as well as a file: this reads gs:// too.
            model_proto = files.as_path(model_path).read_bytes()
        self.model_path = model_path
        self.lower = lower
        self.replace_quotes = replace_quotes
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except RuntimeError as e:  # sentencepiece names neither the file nor what it is
            where = repr(model_path) if model_path else "model_proto"
            raise ValueError(
                f"Tokenizer: {where} is not a sentencepiece model ({str(e).splitlines()[0]}); "
                "pass the .model file sentencepiece trained (e.g. the workdir's tokenizer.model)"
            ) from None
        self._proto = model_proto
        expected = {PAD: 0, UNK: 1, CLS: 2, SEP: 3, MASK: 4}
        for piece, want in expected.items():
            got = self._sp.piece_to_id(piece)
            if got != want or self._sp.id_to_piece(want) != piece:
                raise ValueError(
                    f"Tokenizer: model must have {piece} at id {want} (found id {got}); train it "
                    "with train_tokenizer() or the official spm_train flags"
                )
        pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        self.word_start = np.array([is_start_piece(p) for p in pieces], dtype=bool)
        # Pieces that trigger the official digit-comma re-encoding.
        self._digit_comma = np.array(
            [len(p) > 1 and p[-1] == "," and p[-2].isdigit() for p in pieces], dtype=bool
        )

    # -- ids ------------------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    @property
    def cls_id(self) -> int:
        return 2

    @property
    def sep_id(self) -> int:
        return 3

    @property
    def mask_id(self) -> int:
        return 4

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def fingerprint(self) -> str:
        """sha256 of the serialized model (keys tokenized caches)."""
        return hashlib.sha256(self._proto).hexdigest()[:16]

    def __getstate__(self) -> dict:
        # SentencePieceProcessor is not picklable; rebuild it from the proto in worker processes.
        return {
            "proto": self._proto,
            "lower": self.lower,
            "replace_quotes": self.replace_quotes,
            "model_path": self.model_path,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            model_proto=state["proto"], lower=state["lower"], replace_quotes=state["replace_quotes"]
        )
        self.model_path = state["model_path"]

    # -- encoding -------------------------------------------------------------------------------
    def normalize(self, text: str) -> str:
        return preprocess_text(text, lower=self.lower, replace_quotes=self.replace_quotes)

    def _fix_digit_comma(self, ids: list[int]) -> list[int]:
        """Official `encode_pieces` quirk: split `<digits>,` pieces into digits + `,`."""
        out: list[int] = []
        for i in ids:
            if not self._digit_comma[i]:
                out.append(i)
                continue
            piece = self._sp.id_to_piece(i)
            sub = self._sp.encode(piece[:-1].replace(SPIECE_UNDERLINE, ""), out_type=str)
            if piece[0] != SPIECE_UNDERLINE and sub and sub[0][0] == SPIECE_UNDERLINE:
                sub = sub[1:] if len(sub[0]) == 1 else [sub[0][1:], *sub[1:]]
            sub.append(piece[-1])
            out.extend(self._sp.piece_to_id(p) for p in sub)
        return out

    def encode(self, text: str) -> list[int]:
        """Normalizes `text` and returns its ids (no [CLS]/[SEP] added)."""
        ids = self._sp.encode(self.normalize(text))
        if ids and self._digit_comma[ids].any():
            ids = self._fix_digit_comma(ids)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts at once (one SentencePiece call)."""
        batch = self._sp.encode([self.normalize(t) for t in texts])
        out = []
        for ids in batch:
            if ids and self._digit_comma[ids].any():
                ids = self._fix_digit_comma(ids)
            out.append(ids)
        return out

    def encode_pieces(self, text: str) -> list[str]:
        return [self._sp.id_to_piece(i) for i in self.encode(text)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.piece_to_id(piece)


def train_tokenizer_proto(
    texts: Iterable[str],
    vocab_size: int = 30000,
    *,
    max_sentences: int = 1_000_000,
    seed: int = 0,
    lower: bool = True,
    character_coverage: float = 0.99995,
    num_threads: int | None = None,
    **spm_options: Any,
) -> bytes:
    """Trains an ALBERT SentencePiece model in memory; returns the serialized model (what
    `Tokenizer(model_proto=...)` loads and a `.model` file holds).

    Settings are the official `spm_train` flags: unigram, `--pad_id=0 --unk_id=1 --eos_id=-1
    --bos_id=-1 --control_symbols=[CLS],[SEP],[MASK] --user_defined_symbols=(,),",-,.,–,£,€
    --character_coverage=0.99995`. Each text (ideally one sentence) goes through
    `preprocess_text` first. At most `max_sentences` texts are kept, sampled uniformly with a
    seeded reservoir, so memory and time stay bounded on big corpora. `spm_options` go to
    `SentencePieceTrainer.train` as they are (e.g. `hard_vocab_limit`).
    """
    if vocab_size < 16:
        raise ValueError(f"vocab_size must be >= 16 (got {vocab_size})")
    if max_sentences < 1:
        raise ValueError(f"max_sentences must be >= 1 (got {max_sentences})")
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for text in texts:
        text = preprocess_text(text, lower=lower)
        if not text:
            continue
        seen += 1
        if len(reservoir) < max_sentences:
            reservoir.append(text)
        else:
            j = rng.randrange(seen)
            if j < max_sentences:
                reservoir[j] = text
    if not reservoir:
        raise ValueError("train_tokenizer: texts is empty (no non-blank text after normalization)")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(reservoir),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0,
        unk_id=1,
        eos_id=-1,
        bos_id=-1,
        control_symbols=list(CONTROL_SYMBOLS),
        user_defined_symbols=list(USER_DEFINED_SYMBOLS),
        character_coverage=character_coverage,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2,
        **spm_options,
    )
    return model.getvalue()


def train_tokenizer(
    texts: Iterable[str], model_prefix: str, vocab_size: int = 30000, **train_kwargs: Any
) -> str:
    """`train_tokenizer_proto` written to `model_prefix + ".model"` (and its pieces and scores
    to `.vocab`), local or `gs://`; returns the `.model` path. Both files are written
    atomically (`files.write_atomic`): concurrent trainers may race safely."""
    proto = train_tokenizer_proto(texts, vocab_size, **train_kwargs)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab_lines = "".join(
        f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size())
    )
    model_path = model_prefix + ".model"
    files.write_atomic(model_prefix + ".vocab", vocab_lines)
    files.write_atomic(model_path, proto)
    return model_path


def load_or_train_tokenizer(
    model_path: str,
    texts: Callable[[], Iterable[str]],
    *,
    vocab_size: int = 30000,
    **train_kwargs: Any,
) -> Tokenizer:
    """Loads `model_path` (`.../NAME.model`), training it from `texts()` first if it is absent.

    Several processes may call this at once: each may train, the atomic rename makes the file
    appear whole, and all of them load the same bytes afterwards only if they trained with the
    same inputs; so train on one process (or ahead of time) when inputs can differ.
    """
    if not model_path.endswith(".model"):
        raise ValueError(f"model_path must end with '.model' (got {model_path!r})")
    if not files.as_path(model_path).is_file():
        train_tokenizer(texts(), model_path[: -len(".model")], vocab_size, **train_kwargs)
    return Tokenizer(model_path)


def _main(argv: list[str]) -> None:
    from absl import flags, logging

    from albert_jax.data import sentences, sources

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    srcs = sources.parse_sources(FLAGS.source)
    per_source = max(1, FLAGS.max_documents // len(srcs)) if FLAGS.max_documents else None

    def texts() -> Iterable[str]:
        for src in srcs:
            for n, doc in enumerate(
                sources.iter_documents(src, split=FLAGS.split, data_dir=FLAGS.data_dir)
            ):
                if per_source is not None and n >= per_source:
                    break
                yield from sentences.split_sentences(doc.get("text", ""))

    path = train_tokenizer(
        texts(),
        FLAGS.output[: -len(".model")] if FLAGS.output.endswith(".model") else FLAGS.output,
        vocab_size=FLAGS.vocab_size,
        max_sentences=FLAGS.max_sentences,
        seed=FLAGS.seed,
    )
    logging.info("wrote %s", path)
    print(path)


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("source", None, "Sources spec (albert_jax.data.sources.parse_sources).")
    flags.DEFINE_string("output", None, "Model prefix; writes PREFIX.model and PREFIX.vocab.")
    flags.DEFINE_integer("vocab_size", 30000, "Number of pieces (official: 30000).")
    flags.DEFINE_string("data_dir", None, "TFDS data dir of the sources.")
    flags.DEFINE_string("split", "train", "Split to read.")
    flags.DEFINE_integer("max_sentences", 1_000_000, "Sentences sampled for training.")
    flags.DEFINE_integer("max_documents", 0, "Read at most this many documents (0 = all).")
    flags.DEFINE_integer("seed", 0, "Seed of the sentence sample.")
    flags.mark_flags_as_required(["source", "output"])


if __name__ == "__main__":
    from albert_jax.runtime import cli

    _define_flags()
    cli.run(_main)
