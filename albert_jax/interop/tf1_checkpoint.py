"""Official TF1 ALBERT checkpoints (google-research/albert, TF-Hub) -> albert_jax params.

A checkpoint is a prefix `PREFIX` with `PREFIX.index` + `PREFIX.data-*` files, local or remote:
`tf.train.load_checkpoint` reads `gs://` itself. Variable names and reshapes come from
`weight_names.layout`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from albert_jax import files
from albert_jax.interop.weight_names import check_projection, import_tensors, layout, unreadable
from albert_jax.model.config import ModelConfig

__all__ = ["tf_checkpoint_to_params", "find_tf_checkpoint", "index_missing"]

# One logger for every conversion message, whichever module emits it (users filter on it).
log = logging.getLogger("albert_jax.convert")

# Training-only TF variables: optimizer slots / accumulators, step counters, loss scaling.
TF_IGNORED = re.compile(
    r"(^|/)(global_step|beta1_power|beta2_power|good_steps|loss_scale|current_loss_scale)$"
    r"|/(adam|lamb)_[mv]$"
    r"|(^|/)(AdamWeightDecayOptimizer|LAMBOptimizer)(_\d+)?(/|$)"
)


def tf_checkpoint_to_params(ckpt_prefix: str, config: ModelConfig) -> dict[str, Any]:
    """Official TF1 checkpoint (`model.ckpt-N` prefix) -> `{"params": ...}` (numpy).

    Names as in google-research/albert; a TF-Hub `module/` prefix is detected and stripped.
    Optimizer slots (`*/adam_m`, `*/lamb_v`, ...) and `global_step` are ignored (logged);
    other unused variables (e.g. fine-tuning heads) are logged as a warning.
    """
    import tensorflow as tf

    if not files.as_path(ckpt_prefix + ".index").is_file():
        raise index_missing(ckpt_prefix) or ValueError(
            f"{ckpt_prefix}: no TF checkpoint ({ckpt_prefix}.index does not exist)"
        )
    try:
        reader = tf.train.load_checkpoint(files.absolute(ckpt_prefix))
        raw_shapes = reader.get_variable_to_shape_map()
    except (tf.errors.OpError, IndexError, ValueError) as e:  # a corrupt or cut-off index
        raise unreadable(f"{ckpt_prefix}.index", "TF checkpoint index", e) from e

    def read(name: str) -> Any:
        try:
            return reader.get_tensor(names[name])
        except (tf.errors.OpError, IndexError, ValueError) as e:  # IndexError: data cut off
            data_files = ", ".join(str(p) for p in files.glob(f"{ckpt_prefix}.data-*"))
            what = f"TF checkpoint data file (variable {names[name]})"
            raise unreadable(data_files or f"{ckpt_prefix}.data-*", what, e) from e

    hub = any(name.startswith("module/") for name in raw_shapes)
    strip = (lambda n: n.removeprefix("module/")) if hub else (lambda n: n)
    names = {strip(n): n for n in raw_shapes}
    shapes = {n: tuple(raw_shapes[raw]) for n, raw in names.items()}
    source = f"TF checkpoint {ckpt_prefix}" + (" (TF-Hub module/ prefix)" if hub else "")
    check_projection(config, "bert/encoder/embedding_hidden_mapping_in/kernel" in shapes, source)
    ignored = [n for n in shapes if TF_IGNORED.search(n)]
    return import_tensors(
        layout(config),
        "tf",
        shapes,
        read,
        config.weight_dtype,
        source,
        ignored,
    )


def index_missing(path: str) -> ValueError | None:
    """The error for TF checkpoint data files without their `.index` (an incomplete copy: the
    index is written last and is small, easy to leave behind), or None if there are none.
    `path` is a checkpoint prefix or a dir."""
    root = files.as_path(path)
    pattern = str(root / "*.data-*") if root.is_dir() else f"{path}.data-*"
    data = [str(p) for p in files.glob(pattern)]
    if not data:
        return None
    prefixes = sorted({d.rpartition(".data-")[0] for d in data})
    return ValueError(
        f"{path}: incomplete TF checkpoint: {', '.join(p + '.index' for p in prefixes)} "
        f"missing (the data files {', '.join(data)} need it)"
    )


def find_tf_checkpoint(tf_dir: str) -> str:
    """The checkpoint prefix in an official dir (local or remote): the `checkpoint` file's
    latest, else `model.ckpt-best`, else the highest-numbered `*.ckpt-N`."""
    import tensorflow as tf

    tf_dir = files.absolute(tf_dir)
    latest = tf.train.latest_checkpoint(tf_dir)
    if latest:
        return latest
    prefixes = [str(p).removesuffix(".index") for p in files.as_path(tf_dir).glob("*.index")]
    if not prefixes:
        raise index_missing(tf_dir) or ValueError(f"{tf_dir}: no TF checkpoint (no *.index file)")
    best = [p for p in prefixes if p.endswith("ckpt-best")]
    if best:
        return best[0]

    def step(prefix: str) -> int:
        m = re.search(r"-(\d+)$", prefix)
        return int(m.group(1)) if m else -1

    chosen = max(prefixes, key=step)
    if len(prefixes) > 1:
        log.info("%s: %d checkpoints, using %s", tf_dir, len(prefixes), chosen)
    return chosen
