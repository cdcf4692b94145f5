"""Swap the fused ops into a Hugging Face causal LM, and take them out again.

What `patch(model)` changes, for the families of hf_slideformer's registry whose entry lists
`kernels` (`hf_slideformer.models.FAMILIES`, listed by `supported_families()`), and only the ops
that entry lists (a family's op that differs keeps HF's module):

- "rms_norm": every `*RMSNorm` module: its `forward` becomes `triton_ops.rms_norm` (instance
  attribute), with the Llama casting, or with Gemma's (1 + w) scale and casting where the entry
  says `norm_offset` (`offset=True`); its backward writes dx over the incoming gradient, but in
  the norms the entry names as feeding the residual add (`residual_norms`), whose incoming
  gradient the residual still carries;
- "swiglu": every `*MLP` module with gate / up / down projections and a SiLU activation:
  `forward` uses the fused `swiglu`;
- "geglu": the same MLPs with the tanh GeLU (`gelu_pytorch_tanh`, Gemma's): the fused `geglu`;
- "rope": the family's `apply_rotary_pos_emb` (a module-level function the attention layers look
  up at call time) becomes `triton_ops.rope`. Such a module-level swap is not per model: it
  lasts while at least one model of that family is patched (a count per family and function);
- "gated_delta": likewise the family's `torch_chunk_gated_delta_rule` (transformers' torch path
  of the linear-attention layers, which it takes when flash-linear-attention is not installed)
  becomes `triton_ops.gated_delta.chunk_gated_delta_rule`: the same mathematics in fp32, the
  scan over chunks with its own backward. Where `fla` is installed, its kernels stay;
- "causal_conv": likewise the family's `causal_conv1d_fn` (the linear-attention layers'
  depthwise causal convolution and SiLU, transformers' torch path without the causal-conv1d
  package) becomes `triton_ops.causal_conv`, which reads and writes the projection's layout in
  place of cuDNN's grouped convolution over a transposed copy; a call the kernel does not cover
  (a bias, another activation) runs the original. Where `causal_conv1d` is installed, it stays;
- "gated_norm": every `*RMSNormGated` module (Qwen3.5's norm of the linear attention's output,
  times SiLU of its gate): `forward` becomes `triton_ops.gated_rms_norm`;
- the causal LM's `forward`: with labels, the loss comes from `linear_cross_entropy` on the
  final hidden states, with the family's logit transform (Granite's divisor, Gemma's
  soft-capping), and the logits are not materialized (`logits` is None in the output); without
  labels, the original forward runs.

Each op dispatches at call time, so a patched model on CPU keeps computing the reference
mathematics. `unpatch(model)` or `handle.revert()` restores the originals.

`patched_op(module)` says which op a module's forward became, and `rows_forward(module, give)`
is that forward for an output that FP8 projections read next: the same output, whose e4m3 rows
the same kernel writes and hands to `give` (the FP8 mode's `hf_slideformer.compute.layer_matmuls`).
"""
from __future__ import annotations

import importlib
import importlib.util
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import triton_ops

__all__ = ["PatchHandle", "patch", "unpatch", "supported_families", "patched_op", "rows_forward"]

_ATTR = "_triton_ops_patch"
# (modeling module name, function name) -> (original function, patched models of that module)
_function_patches: dict[tuple[str, str], tuple[object, int]] = {}


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # Only linear layers (or the in-place rope) read this norm's output (the norms feeding the
    # residual take _residual_norm_forward: note [Why a residual norm's backward is out of place]),
    # so its incoming gradient is not shared and dx may overwrite it.
    return triton_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon, in_place_backward=True)


def _offset_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # Gemma's (1 + w) norm, under the same contract as _rms_norm_forward.
    return triton_ops.rms_norm(hidden_states, self.weight, self.eps, in_place_backward=True, offset=True)


def _residual_offset_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # Gemma's post-norms: their output is added to the residual, whose gradient is the very tensor
    # this backward receives, so dx goes to a buffer of its own.
    return triton_ops.rms_norm(hidden_states, self.weight, self.eps, in_place_backward=False, offset=True)


def _residual_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # A Llama-cast norm feeding the residual add: as _residual_offset_norm_forward.
    return triton_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon, in_place_backward=False)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(triton_ops.swiglu(self.gate_proj(x), self.up_proj(x), in_place_backward=True))


def _geglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(triton_ops.geglu(self.gate_proj(x), self.up_proj(x), in_place_backward=True))


_OPS = {_rms_norm_forward: "rms_norm", _offset_norm_forward: "offset_rms_norm",
        _residual_norm_forward: "residual_rms_norm", _residual_offset_norm_forward: "residual_offset_rms_norm",
        _mlp_forward: "swiglu",
        _geglu_mlp_forward: "geglu"}
_GELU_TANH = ("gelu_pytorch_tanh",)          # F.gelu(approximate="tanh"), the kernel's activation


def patched_op(module: nn.Module) -> str | None:
    """The op `patch` put into `module`'s forward ("rms_norm", "offset_rms_norm", their
    "residual_" forms, "swiglu" or "geglu"), or None."""
    fn = getattr(module.__dict__.get("forward"), "__func__", None)
    return _OPS.get(fn)


def rows_forward(module: nn.Module, give):
    """For a module whose forward `patch` replaced (`patched_op`): a forward of the same output
    that also hands that output's e4m3 rows, made by the same kernel, to `give(output, (q, inv))`
    (`triton_ops.rms_norm_rows` / `swiglu_rows`); the SwiGLU MLP's is its activation's output, the
    down projection's input. None for any other module (Gemma's offset norm and GeGLU have no
    rows form: FP8 projections quantize their outputs themselves)."""
    op = patched_op(module)
    if op == "rms_norm":
        def norm(hidden_states):
            y, rows = triton_ops.rms_norm_rows(hidden_states, module.weight, module.variance_epsilon,
                                               in_place_backward=True)      # as _rms_norm_forward
            give(y, rows)
            return y
        return norm
    if op == "swiglu":
        def mlp(x):
            c, rows = triton_ops.swiglu_rows(module.gate_proj(x), module.up_proj(x), in_place_backward=True)
            give(c, rows)
            return module.down_proj(c)
        return mlp
    return None


def _rope(q, k, cos, sin, unsqueeze_dim=1):
    return triton_ops.rope(q, k, cos, sin, unsqueeze_dim)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    """The causal LM's forward with the fused loss head (plus a mixture of experts' load-balancing
    loss where its router logits are asked for, as HF's forward adds it); falls back to the
    original without labels."""
    shift_labels = kwargs.pop("shift_labels", None)
    if labels is None and shift_labels is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    return_dict = kwargs.pop("return_dict", None)
    kwargs.pop("logits_to_keep", None)
    router = kwargs.pop("output_router_logits", None)
    router = getattr(self.config, "output_router_logits", False) if router is None else router
    if router:                                   # a mixture of experts' load-balancing loss, as HF adds it
        kwargs["output_router_logits"] = True
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs.last_hidden_state                                               # (B, S, H)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]             # (B, S)
    transform = _family(self).final_logits(self.config)
    if transform.divisor != 1.0:
        hidden = hidden / transform.divisor                  # (h / d) @ W.T = (h @ W.T) / d
    loss = triton_ops.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
        shift_labels.reshape(-1).to(hidden.device),
        ignore_index=ignore_index, num_items_in_batch=num_items_in_batch, softcap=transform.softcap,
    )
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if not router:
        out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions)
        return out.to_tuple() if return_dict is False else out
    balance = importlib.import_module(_family(self).modeling).load_balancing_loss_func
    aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
    loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    out = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=None, hidden_states=outputs.hidden_states,
                                    attentions=outputs.attentions, router_logits=outputs.router_logits)
    return out.to_tuple() if return_dict is False else out


@dataclass
class PatchHandle:
    """What `patch` changed on one model; `revert()` (or leaving a `with` block) undoes it.

    Attributes:
        model: the patched model.
        family: its `config.model_type`.
        forwards: modules whose instance `forward` was replaced.
        functions: (modeling module name, function name) of the module-level functions replaced
            (`apply_rotary_pos_emb`, `torch_chunk_gated_delta_rule`, `causal_conv1d_fn`).
    """

    model: nn.Module
    family: str
    forwards: list[nn.Module] = field(default_factory=list)
    functions: list[tuple[str, str]] = field(default_factory=list)

    def revert(self) -> None:
        """Restore the original forwards and, with the last patched model of the family, the
        module-level functions."""
        for module in self.forwards:
            if "forward" in module.__dict__:
                delattr(module, "forward")
        self.forwards = []
        for key in self.functions:
            original, count = _function_patches[key]
            if count == 1:
                setattr(importlib.import_module(key[0]), key[1], original)
                del _function_patches[key]
            else:
                _function_patches[key] = (original, count - 1)
        self.functions = []
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def _kernel_families() -> dict:
    """model_type -> its registry entry, for the families the kernels apply to.

    The registry is imported on first use: `import triton_ops` stays free of hf_slideformer."""
    from hf_slideformer.models.registry import FAMILIES

    return {name: f for name, f in FAMILIES.items() if f.kernels}



def supported_families() -> tuple[str, ...]:
    """The model types `patch` accepts."""
    return tuple(_kernel_families())


def _family(model: nn.Module):
    """The registry entry of `model`'s family, or a ValueError naming the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    families = _kernel_families()
    if model_type not in families:
        raise ValueError(f"triton_ops.patch supports {tuple(families)}, got model_type={model_type!r}")
    return families[model_type]


def patch(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
          geglu: bool = True, gated_delta: bool = True, causal_conv: bool = True, gated_norm: bool = True,
          cross_entropy: bool = True) -> PatchHandle:
    """Apply the fused ops to a Hugging Face model of a supported family, in place.

    Args:
        model: a `*ForCausalLM` (or its base `*Model`) of a family in `supported_families()`.
        rms_norm, rope, swiglu, geglu, gated_delta, causal_conv, gated_norm, cross_entropy: which ops to
            swap in (of those
            the family's entry lists; the loss head applies to every family).

    Returns:
        A `PatchHandle`; `handle.revert()` or `unpatch(model)` restores the model.
    """
    family = _family(model)
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError("model is already patched; unpatch it first")
    handle = PatchHandle(model=model, family=family.model_type)
    modeling = family.modeling
    rms_norm, rope = rms_norm and "rms_norm" in family.kernels, rope and "rope" in family.kernels
    config = model.config
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    mlp_forward = (_mlp_forward if swiglu and "swiglu" in family.kernels and act in ("silu", "swish") else
                   _geglu_mlp_forward if geglu and "geglu" in family.kernels and act in _GELU_TANH else None)
    norm_forward, residual_norm_forward, eps = (
        (_offset_norm_forward, _residual_offset_norm_forward, "eps") if family.norm_offset
        else (_rms_norm_forward, _residual_norm_forward, "variance_epsilon"))
    for path, module in model.named_modules():
        name = type(module).__name__
        if rms_norm and name.endswith("RMSNorm") and hasattr(module, eps):
            residual = path.rpartition(".")[2] in family.residual_norms
            module.forward = types.MethodType(residual_norm_forward if residual else norm_forward, module)
            handle.forwards.append(module)
        elif gated_norm and "gated_norm" in family.kernels and name.endswith("RMSNormGated") and hasattr(
                module, "variance_epsilon"):
            module.forward = types.MethodType(_gated_norm_forward, module)
            handle.forwards.append(module)
        elif mlp_forward is not None and name.endswith("MLP") and all(
                hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            module.forward = types.MethodType(mlp_forward, module)
            handle.forwards.append(module)
    if cross_entropy and hasattr(model, "lm_head") and hasattr(model, "model"):
        model.forward = types.MethodType(_causal_lm_forward, model)
        handle.forwards.append(model)
    if rope:
        _swap_function(handle, modeling, "apply_rotary_pos_emb", _rope)
    if gated_delta and "gated_delta" in family.kernels and importlib.util.find_spec("fla") is None:
        from .gated_delta import chunk_gated_delta_rule
        _swap_function(handle, modeling, "torch_chunk_gated_delta_rule", chunk_gated_delta_rule)
    if causal_conv and "causal_conv" in family.kernels and importlib.util.find_spec("causal_conv1d") is None:
        original = _original_function(modeling, "causal_conv1d_fn")
        _swap_function(handle, modeling, "causal_conv1d_fn", _causal_conv1d_fn(original))
    object.__setattr__(model, _ATTR, handle)
    return handle


def _gated_norm_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return triton_ops.gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)


def _causal_conv1d_fn(original):
    """transformers' `causal_conv1d_fn(hidden_states, weight, bias, activation, **kwargs)` by
    `triton_ops.causal_conv`; with a bias or an activation other than SiLU, `original` runs.
    (transformers' torch path reads none of the other keyword arguments either.)"""
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if bias is not None or activation not in (None, "silu", "swish"):
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return triton_ops.causal_conv(hidden_states, weight, silu=activation is not None)

    causal_conv1d_fn.__module__ = __name__
    return causal_conv1d_fn


def _original_function(modeling: str, name: str):
    """Module `modeling`'s own function `name`, also while a patch has swapped it."""
    swapped = _function_patches.get((modeling, name))
    return swapped[0] if swapped else getattr(importlib.import_module(modeling), name)


def _swap_function(handle: PatchHandle, modeling: str, name: str, replacement) -> None:
    """Replace the module-level function `name` of module `modeling` (looked up at call time by
    the family's layers) while at least one model of the family is patched."""
    original, count = _original_function(modeling, name), _function_patches.get((modeling, name), (None, 0))[1]
    setattr(importlib.import_module(modeling), name, replacement)
    _function_patches[(modeling, name)] = (original, count + 1)
    handle.functions.append((modeling, name))


def unpatch(model: nn.Module) -> None:
    """Undo `patch(model)`; a no-op for a model that is not patched."""
    handle = getattr(model, _ATTR, None)
    if handle is not None:
        handle.revert()
