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
    linear_attention_s: float = 0.0   # of the GPU term: the linear-attention layers beyond their projections
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
    device_share: float = 0.0         # streamed layers updated on the GPU in the backward (no clipping)
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
        out = asdict(self)
        if self.gpus == 1:
            del out["gpus"]           # one GPU: the dict as it was before data parallelism
        if self.optimizer_state == "adamw":
            del out["optimizer_state"]    # the default: the dict as it was before the state formats
        if not self.fp8:
            del out["fp8"]
        if not self.device_share:
            del out["device_share"]
        out["shape"]["n_params"] = self.shape.n_params
        out.update(tokens_per_step=self.tokens_per_step, host_fits=self.host_fits, gpu_fits=self.gpu_fits,
                 disk_fits=self.disk_fits, fits=self.fits, tokens_per_s=self.tokens_per_s, expected_tokens_per_s=self.expected_tokens_per_s)
        return out

    def report(self) -> str:
        """The plan as text: memory, largest batch, step-time terms, advice."""
        return _format_report(self)


def gib(nbytes: float) -> str:
    """Bytes as GiB with one decimal, as the report prints them."""
    return f"{nbytes / GiB:.1f} GiB"


def disk_parts(plan: Plan) -> str:
    """Which part of which layers is on disk, in words."""
    shape, moments, whole = plan.shape, plan.disk_moment_layers, plan.disk_whole_layers
    if not whole:
        return f"the moments of the last {moments} of {shape.layers} layers"
    if not moments:
        return f"the whole state of the last {whole} of {shape.layers} layers"
    return f"the moments of the last {moments + whole} of {shape.layers} layers and the whole state of the last {whole}"


def _span(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}..{last}"


def _count(params: int) -> str:
    """A parameter count with three significant digits in the unit that fits (B, M, K)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.3g} {unit}"
    return str(params)


def _format_report(plan: Plan) -> str:
    lines = _header_lines(plan) + [""] + _memory_lines(plan) + [""] + _step_lines(plan)
    lines += ["", "advice"] + [f"  - {a}" for a in plan.advice]
    lines.append("(estimates calibrated on H200 measurements; see docs/planner.md)")
    return "\n".join(lines)


def _resident_params(plan: Plan) -> int:
    """Parameters the plan keeps on the GPU with their optimizer state (updated there)."""
    return (plan.shape.embed_params if plan.resident_embedding else 0) + plan.resident_layers * plan.shape.layer_params


def _header_lines(plan: Plan) -> list[str]:
    """The model, the batch and the run's settings; the data-parallel and LoRA plans."""
    shape = plan.shape
    tie = "tied" if shape.tied else "untied"
    lines = [
        f"{shape.model_type}: {_count(shape.n_params)} parameters ({shape.layers} layers x {_count(shape.layer_params)}, "
        f"hidden {shape.hidden}, intermediate {shape.intermediate}, vocab {shape.vocab}, {tie})",
        f"batch {plan.batch}{' (chosen)' if plan.batch_chosen else ''} x seq {plan.seq}"
        f"{f' x {plan.gradient_accumulation_steps} micro-batches' if plan.gradient_accumulation_steps > 1 else ''}"
        f"{f' x {plan.gpus} GPUs' if plan.gpus > 1 else ''}"
        f" = {plan.tokens_per_step} tokens per step; window {plan.window}, activations on {plan.activation_tier}"
        f"{f', clipping at {plan.max_grad_norm}' if plan.max_grad_norm else ''}"
        f"{f', optimizer state {plan.optimizer_state}' if plan.optimizer_state != 'adamw' else ''}"
        f"{', projections in FP8' if plan.fp8 else ''}",
    ]
    gpus = plan.gpus
    if gpus > 1:
        lines.append(f"plan for {gpus} GPUs of one host (data parallel, one process each): batch, GPU memory and PCIe "
                     "bytes per GPU; the host state (fp32 masters, AdamW moments"
                     f"{', accumulators' if plan.max_grad_norm or plan.gradient_accumulation_steps > 1 else ''})"
                     " shared, "
                     f"one copy on the host; the host items marked 'x {gpus} GPUs' once per process; no resident units, "
                     f"no GPU-side updates; tokens/s for the {gpus} GPUs together")
    if plan.lora_r:
        on = (f" ({(plan.lora_params - plan.lora_expert_params) / 1e6:.1f} M on linears, "
              f"{plan.lora_expert_params / 1e6:.1f} M on target_parameters)" if plan.lora_expert_params else "")
        lines.append(f"LoRA plan: rank {plan.lora_r} on {plan.lora_targets} of each decoder layer, "
                     f"{plan.lora_params / 1e6:.1f} M adapter parameters{on} in fp32 on the GPU, updated there;"
                     " the base "
                     f"frozen and streamed ({plan.lora_base_bytes} B/param, the embedding fp32), "
                     + (f"modules_to_save {', '.join(plan.lora_trained)} trained in full ("
                        f"{plan.lora_trained_params / 1e6:.1f} M parameters, CPU AdamW)" if plan.lora_trained
                        else "no CPU AdamW"))
    return lines


def _memory_lines(plan: Plan) -> list[str]:
    """Host memory, the disk split, GPU memory, the largest batches, the resident units and the
    updates under clipping."""
    shape, gpus = plan.shape, plan.gpus
    lines = []
    if plan.host_mem_bytes is None:
        verdict = "limit unknown"
    else:
        verdict = (f"of {gib(plan.host_mem_bytes)} ({plan.host_mem_source}): "
                   + ("fits" if plan.host_fits else f"SHORT by {gib(plan.host_total - plan.host_mem_bytes)}"))
    lines.append(f"host memory  {gib(plan.host_total)} {verdict}")
    lines += [f"  {v / GiB:7.2f} GiB  {k}" for k, v in plan.host.items() if v]
    if plan.host_steady < plan.host_total:
        lines.append(f"  peak in the first step; {gib(plan.host_steady)} once the resident units' host pages"
                     " are released")
    if plan.disk_mem_bytes is not None:
        short = (plan.disk_state_bytes - plan.disk_mem_bytes) / 1e9
        dverdict = "fits" if plan.disk_fits else f"SHORT by {short:.0f} GB"
        lines.append(f"disk         {plan.disk_state_bytes / 1e9:.1f} GB of {plan.disk_mem_bytes / 1e9:.0f} GB"
                     " (given): "
                     f"{dverdict}")
        first, whole = shape.layers - plan.disk_layers, shape.layers - plan.disk_whole_layers
        parts = ([f"{_span(0, first - 1)} in host memory"] if first else []) + (
            [f"{_span(first, whole - 1)} ({plan.disk_moment_layers}) with their moments on disk, masters in RAM"]
            if plan.disk_moment_layers else []) + (
            [f"{_span(whole, shape.layers - 1)} ({plan.disk_whole_layers}) with their whole state on disk"]
            if plan.disk_whole_layers else [])
        lines.append("  RAM / disk split: " + ", ".join(parts) + (
            f" ({_count(plan.disk_layers * shape.layer_params)} parameters,"
            f" host_memory_limit={plan.host_memory_limit_gib} GiB)"
            if plan.disk_layers else ", none on disk"))
    gverdict = "fits" if plan.gpu_fits else f"SHORT by {gib(plan.gpu_peak - plan.gpu_limit)}"
    lines.append(f"GPU memory   {gib(plan.gpu_peak)} peak allocated{' per GPU' if gpus > 1 else ''}, "
                 f"{gib(plan.gpu_limit)} usable of "
                 f"{gib(plan.gpu_mem_bytes)} ({plan.gpu_mem_source}): {gverdict}")
    lines += [f"  {v / GiB:7.2f} GiB  {k}" for k, v in plan.gpu_fixed.items()]
    big = max(plan.gpu_phases, key=plan.gpu_phases.get)
    lines += [f"  {v / GiB:7.2f} GiB  {k}{'  <- peak phase' if k == big else ''}" for k, v in plan.gpu_phases.items()]
    host_b = "" if plan.max_batch_host is None else f", {plan.max_batch_host} by host memory"
    lines += [f"largest batch {plan.max_batch_gpu}{' per GPU' if gpus > 1 else ''} by GPU memory{host_b}"]
    res_params = _resident_params(plan)
    if res_params:
        what = (["the embedding"] if plan.resident_embedding else []) + (
            [f"layers 0..{plan.resident_layers - 1}"] if plan.resident_layers else [])
        lines.append(f"resident on the GPU (optimizer state, updated there): {' and '.join(what)}, "
                     f"{_count(res_params)} parameters (the engine decides after its first step)")
    if plan.max_grad_norm and not plan.lora_r and gpus > 1:
        lines.append("clipping: every unit is updated by the host's workers after the backward (no GPU-side updates "
                     "with several GPUs)")
    elif plan.max_grad_norm and not plan.lora_r:
        host_layers = list(range(shape.layers - plan.resident_layers))
        device_layers = len(pick_device_units(host_layers, balanced_share()))
        lines.append(f"clipping: the host-held units are updated after the backward; {device_layers} of the "
                     f"{len(host_layers)} host-held layers on the GPU as they are copied in "
                     f"(device_update_share 'auto': {balanced_share():.2f})")
    return lines


def _step_lines(plan: Plan) -> list[str]:
    """The step's bound and expected time, and each term with what it counts."""
    shape, gpus = plan.shape, plan.gpus
    res_params = _resident_params(plan)
    on_gpu = int(plan.device_share * (shape.layers - plan.resident_layers) * shape.layer_params)
    lines = []
    eff = plan.rates["gpu_tflops"] * plan.rates["gpu_efficiency"]
    lines.append(f"step time    bound {plan.bound_s:.3f} s by {plan.bound_by}"
                 f" ({plan.tokens_per_s / 1e3:.1f} k tokens/s); "
                 f"expected about {plan.expected_step_s:.2f} s ({plan.expected_tokens_per_s / 1e3:.1f} k tokens/s)")
    detail = {
        "gpu": (f"fwd + recompute + input gradients, {plan.flops_per_token / 1e9:.1f} GFLOP/token at {eff:.0f} TFLOPS, "
                f"+ {plan.adapter_s:.3f} s of the adapters' own work" if plan.lora_r else
                f"fwd + recompute + bwd, {plan.flops_per_token / 1e9:.1f} GFLOP/token at {eff:.0f} TFLOPS"
                + (f" + {plan.linear_attention_s:.3f} s of linear attention beyond its projections (measured rate)"
                   if plan.linear_attention_s else "")
                + (" (the layers' projections in FP8 at 1.70x, their quantization passes at the HBM rate)" if plan.fp8 else "") + " "
                f"(resident, no recompute: {plan.gpu_resident_s:.3f} s)" + (", each GPU" if gpus > 1 else "")),
        "pcie": f"h2d {plan.h2d_bytes / 1e9:.1f} GB, d2h {plan.d2h_bytes / 1e9:.1f} GB at {plan.rates['pcie_gbs']} GB/s"
                + (f" per GPU, each on its own link (d2h: 1/{gpus} of each gradient)" if gpus > 1 else ""),
        "cpu": f"AdamW over {_count(plan.lora_trained_params if plan.lora_r else shape.n_params - res_params - on_gpu)}"
               " parameters "
               + (f"(the other {_count(on_gpu)} streamed ones on the GPU in the backward: device_update_share "
                  f"{plan.device_share}) " if on_gpu else "")
               + f"at {plan.rates['adam_gps']} G/s ({plan.adam_source})" + (" (modules_to_save)" if plan.lora_r else "")
               + (f", one host's rate shared by the {gpus} processes' workers" if gpus > 1 else ""),
        "disk": " + ".join(
            ([f"layer inputs written at {plan.rates['nvme_write_gbs']} and read at {plan.rates['nvme_read_gbs']} GB/s"]
             if plan.activation_tier == "nvme" else [])
            + ([f"{disk_parts(plan)}, {plan.disk_bytes_per_step / 1e9:.1f} GB read and written at "
                f"{plan.rates['nvme_bw']} GB/s"] if plan.disk_layers else [])),
    }
    lines += [f"  {k:5s} {v:7.3f} s  {detail[k]}" for k, v in plan.times.items()]
    return lines
