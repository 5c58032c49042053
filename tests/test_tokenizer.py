"""Tokenizer: ALBERT normalization, special ids, whole-word table, training, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from albert_jax import files
from albert_jax.data.tokenizer import (
    Tokenizer,
    is_start_piece,
    load_or_train_tokenizer,
    preprocess_text,
    train_tokenizer,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("  Hello \t  World\n\nAgain  ", "hello world again"),  # whitespace collapsed, stripped
        ("Café naïve Ångström", "cafe naive angstrom"),  # NFKD + combining marks dropped
        ("ﬁnal Ｆｕｌｌ ²", "final full 2"),  # compatibility forms (NFKD)
        ("``Quoted''", "``quoted''"),  # the official code leaves quotes alone
        ("ÉCOLE", "ecole"),
        ("", ""),
    ],
)
def test_preprocess_text(text, expected):
    assert preprocess_text(text) == expected


def test_preprocess_text_options():
    assert preprocess_text("Café", lower=False) == "Cafe"
    assert preprocess_text("``Hi''", replace_quotes=True) == '"hi"'


def test_special_ids(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.cls_id) == (0, 1, 2)
    assert (tokenizer.sep_id, tokenizer.mask_id) == (3, 4)
    assert [tokenizer.id_to_piece(i) for i in range(5)] == [
        "<pad>",
        "<unk>",
        "[CLS]",
        "[SEP]",
        "[MASK]",
    ]
    # User-defined symbols follow, in the official order.
    assert [tokenizer.id_to_piece(i) for i in range(5, 13)] == list('()"-.–£€')
    assert tokenizer.vocab_size == 3000
    ids = tokenizer.encode("The cat sat.")
    assert ids and not {0, 2, 3, 4} & set(ids)  # nothing special is added
    assert tokenizer.decode(ids) == "the cat sat."


def test_encode_normalizes_first(tokenizer):
    assert tokenizer.encode("  The   CAFÉ ") == tokenizer.encode("the cafe")
    assert tokenizer.encode_batch(["The CAT", "x"]) == [
        tokenizer.encode("the cat"),
        tokenizer.encode("x"),
    ]


def test_model_without_albert_ids_is_rejected(tmp_path):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["the quick brown fox jumps over the lazy dog"] * 50),
        model_prefix=str(tmp_path / "plain"),
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="<pad>"):
        Tokenizer(str(tmp_path / "plain.model"))


@pytest.mark.parametrize(
    "piece, start",
    [
        ("▁the", True),  # starts with ▁
        ("<unk>", True),  # starts with <
        (",", True),  # official punctuation
        ("ing", False),  # continuation piece
        ("ed.", False),  # letters + official punctuation only
        ("'s", True),  # apostrophe is not in the official set
        ("9", True),  # digits
        ("é", True),  # non-[a-z] letter
        ("[MASK]", False),  # brackets and letters only
    ],
)
def test_is_start_piece(piece, start):
    assert is_start_piece(piece) is start


def test_word_start_table(tokenizer):
    table = tokenizer.word_start
    assert table.shape == (tokenizer.vocab_size,) and table.dtype == bool
    for i in range(tokenizer.vocab_size):
        assert table[i] == is_start_piece(tokenizer.id_to_piece(i))
    assert table[tokenizer.piece_to_id("▁the")]
    assert 0.05 < (~table).mean() < 0.95  # both kinds really occur


def test_digit_comma_quirk(tokenizer, tmp_path):
    """A piece `▁1990,` is re-encoded as the pieces of `1990` plus `,` (official encode_pieces)."""
    proto = sentencepiece_model_pb2.ModelProto()
    with open(tokenizer.model_path, "rb") as f:
        proto.ParseFromString(f.read())
    piece = proto.pieces.add()
    piece.piece, piece.score, piece.type = "▁1990,", 0.0, piece.NORMAL
    path = tmp_path / "quirk.model"
    path.write_bytes(proto.SerializeToString())
    quirky = Tokenizer(str(path))
    plain = spm.SentencePieceProcessor(model_file=str(path))
    assert "▁1990," in plain.encode("in 1990, we", out_type=str)  # the piece is really used
    pieces = quirky.encode_pieces("In 1990, we")
    assert "▁1990," not in pieces
    digits = plain.encode("1990", out_type=str)
    assert pieces == ["▁in", *digits, ",", "▁we"]


def test_train_tokenizer_settings(tokenizer, tmp_path):
    proto = sentencepiece_model_pb2.ModelProto()
    with open(tokenizer.model_path, "rb") as f:
        proto.ParseFromString(f.read())
    spec = proto.trainer_spec
    assert spec.model_type == spec.UNIGRAM
    assert (spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id) == (0, 1, -1, -1)
    assert list(spec.control_symbols) == ["[CLS]", "[SEP]", "[MASK]"]
    assert spec.input_sentence_size == 15000
    vocab = tokenizer.model_path[: -len(".model")] + ".vocab"
    with open(vocab, encoding="utf-8") as f:
        assert len(f.readlines()) == tokenizer.vocab_size
    leftovers = [n for n in os.listdir(os.path.dirname(vocab)) if ".tmp" in n]
    assert leftovers == []
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(["", "   "], str(tmp_path / "x"), vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["a"], str(tmp_path / "x"), vocab_size=3)


def test_atomic_write_races(tmp_path):
    """Concurrent writers (the tokenizer's `files.write_atomic`): the file is always one
    complete version, never a mix."""
    path = str(tmp_path / "model.bin")
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    threads = [threading.Thread(target=files.write_atomic, args=(path, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(path, "rb") as f:
        assert f.read() in payloads
    assert os.listdir(tmp_path) == ["model.bin"]


def test_tokenizer_pickles(tokenizer):
    import pickle

    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode("Hello there, world.") == tokenizer.encode("Hello there, world.")
    assert np.array_equal(clone.word_start, tokenizer.word_start)
    assert clone.fingerprint == tokenizer.fingerprint


def test_cli_help():
    out = subprocess.run(
        [sys.executable, "-m", "albert_jax.data.tokenizer", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert "Traceback" not in out.stderr, out.stderr  # absl exits 1 after printing --help
    for flag in ("--source", "--vocab_size", "--output", "--max_sentences"):
        assert flag in out.stdout


def test_load_or_train_trains_once(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return ["the quick brown fox jumps over the lazy dog, again and again."] * 200

    path = str(tmp_path / "first_use.model")
    first = load_or_train_tokenizer(path, texts, vocab_size=60, hard_vocab_limit=False)
    second = load_or_train_tokenizer(path, texts, vocab_size=60)
    assert calls == [1] and first.fingerprint == second.fingerprint
    with pytest.raises(ValueError, match=".model"):
        load_or_train_tokenizer(str(tmp_path / "x.spm"), texts)


def test_tokenizer_reads_and_writes_gs(gcs, tokenizer, tmp_path, monkeypatch):
    """`Tokenizer("gs://...")` reads the model bytes through the file layer; training writes
    the .model and .vocab there; nothing lands in the working directory."""
    monkeypatch.chdir(tmp_path)
    prefix = f"tokenizer-{tmp_path.name}"
    files.copy(tokenizer.model_path, gcs.url(f"{prefix}/session.model"))
    remote = Tokenizer(gcs.url(f"{prefix}/session.model"))
    assert remote.fingerprint == tokenizer.fingerprint
    assert remote.encode("Emma smiled, 1990.") == tokenizer.encode("Emma smiled, 1990.")
    calls = []

    def texts():
        calls.append(1)
        return ["the quick brown fox jumps over the lazy dog, again and again."] * 200

    path = gcs.url(f"{prefix}/first_use.model")
    first = load_or_train_tokenizer(path, texts, vocab_size=60, hard_vocab_limit=False)
    second = load_or_train_tokenizer(path, texts, vocab_size=60)
    assert calls == [1] and first.fingerprint == second.fingerprint
    assert gcs.exists(f"{prefix}/first_use.vocab") and second.model_path == path
    with pytest.raises(ValueError, match=f"{prefix}/missing.model"):
        Tokenizer(gcs.url(f"{prefix}/missing.model"))
    assert os.listdir(tmp_path) == []


def test_a_file_that_is_not_a_sentencepiece_model_is_named(tmp_path):
    """sentencepiece's own `RuntimeError: INTERNAL: ...` named no file."""
    bogus = tmp_path / "vocab.txt"
    bogus.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ValueError, match=rf"Tokenizer: '{bogus}' is not a sentencepiece model"):
        Tokenizer(str(bogus))
