"""`resident`: the compute bound. The model resident on the GPU with the project's own kernels.

Same model and optimizer as `hf`, gradient checkpointing off unless the batch runs out of memory
without it (`--checkpointing auto`), the decoder layers patched by `triton_ops.patch(model)`,
and the loss is `triton_ops.linear_cross_entropy` on the final hidden states, so the (B*S, V)
logits are never materialised. The forward + backward time of each step is measured separately
(CUDA events): that is the GPU-compute term of the step bound (docs/benchmarks.md, "Protocol and columns"), the work an
offloading engine must hide its transfers and CPU Adam behind.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import median

from .hf import HFProvider

__all__ = ["ResidentProvider"]


class ResidentProvider(HFProvider):
    name = "resident"
    capped = False

    default_checkpointing = "auto"
    default_kernels = None  # always the project's own: that is what this bound measures

    def setup(self) -> None:
        super().setup()
        import triton_ops

        self.lce = triton_ops.linear_cross_entropy
        self._compute: list[tuple[Any, Any] | float] = []

    def apply_kernels(self) -> str:
        import triton_ops

        triton_ops.patch(self.model)
        return "triton_ops.patch"

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.model.base_model(input_ids=input_ids).last_hidden_state    # (B, S, H)
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)                        # (B, S): next token
        return self.lce(hidden.reshape(-1, hidden.shape[-1]), self.model.lm_head.weight, shifted.reshape(-1))

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = self.loss(input_ids, labels)
            loss.backward()
            end.record()
            self._compute.append((start, end))
        else:
            t0 = time.perf_counter()
            loss = self.loss(input_ids, labels)
            loss.backward()
            self._compute.append(time.perf_counter() - t0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def after_oom(self, batch: int) -> bool:
        self._compute.clear()
        return super().after_oom(batch)

    def report(self) -> dict[str, Any]:
        if self._compute and not isinstance(self._compute[0], float):
            torch.cuda.synchronize()
        times = [c if isinstance(c, float) else c[0].elapsed_time(c[1]) / 1e3 for c in self._compute]
        return {**super().report(), "kernels": self.kernels, "loss": "triton_ops.linear_cross_entropy",
                "compute_s": median(times[-self.spec.steps:])}
