"""ALBERT pretraining config: `--config=configs/pretrain.py:size=base,sharing=all,embed=128`.

Arg keys:
  size       tiny | base | large | xlarge | xxlarge   (official sizes; tiny runs on a laptop CPU)
  sharing    all | attention | ffn | none            (paper Table 4)
  embed      embedding size E                        (paper Table 3; 128 for all released models)
  objective  sop | nsp | none                        (paper Table 5)
  data       demo | wiki_books | <a source spec of albert_jax.data.sources>
Defaults reproduce the paper (Sec. 4.1): batch 4096, seq 512, 20 predictions, LAMB lr 0.00176,
3125 warmup steps, 125k steps, linear decay to 0, weight decay 0.01, clip 1.0, no dropout (v2).
Any field can be overridden afterwards: `--config.batch_size=256 --config.model.dtype=bfloat16`.

size=tiny is the CPU demo: a 2-layer, H=128, E=64 all-shared ALBERT with a 4000-piece tokenizer
trained on first use, on the shipped demo corpus (seq 32, batch 32, LAMB lr 0.01, 7000 steps);
about 970 s of CPU time in all, i.e. under 10 minutes on 2 idle cores. Short sequences buy the
steps: the model starts to use context at [MASK] positions only after ~5000 steps.
"""

from __future__ import annotations

import ml_collections

from albert_jax.data import line_reading
from albert_jax.model.config import ModelConfig
from configs.common import add_loop, add_mesh, add_optimizer, parse_arg

SIZES = ("tiny", "base", "large", "xlarge", "xxlarge")


# The arg keys and their defaults (`--config=FILE:key=value,...`; a sweep tells them from fields).
ARG_DEFAULTS = dict(size="base", sharing="all", embed=-1, objective="sop", data="")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arg = parse_arg(arg, **ARG_DEFAULTS)
    if arg.size not in SIZES:
        raise ValueError(f"config arg size={arg.size!r} is not one of {SIZES}")
    tiny = arg.size == "tiny"
    c = ml_collections.ConfigDict()
    c.size = arg.size  # preset name of albert_jax.ModelConfig

    # --- model: fields of albert_jax.ModelConfig. The architecture is spelled out (the official
    # preset of `size`, or the CPU demo model for tiny) so that every field can be overridden
    # from the command line (`--config.model.hidden_size=256`) although the config is locked.
    preset = ModelConfig.preset(arg.size)
    c.model = ml_collections.ConfigDict()
    c.model.sharing = arg.sharing  # which sub-blocks the layers share (all|attention|ffn|none)
    # E of the factorized embedding (paper Table 3)
    c.model.embedding_size = arg.embed if arg.embed > 0 else preset.embedding_size
    # tiny: the demo tokenizer is trained to this size on first use
    c.model.vocab_size = 4000 if tiny else preset.vocab_size
    c.model.hidden_size = 128 if tiny else preset.hidden_size  # H
    c.model.num_hidden_layers = 2 if tiny else preset.num_hidden_layers  # layer applications
    c.model.num_attention_heads = 2 if tiny else preset.num_attention_heads  # H / 64 officially
    c.model.intermediate_size = 512 if tiny else preset.intermediate_size  # FFN width (4H)
    c.model.max_position_embeddings = preset.max_position_embeddings  # longest seq_len
    c.model.hidden_dropout_prob = 0.0  # v2 models: no dropout (paper Sec. 4.9, official v2)
    c.model.attention_probs_dropout_prob = 0.0  # idem for attention probabilities
    c.model.dtype = "float32"  # compute dtype; bfloat16 on TPU for speed
    c.model.param_dtype = "float32"  # parameters stay fp32 for LAMB
    # What the backward pass keeps: none|full|dots|dots_no_batch|minimal|save_attention_out.
    # "dots" saves matmul outputs and recomputes the cheap elementwise ops (GELU, softmax,
    # LayerNorm): 0.42x the temporaries of "none" (base, seq 512) and a faster step, since the
    # scan no longer stacks every elementwise intermediate. "full" is the memory lever.
    # xxlarge: "full", the least recomputation its float32 step fits with at the paper's
    # 4096 x 512 on a v3-512 (the TPU compiler: `python -m albert_jax.plan`, docs/tpu_plans.md).
    c.model.remat_policy = "full" if arg.size == "xxlarge" else "dots"
    c.model.scan_layers = True  # nn.scan over layers (compile time independent of depth)
    c.model.attention_impl = "xla"  # xla (einsums) | dot_product (JAX picks) | cudnn (GPU)
    # The official config's remaining fields, so that every one can be set on the command line.
    c.model.num_hidden_groups = preset.num_hidden_groups  # G: layers split into G param groups
    c.model.inner_group_num = preset.inner_group_num  # blocks per group, run in order
    c.model.hidden_act = preset.hidden_act  # gelu_new (tanh GELU, the official "gelu")
    c.model.type_vocab_size = preset.type_vocab_size  # segment ids (A / B)
    c.model.initializer_range = preset.initializer_range  # truncated-normal std
    c.model.layer_norm_eps = preset.layer_norm_eps  # official 1e-12
    # E→H projection even when E == H (HF checkpoints always have it; the official code not)
    c.model.always_project_embeddings = preset.always_project_embeddings

    # --- objective and data
    c.objective = arg.objective  # sop (ALBERT) | nsp (BERT) | none (MLM only)
    c.data = ml_collections.ConfigDict()
    c.data.sources = arg.data or ("demo" if tiny else "wiki_books")  # source spec (weights)
    c.data.data_dir = ml_collections.FieldReference(None, field_type=str)  # TFDS dir
    c.data.tokenizer = ml_collections.FieldReference(None, field_type=str)  # spm model path
    c.data.short_seq_prob = 0.1  # fraction of shorter training sequences (official)
    c.data.masked_lm_prob = 0.15  # masking rate before the max_predictions_per_seq cap
    c.data.max_ngram = 3  # whole-word n-gram masking, n <= 3 with p(n) ~ 1/n
    # SOP chunk of one sentence: "split" it inside the sentence (balanced labels) or give it a
    # random-document B with label 1 ("random_b", the official script).
    c.data.sop_single_segment = "split"
    c.data.num_workers = 0 if tiny else 8  # preprocessing worker processes per host
    # Data shards (0 = one per process, recorded in checkpoints): the global batch depends on
    # this, not on the process count; a multiple of the process count that divides batch_size.
    c.data.num_shards = 0
    c.data.cache_dir = ml_collections.FieldReference(None, field_type=str)  # tokenized cache
    c.data.eval_split = "validation"  # held-out split for periodic evaluation
    # Sentences sampled (per run, weighted over sources) when the run trains its own tokenizer
    # (data.tokenizer unset): bounds the time; the demo corpus has ~37k sentences.
    c.data.tokenizer_max_sentences = 100_000 if tiny else 1_000_000
    # Bounds of reading our sources' input files when they are built (line_reading.LineLimits):
    # a longer line (or whole-file document: books, document_per_file) is skipped and counted
    # (`lines_too_long` / `documents_too_long`) without being held whole; more blank lines in
    # a row end that file's read (`blank_runs_too_long`). Not part of a prepared dataset's
    # identity: what they skipped is in its counters.
    c.data.max_line_bytes = line_reading.DEFAULT_MAX_LINE_BYTES  # 64 MiB
    c.data.max_blank_lines = line_reading.DEFAULT_MAX_BLANK_LINES  # 100k
    # Unparsable lines in a row, and bytes per stored byte of a compressed file: past either
    # the rest of that file is not read (`bad_runs_too_long` / `expansions_too_large`).
    c.data.max_bad_lines = line_reading.DEFAULT_MAX_BAD_LINES  # 10k
    c.data.max_expansion = line_reading.DEFAULT_MAX_EXPANSION  # 200x

    # --- batch shape
    c.batch_size = 32 if tiny else 4096  # global batch (sequences per step)
    c.seq_len = 32 if tiny else 512  # tokens per sequence
    # the authors used 20 even at 512 (official issue #51); tiny: 15% of 32
    c.max_predictions_per_seq = 5 if tiny else 20
    c.microbatches = 1  # gradient accumulation: 4096 sequences on any mesh

    # --- optimization (LAMB as the official lamb_optimizer.py): linear warmup, then linear
    # decay to 0 at num_train_steps
    add_optimizer(
        c,
        "lamb",
        learning_rate=0.01 if tiny else 0.00176,
        warmup_steps=50 if tiny else 3125,
        num_train_steps=7000 if tiny else 125_000,
    )

    # --- mesh: (data, fsdp, tensor); -1 fills with the remaining devices. Why per size:
    # tiny..large: data parallel (weights, gradients, LAMB state <= 0.3 GB; one all-reduce a step);
    # xlarge: FSDP over all devices (else 0.9 GB of weights, gradients and LAMB state on each);
    # xxlarge: FSDP + 4-way tensor parallel (a host's 4 chips) that also splits its 16k-wide FFN.
    data, fsdp, tensor = {
        "tiny": (-1, 1, 1), "base": (-1, 1, 1), "large": (-1, 1, 1), "xlarge": (1, -1, 1),
        "xxlarge": (1, -1, 4),
    }[arg.size]  # fmt: skip
    add_mesh(c, data, fsdp, tensor)

    # --- loop
    add_loop(
        c,
        log_every_steps=50 if tiny else 100,
        eval_every_steps=500 if tiny else 5000,  # held-out MLM / SOP evaluation
        checkpoint_every_steps=500 if tiny else 5000,
        keep_checkpoints=3,
    )
    c.eval_batches = 32 if tiny else 50  # batches per evaluation
    c.resume_from = ml_collections.FieldReference(None, field_type=str)  # another workdir
    c.init_from = ml_collections.FieldReference(None, field_type=str)  # params only
    # more debugging hooks (0 = off): crashes at a save, divergence
    c.debug.sigkill_after_save_at_step = 0  # SIGKILL right after this step's async save starts
    c.debug.sigkill_after_commit_at_step = 0  # SIGKILL right after this step's save commits
    c.debug.nan_at_step = 0  # this step's batch gets NaN loss weights (divergence handling)
    return c


def sweep(add) -> None:
    """The paper's ablation grid (Tables 3, 4, 5) at the size of `--config`'s arg:

        python -m albert_jax.sweep --config=configs/pretrain.py:size=base \
          --sweep_fn=configs/pretrain.py:sweep --root=gs://BUCKET/ablations

    `add(**overrides)` receives config-arg overrides; a point two tables share (all-shared at
    E=128 with SOP) is added once: 14 points.
    """
    added: set[tuple[tuple[str, object], ...]] = set()

    def once(**arg: object) -> None:
        key = tuple(sorted({"objective": "sop", **arg}.items()))
        if key not in added:
            added.add(key)
            add(**arg)

    for sharing in ("none", "all"):  # Table 3: embedding size, not-shared vs all-shared
        for embed in (64, 128, 256, 768):
            once(sharing=sharing, embed=embed)
    for embed in (768, 128):  # Table 4: sharing strategies
        for sharing in ("all", "attention", "ffn", "none"):
            once(sharing=sharing, embed=embed)
    for objective in ("none", "nsp", "sop"):  # Table 5: sentence-level objectives (E=128)
        once(sharing="all", embed=128, objective=objective)


def sweep_table4(add) -> None:
    """The paper's Table 4, one embedding size: cross-layer sharing all / attention / ffn /
    none at the E of `--config`'s arg (`:size=base,embed=128` is the paper's lower half; the
    tiny model's E=64 is its factorized analog at H=128)."""
    for sharing in ("all", "attention", "ffn", "none"):
        add(sharing=sharing)
