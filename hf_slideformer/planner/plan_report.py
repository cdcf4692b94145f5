"""The planner's answer: `Plan`, its figures as a dict, the advice drawn from its shortfalls and
its binding term, and the text `hf-slideformer plan` prints.

The figures are filled by `planner.plan` from the formulas of `plan_estimate`; the advice asks
the same formulas (and a few sums of the shape's sizes) what another setting would cost or save.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .budget import balanced_share, pick_device_units
from ..host.host_optim import embed_format, state_format
from ..host.memory import GiB
from .plan_estimate import ENGINE_EFFICIENCY, GRAD_BYTES, PROCESS_HOST_BYTES, Estimator, ModelShape, batch_limit, gpu_binds

__all__ = ["Plan", "advise", "gib"]


@dataclass
class Plan:
    """The planner's answer for one model and one setting. Sizes in bytes, times in seconds."""

    shape: ModelShape
    batch: int
    seq: int
    gradient_accumulation_steps: int
    max_grad_norm: float | None
    window: int
    activation_tier: str
    grad_buffers: int
    gpu_mem_bytes: int
    host_mem_bytes: int | None        # None: unknown (no limit checked)
    host_mem_source: str
    gpu_mem_source: str
    rates: dict                       # pcie_gbs, adam_gps, gpu_tflops, gpu_efficiency, nvme_*_gbs
    adam_source: str = "given"        # where rates["adam_gps"] came from ("given", "measured here: ...", the default's)
    batch_chosen: bool = False        # the batch was picked by the planner
    gpus: int = 1                     # data-parallel GPUs of one host: batch, GPU memory and PCIe are per GPU
    host: dict = field(default_factory=dict)       # name -> bytes
    gpu_fixed: dict = field(default_factory=dict)  # name -> bytes, held all step
    gpu_phases: dict = field(default_factory=dict)  # name -> bytes, the larger one adds to the fixed part
    host_total: int = 0
    host_steady: int = 0              # after the first step: the resident units' host pages released
    gpu_peak: int = 0
    gpu_limit: int = 0                # bytes the allocator may fill on this card
    max_batch_gpu: int = 0
    max_batch_host: int | None = None
    flops_per_token: float = 0.0
    h2d_bytes: int = 0                # per optimizer step
    d2h_bytes: int = 0
    times: dict = field(default_factory=dict)      # term -> seconds per optimizer step
    gpu_resident_s: float = 0.0
    resident_embedding: bool = False  # units the engine keeps and updates on the GPU (SlideConfig.resident_*)
    resident_layers: int = 0
    disk_layers: int = 0              # the last layers with state on disk (SlideConfig.host_memory_limit)
    disk_moment_layers: int = 0       # of them, those with their moments alone there (the rest: the whole state)
    disk_mem_bytes: int | None = None  # the disk's free space given (None: no disk for the state)
    disk_state_bytes: int = 0         # the state file of the layers on disk
    disk_bytes_per_step: int = 0      # read + written per optimizer step
    host_memory_limit_gib: float | None = None   # the setting that gives this split
    lora_r: int | None = None         # a LoRA plan's rank (None: full fine-tuning)
    lora_params: int = 0              # its adapter parameters (fp32, on the GPU)
    lora_targets: str = ""            # what they adapt, in words (plan_lora_targets.LoraTargets.describe)
    lora_expert_params: int = 0       # of them, those on target_parameters (PEFT's ParamWrapper: the experts' weights)
    lora_base_bytes: int | None = None  # host bytes per parameter of its frozen layers and head
    lora_trained: tuple = ()          # its modules_to_save (trained in full on the host)
    lora_trained_params: int = 0      # their parameters
    adapter_s: float = 0.0            # the adapters' part of the gpu term
    optimizer_state: str = "adamw"    # SlideConfig.optimizer_state (host_optim.py)
    fp8: bool = False                 # SlideConfig.matmuls='fp8' (docs/fp8.md)
    bound_s: float = 0.0
    bound_by: str = ""
    paced_by: str = ""                # the term that sets the expected step (each at its measured efficiency)
    expected_step_s: float = 0.0
    advice: list = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq * self.gradient_accumulation_steps * self.gpus

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_mem_bytes is None else self.host_total <= self.host_mem_bytes

    @property
    def gpu_fits(self) -> bool:
        return self.gpu_peak <= self.gpu_limit

    @property
    def disk_fits(self) -> bool | None:
        return None if self.disk_mem_bytes is None else self.disk_state_bytes <= self.disk_mem_bytes

    @property
    def disk_whole_layers(self) -> int:
        """The last layers whose whole state (master and moments) is on disk."""
        return self.disk_layers - self.disk_moment_layers

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits is not False and self.disk_fits is not False

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second at the step-time bound (a ceiling)."""
        return self.tokens_per_step / self.bound_s

    @property
    def expected_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.expected_step_s

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.gpus == 1:
            del d["gpus"]           # one GPU: the dict as it was before data parallelism
        if self.optimizer_state == "adamw":
            del d["optimizer_state"]    # the default: the dict as it was before the state formats
        if not self.fp8:
            del d["fp8"]
        d["shape"]["n_params"] = self.shape.n_params
        d.update(tokens_per_step=self.tokens_per_step, host_fits=self.host_fits, gpu_fits=self.gpu_fits,
                 disk_fits=self.disk_fits, fits=self.fits, tokens_per_s=self.tokens_per_s, expected_tokens_per_s=self.expected_tokens_per_s)
        return d

    def report(self) -> str:
        """The plan as text: memory, largest batch, step-time terms, advice."""
        return _format_report(self)


def gib(n: float) -> str:
    """Bytes as GiB with one decimal, as the report prints them."""
    return f"{n / GiB:.1f} GiB"


def advise(p: Plan, est: Estimator, deferred: bool) -> list[str]:
    """What to change, from the plan's shortfalls and its binding term."""
    s, out, N, tier, G = p.shape, [], p.gradient_accumulation_steps, p.activation_tier, p.gpus
    if s.max_positions and p.seq > s.max_positions:
        out.append(f"seq {p.seq} is beyond this model's max_position_embeddings ({s.max_positions}): it was not "
                   f"trained on such positions; plan with --seq {s.max_positions} or raise the limit in its config")
    if p.disk_layers:
        out.append(f"{_disk_parts(p)} on disk: SlideConfig(host_memory_limit={p.host_memory_limit_gib}, "
                   "nvme_path=<a directory on that disk>)")
    if p.disk_fits is False:
        out.append(f"disk short by {(p.disk_state_bytes - p.disk_mem_bytes) / 1e9:.0f} GB: the state file of the "
                   f"{p.disk_layers} layers on disk takes {p.disk_state_bytes / 1e9:.0f} GB (one record each, of "
                   "the moments or the whole state in the optimizer state format: docs/disk.md); free space there or use a larger disk")
    if p.host_fits is False:
        short = p.host_total - p.host_mem_bytes
        fixes = []
        compact = {"adamw": "adamw_8bit", "adamw_8bit": "adamw_8bit_bf16"}.get(p.optimizer_state)
        if compact and not p.lora_r and G == 1:
            fixes.append(f"optimizer_state='{compact}' (--optim {compact}) saves "
                         f"{gib(_state_saving(s, p.optimizer_state, compact))} (docs/host_state.md)")
        if p.disk_mem_bytes is None and G == 1:
            fixes.append("a disk for the state (--nvme-gb, SlideConfig.host_memory_limit with nvme_path) keeps the "
                         "last layers' masters and moments there")
        if deferred:
            fixes.append(f"no clipping and no accumulation (max_grad_norm=None, gradient_accumulation_steps=1) "
                         f"saves {gib(est.accumulator_bytes())}")
        acts = p.host[est.per_gpu(f"layer inputs ({tier} tier)")]
        if tier == "cpu" and acts:
            if est.gpu_peak(p.batch, "device") <= p.gpu_limit:
                fixes.append(f"activation_tier='device' saves {gib(acts)} (the GPU has room for them)")
            saved = acts - est.host(p.batch, "nvme", deferred)[est.per_gpu("layer inputs (nvme tier)")]
            fixes.append(f"activation_tier='nvme' saves {gib(saved)} (costs about "
                         f"{est.times(p.batch, N, 'nvme')['disk']:.1f} s of disk time per step)")
        if p.grad_buffers > 2:
            fixes.append(f"grad_buffers=2 saves {gib(G * GRAD_BYTES * (p.grad_buffers - 2) * s.layer_params)}")
        if p.max_batch_host and p.max_batch_host < p.batch:
            fixes.append(f"batch {p.max_batch_host} fits")
        floor = est.state_bytes() + 4 * s.embed_params + G * PROCESS_HOST_BYTES
        msg = f"host memory short by {gib(short)}: " + "; ".join(fixes) if fixes else \
            f"host memory short by {gib(short)}"
        if p.host_mem_bytes < floor:
            msg += (f". Masters, moments and the embedding gradient alone need {gib(floor)}: use a host with "
                    "more memory or a smaller model" + (f", or fewer GPUs than {G}" if G > 1 else ""))
        out.append(msg)
    if not p.gpu_fits:
        m = p.max_batch_gpu
        if m >= 1:
            k = math.ceil(p.batch * N / m)
            out.append(f"GPU memory short by {gib(p.gpu_peak - p.gpu_limit)} at batch {p.batch}: the largest batch "
                       f"that fits is {m}; batch {m} with gradient_accumulation_steps={k} keeps about "
                       f"{p.batch * N} sequences per step (+{gib(est.accumulator_bytes())} of host "
                       "memory for the accumulator)")
        else:
            out.append(f"GPU memory short by {gib(p.gpu_peak - p.gpu_limit)} even at batch 1: lower seq, use "
                       "window=1, or a GPU with more memory")
    limit = batch_limit(p.max_batch_gpu, p.max_batch_host)
    t = p.times
    if p.bound_by in ("cpu", "pcie"):
        what = {"cpu": f"AdamW ({t['cpu']:.2f} s)", "pcie": f"the transfers ({t['pcie']:.2f} s)"}[p.bound_by]
        b = est.hiding_batch(N, tier, limit, deferred)
        tb = est.times(b, N, tier, deferred) if b else {}
        hides = bool(tb) and gpu_binds(tb)
        if b > p.batch:
            out.append(f"{p.bound_by.upper()}-bound: raise the batch to {b} to hide {what} behind the GPU's "
                       f"compute ({tb['gpu']:.2f} s at batch {b}"
                       + ("" if hides else f", still short of {max(tb.values()):.2f} s") + ")")
        k = next((k for k in range(2, 65) if gpu_binds(est.times(b, k, tier, True))), None) if b else None
        if b and not hides and p.bound_by == "cpu" and k:
            need = sum(est.host(b, tier, True).values())
            room = ("" if p.host_mem_bytes is None else
                    "; it fits in host memory" if need <= p.host_mem_bytes else
                    f"; that needs {gib(need)} of host memory, more than the {gib(p.host_mem_bytes)} there is")
            out.append(f"CPU-bound at the largest batch that fits ({b}): gradient_accumulation_steps={k} hides "
                       f"AdamW behind {k} micro-batches (the fp32 accumulator adds "
                       f"{gib(est.accumulator_bytes())}{room}), or use a host with a faster AdamW "
                       "(more cores, more memory bandwidth)")
        if b and not hides and p.bound_by == "pcie":
            out.append(f"PCIe-bound at the largest batch that fits ({b}): the weights cross PCIe twice per "
                       "micro-batch whatever its size; a larger window re-sends fewer layers in backward")
        if p.bound_by == "pcie" and tier == "cpu" and est.gpu_peak(p.batch, "device") <= p.gpu_limit:
            out.append("activation_tier='device' fits on this GPU and takes the layer inputs off PCIe")
    elif p.bound_by == "disk":
        if p.disk_layers:
            fmt = state_format(p.optimizer_state or "adamw")     # its moments alone, or master and moments
            moments = fmt.bytes_per_param - fmt.master_dtype.itemsize
            more = int((moments * p.disk_moment_layers + fmt.bytes_per_param * p.disk_whole_layers) * s.layer_params)
            out.append(f"disk-bound: the state of the {p.disk_layers} layers on disk moves "
                       f"{p.disk_bytes_per_step / 1e9:.0f} GB per step at {p.rates['nvme_bw']} GB/s; it does not grow "
                       f"with the batch, so a larger batch (or gradient accumulation) spreads it over more tokens; "
                       f"{gib(more)} more host memory keeps every layer in RAM; a faster disk (or several in RAID 0) "
                       "shortens it")
        if tier == "nvme":
            need = est.host(p.batch, "cpu", deferred)[est.per_gpu("layer inputs (cpu tier)")]
            out.append(f"disk-bound: the nvme tier writes and reads "
                       f"{gib(2 * s.layers * p.batch * p.seq * s.hidden * N * G)} per step; "
                       "activation_tier='cpu' needs "
                       f"{gib(need)} of host memory instead")
    elif p.paced_by not in ("", "gpu"):
        t = p.times[p.paced_by]
        out.append(f"GPU-bound, but close: the {p.paced_by} term ({t:.3f} s at its full rate) runs at about "
                   f"{ENGINE_EFFICIENCY[p.paced_by]:.2f} of it in the pipeline and so sets the expected step; a "
                   "larger batch hides it behind the compute")
    else:
        out.append("GPU-bound: AdamW and the transfers hide behind the compute; only faster kernels or a faster "
                   "GPU raise tokens/s")
        if not deferred and p.grad_buffers > 3 and GRAD_BYTES * (p.grad_buffers - 3) * s.layer_params >= GiB // 10:
            # 3 buffers cost nothing while the GPU is the bound and nothing is clipped or
            # accumulated; they slow a step the CPU paces (docs/benchmarks.md).
            out.append(f"grad_buffers=3 saves {gib(G * GRAD_BYTES * (p.grad_buffers - 3) * s.layer_params)} of host memory at "
                       "no cost while the GPU is the bound and nothing is clipped or accumulated")
    return out


def _state_saving(s: ModelShape, have: str, other: str) -> float:
    """Host bytes of masters and state that optimizer_state `other` saves against `have`."""

    layers = state_format(have).bytes_per_param - state_format(other).bytes_per_param
    embed = embed_format(have, s.hidden).bytes_per_param - embed_format(other, s.hidden).bytes_per_param
    return layers * (s.n_params - s.embed_params) + embed * s.embed_params


def _disk_parts(p: Plan) -> str:
    """Which part of which layers is on disk, in words."""
    s, m, w = p.shape, p.disk_moment_layers, p.disk_whole_layers
    if not w:
        return f"the moments of the last {m} of {s.layers} layers"
    if not m:
        return f"the whole state of the last {w} of {s.layers} layers"
    return f"the moments of the last {m + w} of {s.layers} layers and the whole state of the last {w}"


def _span(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}..{last}"


def _count(n: int) -> str:
    """A parameter count with three significant digits in the unit that fits (B, M, K)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def _format_report(p: Plan) -> str:
    s = p.shape
    tie = "tied" if s.tied else "untied"
    lines = [
        f"{s.model_type}: {_count(s.n_params)} parameters ({s.layers} layers x {_count(s.layer_params)}, "
        f"hidden {s.hidden}, intermediate {s.intermediate}, vocab {s.vocab}, {tie})",
        f"batch {p.batch}{' (chosen)' if p.batch_chosen else ''} x seq {p.seq}"
        f"{f' x {p.gradient_accumulation_steps} micro-batches' if p.gradient_accumulation_steps > 1 else ''}"
        f"{f' x {p.gpus} GPUs' if p.gpus > 1 else ''}"
        f" = {p.tokens_per_step} tokens per step; window {p.window}, activations on {p.activation_tier}"
        f"{f', clipping at {p.max_grad_norm}' if p.max_grad_norm else ''}"
        f"{f', optimizer state {p.optimizer_state}' if p.optimizer_state != 'adamw' else ''}"
        f"{', projections in FP8' if p.fp8 else ''}",
    ]
    G = p.gpus
    if G > 1:
        lines.append(f"plan for {G} GPUs of one host (data parallel, one process each): batch, GPU memory and PCIe "
                     "bytes per GPU; the host state (fp32 masters, AdamW moments"
                     f"{', accumulators' if p.max_grad_norm or p.gradient_accumulation_steps > 1 else ''}) shared, "
                     f"one copy on the host; the host items marked 'x {G} GPUs' once per process; no resident units, "
                     f"no GPU-side updates; tokens/s for the {G} GPUs together")
    if p.lora_r:
        on = (f" ({(p.lora_params - p.lora_expert_params) / 1e6:.1f} M on linears, "
              f"{p.lora_expert_params / 1e6:.1f} M on target_parameters)" if p.lora_expert_params else "")
        lines.append(f"LoRA plan: rank {p.lora_r} on {p.lora_targets} of each decoder layer, "
                     f"{p.lora_params / 1e6:.1f} M adapter parameters{on} in fp32 on the GPU, updated there; the base "
                     f"frozen and streamed ({p.lora_base_bytes} B/param, the embedding fp32), "
                     + (f"modules_to_save {', '.join(p.lora_trained)} trained in full ("
                        f"{p.lora_trained_params / 1e6:.1f} M parameters, CPU AdamW)" if p.lora_trained
                        else "no CPU AdamW"))
    lines.append("")
    if p.host_mem_bytes is None:
        verdict = "limit unknown"
    else:
        verdict = (f"of {gib(p.host_mem_bytes)} ({p.host_mem_source}): "
                   + ("fits" if p.host_fits else f"SHORT by {gib(p.host_total - p.host_mem_bytes)}"))
    lines.append(f"host memory  {gib(p.host_total)} {verdict}")
    lines += [f"  {v / GiB:7.2f} GiB  {k}" for k, v in p.host.items() if v]
    if p.host_steady < p.host_total:
        lines.append(f"  peak in the first step; {gib(p.host_steady)} once the resident units' host pages are released")
    if p.disk_mem_bytes is not None:
        dverdict = "fits" if p.disk_fits else f"SHORT by {(p.disk_state_bytes - p.disk_mem_bytes) / 1e9:.0f} GB"
        lines.append(f"disk         {p.disk_state_bytes / 1e9:.1f} GB of {p.disk_mem_bytes / 1e9:.0f} GB (given): "
                     f"{dverdict}")
        first, whole = s.layers - p.disk_layers, s.layers - p.disk_whole_layers
        parts = ([f"{_span(0, first - 1)} in host memory"] if first else []) + (
            [f"{_span(first, whole - 1)} ({p.disk_moment_layers}) with their moments on disk, masters in RAM"]
            if p.disk_moment_layers else []) + (
            [f"{_span(whole, s.layers - 1)} ({p.disk_whole_layers}) with their whole state on disk"]
            if p.disk_whole_layers else [])
        lines.append("  RAM / disk split: " + ", ".join(parts) + (
            f" ({_count(p.disk_layers * s.layer_params)} parameters, host_memory_limit={p.host_memory_limit_gib} GiB)"
            if p.disk_layers else ", none on disk"))
    gverdict = "fits" if p.gpu_fits else f"SHORT by {gib(p.gpu_peak - p.gpu_limit)}"
    lines.append(f"GPU memory   {gib(p.gpu_peak)} peak allocated{' per GPU' if G > 1 else ''}, "
                 f"{gib(p.gpu_limit)} usable of "
                 f"{gib(p.gpu_mem_bytes)} ({p.gpu_mem_source}): {gverdict}")
    lines += [f"  {v / GiB:7.2f} GiB  {k}" for k, v in p.gpu_fixed.items()]
    big = max(p.gpu_phases, key=p.gpu_phases.get)
    lines += [f"  {v / GiB:7.2f} GiB  {k}{'  <- peak phase' if k == big else ''}" for k, v in p.gpu_phases.items()]
    host_b = "" if p.max_batch_host is None else f", {p.max_batch_host} by host memory"
    lines += [f"largest batch {p.max_batch_gpu}{' per GPU' if G > 1 else ''} by GPU memory{host_b}"]
    res_params = (s.embed_params if p.resident_embedding else 0) + p.resident_layers * s.layer_params
    if res_params:
        what = (["the embedding"] if p.resident_embedding else []) + (
            [f"layers 0..{p.resident_layers - 1}"] if p.resident_layers else [])
        lines.append(f"resident on the GPU (optimizer state, updated there): {' and '.join(what)}, "
                     f"{_count(res_params)} parameters (the engine decides after its first step)")
    if p.max_grad_norm and not p.lora_r and G > 1:
        lines.append("clipping: every unit is updated by the host's workers after the backward (no GPU-side updates "
                     "with several GPUs)")
    elif p.max_grad_norm and not p.lora_r:
        host_layers = list(range(s.layers - p.resident_layers))
        n = len(pick_device_units(host_layers, balanced_share()))
        lines.append(f"clipping: the host-held units are updated after the backward; {n} of the {len(host_layers)} "
                     f"host-held layers on the GPU as they are copied in (device_update_share 'auto': "
                     f"{balanced_share():.2f})")
    lines.append("")
    eff = p.rates["gpu_tflops"] * p.rates["gpu_efficiency"]
    lines.append(f"step time    bound {p.bound_s:.3f} s by {p.bound_by} ({p.tokens_per_s / 1e3:.1f} k tokens/s); "
                 f"expected about {p.expected_step_s:.2f} s ({p.expected_tokens_per_s / 1e3:.1f} k tokens/s)")
    detail = {
        "gpu": (f"fwd + recompute + input gradients, {p.flops_per_token / 1e9:.1f} GFLOP/token at {eff:.0f} TFLOPS, "
                f"+ {p.adapter_s:.3f} s of the adapters' own work" if p.lora_r else
                f"fwd + recompute + bwd, {p.flops_per_token / 1e9:.1f} GFLOP/token at {eff:.0f} TFLOPS"
                + (" (the layers' projections in FP8 at 1.70x, their quantization passes at the HBM rate)" if p.fp8 else "") + " "
                f"(resident, no recompute: {p.gpu_resident_s:.3f} s)" + (", each GPU" if G > 1 else "")),
        "pcie": f"h2d {p.h2d_bytes / 1e9:.1f} GB, d2h {p.d2h_bytes / 1e9:.1f} GB at {p.rates['pcie_gbs']} GB/s"
                + (f" per GPU, each on its own link (d2h: 1/{G} of each gradient)" if G > 1 else ""),
        "cpu": f"AdamW over {_count(p.lora_trained_params if p.lora_r else s.n_params - res_params)} parameters "
               f"at {p.rates['adam_gps']} G/s ({p.adam_source})" + (" (modules_to_save)" if p.lora_r else "")
               + (f", one host's rate shared by the {G} processes' workers" if G > 1 else ""),
        "disk": " + ".join(
            ([f"layer inputs written at {p.rates['nvme_write_gbs']} and read at {p.rates['nvme_read_gbs']} GB/s"]
             if p.activation_tier == "nvme" else [])
            + ([f"{_disk_parts(p)}, {p.disk_bytes_per_step / 1e9:.1f} GB read and written at "
                f"{p.rates['nvme_bw']} GB/s"] if p.disk_layers else [])),
    }
    lines += [f"  {k:5s} {v:7.3f} s  {detail[k]}" for k, v in p.times.items()]
    lines += ["", "advice"] + [f"  - {a}" for a in p.advice]
    lines.append("(estimates calibrated on H200 measurements; see docs/planner.md)")
    return "\n".join(lines)
