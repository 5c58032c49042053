"""HF PyTorch ALBERT as a contender of `benchmarks/train_step.py`, on the CPU or a CUDA GPU.

`transformers.AlbertForPreTraining` with `labels` = -100 outside the masked positions and the
sentence-order label, `torch.optim.AdamW` (fused on a GPU), eval mode (no dropout anywhere, the
SOP head too).
On a GPU the model and batch live on `cuda:0` and every step ends in `torch.cuda.synchronize()`
(CUDA kernels run asynchronously; a step is timed to its last kernel, as ours is timed to its
loss being ready). `--dtype=bfloat16` runs the forward and the loss under
`torch.autocast(dtype=torch.bfloat16)`, torch's mixed precision (parameters, gradients and
AdamW moments stay float32, as ours), and attention through SDPA
(`attn_implementation="sdpa"`, PyTorch's fused scaled-dot-product attention: the fastest
attention HF offers ALBERT). `attention` in the result says which one the model really uses.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from albert_jax.model import flops


def _torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def device_name(torch: Any) -> str:
    """ "cuda" when torch sees a GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(torch: Any, device: str) -> Callable[[], None]:
    """What makes a step's end observable: a CUDA synchronize, nothing on the (synchronous) CPU."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def matmul_peak(size: int, repeats: int, dtype: str = "float32") -> float | None:
    """FLOP/s of a [size, size] `torch.matmul` in `dtype` on torch's device, best of `repeats`;
    None without torch. On the CPU: all cores (oneDNN/MKL), float32 whatever `dtype`."""
    torch = _torch()
    if torch is None:
        return None
    device = device_name(torch)
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
        dtype = "float32"
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (
        torch.randn(size, size, generator=generator, device=device, dtype=getattr(torch, dtype))
        for _ in range(2)
    )
    sync = _sync(torch, device)

    def matmul() -> None:
        torch.matmul(a, b)
        sync()

    return flops.square_matmul_flops(matmul, size, repeats)


def _pretraining_model(torch: Any, hf_config: Any, dtype: str) -> Any:
    from transformers import AlbertForPreTraining

    if dtype == "bfloat16":
        # `_from_config` takes the attention implementation in transformers 4.4x and 5.x alike;
        # a version without SDPA for ALBERT keeps its default (reported as `attention`).
        try:
            return AlbertForPreTraining._from_config(hf_config, attn_implementation="sdpa")
        except (TypeError, ValueError, ImportError) as error:
            print(f"hf_torch: no SDPA attention ({error}); its default instead", file=sys.stderr)
    return AlbertForPreTraining(hf_config)


def hf_torch(
    hf_config: Any, batch: dict[str, np.ndarray], dtype: str, lr: float, weight_decay: float
) -> dict[str, Any] | None:
    """The contender: {"step": a blocking training step, "compile_s": 0, "device", "attention"};
    None when torch or transformers is missing.

    `batch` is `train_step.make_batch`'s ([B, S] ids, segments, mask; [B, P] masked positions and
    ids; [B] sentence-order labels)."""
    torch = _torch()
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    if torch is None:
        return None
    device = device_name(torch)
    torch.manual_seed(0)
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    model = _pretraining_model(torch, hf_config, dtype).to(device).eval()
    # On a GPU the fused AdamW kernel (one launch over all parameters), the Trainer's default.
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=weight_decay,
        fused=device == "cuda",
    )
    labels = np.full(batch["input_ids"].shape, -100, np.int64)
    np.put_along_axis(labels, batch["masked_lm_positions"], batch["masked_lm_ids"], 1)
    arrays = dict(
        input_ids=batch["input_ids"],
        attention_mask=batch["input_mask"],
        token_type_ids=batch["segment_ids"],
        labels=labels,
        sentence_order_label=batch["sentence_order_label"],
    )
    inputs = {k: torch.from_numpy(v.astype(np.int64)).to(device) for k, v in arrays.items()}
    mixed = dtype == "bfloat16"
    sync = _sync(torch, device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mixed):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        sync()

    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    return dict(step=step, compile_s=0.0, device=device, attention=attention)
