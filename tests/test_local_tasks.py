"""Readers of the local labelled sets: real files (README counts), bad-record counting, and
bounded reading (a gigantic line or blank run costs seconds and bounded memory)."""

import collections
import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from albert_jax import files
from albert_jax.data import line_reading
from albert_jax.finetune.settings import validate_config
from albert_jax.tasks import local, registry
from albert_jax.tasks.metrics import METRIC_FNS
from configs import finetune as finetune_config


def _tasks_dir(shared_data, *parts):
    return os.path.join(shared_data, "tasks", *parts)


# Record counts from shared/data/README.md (train / dev).
README_COUNTS = {
    "sentiment_rt": (8431, 1109),
    "nli_vitaminc": (43598, 5459),
    "mc_cosmosqa": (5231, 621),
}


@pytest.mark.parametrize("name", sorted(README_COUNTS))
def test_real_files_match_readme_counts(shared_data, name):
    for split, expected in zip(("train", "dev"), README_COUNTS[name], strict=True):
        stats = local.ReadStats()
        examples = local.read_task(
            name, _tasks_dir(shared_data, name, f"{split}.jsonl.gz"), stats=stats
        )
        assert len(examples) == stats.kept == stats.read == expected
        assert stats.skipped_total == 0
        assert len({e.id for e in examples}) == expected
        task = local.TASKS[name]
        labels = collections.Counter(e.label for e in examples)
        assert set(labels) == set(range(task.num_labels))  # every class occurs, none beyond


def test_record_contents(shared_data):
    dev = local.read_nli_vitaminc(_tasks_dir(shared_data, "nli_vitaminc", "dev.jsonl.gz"))
    first = dev[0]
    assert first.text_a.startswith("Thrift Shop: Furthermore")
    assert first.text_b.startswith("Thrift Shop commands")
    assert first.label == local.VITAMINC_LABELS.index("entailment") == 0
    counts = collections.Counter(local.VITAMINC_LABELS[e.label] for e in dev)
    assert counts == {"entailment": 2735, "contradiction": 2026, "neutral": 698}

    sentences = local.read_sentiment_rt(_tasks_dir(shared_data, "sentiment_rt", "dev.jsonl.gz"))
    assert sentences[0].text_b is None and sentences[0].label == 1
    scores = local.read_sentiment_rt_score(_tasks_dir(shared_data, "sentiment_rt", "dev.jsonl.gz"))
    assert scores[0].label == pytest.approx(1.73333333333)
    # The binary label is the sign of the mean rating in this set.
    assert all((s.label > 0) == (c.label == 1) for s, c in zip(scores, sentences, strict=True))

    train = local.read_mc_cosmosqa(_tasks_dir(shared_data, "mc_cosmosqa", "train.jsonl.gz"))
    real_options = collections.Counter(sum(e.option_mask) for e in train)
    assert real_options == {3: 3664, 4: 1566, 2: 1}
    for e in train:
        assert len(e.options) == len(e.option_mask) == local.DEFAULT_NUM_CHOICES
        assert e.option_mask[e.label] == 1
        assert all(o == "" for o, m in zip(e.options, e.option_mask, strict=True) if not m)


def test_squad_shifts_all_questions(shared_data):
    stats = local.ReadStats()
    pattern = _tasks_dir(shared_data, "squad_shifts", "*.json.gz")
    examples = local.read_task("squad_shifts", pattern, stats=stats)
    # README: 4 files, ~37.6k QAs (9,877 amazon + 7,936 new_wiki + 10,056 nyt + 9,767 reddit).
    assert len(examples) == stats.read == 37636 and stats.skipped_total == 0
    assert len({e.id for e in examples}) == 37636
    # Some answer_start offsets are shifted by a few characters in the real files: all are
    # moved onto their text, and every kept answer now points at it.
    assert stats.adjusted == {"answer_start_relocated": 987}
    for e in examples:
        assert not e.is_impossible and e.answers
        for a in e.answers:
            assert e.context[a.answer_start : a.answer_start + len(a.text)] == a.text

    strict = local.ReadStats()
    kept = local.read_squad(
        _tasks_dir(shared_data, "squad_shifts", "nyt_v1.0.json.gz"),
        stats=strict,
        relocate_answers=False,
    )
    assert len(kept) == 10055 and strict.skipped == {"no_valid_answer": 1}
    assert strict.adjusted == {"answer_dropped:not_in_context": 10}


def _write_jsonl_gz(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def test_bad_jsonl_records_are_skipped_and_counted(tmp_path):
    path = tmp_path / "train.jsonl.gz"
    _write_jsonl_gz(
        path,
        [
            {"sentence": "good one", "label": 1, "score": 1.5},
            {"sentence": "no label"},
            {"sentence": "", "label": 0},
            {"sentence": "label two", "label": 2},
            {"sentence": "bool label", "label": True},
            "{not json",
            "",  # blank line: no record
            [1, 2],
            {"sentence": "good two", "label": 0, "score": -0.5},
        ],
    )
    stats = local.ReadStats()
    examples = local.read_sentiment_rt(path, stats=stats)
    assert [e.text_a for e in examples] == ["good one", "good two"]
    assert [e.id for e in examples] == ["train-0", "train-8"]  # ids are line numbers
    assert stats.read == 8 and stats.kept == 2 and stats.skipped_total == 6
    assert stats.skipped == {
        "missing_field:label": 1,
        "empty_text:sentence": 1,
        "label_out_of_range": 1,
        "bad_type:label": 1,
        "invalid_json": 1,
        "not_an_object": 1,
    }
    assert stats.first_skipped["label_out_of_range"] == "train.jsonl.gz:4"

    nli = tmp_path / "nli.jsonl"  # not gzip'ed: detected from the content
    nli.write_text(
        json.dumps({"premise": "p", "hypothesis": "h", "label": "neutral"})
        + "\n"
        + json.dumps({"premise": "p", "hypothesis": "h", "label": "SUPPORTS"})
        + "\n"
    )
    stats = local.ReadStats()
    assert [e.label for e in local.read_nli_vitaminc(nli, stats=stats)] == [1]
    assert stats.skipped == {"unknown_label": 1}

    mc = tmp_path / "mc.jsonl.gz"
    base = {"context": "c", "question": "q"}
    _write_jsonl_gz(
        mc,
        [
            {**base, "options": ["a", "b", "c"], "label": 2},
            {**base, "options": ["a", "b", "c"], "label": 3},
            {**base, "options": ["a"], "label": 0},
            {**base, "options": ["a", "b", "c", "d", "e"], "label": 0},
            {**base, "options": ["a", 5], "label": 0},
            {**base, "options": ["a", " "], "label": 0},
            {"context": "c", "options": ["a", "b"], "label": 0},
        ],
    )
    stats = local.ReadStats()
    (example,) = local.read_mc_cosmosqa(mc, stats=stats)
    assert example.options == ("a", "b", "c", "") and example.option_mask == (1, 1, 1, 0)
    assert stats.skipped == {
        "label_out_of_range": 1,
        "too_few_options": 1,
        "too_many_options": 1,
        "bad_type:options": 1,
        "empty_text:options": 1,
        "missing_field:question": 1,
    }


def test_undecodable_lines_are_skipped_and_counted(tmp_path):
    """One invalid UTF-8 byte costs its line only: counted as `bad_utf8` at its line number,
    the other lines read, in training files as the fine-tuning run reads them (gzip'ed or
    not); a file with no UTF-8 line at all is an error naming it."""
    good = [json.dumps({"sentence": s, "label": 1}).encode() for s in ("first", "third")]
    bad = json.dumps({"sentence": "caf\u00e9", "label": 0}).encode().replace(b"\\u00e9", b"\xe9")
    content = b"\n".join([good[0], bad, good[1]]) + b"\n"
    plain, packed = tmp_path / "train.jsonl", tmp_path / "dev.jsonl.gz"
    plain.write_bytes(content)
    packed.write_bytes(gzip.compress(content))
    for path in (plain, packed):
        stats = local.ReadStats()
        examples = local.read_sentiment_rt(path, stats=stats)
        assert [e.text_a for e in examples] == ["first", "third"]
        assert stats.read == 3 and stats.kept == 2 and stats.skipped == {"bad_utf8": 1}
        assert stats.first_skipped == {"bad_utf8": f"{path.name}:2"}
    train = registry.read_train("sentiment_rt", {"train_files": str(plain)})
    assert len(train.examples) == 2 and train.stats.skipped == {"bad_utf8": 1}

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(bad + b"\n\n" + bad + b"\n")
    with pytest.raises(
        ValueError, match=re.escape(f"{latin1}: none of its 2 lines is UTF-8") + ".*line 1"
    ):
        local.read_sentiment_rt(latin1)


def test_unparsable_squad_json_names_the_file(tmp_path):
    """A truncated SQuAD JSON file (the training / eval reader and the run's evaluator JSON)
    or one with a byte that is not UTF-8 raises one ValueError naming the file, line and
    column, with the parser's error chained."""
    dataset = {"data": [{"title": "T", "paragraphs": [{"context": "Paris is big.", "qas": [
        {"id": "q", "question": "What?", "answers": [{"text": "Paris", "answer_start": 0}]}
    ]}]}]}  # fmt: skip
    text = json.dumps(dataset, indent=1).encode()
    cut = tmp_path / "dev-v1.1.json.gz"
    cut.write_bytes(gzip.compress(text[: len(text) // 2]))
    with pytest.raises(
        ValueError, match=re.escape(f"{cut}: not valid JSON at line ") + r"\d+ column \d+"
    ) as e:
        local.read_squad(cut)
    assert isinstance(e.value.__cause__, json.JSONDecodeError) and "truncated" in str(e.value)
    with pytest.raises(ValueError, match=re.escape(f"{cut}: not valid JSON at line")):
        registry.read_eval("squad_v1", {"eval_files": str(cut)})

    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(text.replace(b"Paris is", b"Par\xeds is"))
    line = 1 + text[: text.index(b"Paris is")].count(b"\n")
    with pytest.raises(
        ValueError, match=re.escape(f"{latin1}: not UTF-8 text at line {line} column")
    ):
        local.read_squad(latin1)
    bom = tmp_path / "bom.json"  # a byte-order mark is not an error
    bom.write_bytes(b"\xef\xbb\xbf" + text)
    assert [e.id for e in local.read_squad(bom)] == ["q"]


def test_squad_v2_reader_and_bad_answers(tmp_path):
    context = "Paris is the capital of France. Paris is large."
    qas = [
        {"id": "ok", "question": "Capital?", "answers": [{"text": "Paris", "answer_start": 0}]},
        # Offset off by 2: relocated to the nearest "Paris" (32, not 0).
        {"id": "shifted", "question": "Large?", "answers": [{"text": "Paris", "answer_start": 30}]},
        # One answer not in the context (dropped), one good one (kept).
        {
            "id": "mixed",
            "question": "Country?",
            "answers": [
                {"text": "Germany", "answer_start": 24},
                {"text": "France", "answer_start": 24},
            ],
        },
        {"id": "none", "question": "?", "answers": [{"text": "Berlin", "answer_start": 0}]},
        {"id": "imp", "question": "Mayor?", "answers": [], "is_impossible": True},
        {"id": "ok", "question": "Again?", "answers": [{"text": "Paris", "answer_start": 0}]},
        {"id": "noq", "answers": [{"text": "Paris", "answer_start": 0}]},
        {"id": "bad", "question": "?", "answers": [{"text": "Paris"}]},
    ]
    dataset = {
        "version": "v2.0",
        "data": [{"title": "Paris", "paragraphs": [{"context": context, "qas": qas}]}],
    }
    path = tmp_path / "dev-v2.0.json"
    path.write_text(json.dumps(dataset))
    stats = local.ReadStats()
    examples = {e.id: e for e in local.read_squad(path, stats=stats)}
    assert sorted(examples) == ["imp", "mixed", "ok", "shifted"]
    assert examples["shifted"].answers == (local.SpanAnswer("Paris", 32),)
    assert examples["mixed"].answers == (local.SpanAnswer("France", 24),)
    assert examples["imp"].is_impossible and examples["imp"].answers == ()
    assert examples["ok"].title == "Paris" and examples["ok"].question == "Capital?"
    assert stats.read == 8 and stats.kept == 4
    assert stats.skipped == {
        "no_valid_answer": 2,
        "duplicate_id": 1,
        "missing_field:question": 1,
    }
    assert stats.adjusted == {
        "answer_start_relocated": 1,
        "answer_dropped:not_in_context": 2,
        "answer_dropped:bad_field": 1,
    }
    with pytest.raises(ValueError, match="top-level 'data'"):
        (tmp_path / "x.json").write_text("[]")
        local.read_squad(tmp_path / "x.json")


def test_registry_and_paths(shared_data, tmp_path):
    for name, task in local.TASKS.items():
        assert task.kind in ("classification", "regression", "multiple_choice", "span"), name
        if task.kind == "span":
            assert task.metrics == ("exact_match", "f1")
        else:
            assert set(task.metrics) <= set(METRIC_FNS), name
    reader, kind, num_labels, metric_names = local.TASKS["nli_vitaminc"]
    assert (kind, num_labels, metric_names) == ("classification", 3, ("accuracy",))
    assert local.TASKS["sentiment_rt_score"].kind == "regression"

    both = ",".join(
        _tasks_dir(shared_data, "sentiment_rt", f"{s}.jsonl.gz") for s in ("train", "dev")
    )
    assert len(local.read_task("sentiment_rt", both)) == 8431 + 1109
    with pytest.raises(ValueError, match="unknown local task"):
        local.read_task("sst2", both)
    with pytest.raises(ValueError, match="names no readable file"):
        local.read_task("sentiment_rt", str(tmp_path / "missing-*.jsonl"))
    with pytest.raises(ValueError, match="num_choices"):
        local.read_mc_cosmosqa(tmp_path / "any", num_choices=1)


def test_task_files_on_gs(gcs, shared_data, tmp_path, monkeypatch):
    """Task files, globs and SQuAD JSON on gs:// read like local ones; a missing gs:// file is
    a ValueError naming it; nothing lands in the working directory."""
    monkeypatch.chdir(tmp_path)
    prefix = f"tasks-{tmp_path.name}"
    dev = _tasks_dir(shared_data, "sentiment_rt", "dev.jsonl.gz")
    squad = _tasks_dir(shared_data, "squad_shifts", "reddit_v1.0.json.gz")
    for path in (dev, squad):
        files.copy(path, gcs.url(f"{prefix}/{os.path.basename(path)}"))
    stats = local.ReadStats()
    remote = local.read_task("sentiment_rt", gcs.url(f"{prefix}/dev.*"), stats=stats)
    assert remote == local.read_task("sentiment_rt", dev) and stats.kept == 1109
    remote_squad = local.read_squad(gcs.url(f"{prefix}/reddit_v1.0.json.gz"))
    assert remote_squad == local.read_squad(squad)
    missing = gcs.url(f"{prefix}/train.jsonl.gz")
    with pytest.raises(ValueError, match=missing):
        local.read_task("sentiment_rt", f"{gcs.url(f'{prefix}/dev.jsonl.gz')},{missing}")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- bounded reading (#58 10, 11)
def _gzip_bomb(path, before: bytes, unit: bytes, repeats: int, after: bytes) -> None:
    """A real gzip file of before + unit * repeats + after, written in members (a gzip file
    may hold several; every reader takes them as one stream): the repeated unit is compressed
    once, so gigabytes of content take a megabyte and milliseconds to write."""
    member = gzip.compress(unit, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(before))
        f.write(member * repeats)
        f.write(gzip.compress(after))


# Reads a task file in a fresh process: its peak memory is the reader's alone, and a reader
# that would take minutes is stopped by the timeout.
_READ_IN_A_PROCESS = """
import json, resource, sys, time
from albert_jax.tasks import local
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
stats = local.ReadStats()
examples = local.read_task("sentiment_rt", sys.argv[1], stats=stats)
print(json.dumps({
    "seconds": time.perf_counter() - start,
    "grew_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
    "kept": [e.text_a for e in examples],
    "skipped": stats.skipped,
    "first_skipped": stats.first_skipped,
}))
"""


def _read_in_a_process(path, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _READ_IN_A_PROCESS, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_gigabyte_line_is_skipped_in_bounded_memory(tmp_path):
    # Case 11: ~1 MB of gzip that expands to one 1 GiB line (it was held whole, and decoded:
    # 2.2 GB at the peak, before it was skipped as invalid JSON).
    path = tmp_path / "big.jsonl.gz"
    good = b'{"sentence": "good", "label": 1}\n'
    _gzip_bomb(path, good, b"a" * (1 << 20), 1024, b"\n" + good.replace(b"good", b"fine"))
    assert path.stat().st_size < 2 << 20
    got = _read_in_a_process(path, timeout=120)
    # At most the 64 MiB cap of the line would be held (in pieces, then dropped), never the
    # line; at ~1000x its stored size the file is now abandoned before (max_expansion=200x,
    # #66 case 10). The record after the line is not read.
    assert got["grew_mib"] < 256, got
    assert got["kept"] == ["good"]
    assert got["skipped"] == {line_reading.EXPANSION_TOO_LARGE: 1}
    assert got["first_skipped"] == {line_reading.EXPANSION_TOO_LARGE: "big.jsonl.gz:2"}


def test_a_gzip_of_junk_lines_is_abandoned_after_a_run_of_them(tmp_path):
    """#66 case 10: 16 kB of gzip holding 8 Mi lines of "x" took 20 s to reject (~21 min a
    MB): every line was parsed and skipped. max_bad_lines (10k) unparsable lines in a row end
    the file's read; a record after a shorter run is still read."""
    path = tmp_path / "junk.jsonl.gz"
    good = b'{"sentence": "good", "label": 1}\n'
    _gzip_bomb(path, good + b"x\n" * 50 + good, b"x\n" * (1 << 20), 8, good)
    assert path.stat().st_size < 64 << 10
    got = _read_in_a_process(path, timeout=60)
    assert got["seconds"] < 2, got
    assert got["kept"] == ["good", "good"]
    # Lines 1 and 52 are records; the run starts at 53: line 10,053 is its first past the cap.
    assert got["first_skipped"][line_reading.BAD_RUN_TOO_LONG] == "junk.jsonl.gz:10053"
    assert got["skipped"]["invalid_json"] == 50 + 10_001


def test_a_file_that_expands_too_far_ends_its_read(tmp_path):
    """Valid records, but 1000x their stored size (generated filler or a bomb): the read
    stops at max_expansion, said and counted, instead of parsing every copy."""
    path = tmp_path / "filler.jsonl.gz"
    record = b'{"sentence": "again", "label": 1}\n'
    _gzip_bomb(path, record, record * (1 << 17), 64, b'{"sentence": "last", "label": 0}\n')
    got = _read_in_a_process(path, timeout=60)
    assert got["skipped"] == {line_reading.EXPANSION_TOO_LARGE: 1}
    assert "last" not in got["kept"] and 0 < len(got["kept"]) < 64 << 17


def test_a_long_run_of_blank_lines_ends_the_read_in_seconds(tmp_path):
    # Case 10: ~0.5 MB of gzip holding 512 Mi blank lines took ~7 min of CPU, silently.
    path = tmp_path / "blank.jsonl.gz"
    good = b'{"sentence": "good", "label": 1}\n'
    _gzip_bomb(path, good, b"\n" * (1 << 20), 512, b'{"sentence": "never read", "label": 0}\n')
    assert path.stat().st_size < 1 << 20
    got = _read_in_a_process(path, timeout=60)
    assert got["seconds"] < 5, got
    assert got["kept"] == ["good"]  # the read stopped in the run: the record after it is lost
    assert got["skipped"] == {line_reading.BLANK_RUN_TOO_LONG: 1}
    # Line 1 is the record, the run starts at line 2: line 100,002 is its first past the cap.
    assert got["first_skipped"] == {line_reading.BLANK_RUN_TOO_LONG: "blank.jsonl.gz:100002"}


def test_line_limits_come_from_the_config(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        '{"sentence": "short", "label": 1}\n'
        + json.dumps({"sentence": "long " * 20, "label": 0})
        + "\n\n\n\n"
        + '{"sentence": "after the blank run", "label": 1}\n'
    )
    data = {"train_files": str(path), "max_line_bytes": 60, "max_blank_lines": 2}
    train = registry.read_train("sentiment_rt", data)
    assert [e.text_a for e in train.examples] == ["short"]
    assert train.stats.skipped == {
        line_reading.LINE_TOO_LONG: 1,
        line_reading.BLANK_RUN_TOO_LONG: 1,
    }
    assert train.stats.first_skipped == {
        line_reading.LINE_TOO_LONG: "train.jsonl:2",
        line_reading.BLANK_RUN_TOO_LONG: "train.jsonl:5",
    }
    # A SQuAD JSON file is one value: larger than the cap, it is refused, naming file and field.
    squad = tmp_path / "dev.json"
    squad.write_text(json.dumps({"data": [{"title": "t", "paragraphs": []}]}))
    with pytest.raises(ValueError, match=r"dev\.json: more than 20 bytes .*max_line_bytes"):
        local.read_squad(squad, limits=line_reading.LineLimits(max_line_bytes=20))
    assert local.read_squad(squad) == []
    # Bad bounds fail the config check, naming the field.
    config = finetune_config.get_config("task=sentiment_rt")
    config.data.max_blank_lines = 0
    with pytest.raises(ValueError, match=r"config\.data\.max_blank_lines must be an integer"):
        validate_config(config)
