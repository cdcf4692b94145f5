"""The planner's settings (plan_settings.py): the engine's take SlideConfig's defaults and checks,
in `plan` and on the command line alike; the planner's own keep their messages."""
import inspect
from pathlib import Path

import pytest

from hf_slideformer.cli import build_parser
from hf_slideformer.config import SETTINGS, SlideConfig
from hf_slideformer.planner.plan_settings import ENGINE_OPTIONS
from hf_slideformer.planner.planner import plan

TINY = Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "tiny.json"
MACHINE = dict(gpu_mem=24, host_mem=24, pcie_gbs=54.6, adam_gps=3.5)


def test_the_engine_settings_default_to_slideconfigs():
    params = inspect.signature(plan).parameters
    args = build_parser().parse_args(["plan", str(TINY)])
    for argument, name in ENGINE_OPTIONS.items():
        assert params[argument].default == SETTINGS[name].default, argument
        assert getattr(args, argument) == SETTINGS[name].default, argument
    assert params["activation_tier"].default == "auto"
    assert build_parser().parse_args(["plan", str(TINY), "--activation-tier", "nvme"]).activation_tier == "nvme"


def test_auto_plans_the_cuda_devices_tier():
    assert plan(TINY, batch=2, **MACHINE).activation_tier == "cpu"
    assert plan(TINY, batch=2, activation_tier="auto", **MACHINE).report() == \
        plan(TINY, batch=2, activation_tier="cpu", **MACHINE).report()


@pytest.mark.parametrize("argument, value, message", [
    ("window", 17, r"window=17: use an int in \[1, 16\]"),
    ("grad_buffers", 0, r"grad_buffers=0: use an int >= 1"),
    ("gradient_accumulation_steps", 2.5, r"gradient_accumulation_steps=2.5: use an int >= 1"),
    ("activation_tier", "disk", r"activation_tier='disk': use one of 'auto', 'device', 'cpu', 'nvme'"),
    ("mlp_chunk_tokens", 0, r"mlp_chunk_tokens=0: use an int >= 1"),
    ("max_grad_norm", float("nan"), r"max_grad_norm=nan"),
])
def test_the_engine_settings_are_checked_by_slideconfigs_table(argument, value, message):
    with pytest.raises(ValueError, match=message):
        plan(TINY, batch=2, **{argument: value}, **MACHINE)
    with pytest.raises(ValueError, match=message.replace(argument, "SlideConfig." + argument, 1)):
        SlideConfig(device="cpu", **{argument: value})


def test_no_clipping_at_zero_as_the_engine():
    assert plan(TINY, batch=2, max_grad_norm=0.0, **MACHINE).max_grad_norm is None
    assert plan(TINY, batch=2, max_grad_norm=1, **MACHINE).max_grad_norm == 1.0
