"""Gradient accumulation through the device (accumulate.py): the first micro-batch lands in the
host accumulator, later ones are added on the device to the sum brought back in; the CPU worker
folds only the embedding's and the head's gradients."""
import math

import pytest
import torch

from hf_slideformer.host.host_tasks import HostUpdates
from helpers import batches, make_pair
from test_engine import PARAM_TOL, train_both


@pytest.mark.parametrize("tied", [False, True])
def test_the_worker_folds_no_layer_gradient(tied, monkeypatch):
    """With accumulation the layers' gradients never reach the worker's fold (its `_consume`),
    and the h2d traffic includes each later micro-batch's running sums."""
    folded = []
    consume = HostUpdates.consume
    monkeypatch.setattr(HostUpdates, "consume", lambda self, u, *a, **k: (folded.append(u.kind), consume(self, u, *a, **k))[1])
    ref, slid = make_pair("llama", tied, gradient_accumulation_steps=3, max_grad_norm=0.5)
    assert train_both(ref, slid, batches(6, pad=True), ga=3, clip=0.5) < PARAM_TOL
    assert folded and "layer" not in folded, folded
    layers = sum(u.numel for u in slid.slide_engine.layer_units)
    assert slid.slide_stats()["h2d_bytes"] >= 2 * 2 * 4 * layers     # 2 steps x 2 later micro-batches


@pytest.mark.parametrize("clip", [None, 0.4])
def test_accumulation_through_the_device_with_a_short_window(clip):
    """gradient_accumulation_steps=3 with a step after 2 micro-batches (the end of an epoch), a
    full window, and a short one again: the layers' sums go through the device (accumulate.py),
    the norms of a short window are taken from the host accumulators (not from the device's
    partial sum of the step before), and everything matches plain PyTorch.
    Tolerances: the gradients agree to 1e-7, but AdamW's first step divides by |g| + eps, so a
    gradient entry near eps moves its weight by up to 1% of a step between the two sums' roundings
    (the host path of 4250945 gives the same figures); the norms of later steps follow."""
    data = batches(8, pad=True)
    ref, slid = make_pair("llama", True, gradient_accumulation_steps=3, max_grad_norm=clip)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = slid.create_optimizer(lr=1e-2)
    for window in (data[:2], data[2:5], data[5:7]):
        for b in window:
            (ref(**b).loss / len(window)).backward()
            (slid(**b).loss / len(window)).backward()
        rn = (torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else
              torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])))
        ropt.step(); ropt.zero_grad()
        opt.step(); opt.zero_grad()
        assert math.isclose(opt.last_grad_norm, float(rn), rel_tol=1e-3), (len(window), opt.last_grad_norm, float(rn))
    sd, rsd = slid.state_dict(), ref.state_dict()
    assert max((sd[k] - rsd[k]).abs().max().item() for k in rsd) < 2 * PARAM_TOL
