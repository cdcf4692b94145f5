"""The step's gradient norm: taken where the gradients are, and the clip factor from it."""
import math

import torch

from helpers import batches, make_pair

LR = 1e-2


def _norm_of_reference(ref, data, ga):
    for b in data[:ga]:
        (ref(**b).loss / ga).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]))


def test_last_norm_is_the_steps_with_one_or_several_backwards():
    for ga in (1, 2):
        ref, slid = make_pair("llama", False, gradient_accumulation_steps=ga)
        opt = slid.create_optimizer(lr=LR)
        data = batches(ga)
        want = float(_norm_of_reference(ref, data, ga))
        for b in data:
            (slid(**b).loss / ga).backward()
        assert math.isclose(slid.slide_engine.norm.last(), want, rel_tol=1e-5), ga
        assert math.isclose(opt.last_grad_norm, want, rel_tol=1e-5)
        opt.step()


def test_clip_factor_and_non_finite_flag():
    _, slid = make_pair("llama", False, max_grad_norm=0.5)
    norm = slid.slide_engine.norm
    norm.dev.fill_(4.0)                                       # a norm of 2
    assert norm.clip_coef() == min(0.5 / (2.0 + 1e-6), 1.0)
    assert float(norm.found_inf()) == 0.0
    norm.dev.fill_(float("inf"))
    assert float(norm.found_inf()) == 1.0


def test_each_unit_has_its_own_pinned_slot():
    eng = make_pair("llama", False)[1].slide_engine
    slots = [eng.norm.slot(u) for u in eng.store.units]
    assert len({s.data_ptr() for s in slots}) == len(slots) and all(s.numel() == 1 for s in slots)
