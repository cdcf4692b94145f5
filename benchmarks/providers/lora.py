"""LoRA rows: `slide_lora` (hf_slideformer with a PEFT model) and `hf_lora` (PEFT on the GPU-resident model).

Both put a LoRA adapter of rank `RunSpec.lora_r` (alpha 2r, no dropout) on every linear layer of
the decoder layers, as a PEFT user does for instruction tuning. `hf_lora` is what a LoRA user
with a GPU large enough for the model runs: bf16 weights on the GPU, the fused kernels
(`recipe.apply_kernels`), HF's gradient checkpointing and `torch.optim.AdamW(fused=True)` over
the adapters (fp32: PEFT keeps adapters of a bf16 model in fp32). `slide_lora` slides the same
PEFT model under the GPU memory cap: the frozen base streams, the adapters stay on the GPU.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Provider, build_model, call_with_known_fields
from .recipe import apply_kernels, enable_checkpointing

__all__ = ["SlideLoraProvider", "HFLoraProvider", "LINEAR_TARGETS"]

LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, r: int):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LINEAR_TARGETS))


def _adapter_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class SlideLoraProvider(Provider):
    name = "slide_lora"
    capped = True

    def setup(self) -> None:
        import hf_slideformer as hs

        base = build_model(self.config, "cpu", self.spec.torch_dtype, fill="tiled", seed=self.spec.seed)
        self.count(base)
        self.model = _lora(base, self.spec.lora_r)
        options = {"device": self.spec.device, "dtype": self.spec.torch_dtype}
        if self.spec.cap_gib is not None and self.device.type == "cuda":
            options["gpu_memory_limit"] = self.spec.cap_gib
        options.update(self.spec.slide_options)
        self.slide_config = call_with_known_fields(hs.SlideConfig, options, self.notes)
        self.model = hs.slide(self.model, self.slide_config)
        self.notes.append(f"LoRA r={self.spec.lora_r} on every linear layer: {_adapter_params(self.model) / 1e6:.1f}M "
                          "adapter parameters")
        self.optimizer = self.model.create_optimizer(lr=self.spec.lr)

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def after_oom(self, batch: int) -> bool:
        self.optimizer.zero_grad()
        return False

    def report(self) -> dict[str, Any]:
        return {"lora_r": self.spec.lora_r, "slide_stats": dict(self.model.slide_stats())}


class HFLoraProvider(Provider):
    name = "hf_lora"
    capped = False
    default_checkpointing = "on"
    default_kernels = "auto"

    def setup(self) -> None:
        base = build_model(self.config, self.device, self.spec.torch_dtype, seed=self.spec.seed,
                           fill="normal" if self.device.type == "cuda" else "tiled")
        self.count(base)
        self.kernels = apply_kernels(base, self.spec.kernels)
        self.notes.append(f"kernels: {self.kernels}")
        self.model = _lora(base, self.spec.lora_r)
        self.checkpointing = self.spec.checkpointing == "on"
        if self.checkpointing:
            enable_checkpointing(self.model.get_base_model())
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.notes.append(f"LoRA r={self.spec.lora_r}: {sum(p.numel() for p in params) / 1e6:.1f}M adapter "
                          f"parameters ({params[0].dtype})")
        self.optimizer = torch.optim.AdamW(params, lr=self.spec.lr, weight_decay=0.0,
                                           fused=self.device.type == "cuda")

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def after_oom(self, batch: int) -> bool:
        self.optimizer.zero_grad(set_to_none=True)
        return False

    def report(self) -> dict[str, Any]:
        return {"lora_r": self.spec.lora_r, "gradient_checkpointing": self.checkpointing, "kernels": self.kernels}
