"""What all our document builders share: config, features, splits, counters, reading.

Every builder turns local files into `{"title": str, "text": str}` documents (paragraphs or
sentences separated by "\\n") with two splits:

- `validation`: the documents whose title hashes below `validation_fraction` (SHA-256 of the
  title). The held-out set is decided per document, so it does not move when files are added
  or reordered, and a builder can skip the expensive cleaning of documents of the other split.
  A corpus so small that no title falls below the fraction holds out the one document with
  the smallest title hash instead (recorded as `validation_fallback_title` in the metadata).
- `train`: all the other documents.

The metadata also records the inputs' fingerprints and a build id (see `prepared.py`), so that
a dataset is never silently used with inputs that changed since it was built.

TFDS runs one pass over the inputs per split. Counters (what was skipped or repaired) are
kept per split and stored in the dataset's `metadata.json`; `counters(builder)` reads them.
Counters about documents (written, empty, decode errors) are counted in the pass of the
document's split; counters about inputs (files, pages, broken JSON lines, redirects...) are
counted once, in the `train` pass. So summing over splits never counts anything twice.

Records are written in TFDS's deterministic order (a hash of the example key). The file format
(`file_format_for`): ArrayRecord in a local data dir, for random access through
`tfds.data_source` (`as_dataset` works too, through a generator over the same source); TFRecord
in an object-store data dir (`gs://`), because ArrayRecord's writer opens local files only. A
TFRecord dataset is read sequentially through `as_dataset`, which is all the pretraining
pipeline needs (it reads each shard once, into its tokenized cache). `file_format=` overrides.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from albert_jax.data.builders.prepared import fingerprint, new_build_id
from albert_jax.data.builders.text_files import resolve_files
from albert_jax.data.line_reading import (
    DEFAULT_MAX_BAD_LINES,
    DEFAULT_MAX_BLANK_LINES,
    DEFAULT_MAX_EXPANSION,
    DEFAULT_MAX_LINE_BYTES,
    LineLimits,
)
from albert_jax.files import is_local
from albert_jax.runtime.process_setup import hide_accelerators_from_tensorflow

if TYPE_CHECKING:
    import tensorflow as tf

TRAIN = "train"
VALIDATION = "validation"
# Input that is not UTF-8 text (`_check_decoding`): binary data replaces this fraction of its
# characters or more; another encoding leaves most documents with a replaced byte.
MAX_REPLACED_FRACTION = 0.05
MIN_CHARACTERS_JUDGED, MIN_DOCUMENTS_JUDGED = 1000, 10
VERSION = tfds.core.Version("1.0.0")
_READ_CHUNK = 256  # records fetched per random-access call when streaming
# LocalTextConfig fields left out of the dataset's recorded config (see its docstring): a dataset
# prepared before they existed, or with other bounds, is still the same dataset.
_NOT_IDENTITY = frozenset({"max_line_bytes", "max_blank_lines", "max_bad_lines", "max_expansion"})


@dataclasses.dataclass
class LocalTextConfig(tfds.core.BuilderConfig):
    """Inputs of one prepared dataset; its `name` names the folder under the builder's.

    Attributes:
      files: file paths, globs or directories (local or gs://); see `resolve_files`.
      validation_fraction: share of documents (by title hash) held out as `validation`;
        0 builds `train` only.
      max_line_bytes, max_blank_lines, max_bad_lines, max_expansion: the bounds of reading the
        files (`line_reading.LineLimits`): longer lines and whole-file documents are skipped
        and counted (`lines_too_long`, `documents_too_long`); a longer run of blank or
        unparsable lines, or a compressed file expanding past the ratio, ends its file's read
        (`blank_runs_too_long`, `bad_runs_too_long`, `expansions_too_large`). Not part of the
        dataset's identity (`_config_record`): they only guard the host against broken
        files, and what they skipped is in the counters.
    """

    files: tuple[str, ...] = ()
    validation_fraction: float = 0.01
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_blank_lines: int = DEFAULT_MAX_BLANK_LINES
    max_bad_lines: int = DEFAULT_MAX_BAD_LINES
    max_expansion: int = DEFAULT_MAX_EXPANSION

    def __post_init__(self):
        if isinstance(self.files, str):
            self.files = (self.files,)
        self.files = tuple(str(f) for f in self.files)
        _ = self.line_limits  # bad bounds raise here (naming the field), not mid-build
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(
                f"validation_fraction must be in [0, 1), got {self.validation_fraction}"
            )

    @property
    def line_limits(self) -> LineLimits:
        """The `line_reading.read_lines` bounds of this config's fields."""
        return LineLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LineLimits)})


def file_format_for(data_dir: str | os.PathLike) -> str:
    """The file format of new datasets in `data_dir`: `array_record` in a local one (random
    access), `tfrecord` on an object store (gs://...), where ArrayRecord's writer cannot write:
    it opens local files only (on real GCS as well)."""
    return "array_record" if is_local(data_dir) else "tfrecord"


def _title_hash(title: str) -> int:
    return int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "big")


def in_validation(title: str, fraction: float) -> bool:
    """True for the held-out documents: those whose title hashes into the first `fraction`."""
    return _title_hash(title) < fraction * 2.0**64


class _SplitSelector:
    """`selector(title)` says whether a document belongs to `split`; sees every title."""

    def __init__(self, split: str, fraction: float, extra_validation_title: str | None):
        self.split = split
        self.fraction = fraction
        self.extra_validation_title = extra_validation_title
        self.smallest: tuple[int, str] | None = None  # (hash, title) of all titles seen
        self.selected = 0  # titles that belonged to the split

    def __call__(self, title: str) -> bool:
        key = (_title_hash(title), title)
        if self.smallest is None or key < self.smallest:
            self.smallest = key
        held_out = in_validation(title, self.fraction) or title == self.extra_validation_title
        selected = held_out == (self.split == VALIDATION)
        self.selected += selected
        return selected


class Tally:
    """Counters of one split's pass; input counters only count in the `train` pass."""

    def __init__(self, split: str):
        self.split = split
        self.counts: collections.Counter[str] = collections.Counter()
        # Characters of the kept documents, and how many are U+FFFD (`_check_decoding`).
        self.characters = self.replaced = 0

    def document(self, name: str, n: int = 1) -> None:
        """Counts an event of a document that belongs to this pass's split."""
        self.counts[name] += n

    def input(self, name: str, n: int = 1) -> None:
        """Counts an event of the inputs (not tied to one split's documents), once."""
        if self.split == TRAIN:
            self.counts[name] += n


class LocalTextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the builders of local text; subclasses implement `_read_documents`.

    Not registered in the TFDS catalog (names such as "books" could collide with future catalog
    datasets); construct the classes directly or go through `albert_jax.data.sources`.
    """

    VERSION = VERSION
    RELEASE_NOTES = {"1.0.0": "First release."}
    # Names of files a directory pattern contributes.
    FILE_SUFFIXES: tuple[str, ...] = ()
    # Whether `decode_errors` counts documents (`tally.document`) or input bytes / lines.
    DECODE_ERRORS_PER_DOCUMENT = True
    DESCRIPTION = ""

    def download_and_prepare(self, *args: Any, **kwargs: Any) -> None:
        """TFDS's, after hiding the accelerators from TensorFlow, which writes the dataset.
        No progress bars: in a log they leave a residue (on the line of an error message)."""
        hide_accelerators_from_tensorflow()
        tfds.disable_progress_bar()
        super().download_and_prepare(*args, **kwargs)

    def _log_download_bytes(self) -> None:
        # TFDS prints "Downloading and preparing dataset Unknown size (download: Unknown
        # size, ...)" of local files: one log line says what is built, and where.
        logging.info("building %s in %s", self.info.full_name, self.data_dir)

    def _log_download_done(self) -> None:
        pass  # the split counts logged after the build say it is done

    def __init__(self, *, file_format: str | None = None, **kwargs: Any):
        super().__init__(file_format=file_format, **kwargs)
        # New datasets get the format of their data dir; a prepared one keeps its own.
        if file_format is None and not self.is_prepared():
            self.info.set_file_format(file_format_for(self.data_dir), override=True)

    @property
    def config(self) -> LocalTextConfig:
        return self.builder_config  # type: ignore[return-value]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.DESCRIPTION,
            features=tfds.features.FeaturesDict(
                {"title": tfds.features.Text(), "text": tfds.features.Text()}
            ),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        del dl_manager  # inputs are local files
        if self.builder_config is None:
            raise ValueError(f"{self.name}: a config with `files` is required")
        files = resolve_files(self.config.files, self.FILE_SUFFIXES)
        self.info.metadata.update(
            {
                "files": files,
                # Taken before reading: a file changed during the build then reads as changed.
                "inputs": fingerprint(files),
                "build_id": new_build_id(),
                "config": self._config_record(),
                "counters": {},
            }
        )
        # TFDS generates splits one after the other in this order: `validation` first, so
        # that `train` knows the fallback document a tiny corpus holds out.
        self._extra_validation_title: str | None = None
        splits = {}
        if self.config.validation_fraction > 0:
            splits[VALIDATION] = self._generate_examples(files=files, split=VALIDATION)
        splits[TRAIN] = self._generate_examples(files=files, split=TRAIN)
        return splits

    def _config_record(self) -> dict[str, Any]:
        """The config fields that decide the content (stored to detect stale datasets)."""
        skip = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)} | {"files"}
        skip |= _NOT_IDENTITY
        return {
            f.name: getattr(self.config, f.name)
            for f in dataclasses.fields(self.config)
            if f.name not in skip
        }

    def _documents(self, files: list[str], wants: Callable[[str], bool], tally: Tally):
        for key, title, text in self._read_documents(files, wants, tally):
            text = text.strip()
            if not text:
                tally.document("empty_documents")
                continue
            tally.document("documents")
            tally.characters += len(text)
            tally.replaced += text.count("\ufffd")
            yield key, {"title": title, "text": text}

    def _generate_examples(self, files: list[str], split: str):
        """Yields (key, {"title", "text"}) for the documents of `split`; records counters."""
        tally = Tally(split)
        selector = _SplitSelector(
            split, self.config.validation_fraction, self._extra_validation_title
        )
        yield from self._documents(files, selector, tally)
        if split == VALIDATION and not selector.selected and selector.smallest:
            # No title hashed below the fraction: hold out the smallest-hash document(s).
            title = selector.smallest[1]
            self._extra_validation_title = title
            self.info.metadata["validation_fallback_title"] = title
            yield from self._documents(files, lambda t: t == title, tally)
        written = tally.counts["documents"]
        tally.counts.setdefault("documents", 0)
        if split == TRAIN:
            tally.input("files", len(files))
        counts = dict(sorted(tally.counts.items()))
        self.info.metadata["counters"][split] = counts
        logging.info("%s/%s %s: %s", self.name, self.config.name, split, counts)
        self._check_decoding(files, tally)
        if written == 0:
            raise ValueError(
                f"{self.name}/{self.config.name}: split {split!r} would be empty "
                f"(counters: {counts}). Add input documents, or set validation_fraction=0 "
                "to build `train` only."
            )

    def _check_decoding(self, files: list[str], tally: Tally) -> None:
        """Input that is not UTF-8 text is an error, not a corpus of `<unk>`s: binary data
        (over `MAX_REPLACED_FRACTION` of the characters replaced by U+FFFD) or another
        encoding such as Latin-1 (most of at least `MIN_DOCUMENTS_JUDGED` documents holding
        invalid bytes). A few such documents are a warning: the rest of the corpus is sound."""
        invalid, written = tally.counts.get("decode_errors", 0), tally.counts["documents"]
        if not invalid:
            return
        where = f"{self.name}/{self.config.name} split {tally.split!r}"
        replaced = f"{tally.replaced} of {tally.characters} characters replaced by U+FFFD"
        if self.DECODE_ERRORS_PER_DOCUMENT:
            what = f"{where}: {invalid} of {written} documents hold bytes that are not UTF-8"
        else:
            what = f"{where}: {invalid} runs of bytes that are not UTF-8 in {written} documents"
        what += f" ({replaced})"
        binary = tally.characters >= MIN_CHARACTERS_JUDGED and (
            tally.replaced > tally.characters * MAX_REPLACED_FRACTION
        )
        encoded = (
            self.DECODE_ERRORS_PER_DOCUMENT
            and invalid >= MIN_DOCUMENTS_JUDGED
            and invalid > written / 2
        )
        if binary or encoded:
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise ValueError(
                f"{what}: the input is not UTF-8 text ({shown}); convert it (e.g. iconv -f "
                "LATIN1 -t UTF-8) or leave out what is not text"
            )
        logging.warning("%s; they are kept", what)

    def _read_documents(
        self, files: list[str], wants: Callable[[str], bool], tally: Tally
    ) -> Iterator[tuple[str, str, str]]:
        """Yields (unique key, title, raw text) of the documents `wants(title)` accepts.

        Implementations count skipped or repaired inputs with `tally.input` and events of the
        yielded documents (e.g. "decode_errors") with `tally.document`; the base class strips
        the text and counts written and empty documents.
        """
        raise NotImplementedError

    def _as_dataset(
        self,
        split: Any,
        decoders: Any = None,
        read_config: tfds.ReadConfig | None = None,
        shuffle_files: bool = False,
    ) -> tf.data.Dataset:
        """tf.data over ArrayRecord files (TFDS itself only reads them via `as_data_source`)."""
        hide_accelerators_from_tensorflow()
        import tensorflow as tf  # only here: reading prepared ArrayRecord needs no TensorFlow

        if self.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
            return super()._as_dataset(split, decoders, read_config, shuffle_files)
        if decoders:
            raise ValueError("decoders: not supported for text features; pass None")
        source = self.as_data_source(split)
        order = np.arange(len(source))
        if shuffle_files:  # no files to shuffle here: shuffle the record order instead
            seed = read_config.shuffle_seed if read_config and read_config.shuffle_seed else 0
            order = np.random.default_rng(seed).permutation(order)

        def records() -> Iterator[dict[str, bytes]]:
            for start in range(0, len(order), _READ_CHUNK):
                for record in source.__getitems__(order[start : start + _READ_CHUNK].tolist()):
                    yield {"title": record["title"], "text": record["text"]}

        spec = tf.TensorSpec(shape=(), dtype=tf.string)
        return tf.data.Dataset.from_generator(
            records, output_signature={"title": spec, "text": spec}
        )


def counters(builder: tfds.core.DatasetBuilder, split: str | None = None) -> dict[str, int]:
    """Build counters of a prepared builder (ours, or read back with `builder_from_directory`).

    Args:
      builder: a prepared dataset builder.
      split: one split's counters, or None for the sum over splits (every event once).

    Returns:
      e.g. {"documents": 233, "empty_documents": 1, "bad_json_lines": 2, "files": 3}.
    """
    metadata = builder.info.metadata or {}
    per_split: dict[str, dict[str, int]] = dict(metadata.get("counters", {}))
    if split is not None:
        if split not in per_split:
            raise ValueError(f"split: no counters for {split!r}; have {sorted(per_split)}")
        return dict(per_split[split])
    total: collections.Counter[str] = collections.Counter()
    for counts in per_split.values():
        total.update(counts)
    return dict(sorted(total.items()))
