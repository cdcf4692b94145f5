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

from .base import INIT_STD, fill_tensor
from .hf import HFProvider
from .slide import SlideProvider

__all__ = ["SlideLoraProvider", "HFLoraProvider", "LINEAR_TARGETS"]

LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, r: int):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LINEAR_TARGETS))


def _adapter_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class SlideLoraProvider(SlideProvider):
    """The PEFT model built on the meta device and slid with its base frozen from the start (as
    `SlideModel.from_pretrained(path, peft_config=...)` does), its store then filled with random
    weights: the model is never in host memory twice, so a base larger than half of it trains."""

    name = "slide_lora"

    def build_slid(self):
        import hf_slideformer as hs
        from accelerate import init_empty_weights
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM

        from hf_slideformer.lora import peft_on_meta

        with init_empty_weights(include_buffers=False):
            base = AutoModelForCausalLM.from_config(self.config, dtype=self.spec.torch_dtype,
                                                    attn_implementation="sdpa")
        self.count(base)
        r = self.spec.lora_r
        model = peft_on_meta(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LINEAR_TARGETS))
        self.notes.append(f"LoRA r={r} on every linear layer: {_adapter_params(model) / 1e6:.1f}M adapter parameters")
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
        self.model = _lora(self.model, self.spec.lora_r)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.notes.append(f"LoRA r={self.spec.lora_r}: {sum(p.numel() for p in params) / 1e6:.1f}M adapter "
                          f"parameters ({params[0].dtype})")
        self.optimizer = torch.optim.AdamW(params, lr=self.spec.lr, weight_decay=0.0,
                                           fused=self.device.type == "cuda")

    def report(self) -> dict[str, Any]:
        return {"lora_r": self.spec.lora_r, "gradient_checkpointing": self.checkpointing, "kernels": self.kernels}
