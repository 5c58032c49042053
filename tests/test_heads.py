"""Fine-tuning heads (shapes, masks, the SQuAD v2 beam), task featurization (truncation,
SQuAD offsets that round-trip the original text), n-best decoding and the TFDS record mappers."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_finetune import tiny_tokenizer_path

from albert_jax.data.tokenizer import Tokenizer
from albert_jax.model.albert import AlbertForPreTraining, AlbertModel, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.model.heads import (
    AlbertForMultipleChoice,
    AlbertForQuestionAnswering,
    AlbertForQuestionAnsweringV2,
    AlbertForSequenceClassification,
)
from albert_jax.model.losses import squad_v2_loss
from albert_jax.tasks import glue, local, race, squad
from albert_jax.tasks.batching import eval_batches, train_batch
from albert_jax.tasks.classification import classification_features, truncate_pair
from albert_jax.tasks.multiple_choice import multiple_choice_features, question_with_option
from albert_jax.tasks.squad_features import align_pieces, doc_windows, squad_features
from albert_jax.tasks.squad_predictions import predict_v1, predict_v2

CFG = ModelConfig(
    vocab_size=120,
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory, shared_data) -> Tokenizer:
    return Tokenizer(tiny_tokenizer_path(tmp_path_factory, shared_data))


def _inputs(batch=2, seq=16, real=12, seed=0):
    ids = jax.random.randint(jax.random.key(seed), (batch, seq), 5, CFG.vocab_size)
    mask = (jnp.arange(seq)[None] < real).astype(jnp.int32).repeat(batch, 0)
    return ids * mask, jnp.zeros_like(ids), mask


def _unboxed(variables):
    return nn.meta.unbox(variables)


# ------------------------------------------------------------------------------------ heads
def test_classification_head_shapes_tree_and_dropout():
    ids, seg, mask = _inputs()
    model = AlbertForSequenceClassification(CFG, num_labels=3)
    variables = _unboxed(jax.jit(model.init)(jax.random.key(0), ids, seg, mask))
    params = variables["params"]
    assert set(params) == {"albert", "classifier"}
    assert params["classifier"]["kernel"].shape == (32, 3)
    # The backbone tree is exactly the pretraining model's `albert` tree: pretrained weights
    # drop in by path.
    pretraining = jax.eval_shape(
        lambda k: _unboxed(init_params(AlbertForPreTraining(CFG), k)), jax.random.key(1)
    )["params"]
    shapes = lambda t: jax.tree.map(lambda x: x.shape, t)
    assert shapes(params["albert"]) == shapes(pretraining["albert"])
    apply = jax.jit(model.apply, static_argnames="deterministic")
    logits = apply(variables, ids, seg, mask)
    assert logits.shape == (2, 3) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits, apply(variables, ids, seg, mask))
    dropped = apply(
        variables, ids, seg, mask, deterministic=False, rngs={"dropout": jax.random.key(3)}
    )
    assert float(jnp.abs(dropped - logits).max()) > 0  # classifier dropout is active


# One case per distinct branch of the split-off [CLS] application (each case is a few
# compiles): the default scanned, all-shared path and the plain unrolled one are covered by
# the scanned and unrolled cases below, which add groups, unshared blocks and remat.
@pytest.mark.parametrize(
    "overrides",
    [
        # the split-off [CLS] application is the only one (scan of length 0 skipped)
        dict(num_hidden_layers=1),
        # scan, two groups, unshared sub-blocks (layer-indexed weights), remat
        dict(num_hidden_groups=2, sharing="none", remat_policy="dots"),
        # unrolled (scan_layers=False), two inner blocks, attention shared and FFN stacked
        dict(inner_group_num=2, sharing="ffn", scan_layers=False),
    ],
)
def test_classification_runs_its_last_layer_at_cls_only(overrides):
    """The classification head reads only [CLS], so its backbone runs the last layer there
    only (`pooled_only`): the logits and gradients of the full last layer."""
    cfg = CFG.replace(**overrides)
    ids, seg, mask = _inputs(batch=3, real=9)
    model = AlbertForSequenceClassification(cfg, num_labels=3)
    params = _unboxed(model.init(jax.random.key(0), ids, seg, mask))["params"]

    def full_logits(p):  # every layer at every position, then [CLS]
        out = AlbertModel(cfg).apply({"params": p["albert"]}, ids, seg, mask)
        assert "sequence_output" in out
        return out["pooled_output"] @ p["classifier"]["kernel"] + p["classifier"]["bias"]

    head_logits = lambda p: model.apply({"params": p}, ids, seg, mask)  # noqa: E731
    # Compiled, not eager: op-by-op dispatch of these programs costs more than compiling them.
    np.testing.assert_allclose(
        jax.jit(head_logits)(params), jax.jit(full_logits)(params), atol=1e-5
    )
    loss = lambda f: lambda p: jnp.sum(f(p) ** 2)  # noqa: E731
    grad = lambda f: jax.jit(jax.grad(loss(f)))  # noqa: E731
    full, cls_only = grad(full_logits)(params), grad(head_logits)(params)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(full), jax.tree.leaves(cls_only), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(path))
    pooled = jax.eval_shape(  # the returned keys only: no need to run it again
        lambda p: AlbertModel(cfg).apply({"params": p}, ids, seg, mask, pooled_only=True),
        params["albert"],
    )
    assert set(pooled) == {"pooled_output"}


def test_span_head_masks_padding():
    ids, seg, mask = _inputs(real=10)
    model = AlbertForQuestionAnswering(CFG)
    variables = jax.jit(model.init)(jax.random.key(0), ids, seg, mask)
    assert set(variables["params"]) == {"albert", "qa_outputs"}
    out = jax.jit(model.apply)(variables, ids, seg, mask)
    for name in ("start_logits", "end_logits"):
        assert out[name].shape == (2, 16)
        assert bool((out[name][:, 10:] <= -1e29).all())
        assert bool((out[name][:, :10] > -1e29).all())
    probs = jax.nn.softmax(out["start_logits"], axis=-1)
    assert float(probs[:, 10:].sum()) == 0.0


def test_squad_v2_head_training_and_beam():
    ids, seg, mask = _inputs(batch=3, seq=20, real=18)
    p_mask = jnp.zeros((3, 20), jnp.int32).at[:, 1:5].set(1).at[:, 18:].set(1)
    model = AlbertForQuestionAnsweringV2(CFG, start_n_top=4, end_n_top=3)
    variables = jax.jit(model.init)(jax.random.key(0), ids, seg, mask, p_mask)
    apply = jax.jit(model.apply)
    head = variables["params"]["squad_v2"]
    assert set(head) == {"start_logits", "end_logits", "answer_class"}
    assert set(head["end_logits"]) == {"dense_0", "LayerNorm", "dense_1"}
    assert "bias" not in head["answer_class"]["dense_1"]  # official: no bias on the last dense
    assert head["end_logits"]["dense_0"]["kernel"].value.shape == (64, 32)

    starts = jnp.array([0, 6, 10])
    train = apply(variables, ids, seg, mask, p_mask, start_positions=starts)
    assert train["start_log_probs"].shape == (3, 20) and train["cls_logits"].shape == (3,)
    # p_mask positions get no probability; [CLS] (p_mask 0) does.
    np.testing.assert_allclose(jnp.exp(train["start_log_probs"]).sum(-1), 1.0, rtol=1e-5)
    assert float(jnp.exp(train["end_log_probs"][:, 1:5]).max()) == 0.0
    # The end distribution depends on the (teacher-forced) start.
    other = apply(variables, ids, seg, mask, p_mask, start_positions=starts + 1)
    assert float(jnp.abs(other["end_log_probs"] - train["end_log_probs"]).max()) > 1e-6
    loss = squad_v2_loss(train, starts, starts + 1, jnp.array([1, 0, 0]))
    assert loss.shape == () and bool(jnp.isfinite(loss))

    beam = apply(variables, ids, seg, mask, p_mask)
    assert beam["start_top_index"].shape == (3, 4)
    assert beam["start_top_log_probs"].shape == (3, 4)
    assert beam["end_top_index"].shape == (3, 12) and beam["end_top_log_probs"].shape == (3, 12)
    assert not bool(jnp.isin(beam["start_top_index"], jnp.arange(1, 5)).any())
    # Starts come sorted; entry i*Ke+j is the j-th end of the i-th start (ends sorted per start).
    assert bool((jnp.diff(beam["start_top_log_probs"], axis=-1) <= 0).all())
    ends = beam["end_top_log_probs"].reshape(3, 4, 3)
    assert bool((jnp.diff(ends, axis=-1) <= 0).all())
    # The beam's end scores for start i equal teacher forcing with that start.
    forced = apply(variables, ids, seg, mask, p_mask, start_positions=beam["start_top_index"][:, 1])
    expected = jnp.take_along_axis(
        forced["end_log_probs"], beam["end_top_index"].reshape(3, 4, 3)[:, 1], axis=-1
    )
    np.testing.assert_allclose(ends[:, 1], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(beam["cls_logits"], train["cls_logits"], rtol=1e-5)


def test_multiple_choice_masks_padding_options():
    ids, seg, mask = _inputs(batch=8, seq=16)
    shape = (2, 4, 16)
    option_mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    model = AlbertForMultipleChoice(CFG)
    variables = jax.jit(model.init)(
        jax.random.key(0), ids.reshape(shape), seg.reshape(shape), mask.reshape(shape)
    )
    assert variables["params"]["classifier"]["kernel"].value.shape == (32, 1)
    apply = jax.jit(model.apply)
    logits = apply(
        variables,
        ids.reshape(shape),
        seg.reshape(shape),
        mask.reshape(shape),
        option_mask,
    )
    assert logits.shape == (2, 4)
    probs = jax.nn.softmax(logits, -1)
    assert float(probs[0, 3]) == 0.0 and float(probs[1, 3]) > 0.0
    # Each option is scored on its own: permuting options permutes the logits.
    perm = jnp.array([2, 0, 1, 3])
    permuted = apply(
        variables,
        ids.reshape(shape)[:, perm],
        seg.reshape(shape)[:, perm],
        mask.reshape(shape)[:, perm],
        option_mask[:, perm],
    )
    np.testing.assert_allclose(permuted, logits[:, perm], rtol=1e-5)
    with pytest.raises(ValueError, match="input_ids must be"):
        jax.eval_shape(model.apply, variables, ids, seg, mask)


# ---------------------------------------------------------------------------- featurization
def test_truncate_pair_is_the_official_loop():
    def reference(a, b, n):
        a, b = list(a), list(b)
        while len(a) + len(b) > n:
            (a if len(a) > len(b) else b).pop()
        return a, b

    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = list(range(rng.integers(0, 30))), list(range(rng.integers(0, 30)))
        n = int(rng.integers(0, 40))
        assert truncate_pair(a, b, n) == reference(a, b, n)


def test_classification_features_layout_and_counts(tiny_tokenizer):
    examples = [
        local.ClassificationExample("a", "a short one", None, 1),
        local.ClassificationExample("b", "premise " * 40, "the hypothesis", 0),
        local.ClassificationExample("c", "premise", "hypothesis " * 40, 2),
    ]
    features = classification_features(examples, tiny_tokenizer, 24)
    a = features.arrays
    assert a["input_ids"].shape == (3, 24) and a["label"].tolist() == [1, 0, 2]
    cls, sep = tiny_tokenizer.cls_id, tiny_tokenizer.sep_id
    n = int(a["input_mask"][0].sum())
    assert a["input_ids"][0, 0] == cls and a["input_ids"][0, n - 1] == sep
    assert (a["input_ids"][0, n:] == 0).all() and (a["segment_ids"][0] == 0).all()
    # Pairs: [CLS] a [SEP] b [SEP], segment 1 on the b side, the longer side cut.
    for row in (1, 2):
        assert a["input_mask"][row].sum() == 24
        seps = np.flatnonzero(a["input_ids"][row] == sep)
        assert len(seps) == 2 and seps[1] == 23
        assert (a["segment_ids"][row, : seps[0] + 1] == 0).all()
        assert (a["segment_ids"][row, seps[0] + 1 :] == 1).all()
    hyp = tiny_tokenizer.encode("the hypothesis")
    assert a["input_ids"][1, 24 - len(hyp) - 1 : 23].tolist() == hyp  # short side kept whole
    stats = features.stats
    assert stats.truncated_examples == 2 and stats.truncated == {"text_a": 1, "text_b": 1}
    regression = classification_features(
        [local.ClassificationExample("r", "x", None, 0.25)], tiny_tokenizer, 8, regression=True
    )
    assert regression.arrays["label"].dtype == np.float32


def test_multiple_choice_features(tiny_tokenizer):
    assert question_with_option("He went to _ .", "Paris") == "He went to Paris ."
    assert question_with_option("Where did he go?", "Paris") == "Where did he go? Paris"
    example = local.MultipleChoiceExample(
        "q",
        "a long passage " * 30,
        "what happened " * 10,
        ("first option", "second", ""),
        (1, 1, 0),
        1,
    )
    features = multiple_choice_features([example], tiny_tokenizer, 40, max_qa_length=12)
    a = features.arrays
    assert a["input_ids"].shape == (1, 3, 40) and a["option_mask"].tolist() == [[1, 1, 0]]
    for c in range(3):
        row = a["input_ids"][0, c]
        seps = np.flatnonzero(row == tiny_tokenizer.sep_id)
        assert row[0] == tiny_tokenizer.cls_id and len(seps) == 2 and seps[1] == 39
        qa = row[seps[0] + 1 : seps[1]].tolist()
        assert len(qa) == 12  # question+option cut to max_qa_length, keeping its end
        if c < 2:
            text = question_with_option(example.question, example.options[c])
            assert qa == tiny_tokenizer.encode(text)[-12:]
    assert features.stats.truncated == {"question_option": 1, "context": 1}


def test_align_pieces_round_trips_words(tiny_tokenizer):
    for word in ["Café", "naïve", "(Hello),", "$1,000,", "Ångström", "e\u0301t\u00e9", "ﬁnal"]:
        pieces = tiny_tokenizer.encode_pieces(word)
        spans = align_pieces(word, pieces, tiny_tokenizer)
        assert len(spans) == len(pieces)
        assert spans[0][0] == 0 and spans[-1][1] == len(word)
        # Non-empty pieces tile the word in order.
        covered = "".join(word[s:e] for s, e in spans)
        assert covered == word, (word, pieces, spans)


def test_squad_offsets_round_trip_the_original_text(tiny_tokenizer, shared_data):
    path = os.path.join(shared_data, "tasks", "squad_shifts", "new_wiki_v1.0.json.gz")
    examples = local.read_squad(path)[:150]
    features = squad_features(examples, tiny_tokenizer, 96, doc_stride=32, max_query_length=24)
    a = features.arrays
    assert a["input_ids"].shape[1] == 96 and len(features) > len(examples)
    assert features.stats.split_into_windows > 0
    exact = answered = 0
    for row in range(len(features)):
        example = features.examples[features.example_index[row]]
        spans = features.token_spans[row]
        context_tokens = np.flatnonzero(spans[:, 0] >= 0)
        # Context tokens are exactly p_mask 0 outside [CLS], and sit in segment 1.
        assert (a["p_mask"][row, context_tokens] == 0).all()
        assert (a["segment_ids"][row, context_tokens] == 1).all()
        # Consecutive context pieces cover the text between them up to whitespace.
        first, last = spans[context_tokens[0], 0], spans[context_tokens[-1], 1]
        pieces = "".join(example.context[s:e] for s, e in spans[context_tokens])
        assert pieces == "".join(example.context[first:last].split())
        if a["is_impossible"][row]:
            assert a["start_positions"][row] == a["end_positions"][row] == 0
            continue
        answered += 1
        s, e = a["start_positions"][row], a["end_positions"][row]
        text = example.context[spans[s, 0] : spans[e, 1]]
        gold = example.answers[0].text
        assert gold in text  # the labelled span covers the answer...
        exact += text == gold  # ...and is the answer itself unless it starts mid-piece
    assert answered > 50 and exact / answered > 0.95


def test_doc_windows_cover_everything():
    assert doc_windows(10, 4, 2) == [(0, 4), (2, 4), (4, 4), (6, 4)]
    assert doc_windows(3, 8, 2) == [(0, 3)]
    for n, m, stride in [(100, 17, 5), (33, 33, 10), (1, 5, 1)]:
        covered = set()
        for start, length in doc_windows(n, m, stride):
            assert length <= m
            covered.update(range(start, start + length))
        assert covered == set(range(n))
    with pytest.raises(ValueError, match="doc_stride"):
        doc_windows(10, 4, 0)


def test_predictions_return_exact_original_text(tiny_tokenizer):
    context = "The Eiffel Tower (Tour Eiffel) is in Paris, France; it opened in 1889."
    examples = [
        local.SpanExample(
            "q1", "t", "Where is it?", context, (local.SpanAnswer("Paris, France", 37),), False
        ),
        local.SpanExample("q2", "t", "Who built it?", context, (), True),
    ]
    features = squad_features(examples, tiny_tokenizer, 48, doc_stride=16, max_query_length=16)
    a = features.arrays
    row = int(np.flatnonzero((features.example_index == 0) & (a["is_impossible"] == 0))[0])
    s, e = a["start_positions"][row], a["end_positions"][row]
    f, seq = len(features), a["input_ids"].shape[1]
    start_logits = np.full((f, seq), -5.0, np.float32)
    end_logits = np.full((f, seq), -5.0, np.float32)
    start_logits[row, s], end_logits[row, e] = 5.0, 5.0
    v1 = predict_v1(features, start_logits, end_logits, n_best_size=5, max_answer_length=30)
    assert v1.answers["q1"] == "Paris, France"  # original case and punctuation
    assert v1.nbest["q1"][0].text == "Paris, France"
    probs = [c["probability"] for c in v1.nbest_json()["q1"]]
    assert abs(sum(probs) - 1.0) < 1e-6 and probs == sorted(probs, reverse=True)
    # max_answer_length filters long spans.
    short = predict_v1(features, start_logits, end_logits, 5, max_answer_length=1)
    assert short.answers["q1"] != "Paris, France"

    # v2: beam outputs pointing at the same span; q2's windows all say "no answer".
    k, ke = 2, 2
    beam = {
        "start_top_log_probs": np.full((f, k), -3.0, np.float32),
        "start_top_index": np.zeros((f, k), np.int32),
        "end_top_log_probs": np.full((f, k * ke), -3.0, np.float32),
        "end_top_index": np.zeros((f, k * ke), np.int32),
        "cls_logits": np.where(features.example_index == 1, 4.0, -4.0).astype(np.float32),
    }
    beam["start_top_index"][row, 0], beam["start_top_log_probs"][row, 0] = s, -0.1
    beam["end_top_index"][row, 0], beam["end_top_log_probs"][row, 0] = e, -0.1
    v2 = predict_v2(features, beam, n_best_size=5, max_answer_length=30, null_threshold=0.5)
    assert v2.answers == {"q1": "Paris, France", "q2": ""}
    assert v2.na_probs["q2"] > 0.98 and v2.na_probs["q1"] < 0.02
    assert v2.best_non_null["q1"] == "Paris, France"


# ---------------------------------------------------------------------------------- batching
def test_train_batches_are_a_function_of_the_step():
    arrays = {"x": np.arange(10), "y": np.arange(10) * 10}
    b = train_batch(arrays, 3, 4, seed=1)
    np.testing.assert_array_equal(b["y"], b["x"] * 10)  # rows stay aligned
    np.testing.assert_array_equal(train_batch(arrays, 3, 4, seed=1)["x"], b["x"])
    epoch = np.concatenate([train_batch(arrays, s, 4, seed=1)["x"] for s in (0, 1)])
    assert len(set(epoch.tolist())) == 8  # within an epoch no row repeats (remainder dropped)
    with pytest.raises(ValueError, match="batch_size"):
        train_batch(arrays, 0, 11, seed=0)
    batches = list(eval_batches(arrays, 4))
    assert [b["example_weight"].sum() for b in batches] == [4, 4, 2]
    assert all(len(b["x"]) == 4 for b in batches)
    real = np.concatenate([b["x"][b["example_weight"] > 0] for b in batches])
    np.testing.assert_array_equal(real, np.arange(10))


# --------------------------------------------------------------------- TFDS catalog records
def test_glue_records_map_to_examples():
    record = {"sentence1": b"A man eats.", "sentence2": b"Someone eats.", "label": 0, "idx": 7}
    example = glue.glue_example("rte", record, "validation")
    assert example == local.ClassificationExample("validation-7", "A man eats.", "Someone eats.", 0)
    sst = glue.glue_example("sst2", {"sentence": b"great", "label": np.int64(1), "idx": 3})
    assert sst.text_b is None and sst.label == 1
    stsb = glue.glue_example(
        "stsb", {"sentence1": b"a", "sentence2": b"b", "label": np.float32(3.8), "idx": 0}
    )
    assert isinstance(stsb.label, float) and abs(stsb.label - 3.8) < 1e-6
    mnli = glue.glue_example("mnli", {"premise": b"p", "hypothesis": b"h", "label": 2, "idx": 1})
    assert mnli.label == 2
    with pytest.raises(glue.BadRecordError, match="no class") as bad:
        glue.glue_example("sst2", {"sentence": b"test split", "label": -1, "idx": 0})
    assert bad.value.reason == "unlabelled"
    with pytest.raises(ValueError, match="'sentence2'"):
        glue.glue_example("mrpc", {"sentence1": b"x", "label": 1, "idx": 0})


def test_squad_records_map_to_examples():
    context = "Normans came from Normandy in France."
    v1 = {
        "id": b"q1",
        "title": b"Normans",
        "context": context.encode(),
        "question": b"Where from?",
        "answers": {
            "text": np.array([b"Normandy", b"France", b"Normandy"], dtype=object),
            "answer_start": np.array([18, 30, 0], np.int32),  # the last one is misplaced
        },
    }
    stats = local.ReadStats()
    example = squad.squad_example(v1, stats)
    assert [a.answer_start for a in example.answers] == [18, 30, 18]
    assert stats.adjusted["answer_start_relocated"] == 1 and not example.is_impossible
    no_answers = {"text": np.array([], dtype=object), "answer_start": np.array([], np.int32)}
    v2 = {**v1, "id": b"q2", "is_impossible": np.bool_(True), "answers": no_answers}
    impossible = squad.squad_example(v2)
    assert impossible.is_impossible and impossible.answers == ()
    bad = {**v1, "answers": {"text": np.array([b"Spain"], dtype=object),
                             "answer_start": np.array([0], np.int32)}}  # fmt: skip
    with pytest.raises(glue.BadRecordError, match="no valid answer"):
        squad.squad_example(bad)
    dataset = squad.squad_json([example, impossible], "v2.0")
    assert dataset["version"] == "2.0"
    qas = [p["qas"][0] for a in dataset["data"] for p in a["paragraphs"]]
    assert [q["id"] for q in qas] == ["q1", "q2"] and qas[1]["is_impossible"]


def test_race_records_map_to_examples():
    record = {
        "article": b"Tom has a dog. The dog is brown.",
        "questions": np.array([b"What color is the dog?", b"Tom has a _ ."], dtype=object),
        "answers": np.array([b"B", b"A"], dtype=object),
        "options": np.array(
            [[b"black", b"brown", b"white", b"red"], [b"dog", b"cat", b"fish", b"bird"]],
            dtype=object,
        ),
        "example_id": b"high123.txt",
    }
    examples = race.race_examples(record)
    assert [e.label for e in examples] == [1, 0]
    assert examples[0].options == ("black", "brown", "white", "red")
    assert examples[1].id == "high123.txt-1" and examples[1].option_mask == (1, 1, 1, 1)
    stats = local.ReadStats()
    broken = {**record, "answers": np.array([b"E", b"A"], dtype=object)}
    assert len(race.race_examples(broken, stats)) == 1
    assert stats.skipped == {"bad_answer": 1}
