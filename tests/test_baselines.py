"""The baselines as their users run them: checkpointing, fused kernels, DeepSpeed's config, the batch search.

DeepSpeed and Liger are not needed here: what the providers build is checked on the CPU, and the
batch search is driven by a fake provider that runs out of memory above a batch.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_train  # noqa: E402
from benchmarks.batch_search import search_batches, search_order  # noqa: E402
from benchmarks.providers import RunSpec, get_provider  # noqa: E402
from benchmarks.providers import recipe  # noqa: E402
from benchmarks.providers.base import build_model, load_config  # noqa: E402
from benchmarks.providers.deepspeed_zero import ds_config  # noqa: E402


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_config_is_the_protocols(stage):
    cfg = ds_config(stage, micro_batch=8, lr=1e-5)
    zero = cfg["zero_optimization"]
    assert cfg["train_micro_batch_size_per_gpu"] == 8 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["bf16"] == {"enabled": True} and cfg["optimizer"]["type"] == "AdamW"
    assert zero["stage"] == stage and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["overlap_comm"] and zero["contiguous_gradients"]
    assert ("offload_param" in zero) == (stage == 3)
    if stage == 3:
        assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}


def _no_liger(monkeypatch):
    monkeypatch.setattr(recipe, "is_liger_available", lambda: False)


@pytest.mark.parametrize("name", ["ds2", "ds3"])
def test_deepspeed_providers_prepare_checkpointing_and_kernels(name, monkeypatch):
    """Before deepspeed.initialize: HF's non-reentrant checkpointing on, the fused loss in the forward."""
    _no_liger(monkeypatch)
    cls = get_provider(name)
    assert (cls.default_checkpointing, cls.default_kernels) == ("on", "auto")
    spec = RunSpec(provider=name, model="tiny", seq=16, batches=[2], device="cpu", checkpointing="on", kernels="auto")
    provider = cls(spec)
    external = []
    monkeypatch.setattr(cls, "fused_loss_reads_head", lambda self, model: external.append(model))
    model = build_model(provider.config, "cpu", torch.float32, fill="tiled")
    provider.prepare(model)
    assert provider.checkpointing
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords["use_reentrant"] is False
    assert provider.kernels.startswith("triton_ops.patch") and "Liger not importable" in provider.kernels
    assert external == [model]  # ZeRO-3 gathers lm_head.weight for the fused loss
    ids = torch.randint(0, provider.config.vocab_size, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and torch.isfinite(out.loss)  # the fused head: no logits
    out.loss.backward()
    assert model.lm_head.weight.grad is not None


def test_deepspeed_provider_without_checkpointing_or_kernels():
    spec = RunSpec(provider="ds2", model="tiny", seq=16, batches=[2], device="cpu", checkpointing="off", kernels="none")
    provider = get_provider("ds2")(spec)
    model = build_model(provider.config, "cpu", torch.float32, fill="tiled")
    provider.prepare(model)
    assert not model.model.layers[0].gradient_checkpointing and provider.kernels.startswith("none")


def test_liger_is_preferred_when_it_imports(monkeypatch):
    calls = []
    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    model = build_model(load_config("tiny"), "cpu", torch.float32, fill="tiled")
    assert recipe.is_liger_available()
    text = recipe.apply_kernels(model, "auto")
    assert text.startswith("liger") and "apply_liger_kernel_to_llama" in text
    assert calls == [dict(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                          fused_linear_cross_entropy=True, model=model)]


def test_gemma3_takes_ligers_geglu_patch(monkeypatch):
    """Gemma 3's Liger patch is asked for its GeGLU (its keyword), not a SwiGLU it does not have."""
    from helpers import family_config
    from transformers import AutoModelForCausalLM

    calls = []
    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_gemma3_text = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    model = AutoModelForCausalLM.from_config(family_config("gemma3_text"))
    text = recipe.apply_kernels(model, "auto")
    assert "apply_liger_kernel_to_gemma3_text(rope, geglu, rms_norm" in text
    assert calls == [dict(rope=True, geglu=True, rms_norm=True, cross_entropy=False,
                          fused_linear_cross_entropy=True, model=model)]


def test_a_family_neither_patches_runs_plain_and_says_so(monkeypatch):
    """gpt-oss without Liger: triton_ops has no entry for it, so "auto" leaves HF's
    layers and loss and the row says why; asking for triton_ops raises."""
    from helpers import family_config
    from transformers import AutoModelForCausalLM

    _no_liger(monkeypatch)
    model = AutoModelForCausalLM.from_config(family_config("gpt_oss"))
    text = recipe.apply_kernels(model, "auto")
    assert text.startswith("none") and "triton_ops does not patch 'gpt_oss'" in text
    with pytest.raises(ValueError, match="gpt_oss"):
        recipe.apply_kernels(model, "triton_ops")


def test_auto_falls_back_to_triton_ops_when_ligers_patch_fails(monkeypatch):
    fake = types.ModuleType("liger_kernel.transformers")

    def broken(**kw):
        raise TypeError("unexpected keyword argument")
    fake.apply_liger_kernel_to_llama = broken
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    model = build_model(load_config("tiny"), "cpu", torch.float32, fill="tiled")
    with pytest.raises(TypeError):
        recipe.apply_kernels(model, "liger")
    text = recipe.apply_kernels(model, "auto")
    assert text.startswith("triton_ops.patch") and "apply_liger_kernel_to_llama failed: TypeError" in text


def test_kernel_choices(monkeypatch):
    _no_liger(monkeypatch)
    model = build_model(load_config("tiny"), "cpu", torch.float32, fill="tiled")
    with pytest.raises(ValueError):
        recipe.apply_kernels(model, "fastest")
    if not recipe.is_liger_available():
        monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails: the row says skipped
        with pytest.raises(ImportError):
            recipe.apply_kernels(model, "liger")
    assert recipe.apply_kernels(model, "triton_ops") == "triton_ops.patch(rms_norm, rope, swiglu, linear_cross_entropy)"
    assert set(recipe.LIGER_PATCHES) >= {"llama", "qwen2"}


def test_hf_provider_defaults_to_its_users_configuration(monkeypatch):
    _no_liger(monkeypatch)
    cls = get_provider("hf")
    assert (cls.default_checkpointing, cls.default_kernels) == ("on", "auto")
    assert get_provider("resident").default_checkpointing == "auto"
    provider = cls(RunSpec(provider="hf", model="tiny", seq=16, batches=[2], device="cpu", dtype="float32",
                           checkpointing="on", kernels="auto"))
    provider.setup()
    assert provider.model.model.layers[0].gradient_checkpointing and provider.report()["gradient_checkpointing"]
    ids = torch.randint(0, provider.config.vocab_size, (2, 16))
    assert torch.isfinite(provider.train_step(ids, ids))


def _fake_run(fits: int, fail_at: int | None = None, status: str = "error"):
    tried = []

    def run(batch, seconds):
        assert seconds > 0
        tried.append(batch)
        if fail_at is not None and batch == fail_at:
            return {"status": status, "error": "boom"}
        if batch > fits:
            return {"status": "oom", "error": "out of memory at every batch of [b]", "processes": 1}
        return {"status": "ok", "batch": batch, "step_s": 0.5 + 0.05 * batch, "processes": 1}
    return run, tried


def test_batch_search_goes_up_until_the_first_oom():
    run, tried = _fake_run(fits=8)
    row = search_batches(run, [16, 4, 8, 32], seq=2048, timeout=60)
    assert tried == [4, 8, 16]  # 32 is never tried: 16 ran out of memory
    assert row["batch"] == 8 and row["oom_batches"] == [16] and row["processes"] == 3
    assert [(a["batch"], a["status"]) for a in row["search"]] == [(4, "ok"), (8, "ok"), (16, "oom")]
    assert row["search"][1]["tokens_per_s"] == pytest.approx(8 * 2048 / 0.9)


def test_batch_search_halves_down_when_the_first_batch_does_not_fit():
    run, tried = _fake_run(fits=1)
    row = search_batches(run, [4, 8], seq=128, timeout=60)
    assert tried == [4, 2, 1] and row["status"] == "ok" and row["batch"] == 1
    run, tried = _fake_run(fits=0)
    row = search_batches(run, [2, 4], seq=128, timeout=60)
    assert tried == [2, 1] and row["status"] == "oom" and row["oom_batches"] == [2, 1]


def test_batch_search_counts_an_error_after_an_oom_as_out_of_memory():
    """DeepSpeed's state can break in the OOM's cleanup: the row is an error, its oom_batches say why."""
    def run(batch, seconds):
        if batch > 2:
            return {"status": "error", "error": "after OOM: parameter already reduced", "oom_batches": [batch]}
        return {"status": "ok", "batch": batch, "step_s": 1.0}

    row = search_batches(run, [4, 8], seq=128, timeout=60)
    assert [a["batch"] for a in row["search"]] == [4, 2] and row["batch"] == 2 and row["oom_batches"] == [4]


def test_batch_search_stops_at_an_error_and_keeps_the_best_so_far():
    run, tried = _fake_run(fits=64, fail_at=16, status="timeout")
    row = search_batches(run, [4, 8, 16, 32], seq=128, timeout=60)
    assert tried == [4, 8, 16] and row["batch"] == 8 and row["search"][-1]["status"] == "timeout"
    run, tried = _fake_run(fits=64, fail_at=4, status="skipped")
    row = search_batches(run, [4, 8], seq=128, timeout=60)
    assert tried == [4] and row["status"] == "skipped"
    with pytest.raises(ValueError):
        search_order([0, 4])


def test_batch_search_does_not_start_a_batch_it_has_no_time_for(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("benchmarks.batch_search.time.monotonic", lambda: clock[0])

    def run(batch, seconds):
        clock[0] += 40.0  # each process takes 40 s
        return {"status": "ok", "batch": batch, "step_s": 1.0}

    row = search_batches(run, [1, 2, 4, 8], seq=16, timeout=100)
    assert [(a["batch"], a["status"]) for a in row["search"]] == [(1, "ok"), (2, "ok"), (4, "not run")]
    assert row["batch"] == 2 and row["processes"] == 2


def test_parent_searches_each_provider_in_fresh_processes(monkeypatch, tmp_path):
    seen = []

    def fake_run_provider(name, spec, timeout):
        seen.append((name, spec.batches, spec.checkpointing, spec.kernels))
        if spec.batches[0] > 2:
            return {"provider": name, "status": "oom", "oom_batches": spec.batches, "processes": 1}
        return {"provider": name, "status": "ok", "batch": spec.batches[0], "step_s": 1.0, "processes": 1,
                "capped": True}

    monkeypatch.setattr(bench_train, "run_provider", fake_run_provider)
    out = tmp_path / "s.json"
    bench_train.main(["--device", "cpu", "--model", "tiny", "--providers", "ds2,hf", "--search-batches", "1,2,4,8",
                      "--no-probe", "--json", str(out)])
    assert seen == [("ds2", [1], "on", "auto"), ("ds2", [2], "on", "auto"), ("ds2", [4], "on", "auto"),
                    ("hf", [1], "on", "auto"), ("hf", [2], "on", "auto"), ("hf", [4], "on", "auto")]
    import json
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["results"]] == [2, 2] and doc["search_batches"] == "1,2,4,8"
