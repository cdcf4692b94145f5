"""The training benchmark harness: its helpers, and one real CPU run of `bench_train.py`."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_train  # noqa: E402
from benchmarks.harness import (emit, flops_per_token, format_table, is_cuda_oom, linear_params,  # noqa: E402
                                parse_line, peak_tflops)
from benchmarks.providers import PROVIDERS, RunSpec, get_provider  # noqa: E402
from benchmarks.providers.base import attention_of, build_model, call_with_known_fields, load_config  # noqa: E402


@pytest.mark.parametrize("name, n_params", [("tiny", 90_432), ("llama3-3b", 3_212_749_824),
                                            ("llama3-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512),
                                            ("gpt-oss-20b", 20_914_757_184)])
def test_shape_configs_have_the_real_parameter_counts(name, n_params):
    from transformers import AutoModelForCausalLM

    config = load_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert config.use_cache is False


@pytest.mark.parametrize("name, attention", [("llama3-8b", "sdpa"), ("gemma3-4b", "sdpa"),
                                             ("gpt-oss-20b", "flex_attention")])
def test_a_benchmark_model_runs_sdpa_where_its_family_has_it_else_flex(name, attention):
    """gpt-oss has no sdpa path in HF (its sinks): building it with sdpa raised, and eager attention's
    batch x heads x seq x seq scores do not fit a capped GPU at the benchmark's sequence."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = load_config(name)
    assert attention_of(config) == attention
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_of(config))
    assert model.config._attn_implementation == attention


def test_build_model_keeps_ties_buffers_and_initialises():
    config = load_config("tiny")
    model = build_model(config, "cpu", torch.bfloat16, fill="tiled")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    std = model.model.layers[0].mlp.up_proj.weight.float().std().item()
    assert 0.015 < std < 0.025
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.device.type == "cpu" and torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0
    ids = torch.randint(0, config.vocab_size, (2, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_linear_params_and_flops_formula():
    config = load_config("tiny")
    model = build_model(config, "cpu", torch.float32)
    h, i, v, layers, kv = 64, 128, 256, 2, 2 * 16
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i          # q, o, k, v, gate/up/down
    assert linear_params(model) == layers * per_layer + v * h  # lm_head counted once (tied)
    assert flops_per_token(1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 64 * 128


def test_event_lines_round_trip(capsys):
    emit("step", batch=4, seconds=0.5, loss=torch.tensor(2.0))
    line = capsys.readouterr().out
    assert parse_line(line) == {"event": "step", "batch": 4, "seconds": 0.5, "loss": 2.0}
    assert parse_line("ordinary log output") is None


def test_format_table_prints_missing_values_as_dashes():
    table = format_table([{"a": "x", "b": 1.234}, {"a": "yy", "b": None}], [("a", "A", ""), ("b", "B", ".1f")])
    assert table.splitlines() == ["| A  | B   |", "|----|-----|", "| x  | 1.2 |", "| yy | -   |"]


def test_run_spec_round_trips_and_validates():
    with pytest.raises(ValueError):
        RunSpec(provider="hf", model="tiny", seq=128, batches=[1], kernels="fast")
    spec = RunSpec(provider="hf", model="tiny", seq=128, batches=[4, 2, 1], slide_options={"window": 3})
    assert RunSpec.from_json(spec.to_json()) == spec
    assert all(f.metadata.get("help") for f in dataclasses.fields(RunSpec))
    with pytest.raises(ValueError):
        RunSpec(provider="hf", model="tiny", seq=128, batches=[])
    with pytest.raises(ValueError):
        RunSpec(provider="hf", model="tiny", seq=128, batches=[1], checkpointing="sometimes")


def test_call_with_known_fields_drops_and_notes_unknown_fields():
    @dataclasses.dataclass
    class Config:
        device: str = "cpu"

    notes: list[str] = []
    assert call_with_known_fields(Config, {"device": "cuda", "gpu_memory_limit": 24}, notes) == Config("cuda")
    assert notes == ["Config has no field gpu_memory_limit: not passed"]


def test_step_bound_takes_the_largest_term():
    hardware = {"h2d_gbs": 50.0, "d2h_gbs": 50.0, "adam_params_per_s": 3.5e9}
    resident = {"extra": {"compute_s": 1.0}, "tokens_per_step": 8 * 2048}
    row = {"capped": True, "step_s": 2.0, "n_params": 7e9, "tokens_per_step": 16 * 2048}
    out = bench_train.step_bound(row, resident, hardware)
    assert out["bound_terms"] == pytest.approx({"gpu": 2.0, "pcie": 4 * 7e9 / 50e9, "cpu_adam": 2.0})
    assert out["bound_by"] in ("gpu", "cpu_adam") and out["efficiency"] == pytest.approx(1.0)
    uncapped = bench_train.step_bound({**row, "capped": False}, resident, hardware)
    assert set(uncapped["bound_terms"]) == {"gpu"}
    assert bench_train.step_bound({**row, "capped": False}, None, hardware) == {}
    assert bench_train.step_bound(row, None, hardware)["bound_by"] == "cpu_adam (no gpu term)"
    two = bench_train.step_bound({**row, "nproc": 2, "tokens_per_step": 2 * 16 * 2048,   # 16 per GPU, 2 GPUs
                                  "extra": {"slide_stats_per_step": {"updated_params": 3.5e9}}}, resident, hardware)
    assert two["bound_terms"] == pytest.approx({"gpu": 2.0, "pcie": 4 * 7e9 / 50e9, "cpu_adam": 2.0})


def test_resident_row_from_an_earlier_run(tmp_path):
    shape = {"name": "llama3-3b", "seq": 2048, "layers": 28}
    res = {"provider": "resident", "status": "ok", "extra": {"compute_s": 1.0}, "tokens_per_step": 32768}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"shape": shape, "results": [{"provider": "hf", "status": "ok"}, res]}))
    assert bench_train._resident_row(str(path), shape) == res
    with pytest.raises(SystemExit, match="not this run's"):
        bench_train._resident_row(str(path), {**shape, "seq": 1024})
    path.write_text(json.dumps({"shape": shape, "results": [{"provider": "resident", "status": "oom"}]}))
    with pytest.raises(SystemExit, match="no successful"):
        bench_train._resident_row(str(path), shape)
    doc = {"results": [{"provider": "slide", "capped": True, "step_s": 2.0, "batch": 16, "n_params": 3.2e9}],
           "shape": shape, "device": "cuda", "hardware": {"h2d_gbs": 50.0, "d2h_gbs": 50.0, "adam_params_per_s": 3.5e9}}
    path.write_text(json.dumps({"shape": shape, "results": [res]}))
    args = bench_train.parse_args(["--resident-from", str(path), "--peak-tflops", "989.4"])
    bench_train._finish(doc, args)
    row = doc["results"][0]
    assert row["bound_by"] == "gpu" and row["bound_s"] == pytest.approx(1.0) and row["efficiency"] == pytest.approx(0.5)


def test_small_helpers():
    assert bench_train._halvings(16) == [16, 8, 4, 2, 1] and bench_train._halvings(1) == [1]
    assert peak_tflops("NVIDIA H200") == 989.4 and peak_tflops("mystery card") is None
    assert is_cuda_oom(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert not is_cuda_oom(RuntimeError("shape mismatch"))
    assert set(PROVIDERS) == {"slide", "hf", "ds2", "ds3", "resident", "slide_lora", "hf_lora", "hf_lora_offload",
                              "slide_trainer", "slide_sft", "slide_8bit", "slide_8bit_bf16", "slide_fp8"}
    assert get_provider("hf").name == "hf"


def test_cpu_run_end_to_end(tmp_path):
    """The real harness: worker processes, events, JSON, table; the hf provider must succeed."""
    out = tmp_path / "train.json"
    cmd = [sys.executable, "benchmarks/bench_train.py", "--device", "cpu", "--model", "tiny", "--providers", "slide,hf",
           "--batch", "2", "--steps", "2", "--warmup", "1", "--timeout", "120", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["versions"]["torch"] == torch.__version__
    assert "bench_train.py --device cpu --model tiny" in doc["command"]
    assert doc["shape"] == {"name": "tiny", "model_type": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                            "intermediate": 128, "vocab": 256, "tied_embeddings": True, "seq": 128}
    rows = {r["provider"]: r for r in doc["results"]}
    hf = rows["hf"]
    assert hf["status"] == "ok", hf
    assert hf["batch"] == 2 and hf["tokens_per_step"] == 256 and len(hf["step_times"]) == 2
    assert hf["step_s"] > 0 and hf["tokens_per_s"] == pytest.approx(256 / hf["step_s"])
    assert hf["n_params"] == 90_432 and hf["model_tflops"] > 0 and hf["host_rss_peak"] > 0
    assert hf["gpu_peak_allocated"] is None and hf["capped"] is False
    assert hf["extra"]["gradient_checkpointing"] is True  # as its users run it, by default
    assert hf["extra"]["kernels"].startswith(("liger", "triton_ops.patch"))
    assert rows["slide"]["status"] in ("ok", "skipped", "error")  # the engine is allowed to be unfinished here
    assert rows["slide"]["capped"] is True
    lines = proc.stdout.strip().splitlines()
    assert lines[-4].startswith("| provider") and lines[-2].startswith("| slide") and lines[-1].startswith("| hf")


class _FlakyProvider:
    """Runs out of memory above `fits`; after an OOM, optionally breaks like a half-reduced ZeRO state."""

    fits, break_after_oom = 2, False

    def __init__(self, spec):
        self.spec, self.notes, self.n_params, self.n_linear = spec, [], 10, 8
        self.config = load_config("tiny")
        self.ooms = 0

    def setup(self):
        pass

    def train_step(self, ids, labels):
        if self.break_after_oom and self.ooms:
            raise AssertionError("parameter already reduced")
        if ids.shape[0] > self.fits:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return torch.tensor(1.0)

    def begin_timed(self):
        pass

    def after_oom(self, batch):
        self.ooms += 1
        return False

    def report(self):
        return {"ooms": self.ooms}


def _events(capsys):
    return [parse_line(line) for line in capsys.readouterr().out.splitlines() if parse_line(line)]


def test_worker_steps_down_to_the_batch_that_fits(monkeypatch, capsys):
    monkeypatch.setattr(bench_train, "get_provider", lambda name: _FlakyProvider)
    spec = RunSpec(provider="hf", model="tiny", seq=8, batches=[8, 4, 2, 1], device="cpu", warmup=1, steps=3)
    assert bench_train.run_worker(spec) == 0
    events = _events(capsys)
    assert [e["batch"] for e in events if e["event"] == "oom"] == [8, 4]
    result = events[-1]
    assert result["event"] == "result" and result["status"] == "ok" and result["batch"] == 2
    assert len(result["step_times"]) == 3 and result["extra"] == {"ooms": 2}


def test_worker_asks_for_a_fresh_process_when_an_oom_broke_the_state(monkeypatch, capsys):
    monkeypatch.setattr(_FlakyProvider, "break_after_oom", True)
    monkeypatch.setattr(bench_train, "get_provider", lambda name: _FlakyProvider)
    spec = RunSpec(provider="ds2", model="tiny", seq=8, batches=[8, 4, 2], device="cpu", warmup=1, steps=1)
    assert bench_train.run_worker(spec) == bench_train.RESPAWN_EXIT
    respawn = _events(capsys)[-1]
    assert respawn["event"] == "respawn" and respawn["batches"] == [4, 2]
    assert "already reduced" in respawn["error"]


@pytest.mark.slow
def test_deepspeed_providers_on_deepspeeds_cpu_accelerator(tmp_path):
    """ds2 and ds3 end to end on the tiny shape, through DeepSpeed's CPU accelerator (no GPU needed)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds.json"
    env = {**__import__("os").environ, "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "benchmarks/bench_train.py", "--device", "cpu", "--model", "tiny", "--providers", "ds2,ds3",
           "--batch", "4", "--steps", "2", "--warmup", "1", "--timeout", "500", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["provider"]: r for r in json.loads(out.read_text())["results"]}
    for name, optimizer in (("ds2", "DeepSpeedZeroOptimizer"), ("ds3", "DeepSpeedZeroOptimizer_Stage3")):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["n_params"] == 90_432 and f"optimizer {optimizer}" in rows[name]["notes"]
        assert rows[name]["extra"]["deepspeed_config"]["zero_optimization"]["stage"] == int(name[-1])


def test_step_trace_and_its_summary(tmp_path):
    """SLIDE_TRACE writes a timeline of the timed steps; trace_summary reads it back per step."""
    from benchmarks.trace_summary import summarize
    trace = tmp_path / "trace.json"
    out = subprocess.run([sys.executable, "benchmarks/bench_train.py", "--device", "cpu", "--model", "tiny",
                          "--providers", "slide", "--batch", "2", "--steps", "3", "--warmup", "1", "--no-probe"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "SLIDE_TRACE": str(trace)})
    assert out.returncode == 0, out.stderr[-2000:]
    events = json.loads(trace.read_text())
    labels = {e[1].split(":")[0] for e in events}
    assert {"step", "forward_begin", "backward_begin", "backward_end", "adam", "layer_task"} <= labels
    text = summarize(events)
    assert text.count("step ") == sum(1 for e in events if e[1] == "step") - 1 and "worker.adam" in text


def test_trace_summary_names_the_slow_gpu_spans():
    """A layer's GPU span well above its neighbours' is reported (a stall inside it); the head's
    long span and the change from backward to forward spans are not."""
    from benchmarks.trace_summary import slow_spans
    def spans(durations):
        t, events = 0.0, []
        for d in durations:
            events.append(("gpu", "compute", t, t + d))
            t += d + 0.001
        return events
    steady = [0.066] * 3 + [0.002] + [0.022] * 10 + [0.180] + [0.066] * 8
    (line,) = slow_spans(spans(steady[:9] + [0.044] + steady[9:19] + [0.090] + steady[19:]))
    assert "2 of 25" in line and "(44/22, 90/66 ms)" in line, line
    assert slow_spans(spans(steady)) == []


def test_trace_summary_names_the_copy_a_gap_ended_with():
    """A GPU idle gap lists the copies that ended inside it or within 0.5 ms after it (what the
    GPU may have waited for), not those that ended well before; the step's copy time is per kind."""
    from benchmarks.trace_summary import summarize
    events = [("MainThread", "step", 0.0, 0.0),
              ("gpu", "compute", 0.000, 0.010), ("gpu", "compute", 0.020, 0.030),
              ("copy", "fill:layer.3", 0.004, 0.0202), ("copy", "update:layer.4", 0.001, 0.008),
              ("copy", "input:layer.3", 0.012, 0.014), ("copy", "fill:layer.2", 0.022, 0.029),
              ("MainThread", "step", 0.031, 0.031)]
    text = summarize(events, gaps=2)
    gap = next(line for line in text.splitlines() if "idle   10.0 ms" in line)
    assert "C:fill:layer.3" in gap and "C:input:layer.3" in gap and "update" not in gap, gap
    copies = next(line for line in text.splitlines() if line.strip().startswith("copies"))
    assert "fill 0.023" in copies and "input 0.002" in copies and "update 0.007" in copies, copies


def test_soak_reports_flat_memory_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/soak.py", "--device", "cpu", "--model", "tiny", "--batch", "2",
                          "--seq", "32", "--steps", "30", "--compare-clipping", "6", "--json", str(tmp_path / "s.json")],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["flat"] and result["steps"] == 30 and len(result["rows"]) == 30
    assert result["clipping_median_step_s"] > 0


def test_memory_profile_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/memory_profile.py", "--device", "cpu", "--model", "tiny",
                          "--batch", "2", "--seq", "32", "--steps", "2", "--json", str(tmp_path / "m.json")],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "m.json").read_text())
    assert [r["phase"] for r in result["rows"]] == ["start"] + ["forward", "backward", "optimizer step"] * 2
    assert all(r["host_rss_gib"] > 0 for r in result["rows"])


def test_batch_sweep_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/batch_sweep.py", "--device", "cpu", "--model", "tiny",
                          "--batches", "2,4", "--seq", "32", "--steps", "2", "--warmup", "1",
                          "--json", str(tmp_path / "s.json")], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "s.json").read_text())
    assert [r["batch"] for r in result["rows"]] == [4, 2]
    assert result["smallest_batch_at_90pct"] in (2, 4)


def _offload_hooks(module: torch.nn.Module) -> list:
    """The AlignDevicesHooks with offload on `module` (one hook, or inside a SequentialHook)."""
    hook = getattr(module, "_hf_hook", None)
    return [h for h in getattr(hook, "hooks", [hook]) if getattr(h, "offload", False)]


def test_hf_lora_offload_trains_adapters_through_offload_hooks():
    """hf_lora_offload on the CPU: the last decoder layer's frozen base behind Accelerate's offload hooks,
    loaded at the forward and at the checkpointed recompute; loss and adapter gradients bit-identical to
    hf_lora's on the same weights and adapters, and one step moves the adapters of the offloaded layer."""
    import triton_ops
    from benchmarks.providers.base import random_batch

    spec = RunSpec(provider="hf_lora_offload", model="tiny", seq=32, batches=[2], device="cpu", lora_r=4,
                   checkpointing="on", kernels="auto")
    providers = {}
    try:
        for name in ("hf_lora_offload", "hf_lora"):
            torch.manual_seed(0)                     # PEFT draws lora_A from the global generator
            providers[name] = get_provider(name)(dataclasses.replace(spec, provider=name))
            providers[name].setup()
        offload, resident = providers["hf_lora_offload"], providers["hf_lora"]
        base = offload.model.get_base_model()
        hooked = {n: m for n, m in base.named_modules() if _offload_hooks(m)}
        assert offload.plan.n_offloaded == 1 and sorted(hooked) == sorted(offload.plan.offloaded_modules)
        assert {n.split(".")[2] for n in hooked} == {"1"} and len(hooked) == 7   # layer 1's seven base linears
        assert all(m.weight.device.type == "meta" for m in hooked.values())       # in host memory between forwards
        loads = []
        hook = _offload_hooks(hooked["model.layers.1.mlp.down_proj.base_layer"])[0]
        pre_forward = hook.pre_forward
        hook.pre_forward = lambda *a, **k: loads.append(1) or pre_forward(*a, **k)

        ids, labels = random_batch(256, 2, 32, torch.device("cpu"))
        losses = {}
        for name, provider in providers.items():
            losses[name] = provider.loss(ids, labels)
            losses[name].backward()
        assert len(loads) == 2                       # the forward and the checkpointed recompute
        assert torch.isfinite(losses["hf_lora_offload"]) and torch.equal(*losses.values())
        grads = {n: p.grad for n, p in resident.model.named_parameters() if p.requires_grad}
        for n, p in offload.model.named_parameters():
            if p.requires_grad:
                assert p.device.type == "cpu" and torch.equal(p.grad, grads.pop(n)), n
        assert not grads

        offload.optimizer.zero_grad(set_to_none=True)
        before = {n: p.detach().clone() for n, p in offload.model.named_parameters() if p.requires_grad}
        assert torch.isfinite(offload.train_step(ids, labels)) and offload._grads_checked
        moved = {n for n, p in offload.model.named_parameters() if p.requires_grad and not torch.equal(before[n], p)}
        lora_b = {n for n in before if "lora_B" in n}
        assert lora_b <= moved and any(".layers.1." in n for n in lora_b)   # lora_A's first gradient is 0 (B = 0)
        assert all(m.weight.device.type == "meta" for m in hooked.values())
        report = offload.report()
        assert report["offloaded_layers"] == 1 and report["gpu_layers"] == 1 and report["gradient_checkpointing"]
        layer_bytes = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)               # q o, k v, gate up down; bf16
        assert report["h2d_bytes_per_step"] == 2 * report["offloaded_bytes"] == 2 * layer_bytes
        assert any("1 of 2 decoder layers offloaded" in note for note in offload.notes)
    finally:
        for provider in providers.values():
            triton_ops.unpatch(provider.model.get_base_model())


def test_hf_lora_offload_refuses_to_run_without_checkpointing():
    spec = RunSpec(provider="hf_lora_offload", model="tiny", seq=32, batches=[2], device="cpu", checkpointing="off")
    with pytest.raises(ValueError, match="needs gradient checkpointing"):
        get_provider("hf_lora_offload")(spec).setup()


def test_plan_offload_keeps_what_fits_under_the_cap_on_the_8b_shape():
    """The rule of HFLoraOffloadProvider on Llama-3.1-8B (meta device), r=16, seq 2048, 24 GiB cap."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from accelerate.utils import check_device_map

    from benchmarks.harness import GIB
    from benchmarks.providers.lora import _device_map, _lora, plan_offload

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(load_config("llama3-8b"), dtype=torch.bfloat16)
    _lora(model, 16)
    h, i, kv, layers = 4096, 14336, 1024, 32
    layer_bytes = 2 * (2 * h * h + 2 * h * kv + 3 * h * i)
    assert (plan_offload(model, 24 * GIB, 16, 2048, torch.bfloat16).n_offloaded) == 32   # batch 16: every layer
    plan = plan_offload(model, 24 * GIB, 8, 2048, torch.bfloat16)
    tokens = 8 * 2048
    assert plan.layer_bytes == layer_bytes
    assert plan.reserve_bytes == 2 * layers * tokens * h * 2 + 4 * tokens * i * 2 + 2 * GIB
    assert plan.fixed_bytes + plan.gpu_layers * layer_bytes + plan.reserve_bytes <= 24 * GIB
    assert plan.fixed_bytes + (plan.gpu_layers + 1) * layer_bytes + plan.reserve_bytes > 24 * GIB
    assert (plan.gpu_layers, plan.n_offloaded) == (23, 9)
    assert plan.offloaded_modules[0] == "model.layers.23.self_attn.q_proj.base_layer"
    assert len(plan.offloaded_modules) == 9 * 7 and plan.h2d_bytes_per_step == 2 * 9 * layer_bytes
    gpu = torch.device("cuda", 0)
    device_map = _device_map(model, set(plan.offloaded_modules), gpu)
    check_device_map(model, device_map)                  # every weight placed, as dispatch_model requires
    assert device_map["model.layers.22"] == device_map["model.embed_tokens"] == device_map["lm_head"] == gpu
    assert device_map["model.layers.23.mlp.up_proj.base_layer"] == "cpu"
    assert device_map["model.layers.23.mlp.up_proj.lora_A"] == device_map["model.layers.23.input_layernorm"] == gpu
    assert plan_offload(model, 4 * GIB, 16, 2048, torch.bfloat16).gpu_layers == 0
    assert plan_offload(model, None, 16, 2048, torch.bfloat16).gpu_layers == 16       # a CPU run: half


def test_disk_bandwidth_measures_dd_and_the_backend(tmp_path, capsys):
    """benchmarks/disk_bandwidth.py: both methods write and read a file, report GB/s, and leave no
    file behind; the last line names the better of each."""
    from benchmarks import disk_bandwidth

    out = tmp_path / "bw.json"
    assert disk_bandwidth.main(["--dir", str(tmp_path / "d"), "--size-gib", "0.03", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    back = doc["rows"]["backend"]
    assert back["backend"] == "plain" and back["write_gbs"] > 0 and back["read_gbs"] > 0
    dd = doc["rows"]["dd (O_DIRECT)"]
    assert dd is None or "error" in dd or (dd["write_gbs"] > 0 and dd["read_gbs"] > 0)
    assert doc["best"]["read_gbs"] >= back["read_gbs"] and os.listdir(tmp_path / "d") == []
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("best: write ")


# ---------------------------------------------------------------------------------------------
# several processes of one host: --nproc and the `multi` scenario
# ---------------------------------------------------------------------------------------------
def test_multi_scenario_plans_one_and_two_process_rows(tmp_path):
    from benchmarks.scenarios import SCENARIOS, Settings

    steps = SCENARIOS["multi"](Settings(workdir=tmp_path))
    assert [s.name for s in steps] == ["8b_b16_cap24", "8b_b16_cap24_np2", "8b_ds3_np2_search"]
    assert sum(s.timeout for s in steps) <= 570
    flag = lambda s, name: s.argv[s.argv.index(name) + 1] if name in s.argv else None  # noqa: E731
    assert [flag(s, "--nproc") for s in steps] == [None, "2", "2"]
    assert [s.project for s in steps] == [True, False, False]        # older trees have no --nproc
    assert all(flag(s, "--model") == "llama3-8b" and flag(s, "--cap-gib") == "24" for s in steps)
    assert all(flag(s, "--steps") == "2" and flag(s, "--warmup") == "1" for s in steps)
    assert [flag(s, "--offload-batches") for s in steps[:2]] == ["16", "16"]
    assert flag(steps[2], "--providers") == "ds3" and flag(steps[2], "--search-batches") == "16"


def test_run_spec_refuses_no_processes():
    with pytest.raises(ValueError, match="nproc"):
        RunSpec(provider="slide", model="tiny", seq=8, batches=[1], nproc=0)
    assert RunSpec.from_json(RunSpec(provider="slide", model="tiny", seq=8, batches=[1], nproc=2).to_json()).nproc == 2


def test_nproc_refuses_a_single_process_provider_in_its_row(tmp_path):
    """hf trains in one process only: `--nproc 2` gives a skipped row that names --nproc, at once."""
    out = tmp_path / "hf.json"
    cmd = [sys.executable, "benchmarks/bench_train.py", "--device", "cpu", "--model", "tiny", "--providers", "hf",
           "--nproc", "2", "--batch", "2", "--seq", "32", "--no-probe", "--timeout", "60", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["results"][0]
    assert row["status"] == "skipped" and row["nproc"] == 2 and row["processes"] == 0
    assert "--nproc 2" in row["error"] and "slide" in row["error"], row["error"]
    assert proc.stdout.strip().splitlines()[-1].startswith("| hf ")


_FAKE_RANK = """\
import json, os, sys, time
rank = int(os.environ["RANK"])
print("log line of rank", rank, flush=True)
if os.environ.get("FAIL_RANK") == str(rank):
    print("@@bench " + json.dumps({"event": "result", "status": "error", "error": "boom"}), flush=True)
    sys.exit(1)
time.sleep(120)
"""


def test_launch_group_ends_every_rank_when_one_fails_or_time_is_up(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_FAKE_RANK)
    envs = [{"RANK": str(r), "FAIL_RANK": "1"} for r in range(2)]
    t0 = time.monotonic()
    runs, timed_out = bench_train._launch_group([], "fake", 100, envs, script=str(script))
    assert time.monotonic() - t0 < 30 and not timed_out    # rank 0 would wait 120 s in a collective
    assert runs[1].code == 1 and runs[1].result()["error"] == "boom" and not runs[1].killed
    assert runs[0].killed and runs[0].code is None and runs[0].tail == ["log line of rank 0"]
    t0 = time.monotonic()
    runs, timed_out = bench_train._launch_group([], "fake", 2, [{"RANK": str(r)} for r in range(2)],
                                                script=str(script))
    assert timed_out and all(run.killed for run in runs) and time.monotonic() - t0 < 30


def test_run_provider_with_several_processes_reports_the_failing_rank(monkeypatch):
    """Rank 1 ran out of memory while rank 0 waited: the row says so, and a fresh group tries the next batch."""
    launches = []

    def fake_group(args, name, timeout, envs, script=None):
        spec = RunSpec.from_json(args[args.index("--worker-spec") + 1])
        launches.append((spec.batches, [e["RANK"] for e in envs], {e["MASTER_PORT"] for e in envs}))
        assert all(e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "2" and e["LOCAL_RANK"] == e["RANK"] for e in envs)
        assert all(e.get("DS_SKIP_CUDA_CHECK") == ("1" if name == "ds3" else None) for e in envs)
        batch = spec.batches[0]
        if batch > 4:
            oom = [{"event": "oom", "batch": batch, "error": "CUDA out of memory"},
                   {"event": "result", "status": "oom", "batch": batch, "error": "out of memory at batch 8"}]
            return [bench_train.RankRun([], None, [], killed=True), bench_train.RankRun(oom, 1, [])], False
        ok = {"event": "result", "status": "ok", "batch": batch, "step_s": 1.0, "step_times": [1.0]}
        return [bench_train.RankRun([ok], 0, []), bench_train.RankRun([{**ok, "step_s": 9.0}], 0, [])], False

    monkeypatch.setattr(bench_train, "_launch_group", fake_group)
    spec = RunSpec(provider="slide", model="tiny", seq=8, batches=[8, 4], device="cpu", nproc=2)
    row = bench_train.run_provider("slide", spec, 100)
    assert [(b, ranks) for b, ranks, _ in launches] == [([8, 4], ["0", "1"]), ([4], ["0", "1"])]
    assert all(len(ports) == 1 for _, _, ports in launches)           # one group: one master port
    assert row["status"] == "ok" and row["batch"] == 4 and row["step_s"] == 1.0   # rank 0's figures
    assert row["oom_batches"] == [8] and row["processes"] == 4 and row["nproc"] == 2 and "error" not in row
    assert row["notes"] == ["fresh processes after out of memory at batch 8"]
    launches.clear()
    row = bench_train.run_provider("ds3", dataclasses.replace(spec, provider="ds3", batches=[8]), 100)
    assert row["status"] == "oom" and row["error"].startswith("rank 1: out of memory at batch 8")
    assert [b for b, _, _ in launches] == [[8]]                         # no smaller batch: no fresh group


def test_multi_scenario_runs_at_smoke_scale(tmp_path):
    """`python -m benchmarks.suite multi --smoke`: slide with one process, then two over gloo (each rank its
    own data, the engine's data parallelism), then ZeRO-3 with two (skipped where DeepSpeed is missing)."""
    import importlib.util

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite", "multi", "--smoke", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    doc = json.loads((out / "multi.json").read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    one, two = (steps[n]["doc"]["results"][0] for n in ("8b_b16_cap24", "8b_b16_cap24_np2"))
    assert one["status"] == "ok" and two["status"] == "ok", (proc.stdout[-2000:], proc.stderr[-3000:])
    seq = steps["8b_b16_cap24_np2"]["doc"]["shape"]["seq"]
    assert one["nproc"] == 1 and two["nproc"] == 2 and two["processes"] == 2 and two["batch"] == 2
    assert two["tokens_per_step"] == 2 * seq * 2 and two["tokens_per_s"] == pytest.approx(2 * seq * 2 / two["step_s"])
    assert two["extra"]["data_parallel"] == {"rank": 0, "world": 2} and one["extra"]["data_parallel"] is None
    for row in (one, two):
        assert row["host_rss_peak"] > 0 and row["host_used_peak"] >= row["host_used_end"] > 0
        assert row["host_used_peak_gib"] == pytest.approx(row["host_used_peak"] / 2 ** 30)
    ds3 = steps["8b_ds3_np2_search"]["rows"][0]
    if importlib.util.find_spec("deepspeed") is None:
        assert ds3["status"] == "skipped" and "deepspeed" in ds3["note"]
    table = proc.stdout.strip().splitlines()
    assert table[-5].startswith("| step") and "host used GiB" in table[-5] and "procs" in table[-5]
    assert table[-2].startswith("| 8b_b16_cap24_np2 ")


def test_row_summary_prints_the_timed_steps_breakdown(tmp_path, capsys):
    """row_summary reads bench_train's JSON: per timed step, from slide_stats_per_step."""
    from benchmarks.row_summary import main as summary

    doc = {"results": [
        {"provider": "slide", "status": "ok", "batch": 16, "step_s": 3.4, "tokens_per_s": 9637.6,
         "gpu_alloc_retries": 21, "host_rss_end": 105.7 * 2 ** 30,
         "extra": {"slide_stats_per_step": {"gpu_compute_s": 3.19, "cpu_adam_s": 2.324, "worker_busy_s": 3.04,
                                            "worker_wait_s": 0.73, "wait_grad_buffer_s": 0.758,
                                            "wait_update_s": 0.063, "resident_layers": 0}}},
        {"provider": "ds2", "status": "oom"}]}
    (tmp_path / "row.json").write_text(json.dumps(doc))
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "trace.json").write_text("[]")         # a step trace (SLIDE_TRACE), not a row
    assert summary([str(tmp_path / "row.json"), str(tmp_path / "bad.json"), str(tmp_path / "trace.json")]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "row slide b16: 9,638 tok/s, step 3.400 s | per step: gpu 3.19, adam 2.32, busy 3.04, wait 0.73, buf 0.76, "
        "upd 0.06 | retries 21 | RSS 105.7 GiB",
        "row ds2: oom"]
    assert "bad.json: unreadable" in out.err and "trace.json: not a bench_train.py --json file" in out.err


def test_host_adam_rate_with_a_busy_core(tmp_path, capsys):
    """host_adam_rate times every route and the triad, here beside one busy process it ends after."""
    from benchmarks.host_adam_rate import main as rate
    from hf_slideformer.host import host_adam

    if host_adam._compiler() is None:
        pytest.skip("no C compiler: the native route cannot be timed")
    out = tmp_path / "adam.json"
    threads = torch.get_num_threads()
    assert rate(["--params", "65536", "--threads", "1", "--repeat", "1", "--busy", "1", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads           # the process's threads are left as they were
    doc = json.loads(out.read_text())
    assert doc["busy"] == 1 and doc["params"] == 65536 and doc["triad_gb_s"] > 0
    assert {"torch fused, fp32 grad", "native, bf16 grad"} <= set(doc["rows"])
    assert all(r["params_per_s"] > 0 for r in doc["rows"].values())
    assert "1 other busy processes" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["slide_trainer", "slide_sft"])
def test_trainer_providers_take_the_slide_providers_step(name):
    """slide_trainer (SlideTrainer) and slide_sft (TRL's SFTTrainer) on the CPU: the same loss and the
    same weights after two steps as the slide provider's own loop, in fp32 (TRL's per-token head
    sums the tokens in another order: 1e-5)."""
    if name == "slide_sft":
        pytest.importorskip("trl")
    from benchmarks.providers.base import random_batch

    spec = RunSpec(provider="slide", model="tiny", seq=32, batches=[2], device="cpu", dtype="float32", lr=1e-3)
    providers = {}
    for provider in ("slide", name):
        providers[provider] = get_provider(provider)(dataclasses.replace(spec, provider=provider))
        providers[provider].setup()
    for step in range(2):
        ids, labels = random_batch(256, 2, 32, torch.device("cpu"), seed=step)
        losses = [p.train_step(ids, labels) for p in providers.values()]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    # state_dict() waits for the last step's updates, which overlap what follows optimizer.step().
    ours, theirs = (p.model.state_dict() for p in providers.values())
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(theirs[key], ours[key], rtol=0, atol=1e-5)


def test_fp8_table_sets_each_fp8_row_beside_bf16_and_its_target():
    import importlib
    table = importlib.import_module("benchmarks.experiments.fp8_table")
    doc = {"shape": {"name": "llama3-8b"}, "cap_gib": 12.0, "results": [
        {"provider": "slide_fp8", "status": "ok", "tokens_per_s": 12500.0, "step_s": 2.62, "gpu_peak_reserved_gib": 11.2,
         "n_params": 8.03e9, "tokens_per_step": 32768,
         "gpu_alloc_retries": 0, "extra": {"slide_stats_per_step": {"gpu_compute_s": 2.01}}},
        {"provider": "slide", "status": "ok", "tokens_per_s": 10000.0, "step_s": 3.28, "extra": {}}]}
    fp8_line = next(line for line in table.lines(doc) if "slide_fp8" in line)
    assert "12,500" in fp8_line and "1.25x" in fp8_line and "target 12,000: met" in fp8_line and "2.010" in fp8_line
    assert "| 785 |" in fp8_line                          # 6 x 8.03e9 x 32,768 / 2.01 s
    doc["results"][0].update(status="timeout", error="wall-time limit")
    assert "timeout" in next(line for line in table.lines(doc) if "slide_fp8" in line)


def test_step_kernels_counts_each_layers_projection_gemms_and_the_head():
    import importlib
    from transformers import AutoModelForCausalLM

    from hf_slideformer.demo import tiny_config
    kernels = importlib.import_module("benchmarks.experiments.step_kernels")
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=96, num_hidden_layers=3))
    hidden, inter, kv = 64, 128, 32                       # tiny_config: 4 heads, 2 kv heads of 16
    n = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    flops = kernels.gemm_flops(model, tokens=10)
    # forward 2N, recompute 2(N - down) (the output-free down projection), backward 4N
    assert flops["layers"] == 3 * 10 * (2 * n + 2 * (n - hidden * inter) + 4 * n)
    assert flops["head"] == 6 * 10 * hidden * 96 and flops["total"] == flops["layers"] + flops["head"]
    assert kernels.kind_of("nvjet_qqtst_128x256_64x4_2x1_v_bz_TNT") == "gemm"
    assert kernels.kind_of("_fp8_quantize_rows_kernel") == "triton"
    assert kernels.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"


def test_lora_rows_take_the_experts_weights_of_a_mixture_of_experts(tmp_path):
    """slide_lora and hf_lora on a tiny Qwen3-MoE shape: LoRA on the attention and on the experts'
    3-D weights (PEFT's target_parameters), the same adapters both ways, and a step of each trains
    them (the engine's on the CPU, the frozen base streamed)."""
    import hf_slideformer as hs
    from benchmarks.providers.base import random_batch
    from benchmarks.providers.lora import lora_config
    from helpers import family_config

    family_config("qwen3_moe", num_hidden_layers=2).to_json_file(tmp_path / "config.json")
    spec = RunSpec(provider="hf_lora", model=str(tmp_path / "config.json"), seq=16, batches=[2], device="cpu",
                   dtype="float32", lora_r=4, checkpointing="on", kernels="none")
    ids, labels = random_batch(97, 2, 16, torch.device("cpu"))
    lora = lora_config(build_model(load_config(spec.model), "cpu", torch.float32, fill="tiled"), 4)
    assert lora.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapters = {}
    for name in ("hf_lora", "slide_lora"):
        provider = get_provider(name)(dataclasses.replace(spec, provider=name))
        provider.setup()
        model = provider.model
        adapters[name] = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        assert any("experts" in n for n in adapters[name]) and any("experts" in note for note in provider.notes)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "lora_B" in n}
        assert torch.isfinite(provider.train_step(ids, labels))
        if hs.is_slid(model):
            model.slide_engine.synchronize()
        after = dict(model.named_parameters())
        assert all(not torch.equal(before[n], after[n].detach()) for n in before)
    assert adapters["hf_lora"] == adapters["slide_lora"]


def test_code_metrics_counts_one_letter_bindings_outside_comprehensions_and_lambdas():
    import ast

    from benchmarks.code_metrics import one_letter_names
    tree = ast.parse("u = 1\n"
                     "def f(e, unit):\n"
                     "    for k in range(3):\n"
                     "        pass\n"
                     "    return [x for x in unit], (lambda n: n), {y: 1 for y in unit}\n"
                     "_ = 2\n")
    assert sorted(name for _, name in one_letter_names(tree)) == ["e", "k", "u"]


_VARIANT_STATE = r"""
import hashlib, sys, torch
from pathlib import Path
sys.path[:0] = [{repo!r}]
import hf_slideformer.host.host_adam as host_adam
host_adam._SOURCE = Path({src!r}) / "host_adam.c"
from hf_slideformer.host.host_optim import state_format
from hf_slideformer.host.host_rate import rate_unit
fmt, n = state_format({fmt!r}), 1000
unit, native = rate_unit(fmt, n), host_adam.HostAdam("native", 2)
hp = {{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}}
gen = torch.Generator().manual_seed(0)
for s in range(3):
    grad = (torch.rand(n, generator=gen) - 0.5).bfloat16()
    fmt.run(native, hp, unit, unit, [(0, 0, n)], [grad], [torch.tensor(float(s + 1))], None)
arrays = [unit.master] + [getattr(unit, a.name) for a in fmt.arrays]
print(hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in arrays)).hexdigest())
"""


def test_the_host_update_probes_variants_apply_and_give_the_kernels_values(tmp_path):
    """adam8_variants_probe.py's variants are other forms of the same update: built from today's
    source, each leaves the master, the 8-bit moments and their scales bit for bit as the kernel
    as it is does (three steps of 1,000 elements, a partial last block). adam8_parts_probe.py's
    substitutions still apply to the source."""
    import importlib
    import shutil

    from hf_slideformer.host.host_adam import NativeKernelError, native_library
    try:
        native_library()
    except NativeKernelError as e:
        pytest.skip(f"no native host kernel: {e}")
    variants = importlib.import_module("benchmarks.experiments.adam8_variants_probe")
    parts = importlib.import_module("benchmarks.experiments.adam8_parts_probe")
    source = (variants.CSRC / "host_adam8.c").read_text()
    assert all(old in source for old, _ in parts.TWICE.values())
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))

    def state(src, fmt):
        code = _VARIANT_STATE.format(repo=repo, src=str(src), fmt=fmt)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()[-1]

    as_is = tmp_path / "as_is"
    shutil.copytree(variants.CSRC, as_is)
    for fmt in ("adamw_8bit_bf16", "adamw_8bit"):
        expected = state(as_is, fmt)
        for name in variants.VARIANTS:
            assert state(variants.variant(tmp_path / fmt, name), fmt) == expected, f"{name} changes {fmt}'s values"
