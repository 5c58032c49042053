"""The HF PyTorch contender of `benchmarks/finetune.py`: `AlbertForSequenceClassification`
trained as HF's Trainer trains it (`HFTorch`), in a process of its own (`TorchProcess`)."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any

from albert_jax.finetune.settings import optimizer_config
from albert_jax.interop.hf_checkpoint import to_hf_config


class HFTorch:
    """HF PyTorch `AlbertForSequenceClassification` as HF's Trainer runs it: dynamic padding
    (`DataCollatorWithPadding`), AdamW without decay on biases / LayerNorm, clip 1.0, linear
    warmup / decay; `threads` torch threads during its steps."""

    def __init__(
        self,
        config: Any,
        model_config: Any,
        tokenizer: str,
        labels: int,
        threads: int,
        bf16: bool = False,
    ):
        import torch
        import transformers

        torch.manual_seed(int(config.seed))
        hf_config = to_hf_config(model_config)
        hf_config.pop("architectures", None)
        hf_config["classifier_dropout_prob"] = float(config.classifier_dropout)
        self.model = transformers.AlbertForSequenceClassification(
            transformers.AlbertConfig(**hf_config, num_labels=labels)
        ).train()
        no_decay = ("bias", "LayerNorm.weight")
        named = list(self.model.named_parameters())
        groups = [
            {"params": [p for n, p in named if not n.endswith(no_decay)],
             "weight_decay": float(config.weight_decay)},
            {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
        ]  # fmt: skip
        schedule = optimizer_config(config, int(config.num_train_steps))
        self.opt = torch.optim.AdamW(
            groups, lr=float(config.learning_rate), betas=(config.b1, config.b2), eps=config.eps
        )
        self.scheduler = transformers.get_linear_schedule_with_warmup(
            self.opt, schedule["warmup_steps"], schedule["num_train_steps"]
        )
        self.clip = float(config.grad_clip_norm)
        self.collator = transformers.DataCollatorWithPadding(
            transformers.AlbertTokenizer(vocab_file=tokenizer), return_tensors="pt"
        )
        self.torch, self.threads, self.bf16 = torch, threads, bf16

    def step(self, rows: list[dict[str, Any]], pad_to: int | None = None) -> float:
        """One update on `rows` padded to their longest (or to `pad_to`)."""
        self.torch.set_num_threads(self.threads)  # a process-wide setting: set per step
        if pad_to is None:
            batch = self.collator(rows)
        else:
            self.collator.padding, self.collator.max_length = "max_length", pad_to
            try:
                batch = self.collator(rows)
            finally:
                self.collator.padding, self.collator.max_length = True, None
        # Trainer's `bf16=True` on a CPU: the forward pass under autocast (bf16 matmuls,
        # fp32 parameters and optimizer), the backward pass outside it.
        with self.torch.autocast("cpu", dtype=self.torch.bfloat16, enabled=self.bf16):
            loss = self.model(**batch).loss
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.scheduler.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _torch_worker(conn: Any) -> None:
    """TorchProcess's side: builds `HFTorch` contenders by name and runs their steps."""
    models: dict[str, HFTorch] = {}
    while (request := conn.recv())[0] != "stop":
        command, name, *args = request
        try:
            if command == "build":
                models[name] = HFTorch(**args[0])
                conn.send(("ok", None))
            else:  # "step"
                conn.send(("ok", models[name].step(*args)))
        except Exception:  # noqa: BLE001 - reported in the parent, which stops
            conn.send(("error", traceback.format_exc()))


class TorchProcess:
    """The HF contenders in a process of their own, one step per request.

    Ours' process keeps the memory XLA frees (`process_setup.keep_freed_host_memory`: one
    malloc arena), which made torch's bfloat16 step 1.5x slower when the two shared it
    (2.2 -> 3.5 s, HF base, 32 sentences, 2 threads; float32 within noise); HF's Trainer runs
    under glibc's defaults, so its contenders do here. A request costs ~1 ms of the timed step
    (32 rows of token ids through a pipe)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: default malloc
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_torch_worker, args=(child,), daemon=True)
        self.process.start()

    def _ask(self, *request: Any) -> Any:
        self.conn.send(request)
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"HF contender {request[1]}: {value}")
        return value

    def build(self, name: str, **kwargs: Any) -> Callable[..., float]:
        """`HFTorch(**kwargs)` as contender `name`; returns its `step(rows, pad_to=None)`."""
        self._ask("build", name, kwargs)
        return lambda rows, pad_to=None: self._ask("step", name, rows, pad_to)

    def close(self) -> None:
        self.conn.send(("stop",))
        self.process.join()
