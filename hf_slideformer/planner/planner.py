"""Planner: will a model fit, with which batch, and how fast, from its config.json alone.

`plan` reads top to bottom as its stages: the settings (`plan_settings.PlanSettings`: the
engine's from SlideConfig's table, the machine's, checked once), the formulas for them, the batch
and the layers on disk, the memory at that batch, the resident units as the engine decides them,
the step time, and the advice. The model's shape, the calibrated constants and the formulas are in
`plan_estimate`; the `Plan` and its text in `plan_report`, its advice in `plan_advice`; a LoRA run's formulas and
advice in `plan_lora`. Every name the planner offered before stays importable from here.
Nothing here touches a GPU or builds a model: the parameter counts come from the config's sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .budget import balanced_share, plan_resident, resident_bytes_per_param
from ..config import ACTIVATION_TIERS
from ..disk.disk_plan import DiskSplit, split_layers
from ..host.host_optim import state_format
from ..host.memory import GiB
from .plan_estimate import (  # noqa: F401 - ADAM_GPS: the calibration, importable from the planner as well
    ADAM_GPS, DEVICE_UPDATE_LINK, ENGINE_EFFICIENCY, FORWARD_SHARE, GPU_CONTEXT_BYTES, GPU_EFFICIENCY, GPU_USABLE, PEAK_TFLOPS,
    RESERVED_VS_ALLOCATED, Estimator, ModelShape, batch_limit, load_model_config, model_shape,
)
from .plan_estimate import (  # noqa: F401 - the rest of the calibration, importable from the planner as well
    ACT_HIDDEN, ACT_INTER, ADD_VS_ADAM, DUPLEX, GRAD_BYTES, NVME_BUFFERS, PROCESS_HOST_BYTES,
)
from .plan_lora import FROZEN_BASE_BYTES, PEAK_FP32_TFLOPS, PEAK_HBM_GBS, LoraEstimator, advise_lora
from .plan_lora_targets import DEFAULT_TARGET_MODULES, DEFAULT_TARGET_PARAMETERS
from .plan_advice import advise
from .plan_report import Plan
from .plan_settings import DEFAULT_SEQ, PlanSettings, engine_default  # noqa: F401 - DEFAULT_SEQ: importable here
from ..engine.resident_state import resident_bytes_per_param_of

__all__ = ["ModelShape", "Plan", "load_model_config", "model_shape", "plan"]

TIERS = ACTIVATION_TIERS    # what activation_tier accepts (SlideConfig's; 'auto' plans 'cpu')
# A batch the plan chooses holds at most this many tokens: where nothing makes the GPU the bound
# (a tiny model), a larger batch only grows the step, and no one trains on more per micro-batch.
MAX_CHOSEN_TOKENS = 1 << 20


def plan(config_or_path, *, batch: int | None = None, seq: int | None = None, gpu_mem: float | None = None,
         host_mem: float | None = None, pcie_gbs: float = 54.6, adam_gps: float | str | None = None,
         gpu_tflops: float = PEAK_TFLOPS, gpu_efficiency: float = GPU_EFFICIENCY,
         gradient_accumulation_steps: int = engine_default("gradient_accumulation_steps"),
         max_grad_norm: float | None = engine_default("max_grad_norm"), window: int = engine_default("window"),
         activation_tier: str = engine_default("activation_tier"), grad_buffers: int = engine_default("grad_buffers"),
         nvme_write_gbs: float = 1.2, nvme_read_gbs: float = 0.9, resident: bool = True, nvme_gb: float | None = None,
         nvme_bw: float = 7.0, lora_r: int | None = None, lora_base_bytes: int = FROZEN_BASE_BYTES,
         lora_modules_to_save: tuple[str, ...] = (), mlp_chunk_tokens: int | None = engine_default("mlp_chunk_tokens"),
         gpu_hbm_gbs: float = PEAK_HBM_GBS, gpu_fp32_tflops: float = PEAK_FP32_TFLOPS, gpus: int = 1,
         optim: str = engine_default("optim"), fp8: bool = False,
         device_update_share: float | str = engine_default("device_update_share"),
         lora_target_modules: str | tuple[str, ...] | None = DEFAULT_TARGET_MODULES,
         lora_target_parameters: tuple[str, ...] | None = DEFAULT_TARGET_PARAMETERS) -> Plan:
    """Estimate host and GPU memory, the largest batch and the step time of training a model.

    The stages, in order: the settings (`PlanSettings`), the formulas for them (`_estimator`),
    the batch and the layers on disk (`_size_batch`), the memory at that batch (`_memory`), the
    resident units (`_resident_units`), the step time (`_step_time`), the advice.

    Args:
        config_or_path: a model directory holding config.json, a config.json path, a dict or an HF config.
        batch: sequences per micro-batch (default: the smallest power of two whose GPU compute
            hides AdamW and the transfers, or the largest that fits when none does).
        seq: tokens per sequence (default: 2048, or the model's max_position_embeddings when shorter).
        gpu_mem: GPU memory in GiB (default: the current CUDA device's, else 24).
        host_mem: host memory in GiB (default: this machine's MemAvailable).
        pcie_gbs: pinned host<->device bandwidth, GB/s each way (H200 machine: 54.6).
        adam_gps: the host AdamW's rate alone, G parameters/s, or "host" to measure this machine's
            (`host_rate.measure_rate`, about a second and 1 GiB). Default: ADAM_GPS (the H200 machine's).
        gpu_tflops, gpu_efficiency: the GPU's dense bf16 peak (H100 / H200 SXM: 989.4), its achieved share (0.61).
        gradient_accumulation_steps, max_grad_norm, window, activation_tier, grad_buffers,
            mlp_chunk_tokens: SlideConfig's settings, with its defaults and checks ("auto" plans
            the CUDA device's tier, "cpu").
        optim: SlideConfig.optimizer_state, or one of the Trainer's AdamW names (adamw_8bit,
            adamw_bnb_8bit, ...): the host bytes per parameter and the records on disk follow the
            format (host_optim.py, disk_record.py); a compact format keeps no resident layers.
        fp8: SlideConfig.matmuls='fp8': the layers' projection GEMMs at `FP8_GEMM_SPEEDUP` the bf16 rate.
        device_update_share: SlideConfig's; without clipping and with one micro-batch a number takes
            that share of the streamed layers' updates off the CPU's term and puts their state on
            the link, both ways (with clipping the plan takes the balanced share, as 'auto').
        nvme_write_gbs, nvme_read_gbs: disk rates of the "nvme" activation tier, GB/s.
        nvme_gb: free space of a disk for the layers' state, GB: what does not fit in host memory
            goes there, the moments of the last layers first, then their whole state
            (SlideConfig.host_memory_limit with nvme_path; the plan gives the limit). None: no disk.
        nvme_bw: the rate that disk reads and writes the state at, GB/s (2rw / (r + w) for read
            rate r and write rate w, as `benchmarks/disk_bandwidth.py` prints).
        resident: model the engine's resident units (SlideConfig.resident_embedding / resident_layers
            "auto", from the allocated peak times RESERVED_VS_ALLOCATED; none with accumulation or GPUs > 1).
        lora_r: plan a PEFT LoRA run (lora.py) of this rank on `lora_target_modules` and
            `lora_target_parameters`: the base frozen and streamed, the adapters on the GPU. None:
            full fine-tuning.
        lora_target_modules, lora_target_parameters: PEFT's `target_modules` (names, a regex, or
            "all-linear") and `target_parameters` (names of 2-D or 3-D parameters: the experts'
            fused weights), matched as PEFT matches them inside the decoder layers
            (plan_lora_targets.py). Default: every linear layer named q/k/v/o_proj, gate/up/down_proj
            and, where the model has experts, `experts.gate_up_proj` and `experts.down_proj`.
        lora_base_bytes: host bytes per parameter of the frozen layers and head: 2 (the compute
            dtype) or 4 (adapters added to a model already slid).
        lora_modules_to_save: PEFT's modules_to_save ("embed_tokens", "lm_head"), trained in full.
        gpu_hbm_gbs, gpu_fp32_tflops: the GPU's memory bandwidth (GB/s) and fp32 peak (TFLOPS),
            which pace the LoRA adapters' work (H200: 4800, 66.9).
        gpus: data parallelism over this many GPUs of one host (data_parallel.py): `batch` is per
            GPU, the host state one shared copy; no resident units, device updates, disk or LoRA.

    Returns:
        A Plan; `Plan.report()` formats it, `Plan.to_dict()` serialises it.

    Raises:
        FileNotFoundError: no config.json at the path.
        ValueError: an unsupported model_type (the message names the supported ones) or a bad setting.
    """
    settings = PlanSettings(**locals())                # every argument by name, checked once
    est = _estimator(settings)
    sizing = _size_batch(settings, est)
    result = _memory(settings, est, sizing)
    res = _resident_units(result, settings, est, sizing.disk)
    _step_time(result, settings, est, res, sizing.disk)
    result.advice = advise_lora(result, est) if settings.lora else advise(result, est, settings.deferred)
    return result


@dataclass
class _Sizing:
    """The batch stage's answer: the batch, the largest each memory allows, and the layers on disk."""

    batch: int
    chosen: bool                 # the planner picked the batch
    max_gpu: int
    max_host: int | None         # None: the host's memory is unknown
    gpu_limit: int               # bytes the allocator may fill on this card
    extras: dict                 # GPU items of accumulation and clipping, name -> bytes
    disk: DiskSplit              # the last layers whose state is on disk, at this batch


def _largest(fits, hi: int = 1 << 16) -> int:
    """Largest n in [0, hi] with fits(n), for a monotone fits (0 when even 1 does not)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _estimator(settings: PlanSettings) -> Estimator:
    """The formulas for the model and the settings: a LoRA run's or full fine-tuning's."""
    if settings.lora:
        return LoraEstimator(settings.shape, settings.seq, settings.window, settings.grad_buffers, settings.rates,
                             settings.mlp_chunk_tokens, r=settings.lora_r, base_bytes=settings.lora_base_bytes,
                             trained=tuple(dict.fromkeys(settings.lora_modules_to_save)),
                             targets=settings.lora_targets)
    return Estimator(settings.shape, settings.seq, settings.window, settings.grad_buffers, settings.rates,
                     settings.mlp_chunk_tokens, gpus=settings.gpus, optimizer_state=settings.optim, fp8=settings.fp8,
                     device_share=settings.device_share)


def _disk_layers(est: Estimator, batch: int, tier: str, deferred: bool, host_bytes: int) -> DiskSplit:
    """Which of the last layers keep their moments, or their whole state, on disk so that the
    host's items fit in `host_bytes` at this batch (`disk_plan.split_layers`, as the engine
    decides); every layer's whole state when even that does not fit (the plan then says the host
    is short)."""
    items = est.host(batch, tier, deferred)
    shape = est.s
    state = est.state_bytes()
    others = sum(items.values()) - state
    fmt = state_format(est.optimizer_state)             # the layers' records hold its arrays (disk_record.py)
    fixed = state - int(fmt.bytes_per_param * shape.layers * shape.layer_params) + others
    split = split_layers(host_bytes, fixed, [shape.layer_params] * shape.layers, fmt)
    return DiskSplit(0, shape.layers) if split is None else split


def _size_batch(settings: PlanSettings, est: Estimator) -> _Sizing:
    """The largest batch each memory allows, the batch (given, or the one that hides the host's
    work), and, with a disk for the state, the last layers that do not fit in host memory."""
    tier, deferred, host_bytes = settings.tier, settings.deferred, settings.host_bytes
    gpu_limit = int(settings.gpu_mem * GiB * GPU_USABLE) - GPU_CONTEXT_BYTES
    extras = est.gpu_extras(settings.gradient_accumulation_steps, settings.clip is not None)
    max_gpu = _largest(lambda b: est.gpu_peak(b, tier) + sum(extras.values()) <= gpu_limit)
    split = settings.nvme_gb is not None and bool(host_bytes)
    disk_of = (lambda b: _disk_layers(est, b, tier, deferred, host_bytes)) if split else (lambda b: DiskSplit())
    floor = DiskSplit(0, settings.shape.layers) if split else DiskSplit()        # every layer's whole state on disk
    max_host = None if not host_bytes else _largest(
        lambda b: sum(est.host(b, tier, deferred, floor).values()) <= host_bytes)
    batch, chosen = settings.batch, settings.batch is None
    if chosen:
        limit = min(batch_limit(max_gpu, max_host), max(1, MAX_CHOSEN_TOKENS // settings.seq))
        batch = est.hiding_batch(settings.gradient_accumulation_steps, tier, limit, deferred,
                                 disk_of if split else None) or 1
    return _Sizing(batch, chosen, max_gpu, max_host, gpu_limit, extras, disk_of(batch))


def _memory(settings: PlanSettings, est: Estimator, sizing: _Sizing) -> Plan:
    """The Plan at the batch: its host items, the state on disk, the GPU's items and peak."""
    batch, tier, k_disk = sizing.batch, settings.tier, sizing.disk
    plan = Plan(settings.shape, batch, settings.seq, settings.gradient_accumulation_steps, settings.clip,
                settings.window, tier, settings.grad_buffers, int(settings.gpu_mem * GiB), settings.host_bytes or None,
                settings.host_source, settings.gpu_source, settings.rates, adam_source=settings.adam_source,
                batch_chosen=sizing.chosen, gpu_limit=sizing.gpu_limit, max_batch_gpu=sizing.max_gpu,
                max_batch_host=sizing.max_host, gpus=settings.gpus)
    plan.optimizer_state = settings.optim
    plan.fp8 = settings.fp8
    plan.device_share = settings.device_share
    if settings.lora:
        plan.lora_r, plan.lora_base_bytes = settings.lora_r, settings.lora_base_bytes
        plan.lora_params = est.adapter_params
        plan.lora_targets, plan.lora_expert_params = est.lora_targets.describe(), est.param_adapter_params
        plan.lora_trained, plan.lora_trained_params = est.trained, est.trained_params
        plan.adapter_s = est.adapter_seconds(batch, settings.gradient_accumulation_steps)
    plan.host = est.host(batch, tier, settings.deferred, k_disk)
    plan.host_total = sum(plan.host.values())
    plan.disk_layers, plan.disk_moment_layers = k_disk.layers, k_disk.moments
    plan.disk_mem_bytes = None if settings.nvme_gb is None else int(settings.nvme_gb * 1e9)
    plan.disk_state_bytes = est.disk_state_bytes(k_disk)
    plan.disk_bytes_per_step = est.disk_traffic(settings.gradient_accumulation_steps, k_disk, settings.deferred)
    if k_disk.layers:
        # what SlideConfig.host_memory_limit bounds: the store's part of the host items
        state = [k for k in plan.host
                 if k.startswith(("fp32 masters", "masters of the layers", "fp32 gradient accumulator",
                                  "state buffers"))
                 or k == est.state_key]
        plan.host_memory_limit_gib = math.ceil(sum(plan.host[k] for k in state) / GiB * 10) / 10
    plan.gpu_fixed, plan.gpu_phases = est.gpu(batch, tier)
    plan.gpu_fixed.update(sizing.extras)
    plan.gpu_peak = est.gpu_peak(batch, tier) + sum(sizing.extras.values())
    plan.flops_per_token = est.flops_per_token()
    return plan


def _resident_units(plan: Plan, settings: PlanSettings, est: Estimator, k_disk: DiskSplit) -> tuple[bool, int]:
    """(resident embedding, resident layers) as the engine decides them, and what they move: their
    state onto the GPU, the embedding's host items away."""
    shape, clip = settings.shape, settings.clip
    res = (False, 0)
    if settings.resident and settings.gradient_accumulation_steps == 1 and settings.gpus == 1 and est.host_updates:
        # several GPUs: the engine keeps none. Resident layers keep the state format on the GPU
        # (resident_state.py); under a compact format the engine's resident_embedding='auto' keeps
        # the embedding on the host in the format (host_optim.embed_format)
        layer_per = resident_bytes_per_param_of(state_format(settings.optim), torch.bfloat16)
        res = plan_resident(limit_bytes=int(settings.gpu_mem * GiB),
                            peak_bytes=int(plan.gpu_peak * RESERVED_VS_ALLOCATED),
                            layer_numel=shape.layer_params, n_layers=shape.layers - k_disk.layers,
                            embed_numel=shape.embed_params, dtype=torch.bfloat16, clipping=clip is not None,
                            embed=None if settings.optim == "adamw" else False, layer_bytes_per_param=layer_per)
    plan.resident_embedding, plan.resident_layers = res
    if res != (False, 0):
        per = resident_bytes_per_param(torch.bfloat16)
        held = ((per + 4) * shape.embed_params if res[0] else 0) + res[1] * shape.layer_params * layer_per
        if res[1]:
            held += (res[1] if clip is not None else 1) * 4 * shape.layer_params     # fp32 gradient buffer(s)
        plan.gpu_fixed["resident units (fp32 master, m, v, gradient; bf16 weights)"] = held
        plan.gpu_peak += held
    if res[0]:
        _drop_resident_embedding(plan, est, settings.tier)
    # Resident layers are updated by the CPU in the first step: their host moments (and, with clipping,
    # accumulators) are released after it.
    plan.host_steady = plan.host_total - (8 + (4 if clip is not None else 0)) * res[1] * shape.layer_params
    return res


def _drop_resident_embedding(plan: Plan, est: Estimator, tier: str) -> None:
    """Resident from the first step (engine: [Why the embedding can be resident before the first
    step]): its moments are never written, its master is given back, its dense gradient and row
    buffers are never made; no layer is late (late_updates.py: nothing at the worker's front)."""
    shape, key = plan.shape, est.state_key
    dropped = ("embedding gradient (fp32", "embedding row buffers (B*S*H bf16 + fp32, pinned)",
               "late layers' gradients")
    plan.host = {(k + ", the resident embedding's given back" if k == key else k):
              (v - 12 * shape.embed_params if k == key else v) for k, v in plan.host.items()
              if not k.startswith(dropped)}
    acts = f"layer inputs ({tier} tier)"
    if tier == "cpu" and shape.layers > 1:
        # the first layer's input is gathered again from the resident embedding (activations.py)
        plan.host[acts] -= 2 * plan.batch * plan.seq * shape.hidden
    plan.host_total = sum(plan.host.values())


def _clipped_serial_s(plan: Plan, settings: PlanSettings, est: Estimator, res: tuple[bool, int]) -> float:
    """The step with clipping: no host unit can be updated before the backward has ended (the clip
    factor needs the global norm), so their AdamW paces the next forward. A share of the host-held
    layers is updated by the GPU as it is copied in (device_update.py): the CPU and the link share
    that work (docs/benchmarks.md has the measured steps)."""
    shape, adam_gps = settings.shape, settings.rates["adam_gps"]
    host_params = shape.n_params - est.resident_params(res)
    if settings.gpus == 1:
        share = balanced_share()
        layers = (shape.layers - res[1]) * shape.layer_params
        link = layers * (4 * (1 - share) + 16 * share) / (settings.rates["pcie_gbs"] * 1e9 * DEVICE_UPDATE_LINK)
        adam_after = max((host_params - share * layers) / (adam_gps * 1e9), link)
    else:                       # no device updates: the ranks' workers update every unit
        adam_after = host_params / (adam_gps * 1e9)
    # Only the first micro-batch's forward overlaps it.
    first_forward = FORWARD_SHARE * plan.times["gpu"] / settings.gradient_accumulation_steps
    return plan.times["gpu"] - first_forward + max(first_forward, adam_after)


def _step_time(plan: Plan, settings: PlanSettings, est: Estimator, res: tuple[bool, int], k_disk: DiskSplit) -> None:
    """The traffic, each term's time, the bound, and the expected step."""
    batch, accum, tier = plan.batch, settings.gradient_accumulation_steps, settings.tier
    plan.h2d_bytes, plan.d2h_bytes = est.traffic(batch, accum, tier, res)
    plan.times = est.times(batch, accum, tier, settings.deferred, res, disk_layers=k_disk)
    plan.gpu_resident_s = est.gpu_seconds(batch, accum, recompute=False)
    plan.linear_attention_s = accum * est.linear_attention_seconds(batch * est.seq)
    plan.bound_by = max(plan.times, key=plan.times.get)
    plan.bound_s = plan.times[plan.bound_by]
    # The file tier reads and writes on a thread of its own: its time overlaps the GPU's, like the
    # other terms (activation_file.py: [Why the nvme tier's file work is on its own thread]).
    serial = plan.times["gpu"]
    if settings.clip is not None and est.host_updates:
        serial = max(serial, _clipped_serial_s(plan, settings, est, res))
    # Each resource reaches its own share of its bound (ENGINE_EFFICIENCY): one that is not the
    # bound can still pace the step when it runs close to it (the CPU's AdamW, 0.65 of its rate in
    # the pipeline, beside a GPU-bound step: the 3B shape at batch 8, docs/planner.md).
    plan.paced_by = max(plan.times, key=lambda k: plan.times[k] / ENGINE_EFFICIENCY[k])
    each = plan.times[plan.paced_by] / ENGINE_EFFICIENCY[plan.paced_by]
    bound = max(plan.bound_s, serial) / ENGINE_EFFICIENCY[plan.bound_by]
    if bound >= each:
        plan.paced_by = plan.bound_by
    plan.expected_step_s = max(bound, each)
