"""Family adapters.

An adapter names the parts of an HF causal LM that the engine slides: the token embedding, the
decoder layers, the final norm and the lm_head. Masks, RoPE, GQA and sliding-window attention stay
with the HF model's own code: the base model's forward runs unchanged and calls the layers, whose
forward the engine replaces by a sliding proxy. So every family whose decoder follows the
Llama layout (embed_tokens / layers / norm / lm_head, layers that take the hidden states and
return them) is supported by one adapter; families differ in what their registry entry
(`registry.Family`) says: which layer classes and types are proven, whether the MLP's last
projection feeds the residual, the embedding scale and the logit transform, all read here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..engine.modules_to_save import trained_copy
from .registry import FAMILIES, SUPPORTED_MODEL_TYPES, Family, LogitTransform, get_family

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderAdapter", "get_adapter"]


@dataclass(frozen=True)
class DecoderAdapter:
    """Accessors for a Llama-layout decoder-only causal LM."""

    model_type: str
    base_attr: str = "model"

    @property
    def family(self) -> Family:
        """The registry entry this adapter is made from."""
        return FAMILIES[self.model_type]

    def embedding_scale(self, model: nn.Module) -> float | None:
        """The factor the family's embedding module multiplies its rows by (the engine's embedding
        applies it), or None."""
        scale = self.family.embedding_scale
        return None if scale is None else scale(model.config)

    def router_aux(self, model: nn.Module, layers):
        """A mixture of experts' `router_aux.RouterAux` (each forward says whether it computes the
        auxiliary load-balancing loss: `output_router_logits`), else None."""
        family = self.family
        if family.router_class is None:
            return None
        from ..compute.router_aux import RouterAux
        return RouterAux(model, layers, family.router_class)

    def logit_transform(self, model: nn.Module) -> LogitTransform:
        """What the family's causal LM does to the logits before its loss (the loss head does the same)."""
        return self.family.final_logits(model.config)

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
        `nn.Linear` or a LoRA wrapper of one (a quantized layer, say), and in families whose
        MLP feeds a norm before the residual (`Family.mlp_feeds_residual`: Gemma, OLMo), where
        the norm's backward reads that product.
        """
        if not self.family.mlp_feeds_residual:
            return None
        proj = getattr(getattr(layer, "mlp", None), "down_proj", None)
        # A LoRA wrapper adds its adapter's branch to its frozen linear's product: the linear's
        # output is skipped the same way, and the branch is computed as usual (the adapter's
        # gradients need it).
        proj = getattr(proj, "base_layer", proj)
        return proj if type(proj) is nn.Linear else None

    def check(self, model: nn.Module) -> None:
        """Raise if this model instance uses something the engine cannot reproduce exactly."""
        cfg, family = model.config, self.family
        for key in family.dropouts:
            if getattr(cfg, key, 0.0):
                raise NotImplementedError(
                    f"{key}={getattr(cfg, key)} is not supported: recompute in backward would draw "
                    f"different dropout masks. Set config.{key} = 0.0 (the value every supported "
                    "checkpoint ships with)."
                )
        parts = family.unsupported(cfg)
        if parts:
            raise NotImplementedError(
                f"{self.model_type}: {'; '.join(parts)} {'is' if len(parts) == 1 else 'are'} not supported by the "
                "sliding engine yet; use a checkpoint of the family without them (docs/models.md lists which)")
        layers = self.layers(model)
        foreign = sorted({type(layer).__name__ for layer in layers} - set(family.layer_classes))
        if foreign:
            raise NotImplementedError(
                f"decoder layer class {', '.join(foreign)} is not one the engine handles for {self.model_type} "
                f"(the family's layers: {', '.join(family.layer_classes)}); the layers' structure decides "
                "what the engine recomputes and skips")
        types = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(family.layer_types))
        if types:
            raise NotImplementedError(f"layer type(s) {', '.join(types)} of config.layer_types are not supported "
                                      f"for {self.model_type} (supported: {', '.join(family.layer_types)})")
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            raise NotImplementedError("pretraining_tp > 1 is not supported; set config.pretraining_tp = 1")
        head = self.lm_head(model)
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("an lm_head with a bias is not supported")


_ADAPTERS = {name: DecoderAdapter(name, f.base_attr) for name, f in FAMILIES.items()}


def get_adapter(model_type: str) -> DecoderAdapter:
    """The adapter for `model_type` (a `registry.FAMILIES` entry), or a ValueError naming the supported ones."""
    return _ADAPTERS[get_family(model_type).model_type]
