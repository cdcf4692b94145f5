"""Family adapters.

An adapter names the parts of an HF causal LM that the engine slides: the token embedding, the
decoder layers, the final norm and the lm_head. Masks, RoPE, GQA and sliding-window attention stay
with the HF model's own code: the base model's forward runs unchanged and calls the layers, whose
forward the engine replaces by a sliding proxy. So every family whose decoder follows the
Llama layout (embed_tokens / layers / norm / lm_head, layers that take the hidden states and
return them) is supported by one adapter; families only differ in what they need checked.
Which families those are is the registry's (`registry.FAMILIES`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..modules_to_save import trained_copy
from .registry import FAMILIES, SUPPORTED_MODEL_TYPES, get_family

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderAdapter", "get_adapter"]


@dataclass(frozen=True)
class DecoderAdapter:
    """Accessors for a Llama-layout decoder-only causal LM."""

    model_type: str
    base_attr: str = "model"

    def base(self, model: nn.Module) -> nn.Module:
        return getattr(model, self.base_attr)

    def embed(self, model: nn.Module) -> nn.Embedding:
        """The input embedding; under PEFT `modules_to_save`, its trainable copy (modules_to_save.py)."""
        return trained_copy(self.base(model).embed_tokens)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self.base(model).layers

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.base(model).norm

    def lm_head(self, model: nn.Module) -> nn.Linear:
        """The lm_head; under PEFT `modules_to_save`, its trainable copy (modules_to_save.py)."""
        return trained_copy(model.lm_head)

    def rotary(self, model: nn.Module) -> nn.Module | None:
        return getattr(self.base(model), "rotary_emb", None)

    def output_projection(self, layer: nn.Module) -> nn.Linear | None:
        """The layer's last linear, whose output only feeds the layer's closing residual add.

        In these families a decoder layer ends with `hidden = residual + mlp.down_proj(...)`: no
        gradient inside the layer reads that product's value, so the engine's recompute in
        backward can skip it. None (nothing skipped) when `down_proj` is not a plain
        `nn.Linear` or a LoRA wrapper of one (a quantized layer, say).
        """
        proj = getattr(getattr(layer, "mlp", None), "down_proj", None)
        # A LoRA wrapper adds its adapter's branch to its frozen linear's product: the linear's
        # output is skipped the same way, and the branch is computed as usual (the adapter's
        # gradients need it).
        proj = getattr(proj, "base_layer", proj)
        return proj if type(proj) is nn.Linear else None

    def check(self, model: nn.Module) -> None:
        """Raise if this model instance uses something the engine cannot reproduce exactly."""
        cfg = model.config
        if getattr(cfg, "attention_dropout", 0.0):
            raise NotImplementedError(
                f"attention_dropout={cfg.attention_dropout} is not supported: recompute in backward would draw "
                "different dropout masks. Set config.attention_dropout = 0.0 (the value every supported "
                "checkpoint ships with)."
            )
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            raise NotImplementedError("pretraining_tp > 1 is not supported; set config.pretraining_tp = 1")
        head = self.lm_head(model)
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("an lm_head with a bias is not supported")


_ADAPTERS = {name: DecoderAdapter(name, f.base_attr) for name, f in FAMILIES.items()}


def get_adapter(model_type: str) -> DecoderAdapter:
    """The adapter for `model_type` (a `registry.FAMILIES` entry), or a ValueError naming the supported ones."""
    return _ADAPTERS[get_family(model_type).model_type]
