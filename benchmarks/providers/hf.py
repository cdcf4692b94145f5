"""`hf`: Hugging Face training with the whole model resident on the GPU, uncapped: the ceiling.

bf16 parameters, sdpa attention (flex attention where HF has no sdpa path: `base.attention_of`),
`torch.optim.AdamW(fused=True)` on the device (so Adam moments are bf16 too: pure bf16 training,
as `model.to(torch.bfloat16)` + AdamW gives), the loss from `model(input_ids, labels).loss`.
Configured as its users run it by default: gradient checkpointing on (HF's, non-reentrant) and
the fused kernels (`recipe.apply_kernels`: Liger, else triton_ops, whose loss head never
materialises the logits). `--checkpointing off --kernels
none` gives plain HF (full logits, upcast to fp32); `--checkpointing auto` turns checkpointing
on only after an out-of-memory batch. The row says what ran.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Provider, build_model
from .recipe import apply_kernels, enable_checkpointing

__all__ = ["HFProvider"]


class HFProvider(Provider):
    name = "hf"
    capped = False
    default_checkpointing = "on"
    default_kernels = "auto"

    def setup(self) -> None:
        self.model = build_model(self.config, self.device, self.spec.torch_dtype, seed=self.spec.seed,
                                 fill="normal" if self.device.type == "cuda" else "tiled")
        self.count(self.model)
        self.kernels = self.apply_kernels()
        self.notes.append(f"kernels: {self.kernels}")
        self.checkpointing = False
        if self.spec.checkpointing == "on":
            self._enable_checkpointing()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.spec.lr, weight_decay=0.0, fused=True)

    def apply_kernels(self) -> str:
        return apply_kernels(self.model, self.spec.kernels)

    def _enable_checkpointing(self) -> None:
        enable_checkpointing(self.model)
        self.checkpointing = True

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss(input_ids, labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def after_oom(self, batch: int) -> bool:
        self.optimizer.zero_grad(set_to_none=True)
        if self.spec.checkpointing == "auto" and not self.checkpointing:
            self._enable_checkpointing()
            self.notes.append(f"gradient checkpointing turned on: batch {batch} ran out of memory without it")
            return True
        return False

    def report(self) -> dict[str, Any]:
        return {"gradient_checkpointing": self.checkpointing, "kernels": self.kernels,
                "optimizer": "torch.optim.AdamW(fused=True), bf16 states"}
