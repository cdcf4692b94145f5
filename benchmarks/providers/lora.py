"""LoRA rows: `slide_lora`, `hf_lora` and `hf_lora_offload`, PEFT LoRA three ways.

All three put a LoRA adapter of rank `RunSpec.lora_r` (alpha 2r, no dropout) on every linear layer
of the decoder layers, as a PEFT user does for instruction tuning; `slide_lora` and `hf_lora` also
on the experts' fused 3-D weights of a mixture of experts (`target_parameters`, PEFT's
`ParamWrapper`: rank r per expert), where the model has them (`lora_config`). `hf_lora` is what a LoRA user
with a GPU large enough for the model runs: bf16 weights on the GPU, the fused kernels
(`recipe.apply_kernels`), HF's gradient checkpointing and `torch.optim.AdamW(fused=True)` over
the adapters (fp32: PEFT keeps adapters of a bf16 model in fp32). `hf_lora_offload` is the same
recipe for a user whose GPU is too small: Accelerate's big-model hooks keep the frozen base of the
last decoder layers in host memory, under the GPU memory cap. `slide_lora` slides the same PEFT
model under the cap: the frozen base streams, the adapters stay on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import GIB
from hf_slideformer.planner.plan_lora_targets import present_linears

from .base import INIT_STD, attention_of, build_model, fill_tensor
from .hf import HFProvider
from .recipe import apply_kernels, enable_checkpointing
from .slide import SlideProvider

__all__ = ["SlideLoraProvider", "HFLoraProvider", "HFLoraOffloadProvider", "OffloadPlan", "plan_offload",
           "LINEAR_TARGETS", "EXPERT_TARGETS", "lora_config"]

LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_TARGETS = ["gate_up_proj", "down_proj"]       # the fused expert weights of HF's MoE modules
# hf_lora_offload's activation reserve, per decoder layer's (B, S, H) checkpointed input: the input itself
# and as much again for what the checkpointed forward keeps besides (hf_lora, GPU-resident, batch 16 on
# the 8B shape: 33.9 GiB allocated at peak, 15 of them weights; docs/benchmarks.md)
CHECKPOINT_COPIES = 2
RECOMPUTE_COPIES = 4     # (B, S, I) activations alive at the recompute peak of one MLP


def lora_config(model, r: int, experts: bool = True):
    """PEFT's LoraConfig of these rows for `model` (on any device, meta too): rank r, alpha 2r, no
    dropout, on every linear layer of `LINEAR_TARGETS` the decoder layer has and, with `experts`, on the 3-D expert
    weights of `EXPERT_TARGETS` of each module named `experts` (Qwen3-MoE, Mixtral, Qwen3.5-MoE,
    gpt-oss, Gemma 4's MoE), named by their path below the decoder layer (`mlp.experts.down_proj`)."""
    from peft import LoraConfig

    layer = model.get_decoder().layers[0]
    params = [f"{path}.{name}" for path, module in layer.named_modules() if path.split(".")[-1] == "experts"
              for name in EXPERT_TARGETS if getattr(module, name, None) is not None
              and getattr(module, name).dim() == 3] if experts else []
    # Only the linears the layer has: on fused experts PEFT would rewrite gate_proj / up_proj /
    # down_proj into the experts' weights, gate_up_proj at rank 2r beside target_parameters' r.
    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                      target_modules=list(present_linears(model, LINEAR_TARGETS)),
                      target_parameters=params or None)


def _lora(model, r: int, experts: bool = True):
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model, r, experts))


def _experts_note(lora) -> str:
    """What the row's LoRA adapts besides the linears (read before PEFT, which extends the list)."""
    return f" and the experts' {', '.join(lora.target_parameters)}" if lora.target_parameters else ""


def _adapter_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class SlideLoraProvider(SlideProvider):
    """The PEFT model built on the meta device and slid with its base frozen from the start (as
    `SlideModel.from_pretrained(path, peft_config=...)` does), its store then filled with random
    weights: the model is never in host memory twice, so a base larger than half of it trains."""

    name = "slide_lora"
    multi_process = False      # the engine refuses frozen parameters with several processes

    def build_slid(self):
        import hf_slideformer as hs
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        from hf_slideformer.engine.lora import peft_on_meta

        with init_empty_weights(include_buffers=False):
            base = AutoModelForCausalLM.from_config(self.config, dtype=self.spec.torch_dtype,
                                                    attn_implementation=attention_of(self.config))
        self.count(base)
        r = self.spec.lora_r
        lora = lora_config(base, r)
        note = f"LoRA r={r} on every linear layer{_experts_note(lora)}"
        model = peft_on_meta(base, lora)
        self.notes.append(f"{note}: {_adapter_params(model) / 1e6:.1f}M adapter parameters")
        model = hs.slide(model, self.slide_config, _fill=False)        # the weights are written below
        block = (torch.randn(1 << 24, generator=torch.Generator().manual_seed(self.spec.seed)) * INIT_STD)
        store = model.slide_engine.store
        for u in store.units:
            for e in u.entries:
                fill_tensor(e.view(u.master), e.name, "tiled", None, block)
        return model

    def report(self) -> dict[str, Any]:
        return {"lora_r": self.spec.lora_r, **super().report()}


class HFLoraProvider(HFProvider):
    name = "hf_lora"

    def setup(self) -> None:
        super().setup()                   # the bf16 model on the GPU, the kernels, HF's checkpointing
        from peft import get_peft_model

        lora = lora_config(self.model, self.spec.lora_r)
        note = f"LoRA r={self.spec.lora_r}{_experts_note(lora)}"
        self.model = get_peft_model(self.model, lora)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.notes.append(f"{note}: {sum(p.numel() for p in params) / 1e6:.1f}M adapter parameters ({params[0].dtype})")
        self.optimizer = torch.optim.AdamW(params, lr=self.spec.lr, weight_decay=0.0,
                                           fused=self.device.type == "cuda")

    def report(self) -> dict[str, Any]:
        return {"lora_r": self.spec.lora_r, "gradient_checkpointing": self.checkpointing, "kernels": self.kernels}


@dataclass
class OffloadPlan:
    """Which decoder layers of `hf_lora_offload` keep their frozen base weights on the execution device.

    Attributes:
        base_layers: per decoder layer, the module names of its LoRA layers' frozen `base_layer`s.
        gpu_layers: the first this many layers stay on the execution device; the others are offloaded.
        layer_bytes: bytes of one decoder layer's frozen base weights.
        fixed_bytes: bytes resident on the GPU whatever the split (0 on a CPU run).
        reserve_bytes: bytes set aside for activations; None on a CPU run (no cap).
    """

    base_layers: list[list[str]]
    gpu_layers: int
    layer_bytes: int
    fixed_bytes: int
    reserve_bytes: int | None

    @property
    def n_layers(self) -> int:
        return len(self.base_layers)

    @property
    def n_offloaded(self) -> int:
        return self.n_layers - self.gpu_layers

    @property
    def offloaded_modules(self) -> list[str]:
        return [name for names in self.base_layers[self.gpu_layers:] for name in names]

    @property
    def offloaded_bytes(self) -> int:
        return self.n_offloaded * self.layer_bytes

    @property
    def h2d_bytes_per_step(self) -> int:
        return 2 * self.offloaded_bytes      # the forward and the checkpointed recompute


def plan_offload(model: torch.nn.Module, cap_bytes: int | None, batch: int, seq: int,
                 dtype: torch.dtype) -> OffloadPlan:
    """The split of `HFLoraOffloadProvider`'s rule for a PEFT-wrapped Hugging Face causal LM.

    Args:
        model: the causal LM inside the PEFT model (`get_base_model()`), on any device, meta too.
        cap_bytes: the GPU memory cap; None on a CPU run (half the layers offloaded).
        batch, seq: the largest batch that will run, and its tokens per sequence.
        dtype: the dtype of the activations.
    """
    from peft.tuners.lora import LoraLayer

    layers = model.get_decoder().layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    bases = [[f"{prefix}.{i}.{n}.base_layer" for n, m in layer.named_modules() if isinstance(m, LoraLayer)]
             for i, layer in enumerate(layers)]
    layer_bytes = sum(_tensor_bytes(model.get_submodule(n)) for n in bases[0])
    n_layers = len(layers)
    if cap_bytes is None:
        return OffloadPlan(bases, n_layers // 2, layer_bytes, fixed_bytes=0, reserve_bytes=None)
    adapters = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    fixed = _tensor_bytes(model) - n_layers * layer_bytes + 3 * adapters     # + gradient and two moments
    config, tokens, d = model.config, batch * seq, dtype.itemsize
    reserve = (CHECKPOINT_COPIES * n_layers * tokens * config.hidden_size * d
               + RECOMPUTE_COPIES * tokens * config.intermediate_size * d + 2 * GIB)
    fit = max(0, cap_bytes - reserve - fixed) // layer_bytes
    return OffloadPlan(bases, min(n_layers, fit), layer_bytes, fixed, reserve)


class HFLoraOffloadProvider(HFProvider):
    """PEFT LoRA on a bf16 model whose last decoder layers keep their frozen base weights in host memory.

    What a Hugging Face user runs today when the model does not fit the GPU: `hf_lora`'s recipe
    (LoRA r on every linear layer, fp32 adapters, fused kernels, HF's gradient checkpointing,
    `torch.optim.AdamW(fused=True)` over the adapters) with Accelerate's big-model offload. The
    model is built on the CPU, LoRA is applied there, then `accelerate.dispatch_model` places it
    with a device map in which only the `...base_layer` (the frozen `nn.Linear`) of an offloaded
    decoder layer is on "cpu"; its adapters, its norms and every other module are on the GPU.
    Their `AlignDevicesHook(offload=True)` copies those weights in (pageable, as from a loaded
    state dict) at each forward and again at the checkpointed recompute, and drops them after.
    The adapters are ordinary GPU parameters: the optimizer updates the tensors the forward uses.

    Layers kept on the GPU: as many as fit in `cap - reserve - fixed`, where `fixed` is what is
    resident whatever the split (embeddings, head, norms, the adapters with their fp32 gradient
    and AdamW moments) and `reserve`, for the activations of the largest batch B at S tokens, is
    `2*L*B*S*H*d` (the decoder layers' checkpointed inputs, and as much again for what the
    checkpointed forward keeps besides, calibrated on `hf_lora`'s measured peak) `+ 4*B*S*I*d`
    (the recompute peak of one MLP) `+ 2 GiB`, with d the bytes of the dtype. The last layers are offloaded first, as
    `infer_auto_device_map` does. A smaller batch tried after an out-of-memory one keeps the
    split. On a CPU run (no cap) half the layers are offloaded to the CPU itself, so that the
    same hooks run. Gradient checkpointing is always on: without it autograd keeps every copied
    weight until the backward, and offloading saves nothing.
    """

    name = "hf_lora_offload"
    capped = True

    def setup(self) -> None:
        if self.spec.checkpointing == "off":
            raise ValueError(f"{self.name} needs gradient checkpointing: without it every offloaded weight "
                             "copied to the GPU stays there until the backward")
        cuda = self.device.type == "cuda"
        self.exec_device = torch.device("cuda", torch.cuda.current_device()) if cuda else self.device
        base = build_model(self.config, "cpu", self.spec.torch_dtype, fill="tiled", seed=self.spec.seed)
        self.count(base)
        self.kernels = apply_kernels(base, self.spec.kernels)
        self.notes.append(f"kernels: {self.kernels}")
        enable_checkpointing(base)
        self.checkpointing = True
        # on the CPU: the adapters exist before dispatch; the linears only (its offload plan moves the
        # frozen `base_layer` of each LoRA linear)
        self.model = _lora(base, self.spec.lora_r, experts=False)
        cap = None
        if cuda:
            cap = (int(self.spec.cap_gib * GIB) if self.spec.cap_gib is not None
                   else torch.cuda.get_device_properties(self.exec_device).total_memory)
        self.plan = plan_offload(base, cap, self.spec.batches[0], self.spec.seq, self.spec.torch_dtype)
        _dispatch(base, self.plan.offloaded_modules, self.exec_device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        misplaced = [n for n, p in self.model.named_parameters() if p.requires_grad and p.device != self.exec_device]
        if misplaced:
            raise RuntimeError(f"{len(misplaced)} adapter parameters are not on {self.exec_device} after dispatch, "
                               f"e.g. {misplaced[0]}")
        self.optimizer = torch.optim.AdamW(params, lr=self.spec.lr, weight_decay=0.0, fused=cuda)
        self._grads_checked = False
        plan = self.plan
        self.notes.append(f"LoRA r={self.spec.lora_r}: {_adapter_params(self.model) / 1e6:.1f}M adapter parameters "
                          f"({params[0].dtype}) on {self.exec_device}")
        self.notes.append(f"{plan.n_offloaded} of {plan.n_layers} decoder layers offloaded: "
                          f"{plan.offloaded_bytes / GIB:.2f} GiB of frozen base weights in host memory, copied in "
                          f"at the forward and the recompute: {plan.h2d_bytes_per_step / GIB:.2f} GiB per step")
        if plan.reserve_bytes is not None:
            self.notes.append(f"{plan.gpu_layers} decoder layers on the GPU: {plan.reserve_bytes / GIB:.1f} GiB "
                              f"reserved for activations at batch {self.spec.batches[0]}, {plan.fixed_bytes / GIB:.1f} "
                              "GiB fixed (embeddings, head, adapters with gradients and AdamW moments)")

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss(input_ids, labels)
        loss.backward()
        if not self._grads_checked:
            self._check_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _check_grads(self) -> None:
        """Raise unless every adapter the optimizer holds is the model's own, with a gradient on the device."""
        held = [p for group in self.optimizer.param_groups for p in group["params"]]
        live = {id(p) for p in self.model.parameters() if p.requires_grad}
        stale = [p for p in held if id(p) not in live or p.grad is None or p.grad.device != self.exec_device]
        if stale or len(live) != len(held):
            raise RuntimeError(f"{len(stale)} of {len(held)} adapter parameters got no gradient on {self.exec_device} "
                               f"in the first backward ({len(live)} in the model): the adapters would not train")
        self._grads_checked = True

    def report(self) -> dict[str, Any]:
        plan = self.plan
        return {"lora_r": self.spec.lora_r, "gradient_checkpointing": self.checkpointing, "kernels": self.kernels,
                "gpu_layers": plan.gpu_layers, "offloaded_layers": plan.n_offloaded,
                "offloaded_bytes": plan.offloaded_bytes, "h2d_bytes_per_step": plan.h2d_bytes_per_step,
                "activation_reserve_bytes": plan.reserve_bytes, "fixed_bytes": plan.fixed_bytes}


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters, a tied one counted once."""
    return sum(p.nbytes for p in {id(p): p for p in module.parameters()}.values())


def _device_map(model: torch.nn.Module, offloaded: set[str], device: torch.device) -> dict[str, Any]:
    """Module name -> device: each offloaded module "cpu", each largest subtree holding none `device`."""
    out: dict[str, Any] = {}

    def walk(name: str, module: torch.nn.Module) -> None:
        holds = any(o.startswith(f"{name}.") for o in offloaded) if name else bool(offloaded)
        if name in offloaded:
            out[name] = "cpu"
        elif holds:
            for child_name, child in module.named_children():
                walk(f"{name}.{child_name}" if name else child_name, child)
        elif next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
            out[name] = device

    walk("", model)
    return out


def _dispatch(model: torch.nn.Module, offloaded: list[str], device: torch.device) -> None:
    """Attach Accelerate's big-model hooks: the `offloaded` modules' weights in host memory, the rest on `device`.

    On a GPU this is `dispatch_model` with the device map. `dispatch_model` offloads nothing when
    the execution device is the CPU itself, so a CPU run attaches the same hooks as it would.
    """
    from accelerate import dispatch_model
    from accelerate.hooks import attach_align_device_hook_on_blocks
    from accelerate.utils import OffloadedWeightsLoader, extract_submodules_state_dict

    names = set(offloaded)
    device_map = _device_map(model, names, device)
    if device.type == "cuda" or not names:
        dispatch_model(model, device_map, main_device=device)
        return
    weights = OffloadedWeightsLoader(state_dict=extract_submodules_state_dict(model.state_dict(), offloaded))
    attach_align_device_hook_on_blocks(model, execution_device={**dict.fromkeys(device_map, device), "": device},
                                       offload={n: n in names for n in device_map}, weights_map=weights)
