"""SlideConfig: every knob of the sliding engine, validated once and passed whole to each part.

The fields below are the settings table (see `options.py`): each carries its help, what it
accepts and where users write it. `SlideArgs`, `SlidePlugin` and docs/options.md are derived
from them. After `slide()`, `model.slide_config` is a read-only view (`ReadOnlySlideConfig`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from .options import (DTYPES, FLOAT16_REFUSED, Auto, Bool, Choice, ClipNorm, Device, Directory, DType, Float, Int,
                      option, settings_of)

__all__ = ["SlideConfig", "ReadOnlySlideConfig", "SETTINGS", "DTYPES", "ACTIVATION_TIERS", "FLOAT16_REFUSED",
           "configure_logging"]

ACTIVATION_TIERS = ("auto", "device", "cpu", "nvme")
PACKAGE_LOGGER = "hf_slideformer"


def _host_cores() -> int:
    return os.cpu_count() or 1


def worker_threads(cores: int) -> int:
    """The CPU optimizer's threads on `cores` cores: on more than 4, one core stays with the main
    thread, which feeds the GPU."""
    return cores - 1 if cores > 4 else cores


@dataclass
class SlideConfig:
    """Settings of the sliding engine; one field per option (help and accepted values: docs/options.md).

    Every value is checked by type and range at construction (`ValueError` naming the field and
    saying what to use); None and "auto" are resolved for the device here, so the engine reads
    plain values. float16 is refused: the engine applies each update inside backward, where
    `torch.amp.GradScaler` can neither unscale nor skip it; use bfloat16.
    """

    device: str | None = option(None, Device(), "Compute device.", none="'cuda' when available, else 'cpu'",
                                surfaces=(), elsewhere="SlideArgs: the Trainer's device (use_cpu); "
                                                       "yaml: the Accelerator's device")
    dtype: torch.dtype | str | None = option(
        None, DType(),
        "Compute and transfer dtype of the layers on the device. Master weights and Adam moments are always "
        "float32 on the host. float16 is refused (updates run inside backward, where GradScaler cannot unscale "
        "or skip them): use bfloat16.",
        none="bfloat16 on CUDA, float32 on CPU (SlideArgs: --bf16 picks bfloat16; yaml: mixed_precision)")
    window: int = option(2, Int(1, 16), "GPU layer slots: how many decoder layers are on the device at once; more "
                                        "slots prefetch further ahead.")
    gradient_accumulation_steps: int = option(
        1, Int(1), "Backward passes per optimizer step (yaml: also given to the Accelerator).",
        surfaces=("plugin",), elsewhere="SlideArgs: the Trainer's gradient_accumulation_steps")
    max_grad_norm: float | None = option(
        None, ClipNorm(),
        "Global gradient-norm clipping threshold, as torch.nn.utils.clip_grad_norm_, applied by the engine at "
        "optimizer.step() (it must be known before backward: with Accelerate it is this setting, not an "
        "accelerator.clip_grad_norm_ call); 0 or less turns clipping off.",
        none="no clipping", surfaces=("plugin",), elsewhere="SlideArgs: the Trainer's max_grad_norm")
    activation_tier: str = option(
        "auto", Choice(*ACTIVATION_TIERS),
        "Where each layer's input waits between forward and backward: 'device' (GPU memory), 'cpu' (pinned host "
        "memory), 'nvme' (files under nvme_path), or 'auto' ('cpu' on CUDA, 'device' on CPU).")
    nvme_path: str | None = option(
        None, Directory(), "Directory on a fast disk for the 'nvme' activation tier and for the state files of the "
                           "layers that do not fit in host_memory_limit. Its parent must exist; the directory itself "
                           "is created if missing.",
        none="unset (the 'nvme' tier needs it, and host_memory_limit where its split puts a layer on disk)")
    host_memory_limit: float | str | None = option(
        None, Auto(Float(0.0, lo_open=True, unit="GiB")),
        "Host memory the unit state may take, in GiB: the fp32 masters, AdamW moments and gradient accumulators "
        "of the units held in host memory, plus a few pinned buffers of one layer each. What does not fit goes to "
        "a preallocated file under nvme_path, read in and written back around each use: first the AdamW moments "
        "of the last decoder layers (their masters stay in host memory), then, when every layer's moments are on "
        "disk, the whole state of the last layers (docs/disk.md). 'auto': the host's available memory at slide() "
        "less 20% (at least 4 GiB) for the rest of the process. Not with several processes.",
        none="no limit: every unit's state in host memory")
    cpu_threads: int | None = option(
        None, Int(1, _host_cores, "at most the cores of this host"),
        "Threads of the CPU optimizer. Set explicitly because launchers such as `accelerate launch` export "
        "OMP_NUM_THREADS=1. More threads than the host has cores are refused (the OpenMP runtime fails on them).",
        none="all cores; all but one (the main thread's) on hosts of more than 4 cores; with several processes, "
             "each process that of its share of the cores")
    pin_memory: bool | None = option(None, Bool(), "Pin the host masters and staging buffers.", none="True on CUDA")
    use_kernels: bool | None = option(None, Bool(), "Use the Triton kernels of `triton_ops`.",
                                      none="True on CUDA (with Triton)")
    gpu_memory_limit: float | None = option(
        None, Float(0.0, lo_open=True, unit="GiB"), "Cap on this process's GPU memory, in GiB (e.g. 24 to emulate "
                                                    "a consumer card).", none="no cap")
    head_chunk_tokens: int | None = option(None, Int(1), "Tokens per chunk of the fused linear-cross-entropy head.",
                                           none="chosen by the engine")
    mlp_chunk_tokens: int | None = option(
        None, Int(1), "Tokens per chunk of each layer's MLP (forward, recompute and backward): at long sequences "
                      "its intermediates, not the layer input, fill the GPU; chunked, one chunk's are alive at a "
                      "time (tiled_mlp.py). Gradients equal the whole MLP's within rounding.",
        none="the whole sequence at once")
    grad_buffers: int = option(
        4, Int(1), "Pinned host gradient staging buffers, each one layer large; the head's gradient borrows them "
                   "between forward and backward. 3 saves one layer's gradient of host memory and is as fast "
                   "where the GPU is the bound; where the CPU paces the step more buffers let the backward run "
                   "further ahead of the host AdamW (3 was slower there, 8 faster: docs/benchmarks.md).")
    late_layer_updates: int | str = option(
        "auto", Auto(Int(0)),
        "With updates in backward (one micro-batch, no clipping) and the embedding on the host: the first layers "
        "of each backward (the top ones) whose update waits for its end and runs during the next forward, so that "
        "the CPU worker is not behind when the backward ends (docs/engine.md). 'auto': as many as the embedding's "
        "whole-table update at the worker's front takes (3 at Llama-3-8B); layer 0's update then waits for the "
        "embedding's batch rows, so that the next forward gathers them meanwhile; 0 turns both off. Each late layer "
        "costs one layer's gradient of pinned host memory (bf16).")
    resident_layers: int | str = option(
        "auto", Auto(Int(0)),
        "Layers whose master and Adam state live on the GPU and are updated there (layers 0..k-1). 'auto' measures "
        "the first optimizer step and keeps as many as fit in what it left free under the cap, less a margin (10%, "
        "at least 2 GiB), after the embedding; 0 turns them off. With gradient accumulation only a number takes "
        "effect. With several processes (data parallel) none: 'auto' means 0. See docs/engine.md.")
    resident_embedding: bool | str = option(
        "auto", Auto(Bool()), "Keep the input embedding's master and Adam state on the GPU too ('auto': when it "
                              "fits, decided with resident_layers, before the layers; never with several processes).")
    device_update_share: float | str = option(
        "auto", Auto(Float(0.0, 1.0)),
        "The share of the host-held layers whose update runs on the GPU, beside the CPU's updates of the others: "
        "with clipping as they are copied in for the next forward; without clipping (one backward per step) in "
        "the backward, from the gradients still on the device, which pays where the CPU's AdamW bounds the step. "
        "'auto': with clipping the share that balances the CPU's AdamW rate against the PCIe bandwidth on CUDA "
        "(about 0.32 on the H200 host); without clipping 0; 0 on the CPU device and with several processes. "
        "See docs/engine.md.")
    expandable_segments: bool = option(
        True, Bool(),
        "Turn on the CUDA caching allocator's expandable segments for the process when the model is slid, unless "
        "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF sets expandable_segments. With fixed segments the reserved "
        "peak runs far above the allocated one, and the resident plan, which measures it, has that much less room.")
    host_adam: str = option(
        "auto", Choice("auto", "native", "torch"),
        "The kernel of the host AdamW: 'native' (a vectorised, threaded C kernel compiled for this CPU on first "
        "use: one pass that reads the compute-dtype gradient and the fp32 master and moments), 'torch' (torch's "
        "fused CPU AdamW; a bf16 gradient is widened first) or 'auto' ('native' where a C compiler is found). "
        "Both follow torch.optim.AdamW.")
    optimizer_state: str = option(
        "adamw", Choice("adamw", "adamw_8bit", "adamw_8bit_bf16"),
        "What the host AdamW keeps per trainable parameter (docs/host_state.md): 'adamw' (fp32 master and moments, "
        "12 bytes, torch.optim.AdamW bit for bit), 'adamw_8bit' (8-bit block-wise moments as bitsandbytes' "
        "AdamW8bit, about 6 bytes) or 'adamw_8bit_bf16' (those and a bf16 master with stochastic rounding, about 4 "
        "bytes). The embedding keeps the format where its hidden size is a multiple of 256 (else 'adamw'), and "
        "'adamw' when resident_embedding=True (its state then lives on the GPU; 'auto' keeps it on the host). "
        "Resident layers and device-updated layers keep the compact format on the GPU too, and under "
        "host_memory_limit the layers on disk keep it in their records; the compact formats run in one process "
        "(SlideArgs: also from the Trainer's optim, e.g. adamw_8bit).")
    matmuls: str = option(
        "dtype", Choice("dtype", "fp8", "fp8_gw_hp"),
        "How the decoder layers' linear projections (q, k, v, o, gate, up, down) multiply, in their forward, "
        "recompute and backward: 'dtype' (in the compute dtype), 'fp8' (e4m3 with row-wise power-of-two scales "
        "through torch._scaled_mm, torchao's float8 rowwise recipe; docs/fp8.md) or 'fp8_gw_hp' (torchao's "
        "rowwise_with_gw_hp: the same forward, dgrad against a tensor-wise weight, the weight gradient in the "
        "compute dtype, as AdamW reads it; wgrad then runs at the bf16 rate). The loss head, norms, attention, "
        "the embedding, the fp32 masters and AdamW are unchanged. 'fp8' needs a CUDA GPU of compute capability 8.9 "
        "or newer and dtype bfloat16 (SlideArgs: also --slide_matmuls fp8; yaml: also mixed_precision: fp8).")
    nonfinite_grads: str = option(
        "skip", Choice("skip", "raise"),
        "A step whose gradients are not finite (inf or NaN): 'skip' leaves the weights and AdamW state of every "
        "unit it has not updated yet untouched and logs a warning naming the step (with clipping or accumulation "
        "no unit is updated: the whole step is skipped); 'raise' stops training with an error instead. Either way "
        "no master takes a non-finite value from a gradient. See docs/reliability.md.")
    check_host_memory: bool = option(True, Bool(), "Refuse to start when the host store (12 bytes per parameter "
                                                   "and more) cannot fit in available memory.")
    check_finite_weights: bool = option(
        True, Bool(), "Refuse a model whose weights hold inf or NaN, at slide() and when a checkpoint is loaded "
                      "(NonFiniteWeightError names the parameter): every step of such a model would be skipped as a "
                      "non-finite gradient. False lets such a model in anyway (to repair its weights, say).")
    rank_timeout: float = option(
        600.0, Float(lo=1.0),
        "Data-parallel launches: seconds a rank waits for its peers at a step boundary before it stops with an "
        "error (a rank that runs more steps than the others, or one that died). Longer than any step and any "
        "save of a rank 0 (the others wait for it). See docs/reliability.md.")
    debug: bool = option(False, Bool(), "Log the package's messages (logger 'hf_slideformer') at DEBUG level.")

    def __post_init__(self):
        for name, opt in SETTINGS.items():
            setattr(self, name, opt.check(getattr(self, name), f"SlideConfig.{name}"))
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("SlideConfig.device='cuda' but CUDA is not available; use device='cpu'")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = str(dev)
        self.dtype = DTYPES[self.dtype] if self.dtype else torch.bfloat16 if dev.type == "cuda" else torch.float32
        if self.activation_tier == "auto":
            self.activation_tier = "cpu" if dev.type == "cuda" else "device"
        if self.activation_tier == "nvme" and not self.nvme_path:
            raise ValueError("SlideConfig.activation_tier='nvme' needs nvme_path (a directory on a fast disk)")
        # host_memory_limit needs nvme_path only where its split puts a layer on disk: at slide()
        # (disk_plan.plan_disk_units), once the units' sizes are known.
        self._check_optimizer_state()
        # None: the host's cores (data_parallel.py gives each of several processes its share of them).
        self._auto_threads = self.cpu_threads is None
        if self.cpu_threads is None:
            self.cpu_threads = worker_threads(_host_cores())
        if self.pin_memory is None:
            self.pin_memory = dev.type == "cuda"
        if self.use_kernels is None:
            self.use_kernels = dev.type == "cuda"

    def _check_optimizer_state(self) -> None:
        """A compact optimizer state updates host units in the native kernel and GPU units (resident
        layers, the device-updated share) in torch ops: refuse the torch host route, and resolve a
        resident embedding's 'auto' to the host (host_optim.embed_format)."""
        if self.optimizer_state == "adamw":
            return
        if self.host_adam == "torch":
            raise ValueError(f"SlideConfig.optimizer_state={self.optimizer_state!r} does not support host_adam='torch' "
                             "(the compact host update is in the native kernel: use 'auto' or 'native')")
        if self.resident_embedding == "auto":
            # the embedding's state is in the compact format on the host: a resident one keeps fp32
            # AdamW on the GPU, which only resident_embedding=True asks for (host_optim.embed_format)
            self.resident_embedding = False

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def deferred(self) -> bool:
        """Whether updates may have to wait for optimizer.step() (accumulation or clipping)."""
        return self.gradient_accumulation_steps > 1 or self.max_grad_norm is not None

    def read_only(self) -> "ReadOnlySlideConfig":
        """A view of this config that refuses assignment and shows later changes the engine makes."""
        view = object.__new__(ReadOnlySlideConfig)
        object.__setattr__(view, "__dict__", self.__dict__)
        return view


SETTINGS = settings_of(SlideConfig)


class ReadOnlySlideConfig(SlideConfig):
    """`model.slide_config` after `slide()`: the engine's settings, read-only.

    The engine was built for these values (slots, buffers, resident plan, accumulation), so a
    field set directly would change the math behind its back. Between optimizer steps,
    accumulation and clipping change through `model.slide_engine.configure_steps(...)` (the
    Trainer does this from its arguments); anything else needs a fresh `slide()`. Copies
    (`copy.copy`, `dataclasses.replace`, pickling) are plain, writable `SlideConfig`s.
    """

    def __new__(cls, *args, **kwargs):
        # dataclasses.replace() and copy/pickle construct through the class: give them a SlideConfig.
        return SlideConfig(*args, **kwargs) if args or kwargs else object.__new__(SlideConfig)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(
            f"model.slide_config is read-only after slide() (setting {name}={value!r}): the engine was built for "
            "these settings. Change accumulation or clipping between optimizer steps with "
            "model.slide_engine.configure_steps(gradient_accumulation_steps, max_grad_norm); for anything else "
            "slide a fresh model with a new SlideConfig.")

    def __delattr__(self, name):
        self.__setattr__(name, None)

    def __eq__(self, other):
        if not isinstance(other, SlideConfig):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in SETTINGS)

    __hash__ = None


def configure_logging(config: SlideConfig) -> None:
    """`config.debug`: the package logger logs at DEBUG (with a stderr handler if logging is unconfigured)."""
    if not config.debug:
        return
    pkg = logging.getLogger(PACKAGE_LOGGER)
    pkg.setLevel(logging.DEBUG)
    if not pkg.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        pkg.addHandler(handler)
