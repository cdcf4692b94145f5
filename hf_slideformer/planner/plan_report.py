"""The planner's answer: `Plan`, its figures as a dict, and the text `hf-slideformer plan` prints.

The figures are filled by `planner.plan` from the formulas of `plan_estimate`; its advice by
`plan_advice`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .budget import balanced_share, pick_device_units
from ..host.memory import GiB
from .plan_estimate import ModelShape

__all__ = ["Plan", "disk_parts", "gib"]


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


def disk_parts(p: Plan) -> str:
    """Which part of which layers is on disk, in words."""
    shape, m, w = p.shape, p.disk_moment_layers, p.disk_whole_layers
    if not w:
        return f"the moments of the last {m} of {shape.layers} layers"
    if not m:
        return f"the whole state of the last {w} of {shape.layers} layers"
    return f"the moments of the last {m + w} of {shape.layers} layers and the whole state of the last {w}"


def _span(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}..{last}"


def _count(n: int) -> str:
    """A parameter count with three significant digits in the unit that fits (B, M, K)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def _format_report(p: Plan) -> str:
    lines = _header_lines(p) + [""] + _memory_lines(p) + [""] + _step_lines(p)
    lines += ["", "advice"] + [f"  - {a}" for a in p.advice]
    lines.append("(estimates calibrated on H200 measurements; see docs/planner.md)")
    return "\n".join(lines)


def _resident_params(p: Plan) -> int:
    """Parameters the plan keeps on the GPU with their optimizer state (updated there)."""
    return (p.shape.embed_params if p.resident_embedding else 0) + p.resident_layers * p.shape.layer_params


def _header_lines(p: Plan) -> list[str]:
    """The model, the batch and the run's settings; the data-parallel and LoRA plans."""
    shape = p.shape
    tie = "tied" if shape.tied else "untied"
    lines = [
        f"{shape.model_type}: {_count(shape.n_params)} parameters ({shape.layers} layers x {_count(shape.layer_params)}, "
        f"hidden {shape.hidden}, intermediate {shape.intermediate}, vocab {shape.vocab}, {tie})",
        f"batch {p.batch}{' (chosen)' if p.batch_chosen else ''} x seq {p.seq}"
        f"{f' x {p.gradient_accumulation_steps} micro-batches' if p.gradient_accumulation_steps > 1 else ''}"
        f"{f' x {p.gpus} GPUs' if p.gpus > 1 else ''}"
        f" = {p.tokens_per_step} tokens per step; window {p.window}, activations on {p.activation_tier}"
        f"{f', clipping at {p.max_grad_norm}' if p.max_grad_norm else ''}"
        f"{f', optimizer state {p.optimizer_state}' if p.optimizer_state != 'adamw' else ''}"
        f"{', projections in FP8' if p.fp8 else ''}",
    ]
    gpus = p.gpus
    if gpus > 1:
        lines.append(f"plan for {gpus} GPUs of one host (data parallel, one process each): batch, GPU memory and PCIe "
                     "bytes per GPU; the host state (fp32 masters, AdamW moments"
                     f"{', accumulators' if p.max_grad_norm or p.gradient_accumulation_steps > 1 else ''}) shared, "
                     f"one copy on the host; the host items marked 'x {gpus} GPUs' once per process; no resident units, "
                     f"no GPU-side updates; tokens/s for the {gpus} GPUs together")
    if p.lora_r:
        on = (f" ({(p.lora_params - p.lora_expert_params) / 1e6:.1f} M on linears, "
              f"{p.lora_expert_params / 1e6:.1f} M on target_parameters)" if p.lora_expert_params else "")
        lines.append(f"LoRA plan: rank {p.lora_r} on {p.lora_targets} of each decoder layer, "
                     f"{p.lora_params / 1e6:.1f} M adapter parameters{on} in fp32 on the GPU, updated there; the base "
                     f"frozen and streamed ({p.lora_base_bytes} B/param, the embedding fp32), "
                     + (f"modules_to_save {', '.join(p.lora_trained)} trained in full ("
                        f"{p.lora_trained_params / 1e6:.1f} M parameters, CPU AdamW)" if p.lora_trained
                        else "no CPU AdamW"))
    return lines


def _memory_lines(p: Plan) -> list[str]:
    """Host memory, the disk split, GPU memory, the largest batches, the resident units and the
    updates under clipping."""
    shape, gpus = p.shape, p.gpus
    lines = []
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
        first, whole = shape.layers - p.disk_layers, shape.layers - p.disk_whole_layers
        parts = ([f"{_span(0, first - 1)} in host memory"] if first else []) + (
            [f"{_span(first, whole - 1)} ({p.disk_moment_layers}) with their moments on disk, masters in RAM"]
            if p.disk_moment_layers else []) + (
            [f"{_span(whole, shape.layers - 1)} ({p.disk_whole_layers}) with their whole state on disk"]
            if p.disk_whole_layers else [])
        lines.append("  RAM / disk split: " + ", ".join(parts) + (
            f" ({_count(p.disk_layers * shape.layer_params)} parameters, host_memory_limit={p.host_memory_limit_gib} GiB)"
            if p.disk_layers else ", none on disk"))
    gverdict = "fits" if p.gpu_fits else f"SHORT by {gib(p.gpu_peak - p.gpu_limit)}"
    lines.append(f"GPU memory   {gib(p.gpu_peak)} peak allocated{' per GPU' if gpus > 1 else ''}, "
                 f"{gib(p.gpu_limit)} usable of "
                 f"{gib(p.gpu_mem_bytes)} ({p.gpu_mem_source}): {gverdict}")
    lines += [f"  {v / GiB:7.2f} GiB  {k}" for k, v in p.gpu_fixed.items()]
    big = max(p.gpu_phases, key=p.gpu_phases.get)
    lines += [f"  {v / GiB:7.2f} GiB  {k}{'  <- peak phase' if k == big else ''}" for k, v in p.gpu_phases.items()]
    host_b = "" if p.max_batch_host is None else f", {p.max_batch_host} by host memory"
    lines += [f"largest batch {p.max_batch_gpu}{' per GPU' if gpus > 1 else ''} by GPU memory{host_b}"]
    res_params = _resident_params(p)
    if res_params:
        what = (["the embedding"] if p.resident_embedding else []) + (
            [f"layers 0..{p.resident_layers - 1}"] if p.resident_layers else [])
        lines.append(f"resident on the GPU (optimizer state, updated there): {' and '.join(what)}, "
                     f"{_count(res_params)} parameters (the engine decides after its first step)")
    if p.max_grad_norm and not p.lora_r and gpus > 1:
        lines.append("clipping: every unit is updated by the host's workers after the backward (no GPU-side updates "
                     "with several GPUs)")
    elif p.max_grad_norm and not p.lora_r:
        host_layers = list(range(shape.layers - p.resident_layers))
        n = len(pick_device_units(host_layers, balanced_share()))
        lines.append(f"clipping: the host-held units are updated after the backward; {n} of the {len(host_layers)} "
                     f"host-held layers on the GPU as they are copied in (device_update_share 'auto': "
                     f"{balanced_share():.2f})")
    return lines


def _step_lines(p: Plan) -> list[str]:
    """The step's bound and expected time, and each term with what it counts."""
    shape, gpus = p.shape, p.gpus
    res_params = _resident_params(p)
    lines = []
    eff = p.rates["gpu_tflops"] * p.rates["gpu_efficiency"]
    lines.append(f"step time    bound {p.bound_s:.3f} s by {p.bound_by} ({p.tokens_per_s / 1e3:.1f} k tokens/s); "
                 f"expected about {p.expected_step_s:.2f} s ({p.expected_tokens_per_s / 1e3:.1f} k tokens/s)")
    detail = {
        "gpu": (f"fwd + recompute + input gradients, {p.flops_per_token / 1e9:.1f} GFLOP/token at {eff:.0f} TFLOPS, "
                f"+ {p.adapter_s:.3f} s of the adapters' own work" if p.lora_r else
                f"fwd + recompute + bwd, {p.flops_per_token / 1e9:.1f} GFLOP/token at {eff:.0f} TFLOPS"
                + (" (the layers' projections in FP8 at 1.70x, their quantization passes at the HBM rate)" if p.fp8 else "") + " "
                f"(resident, no recompute: {p.gpu_resident_s:.3f} s)" + (", each GPU" if gpus > 1 else "")),
        "pcie": f"h2d {p.h2d_bytes / 1e9:.1f} GB, d2h {p.d2h_bytes / 1e9:.1f} GB at {p.rates['pcie_gbs']} GB/s"
                + (f" per GPU, each on its own link (d2h: 1/{gpus} of each gradient)" if gpus > 1 else ""),
        "cpu": f"AdamW over {_count(p.lora_trained_params if p.lora_r else shape.n_params - res_params)} parameters "
               f"at {p.rates['adam_gps']} G/s ({p.adam_source})" + (" (modules_to_save)" if p.lora_r else "")
               + (f", one host's rate shared by the {gpus} processes' workers" if gpus > 1 else ""),
        "disk": " + ".join(
            ([f"layer inputs written at {p.rates['nvme_write_gbs']} and read at {p.rates['nvme_read_gbs']} GB/s"]
             if p.activation_tier == "nvme" else [])
            + ([f"{disk_parts(p)}, {p.disk_bytes_per_step / 1e9:.1f} GB read and written at "
                f"{p.rates['nvme_bw']} GB/s"] if p.disk_layers else [])),
    }
    lines += [f"  {k:5s} {v:7.3f} s  {detail[k]}" for k, v in p.times.items()]
    return lines
