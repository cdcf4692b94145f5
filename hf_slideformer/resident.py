"""Resident units: the optimizer state of the embedding and a few layers kept on the GPU and
updated there.

Under a memory cap the GPU usually has room left after the window, the activations and the
head: a 3B model trained at 16 x 2048 under 24 GiB peaks near 13 GiB. That room is worth more
as optimizer state than as nothing: a resident layer keeps its fp32 master, Adam moments and
compute-dtype weights on the GPU, is never copied in, and is updated by torch's fused CUDA
AdamW right after its backward, in about a millisecond instead of ~30 ms of CPU time. The CPU
worker, the bound at small batches, has that much less to do, and the next forward does not
wait for those layers.

The host stays the reference copy: each update copies the new master back (the HF parameters
stay views of current values), and `evict_resident()` writes the moments and step counters
back before anything reads or replaces the host state (`engine.synchronize()`: checkpoints,
state_dict, load_state_dict). The embedding goes first (its update, the per-row folding of its
gradient and, when tied, the lm_head's (V, H) gradient copy all leave the CPU, and it is what
the next forward needs first), then layers 0..k-1, the next ones the forward needs.
"""
from __future__ import annotations

import torch

from .store import Unit

__all__ = ["ResidentState", "plan_resident", "plan_resident_layers"]

GiB = 1024 ** 3


class ResidentState:
    """Device copies of one layer unit's master, moments, step counters and compute weights."""

    def __init__(self, u: Unit, dtype: torch.dtype, device: torch.device, with_grad: bool = False):
        self.unit = u
        self.master = torch.empty(u.numel, dtype=torch.float32, device=device)
        self.exp_avg = torch.empty_like(self.master)
        self.exp_avg_sq = torch.empty_like(self.master)
        self.weights = torch.empty(u.numel, dtype=dtype, device=device) if dtype != torch.float32 else self.master
        self.steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in u.entries]
        self.copied = None                    # d2h event of the last copy of `master` back to the host
        # The step's gradient, kept until optimizer.step() when it clips (layers in-backward share one).
        self.grad = torch.empty_like(self.master) if with_grad else None

    def load_from_host(self) -> None:
        u = self.unit
        self.master.copy_(u.master)
        self.exp_avg.copy_(u.exp_avg)
        self.exp_avg_sq.copy_(u.exp_avg_sq)
        for d, s in zip(self.steps, u.steps):
            d.copy_(s)
        if self.weights is not self.master:
            self.weights.copy_(self.master)

    def store_to_host(self) -> None:
        """Write moments, counters and master back (the caller has synchronized the device)."""
        u = self.unit
        u.master.copy_(self.master)
        u.exp_avg.copy_(self.exp_avg)
        u.exp_avg_sq.copy_(self.exp_avg_sq)
        for d, s in zip(u.steps, self.steps):
            d.copy_(s)

    def views(self) -> list[torch.Tensor]:
        return self.unit.views(self.weights)

    @staticmethod
    def bytes_per_param(dtype: torch.dtype) -> int:
        return 12 + (torch.finfo(dtype).bits // 8 if dtype != torch.float32 else 0)


def plan_resident(*, limit_bytes: int, peak_bytes: int, layer_numel: int, n_layers: int, embed_numel: int,
                  dtype: torch.dtype, embed: bool | None = None, layers: int | None = None, clipping: bool = False,
                  margin_fraction: float = 0.1, min_margin: int = 2 * GiB) -> tuple[bool, int]:
    """What to keep resident in what a measured step left free under the limit: (embedding?, layers).

    The embedding comes first when it is not fixed by the caller: per byte of GPU memory it
    takes more work off the CPU (its update, the per-row folding, the tied head's gradient copy)
    and it is the first thing the next forward needs. Then layers 0..k-1.

    Args:
        limit_bytes: the GPU memory the process may use (the cap, else the device's memory).
        peak_bytes: the peak the allocator reserved during a full training step.
        layer_numel: parameters of the largest layer; n_layers: layers in the model.
        embed_numel: parameters of the input embedding.
        dtype: compute dtype (resident units also keep their weights in it).
        embed, layers: fixed choices (None: decide).
        clipping: updates wait for the global norm at optimizer.step(), so every resident layer
            keeps its own fp32 gradient until then (else one buffer serves them all).
        margin_fraction, min_margin: head-room kept free for longer batches and fragmentation.
    """
    margin = max(min_margin, int(margin_fraction * limit_bytes))
    budget = limit_bytes - peak_bytes - margin
    per = ResidentState.bytes_per_param(dtype)
    if embed is None:
        embed = budget >= embed_numel * (per + 4)                        # + its fp32 gradient
    if embed:
        budget -= embed_numel * (per + 4)
    if layers is None:
        if clipping:
            per += 4                                                     # a gradient per layer
        else:
            budget -= layer_numel * 4                                    # one shared fp32 gradient buffer
        layers = int(max(0, min(n_layers, budget // (layer_numel * per)))) if budget > 0 else 0
    return bool(embed), int(layers)


def plan_resident_layers(*, limit_bytes: int, peak_bytes: int, layer_numel: int, n_layers: int,
                         dtype: torch.dtype, margin_fraction: float = 0.1, min_margin: int = 2 * GiB) -> int:
    """Layers only (no embedding): how many fit in what a measured step left free under the limit."""
    return plan_resident(limit_bytes=limit_bytes, peak_bytes=peak_bytes, layer_numel=layer_numel,
                         n_layers=n_layers, embed_numel=0, dtype=dtype, embed=False,
                         margin_fraction=margin_fraction, min_margin=min_margin)[1]
