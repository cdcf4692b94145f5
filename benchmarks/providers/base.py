"""What a training provider is, and the model building every provider shares.

A provider owns one way of training the benchmark model: it builds model and optimizer in
`setup`, runs one full optimizer step in `train_step`, and says what it did in `report`. The
measuring loop lives in `bench_train.run_worker`, the same for all of them.

Models are random-init Hugging Face models of real shapes. Initialising an 8B model with
`torch.nn.init` on the CPU takes minutes, so the parameters are created on the meta device
(buffers such as RoPE's `inv_freq` stay real) and then materialised where the provider needs
them: filled with `normal_` on the GPU, or by tiling one random block on the CPU (memcpy speed).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["RunSpec", "Provider", "load_config", "build_model", "random_batch", "CONFIG_DIR"]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
INIT_STD = 0.02


@dataclass
class RunSpec:
    """Everything a worker needs to run one provider; travels to the worker as JSON."""

    provider: str = field(metadata={"help": "provider name (slide, hf, ds2, ds3, resident)"})
    model: str = field(metadata={"help": "shape name under benchmarks/configs/ or a path to a config.json"})
    seq: int = field(metadata={"help": "tokens per sequence"})
    batches: list[int] = field(metadata={"help": "batch sizes to try, largest first; the first that fits counts"})
    device: str = field(default="cuda", metadata={"help": "cuda or cpu"})
    dtype: str = field(default="bfloat16", metadata={"help": "compute / parameter dtype on the device"})
    warmup: int = field(default=2, metadata={"help": "untimed steps before the timed ones"})
    steps: int = field(default=5, metadata={"help": "timed steps; the median counts"})
    cap_gib: float | None = field(default=None, metadata={"help": "GPU memory cap for this provider, GiB"})
    lr: float = field(default=1e-5, metadata={"help": "learning rate"})
    checkpointing: str = field(default="auto", metadata={"help": "gradient checkpointing of hf, ds2, ds3, resident: "
                                                             "auto (on only after an OOM), on, off"})
    kernels: str = field(default="none", metadata={"help": "fused kernels of hf, ds2, ds3: auto (Liger if importable, "
                                                       "else triton_ops), liger, triton_ops, none"})
    slide_options: dict[str, Any] = field(default_factory=dict, metadata={"help": "extra SlideConfig fields"})
    seed: int = field(default=0, metadata={"help": "seed of the random tokens and weights"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank of the slide_lora and hf_lora providers"})
    alloc_conf: str = field(default="", metadata={"help": "PYTORCH_CUDA_ALLOC_CONF of the provider's process"})
    nproc: int = field(default=1, metadata={"help": "processes of one launch (data parallel on one host, one GPU "
                                                    "each); batches are per process"})

    def __post_init__(self) -> None:
        if self.checkpointing not in ("auto", "on", "off"):
            raise ValueError(f"checkpointing must be auto, on or off, got {self.checkpointing!r}")
        if self.kernels not in ("auto", "liger", "triton_ops", "none"):
            raise ValueError(f"kernels must be auto, liger, triton_ops or none, got {self.kernels!r}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive, got {self.batches}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls(**json.loads(text))


class Provider:
    """One way of training the model. Subclasses set `name`, `capped` and implement the hooks."""

    name: str = ""
    capped: bool = False  # runs under the consumer-card GPU memory cap
    # What the parent passes when the command line leaves --checkpointing / --kernels unset: the
    # configuration this baseline's users run (docs/benchmarks.md, "Providers"). None: the setting does not apply.
    default_checkpointing: str | None = None
    default_kernels: str | None = None
    # Trains with several processes of one host (`bench_train.py --nproc N`): each process a rank of
    # the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), on its own data.
    multi_process: bool = False

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.device = torch.device(spec.device)
        self.config = load_config(spec.model)
        self.notes: list[str] = []   # facts about this run for the table (kernels used, fallbacks)
        self.n_params = 0
        self.n_linear = 0

    def setup(self) -> None:
        """Build model and optimizer."""
        raise NotImplementedError

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One full optimizer step (forward, backward, update, zero grads); returns the loss."""
        raise NotImplementedError

    def begin_timed(self) -> None:
        """Called right before the timed steps of the batch that is being measured."""

    def after_oom(self, batch: int) -> bool:
        """Clean up after a GPU out-of-memory error; True to retry the same batch (changed settings)."""
        return False

    def report(self) -> dict[str, Any]:
        """Provider-specific results: step breakdown, settings actually used."""
        return {}

    def count(self, model: torch.nn.Module) -> None:
        from benchmarks.harness import linear_params
        seen: set[int] = set()
        total = 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += int(getattr(p, "ds_numel", None) or p.numel())
        self.n_params, self.n_linear = total, linear_params(model)


def load_config(name: str):
    """A transformers config from `configs/<name>.json` or from a path to a config.json."""
    from transformers import AutoConfig

    path = Path(name)
    if not path.is_file():
        path = CONFIG_DIR / f"{name}.json"
    data = json.loads(path.read_text())
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config.use_cache = False
    return config


def attention_of(config) -> str:
    """The attention implementation a benchmark model runs: "sdpa" where the family's HF class
    supports it, else "flex_attention" (gpt-oss: its sinks have no sdpa path in HF), else "eager".

    Eager attention materializes batch x heads x seq x seq scores, which at the benchmark's
    sequence lengths does not fit the capped GPU: it is the last resort, never a silent default.
    """
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    if getattr(model_class, "_supports_sdpa", False):
        return "sdpa"
    if getattr(model_class, "_supports_flex_attn", False):
        return "flex_attention"
    return "eager"


def build_model(config, device: str | torch.device, dtype: torch.dtype, *, fill: str = "normal",
                seed: int = 0) -> torch.nn.Module:
    """A random-init causal LM with the family's attention (`attention_of`: sdpa where HF has it),
    its parameters created directly on `device`.

    fill: "normal" draws every weight with normal_(0, 0.02) on the device (fast on a GPU);
    "tiled" copies one 16M-element random block over and over (fast on a CPU). Norm weights
    are ones and biases zeros either way. Tied weights stay tied.
    """
    model = empty_model(config, dtype)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    block = tiled_block(dtype, seed) if fill == "tiled" else None
    made: dict[int, torch.nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for p_name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                t = torch.empty(p.shape, dtype=dtype, device=device)
                fill_tensor(t, f"{mod_name}.{p_name}", fill, gen, block)
                made[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            module._parameters[p_name] = made[id(p)]
    model.to(device)  # the buffers
    model.tie_weights()
    model.train()
    return model


def empty_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The family's causal LM (`attention_of`'s attention) with its parameters on the meta device
    (no memory) and its buffers built."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_of(config))


def tiled_block(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The random block the "tiled" fill repeats (16M elements, normal(0, INIT_STD), in `dtype`)."""
    return (torch.randn(1 << 24, generator=torch.Generator().manual_seed(seed)) * INIT_STD).to(dtype)


@torch.no_grad()
def fill_tensor(t: torch.Tensor, name: str, fill: str, gen: torch.Generator | None, block: torch.Tensor | None) -> None:
    """Write a benchmark weight: ones for a norm, zeros for another vector, else normal or the tiled block."""
    if t.ndim == 1:
        t.fill_(1.0 if "norm" in name else 0.0)
    elif fill == "normal":
        t.normal_(0.0, INIT_STD, generator=gen)
    else:
        flat = t.view(-1)
        for s in range(0, flat.numel(), block.numel()):
            n = min(block.numel(), flat.numel() - s)
            flat[s:s + n].copy_(block[:n])


def random_batch(vocab: int, batch: int, seq: int, device: torch.device, seed: int = 0):
    """Uniform random token ids (B, S) and labels equal to them (the model shifts)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    return ids, ids.clone()


def call_with_known_fields(cls: Callable, options: dict[str, Any], notes: list[str]):
    """Build a dataclass-style config from `options`, dropping (and noting) fields it lacks."""
    if dataclasses.is_dataclass(cls):
        known = {f.name for f in dataclasses.fields(cls)}
        dropped = sorted(set(options) - known)
        if dropped:
            notes.append(f"{cls.__name__} has no field {', '.join(dropped)}: not passed")
        options = {k: v for k, v in options.items() if k in known}
    return cls(**options)
