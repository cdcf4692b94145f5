"""SlideArgs: Hugging Face `TrainingArguments` plus the sliding engine's settings.

Every `slide_*` field is made from one `SlideConfig` option of the settings table (`options.py`),
with its help text, so `HfArgumentParser(SlideArgs)` exposes them on the command line
(`--slide_window 3`), and is checked by the same rule as `SlideConfig`. The Trainer's own fields
keep their meaning and feed the engine where they overlap: `gradient_accumulation_steps` and
`max_grad_norm` become the engine's accumulation and clipping, `bf16` its compute dtype (`fp16`
is refused). Settings that cannot work with sliding (DeepSpeed, FSDP,
several processes, activation checkpointing, ...) are rejected here, at construction, with what
to do instead.

Constructing `SlideArgs` changes nothing outside it: a plain `transformers.Trainer` given them
slides through the hook that `hf_slideformer.install_trainer_hook()` installs (`trainer.py`).
"""
import logging
from dataclasses import dataclass, fields
from typing import Optional

import torch
from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from .accelerate_plugin import launch_environment
from .config import DTYPES, FLOAT16_REFUSED, SETTINGS, SlideConfig
from .host.host_optim import TRAINER_8BIT_NAMES
from .options import check_fields, option_fields

logger = logging.getLogger(__name__)

__all__ = ["SlideArgs", "SlideArgsError"]

_ADAMW = ("adamw_torch", "adamw_torch_fused")
_ADAMW_8BIT = TRAINER_8BIT_NAMES          # the engine's own 8-bit moments (host_optim.py)
PREFIX = "slide_"


class SlideArgsError(ValueError):
    """The training arguments contradict each other or cannot work with a sliding model."""


@dataclass
@option_fields(SETTINGS, surface="args", prefix=PREFIX)
class SlideArgs(TrainingArguments):
    """`TrainingArguments` for a sliding model (see `docs/options.md` for every field).

    The `slide_<name>` fields are the engine's own settings, one per `SlideConfig` option (made
    from the settings table, `config.SETTINGS`); `gradient_accumulation_steps`, `max_grad_norm`
    and `bf16` are handed to the engine. The Trainer never autocasts or moves the model: the engine
    holds fp32 masters on the host and computes in `slide_dtype`. `fp16=True` is refused (use
    `bf16=True`): the engine updates inside backward, where loss scaling cannot unscale or skip.
    """

    def __post_init__(self):
        self._reject_contradictions()
        super().__post_init__()
        env_precision = self.mixed_precision           # from --bf16, else ACCELERATE_MIXED_PRECISION
        # The engine owns precision: Accelerate must neither autocast the forward (the recompute in backward runs
        # outside that autocast) nor scale the loss (updates happen inside backward).
        self.mixed_precision = "no"
        if env_precision == "fp16":
            raise SlideArgsError(f"mixed precision fp16 (ACCELERATE_MIXED_PRECISION) is refused: {FLOAT16_REFUSED}")
        if env_precision == "fp8" and self.slide_matmuls == "dtype":     # Accelerate's FP8: the engine's FP8
            self.slide_matmuls = "fp8"                                   # projections, bf16 around
        if self.slide_dtype is None and env_precision in ("bf16", "fp8"):
            self.slide_dtype = "bfloat16"
        if self.n_gpu > 1:
            self._n_gpu = 1                              # one device slides; never nn.DataParallel
        self.to_slide_config()                           # validate every engine setting now

    def _reject_contradictions(self) -> None:
        env = launch_environment()
        if self.fp16 and self.bf16:
            raise SlideArgsError("fp16=True and bf16=True: choose one compute dtype (bf16 is the sliding default)")
        if self.fp16:
            raise SlideArgsError(f"fp16=True is refused: {FLOAT16_REFUSED}. Use bf16=True (--bf16).")
        try:
            check_fields(self, SETTINGS, surface="args", prefix=PREFIX)
            for name in ("gradient_accumulation_steps", "max_grad_norm"):   # the Trainer's, read by the engine
                SETTINGS[name].check(getattr(self, name), name)
        except ValueError as e:
            raise SlideArgsError(str(e)) from None
        if self.deepspeed or env.use_deepspeed:
            raise SlideArgsError("DeepSpeed is configured together with sliding. They are alternatives: hf_slideformer "
                                 "offloads by itself. Remove --deepspeed (or distributed_type: DEEPSPEED from the "
                                 "accelerate config), or use TrainingArguments without sliding.")
        if self.fsdp or env.use_fsdp:
            raise SlideArgsError("FSDP is configured together with sliding. Remove --fsdp (or distributed_type: FSDP "
                                 "from the accelerate config); for multi-GPU training use FSDP without sliding.")
        if getattr(self, "activation_checkpointing", None) or getattr(self, "gradient_checkpointing", None):
            # TRL's configs turn it on by default: the engine's own recompute is that saving already.
            logger.info("activation / gradient checkpointing changes nothing on a slid model: the sliding engine "
                        "already recomputes every layer from its saved input")
            for name in ("activation_checkpointing", "gradient_checkpointing"):
                if hasattr(self, name):
                    setattr(self, name, False)
        if self.torch_compile:
            raise SlideArgsError("torch_compile is not supported on a sliding model; turn it off")
        if getattr(self, "use_liger_kernel", False):
            raise SlideArgsError("use_liger_kernel: the sliding engine has its own fused kernels "
                                 "(--slide_use_kernels); turn Liger off")
        if self.label_smoothing_factor:
            raise SlideArgsError("label_smoothing_factor needs the logits, which the sliding head never "
                                 "materializes; set it to 0")
        optim = OptimizerNames(self.optim).value
        if optim in _ADAMW_8BIT:
            if self.slide_optimizer_state == "adamw":     # the default: the Trainer's optim says 8-bit moments
                self.slide_optimizer_state = "adamw_8bit"
        elif optim not in _ADAMW:
            raise SlideArgsError(f"optim={optim!r}: the sliding engine runs AdamW on the CPU; use optim='adamw_torch' "
                                 f"(fp32 state) or one of {', '.join(_ADAMW_8BIT)} (8-bit moments; a bf16 master "
                                 "too with slide_optimizer_state='adamw_8bit_bf16')")
        if self.bf16 and self.slide_dtype not in (None, "bfloat16"):
            raise SlideArgsError(f"slide_dtype={self.slide_dtype!r} contradicts bf16=True")

    @property
    def place_model_on_device(self) -> bool:
        """Never: the engine places each layer itself (a large model would not fit)."""
        return False

    def resolved_dtype(self) -> Optional[torch.dtype]:
        """The engine's compute dtype: `slide_dtype`, else bf16 flag, else None (engine default)."""
        name = self.slide_dtype or ("bfloat16" if self.bf16 else None)
        return DTYPES[name] if name else None

    def to_slide_config(self) -> SlideConfig:
        """The `SlideConfig` these arguments describe (every `slide_*` field, device, dtype, accumulation, clipping)."""
        values = {name: getattr(self, PREFIX + name) for name, opt in SETTINGS.items() if "args" in opt.surfaces}
        values.update(device=str(self.device), dtype=self.resolved_dtype(), max_grad_norm=self.max_grad_norm,
                      gradient_accumulation_steps=self.gradient_accumulation_steps)
        try:
            return SlideConfig(**values)
        except ValueError as e:
            raise SlideArgsError(f"invalid slide setting: {e}") from e

    @classmethod
    def from_training_args(cls, args: TrainingArguments, **slide_fields) -> "SlideArgs":
        """Upgrade plain `TrainingArguments` (every field copied) to `SlideArgs`."""
        kwargs = {f.name: getattr(args, f.name) for f in fields(args) if f.init}
        kwargs.update(slide_fields)
        return cls(**kwargs)

