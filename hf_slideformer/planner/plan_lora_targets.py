"""What a planned LoRA run adapts, and the adapters PEFT makes of it, from the config alone.

PEFT's `LoraConfig` names its targets two ways, and the planner reads them as PEFT does:

- `target_modules`: linear layers, by name (a module whose full name is a target or ends in
  "." + a target), by a regex that matches the whole name, or "all-linear". A linear layer of
  `in` input and `out` output features gets A (r, in) and B (out, r): r (in + out) parameters;
- `target_parameters`: parameters, by name (the module's name + "." + the parameter's, or its
  end). PEFT's `ParamWrapper` adapts a 3-D weight of shape (E, d1, d2) (the fused experts of
  HF's mixtures of experts: `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` in Qwen3-MoE,
  Qwen3.5-MoE, Mixtral and gpt-oss, `experts.*` in Gemma 4) with A (E r, in) and B (out, E r),
  {in, out} = {d1, d2}: rank r per expert, E r (d1 + d2) parameters; a 2-D weight (out, in) as
  a linear layer (E = 1).

For Qwen3-MoE and Mixtral, PEFT first rewrites `target_modules` that name the experts'
transformers-4 linears (gate_proj / up_proj / down_proj, w1 / w3 / w2) or the router (`gate`)
into `target_parameters`, the fused gate_up_proj at rank 2 r (its `rank_pattern`) when both of its
halves are named; the planner asks the installed PEFT for that rewrite (`_as_peft_converts`).

The planner counts only inside the decoder layers (the engine refuses adapters elsewhere). Its
default, `DEFAULT_TARGET_MODULES` and `DEFAULT_TARGET_PARAMETERS`, is the benchmark's LoRA
(benchmarks/providers/lora.py, `lora_config`): every linear layer of the decoder layer named as the
Llama layout names them and, where the model has experts, both of their fused weights, all at rank
r (the default names only linears the layer has, so PEFT's rewrite of the experts' v4 names, which
would adapt gate_up_proj at 2 r, does not apply to it).

Where a family's layer is the Llama layout by formula (`Family.extra_layer_params`), its linears
are written down from the shape; every other family's layers are read from its own modules
built on the meta device, as `models.registry.layer_params_of` counts them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..models import get_family
from .plan_shape import ModelShape

__all__ = ["DEFAULT_TARGET_MODULES", "DEFAULT_TARGET_PARAMETERS", "LayerTargets", "LoraTargets", "lora_targets",
           "llama_targets", "normalize_targets", "present_linears"]

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGET_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class _Weight:
    """A linear layer or a parameter of one decoder layer, by its full name in the HF model."""

    name: str              # model.layers.<i>.<path>
    shape: tuple           # a linear's weight (out, in); a parameter's own shape
    linear: bool           # a linear layer (target_modules), else a parameter (target_parameters)
    share: float = 1.0     # the share of it one token computes with (top-k of E for routed experts)


@dataclass(frozen=True)
class LayerTargets:
    """What one decoder layer's adapters are, at their ranks."""

    linear_in: int = 0         # the adapted linears' input features, summed
    linear_out: int = 0        # their output features
    linear_params: int = 0     # their adapters' parameters: r (in + out) each
    param_params: int = 0      # the adapted parameters' adapters: E r (d1 + d2) each
    param_numel: int = 0       # the adapted parameters' elements
    param_largest: int = 0     # the largest adapted parameter's elements
    param_active: float = 0.0  # the elements of them one token computes with
    param_rank_numel: int = 0  # r x elements, summed: half the FLOPs of one W + B A


@dataclass(frozen=True)
class LoraTargets:
    """The adapters of every decoder layer, and the names that matched (for the report)."""

    layers: tuple[LayerTargets, ...]
    modules: tuple[str, ...] = ()        # the adapted linears' names within a layer's module (q_proj, ...)
    parameters: tuple[str, ...] = ()     # the adapted parameters' (experts.gate_up_proj, ...)
    ranks: tuple[tuple[str, int], ...] = ()   # targets whose rank PEFT set otherwise (its rank_pattern)

    @property
    def params(self) -> int:
        """LoRA parameters: r (in + out) per linear, E r (d1 + d2) per 3-D parameter."""
        return self.linear_params + self.param_params

    def total(self, field: str) -> float:
        """One `LayerTargets` field summed over the layers (`linear_params`, `param_numel`, ...)."""
        return sum(getattr(layer, field) for layer in self.layers)

    linear_params = property(lambda self: self.total("linear_params"))
    param_params = property(lambda self: self.total("param_params"))        # PEFT's `ParamWrapper` adapters
    param_numel = property(lambda self: self.total("param_numel"))          # each materialized per pass
    param_active = property(lambda self: self.total("param_active"))        # what one token computes with
    param_rank_numel = property(lambda self: self.total("param_rank_numel"))

    def describe(self) -> str:
        """The targets in words: "q_proj, k_proj, v_proj, o_proj and the experts' gate_up_proj, down_proj"."""
        ranks = dict(self.ranks)

        def named(name):
            return f"{name} (rank {ranks[name]})" if name in ranks else name
        parts = [", ".join(map(named, self.modules))] if self.modules else []
        experts = [named(p).removeprefix("experts.") for p in self.parameters if p.startswith("experts.")]
        others = [named(p) for p in self.parameters if not p.startswith("experts.")]
        if experts:
            parts.append("the experts' " + ", ".join(experts))
        if others:
            parts.append(", ".join(others))
        return " and ".join(parts)


def normalize_targets(name: str, value, allow_str: bool):
    """A target list as a tuple of names (None: none), or a str where PEFT takes one ("all-linear",
    a regex); a ValueError naming `name` for anything else."""
    if value is None:
        return ()
    if isinstance(value, str):
        if allow_str:
            return value
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{name} must be a list of names{' or a str (a regex, or all-linear)' if allow_str else ''}, "
                         f"got {value!r}")
    return names


def _name_matches(key: str, targets: tuple[str, ...]) -> bool:
    """PEFT's rule for a list of targets: the full name, or its end after a dot."""
    return key in targets or any(key.endswith("." + t) for t in targets)


def _module_matches(key: str, targets) -> bool:
    if isinstance(targets, str):
        return targets == ALL_LINEAR or re.fullmatch(targets, key) is not None
    return _name_matches(key, targets)


def _llama_weights(shape: ModelShape) -> list[list[_Weight]]:
    """The linears of every layer of a Llama-layout family, from its shape."""
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    hidden, intermediate = shape.hidden, shape.intermediate
    linears = {"self_attn.q_proj": (q_dim, hidden), "self_attn.k_proj": (kv_dim, hidden),
               "self_attn.v_proj": (kv_dim, hidden), "self_attn.o_proj": (hidden, q_dim),
               "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
               "mlp.down_proj": (hidden, intermediate)}
    out = []
    for index in range(shape.layers):
        layer = []
        for path, weight_shape in linears.items():
            layer.append(_Weight(f"model.layers.{index}.{path}", weight_shape, True))
            layer.append(_Weight(f"model.layers.{index}.{path}.weight", weight_shape, False))
        out.append(layer)
    return out


def _meta_model(cfg: dict):
    """The family's causal LM built from `cfg` on the meta device (no memory is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _module_weights(model) -> list[list[_Weight]]:
    """The linears and parameters of every decoder layer of `model`."""
    import torch.nn as nn

    config = model.config
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None)
    out = []
    for index, layer in enumerate(getattr(model, "model", model).layers):
        weights = []
        for path, module in layer.named_modules():
            full = f"model.layers.{index}.{path}" if path else f"model.layers.{index}"
            if isinstance(module, nn.Linear):
                weights.append(_Weight(full, (module.out_features, module.in_features), True))
            routed = type(module).__name__.endswith("Experts") and top_k
            for pname, param in module.named_parameters(recurse=False):
                share = int(top_k) / param.shape[0] if routed and param.dim() == 3 else 1.0
                weights.append(_Weight(f"{full}.{pname}", tuple(param.shape), False, share))
        out.append(weights)
    return out


def present_linears(model, names) -> tuple[str, ...]:
    """The names among `names` that are linear layers of `model`'s decoder layers, in their order (a
    mixture of experts whose MLP is fused experts has no gate_proj / up_proj / down_proj linear)."""
    import torch.nn as nn

    layers = getattr(model, "model", model).layers
    found = {path.split(".")[-1] for layer in layers for path, module in layer.named_modules()
             if isinstance(module, nn.Linear)}
    return tuple(name for name in names if name in found)


def _as_peft_converts(model, r: int, target_modules, target_parameters) -> tuple:
    """(target_modules, target_parameters, rank_pattern) as PEFT rewrites them for a family whose
    experts transformers 5 fused (its `convert_peft_config_for_transformers`): Qwen3-MoE's and
    Mixtral's v4 expert names (gate_proj / up_proj / down_proj, w1 / w3 / w2) and router (`gate`)
    become `target_parameters`, the fused gate_up_proj at rank 2 r when both of its halves are
    named. Unchanged for the other families, or where this PEFT has no such rewrite."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers, get_model_conversion_mapping,
        )
    except ImportError:
        return target_modules, target_parameters, {}
    config = LoraConfig(r=r, target_modules=(target_modules if isinstance(target_modules, str)
                                             else list(target_modules) or None),
                        target_parameters=list(target_parameters) or None)
    convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    modules = config.target_modules
    modules = modules if isinstance(modules, str) else tuple(sorted(modules or ()))
    return modules, tuple(sorted(config.target_parameters or ())), dict(config.rank_pattern or {})


def _rank(key: str, r: int, rank_pattern: dict) -> int:
    """PEFT's rank for a target (`peft.utils.other.get_pattern_key`: the first pattern that
    matches the end of the name)."""
    for pattern, rank in rank_pattern.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return int(rank)
    return r


def _short(key: str, linear: bool) -> str:
    """A weight's name within its layer's module: q_proj; experts.gate_up_proj."""
    parts = key.split(".")
    return parts[-1] if linear else ".".join(parts[-2:])


def lora_targets(cfg: dict, shape: ModelShape, r: int, target_modules=DEFAULT_TARGET_MODULES,
                 target_parameters=DEFAULT_TARGET_PARAMETERS) -> LoraTargets:
    """The adapters of rank `r` PEFT makes in each decoder layer for these targets (PEFT's
    matching rules, and its rewrite of the targets for Qwen3-MoE and Mixtral).

    Raises:
        ValueError: a targeted parameter PEFT cannot adapt (not 2-D or 3-D), targets PEFT refuses
            (one half of a fused weight), or targets that match nothing inside the decoder layers.
    """
    default_modules = target_modules is DEFAULT_TARGET_MODULES    # not the same names given explicitly
    target_modules = normalize_targets("lora_target_modules", target_modules, allow_str=True)
    target_parameters = normalize_targets("lora_target_parameters", target_parameters, allow_str=False)
    asked = (target_modules, target_parameters)
    rank_pattern = {}
    if get_family(shape.model_type).extra_layer_params is not None:
        weights = _llama_weights(shape)
    else:
        model = _meta_model(cfg)
        if default_modules:                   # the default names only the linears the layer has
            target_modules = present_linears(model, target_modules)
        target_modules, target_parameters, rank_pattern = _as_peft_converts(model, r, target_modules,
                                                                            target_parameters)
        weights = _module_weights(model)
    layers, modules, params, ranks = [], {}, {}, {}
    for layer in weights:
        totals = dict(linear_in=0, linear_out=0, linear_params=0, param_params=0, param_numel=0, param_largest=0,
                 param_active=0.0, param_rank_numel=0)
        for weight in layer:
            if weight.linear:
                if not _module_matches(weight.name, target_modules):
                    continue
                rank = _rank(weight.name, r, rank_pattern)
                totals["linear_out"] += weight.shape[0]
                totals["linear_in"] += weight.shape[1]
                totals["linear_params"] += rank * (weight.shape[0] + weight.shape[1])
                short = _short(weight.name, True)
                modules[short] = None
            else:
                if not target_parameters or not _name_matches(weight.name, target_parameters):
                    continue
                if len(weight.shape) not in (2, 3):
                    raise ValueError(f"lora_target_parameters: {weight.name} has shape {tuple(weight.shape)}; "
                                     "PEFT adapts 2-D and 3-D parameters only")
                rank = _rank(weight.name, r, rank_pattern)
                experts, d1, d2 = weight.shape if len(weight.shape) == 3 else (1, *weight.shape)
                numel = experts * d1 * d2
                totals["param_params"] += experts * rank * (d1 + d2)
                totals["param_numel"] += numel
                totals["param_largest"] = max(totals["param_largest"], numel)
                totals["param_active"] += numel * weight.share
                totals["param_rank_numel"] += rank * numel
                short = _short(weight.name, False)
                params[short] = None
            if rank != r:
                ranks[short] = rank
        layers.append(LayerTargets(**totals))
    targets = LoraTargets(tuple(layers), tuple(modules), tuple(params), tuple(ranks.items()))
    if asked[0] and not modules and targets.params:      # a misspelt name would plan the rest silently
        raise ValueError(f"lora_target_modules={asked[0]!r} match no linear layer of a {shape.model_type} decoder "
                         "layer; name its linears (q_proj, ...), or none (an empty list) to adapt the parameters alone")
    if not targets.params:
        raise ValueError(f"the LoRA targets (lora_target_modules={asked[0]!r}, lora_target_parameters="
                         f"{asked[1]!r}) match no linear layer or parameter of a {shape.model_type} decoder layer")
    return targets


def llama_targets(shape: ModelShape, r: int) -> LoraTargets:
    """Every linear layer of a Llama-layout layer (the 7 projections) at rank r, from the shape alone."""
    return lora_targets({}, replace(shape, model_type="llama"), r, DEFAULT_TARGET_MODULES, ())
