"""GPU budget: what the engine keeps or updates on the GPU, as arithmetic on sizes and rates.

Pure functions and constants: no engine state, no device. The engine decides with them at run
time from a measured peak (`resident.py`, `device_update.py`); the planner decides with the same
ones before a run, from a config.json (`planner.py`), so the two cannot drift apart.
"""
from __future__ import annotations

import math

import torch

from ..host.memory import GiB

__all__ = ["DEVICE_PIECE", "DEVICE_PIECES_MAX", "device_piece", "PCIE_BOTH_WAYS", "CPU_ADAMW_RATE", "resident_bytes_per_param", "plan_resident",
           "balanced_share", "pick_device_units"]

# Elements per piece of a device update: a copy of 4-8 M parameters (64-128 MB in, 48-96 MB out).
DEVICE_PIECE = 1 << 22
# Note: [Why a large layer's pieces are larger] a device layer's update in its backward is queued
# by the thread that runs the backward, piece by piece: per piece about ten operations on the h2d
# stream (the gradient's slice, the state's copies in, the update, the events) and seven on the
# d2h stream, all behind the h2d stream's wait for the layer's own backward. A CUDA stream holds
# about 2,000 pending operations (benchmarks/experiments/device_issue_probe.py); the thread that
# queues past that blocks until the GPU has run the head of the queue, and the next layer's recompute, which the same thread queues
# afterwards, waits with it while the GPU runs out of queued work (measured, and the probe of a
# stream's capacity: docs/host_state.md, "Host-bound steps: part of the update on the GPU"). So a
# layer is cut into at most about DEVICE_PIECES_MAX
# pieces (some 640 operations on the h2d stream): larger pieces for a larger layer, at more device
# memory for their two buffer sets.
DEVICE_PIECES_MAX = 64


def device_piece(numel: int, least: int = DEVICE_PIECE) -> int:
    """Elements per piece of a device update of a unit of `numel` elements: `least`, doubled until
    the unit is at most `DEVICE_PIECES_MAX` pieces of it (each piece spans up to twice that)."""
    piece = max(1, int(least))
    while numel > piece * DEVICE_PIECES_MAX:
        piece *= 2
    return piece
# The rates the automatic device-update share balances: the h2d stream's rate in a clipping forward
# while the d2h stream carries the write-backs and the activations (both copy engines busy, so below
# the one-way figure), and the worker's fused AdamW rate with the clip factor. Measured on the H200
# host at the 3B shape (docs/benchmarks.md, "Measurements behind the engine's notes").
PCIE_BOTH_WAYS = 35e9          # bytes/s
CPU_ADAMW_RATE = 3.0e9         # parameters/s


def resident_bytes_per_param(dtype: torch.dtype) -> int:
    """GPU bytes of a resident unit per parameter: fp32 master, Adam m and v, and the weights in
    the compute dtype (none extra when that is fp32: the master is the weights)."""
    return 12 + (torch.finfo(dtype).bits // 8 if dtype != torch.float32 else 0)


def plan_resident(*, limit_bytes: int, peak_bytes: int, layer_numel: int, n_layers: int, embed_numel: int,
                  dtype: torch.dtype, embed: bool | None = None, layers: int | None = None, clipping: bool = False,
                  margin_fraction: float = 0.1, min_margin: int = 2 * GiB,
                  layer_bytes_per_param: float | None = None, held_bytes: int = 0) -> tuple[bool, int]:
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
        layer_bytes_per_param: a resident layer's GPU bytes per parameter in its state format
            (`resident_state.resident_bytes_per_param_of`); None: fp32 AdamW's.
        held_bytes: what later steps hold beyond the measured one (a device layer's gradients held a
            layer longer: device_update.py).
    """
    margin = max(min_margin, int(margin_fraction * limit_bytes))
    budget = limit_bytes - peak_bytes - margin - held_bytes
    per = resident_bytes_per_param(dtype)
    if embed is None:
        embed = budget >= embed_numel * (per + 4)                        # + its fp32 gradient
    if embed:
        budget -= embed_numel * (per + 4)
    if layers is None:
        if layer_bytes_per_param is not None:
            per = layer_bytes_per_param
        if clipping:
            per += 4                                                     # a gradient per layer
        else:
            budget -= layer_numel * 4                                    # one shared fp32 gradient buffer
        layers = int(max(0, min(n_layers, budget // (layer_numel * per)))) if budget > 0 else 0
    return bool(embed), int(layers)


def balanced_share(pcie_bytes_per_s: float = PCIE_BOTH_WAYS, cpu_params_per_s: float = CPU_ADAMW_RATE) -> float:
    """The share f of layers updated on the device that makes the CPU, (1 - f) / r per parameter,
    and the h2d link, (4 (1 - f) + 16 f) / B, take the same time."""
    b, r = pcie_bytes_per_s, cpu_params_per_s
    return min(1.0, max(0.0, (b - 4 * r) / (b + 12 * r)))


def pick_device_units(candidates: list, share: float) -> list:
    """Every 1/share-th of `candidates` (forward order), starting with the first: the device and
    the CPU then work on alternate stretches of the next forward from its first layer on."""
    eps = 1e-9
    return [u for p, u in enumerate(candidates) if math.ceil((p + 1) * share - eps) > math.ceil(p * share - eps)]
