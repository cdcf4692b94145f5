"""The settings table: what each kind accepts, and SlideConfig, SlideArgs and SlidePlugin agreeing on it."""
import dataclasses
import math

import pytest
import torch
import yaml
from transformers import HfArgumentParser

import hf_slideformer as hs
from hf_slideformer.accelerate_plugin import SlidePlugin
from hf_slideformer.config import SETTINGS
from hf_slideformer.options import Auto, Bool, ClipNorm, Directory, DType, Float, Int
from hf_slideformer.training_args import SlideArgsError


def samples(tmp_path) -> dict:
    """A valid, non-default value for every option users write somewhere besides SlideConfig."""
    return dict(dtype="bfloat16", window=3, gradient_accumulation_steps=2, max_grad_norm=0.5, activation_tier="cpu",
                nvme_path=str(tmp_path), host_memory_limit=64.0, cpu_threads=1, pin_memory=True, use_kernels=True, gpu_memory_limit=24.0,
                head_chunk_tokens=64, mlp_chunk_tokens=16, grad_buffers=3,
                late_layer_updates=2, resident_layers=1, resident_embedding=False, device_update_share=0.5,
                expandable_segments=False,
                host_adam="torch", nonfinite_grads="raise", check_host_memory=False, check_finite_weights=False,
                rank_timeout=30.0, debug=True, matmuls="fp8")


# Options whose non-default values exclude others of `samples` (a compact optimizer_state refuses
# resident layers, state on disk and the torch kernel): carried by a test of their own below.
EXCLUSIVE = {"optimizer_state": "adamw_8bit_bf16"}


def on(surface, exclusive=True):
    return {n for n, o in SETTINGS.items() if surface in o.surfaces and (exclusive or n not in EXCLUSIVE)}


def args(tmp_path, **kw):
    return hs.SlideArgs(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **kw)


def expected(tmp_path) -> hs.SlideConfig:
    return hs.SlideConfig(device="cpu", **samples(tmp_path))


def same_settings(a: hs.SlideConfig, b: hs.SlideConfig) -> None:
    assert {n: getattr(a, n) for n in SETTINGS} == {n: getattr(b, n) for n in SETTINGS}


# ---------------------------------------------------------------- kinds
@pytest.mark.parametrize("kind, good, bad", [
    (Int(1, 16), [(1, 1), ("16", 16), (" 3 ", 3)], [0, 17, True, 2.5, "2.5", "x", None]),
    (Float(0.0, 1.0), [(0, 0.0), ("0.5", 0.5), (1, 1.0)], [1.5, -0.1, True, "half", math.nan, math.inf]),
    (ClipNorm(), [(1, 1.0), ("0.5", 0.5), (0, None), (-1.0, None)], [math.nan, math.inf, "nan", True, "x"]),
    (Bool(), [(True, True), ("false", False), ("TRUE", True)], ["no", "yes", 1, 0, "1"]),
    (Auto(Int(0)), [("auto", "auto"), ("AUTO", "auto"), ("3", 3), (0, 0)], [-1, "some", 1.5, True]),
    (DType(), [(torch.bfloat16, "bfloat16"), ("bf16", "bfloat16"), ("fp32", "float32")],
     [torch.float16, "fp16", "float16", "int8", torch.int64]),
])
def test_a_kind_parses_what_is_unambiguous_and_refuses_the_rest(kind, good, bad):
    for value, want in good:
        assert kind.parse(value) == want
    for value in bad:
        with pytest.raises(ValueError):
            kind.parse(value)


def test_a_directory_needs_its_parent_and_is_never_created(tmp_path):
    kind = Directory()
    assert kind.parse(str(tmp_path / "new")) == str(tmp_path / "new")          # one level: created later
    with pytest.raises(ValueError, match=f"{tmp_path / 'a'} does not exist: create it"):
        kind.parse(str(tmp_path / "a" / "b"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        kind.parse(str(tmp_path / "file"))
    for below in (tmp_path / "file" / "nvme", tmp_path / "file" / "a" / "b"):    # mkdir -p could not help
        with pytest.raises(ValueError, match=f"{tmp_path / 'file'} is a file, not a directory") as err:
            kind.parse(str(below))
        assert "mkdir" not in str(err.value)
    assert not (tmp_path / "a").exists() and not (tmp_path / "new").exists()


def test_cpu_threads_are_bounded_by_the_host(monkeypatch):
    monkeypatch.setattr("hf_slideformer.config.os.cpu_count", lambda: 6)
    assert hs.SlideConfig(device="cpu", cpu_threads=6).cpu_threads == 6
    with pytest.raises(ValueError, match=r"SlideConfig.cpu_threads=7: use an int in \[1, 6\]"):
        hs.SlideConfig(device="cpu", cpu_threads=7)


# ---------------------------------------------------------------- one table, three surfaces
def test_every_field_is_an_option_with_help_and_the_surfaces_list_the_same_settings():
    assert [f.name for f in dataclasses.fields(hs.SlideConfig)] == list(SETTINGS)
    for name, opt in SETTINGS.items():
        assert opt.help and opt.kind, name
        for surface, label in (("args", "SlideArgs"), ("plugin", "yaml")):
            assert surface in opt.surfaces or label in opt.elsewhere, f"{name}: where does {label} take it from?"
    slide_fields = {f.name: f for f in dataclasses.fields(hs.SlideArgs) if f.name.startswith("slide_")}
    assert set(slide_fields) == {"slide_" + n for n in on("args")}
    plugin_fields = {f.name: f for f in dataclasses.fields(SlidePlugin)}
    assert set(plugin_fields) == on("plugin")
    for name in on("args"):
        # argparse formats help texts with %: the field holds it doubled (options.option_fields)
        assert slide_fields["slide_" + name].metadata["help"] == SETTINGS[name].help.replace("%", "%%")
        assert slide_fields["slide_" + name].default == SETTINGS[name].default
    assert "host_adam" in on("args") & on("plugin")


def test_slide_args_carry_every_setting_to_the_config(tmp_path):
    values = samples(tmp_path)
    kw = {"slide_" + n: values[n] for n in on("args", exclusive=False)}
    cfg = args(tmp_path, bf16=False, gradient_accumulation_steps=2, max_grad_norm=0.5, **kw).to_slide_config()
    same_settings(cfg, expected(tmp_path))


def test_the_command_line_carries_every_setting_as_text(tmp_path):
    values = samples(tmp_path)
    argv = ["--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none",
            "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5"]
    for n in sorted(on("args", exclusive=False)):
        argv += [f"--slide_{n}", str(values[n])]
    (parsed,) = HfArgumentParser(hs.SlideArgs).parse_args_into_dataclasses(argv)
    same_settings(parsed.to_slide_config(), expected(tmp_path))


def test_the_yaml_carries_every_setting(tmp_path):
    values = samples(tmp_path)
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({"mpirun_config": {"slideformer": {n: values[n] for n in on("plugin", exclusive=False)}}}))
    same_settings(SlidePlugin.from_yaml(str(path)).to_slide_config("cpu"), expected(tmp_path))
    text = {n: str(values[n]) for n in on("plugin", exclusive=False)}                     # every value quoted: still parsed
    same_settings(SlidePlugin.from_dict(text).to_slide_config("cpu"), expected(tmp_path))


@pytest.mark.parametrize("name", sorted(EXCLUSIVE))
def test_every_surface_carries_the_exclusive_settings(tmp_path, name):
    value = EXCLUSIVE[name]
    want = hs.SlideConfig(device="cpu", **{name: value})
    assert getattr(args(tmp_path, **{"slide_" + name: value}).to_slide_config(), name) == value
    (parsed,) = HfArgumentParser(hs.SlideArgs).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none", f"--slide_{name}", str(value)])
    assert getattr(parsed.to_slide_config(), name) == getattr(want, name)
    assert getattr(SlidePlugin.from_dict({name: value}).to_slide_config("cpu"), name) == value


# ---------------------------------------------------------------- the harmful values of issue 18, on every surface
HARMFUL = [("head_chunk_tokens", -1), ("cpu_threads", 100000), ("cpu_threads", 2.5), ("grad_buffers", 2.5),
           ("window", True), ("pin_memory", "no"), ("gpu_memory_limit", "lots"), ("nvme_path", "/nonexistent/dir"),
           ("resident_layers", True), ("device_update_share", math.nan), ("dtype", "float16"),
           ("host_memory_limit", "lots"), ("host_memory_limit", 0)]


@pytest.mark.parametrize("name, value", HARMFUL)
def test_a_harmful_value_is_refused_on_every_surface_naming_the_field(tmp_path, name, value):
    with pytest.raises(ValueError, match=rf"SlideConfig\.{name}="):
        hs.SlideConfig(device="cpu", **{name: value})
    with pytest.raises(ValueError, match=rf"slideformer\.{name}="):
        SlidePlugin(**{name: value})
    with pytest.raises(SlideArgsError, match=rf"slide_{name}="):
        args(tmp_path, **{"slide_" + name: value})
    assert not __import__("os").path.exists("/nonexistent")


@pytest.mark.parametrize("value", [math.nan, math.inf, "nan"])
def test_a_non_finite_clipping_threshold_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match="SlideConfig.max_grad_norm="):
        hs.SlideConfig(device="cpu", max_grad_norm=value)
    with pytest.raises(ValueError, match="slideformer.max_grad_norm="):
        SlidePlugin(max_grad_norm=value)
    with pytest.raises(SlideArgsError, match="max_grad_norm="):           # it silently turned clipping off
        args(tmp_path, max_grad_norm=float(value))


def test_zero_or_less_turns_clipping_off_everywhere(tmp_path):
    assert hs.SlideConfig(device="cpu", max_grad_norm=0).max_grad_norm is None
    assert hs.SlideConfig(device="cpu", max_grad_norm=-1.0).max_grad_norm is None
    assert SlidePlugin(max_grad_norm=0.0).max_grad_norm is None
    assert args(tmp_path, max_grad_norm=0.0).to_slide_config().max_grad_norm is None


def test_numbers_given_as_text_are_read_as_numbers():
    cfg = hs.SlideConfig(device="cpu", window="3", gpu_memory_limit="24", head_chunk_tokens="512",
                         device_update_share="0.25", resident_layers="2", pin_memory="True")
    assert (cfg.window, cfg.gpu_memory_limit, cfg.head_chunk_tokens) == (3, 24.0, 512)
    assert (cfg.device_update_share, cfg.resident_layers, cfg.pin_memory) == (0.25, 2, True)
