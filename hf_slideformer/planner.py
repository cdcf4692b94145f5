"""Planner: will a model fit, with which batch, and how fast, from its config.json alone.

`plan` checks the settings, finds the largest batch each memory allows, picks the batch when
none is given, decides the resident units as the engine would, and fills a `Plan`. The model's
shape, the calibrated constants and the formulas are in `plan_estimate`; the `Plan`, its advice
and its text in `plan_report`; a LoRA run's formulas and advice in `plan_lora`. Every name the
planner offered before stays importable from here.
Nothing here touches a GPU or builds a model: the parameter counts come from the config's sizes.
"""
from __future__ import annotations

import math

import torch

from .budget import balanced_share, plan_resident, resident_bytes_per_param
from .disk_plan import DiskSplit, split_layers
from .host_optim import state_format
from .memory import GiB, available_host_bytes
from .plan_estimate import (
    ADAM_GPS, DEVICE_UPDATE_LINK, ENGINE_EFFICIENCY, FORWARD_SHARE, GPU_CONTEXT_BYTES, GPU_EFFICIENCY, GPU_USABLE, PEAK_TFLOPS,
    RESERVED_VS_ALLOCATED, Estimator, ModelShape, batch_limit, load_model_config, model_shape,
)
from .plan_estimate import (  # noqa: F401 - the rest of the calibration, importable from the planner as well
    ACT_HIDDEN, ACT_INTER, ADD_VS_ADAM, DUPLEX, GRAD_BYTES, NVME_BUFFERS, PROCESS_HOST_BYTES,
)
from .plan_lora import (
    FROZEN_BASE_BYTES, MODULES_TO_SAVE, PEAK_FP32_TFLOPS, PEAK_HBM_GBS, LoraEstimator, advise_lora,
)
from .plan_report import Plan, advise
from .resident_state import resident_bytes_per_param_of

__all__ = ["ModelShape", "Plan", "load_model_config", "model_shape", "plan"]

TIERS = ("cpu", "device", "nvme")


DEFAULT_SEQ = 2048          # tokens per sequence when none is given (capped by max_position_embeddings)
# A batch the plan chooses holds at most this many tokens: where nothing makes the GPU the bound
# (a tiny model), a larger batch only grows the step, and no one trains on more per micro-batch.
MAX_CHOSEN_TOKENS = 1 << 20

def _check(name, value, ok, what):
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _largest(fits, hi: int = 1 << 16) -> int:
    """Largest n in [0, hi] with fits(n), for a monotone fits (0 when even 1 does not)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _disk_layers(est: Estimator, batch: int, tier: str, deferred: bool, host_bytes: int) -> DiskSplit:
    """Which of the last layers keep their moments, or their whole state, on disk so that the
    host's items fit in `host_bytes` at this batch (`disk_plan.split_layers`, as the engine
    decides); every layer's whole state when even that does not fit (the plan then says the host
    is short)."""
    items = est.host(batch, tier, deferred)
    s = est.s
    state = est.state_bytes()
    others = sum(items.values()) - state
    fmt = state_format(est.optimizer_state)             # the layers' records hold its arrays (disk_record.py)
    fixed = state - int(fmt.bytes_per_param * s.layers * s.layer_params) + others
    split = split_layers(host_bytes, fixed, [s.layer_params] * s.layers, fmt)
    return DiskSplit(0, s.layers) if split is None else split


def _default_gpu_gib() -> tuple[float, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB, "this GPU"
    return 24.0, "assumed: no GPU here"


def _adam_rate(adam_gps, optim: str = "adamw") -> tuple:
    """(rate in G params/s, where it came from) for `plan`'s adam_gps."""
    if adam_gps is None:
        return ADAM_GPS, "the H200 machine's; --adam-gps host measures this one's"
    if isinstance(adam_gps, str):
        if adam_gps.strip().lower() != "host":
            raise ValueError(f"adam_gps must be a positive number of G parameters/s or 'host' (measure this machine's), "
                             f"got {adam_gps!r}")
        from .host_rate import measure_state_rate
        r = measure_state_rate(optim)
        return round(r.params_per_s / 1e9, 2), r.describe()
    return adam_gps, "given"


def plan(config_or_path, *, batch: int | None = None, seq: int | None = None, gpu_mem: float | None = None,
         host_mem: float | None = None, pcie_gbs: float = 54.6, adam_gps: float | str | None = None,
         gpu_tflops: float = PEAK_TFLOPS, gpu_efficiency: float = GPU_EFFICIENCY,
         gradient_accumulation_steps: int = 1, max_grad_norm: float | None = None, window: int = 2,
         activation_tier: str = "cpu", grad_buffers: int = 4, nvme_write_gbs: float = 1.2,
         nvme_read_gbs: float = 0.9, resident: bool = True, nvme_gb: float | None = None,
         nvme_bw: float = 7.0, lora_r: int | None = None, lora_base_bytes: int = FROZEN_BASE_BYTES,
         lora_modules_to_save: tuple[str, ...] = (), mlp_chunk_tokens: int | None = None,
         gpu_hbm_gbs: float = PEAK_HBM_GBS, gpu_fp32_tflops: float = PEAK_FP32_TFLOPS, gpus: int = 1,
         optim: str = "adamw", fp8: bool = False) -> Plan:
    """Estimate host and GPU memory, the largest batch and the step time of training a model.

    Args:
        config_or_path: a model directory holding config.json, a config.json path, a dict or an HF config.
        batch: sequences per micro-batch (default: the smallest power of two whose GPU compute
            hides AdamW and the transfers, or the largest that fits when none does).
        seq: tokens per sequence.
        gpu_mem: GPU memory in GiB (default: the current CUDA device's, else 24).
        host_mem: host memory in GiB (default: this machine's MemAvailable).
        pcie_gbs: pinned host<->device bandwidth, GB/s each way (H200 machine: 54.6).
        adam_gps: the host AdamW's rate alone on the machine, G parameters/s, or "host" to measure
            this machine's (`host_rate.measure_rate`: the route and threads the engine would use,
            about a second and 1 GiB of memory). Default: the H200 machine's calibration figure,
            ADAM_GPS (its 16 cores measured 3.5-4.1 G/s).
        gpu_tflops: the GPU's dense bf16 peak, TFLOPS (H100 / H200 SXM: 989.4).
        gpu_efficiency: achieved share of that peak (calibrated on the H200: 0.61).
        gradient_accumulation_steps, max_grad_norm, window, activation_tier, grad_buffers,
            mlp_chunk_tokens: as in SlideConfig ("auto" means "cpu").
        nvme_write_gbs, nvme_read_gbs: disk rates for the "nvme" activation tier, GB/s.
        nvme_gb: free space of a disk for the layers' state, GB: what does not fit in host memory
            goes there, the moments of the last layers first, then the whole state of the last
            ones (SlideConfig.host_memory_limit with nvme_path; the plan gives the limit to set).
            None: everything in host memory.
        nvme_bw: the rate that disk reads and writes the layers' state at, GB/s (one figure for
            both: they share the disk; with read rate r and write rate w, 2rw / (r + w), which
            `benchmarks/disk_bandwidth.py` prints).
        resident: model the engine's resident units (SlideConfig.resident_embedding / resident_layers
            "auto"): in what the step leaves free under the card's memory, the embedding then layers
            keep their optimizer state on the GPU and leave the CPU's AdamW and PCIe. The engine
            decides from the reserved peak it measures; the plan from its allocated-peak estimate
            times RESERVED_VS_ALLOCATED. No resident units with gradient accumulation.
        lora_r: plan a PEFT LoRA run (lora.py) of this rank on every linear layer of the decoder
            layers (q, k, v, o, gate, up, down): the base frozen and streamed, the adapters in fp32
            on the GPU and updated there; no resident units, no CPU AdamW. None: full fine-tuning.
        lora_base_bytes: host (and PCIe) bytes per parameter of the frozen layers and head: 2, the
            compute dtype the engine keeps them in, or 4 when the adapters are added to a model
            already slid (its fp32 masters stay). The embedding's master is fp32 either way.
        lora_modules_to_save: PEFT's modules_to_save of the LoRA run, of "embed_tokens" and
            "lm_head": their copies train in full (12 B/param on the host, the CPU AdamW).
        gpu_hbm_gbs, gpu_fp32_tflops: the GPU's memory bandwidth (GB/s) and fp32 peak (TFLOPS),
            which pace the LoRA adapters' fp32 work (H200: 4800, 66.9).
        gpus: data parallelism over this many GPUs of one host, one process each (data_parallel.py):
            `batch` is per GPU; the host state (masters, moments, accumulators) is one shared copy,
            each process adds its ring, row buffers, layer inputs and overhead; each GPU's link
            copies out 1/gpus of every gradient; one host's AdamW rate for all. No resident units
            and no GPU-side updates (the engine turns them off); no nvme_gb, no LoRA.
        optim: SlideConfig.optimizer_state ("adamw", "adamw_8bit", "adamw_8bit_bf16"), or one of the
            Trainer's 8-bit AdamW names (adamw_8bit, adamw_bnb_8bit, ...): the host bytes per
            parameter, and the records of the layers on disk, follow the format's declaration
            (host_optim.py, disk_record.py); a compact format keeps no resident layers (the engine
            refuses them), and its AdamW rate is
            `adam_gps` too unless measured ("host" measures that format's update).
        fp8: SlideConfig.matmuls='fp8': the decoder layers' projection GEMMs at 1.70x the bf16 rate
            (`plan_estimate.FP8_GEMM_SPEEDUP`), each slot's FP8 weights on the GPU; not with LoRA.

    Returns:
        A Plan; `Plan.report()` formats it, `Plan.to_dict()` serialises it.

    Raises:
        FileNotFoundError: no config.json at the path.
        ValueError: an unsupported model_type (the message names the supported ones) or a bad setting.
    """
    shape = model_shape(load_model_config(config_or_path))
    tier = "cpu" if activation_tier == "auto" else activation_tier
    _check("activation_tier", activation_tier, tier in TIERS, f"one of {TIERS}")
    if seq is None:                   # 2048, or the model's own limit when it is shorter
        seq = min(DEFAULT_SEQ, shape.max_positions or DEFAULT_SEQ)
    _check("seq", seq, isinstance(seq, int) and seq >= 1, "an int >= 1")
    _check("window", window, isinstance(window, int) and 1 <= window <= 16, "an int in [1, 16]")
    _check("grad_buffers", grad_buffers, isinstance(grad_buffers, int) and grad_buffers >= 1, "an int >= 1")
    N = gradient_accumulation_steps
    _check("gradient_accumulation_steps", N, isinstance(N, int) and N >= 1, "an int >= 1")
    if batch is not None:
        _check("batch", batch, isinstance(batch, int) and batch >= 1, "an int >= 1")
    _check("gpus", gpus, isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1, "an int >= 1")
    if gpus > 1:
        refused = ([f"lora_r (--lora-r {lora_r}): LoRA and other frozen parameters"] if lora_r is not None else []) + (
            [f"nvme_gb (--nvme-gb {nvme_gb}): state on disk, SlideConfig.host_memory_limit"]
            if nvme_gb is not None else [])
        if refused:
            raise ValueError(f"with gpus={gpus} (--gpus {gpus}) the engine does not support {'; '.join(refused)}; "
                             "plan these with one GPU (gpus=1), or leave them out")
    from .host_optim import optimizer_state_of
    optim = optimizer_state_of(optim)
    if optim != "adamw" and lora_r is not None:
        raise ValueError(f"optim={optim!r} is a setting of full fine-tuning: plan a LoRA run with optim='adamw'")
    if fp8 and lora_r is not None:
        raise ValueError("fp8=True is refused with LoRA (the engine refuses matmuls='fp8' for a LoRA model)")
    adam_gps, adam_source = _adam_rate(adam_gps, optim)
    rates = dict(pcie_gbs=pcie_gbs, adam_gps=adam_gps, gpu_tflops=gpu_tflops, gpu_efficiency=gpu_efficiency,
                 nvme_write_gbs=nvme_write_gbs, nvme_read_gbs=nvme_read_gbs, nvme_bw=nvme_bw,
                 gpu_hbm_gbs=gpu_hbm_gbs, gpu_fp32_tflops=gpu_fp32_tflops)
    for k, v in rates.items():
        _check(k, v, isinstance(v, (int, float)) and v > 0, "a positive number")
    if nvme_gb is not None:
        _check("nvme_gb", nvme_gb, isinstance(nvme_gb, (int, float)) and nvme_gb > 0, "a positive number of GB")
    lora = lora_r is not None
    if lora:
        _check("lora_r", lora_r, isinstance(lora_r, int) and lora_r >= 1, "an int >= 1")
        _check("lora_base_bytes", lora_base_bytes, lora_base_bytes in (2, 4), "2 (the compute dtype) or 4 (fp32)")
        _check("lora_modules_to_save", lora_modules_to_save,
               all(m in MODULES_TO_SAVE for m in lora_modules_to_save), f"names among {', '.join(MODULES_TO_SAVE)}")
        if nvme_gb is not None:
            raise ValueError("LoRA on a model whose layers keep their state on disk is not supported (the engine "
                             "refuses it); plan a LoRA run without nvme_gb: its frozen base never goes to disk")
    elif lora_modules_to_save:
        raise ValueError("lora_modules_to_save needs lora_r: modules_to_save is a setting of a LoRA run")
    clip = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else None
    deferred = N > 1 or clip is not None
    gpu_source = "given"
    if gpu_mem is None:
        gpu_mem, gpu_source = _default_gpu_gib()
    _check("gpu_mem", gpu_mem, isinstance(gpu_mem, (int, float)) and gpu_mem > 0, "a positive number of GiB")
    if host_mem is None:
        host_bytes = available_host_bytes()
        host_source = "available here" if host_bytes else "unknown"
    else:
        _check("host_mem", host_mem, isinstance(host_mem, (int, float)) and host_mem > 0, "a positive number of GiB")
        host_bytes, host_source = int(host_mem * GiB), "given"
    if mlp_chunk_tokens is not None:
        _check("mlp_chunk_tokens", mlp_chunk_tokens, isinstance(mlp_chunk_tokens, int) and mlp_chunk_tokens >= 1,
               "an int >= 1")
    est = (LoraEstimator(shape, seq, window, grad_buffers, rates, mlp_chunk_tokens, r=lora_r,
                         base_bytes=lora_base_bytes, trained=tuple(dict.fromkeys(lora_modules_to_save))) if lora
           else Estimator(shape, seq, window, grad_buffers, rates, mlp_chunk_tokens, gpus=gpus, optimizer_state=optim,
                          fp8=fp8))
    gpu_limit = int(gpu_mem * GiB * GPU_USABLE) - GPU_CONTEXT_BYTES
    extras = est.gpu_extras(N, clip is not None)
    max_gpu = _largest(lambda b: est.gpu_peak(b, tier) + sum(extras.values()) <= gpu_limit)
    # With a disk for the state, the last layers that do not fit in host memory go there.
    split = nvme_gb is not None and bool(host_bytes)
    disk_of = (lambda b: _disk_layers(est, b, tier, deferred, host_bytes)) if split else (lambda b: DiskSplit())
    floor = DiskSplit(0, shape.layers) if split else DiskSplit()        # every layer's whole state on disk
    max_host = None if not host_bytes else _largest(
        lambda b: sum(est.host(b, tier, deferred, floor).values()) <= host_bytes)
    chosen = batch is None
    if chosen:
        limit = min(batch_limit(max_gpu, max_host), max(1, MAX_CHOSEN_TOKENS // seq))
        batch = est.hiding_batch(N, tier, limit, deferred, disk_of if split else None) or 1
    k_disk = disk_of(batch)

    p = Plan(shape, batch, seq, N, clip, window, tier, grad_buffers, int(gpu_mem * GiB), host_bytes or None,
             host_source, gpu_source, rates, adam_source=adam_source, batch_chosen=chosen, gpu_limit=gpu_limit, max_batch_gpu=max_gpu,
             max_batch_host=max_host, gpus=gpus)
    p.optimizer_state = optim
    p.fp8 = fp8
    if lora:
        p.lora_r, p.lora_base_bytes, p.lora_params = lora_r, lora_base_bytes, est.adapter_params
        p.lora_trained, p.lora_trained_params = est.trained, est.trained_params
        p.adapter_s = est.adapter_seconds(batch, N)
    p.host = est.host(batch, tier, deferred, k_disk)
    p.host_total = sum(p.host.values())
    p.disk_layers, p.disk_moment_layers = k_disk.layers, k_disk.moments
    p.disk_mem_bytes = None if nvme_gb is None else int(nvme_gb * 1e9)
    p.disk_state_bytes = est.disk_state_bytes(k_disk)
    p.disk_bytes_per_step = est.disk_traffic(N, k_disk, deferred)
    if k_disk.layers:
        # what SlideConfig.host_memory_limit bounds: the store's part of the host items
        state = [k for k in p.host if k.startswith(("fp32 masters", "masters of the layers", "fp32 gradient accumulator", "state buffers"))
                 or k == est.state_key]
        p.host_memory_limit_gib = math.ceil(sum(p.host[k] for k in state) / GiB * 10) / 10
    p.gpu_fixed, p.gpu_phases = est.gpu(batch, tier)
    p.gpu_fixed.update(extras)
    p.gpu_peak = est.gpu_peak(batch, tier) + sum(extras.values())
    p.flops_per_token = est.flops_per_token()
    res = (False, 0)
    if resident and N == 1 and gpus == 1 and est.host_updates:     # several GPUs: the engine keeps none
        # resident layers keep the state format on the GPU (resident_state.py); under a compact format
        # the engine's resident_embedding='auto' keeps the embedding on the host in the format
        # (host_optim.embed_format)
        from .host_optim import state_format
        layer_per = resident_bytes_per_param_of(state_format(optim), torch.bfloat16)
        res = plan_resident(limit_bytes=int(gpu_mem * GiB), peak_bytes=int(p.gpu_peak * RESERVED_VS_ALLOCATED),
                            layer_numel=shape.layer_params, n_layers=shape.layers - k_disk.layers,
                            embed_numel=shape.embed_params, dtype=torch.bfloat16, clipping=clip is not None,
                            embed=None if optim == "adamw" else False, layer_bytes_per_param=layer_per)
    p.resident_embedding, p.resident_layers = res
    if res != (False, 0):
        per = resident_bytes_per_param(torch.bfloat16)
        held = ((per + 4) * shape.embed_params if res[0] else 0) + res[1] * shape.layer_params * layer_per
        if res[1]:
            held += (res[1] if clip is not None else 1) * 4 * shape.layer_params     # fp32 gradient buffer(s)
        p.gpu_fixed["resident units (fp32 master, m, v, gradient; bf16 weights)"] = held
        p.gpu_peak += held
    if res[0]:
        # Resident from the first step (engine: [Why the embedding can be resident before the first
        # step]): its moments are never written, its master is given back, its dense gradient and
        # row buffers are never made; no layer is late (late_updates.py: nothing at the worker's front).
        key = est.state_key
        dropped = ("embedding gradient (fp32", "embedding row buffers (B*S*H bf16 + fp32, pinned)",
                   "late layers' gradients")
        p.host = {(k + ", the resident embedding's given back" if k == key else k):
                  (v - 12 * shape.embed_params if k == key else v) for k, v in p.host.items()
                  if not k.startswith(dropped)}
        acts = f"layer inputs ({tier} tier)"
        if tier == "cpu" and shape.layers > 1:
            # the first layer's input is gathered again from the resident embedding (activations.py)
            p.host[acts] -= 2 * batch * seq * shape.hidden
        p.host_total = sum(p.host.values())
    # Resident layers are updated by the CPU in the first step: their host moments (and, with clipping,
    # accumulators) are released after it.
    p.host_steady = p.host_total - (8 + (4 if clip is not None else 0)) * res[1] * shape.layer_params
    p.h2d_bytes, p.d2h_bytes = est.traffic(batch, N, tier, res)
    p.times = est.times(batch, N, tier, deferred, res, disk_layers=k_disk)
    p.gpu_resident_s = est.gpu_seconds(batch, N, recompute=False)
    p.bound_by = max(p.times, key=p.times.get)
    p.bound_s = p.times[p.bound_by]
    # The file tier reads and writes on a thread of its own: its time overlaps the GPU's, like the
    # other terms (activation_file.py: [Why the nvme tier's file work is on its own thread]).
    serial = p.times["gpu"]
    if clip is not None and est.host_updates:
        # With clipping no host unit can be updated before the backward has ended (the clip factor
        # needs the global norm); their AdamW then paces the next forward. A share of the host-held
        # layers is updated by the GPU as it is copied in (device_update.py): the CPU and the link
        # share that work (docs/benchmarks.md has the measured steps).
        host_params = shape.n_params - est.resident_params(res)
        if gpus == 1:
            f = balanced_share()
            layers = (shape.layers - res[1]) * shape.layer_params
            link = layers * (4 * (1 - f) + 16 * f) / (pcie_gbs * 1e9 * DEVICE_UPDATE_LINK)
            adam_after = max((host_params - f * layers) / (adam_gps * 1e9), link)
        else:                       # no device updates: the ranks' workers update every unit
            adam_after = host_params / (adam_gps * 1e9)
        # Only the first micro-batch's forward overlaps it.
        first_forward = FORWARD_SHARE * p.times["gpu"] / N
        serial = max(serial, p.times["gpu"] - first_forward + max(first_forward, adam_after))
    # Each resource reaches its own share of its bound (ENGINE_EFFICIENCY): one that is not the
    # bound can still pace the step when it runs close to it (the CPU's AdamW, 0.65 of its rate in
    # the pipeline, beside a GPU-bound step: the 3B shape at batch 8, docs/planner.md).
    p.paced_by = max(p.times, key=lambda k: p.times[k] / ENGINE_EFFICIENCY[k])
    each = p.times[p.paced_by] / ENGINE_EFFICIENCY[p.paced_by]
    bound = max(p.bound_s, serial) / ENGINE_EFFICIENCY[p.bound_by]
    if bound >= each:
        p.paced_by = p.bound_by
    p.expected_step_s = max(bound, each)
    p.advice = advise_lora(p, est) if lora else advise(p, est, deferred)
    return p
