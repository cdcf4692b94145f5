"""SlidePlugin / SlideAccelerator settings: the launch's precision and the yaml keys from the settings table."""
import pytest
import torch

from hf_slideformer.accelerate_plugin import SlideAccelerator, SlidePlugin


def test_fp16_mixed_precision_is_refused_before_any_update(monkeypatch):
    with pytest.raises(ValueError, match="mixed_precision 'fp16' is refused.*GradScaler.*bfloat16"):
        SlideAccelerator(cpu=True, mixed_precision="fp16", slide_plugin=SlidePlugin())
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="fp16"):
        SlideAccelerator(cpu=True, slide_plugin=SlidePlugin())


def test_the_launch_precision_picks_the_dtype_unless_the_yaml_sets_it():
    assert SlidePlugin().to_slide_config("cpu", "bf16").dtype == torch.bfloat16
    assert SlidePlugin().to_slide_config("cpu", "no").dtype == torch.float32
    assert SlidePlugin(dtype="fp32").to_slide_config("cpu", "bf16").dtype == torch.float32


def test_unknown_and_new_keys(tmp_path):
    assert SlidePlugin.from_dict({"host_adam": "torch"}).to_slide_config("cpu").host_adam == "torch"
    with pytest.raises(ValueError, match="unknown slideformer setting.*'extra'"):
        SlidePlugin.from_dict({"extra": {}})


def test_fp8_mixed_precision_turns_on_the_fp8_projections(monkeypatch, tmp_path):
    acc = SlideAccelerator(cpu=True, mixed_precision="fp8", slide_plugin=SlidePlugin())
    cfg = acc.slide_config()
    assert cfg.matmuls == "fp8" and cfg.dtype == torch.bfloat16 and acc.mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    assert SlideAccelerator(cpu=True, slide_plugin=SlidePlugin()).slide_config().matmuls == "fp8"
    import hf_slideformer as hs
    args = hs.SlideArgs(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert args.slide_matmuls == "fp8" and args.to_slide_config().dtype == torch.bfloat16
