"""What a run needs on disk before its first step: local TFDS sources built and a tokenizer.

Process 0 does the work; the others wait at a barrier and then read the same files.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
from absl import logging
from jax.experimental import multihost_utils

from albert_jax import checkpointing, files
from albert_jax.data import line_reading

PyTree = Any


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """What `build_sources` and `prepare_tokenizer` read (`pretrain.settings`)."""

    sources: str  # the `data.sources` spec
    data_dir: str | None  # TFDS data dir
    tokenizer: str  # config.data.tokenizer ("": the workdir's, the source runs', or trained)
    tokenizer_max_sentences: int  # sentences a trained tokenizer reads
    limits: line_reading.LineLimits  # the read bounds of the input files
    vocab_size: int  # pieces of a trained tokenizer
    seed: int

    @classmethod
    def from_config(cls, config: Any) -> PrepareSettings:
        """The section of a pretraining config (`config.data`'s source and tokenizer fields,
        `config.model.vocab_size` or the size preset's, `config.seed`); raises ValueError
        naming a bad read bound."""
        from albert_jax.model.config import model_config_from

        data = config.data
        return cls(
            sources=data.sources,
            data_dir=data.get("data_dir"),
            tokenizer=data.get("tokenizer") or "",
            tokenizer_max_sentences=int(data.get("tokenizer_max_sentences", 1_000_000)),
            limits=line_reading.LineLimits.from_config(data, "config.data"),
            vocab_size=model_config_from(config).vocab_size,
            seed=int(config.seed),
        )


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _find_tokenizer(directory: str | None) -> str | None:
    if not directory:
        return None
    path = files.as_path(directory) / checkpointing.TOKENIZER_FILE
    return str(path) if path.is_file() else None


def _train_tokenizer_texts(settings: PrepareSettings) -> Any:
    """Sentences of the train split, at most `tokenizer_max_sentences`, split by source weight."""
    from albert_jax.data import sentences, sources

    limit = settings.tokenizer_max_sentences
    for src in sources.parse_sources(settings.sources):
        quota = max(1, math.ceil(limit * src.weight))
        docs = sources.iter_documents(src, split="train", data_dir=settings.data_dir)
        for doc in docs:
            for sentence in sentences.split_sentences(doc["text"]):
                yield sentence
                quota -= 1
            if quota <= 0:
                break


def prepare_tokenizer(
    settings: PrepareSettings, workdir: str, extra_dirs: tuple[str | None, ...] = ()
) -> Any:
    """The run's tokenizer, saved as WORKDIR/tokenizer.model (what `load_pretrained` reads).

    Order: `config.data.tokenizer` (refused when the workdir already has another one: the
    run's own is never replaced); a tokenizer already in the workdir; one found in
    `extra_dirs` (the resume_from / init_from runs); else trained on the sources on first use
    (process 0; vocabulary = config.model.vocab_size; atomic write, the others wait).
    """
    from albert_jax.data.tokenizer import Tokenizer, train_tokenizer_proto

    target = str(files.as_path(workdir) / checkpointing.TOKENIZER_FILE)
    given = settings.tokenizer
    if given and not files.as_path(given).is_file():
        raise ValueError(f"config.data.tokenizer={given!r} does not exist")
    if given:  # checked before it is copied: a wrong file must not become the run's tokenizer
        try:
            Tokenizer(given)
        except ValueError as e:
            raise ValueError(f"config.data.tokenizer: {e}") from None
    own = _find_tokenizer(workdir)
    if given and own and files.as_path(given).read_bytes() != files.as_path(own).read_bytes():
        # The run's checkpoints were trained with its own tokenizer (perhaps the only copy of
        # one it trained): neither replaced nor silently swapped for another vocabulary.
        raise ValueError(
            f"config.data.tokenizer={given!r} is not this run's tokenizer {own}: the run was "
            "trained with the latter, and it would be replaced. Resume without "
            "config.data.tokenizer, or start a new --workdir (with init_from= this one to "
            "start from its weights)"
        )
    source = given or own
    for directory in extra_dirs:
        source = source or _find_tokenizer(directory)
    if jax.process_index() == 0:
        if source is None:
            vocab = settings.vocab_size
            logging.info("training a %d-piece sentencepiece model on %s", vocab, settings.sources)
            start = time.perf_counter()
            proto = train_tokenizer_proto(
                _train_tokenizer_texts(settings),
                vocab,
                max_sentences=settings.tokenizer_max_sentences,
                seed=settings.seed,
            )
            files.write_atomic(target, proto)  # local or gs://
            logging.info("tokenizer trained in %.1fs: %s", time.perf_counter() - start, target)
        else:
            files.copy(source, target)  # a no-op when the tokenizer is the workdir's already
    barrier("tokenizer")
    return Tokenizer(model_proto=files.as_path(target).read_bytes())


def build_sources(settings: PrepareSettings) -> None:
    """Prepares our TFDS datasets once (process 0) before every process reads them: ArrayRecord
    in a local data dir, TFRecord in a `gs://` one (`builders.base.file_format_for`)."""
    from albert_jax.data import sources

    if jax.process_index() == 0:
        for src in sources.parse_sources(settings.sources):
            if src.is_local:  # config.data.max_line_bytes / max_blank_lines bound the reading
                sources.build_source(src, data_dir=settings.data_dir, limits=settings.limits)
    barrier("sources")
