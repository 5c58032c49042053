"""The paper's Table 5 on tiny models: `configs/pretrain.py:size=tiny`, pretrained with each
sentence-level objective and cross-evaluated on NSP and SOP by

    python -m albert_jax.analysis.sop_table --config=configs/table5.py:data=SPEC --workdir=DIR

which sets `objective` per run (none, nsp, sop: `sop_table.OBJECTIVE_ROWS`) in DIR/<objective>
and writes DIR/sop_table.md. One run alone: `python -m albert_jax.main
--config=configs/table5.py:objective=nsp,data=SPEC --workdir=DIR/nsp`.

Arg keys:
  objective  sop | nsp | none     (the sweep sets it per run)
  data       a source spec of albert_jax.data.sources (default: the shipped demo corpus)
  steps      training steps of each run (7000, the tiny demo's length: at 800 the models had
             learned neither sentence task; ~12 minutes a run on 2 idle CPU cores)
Why these settings: 64-token sequences (the tiny demo's 32 leave segments of a few words, too
little for a sentence-level task) and an evaluation only at the end, on 16 batches (512 pairs
per task: a binomial standard error of about 2.2 points at 50%). Everything else is the tiny
demo's (a 2-layer, H=128, E=64 all-shared ALBERT, batch 32, LAMB lr 0.01).
"""

from __future__ import annotations

import ml_collections

from configs import pretrain
from configs.common import parse_arg

# The arg keys and their defaults (`--config=FILE:key=value,...`; a sweep tells them from fields).
ARG_DEFAULTS = dict(objective="sop", data="", steps=7000)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arg = parse_arg(arg, **ARG_DEFAULTS)
    data = f",data={arg.data}" if arg.data else ""
    c = pretrain.get_config(f"size=tiny,objective={arg.objective}{data}")
    c.seq_len = 64  # tokens per sequence: segments of ~30 tokens
    c.max_predictions_per_seq = 10  # 15% of 64
    c.num_train_steps = arg.steps  # per run
    c.warmup_steps = min(50, arg.steps // 10)  # linear warmup
    c.log_every_steps = 50  # metrics.jsonl cadence
    c.eval_every_steps = arg.steps  # one held-out evaluation, at the end
    c.eval_batches = 16  # 512 held-out pairs per task
    c.checkpoint_every_steps = arg.steps  # the final model (what the table evaluates)
    return c
