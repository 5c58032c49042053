"""Batch prediction and sentence embeddings over a JSON Lines file of any size.

  python -m albert_jax.predict --src=WORKDIR_OR_EXPORT --input=IN.jsonl[.gz] --output=OUT.jsonl
  python -m albert_jax.predict --src=PRETRAINED --input=IN.jsonl --output=OUT.jsonl --embed=mean

`--src` is a serving artifact (`python -m albert_jax.export`: loaded without the model code) or
any checkpoint (`export.in_process`: a fine-tuning run predicts its task, anything else
embeds). Each input line is a record with the task's fields (`serving`'s table: a task's own
eval file predicts as it is); each output line is {"id", ...the prediction} — the record's "id"
when it has one, else `<file stem>-<line index>` as the evaluation's predictions files call it
— in input order. `--embed=cls|mean` writes {"id", "embedding": [H floats]} of the text field
(`--text_field`; default the model's first text field) instead.

The input is read in chunks of `--chunk` records (any size of file in bounded memory), each
chunk's rows sorted into length buckets and run `--batch_size` at a time; progress with the
rate and the time left goes to stderr every `--progress_every_s` seconds (the lines are
counted first, one pass over the file). A line without the task's fields (or not JSON) is
skipped and counted: the first of each reason is named with its file and line, the rest of
the file is still predicted, and the counts end the output. Paths are local or gs://; the
output appears whole when the command succeeds.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from albert_jax import files, serving
from albert_jax.files import BadRecordError
from albert_jax.tasks.json_records import LINE_LIMITS, jsonl_records
from albert_jax.tasks.records import ClassificationExample, ReadStats

__all__ = ["load_model", "predict_file"]


def load_model(src: str, run_seed: int | None = None) -> serving.Served:
    """The artifact at `src` (it holds a manifest.json), else the checkpoint in process."""
    if (files.as_path(src) / serving.MANIFEST).is_file():
        if run_seed is not None:
            raise ValueError(f"--run_seed: {src} is an artifact of one model (its seed chosen)")
        return serving.load(src)
    from albert_jax.export import in_process

    return in_process(src, run_seed=run_seed)


def _count_lines(path: str) -> int:
    count = 0
    with files.open_binary(path) as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
    return count


def _text_field(served: serving.Served, text_field: str | None) -> str:
    if text_field:
        return text_field
    for role in ("text", "text_a"):
        if role in served.fields:
            return served.fields[role]
    raise ValueError(
        f"--embed: a {served.kind} model's records have no single text field "
        f"({sorted(served.fields.values())}); name the one to embed with --text_field"
    )


class _Progress:
    """A line to stderr every `every_s` seconds: done / total lines, rate, time left."""

    def __init__(self, total: int, every_s: float):
        self.total, self.every_s = total, every_s
        self.start = self.last = time.monotonic()

    def update(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        left = (self.total - done) / rate if rate > 0 else float("inf")
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        eta = "" if final else f", {_duration(left)} left"
        print(
            f"predict: {done:,}/{self.total:,} lines{share}, {rate:,.1f} lines/s{eta}",
            file=sys.stderr,
            flush=True,
        )


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}"


def _records(path: str, stats: ReadStats) -> Iterator[tuple[str, str, dict]]:
    """(id: the record's "id" or the generated one, "file:line", record) of each JSON line."""
    for generated, where, record in jsonl_records(path, stats, None, LINE_LIMITS):
        yield str(record.get("id", generated)), where, record


def predict_file(
    served: serving.Served,
    input_path: str,
    output_path: str,
    *,
    embed: str | None = None,
    text_field: str | None = None,
    batch_size: int = serving.DEFAULT_BATCH_SIZE,
    chunk: int = 4096,
    progress_every_s: float = 10.0,
) -> dict[str, Any]:
    """Predicts (or embeds) every record of `input_path` into `output_path` (see the module
    docstring); returns {"read", "written", "skipped" {reason: count}, "first_skipped"
    {reason: "file:line"}, "seconds"}."""
    if embed is not None and embed not in serving.POOLINGS:
        raise ValueError(f"--embed={embed}: choose one of {list(serving.POOLINGS)}")
    if embed is None and "predict" not in served.functions:
        raise ValueError(
            "--src is an encoder without a task head: pass --embed=cls|mean (or export a "
            "fine-tuning run to predict its task)"
        )
    field = _text_field(served, text_field) if embed else None
    stats = ReadStats()
    progress = _Progress(_count_lines(input_path), progress_every_s)
    written = 0

    def example(example_id: str, record: dict) -> Any:
        if field is None:
            return served.example(record, example_id)
        from albert_jax.tasks.json_records import text_field as read_text

        return ClassificationExample(example_id, read_text(record, field), None, 0)

    def flush(out: Any, examples: list) -> int:
        if not examples:
            return 0
        if embed:
            vectors = served.embed([e.text_a for e in examples], embed, batch_size)
            pairs = zip(examples, vectors, strict=True)
            lines = [{"id": e.id, "embedding": v.tolist()} for e, v in pairs]
        else:
            lines = served.predict_examples(examples, batch_size)
        out.write("".join(json.dumps(line) + "\n" for line in lines).encode("utf-8"))
        return len(lines)

    with files.open_atomic(output_path) as out:
        pending: list = []
        for example_id, where, record in _records(input_path, stats):
            try:
                pending.append(example(example_id, record))
            except BadRecordError as bad:
                if bad.reason not in stats.first_skipped:
                    print(f"skipped {where}: {_reason(bad.reason)}", file=sys.stderr)
                stats.skip(bad.reason, where)
            if len(pending) >= chunk:
                written += flush(out, pending)
                pending = []
                progress.update(stats.read)
        written += flush(out, pending)
    progress.update(stats.read, final=True)
    return {
        "read": stats.read, "written": written, "skipped": dict(stats.skipped),
        "first_skipped": stats.first_skipped,
        "seconds": round(time.monotonic() - progress.start, 3),
    }  # fmt: skip


def _reason(reason: str) -> str:
    """ "missing_field:sentence" -> "missing field 'sentence'"."""
    what, _, field = reason.partition(":")
    return f"{what.replace('_', ' ')} {field!r}" if field else what.replace("_", " ")


# ---------------------------------------------------------------------------------------- CLI
def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string(
        "src", None, "A serving artifact dir (python -m albert_jax.export) or a checkpoint: a "
        "fine-tuning workdir, or any checkpoint load_pretrained reads (with --embed).",
    )  # fmt: skip
    flags.DEFINE_string("input", None, "JSON Lines records (.gz or not), local or gs://.")
    flags.DEFINE_string("output", None, "JSON Lines predictions, local or gs://.")
    flags.DEFINE_enum("embed", None, list(serving.POOLINGS), "Write sentence embeddings.")
    flags.DEFINE_string("text_field", None, "--embed: the record field to embed.")
    flags.DEFINE_integer("batch_size", serving.DEFAULT_BATCH_SIZE, "Rows a batch.")
    flags.DEFINE_integer("chunk", 4096, "Records read and sorted into buckets at a time.")
    flags.DEFINE_integer("run_seed", None, "A checkpoint of several seeds: the seed to use.")
    flags.DEFINE_float("progress_every_s", 10.0, "Seconds between progress lines.")
    flags.mark_flags_as_required(["src", "input", "output"])


def main(argv: list[str]) -> None:
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    FLAGS = flags.FLAGS
    if FLAGS.batch_size < 1 or FLAGS.chunk < 1:
        raise app.UsageError("--batch_size and --chunk must be at least 1")
    if not files.as_path(FLAGS.input).is_file():
        raise ValueError(f"--input={FLAGS.input}: no such file")
    served = load_model(FLAGS.src, FLAGS.run_seed)
    report = predict_file(
        served, FLAGS.input, FLAGS.output, embed=FLAGS.embed, text_field=FLAGS.text_field,
        batch_size=FLAGS.batch_size, chunk=FLAGS.chunk, progress_every_s=FLAGS.progress_every_s,
    )  # fmt: skip
    what = f"{FLAGS.embed} embeddings" if FLAGS.embed else "predictions"
    print(f"wrote {report['written']:,} {what} to {FLAGS.output} in {report['seconds']:.1f} s")
    if report["skipped"]:
        counts = ", ".join(f"{_reason(k)}: {v}" for k, v in sorted(report["skipped"].items()))
        first = ", ".join(sorted(report["first_skipped"].values()))
        print(f"skipped {sum(report['skipped'].values()):,} lines ({counts}; first at {first})")


if __name__ == "__main__":
    from albert_jax.runtime import cli

    _define_flags()
    cli.run(main)
