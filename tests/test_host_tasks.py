"""The CPU worker's side of a step (host_tasks.py): a step whose gradients are not finite.

Every case goes through the public loop (forward, backward, optimizer.step) with a gradient made
NaN on purpose below one decoder layer (its forward is the identity, its backward NaN), or with a
NaN loss scale: no master, moment or step counter takes a non-finite value, the updates after the
first non-finite gradient are skipped (all of them with clipping or accumulation), the step is
named in a warning, and `nonfinite_grads='raise'` stops with NonFiniteGradientError.
"""
from __future__ import annotations

import logging

import pytest
import torch

import hf_slideformer as hs

from helpers import batches, make_pair

LR = 1e-2


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


def _poison_layer(monkeypatch, model, index: int):
    """Make the gradient reaching the output of decoder layer `index` NaN (its forward unchanged)."""
    target = model.model.layers[index]
    cls = type(target)
    real = cls.forward

    def forward(self, *a, **k):
        out = real(self, *a, **k)
        if self is not target or not torch.is_grad_enabled():
            return out
        if isinstance(out, tuple):
            return (_NanBackward.apply(out[0]),) + tuple(out[1:])
        return _NanBackward.apply(out)
    monkeypatch.setattr(cls, "forward", forward)


def _state(model, opt):
    opt_sd = opt.state_dict()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()} for k, s in opt_sd["state"].items()}
    return params, moments


def _names_changed(before, after):
    return sorted(k for k in before if not torch.equal(before[k], after[k]))


def _all_finite(model, opt):
    sd = opt.state_dict()["state"]
    return (all(torch.isfinite(v).all() for v in model.state_dict().values())
            and all(torch.isfinite(t).all() for s in sd.values() for t in s.values() if torch.is_tensor(t)))


CASES = [dict(), dict(tied=True), dict(max_grad_norm=0.5), dict(gradient_accumulation_steps=2),
         dict(gradient_accumulation_steps=2, max_grad_norm=0.5, tied=True), dict(resident_layers=1),
         dict(max_grad_norm=0.5, resident_layers=1, resident_embedding=True),
         dict(max_grad_norm=0.5, device_update_share=0.5)]
IDS = ["in-backward", "tied", "clip", "accumulate", "accumulate-clip-tied", "resident", "clip-resident",
       "clip-device-updates"]


def _train(kw, monkeypatch=None, poison_at=None, n_steps=1, scale=1.0, **extra):
    kw = dict(kw)
    tied = kw.pop("tied", False)
    _, slid = make_pair("llama", tied, **kw, **extra)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.01)
    ga = kw.get("gradient_accumulation_steps", 1)
    # one clean step first, so the moments and counters are not zero
    for b in batches(ga, seed=3):
        slid(**b).loss.backward()
    opt.step()
    opt.zero_grad()
    before = _state(slid, opt)
    if poison_at is not None:
        _poison_layer(monkeypatch, slid, poison_at)
    for b in batches(ga * n_steps, seed=4):
        (slid(**b).loss * scale).backward()
        if slid.slide_engine.micro == ga:
            opt.step()
            opt.zero_grad()
    slid.slide_engine.synchronize()
    return slid, opt, before


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_a_nan_loss_skips_the_whole_step(kw, caplog):
    """A NaN loss (here its scale): the head's gradient is the first judged, so nothing moves."""
    with caplog.at_level(logging.WARNING, logger="hf_slideformer"):
        slid, opt, (params, moments) = _train(kw, scale=float("nan"))
    after_params, after_moments = _state(slid, opt)
    assert _names_changed(params, after_params) == []
    for k in moments:
        for n in moments[k]:
            assert torch.equal(torch.as_tensor(moments[k][n]), torch.as_tensor(after_moments[k][n])), (k, n)
    assert "step 2" in caplog.text and "not finite" in caplog.text


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_no_master_takes_a_nan_from_a_layer_gradient(kw, monkeypatch, caplog):
    """NaN gradients from decoder layer 1 down (the loss stays finite): no value becomes NaN; layers
    1 and 0 keep their values (the head, layer 2 and, with updates in backward, the embedding's
    early part, the rows the batch does not touch, were updated before the NaN arrived); with
    clipping or accumulation (the norm is known first) no unit moves at all."""
    with caplog.at_level(logging.WARNING, logger="hf_slideformer"):
        slid, opt, (params, _) = _train(kw, monkeypatch, poison_at=1)
    after, _ = _state(slid, opt)
    assert _all_finite(slid, opt)
    changed = _names_changed(params, after)
    untouched = [k for k in params if k.startswith(("model.layers.0.", "model.layers.1."))]
    assert untouched and not set(untouched) & set(changed), changed
    if kw.get("max_grad_norm") or kw.get("gradient_accumulation_steps"):
        assert changed == []
    assert "step 2" in caplog.text and "not finite" in caplog.text


def test_training_goes_on_after_a_skipped_step():
    """After a skipped step, the next finite steps train as usual (the loss falls)."""
    _, slid = make_pair("llama", False)
    opt = slid.create_optimizer(lr=LR)
    bs = batches(6, seed=5)
    first = None
    for n, b in enumerate(bs):
        loss = slid(**b).loss
        (loss * (float("nan") if n == 1 else 1.0)).backward()
        opt.step()
        opt.zero_grad()
        first = float(loss) if first is None else first
    last = float(slid(**bs[0]).loss)
    assert torch.isfinite(torch.tensor(last)) and last < first


@pytest.mark.parametrize("kw", [dict(), dict(max_grad_norm=0.5)], ids=["in-backward", "clip"])
def test_raise_policy_stops_with_a_clear_error(kw, monkeypatch):
    with pytest.raises(hs.NonFiniteGradientError, match="step 2: .* not finite"):
        slid, opt, _ = _train(kw, monkeypatch, poison_at=1, n_steps=2, nonfinite_grads="raise")
        slid(**batches(1)[0]).loss.backward()


def test_the_policy_is_a_checked_setting():
    with pytest.raises(ValueError, match="nonfinite_grads"):
        hs.SlideConfig(device="cpu", nonfinite_grads="ignore")
