"""Building a slid model: the units a model splits into, the store filled with its weights, the
engine, and the proxies that hand its embedding's and layers' forwards to the engine.

`model.slide` calls these in order; what one of them takes on the way (host registrations, the
GPU cap, the engine's threads) is given back if a later one fails (`released_on_failure`).
"""
from __future__ import annotations

import contextlib
import logging
import re

import torch
import torch.nn as nn

from .slide_engine import SlideEngine
from .lora import parametrized_params, refuse_outside_layers
from ..host.memory import GiB
from .modules_to_save import check_modules_to_save, copy_params, original_params
from ..host.store import ParamEntry, Unit
from ..compute.tiled_mlp import tile_mlps

logger = logging.getLogger(__name__)

__all__ = ["build_units", "check_on_cpu", "drop_hub_kernels", "fill_and_build", "install_proxies", "lora_held_params",
           "refuse_adapters_outside_layers", "released_on_failure"]


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list] = {}
    for mod in model.modules():
        for attr, param in mod._parameters.items():
            if param is not None:
                out.setdefault(id(param), []).append((mod, attr))
    return out


# A PEFT wrapper's inner module is `<module>.base_layer` (LoRA's frozen linear) or
# `<module>.modules_to_save.<adapter>` (a trainable copy), nested where PEFT wraps a module
# twice (a `ParamWrapper` per targeted parameter); under the model's own name
# (`<module>.weight`) its weight loads from and saves as an HF checkpoint.
_PEFT_PART = re.compile(r"\.(base_layer|modules_to_save\.[^.]+)(?=\.)")


def _hf_name(name: str) -> str:
    return _PEFT_PART.sub("", name)


def build_units(model: nn.Module, adapter, skip: set[int] = frozenset()) -> list[Unit]:
    """Split `model` into embed, layer and head units (schedule order), entries in module order;
    the parameters in `skip` (ids: LoRA adapters, which stay on the device, and the frozen
    originals of PEFT `modules_to_save`) are left out. An entry is named by the module the unit
    takes it from (a tied lm_head's weight is the embedding's entry)."""
    paths: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), name)
    holders = _holders(model)
    seen: set[int] = set(skip)
    parametrized = parametrized_params(model)

    def entries(module: nn.Module) -> list[ParamEntry]:
        out = []
        prefix = paths[id(module)]
        for own_name, param in module.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = _hf_name(f"{prefix}.{own_name}" if prefix else own_name)
            out.append(ParamEntry(name, param.shape, 0, param.numel(), holders[id(param)], param,
                                  parametrized=id(param) in parametrized))
        return out

    units = [Unit("embed", "embed", 0, entries(adapter.embed(model)))]
    for layer_no, layer in enumerate(adapter.layers(model)):
        units.append(Unit(f"layer.{layer_no}", "layer", layer_no + 1, entries(layer)))
    head = entries(adapter.final_norm(model)) + entries(adapter.lm_head(model))
    units.append(Unit("head", "head", len(units), head))
    left = [name for name, p in model.named_parameters() if id(p) not in seen]
    if left:
        raise NotImplementedError(f"parameters outside embed / layers / norm / lm_head are not supported: {left}")
    return units


def lora_held_params(model: nn.Module, adapter) -> tuple[set[int], set[int]]:
    """The ids of the parameters of a LoRA model's base that the host store does not hold: the
    adapters, which stay on the device (lora.py), and the frozen originals of `modules_to_save`,
    whose trainable copies are the embedding / head units (modules_to_save.py)."""
    check_modules_to_save(model, adapter)
    copies = copy_params(model)
    adapters = {id(p) for p in model.parameters() if p.requires_grad and id(p) not in copies}
    return adapters, original_params(model, adapter)


def refuse_adapters_outside_layers(model: nn.Module, adapter, adapters: set[int]) -> None:
    """Refuse LoRA adapters outside the decoder layers (`lora.refuse_outside_layers`)."""
    inside = {id(p) for layer in adapter.layers(model) for p in layer.parameters()}
    refuse_outside_layers([n for n, p in model.named_parameters() if id(p) in adapters and id(p) not in inside])


def check_on_cpu(units: list[Unit]) -> None:
    """Refuse a model whose weights are not on the CPU (or the meta device)."""
    for unit in units:
        for entry in unit.entries:
            if entry.param.device.type not in ("cpu", "meta"):
                raise ValueError(f"slide() expects the model on the CPU; {entry.name} is on {entry.param.device}. "
                                 "Load it with device_map=None / on the CPU, or use SlideModel.from_pretrained.")


@contextlib.contextmanager
def released_on_failure(config):
    """Set the GPU cap; on a failure, give back what was built (`built`: "store", "engine") and the cap.

    Note: [Why a failed slide() releases what it took] host memory registered with
    cudaHostRegister stays registered until unregistered: left behind, its addresses, once freed
    and handed out again, make the next registration fail (cudaErrorHostMemoryAlreadyRegistered),
    and a second slide() in the process dies. So do the engine's threads and files. The store (the
    registrations, the state file) and the engine (threads, the tier) are closed here, and the cap
    goes back to what it was, before the error propagates.
    """
    built: dict = {}
    previous = None
    if config.gpu_memory_limit is not None and config.is_cuda:
        dev = config.torch_device
        previous = torch.cuda.get_per_process_memory_fraction(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, config.gpu_memory_limit * GiB / total), dev)
    try:
        yield built
    except BaseException:
        try:
            if "kernels" in built:
                import triton_ops
                triton_ops.unpatch(built["kernels"])
            if "engine" in built:
                built["engine"].close()
            elif "store" in built:
                built["store"].close()
        except Exception:                # noqa: BLE001 - the failure itself is the error to raise
            logger.warning("releasing a failed slide()", exc_info=True)
        if previous is not None:
            torch.cuda.set_per_process_memory_fraction(previous, config.torch_device)
            torch.cuda.empty_cache()
        raise


def fill_and_build(model, adapter, config, built: dict, units, dp, _fill: bool) -> None:
    """Copy the weights into the store, bind the parameters to it, and build the engine."""
    store = built["store"]
    if _fill and (dp is None or dp.writes):
        # With several ranks, rank 0's weights are the model's (as DistributedDataParallel broadcasts them).
        with torch.no_grad():
            for unit in units:
                with store.unit_state(unit, write=True):          # a layer on disk: written to its file
                    for entry in unit.entries:
                        entry.view(unit.master).copy_(entry.param.detach().reshape(entry.shape))
    if _fill and dp is not None:
        dp.barrier()
    store.bind_parameters()
    for name, buf in model.named_buffers():
        # The embedding's scale buffer is not read: the engine's embedding scales (install_proxies).
        if buf.device.type == "meta" and not name.endswith(("inv_freq", "embed_scale")) and "rotary" not in name:
            raise NotImplementedError(f"buffer {name} is uninitialized (meta)")
    # A layer's own buffers (Gemma 4's layer_scalar) are read by its forward on the compute device.
    for layer in adapter.layers(model):
        for module in layer.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device.type != "meta" and buf.device != config.torch_device:
                    setattr(module, key, buf.to(config.torch_device))
    rot = adapter.rotary(model)
    if rot is not None:
        if any(b.device.type == "meta" for b in rot.buffers()):
            with torch.device("cpu"):
                new = type(rot)(config=model.config)
            adapter.base(model).rotary_emb = new.to(config.torch_device)
        else:
            rot.to(config.torch_device)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    _apply_kernels(model, config, built)
    tile_mlps(adapter.layers(model), config.mlp_chunk_tokens)     # after the kernels: it wraps their forward
    built["engine"] = SlideEngine(model, adapter, config, store)


def _apply_kernels(model, config, built: dict) -> None:
    """Swap the Triton RMSNorm / RoPE / SwiGLU / GeGLU kernels into the layers (the head fuses its own loss),
    those the family's entry lists; a family that lists none runs HF's own ops."""
    if not (config.use_kernels and config.is_cuda):
        return
    import triton_ops
    from triton_ops import patching

    if not triton_ops.is_triton_available():
        logger.warning("SlideConfig.use_kernels: Triton is not available, the layers run HF's own ops")
        return
    if model.config.model_type not in patching.supported_families():
        logger.info("SlideConfig.use_kernels: the %s entry lists no kernels, its layers run HF's own ops",
                    model.config.model_type)
        return
    triton_ops.patch(model, cross_entropy=False)
    built["kernels"] = model                # unpatched if slide() fails after this


def drop_hub_kernels(model: nn.Module) -> None:
    """Reset the `kernels` hub kernelization transformers gives a loaded model (5.25: on by default
    where the `kernels` package is installed).

    A kernelized model kernelizes again at every `train()` / `eval()` switch, which puts each
    kernelized module's class forward back in place of its instance's: the engine's proxies and
    Triton kernels, installed as instance forwards, would be dropped at the next mode switch (the
    final norm, applied by the head, would then be applied twice). A slid model's compute is the
    engine's, so the hub's kernels are reset before they are installed."""
    for module in model.modules():
        if getattr(module, "use_kernels", False) and hasattr(module, "reset_kernels"):
            module.reset_kernels()


def install_proxies(model, adapter, engine) -> None:
    from ..compute.functions import EmbedFunction, LayerFunction

    emb = adapter.embed(model)
    scale = adapter.embedding_scale(model)

    def embed_forward(input_ids):
        out = gathered(input_ids)
        # The family's embedding module scales its rows (Gemma); the cast mirrors HF's, which
        # multiplies by the scale in the weights' dtype. A product, not the gather: layer 0's
        # input is then kept, not remade from the ids (embedding.remake_input).
        return out if scale is None else out * torch.tensor(scale, dtype=out.dtype, device=out.device)

    def gathered(input_ids):
        if torch.is_grad_enabled():
            # Note: [Why a parameter added after slide() is checked at every forward] a trainable
            # one that neither the store nor the adapters hold would get no gradient: LoRA
            # adapters (get_peft_model on a slid model) are taken onto the device, anything
            # else is refused, before any step trains without it.
            if engine.lora.foreign():
                engine.lora.adopt_all()
            engine.begin_graph()
            return EmbedFunction.apply(engine.anchor, engine, input_ids)
        return engine.embedding.forward(input_ids)

    emb.forward = embed_forward
    for layer_no, layer in enumerate(adapter.layers(model)):
        def layer_forward(hidden_states, *args, _layer_no=layer_no, **kwargs):
            if torch.is_grad_enabled() and hidden_states.requires_grad:
                return LayerFunction.apply(hidden_states, engine, _layer_no, args, kwargs)
            return engine.layer_forward(_layer_no, hidden_states, args, kwargs, save=False)
        layer.forward = layer_forward
    adapter.final_norm(model).forward = lambda hidden_states, *args, **kwargs: hidden_states   # applied by the head
