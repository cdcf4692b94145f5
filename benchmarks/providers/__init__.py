"""Training providers of `bench_train.py`, one module each (ds2 and ds3 share `deepspeed_zero`).

`get_provider(name)` imports a provider's module only when asked, so a missing optional
dependency (deepspeed, the engine itself) costs that provider's row, not the run.
"""
from __future__ import annotations

import importlib

from .base import Provider, RunSpec

__all__ = ["PROVIDERS", "get_provider", "Provider", "RunSpec"]

# name -> (module, class, runs under the GPU memory cap, one-line description)
PROVIDERS = {
    "slide": ("slide", "SlideProvider", True, "hf_slideformer"),
    "hf": ("hf", "HFProvider", False, "HF GPU-resident training"),
    "ds2": ("deepspeed_zero", "ZeRO2Provider", True, "DeepSpeed ZeRO-2 + CPU optimizer"),
    "ds3": ("deepspeed_zero", "ZeRO3Provider", True, "DeepSpeed ZeRO-3 + CPU params and optimizer"),
    "resident": ("resident", "ResidentProvider", False, "GPU-resident with triton_ops kernels: the compute bound"),
    "slide_8bit": ("slide", "Slide8bitProvider", True, "hf_slideformer, 8-bit AdamW moments (optimizer_state="
                   "adamw_8bit)"),
    "slide_8bit_bf16": ("slide", "Slide8bitBf16Provider", True, "hf_slideformer, 8-bit moments and a bf16 master "
                        "(optimizer_state=adamw_8bit_bf16)"),
    "slide_fp8": ("slide", "SlideFp8Provider", True, "hf_slideformer, the layers' projections in FP8 (matmuls=fp8)"),
    "slide_trainer": ("trainers", "SlideTrainerProvider", True, "hf_slideformer, the step taken by SlideTrainer"),
    "slide_sft": ("trainers", "SlideSFTProvider", True, "hf_slideformer, the step taken by TRL's SFTTrainer"),
    "slide_lora": ("lora", "SlideLoraProvider", True, "hf_slideformer, PEFT LoRA on every linear layer"),
    "hf_lora": ("lora", "HFLoraProvider", False, "PEFT LoRA on the GPU-resident model (checkpointing, kernels)"),
    "hf_lora_offload": ("lora", "HFLoraOffloadProvider", True, "PEFT LoRA, last decoder layers' frozen base "
                        "offloaded to host memory by Accelerate's hooks (checkpointing, kernels)"),
}


def get_provider(name: str) -> type[Provider]:
    """The provider class called `name`."""
    if name not in PROVIDERS:
        raise KeyError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}")
    module, cls, _, _ = PROVIDERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
