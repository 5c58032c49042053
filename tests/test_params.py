"""Parameter counts: the official model sizes and every row of the paper's Tables 1, 3, 4."""

import json
import os
import subprocess
import sys

import pytest

from albert_jax.model.config import ModelConfig
from albert_jax.params import PAPER_ROWS, count_parameters, paper_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "size, core",
    [("base", 11_683_584), ("large", 17_683_968), ("xlarge", 58_724_864),
     ("xxlarge", 222_595_584)],
)  # fmt: skip
def test_official_counts(size, core):
    counts = count_parameters(ModelConfig.preset(size))
    assert counts["core"] == core  # embeddings + projection + encoder + pooler
    assert counts["embeddings"] == 3_906_048  # (30000 + 512 + 2) * 128 + 2 * 128
    h = ModelConfig.preset(size).hidden_size
    # MLM head (H->E dense, LN, decoder bias; decoder tied) and SOP head.
    assert counts["mlm_head"] == h * 128 + 128 + 2 * 128 + 30000
    assert counts["sop_head"] == 2 * h + 2
    assert counts["total"] == core + counts["mlm_head"] + counts["sop_head"]


def test_every_paper_row_matches_with_its_convention():
    rows = paper_table()
    assert len(rows) == len(PAPER_ROWS) == 19
    mismatches = [r for r in rows if not r["match"]]
    assert not mismatches, mismatches
    exact = {r["row"]: r["count"] for r in rows}
    # Exact figures (ALBERT_REFERENCE.md §3), not only the rounded millions.
    assert exact["Table 3: not-shared E=768"] == 108_490_752
    assert exact["Table 4: E=768 shared-attention"] == 83_078_400
    assert exact["Table 4: E=128 shared-FFN"] == 37_686_528


def test_cli_json_keys():
    out = subprocess.run(
        [sys.executable, "-m", "albert_jax.params",
         "--config=configs/pretrain.py:size=base,sharing=attention,embed=768", "--json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {"embeddings", "projection", "encoder", "pooler", "mlm_head", "sop_head", "total"}
    assert expected <= set(counts)
    assert counts["projection"] == 0  # E == H: the official model has no E->H projection
    assert counts["embeddings"] + counts["encoder"] + counts["pooler"] == 83_078_400


def test_every_model_field_is_a_command_line_override():
    """Every `ModelConfig` field is in configs/pretrain.py's model section (the config is
    locked, so a field missing there could not be set at all); groups reach the model: with
    G = 2 groups of 2 inner blocks, base's encoder holds 4 blocks' parameters."""
    import dataclasses

    from configs import pretrain

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields <= set(pretrain.get_config("size=base").model.keys())

    def encoder(*overrides: str) -> int:
        out = subprocess.run(
            [sys.executable, "-m", "albert_jax.params", "--config=configs/pretrain.py:size=base",
             *overrides, "--json"],
            cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])["encoder"]

    grouped = encoder("--config.model.num_hidden_groups=2", "--config.model.inner_group_num=2")
    assert grouped == 4 * encoder()
