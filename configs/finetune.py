"""ALBERT fine-tuning config: `--config=configs/finetune.py:task=NAME,init=PATH`.

Arg keys:
  task   a GLUE task (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte), squad_v1, squad_v2, race,
         or a local task (sentiment_rt, sentiment_rt_score, nli_vitaminc, mc_cosmosqa,
         squad_shifts)
  init   checkpoint to start from: an albert_jax workdir / step dir / model dir, an HF dir or an
         official TF1 dir (anything `albert_jax.load_pretrained` reads); empty = from scratch
         (a baseline: `size` preset + `data.tokenizer`)

GLUE, SQuAD and RACE presets are the paper's (Table 14 = the official run_glue.sh; SQuAD and
RACE from the official ALBERT README): learning rate, batch, steps,
warmup, max length and ALBERT dropout; classifier dropout 0.1 everywhere; AdamW (eps 1e-6,
weight decay 0.01, no decay on LayerNorm / bias), linear warmup then linear decay, clip 1.0.
Local-task presets are sized for a small model on a CPU.

Local tasks read `--config.data.train_files=... --config.data.eval_files=...` (a path, glob or
comma-separated list); catalog tasks read TFDS (`--config.data.data_dir`). squad_v1 / squad_v2
read SQuAD JSON files instead when data.train_files / data.eval_files are set.
"""

from __future__ import annotations

import ml_collections

from albert_jax.data import line_reading
from configs.common import add_loop, add_mesh, add_optimizer, parse_arg

# name: (learning_rate, batch_size, num_train_steps, warmup_steps, max_seq_length, dropout);
# dropout is ALBERT's hidden / attention dropout (the classifier's is 0.1 regardless).
GLUE_PRESETS: dict[str, tuple[float, int, int, int, int, float]] = {
    "cola": (1e-5, 16, 5336, 320, 512, 0.0),
    "stsb": (2e-5, 16, 3598, 214, 512, 0.0),
    "sst2": (1e-5, 32, 20935, 1256, 512, 0.0),
    "mnli": (3e-5, 128, 10000, 1000, 512, 0.0),
    "qnli": (1e-5, 32, 33112, 1986, 512, 0.0),
    "qqp": (5e-5, 128, 14000, 1000, 512, 0.1),
    "rte": (3e-5, 32, 800, 200, 512, 0.1),
    "mrpc": (2e-5, 32, 800, 200, 512, 0.0),
}
# Local labelled sets, sized for a tiny model on CPU: a few epochs at most.
LOCAL_PRESETS: dict[str, tuple[float, int, int, int, int, float]] = {
    "sentiment_rt": (3e-4, 32, 800, 80, 64, 0.0),  # ~3 epochs
    "sentiment_rt_score": (3e-4, 32, 800, 80, 64, 0.0),
    "nli_vitaminc": (3e-4, 32, 2000, 200, 128, 0.0),  # ~1.5 epochs
    "mc_cosmosqa": (3e-4, 16, 650, 65, 128, 0.0),  # ~2 epochs
    "squad_shifts": (3e-4, 16, 600, 60, 192, 0.0),
}
TASKS = (*GLUE_PRESETS, "squad_v1", "squad_v2", "race", *LOCAL_PRESETS)


# The arg keys and their defaults (`--config=FILE:key=value,...`; a sweep tells them from fields).
ARG_DEFAULTS = dict(task="", init="")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arg = parse_arg(arg, **ARG_DEFAULTS)
    if arg.task not in TASKS:
        raise ValueError(f"config arg task={arg.task!r} is not one of {TASKS}")
    task = arg.task
    c = ml_collections.ConfigDict()
    c.task = task  # what to fine-tune on: one of TASKS (albert_jax.tasks.registry reads it)
    c.init = arg.init  # checkpoint (albert_jax / HF / TF1); "" = random init (baseline)
    # An init of several seeds (a run with num_seeds > 1): the seed of the run to start from.
    c.init_run_seed = ml_collections.FieldReference(None, field_type=int)
    # Comma-separated regexes of weight paths initialized fresh though init has them (e.g.
    # "classifier/.*": a new head on a run fine-tuned with one of the same shape).
    c.init_dont_load = ""
    c.size = "base"  # ModelConfig preset, used only when init is empty

    # --- model: ModelConfig fields applied on top of the checkpoint's (dropout, dtypes, ...)
    c.model = ml_collections.ConfigDict()
    c.model.hidden_dropout_prob = 0.0  # ALBERT dropout (paper: 0 for v2 models; 0.1 QQP/RTE)
    c.model.attention_probs_dropout_prob = 0.0  # dropout on attention probabilities
    c.model.dtype = "float32"  # compute dtype; bfloat16 for speed (TPU, GPU, CPUs with AMX)
    # Layers unrolled: base steps 5-11% faster than under nn.scan on a 2-core AMD EPYC, for a
    # compile 1.2-1.3x as long (one packed 8x128 shape: 8-11 s against 7-8 s); set True for
    # very deep models.
    c.model.scan_layers = False  # (scan stacks every layer's residuals for the backward pass)
    c.model.attention_impl = "xla"  # xla (einsums) | dot_product (JAX picks) | cudnn (GPU)
    # Layer applications; None: the checkpoint's (the size preset's without init). An
    # all-shared checkpoint runs at any depth (ModelConfig.with_depth).
    c.model.num_hidden_layers = ml_collections.FieldReference(None, field_type=int)
    c.classifier_dropout = 0.1  # dropout before the task head (official keep_prob 0.9)

    # --- data
    c.data = ml_collections.ConfigDict()
    c.data.train_files = ""  # local tasks / SQuAD JSON: path, glob or comma-separated list
    # Idem for evaluation: one eval set, its ids unique across the files (predictions.jsonl's
    # "eval_set" names each example's file).
    c.data.eval_files = ""
    c.data.data_dir = ml_collections.FieldReference(None, field_type=str)  # TFDS data dir
    c.data.train_split = "train"  # TFDS split to train on
    c.data.eval_split = "validation"  # TFDS split(s) to evaluate on (comma-separated)
    c.data.race_levels = "middle,high"  # RACE levels read (the paper trains on both)
    c.data.tokenizer = ml_collections.FieldReference(None, field_type=str)  # spm override
    # A data.tokenizer other than the init checkpoint's is refused (its embeddings follow the
    # checkpoint's ids) unless this says the ids are the same.
    c.data.allow_other_tokenizer = False
    # Keep N examples (0 = all): a random N, the same in every run (seed 0, not config.seed), in
    # file order; not the first N, which a file sorted by label would make one class (SQuAD:
    # N questions). tasks/registry.subset.
    c.data.max_train_examples = 0
    c.data.max_eval_examples = 0
    # Bounds of reading the task files (line_reading.LineLimits): a longer line is skipped and
    # counted (`line_too_long`) without being held whole; a larger SQuAD JSON file is refused.
    c.data.max_line_bytes = line_reading.DEFAULT_MAX_LINE_BYTES  # 64 MiB
    # More blank lines in a row end that file's read (counted as `blank_run_too_long`).
    c.data.max_blank_lines = line_reading.DEFAULT_MAX_BLANK_LINES  # 100k
    # Unparsable lines in a row, and bytes per stored byte of a compressed file: past either
    # the rest of that file is not read (`bad_run_too_long` / `expansion_too_large`).
    c.data.max_bad_lines = line_reading.DEFAULT_MAX_BAD_LINES  # 10k
    c.data.max_expansion = line_reading.DEFAULT_MAX_EXPANSION  # 200x

    # --- featurization
    c.max_seq_length = 512  # tokens per sequence (per option for multiple choice)
    c.length_buckets = True  # cut each batch to 32·2^k tokens (<= max_seq_length) it fits in
    # Training batches of one-sequence tasks (classification, regression): several examples per
    # row, no padding between them (tasks/packing.py); the others use length buckets. None
    # (auto): packed when the rows would hold <= 3/4 of the unpacked tokens (packing.
    # AUTO_MAX_PACKED_SHARE), i.e. when examples are short against max_seq_length.
    c.pack_examples = ml_collections.FieldReference(None, field_type=bool)
    c.max_qa_length = 128  # multiple choice: tokens kept of question+option (official RACE)
    c.max_query_length = 64  # SQuAD: tokens kept of the question
    c.doc_stride = 128  # SQuAD: tokens between the starts of consecutive context windows
    c.max_answer_length = 30  # SQuAD: longest predicted answer, in tokens
    c.n_best_size = 20  # SQuAD: candidates kept per question
    c.start_n_top = 5  # SQuAD v2 beam: best starts
    c.end_n_top = 5  # SQuAD v2 beam: best ends per start
    c.null_threshold = 0.5  # SQuAD v2: answer "" when P(no answer) exceeds this

    # --- optimization (official AdamW, optimization.py): linear warmup, then linear decay
    add_optimizer(c, "adamw", learning_rate=1e-5, warmup_steps=100, num_train_steps=1000)
    c.num_train_epochs = 0.0  # > 0: num_train_steps = epochs * training features / batch_size
    c.warmup_fraction = 0.0  # > 0: warmup_steps = fraction * num_train_steps
    c.batch_size = 32  # global batch (examples per step)
    c.eval_batch_size = 32  # global evaluation batch (padded; any size divisible by devices)

    # --- mesh: (data, fsdp, tensor); data parallel over every device
    add_mesh(c)

    # --- loop
    add_loop(
        c, log_every_steps=50, eval_every_steps=0, checkpoint_every_steps=0, keep_checkpoints=1
    )
    c.num_seeds = 1  # N > 1: seeds seed..seed+N-1 as one program; eval_results has median etc.
    c.restart_failed_seeds = False  # re-run seeds that diverged / ended at chance, fresh seeds

    if task in GLUE_PRESETS or task in LOCAL_PRESETS:
        lr, batch, steps, warmup, length, dropout = {**GLUE_PRESETS, **LOCAL_PRESETS}[task]
        c.learning_rate, c.batch_size, c.eval_batch_size = lr, batch, max(batch, 32)
        c.num_train_steps, c.warmup_steps, c.max_seq_length = steps, warmup, length
        c.model.hidden_dropout_prob = c.model.attention_probs_dropout_prob = dropout
    if task == "mnli":
        c.data.eval_split = "validation_matched,validation_mismatched"  # both dev sets
    if task in ("squad_v1", "squad_v2"):
        # README: lr 5e-5, batch 48, 2 epochs, 10% warmup, 384 tokens (the paper's SQuAD 2.0
        # xxlarge run used 3e-5, 8144 steps, 814 warmup, 512 tokens).
        c.learning_rate, c.batch_size, c.eval_batch_size = 5e-5, 48, 48
        c.num_train_epochs, c.warmup_fraction, c.max_seq_length = 2.0, 0.1, 384
    if task == "race":
        # README for v2 models: lr 1e-5, ALBERT dropout 0 (v1 settings diverge), batch 32,
        # 12000 steps, 1000 warmup, 512 tokens, question+option cut to 128.
        c.learning_rate, c.batch_size, c.eval_batch_size = 1e-5, 32, 32
        c.num_train_steps, c.warmup_steps, c.max_seq_length = 12000, 1000, 512
        c.data.eval_split = "dev"  # RACE's TFDS dev split
    if task == "mc_cosmosqa":
        c.max_qa_length = 48  # question+option: CosmosQA options are one sentence
    if task == "squad_shifts":
        c.max_query_length, c.doc_stride = 32, 64  # 192-token windows on CPU
    return c
