"""Training providers of `bench_train.py`, one module each (ds2 and ds3 share `deepspeed_zero`).

`get_provider(name)` imports a provider's module only when asked, so a missing optional
dependency (deepspeed, the engine itself) costs that provider's row, not the run.
"""
from __future__ import annotations

import importlib

from .base import Provider, RunSpec

__all__ = ["PROVIDERS", "get_provider", "Provider", "RunSpec"]

# name -> (module, class, one-line description for --help and the docs)
PROVIDERS = {
    "slide": ("slide", "SlideProvider", "hf_slideformer, GPU capped"),
    "hf": ("hf", "HFProvider", "HF GPU-resident training, uncapped"),
    "ds2": ("deepspeed_zero", "ZeRO2Provider", "DeepSpeed ZeRO-2 + CPU optimizer, GPU capped"),
    "ds3": ("deepspeed_zero", "ZeRO3Provider", "DeepSpeed ZeRO-3 + CPU params and optimizer, GPU capped"),
    "resident": ("resident", "ResidentProvider", "GPU-resident with triton_ops kernels: the compute bound"),
}


def get_provider(name: str) -> type[Provider]:
    """The provider class called `name`."""
    if name not in PROVIDERS:
        raise KeyError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}")
    module, cls, _ = PROVIDERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
