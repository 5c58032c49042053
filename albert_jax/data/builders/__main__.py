"""Prepares document sources ahead of training and prints what was built, as JSON lines.

    python -m albert_jax.data.builders --sources="books=/data/books;/more/books" \\
        --data_dir=gs://my-bucket/tfds

Run it once before a multi-host job, so that hosts only read. One JSON object per source
(see `albert_jax.data.sources.prepare_sources`); catalog datasets are reported with
`"prepared": true|false` and never downloaded.

A prepared dataset whose input files changed since it was built is refused (the error names
the file and what changed); `--rebuild` deletes the prepared datasets of the local sources
listed and builds them again from their files as they are now (from the files they were built
from when the spec names none):

    python -m albert_jax.data.builders --sources="documents/mine=/data/mine.jsonl" --rebuild
"""

from __future__ import annotations

import json

from absl import app, flags

from albert_jax.data import line_reading
from albert_jax.data.sources import prepare_sources
from albert_jax.runtime import cli

_SOURCES = flags.DEFINE_string(
    "sources", None, "Mixture spec, e.g. 'demo' or 'books=/data/books/*.txt:1,demo:1'."
)
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "TFDS data dir (default: $TFDS_DATA_DIR, else ~/tensorflow_datasets)."
)
_REBUILD = flags.DEFINE_bool(
    "rebuild",
    False,
    "Delete the prepared datasets of the local sources in --sources and build them again "
    "from their files as they are now (nothing may read them meanwhile).",
)

_MAX_LINE_BYTES = flags.DEFINE_integer(
    "max_line_bytes",
    line_reading.DEFAULT_MAX_LINE_BYTES,
    "Longest input line (and whole-file document) read; longer ones are skipped and counted.",
)
_MAX_BLANK_LINES = flags.DEFINE_integer(
    "max_blank_lines",
    line_reading.DEFAULT_MAX_BLANK_LINES,
    "Longest run of blank lines read; a longer one ends its file's read (counted).",
)
_MAX_BAD_LINES = flags.DEFINE_integer(
    "max_bad_lines",
    line_reading.DEFAULT_MAX_BAD_LINES,
    "Longest run of unparsable lines read; a longer one ends its file's read (counted).",
)
_MAX_EXPANSION = flags.DEFINE_integer(
    "max_expansion",
    line_reading.DEFAULT_MAX_EXPANSION,
    "Most bytes a compressed file may expand to per stored byte; past it its read ends.",
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    limits = line_reading.LineLimits(
        _MAX_LINE_BYTES.value, _MAX_BLANK_LINES.value, _MAX_BAD_LINES.value, _MAX_EXPANSION.value
    )
    reports = prepare_sources(
        _SOURCES.value, data_dir=_DATA_DIR.value, rebuild=_REBUILD.value, limits=limits
    )
    for report in reports:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    flags.mark_flag_as_required("sources")
    cli.run(main)
