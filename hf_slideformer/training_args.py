"""SlideArgs: Hugging Face `TrainingArguments` plus the sliding engine's settings.

Every `slide_*` field maps onto one `SlideConfig` knob and has a `help` text, so
`HfArgumentParser(SlideArgs)` exposes them on the command line (`--slide_window 3`). The
Trainer's own fields keep their meaning and feed the engine where they overlap:
`gradient_accumulation_steps` and `max_grad_norm` become the engine's accumulation and clipping,
`bf16` / `fp16` its compute dtype. Settings that cannot work with sliding (DeepSpeed, FSDP,
several processes, activation checkpointing, ...) are rejected here, at construction, with what
to do instead.
"""
import logging
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from .accelerate_plugin import launch_environment, multi_process_message
from .config import (ACTIVATION_TIERS, SlideConfig, device_update_share_value, resident_embedding_value,
                     resident_layers_value)

logger = logging.getLogger(__name__)

__all__ = ["SlideArgs", "SlideArgsError"]

_ADAMW = ("adamw_torch", "adamw_torch_fused")
_DTYPE_FLAGS = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": None, "fp32": None}


class SlideArgsError(ValueError):
    """The training arguments contradict each other or cannot work with a sliding model."""


@dataclass
class SlideArgs(TrainingArguments):
    """`TrainingArguments` for a sliding model (see `docs/options.md` for every field).

    `gradient_accumulation_steps`, `max_grad_norm` and `bf16` / `fp16` are handed to the engine;
    the `slide_*` fields below are the engine's own settings. The Trainer never autocasts or moves
    the model: the engine holds fp32 masters on the host and computes in `slide_dtype`.
    """

    slide_window: int = field(default=2, metadata={"help": "GPU layer slots (1-16): how many decoder layers are "
                                                           "resident at once; more slots prefetch further ahead."})
    slide_activation_tier: str = field(default="auto", metadata={
        "help": "Where each layer's input waits between forward and backward: 'device' (GPU memory), 'cpu' (pinned "
                "host memory), 'nvme' (files under --slide_nvme_path) or 'auto' (cpu on CUDA, device on CPU)."})
    slide_nvme_path: Optional[str] = field(default=None, metadata={
        "help": "Directory on a fast disk for the 'nvme' activation tier."})
    slide_cpu_threads: Optional[int] = field(default=None, metadata={
        "help": "Threads of the CPU optimizer (default: all cores). Set explicitly on purpose: launchers such as "
                "`accelerate launch` export OMP_NUM_THREADS=1."})
    slide_gpu_memory_limit: Optional[float] = field(default=None, metadata={
        "help": "Cap on this process's GPU memory in GiB (e.g. 24 to emulate a consumer card)."})
    slide_use_kernels: Optional[bool] = field(default=None, metadata={
        "help": "Use the Triton kernels (default: on with CUDA)."})
    slide_pin_memory: Optional[bool] = field(default=None, metadata={
        "help": "Pin the host masters and staging buffers (default: on with CUDA)."})
    slide_dtype: Optional[str] = field(default=None, metadata={
        "help": "Compute / transfer dtype of the layers: bfloat16, float16 or float32. Default: from --bf16 / --fp16, "
                "else bfloat16 on CUDA and float32 on CPU. Masters and Adam moments are always float32."})
    slide_head_chunk_tokens: Optional[int] = field(default=None, metadata={
        "help": "Tokens per chunk of the fused linear-cross-entropy head (default: chosen by the engine)."})
    slide_grad_buffers: int = field(default=4, metadata={
        "help": "Pinned host gradient staging buffers, each one layer large."})
    slide_update_order: str = field(default="arrival", metadata={
        "help": "Order of the CPU updates of one backward: 'arrival' (as gradients come), 'forward' (pending ones "
                "in the order the next forward needs them; helps CPU-bound small batches) or 'hybrid' (arrival during "
                "the backward, forward order for what is left)."})
    slide_head_update: str = field(default="cpu", metadata={
        "help": "Where the head's (final norm + lm_head) AdamW runs when updates happen in backward: 'cpu' (the "
                "CPU worker) or 'device' (streamed through the GPU during the first layers' backward)."})
    slide_resident_layers: str = field(default="auto", metadata={
        "help": "Layers whose master and Adam state stay on the GPU and are updated there: 'auto' (as many as fit "
                "in what the first step left free under the cap, less a margin) or a number (0: none). With "
                "gradient accumulation only a number takes effect."})
    slide_resident_embedding: str = field(default="auto", metadata={
        "help": "Keep the input embedding's master and Adam state on the GPU: 'auto' (when it fits, before the "
                "layers), 'true' or 'false'."})
    slide_device_update_share: str = field(default="auto", metadata={
        "help": "With clipping (max_grad_norm), the share of the host-held layers whose update runs on the GPU "
                "as they are copied in for the next forward, beside the CPU's: 'auto' (balances the CPU's AdamW "
                "against PCIe; about 0.32 on the H200 host) or a number in [0, 1]."})
    slide_check_host_memory: bool = field(default=True, metadata={
        "help": "Refuse to start when the host store (12 bytes per parameter and more) cannot fit in available RAM."})
    slide_debug: bool = field(default=False, metadata={"help": "Verbose logging of the sliding schedule."})

    def __post_init__(self):
        self._reject_contradictions()
        super().__post_init__()
        env_precision = self.mixed_precision           # from --bf16/--fp16, else ACCELERATE_MIXED_PRECISION
        # The engine owns precision: Accelerate must neither autocast the forward (the recompute in backward runs
        # outside that autocast) nor scale the loss (updates happen inside backward).
        self.mixed_precision = "no"
        if self.slide_dtype is None and env_precision in ("bf16", "fp16"):
            self.slide_dtype = "bfloat16" if env_precision == "bf16" else "float16"
        if self.world_size > 1:
            raise SlideArgsError(multi_process_message(self.world_size))
        if self.n_gpu > 1:
            self._n_gpu = 1                              # one device slides; never nn.DataParallel
        if self.resolved_dtype() == torch.float16:
            logger.warning("slide_dtype float16: the sliding engine applies no loss scaling; prefer bfloat16")
        self.to_slide_config()                           # validate every engine setting now
        from .trainer import install_trainer_hook
        install_trainer_hook()

    def _reject_contradictions(self) -> None:
        env = launch_environment()
        if self.fp16 and self.bf16:
            raise SlideArgsError("fp16=True and bf16=True: choose one compute dtype (bf16 is the sliding default)")
        if self.deepspeed or env.use_deepspeed:
            raise SlideArgsError("DeepSpeed is configured together with sliding. They are alternatives: hf_slideformer "
                                 "offloads by itself. Remove --deepspeed (or distributed_type: DEEPSPEED from the "
                                 "accelerate config), or use TrainingArguments without sliding.")
        if self.fsdp or env.use_fsdp:
            raise SlideArgsError("FSDP is configured together with sliding. Remove --fsdp (or distributed_type: FSDP "
                                 "from the accelerate config); for multi-GPU training use FSDP without sliding.")
        if env.world_size > 1:
            raise SlideArgsError(multi_process_message(env.world_size))
        if getattr(self, "activation_checkpointing", None) or getattr(self, "gradient_checkpointing", None):
            raise SlideArgsError("activation_checkpointing / gradient_checkpointing: the sliding engine already "
                                 "recomputes every layer from its saved input; turn it off")
        if self.torch_compile:
            raise SlideArgsError("torch_compile is not supported on a sliding model; turn it off")
        if getattr(self, "use_liger_kernel", False):
            raise SlideArgsError("use_liger_kernel: the sliding engine has its own fused kernels "
                                 "(--slide_use_kernels); turn Liger off")
        if self.label_smoothing_factor:
            raise SlideArgsError("label_smoothing_factor needs the logits, which the sliding head never "
                                 "materializes; set it to 0")
        optim = OptimizerNames(self.optim).value
        if optim not in _ADAMW:
            raise SlideArgsError(f"optim={optim!r}: the sliding engine runs AdamW on the CPU; use optim='adamw_torch'")
        if self.slide_dtype is not None:
            if self.slide_dtype not in _DTYPE_FLAGS:
                raise SlideArgsError(f"slide_dtype {self.slide_dtype!r} is not one of {sorted(_DTYPE_FLAGS)}")
            flag = _DTYPE_FLAGS[self.slide_dtype]
            for name in ("bf16", "fp16"):
                if getattr(self, name) and flag != name:
                    raise SlideArgsError(f"slide_dtype={self.slide_dtype!r} contradicts {name}=True")
        if self.slide_activation_tier not in ACTIVATION_TIERS:
            raise SlideArgsError(f"slide_activation_tier must be one of {ACTIVATION_TIERS}, "
                                 f"got {self.slide_activation_tier!r}")

    @property
    def place_model_on_device(self) -> bool:
        """Never: the engine places each layer itself (a large model would not fit)."""
        return False

    def resolved_dtype(self) -> Optional[torch.dtype]:
        """The engine's compute dtype: `slide_dtype`, else bf16 / fp16 flags, else None (engine default)."""
        name = self.slide_dtype or ("bfloat16" if self.bf16 else "float16" if self.fp16 else None)
        return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "float32": torch.float32, "fp32": torch.float32, None: None}[name]

    def to_slide_config(self) -> SlideConfig:
        """The `SlideConfig` these arguments describe (device, dtype, accumulation, clipping, slide_* fields)."""
        try:
            return SlideConfig(
                device=str(self.device), dtype=self.resolved_dtype(), window=self.slide_window,
                gradient_accumulation_steps=self.gradient_accumulation_steps,
                max_grad_norm=self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else None,
                activation_tier=self.slide_activation_tier, nvme_path=self.slide_nvme_path,
                cpu_threads=self.slide_cpu_threads, pin_memory=self.slide_pin_memory,
                use_kernels=self.slide_use_kernels, gpu_memory_limit=self.slide_gpu_memory_limit,
                head_chunk_tokens=self.slide_head_chunk_tokens, grad_buffers=self.slide_grad_buffers,
                update_order=self.slide_update_order, head_update=self.slide_head_update,
                resident_layers=resident_layers_value(self.slide_resident_layers),
                resident_embedding=resident_embedding_value(self.slide_resident_embedding),
                device_update_share=device_update_share_value(self.slide_device_update_share),
                check_host_memory=self.slide_check_host_memory, debug=self.slide_debug)
        except ValueError as e:
            raise SlideArgsError(f"invalid slide setting: {e}") from e

    @classmethod
    def from_training_args(cls, args: TrainingArguments, **slide_fields) -> "SlideArgs":
        """Upgrade plain `TrainingArguments` (every field copied) to `SlideArgs`."""
        kwargs = {f.name: getattr(args, f.name) for f in fields(args) if f.init}
        kwargs.update(slide_fields)
        return cls(**kwargs)

