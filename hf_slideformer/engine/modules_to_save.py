"""PEFT `modules_to_save` on a slid model: trainable copies of the input embedding and the lm_head.

`LoraConfig(modules_to_save=["lm_head"])` (or `["embed_tokens", "lm_head"]`) wraps each named
module in a PEFT `ModulesToSaveWrapper`: the frozen `original_module` and a trainable copy,
`modules_to_save[adapter]`, which the forward uses, which trains, and which `save_pretrained`
writes into the adapter file. On a slid model the copy is the unit: the family adapter's `embed`
and `lm_head` name it (`trained_copy`), so the embedding or the head unit holds its parameters as
fp32 masters with AdamW moments and trains exactly as in full fine-tuning (12 bytes per parameter
on the host, the CPU worker's update, or the GPU's where the engine makes the embedding resident),
while the decoder layers stay frozen and the LoRA adapters train on the device.

The original module is not a unit: nothing computes with it while the adapter is active. It keeps
its tensors outside the host store, as PEFT keeps it beside the copy (the meta build of
`SlideModel.from_pretrained(path, peft_config=...)` fills them from the copy as loaded,
`fill_originals`). A forward with the adapter disabled would need it, and is refused
(`check_active`).

Tied embeddings follow PEFT. With `ensure_weight_tying=True` the lm_head's copy shares the
embedding copy's weight: one trained table, and the slid model is tied as before. Without it PEFT
unties (and warns): each copy trains on its own, the table it came from stays frozen where it is
still used, and the slid model is untied (its head unit holds its own lm_head).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import SlideStateError

__all__ = ["trained_copy", "saved_wrappers", "check_modules_to_save", "copy_params", "original_params",
           "fill_originals", "check_active"]


def _wrapper_class():
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:          # peft is a dependency; a module can only be a wrapper if it imports
        return None
    return ModulesToSaveWrapper


def _is_wrapper(module: nn.Module) -> bool:
    cls = _wrapper_class()
    return cls is not None and isinstance(module, cls)


def trained_copy(module: nn.Module) -> nn.Module:
    """The module that trains in `module`'s place: a `ModulesToSaveWrapper`'s copy for its active
    adapter, else `module` itself."""
    if _is_wrapper(module) and module.active_adapters and module.active_adapters[0] in module.modules_to_save:
        return module.modules_to_save[module.active_adapters[0]]
    return module


def saved_wrappers(model: nn.Module) -> list[nn.Module]:
    """The `ModulesToSaveWrapper`s inside `model`, in module order."""
    return [m for m in model.modules() if _is_wrapper(m)]


def check_modules_to_save(model: nn.Module, adapter) -> None:
    """Raise for a `ModulesToSaveWrapper` of `model` (the HF model inside a PEFT model) that wraps
    anything but the input embedding or the lm_head, or that has no active copy.

    Args:
        model: the HF causal LM.
        adapter: its family adapter (`models.get_adapter`).
    """
    supported = {id(adapter.embed(model)), id(adapter.lm_head(model))}
    for name, module in model.named_modules():
        if not _is_wrapper(module):
            continue
        if trained_copy(module) is module:
            raise ValueError(f"modules_to_save: {name} has no active trainable copy (no active adapter); "
                             "hf_slideformer slides a PEFT model with its adapter active")
        if id(trained_copy(module)) not in supported:
            raise ValueError(f"modules_to_save: {name} is not supported by hf_slideformer. Supported: the input "
                             "embedding (embed_tokens) and the lm_head, which then train in full beside the LoRA "
                             "adapters; leave other modules (a norm, a module inside the decoder layers) out of "
                             "modules_to_save.")


def copy_params(model: nn.Module) -> set[int]:
    """ids of the parameters of the wrappers' trainable copies (units of the host store)."""
    return {id(p) for w in saved_wrappers(model) for p in trained_copy(w).parameters()}


def original_params(model: nn.Module, adapter) -> set[int]:
    """ids of the parameters that only the wrappers' original modules hold: frozen, never computed
    with, left out of the host store. (With tied embeddings a wrapper's original table can still be
    the other end's weight: that one is a unit's.)"""
    used = {id(p) for m in (adapter.embed(model), adapter.lm_head(model)) for p in m.parameters()}
    return {id(p) for w in saved_wrappers(model) for p in w.original_module.parameters() if id(p) not in used}


@torch.no_grad()
def fill_originals(model: nn.Module) -> None:
    """Give the original modules of a model built on the meta device CPU tensors (their own dtype)
    holding their copy's weights as loaded: what PEFT's copy starts from, the checkpoint's. A
    parameter two originals share (a tied table) stays shared."""
    filled: dict[int, nn.Parameter] = {}
    for wrapper in saved_wrappers(model):
        copy = dict(trained_copy(wrapper).named_parameters())
        for name, param in wrapper.original_module.named_parameters():
            if param.is_meta and id(param) not in filled:
                tensor = torch.empty_like(param, device="cpu").copy_(copy[name].detach())
                filled[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None and id(param) in filled:
                module._parameters[attr] = filled[id(param)]


def check_active(wrappers: list[nn.Module]) -> None:
    """Raise if a wrapper's adapter is disabled (`PeftModel.disable_adapter()`) or switched: the
    engine computes with the trained copies only."""
    for wrapper in wrappers:
        if wrapper.disable_adapters or trained_copy(wrapper) is wrapper:
            raise SlideStateError("a forward with the PEFT adapter disabled or switched (disable_adapter(), "
                                  "set_adapter()) on a slid model with modules_to_save: the engine computes with "
                                  "the trained copies of the embedding / lm_head only. Run this forward with the "
                                  "adapter enabled.")
