"""The step's plans (schedule.py): what a backward hands its parts for the step's norm."""
import torch

from helpers import batches, make_pair
from hf_slideformer.engine.schedule import NoRunningNorm, RunningNorm


def _plans(**slide_kw):
    """The backward plans of two micro-batches' backwards, as the parts saw them."""
    _, slid = make_pair("llama", False, **slide_kw)
    eng, seen = slid.slide_engine, []
    opt = slid.create_optimizer(lr=1e-2)
    take = eng.lora.take_gradient

    def spy(*args):                                   # called once per layer backward, after the placement's
        seen.append(eng.backward_plan)
        return take(*args)
    eng.lora.take_gradient = spy
    for batch in batches(2):
        slid(**batch).loss.backward()
        if eng.micro == eng.config.gradient_accumulation_steps:
            opt.step()
            opt.zero_grad()
    return seen


def test_one_backward_per_step_keeps_a_running_norm():
    plans = _plans()
    assert plans and all(isinstance(p.norm, RunningNorm) and p.running_norm for p in plans)


def test_accumulation_keeps_none():
    plans = _plans(gradient_accumulation_steps=2)
    assert plans and all(isinstance(p.norm, NoRunningNorm) and not p.running_norm for p in plans)


def test_no_running_norm_computes_nothing():
    calls = []
    NoRunningNorm().add(lambda: calls.append(1))
    assert calls == [] and NoRunningNorm().slot(object()) is None


def test_a_running_norm_adds_into_the_step_norm():
    class StepNorm:
        dev = torch.zeros(())

        def slot(self, unit):
            return ("slot of", unit)
    norm = RunningNorm(StepNorm())
    norm.add(lambda x: x * 2, torch.tensor(1.5))
    norm.add(torch.square, torch.tensor(2.0))
    assert float(norm.step_norm.dev) == 7.0 and norm.slot("u") == ("slot of", "u")
