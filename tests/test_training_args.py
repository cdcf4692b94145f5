"""SlideArgs: fp16 refused before any update, the Trainer's fields checked by the settings table."""
import math

import pytest
import torch

import hf_slideformer as hs
from hf_slideformer.training_args import SlideArgsError


def make(tmp_path, **kw):
    return hs.SlideArgs(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **kw)


def test_fp16_is_refused_pointing_to_bf16(tmp_path):
    with pytest.raises(SlideArgsError, match=r"fp16=True is refused.*GradScaler.*bf16=True"):
        make(tmp_path, fp16=True)


def test_fp16_from_the_launcher_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(SlideArgsError, match="fp16.*refused"):
        make(tmp_path)


def test_bf16_picks_the_engine_dtype(tmp_path):
    args = make(tmp_path, bf16=True)
    assert args.resolved_dtype() == torch.bfloat16 and args.mixed_precision == "no"
    assert make(tmp_path, slide_dtype="bf16").to_slide_config().dtype == torch.bfloat16
    with pytest.raises(SlideArgsError, match="contradicts bf16=True"):
        make(tmp_path, bf16=True, slide_dtype="fp32")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_max_grad_norm_is_refused_not_turned_off(tmp_path, value):
    with pytest.raises(SlideArgsError, match="max_grad_norm="):
        make(tmp_path, max_grad_norm=value)


def test_trainer_fields_reach_the_engine(tmp_path):
    cfg = make(tmp_path, gradient_accumulation_steps=3, max_grad_norm=0.0, slide_host_adam="torch",
               slide_expandable_segments=False).to_slide_config()
    assert (cfg.gradient_accumulation_steps, cfg.max_grad_norm, cfg.host_adam) == (3, None, "torch")
    assert cfg.expandable_segments is False


def test_every_slide_option_round_trips_through_hf_argument_parser(tmp_path):
    """Each `slide_*` field parses from its own command-line flag back to its default, and --help formats."""
    import contextlib
    import io

    from transformers import HfArgumentParser

    from hf_slideformer.config import SETTINGS

    parser = HfArgumentParser(hs.SlideArgs)
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--help"])
    assert "--slide_window" in text.getvalue()
    argv = ["--output_dir", str(tmp_path), "--use_cpu"]
    defaults = hs.SlideArgs(output_dir=str(tmp_path), use_cpu=True)
    for name, opt in SETTINGS.items():
        value = getattr(defaults, "slide_" + name, None)
        if "args" in opt.surfaces and value is not None:
            argv += ["--slide_" + name, str(value)]
    (args,) = parser.parse_args_into_dataclasses(argv)
    assert args.to_slide_config() == defaults.to_slide_config()
