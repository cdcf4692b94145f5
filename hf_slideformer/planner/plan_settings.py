"""The planner's settings, checked once before any estimate: `PlanSettings`.

The settings `plan` shares with the engine (`ENGINE_OPTIONS`: window, gradient accumulation,
clipping, the activation tier, the gradient buffers, the MLP chunk, the optimizer state) take
their defaults and their checks from `SlideConfig`'s table (config.py, options.py), so that the
planner, its command line and the engine cannot disagree on them. The planner's own settings
(the machine's memory and rates, the disk, LoRA, the GPUs) are checked here with the same
messages they always had. Nothing here estimates anything: `planner.plan` does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import SETTINGS
from ..host.host_optim import optimizer_state_of
from ..host.memory import GiB, available_host_bytes
from .plan_calibration import ADAM_GPS
from .plan_lora import MODULES_TO_SAVE
from .plan_lora_targets import DEFAULT_TARGET_MODULES, DEFAULT_TARGET_PARAMETERS, LoraTargets, lora_targets
from .plan_shape import ModelShape, load_model_config, model_shape

__all__ = ["ENGINE_OPTIONS", "RATES", "PlanSettings", "engine_default"]

# plan's argument -> the SlideConfig option it is (the table gives its default and its check)
ENGINE_OPTIONS = {"window": "window", "gradient_accumulation_steps": "gradient_accumulation_steps",
                  "max_grad_norm": "max_grad_norm", "activation_tier": "activation_tier",
                  "grad_buffers": "grad_buffers", "mlp_chunk_tokens": "mlp_chunk_tokens", "optim": "optimizer_state",
                  "device_update_share": "device_update_share"}
# the machine's rates, each a positive number (Plan.rates)
RATES = ("pcie_gbs", "adam_gps", "gpu_tflops", "gpu_efficiency", "nvme_write_gbs", "nvme_read_gbs", "nvme_bw",
         "gpu_hbm_gbs", "gpu_fp32_tflops")
DEFAULT_SEQ = 2048          # tokens per sequence when none is given (capped by max_position_embeddings)
PLANNED_AUTO_TIER = "cpu"   # activation_tier='auto' on the CUDA device the plan is for


def engine_default(argument: str) -> Any:
    """The default of one of plan's engine settings: its SlideConfig option's."""
    return SETTINGS[ENGINE_OPTIONS[argument]].default


def _check(name, value, ok, what):
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _positive(name, value, unit=""):
    _check(name, value, isinstance(value, (int, float)) and value > 0, f"a positive number{unit}")


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
        from ..host.host_rate import measure_state_rate
        rate = measure_state_rate(optim)
        return round(rate.params_per_s / 1e9, 2), rate.describe()
    return adam_gps, "given"


@dataclass
class PlanSettings:
    """`plan`'s arguments, checked and resolved: what each stage of the plan reads.

    The fields are plan's arguments by name (see `planner.plan`); `__post_init__` checks them and
    fills the resolved ones below (the model's shape, the tier, the clipping threshold, the rates,
    the memories and where each came from).
    """

    config_or_path: Any
    batch: int | None
    seq: int | None
    gpu_mem: float | None
    host_mem: float | None
    pcie_gbs: float
    adam_gps: float | str | None
    gpu_tflops: float
    gpu_efficiency: float
    gradient_accumulation_steps: int
    max_grad_norm: float | None
    window: int
    activation_tier: str
    grad_buffers: int
    nvme_write_gbs: float
    nvme_read_gbs: float
    resident: bool
    nvme_gb: float | None
    nvme_bw: float
    lora_r: int | None
    lora_base_bytes: int
    lora_modules_to_save: tuple
    mlp_chunk_tokens: int | None
    gpu_hbm_gbs: float
    gpu_fp32_tflops: float
    gpus: int
    optim: str
    fp8: bool
    device_update_share: Any
    lora_target_modules: Any
    lora_target_parameters: Any
    shape: ModelShape = field(init=False)
    model_config: dict = field(init=False)      # the config.json as a dict
    lora_targets: LoraTargets | None = field(init=False)   # what the adapters adapt (a LoRA plan)
    tier: str = field(init=False)               # the activation tier planned ('auto' resolved)
    clip: float | None = field(init=False)      # the clipping threshold, None: no clipping
    rates: dict = field(init=False)
    adam_source: str = field(init=False)
    gpu_source: str = field(init=False)
    host_bytes: int = field(init=False)         # 0: unknown (no host limit checked)
    host_source: str = field(init=False)

    def __post_init__(self):
        self.model_config = load_model_config(self.config_or_path)
        self.shape = model_shape(self.model_config)
        self._check_engine_options()
        self._check_gpus()
        self.optim = optimizer_state_of(self.optim)
        if self.optim != "adamw" and self.lora_r is not None:
            raise ValueError(f"optim={self.optim!r} is a setting of full fine-tuning: plan a LoRA run with optim='adamw'")
        if self.fp8 and self.lora_r is not None:
            raise ValueError("fp8=True is refused with LoRA (the engine refuses matmuls='fp8' for a LoRA model)")
        self.adam_gps, self.adam_source = _adam_rate(self.adam_gps, self.optim)
        self.rates = {name: getattr(self, name) for name in RATES}
        for name, value in self.rates.items():
            _positive(name, value)
        if self.nvme_gb is not None:
            _positive("nvme_gb", self.nvme_gb, " of GB")
        self._check_lora()
        self._resolve_memories()

    def _check_engine_options(self) -> None:
        """The engine's settings, by SlideConfig's table; the sequence and the batch."""
        for argument, name in ENGINE_OPTIONS.items():
            if argument != "optim":               # the Trainer's optimizer names too: optimizer_state_of
                setattr(self, argument, SETTINGS[name].check(getattr(self, argument), argument))
        self.clip = self.max_grad_norm            # ClipNorm: 0 or less is None
        self.tier = PLANNED_AUTO_TIER if self.activation_tier == "auto" else self.activation_tier
        if self.seq is None:                      # 2048, or the model's own limit when it is shorter
            self.seq = min(DEFAULT_SEQ, self.shape.max_positions or DEFAULT_SEQ)
        _check("seq", self.seq, isinstance(self.seq, int) and self.seq >= 1, "an int >= 1")
        if self.batch is not None:
            _check("batch", self.batch, isinstance(self.batch, int) and self.batch >= 1, "an int >= 1")

    def _check_gpus(self) -> None:
        gpus = self.gpus
        _check("gpus", gpus, isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1, "an int >= 1")
        if gpus == 1:
            return
        refused = ([f"lora_r (--lora-r {self.lora_r}): LoRA and other frozen parameters"]
                   if self.lora_r is not None else []) + (
            [f"nvme_gb (--nvme-gb {self.nvme_gb}): state on disk, SlideConfig.host_memory_limit"]
            if self.nvme_gb is not None else [])
        if refused:
            raise ValueError(f"with gpus={gpus} (--gpus {gpus}) the engine does not support {'; '.join(refused)}; "
                             "plan these with one GPU (gpus=1), or leave them out")

    def _check_lora(self) -> None:
        self.lora_targets = None
        if self.lora_r is None:
            if self.lora_modules_to_save:
                raise ValueError("lora_modules_to_save needs lora_r: modules_to_save is a setting of a LoRA run")
            for name, default in (("lora_target_modules", DEFAULT_TARGET_MODULES),
                                  ("lora_target_parameters", DEFAULT_TARGET_PARAMETERS)):
                if getattr(self, name) != default:
                    raise ValueError(f"{name} needs lora_r: the LoRA targets are a setting of a LoRA run")
            return
        _check("lora_r", self.lora_r, isinstance(self.lora_r, int) and self.lora_r >= 1, "an int >= 1")
        _check("lora_base_bytes", self.lora_base_bytes, self.lora_base_bytes in (2, 4),
               "2 (the compute dtype) or 4 (fp32)")
        _check("lora_modules_to_save", self.lora_modules_to_save,
               all(m in MODULES_TO_SAVE for m in self.lora_modules_to_save), f"names among {', '.join(MODULES_TO_SAVE)}")
        if self.nvme_gb is not None:
            raise ValueError("LoRA on a model whose layers keep their state on disk is not supported (the engine "
                             "refuses it); plan a LoRA run without nvme_gb: its frozen base never goes to disk")
        self.lora_targets = lora_targets(self.model_config, self.shape, self.lora_r, self.lora_target_modules,
                                         self.lora_target_parameters)

    def _resolve_memories(self) -> None:
        self.gpu_source = "given"
        if self.gpu_mem is None:
            self.gpu_mem, self.gpu_source = _default_gpu_gib()
        _positive("gpu_mem", self.gpu_mem, " of GiB")
        if self.host_mem is None:
            self.host_bytes = available_host_bytes()
            self.host_source = "available here" if self.host_bytes else "unknown"
        else:
            _positive("host_mem", self.host_mem, " of GiB")
            self.host_bytes, self.host_source = int(self.host_mem * GiB), "given"

    @property
    def lora(self) -> bool:
        """Whether this is a LoRA run's plan."""
        return self.lora_r is not None

    @property
    def device_share(self) -> float:
        """The share of the streamed layers updated on the GPU in the backward: a number given
        without clipping, with one micro-batch and one GPU (device_update.py); else 0."""
        share = self.device_update_share
        if share == "auto" or self.deferred or self.gpus > 1 or self.lora:
            return 0.0
        return float(share)

    @property
    def deferred(self) -> bool:
        """Whether the updates wait for optimizer.step() (accumulation or clipping), as SlideConfig.deferred."""
        return self.gradient_accumulation_steps > 1 or self.clip is not None
