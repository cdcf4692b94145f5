"""SlideConfig: defaults resolved for the device, float16 refused, read-only after slide(), the debug flag."""
import copy
import dataclasses
import logging

import pytest
import torch

import hf_slideformer as hs
from hf_slideformer.config import PACKAGE_LOGGER, ReadOnlySlideConfig
from helpers import batches, make_pair


def test_cpu_defaults_are_resolved_at_construction():
    cfg = hs.SlideConfig(device="cpu")
    assert (cfg.dtype, cfg.activation_tier, cfg.pin_memory, cfg.use_kernels) == (torch.float32, "device", False, False)
    assert cfg.cpu_threads >= 1 and cfg.max_grad_norm is None
    assert hs.SlideConfig(device="cpu", dtype="bf16").dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float16, "float16", "fp16"])
def test_float16_is_refused_before_any_update_pointing_to_bfloat16(dtype):
    with pytest.raises(ValueError, match="SlideConfig.dtype=.*float16 is refused.*GradScaler.*use bfloat16"):
        hs.SlideConfig(device="cpu", dtype=dtype)


def test_nvme_tier_needs_a_path_whose_parent_exists(tmp_path):
    with pytest.raises(ValueError, match="needs nvme_path"):
        hs.SlideConfig(device="cpu", activation_tier="nvme")
    missing = tmp_path / "not" / "here"
    with pytest.raises(ValueError, match=f"SlideConfig.nvme_path=.*{tmp_path / 'not'} does not exist: create it"):
        hs.SlideConfig(device="cpu", activation_tier="nvme", nvme_path=str(missing))
    assert not (tmp_path / "not").exists()


def test_a_host_memory_limit_is_gib_or_auto_and_needs_no_nvme_path_until_a_layer_goes_to_disk(tmp_path):
    assert hs.SlideConfig(device="cpu").host_memory_limit is None
    assert hs.SlideConfig(device="cpu", host_memory_limit="64", nvme_path=str(tmp_path)).host_memory_limit == 64.0
    assert hs.SlideConfig(device="cpu", host_memory_limit="AUTO", nvme_path=str(tmp_path)).host_memory_limit == "auto"
    # the split decides at slide() whether a disk is needed (tests/test_disk_placement.py)
    assert hs.SlideConfig(device="cpu", host_memory_limit=64).nvme_path is None
    for bad in (0, -1.0, "lots", True, float("nan")):
        with pytest.raises(ValueError, match=r"SlideConfig\.host_memory_limit=.*'auto' or a number > 0.0 \(GiB\)"):
            hs.SlideConfig(device="cpu", host_memory_limit=bad, nvme_path=str(tmp_path))


def test_slide_config_is_read_only_after_slide():
    cfg = hs.SlideConfig(device="cpu", dtype=torch.float32)
    _, model = make_pair(max_grad_norm=None)
    view = model.slide_config
    assert isinstance(view, hs.SlideConfig) and view == cfg
    with pytest.raises(dataclasses.FrozenInstanceError, match="configure_steps"):
        model.slide_config.gradient_accumulation_steps = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.slide_config.max_grad_norm = 1.0
    assert model.slide_engine.config.gradient_accumulation_steps == 1
    # The engine's own path changes accumulation and clipping between steps; the view shows it.
    model.slide_engine.configure_steps(2, 0.5)
    assert (view.gradient_accumulation_steps, view.max_grad_norm) == (2, 0.5)
    # Copies are plain, writable configs (to slide another model with).
    for other in (copy.copy(view), copy.deepcopy(view), dataclasses.replace(view, window=3)):
        assert type(other) is hs.SlideConfig
        other.window = 4


def test_the_config_given_to_slide_is_not_shared_with_the_engine():
    ref, _ = make_pair()
    cfg = hs.SlideConfig(device="cpu", dtype=torch.float32)
    model = hs.slide(copy.deepcopy(ref), cfg)
    cfg.gradient_accumulation_steps = 4                   # too late: the model keeps what it was slid with
    assert model.slide_config.gradient_accumulation_steps == 1
    opt = model.create_optimizer(lr=1e-3)
    batch = batches(1)[0]
    model(**batch).loss.backward()
    opt.step()                                            # one backward is one step: accumulation stayed 1
    assert model.slide_stats()["steps"] == 1
    assert isinstance(model.slide_config, ReadOnlySlideConfig)
    hs.slide(copy.deepcopy(ref), model.slide_config)      # a read-only view slides another model


def test_debug_turns_on_debug_logging_of_the_package():
    pkg = logging.getLogger(PACKAGE_LOGGER)
    level, handlers = pkg.level, list(pkg.handlers)
    try:
        pkg.setLevel(logging.WARNING)
        make_pair(debug=False)
        assert pkg.level == logging.WARNING
        make_pair(debug=True)
        assert pkg.getEffectiveLevel() == logging.DEBUG
    finally:
        pkg.setLevel(level)
        pkg.handlers[:] = handlers
