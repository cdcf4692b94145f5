"""A model's shape for the planner: its config.json read (`load_model_config`) and the parameters
of what the engine slides counted from the config's sizes (`model_shape`), without building it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..models import LayerDims, get_family

__all__ = ["ModelShape", "load_model_config", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-layout decoder: what the engine slides, in parameters."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    layer_params: int        # one decoder layer
    embed_params: int        # the token embedding (V * H)
    head_params: int         # final norm + lm_head (the norm alone when tied)
    max_positions: int | None = None     # the config's max_position_embeddings
    active_layer_params: int | None = None   # one token's share of a layer (a mixture of experts: top-k); None: all
    moe: bool = False                    # routed experts: the MLP has no down_proj product to skip
    linear_attention_layers: int = 0     # layers of linear attention (Qwen3.5's gated delta rule)
    linear_width: int = 0                # their value width: value heads x value head dim

    @property
    def n_params(self) -> int:
        return self.embed_params + self.layers * self.layer_params + self.head_params

    @property
    def compute_layer_params(self) -> int:
        """A layer's parameters one token computes with (the GPU's FLOPs): top-k of a mixture of
        experts' routed experts, every parameter of a dense layer."""
        return self.active_layer_params or self.layer_params

    @property
    def skipped_product_params(self) -> int:
        """The weights of the product the recompute skips (down_proj, I x H; none with routed experts)."""
        return 0 if self.moe else self.intermediate * self.hidden

    @property
    def head_slot_params(self) -> int:
        """Parameters in the GPU head slot: norm + lm_head, or norm + the tied embedding."""
        return self.head_params + (self.embed_params if self.tied else 0)


def load_model_config(config_or_path) -> dict:
    """The config as a dict, from a dict, an HF config object, a model directory or a config.json path."""
    if isinstance(config_or_path, dict):
        return dict(config_or_path)
    if hasattr(config_or_path, "to_dict"):
        return config_or_path.to_dict()
    path = os.fspath(config_or_path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{os.path.dirname(path)!r} holds no config.json: pass a model directory "
                                    "with a config.json, or the path of a config.json")
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} does not exist: pass a model directory with a config.json, or the path "
                                "of a config.json (hub ids are not fetched: download the model's config.json first)")
    with open(path, encoding="utf-8") as config_file:
        try:
            cfg = json.load(config_file)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path!r} is not valid JSON: {error}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path!r} does not hold a JSON object")
    return cfg


def model_shape(cfg: dict) -> ModelShape:
    """Count the parameters of a supported family from its config (HF's layouts, biases and norms)."""
    model_type = cfg.get("model_type")
    family = get_family(model_type)      # ValueError naming the supported model types
    try:
        hidden, intermediate, layers, vocab = (int(cfg[k]) for k in ("hidden_size", "intermediate_size",
                                                                     "num_hidden_layers", "vocab_size"))
        nh = int(cfg["num_attention_heads"])
    except KeyError as error:
        raise ValueError(f"config.json lacks {error.args[0]!r}, which a {model_type} config must have") from None
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or hidden // nh)
    layer = family.layer_params(cfg, LayerDims(hidden=hidden, intermediate=intermediate, q=nh * hd, kv=nkv * hd,
                                               head_dim=hd))
    tied = bool(cfg.get("tie_word_embeddings", True))               # PretrainedConfig's default
    maxpos = cfg.get("max_position_embeddings")
    moe = family.router_class is not None
    active = family.active_layer_params(cfg, LayerDims(hidden=hidden, intermediate=intermediate, q=nh * hd,
                                                       kv=nkv * hd, head_dim=hd)) if moe else None
    return ModelShape(model_type, hidden, intermediate, layers, vocab, nh, nkv, hd, tied, layer_params=layer,
                      embed_params=vocab * hidden, head_params=hidden + (0 if tied else vocab * hidden),
                      max_positions=int(maxpos) if maxpos else None, active_layer_params=active, moe=moe,
                      linear_attention_layers=_linear_attention_layers(cfg, family),
                      linear_width=int(cfg.get("linear_num_value_heads", 0)) * int(cfg.get("linear_value_head_dim", 0)))


def _linear_attention_layers(cfg: dict, family) -> int:
    """How many layers are of linear attention: from the config's `layer_types`, or, where a family
    that has them leaves it out, from the layer types its config class derives."""
    if "linear_attention" not in family.layer_types:
        return 0
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        from transformers import AutoConfig

        settings = {key: value for key, value in cfg.items() if key not in ("model_type", "architectures")}
        layer_types = AutoConfig.for_model(cfg["model_type"], **settings).layer_types
    return sum(kind == "linear_attention" for kind in layer_types)
