"""LoRA on a streamed frozen base: PEFT models through the sliding engine.

A PEFT LoRA model slides like its base model, with two kinds of parameters:

- the base's, frozen: they stay in the host store and stream through the window like any layer,
  but no gradient of theirs is computed, crosses back or updates anything (`FrozenLayer`);
- the adapters' (`lora_A`, `lora_B`), small: they stay on the device in fp32 and are updated
  there by torch's fused AdamW at `optimizer.step()` (`AdapterSet`). Their gradients come from
  the layers' recompute in backward, summed on the device over the micro-batches.

`modules_to_save` naming the input embedding or the lm_head makes that unit trainable again: its
PEFT copy trains in full on the host, as in full fine-tuning (modules_to_save.py).

Note: [Why the adapters stay on the device] rank 16 on every linear layer of an 8B model is about
42M parameters: 0.7 GB of fp32 master and moments, against the window's 0.4 GB per layer. On the
device their update is one fused kernel per step; on the CPU worker each layer's adapters would
cost a d2h, a worker task and an h2d for a few MB.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import SlideStateError
from ..host.host_adam import torch_fused_adamw
from .modules_to_save import saved_wrappers
from ..host.optim import grad_scale, sq_norm as _sq_norm
from .placements import FrozenLayer

__all__ = ["AdapterSet", "peft_base", "check_lora", "refuse_outside_layers", "merge_and_unload", "peft_on_meta",
           "parametrized_params"]


def _peft_model_class():
    try:
        from peft import PeftModel
    except ImportError:          # peft is a dependency; a model can only be a PeftModel if it imports
        return None
    return PeftModel


def peft_base(model: nn.Module) -> nn.Module | None:
    """The HF model inside a PEFT model (`PeftModel.get_base_model()`), or None for a plain model."""
    cls = _peft_model_class()
    if cls is not None and isinstance(model, cls):
        check_lora(model)
        return model.get_base_model()
    return None


def check_lora(peft_model) -> None:
    """Raise unless `peft_model` is what the engine trains exactly: one LoRA adapter without DoRA.

    Where the adapters and `modules_to_save` may be is checked at `slide()`, which knows the family:
    LoRA on linear layers and on parameters (`target_parameters`) inside the decoder layers
    (`refuse_outside_layers`, `parametrized_params`), modules_to_save of the input embedding and the
    lm_head (`modules_to_save.check_modules_to_save`)."""
    configs = getattr(peft_model, "peft_config", {})
    if len(configs) != 1:
        raise ValueError(f"hf_slideformer trains one LoRA adapter at a time; this PEFT model has {len(configs)} "
                         f"({', '.join(configs)})")
    (name, cfg), = configs.items()
    kind = str(getattr(cfg.peft_type, "value", cfg.peft_type))
    if kind != "LORA":
        raise ValueError(f"PEFT method {kind} is not supported: hf_slideformer slides LoRA models (LoraConfig) "
                         "and full fine-tuning of the base model")
    unsupported = []
    if getattr(cfg, "use_dora", False):
        unsupported.append("use_dora=True (DoRA)")
    if unsupported:
        raise ValueError(f"LoRA adapter {name!r}: not supported by hf_slideformer: {'; '.join(unsupported)}. "
                         "Supported: LoRA on any linear layers inside the decoder layers and on their parameters "
                         "(target_parameters: the experts' weights of a mixture of experts), and modules_to_save "
                         "of the input embedding and the lm_head.")


def parametrized_params(model: nn.Module) -> set[int]:
    """The ids of the base parameters PEFT's `ParamWrapper` adapts (LoRA `target_parameters`: a
    mixture of experts' 3-D expert weights, say).

    PEFT adds such an adapter's delta `B A` to the weight through a `torch.nn.utils.parametrize`
    parametrization registered for each forward of the wrapper, so the layer's recompute in
    backward rebuilds it from the same factors and their gradients come back with the adapters'.
    The weight itself must stay frozen: its layer streams as a `FrozenLayer`, and its device copy
    is swapped in as a Parameter (note [Why a parametrized weight is swapped in as a Parameter]).

    Raises:
        ValueError: for a targeted parameter that trains (`requires_grad=True`): it would be the
            leaf of both its own update and the adapter's parametrization.
    """
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:          # an older PEFT without LoRA on parameters
        return set()
    out = set()
    for name, module in model.named_modules():
        if not isinstance(module, ParamWrapper):
            continue
        param = module.get_param()
        if param.requires_grad:
            raise ValueError(f"{name}: the parameter {module.parameter_name!r} that LoRA adapts (target_parameters) "
                             "trains too (requires_grad=True): not supported. Train its adapter with the base "
                             "weight frozen, as get_peft_model leaves it.")
        out.add(id(param))
    return out


@torch.no_grad()
def peft_on_meta(model: nn.Module, peft_config) -> nn.Module:
    """`get_peft_model` of a model built on the meta device: the base stays on meta (its weights
    are read into the host store later, the copies of `modules_to_save` too: they are units), the
    adapters are made on the CPU and initialised as PEFT initialises them (`reset_lora_parameters`
    with the config's `init_lora_weights`; with `init_lora_weights=False`, the linears' own
    `reset_parameters`, as their construction does)."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    peft_model = get_peft_model(model, peft_config)
    check_lora(peft_model)
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name in module.active_adapters:
            for part in (module.lora_A, module.lora_B):
                if name in part:
                    part[name].to_empty(device="cpu")
                    if peft_config.init_lora_weights is False:
                        # PEFT keeps the linears' own init there (`reset_lora_parameters` returns at once)
                        part[name].reset_parameters()
            module.reset_lora_parameters(name, peft_config.init_lora_weights)
    return peft_model


@torch.no_grad()
def merge_and_unload(peft_model) -> nn.Module:
    """Merge the trained LoRA adapters of a slid PEFT model into its base and drop them.

    The adapters come back to the host first and PEFT's own `merge_and_unload` adds each one's
    product into its layer's weight in the host store, and puts the trained copies of
    `modules_to_save` (embedding, lm_head: already units) in their wrappers' place; the result is
    the slid base model with the merged weights under the plain HF names, which `save_pretrained`
    writes as a full checkpoint (streamed from the host store, a layer at a time) and
    `AutoModelForCausalLM` loads.

    Args:
        peft_model: a PEFT LoRA model slid with `hs.slide` (or a slid model given `get_peft_model`).

    Returns:
        The base model, still slid (evaluation and generation run on the merged weights).
    """
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else None
    engine = getattr(base, "slide_engine", None)
    if engine is None:
        raise ValueError("merge_and_unload expects a slid PEFT model; for a plain one call its own merge_and_unload()")
    engine.synchronize()
    if engine.micro:
        raise ValueError("merge_and_unload in the middle of an optimizer step: call optimizer.step() first")
    for param in engine.lora.params:
        param.data = param.data.to("cpu", torch.float32)         # PEFT adds B @ A on the weights' (host) device
    merged = peft_model.merge_and_unload()
    for unit in engine.store.units:        # the entries carry the plain HF names already (slide_build.build_units)
        unit.version += 1                                     # device copies of the old weights are stale
    engine.lora.clear()
    return merged


def refuse_outside_layers(names: list[str]) -> None:
    """Raise for trainable parameters outside the decoder layers that the host store does not hold."""
    if names:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ValueError(f"trainable parameters outside the decoder layers that the slid model does not hold "
                         f"({', '.join(names[:3])}{more}): no gradient would reach them. LoRA is supported on "
                         "linear layers inside the decoder layers (not on lm_head or embed_tokens; train those "
                         "in full with modules_to_save, in the PEFT model given to slide()); freeze the "
                         "others (requires_grad=False) or add modules before slide().")


class AdapterSet:
    """The trainable parameters that stay on the device: LoRA adapters inside the slid layers.

    Args:
        engine: the SlideEngine.

    Attributes:
        by_layer: for each decoder layer, its adapters' parameters (module order).
        params: all of them, flat.
    """

    def __init__(self, engine):
        self.engine = engine
        self.by_layer: list[list[nn.Parameter]] = [[] for _ in engine.layers]
        self.params: list[nn.Parameter] = []
        self.names: list[str] = []                  # the model's names of `params`
        self.exp_avg: dict[int, torch.Tensor] = {}
        self.exp_avg_sq: dict[int, torch.Tensor] = {}
        self.steps: dict[int, torch.Tensor] = {}
        self._held = {id(p) for p in engine.store.params()}      # what the engine trains, the adapters included
        # PEFT's modules_to_save wrappers, whose trainable copies are the embedding / head units
        self.saved: list[nn.Module] = saved_wrappers(engine.model_ref())

    def foreign(self) -> bool:
        """Does the model have a trainable parameter that neither the host store nor the adapters hold?"""
        model = self.engine.model_ref()
        return model is not None and any(p.requires_grad and id(p) not in self._held for p in model.parameters())

    def adopt_all(self) -> None:
        """Take the trainable parameters a PEFT model added inside the layers onto the device, and
        make the layers whose own parameters no longer train `FrozenLayer`s. Raises for a trainable
        parameter no gradient would reach, or for adapters added after the optimizer was built (it
        would never update them)."""
        engine = self.engine
        known = len(self.params)
        if engine.store.disk is not None and self.foreign():
            raise SlideStateError("LoRA adapters were added to a slid model whose last layers keep their state on "
                                  "disk (host_memory_limit): not supported. Apply get_peft_model before slide(), "
                                  "or slide with host_memory_limit=None.")
        if engine.optimizer is not None and self.foreign():
            names = [n for n, p in engine.model_ref().named_parameters() if p.requires_grad and id(p) not in self._held]
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise SlideStateError(
                f"trainable parameters were added to the slid model after its optimizer was built ({', '.join(names[:3])}"
                f"{more}; e.g. get_peft_model after create_optimizer): they would never be updated. Build the "
                "optimizer after get_peft_model (a PEFT LoRA model trains its adapters), or freeze them "
                "(requires_grad=False).")
        refuse_outside_layers(self._adopt())
        self._held |= {id(p) for p in self.params}
        targeted = parametrized_params(engine.model_ref())      # wrappers added after slide() too
        for unit in engine.store.units:
            for entry in unit.entries:
                entry.parametrized = id(entry.param) in targeted
        engine.find_dropouts()                                  # a LoRA adapter's lora_dropout
        if len(self.params) == known and engine.places.trainable_match_units():
            return
        engine.residents.evict()
        for place in engine.places.newly_frozen():
            engine.set_place(place.unit, FrozenLayer(engine, place.unit))

    def _adopt(self) -> list[str]:
        """Take the layers' trainable parameters that the engine does not hold onto the device in
        fp32; the names of anything else trainable and not held, which no gradient would reach."""
        engine = self.engine
        owned = self._held
        layer_of = {}
        for layer_no, layer in enumerate(engine.layers):
            for param in layer.parameters():
                layer_of.setdefault(id(param), layer_no)
        stray = []
        for name, param in engine.model_ref().named_parameters():
            if not param.requires_grad or id(param) in owned or any(param is q for q in self.params):
                continue
            layer_no = layer_of.get(id(param))
            if layer_no is None:
                stray.append(name)
                continue
            with torch.no_grad():
                param.data = param.data.to(engine.device, torch.float32)
            self.by_layer[layer_no].append(param)
            self.params.append(param)
            self.names.append(name)
        return stray

    def state(self) -> dict[str, torch.Tensor]:
        """Weights, moments and step counters by name, on the host (a training checkpoint)."""
        out = {}
        for name, param in zip(self.names, self.params):
            out[f"weight/{name}"] = param.detach().cpu()
            if id(param) in self.exp_avg:
                out[f"exp_avg/{name}"] = self.exp_avg[id(param)].cpu()
                out[f"exp_avg_sq/{name}"] = self.exp_avg_sq[id(param)].cpu()
                out[f"step/{name}"] = self.steps[id(param)].cpu().reshape(1)
        return out

    @torch.no_grad()
    def load_state(self, read, weights: bool = True, optimizer: bool = True) -> None:
        """Restore from `read(key)` (keys as in `state`)."""
        for name, param in zip(self.names, self.params):
            if weights:
                param.copy_(read(f"weight/{name}"))
            if optimizer and id(param) in self.exp_avg:
                self.exp_avg[id(param)].copy_(read(f"exp_avg/{name}"))
                self.exp_avg_sq[id(param)].copy_(read(f"exp_avg_sq/{name}"))
                self.steps[id(param)].copy_(read(f"step/{name}").reshape(()))

    def allocate(self, state: dict) -> None:
        """Zeroed AdamW moments and step counters on the device, registered in the optimizer's `state`."""
        for param in self.params:
            if id(param) not in self.exp_avg:
                self.exp_avg[id(param)] = torch.zeros_like(param)
                self.exp_avg_sq[id(param)] = torch.zeros_like(param)
                self.steps[id(param)] = torch.zeros((), dtype=torch.float32, device=param.device)
            state[param] = {"step": self.steps[id(param)], "exp_avg": self.exp_avg[id(param)],
                        "exp_avg_sq": self.exp_avg_sq[id(param)]}

    def take_gradient(self, layer_no: int, grads) -> None:
        """The micro-batch's gradients of layer `layer_no`'s adapters: summed into `.grad` on the device,
        their squared norm added to the step's where the step's norm is taken on the device."""
        engine = self.engine
        ps = self.by_layer[layer_no]
        if not ps:
            return
        for param, grad in zip(ps, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.to(torch.float32)
            else:
                param.grad.add_(grad)
        engine.backward_plan.sums_norm.add(lambda: _sq_norm([p.grad for p in ps if p.grad is not None]))

    def sq_norm(self) -> torch.Tensor | None:
        """The squared norm of the summed gradients so far (a step that ends early), or None."""
        gs = [p.grad for p in self.params if p.grad is not None]
        return _sq_norm(gs) if gs else None

    def step(self, hp, clip_coef=None, found_inf=None) -> None:
        """AdamW of every adapter with its summed gradient (divided by the clip factor), skipped
        where `found_inf` is nonzero; the gradients are dropped after."""
        if not self.params:
            return
        if found_inf is not None and found_inf.device.type == "cpu" and float(found_inf):
            self.zero_grad()
            return
        groups, group_of = hp
        by_group: dict[int, list[nn.Parameter]] = {}
        for param in self.params:
            gi = group_of.get(id(param))
            if gi is not None and param.grad is not None and param.requires_grad:
                by_group.setdefault(gi, []).append(param)
        scale = grad_scale(clip_coef, self.engine.device)
        dev_inf = found_inf if found_inf is not None and found_inf.device.type != "cpu" else None
        for gi, ps in by_group.items():
            steps = [self.steps[id(p)] for p in ps]
            torch._foreach_add_(steps, 1)
            torch_fused_adamw(groups[gi], ps, [p.grad for p in ps], [self.exp_avg[id(p)] for p in ps],
                              [self.exp_avg_sq[id(p)] for p in ps], steps, scale, dev_inf)
            if dev_inf is not None:          # the kernel skipped; the counters go back (as torch.optim does)
                torch._foreach_sub_(steps, [dev_inf] * len(steps))
        self.engine.stats.gpu_adam_params += sum(p.numel() for ps in by_group.values() for p in ps)
        self.zero_grad()

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def clear(self) -> None:
        """Forget the adapters (merged into the base; the modules_to_save copies replaced their wrappers)."""
        self._held -= {id(p) for p in self.params}
        self.saved = []
        self.by_layer = [[] for _ in self.by_layer]
        self.params, self.names = [], []
        self.exp_avg, self.exp_avg_sq, self.steps = {}, {}, {}
