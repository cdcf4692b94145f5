"""SlideConfig: every knob of the sliding engine, validated once and passed whole to each part."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

__all__ = ["SlideConfig"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
ACTIVATION_TIERS = ("auto", "device", "cpu", "nvme")


@dataclass
class SlideConfig:
    """Settings of the sliding engine.

    Args:
        device: Compute device, "cuda" (or "cuda:N") or "cpu". Default: "cuda" when available.
        dtype: Compute and transfer dtype of the layers on the device. Default: bfloat16 on CUDA,
            float32 on CPU. Master weights and Adam moments are always float32 on the host.
        window: Number of GPU layer slots (1-16). More slots prefetch further ahead.
        gradient_accumulation_steps: Backward passes per optimizer step.
        max_grad_norm: Global gradient-norm clipping threshold, as torch.nn.utils.clip_grad_norm_.
        activation_tier: Where each layer's input is kept between forward and backward:
            "device" (GPU memory), "cpu" (pinned host memory), "nvme" (files under `nvme_path`),
            or "auto" ("cpu" on CUDA, "device" on CPU).
        nvme_path: Directory for the "nvme" activation tier.
        cpu_threads: Threads for the CPU optimizer (default: all cores but one, which the main
            thread needs to keep the GPU fed). Set explicitly because
            launchers such as `accelerate launch` export OMP_NUM_THREADS=1.
        pin_memory: Pin the host masters and staging buffers (default: True on CUDA).
        use_kernels: Use the Triton kernels of `triton_ops` (default: True on CUDA with Triton).
        gpu_memory_limit: Cap on this process's GPU memory, in GiB (emulates a smaller card).
        head_chunk_tokens: Tokens per chunk of the fused linear-cross-entropy head (default: auto).
        grad_buffers: Pinned host gradient staging buffers, each one layer large; the head's
            gradient borrows them between forward and backward. 4 by default: where the CPU
            paces the step (3B, batch 8) 3 buffers were 5% slower; where the GPU does (8B, batch
            16) 3 were as fast and save one layer's fp32 gradient of host memory (0.87 GB at 8B).
        update_order: Order of the CPU updates of one backward: "arrival" (as the gradients come,
            L-1 .. 0) or "forward" (those still pending run in the order the next forward needs
            them). "forward" helps when the CPU is the bound (small batches); "hybrid" keeps
            arrival order during the backward and forward order for what is left when it ends
            (measured on the H200: no faster than "arrival" once resident units take the CPU's
            critical work); see docs/engine.md.
        head_update: Where the head's (final norm + lm_head) AdamW runs when updates happen in
            backward (no clipping, no accumulation): "cpu" (default) on the worker, first;
            "device" streams its fp32 master, moments and gradient through the GPU during the
            first layers' backward, in pieces, and leaves the worker to the layers (not for a tied
            lm_head whose embedding is on the host: its update joins the embedding's there).
            Measured slower at 8B (9.6 k against 10.0 k tokens/s): the streamed pieces share the
            copy engines with the layers' gradients. See docs/engine.md.
        resident_layers: Layers whose master and Adam state live on the GPU and are updated there
            (layers 0..k-1). "auto" (default) measures the first optimizer step and keeps as many
            as fit in the memory it left free under the cap (after the embedding, see
            resident_embedding), less a margin (10%, at least 2 GiB);
            0 turns them off. With clipping each keeps its gradient on the GPU until
            optimizer.step(). With gradient accumulation only a number takes effect (each sums its
            micro-batches on the GPU; "auto" keeps none there, the embedding stays on the host).
            See docs/engine.md.
        resident_embedding: Keep the input embedding's master and Adam state on the GPU too
            ("auto": when it fits, decided with resident_layers, before the layers; True/False).
        device_update_share: With clipping (with or without accumulation), the share of the
            layers the GPU does not keep resident whose update runs on the GPU as they are
            copied in for the next forward, in parallel with the CPU's updates of the others
            (their master, moments and gradient cross PCIe both ways). "auto" (default): the share
            that balances the CPU's AdamW rate against the PCIe bandwidth on CUDA (about 0.32 on the H200 host),
            0 on the CPU device. A float in [0, 1] fixes it. See docs/engine.md.
        expandable_segments: Turn on the CUDA caching allocator's expandable segments for the
            process when the model is slid (unless PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF
            already sets expandable_segments). The window, the activations and the head allocate
            and free buffers of many sizes; with fixed segments the reserved peak ran far above
            the allocated one (8B under 24 GiB: 23.8 GiB reserved for 14.8 allocated, 5d7ea7a), and the
            resident plan, which measures the reserved peak, had that much less room (with them
            the 8B embedding became resident). See docs/engine.md.
        host_adam: The kernel of the host AdamW: "native" (a vectorised, threaded C kernel compiled
            for this CPU on first use and cached: one pass per chunk that reads the compute-dtype
            gradient, the fp32 master and moments and writes them back), "torch" (torch's fused
            CPU AdamW, which needs an fp32 gradient: a bf16 gradient is widened first), or "auto"
            (default: "native" where a C compiler is found, else "torch" with a notice). Both
            follow torch.optim.AdamW; see docs/engine.md.
        check_host_memory: Refuse to start when the host store cannot fit in available memory.
        debug: Verbose logging of the schedule.
    """

    device: str | None = None
    dtype: torch.dtype | str | None = None
    window: int = 2
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    activation_tier: str = "auto"
    nvme_path: str | None = None
    cpu_threads: int | None = None
    pin_memory: bool | None = None
    use_kernels: bool | None = None
    gpu_memory_limit: float | None = None
    head_chunk_tokens: int | None = None
    grad_buffers: int = 4
    update_order: str = "arrival"
    head_update: str = "cpu"
    resident_layers: int | str = "auto"
    resident_embedding: bool | str = "auto"
    device_update_share: float | str = "auto"
    expandable_segments: bool = True
    host_adam: str = "auto"
    check_host_memory: bool = True
    debug: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(self.device)
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"SlideConfig.device must be 'cuda' or 'cpu', got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("SlideConfig.device='cuda' but CUDA is not available; use device='cpu'")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = str(dev)
        if isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise ValueError(f"SlideConfig.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
            self.dtype = _DTYPES[self.dtype]
        if self.dtype is None:
            self.dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"SlideConfig.dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if not isinstance(self.window, int) or not 1 <= self.window <= 16:
            raise ValueError(f"SlideConfig.window must be an int in [1, 16], got {self.window!r}")
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise ValueError("SlideConfig.gradient_accumulation_steps must be an int >= 1, "
                             f"got {self.gradient_accumulation_steps!r}")
        if self.max_grad_norm is not None:
            if self.max_grad_norm <= 0:
                self.max_grad_norm = None  # HF's convention: 0 disables clipping
            else:
                self.max_grad_norm = float(self.max_grad_norm)
        if self.activation_tier not in ACTIVATION_TIERS:
            raise ValueError(f"SlideConfig.activation_tier must be one of {ACTIVATION_TIERS}, got {self.activation_tier!r}")
        if self.activation_tier == "auto":
            self.activation_tier = "cpu" if dev.type == "cuda" else "device"
        if self.activation_tier == "nvme" and not self.nvme_path:
            raise ValueError("SlideConfig.activation_tier='nvme' needs nvme_path (a directory on a fast disk)")
        if self.cpu_threads is None:
            # On larger hosts one core stays with the main thread, which issues the GPU work.
            cores = os.cpu_count() or 1
            self.cpu_threads = cores - 1 if cores > 4 else cores
        if self.cpu_threads < 1:
            raise ValueError(f"SlideConfig.cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.pin_memory is None:
            self.pin_memory = dev.type == "cuda"
        if self.use_kernels is None:
            self.use_kernels = dev.type == "cuda"
        if self.gpu_memory_limit is not None and self.gpu_memory_limit <= 0:
            raise ValueError(f"SlideConfig.gpu_memory_limit must be a positive number of GiB, got {self.gpu_memory_limit}")
        if self.head_update not in ("cpu", "device"):
            raise ValueError(f"SlideConfig.head_update must be 'cpu' or 'device', got {self.head_update!r}")
        if self.update_order not in ("arrival", "forward", "hybrid"):
            raise ValueError(f"SlideConfig.update_order must be 'arrival', 'forward' or 'hybrid', got {self.update_order!r}")
        if self.resident_layers != "auto" and (isinstance(self.resident_layers, bool)
                                               or not isinstance(self.resident_layers, int) or self.resident_layers < 0):
            raise ValueError(f"SlideConfig.resident_layers must be 'auto' or an int >= 0, got {self.resident_layers!r}")
        if self.resident_embedding not in ("auto", True, False):
            raise ValueError(f"SlideConfig.resident_embedding must be 'auto', True or False, got {self.resident_embedding!r}")
        if self.device_update_share != "auto":
            share = self.device_update_share
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                raise ValueError("SlideConfig.device_update_share must be 'auto' or a number in [0, 1], "
                                 f"got {share!r}")
            self.device_update_share = float(share)
        if self.host_adam not in ("auto", "native", "torch"):
            raise ValueError(f"SlideConfig.host_adam must be 'auto', 'native' or 'torch', got {self.host_adam!r}")
        if self.grad_buffers < 1:
            raise ValueError(f"SlideConfig.grad_buffers must be >= 1, got {self.grad_buffers}")

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


def resident_layers_value(value):
    """'auto' or a count, from a command-line / yaml string or an int."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


def device_update_share_value(value):
    """'auto' or a share in [0, 1], from a command-line / yaml string or a number."""
    if isinstance(value, str) and value.strip().lower() != "auto":
        try:
            return float(value)
        except ValueError:
            return value
    return value


def resident_embedding_value(value):
    """'auto', True or False, from a command-line / yaml string or a bool."""
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "1", "on"):
            return True
        if low in ("false", "no", "0", "off"):
            return False
    return value
