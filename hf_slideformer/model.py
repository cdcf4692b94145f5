"""The user-facing model: `slide(hf_model)` and `SlideModel.from_pretrained(path)`.

A slid model stays the HF model object (its class becomes a subclass, `Slide<Class>`, so
`isinstance` checks, `config` and the Trainer keep working): its parameters become views of the
host fp32 masters, and its forward runs through the sliding engine.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import logging
import os
import re
import time
import weakref

import torch
import torch.nn as nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from .adapter_save import slid_peft_class
from .config import SlideConfig, configure_logging
from .data_parallel import DataParallel
from .engine import SlideEngine
from .fused_head import FusedLMHeadOutput, fused_head
from .lora import peft_base, refuse_outside_layers
from .memory import GiB, enable_expandable_segments
from .models import get_adapter
from .modules_to_save import check_active, check_modules_to_save, copy_params, fill_originals, original_params
from .model_inputs import check_label_dtype, check_token_ids
from .optim import SlideOptimizer
from .layer_matmuls import check_matmuls
from .slide_checks import align_grouped_experts, check_finite_weights, check_gpu_limit, rank_fingerprint
from .store import HostStore, ParamEntry, Unit
from .tiled_mlp import tile_mlps

logger = logging.getLogger(__name__)

__all__ = ["SlideModel", "slide", "is_slid", "FusedLMHeadOutput"]

_CLASSES: dict[type, type] = {}


def is_slid(model: nn.Module) -> bool:
    """Whether `model` runs through the sliding engine."""
    return getattr(model, "slide_engine", None) is not None


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, attr))
    return out


# A PEFT wrapper's inner module is `<module>.base_layer` (LoRA's frozen linear) or
# `<module>.modules_to_save.<adapter>` (a trainable copy); under the model's own name
# (`<module>.weight`) its weight loads from and saves as an HF checkpoint.
_PEFT_PART = re.compile(r"\.(base_layer|modules_to_save\.[^.]+)\.")


def _hf_name(name: str) -> str:
    return _PEFT_PART.sub(".", name)


def build_units(model: nn.Module, adapter, skip: set[int] = frozenset()) -> list[Unit]:
    """Split `model` into embed, layer and head units (schedule order), entries in module order;
    the parameters in `skip` (ids: LoRA adapters, which stay on the device, and the frozen
    originals of PEFT `modules_to_save`) are left out. An entry is named by the module the unit
    takes it from (a tied lm_head's weight is the embedding's entry)."""
    paths: dict[int, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), n)
    holders = _holders(model)
    seen: set[int] = set(skip)

    def entries(module: nn.Module) -> list[ParamEntry]:
        out = []
        prefix = paths[id(module)]
        for n, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = _hf_name(f"{prefix}.{n}" if prefix else n)
            out.append(ParamEntry(name, p.shape, 0, p.numel(), holders[id(p)], p))
        return out

    units = [Unit("embed", "embed", 0, entries(adapter.embed(model)))]
    for i, layer in enumerate(adapter.layers(model)):
        units.append(Unit(f"layer.{i}", "layer", i + 1, entries(layer)))
    head = entries(adapter.final_norm(model)) + entries(adapter.lm_head(model))
    units.append(Unit("head", "head", len(units), head))
    left = [n for n, p in model.named_parameters() if id(p) not in seen]
    if left:
        raise NotImplementedError(f"parameters outside embed / layers / norm / lm_head are not supported: {left}")
    return units


def _slid_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Slide{cls.__name__}", (SlideModel, cls), {"_slide_base_class": cls})
    return _CLASSES[cls]


@functools.lru_cache(maxsize=None)
def _cache_key(cls: type) -> str:
    """The name under which this transformers version passes the KV cache to decoder stack `cls`."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def slide(model: nn.Module, config: SlideConfig | None = None, *, _fill: bool = True) -> nn.Module:
    """Turn an HF causal LM into a sliding model, in place, and return it.

    The model's weights move into the host store (fp32 masters, pinned on CUDA); its parameters
    become views of them. The model should be on the CPU (any dtype).

    Args:
        model: an HF `*ForCausalLM` of a supported family (`hf_slideformer.models.FAMILIES`), or
            a PEFT LoRA model of one (`get_peft_model(...)`): its base slides frozen and its
            adapters train on the device (lora.py); the copies of its `modules_to_save` (the
            embedding, the lm_head) train in full on the host (modules_to_save.py).
        config: the SlideConfig (default: SlideConfig()). The engine keeps a copy: changing `config`
            afterwards does not reach the model, and `model.slide_config` is a read-only view of
            the engine's settings (see `ReadOnlySlideConfig`).

    Returns:
        The same model object: now a `SlideModel`, or the PEFT model around one.
    """
    if is_slid(model):
        raise ValueError("this model is already slid")
    peft_model, base = model, peft_base(model)
    if base is not None:                 # LoRA: the base slides frozen, the adapters stay on the device
        model = base
    elif hasattr(model, "peft_config"):
        raise ValueError(f"slide() got {type(model).__name__}, a part of a PEFT model: pass the PeftModel that "
                         "get_peft_model returned")
    config = copy.copy(config) if config is not None else SlideConfig()   # the engine's own; the model's is read-only
    # A Trainer (TRL's too) given the slid model slides it (trainer.py). trainer.py builds on this
    # module, so it is loaded by name when slide() runs, not imported at the top.
    importlib.import_module(f"{__package__}.trainer").install_trainer_hook()
    configure_logging(config)
    # Several processes (torchrun): this rank's device, and one shared copy of the state (data_parallel.py).
    dp = DataParallel.from_environment(config, frozen=base is not None
                                       or any(not p.requires_grad for p in model.parameters()))
    adapter = get_adapter(getattr(model.config, "model_type", None))
    adapters, originals = set(), set()
    if base is not None:
        # The LoRA adapters stay on the device; the trainable copies of modules_to_save are the
        # embedding / head units, and their frozen originals stay out of the store (modules_to_save.py).
        check_modules_to_save(model, adapter)
        copies = copy_params(model)
        adapters = {id(p) for p in model.parameters() if p.requires_grad and id(p) not in copies}
        originals = original_params(model, adapter)
    adapter.check(model)
    check_matmuls(config, adapter, model, lora=base is not None)
    if adapters:
        inside = {id(p) for layer in adapter.layers(model) for p in layer.parameters()}
        refuse_outside_layers([n for n, p in model.named_parameters() if id(p) in adapters and id(p) not in inside])
    if config.expandable_segments and config.is_cuda:
        enable_expandable_segments()
    units = build_units(model, adapter, skip=adapters | originals)
    for u in units:
        for e in u.entries:
            if _fill and e.param.device.type not in ("cpu", "meta"):
                raise ValueError(f"slide() expects the model on the CPU; {e.name} is on {e.param.device}. "
                                 "Load it with device_map=None / on the CPU, or use SlideModel.from_pretrained.")
    if _fill and config.check_finite_weights:
        check_finite_weights(model.named_parameters())
    if dp is not None:                  # before any shared memory: its sizes follow the model
        dp.check_same(rank_fingerprint(config, model, units))
    if config.is_cuda:
        check_gpu_limit(config, units, tied=adapter.lm_head(model).weight is adapter.embed(model).weight)
    with _released_on_failure(config) as built:
        built["store"] = HostStore(units, config, dp)
        if config.is_cuda:                  # the slot offsets are set: HF's grouped GEMM needs them aligned
            align_grouped_experts(model, units, config.dtype)
        _fill_and_build(model, adapter, config, built, units, dp, _fill)
    engine = built["engine"]
    model.__class__ = _slid_class(type(model))
    model.slide_engine = engine
    model.slide_config = config.read_only()
    _install_proxies(model, adapter, engine)
    closer = weakref.finalize(model, engine.close)   # unpin and stop the worker when the model goes
    closer.atexit = False                             # at exit the process tears everything down anyway
    if base is not None:
        engine.lora.adopt_all()
        peft_model.__class__ = slid_peft_class(type(peft_model))     # its save_pretrained, crash-safe
    return peft_model


@contextlib.contextmanager
def _released_on_failure(config):
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


def _fill_and_build(model, adapter, config, built: dict, units, dp, _fill: bool) -> None:
    """Copy the weights into the store, bind the parameters to it, and build the engine."""
    store = built["store"]
    if _fill and (dp is None or dp.writes):
        # With several ranks, rank 0's weights are the model's (as DistributedDataParallel broadcasts them).
        with torch.no_grad():
            for u in units:
                with store.unit_state(u, write=True):          # a layer on disk: written to its file
                    for e in u.entries:
                        e.view(u.master).copy_(e.param.detach().reshape(e.shape))
    if _fill and dp is not None:
        dp.barrier()
    store.bind_parameters()
    for name, buf in model.named_buffers():
        # The embedding's scale buffer is not read: the engine's embedding scales (_install_proxies).
        if buf.device.type == "meta" and not name.endswith(("inv_freq", "embed_scale")) and "rotary" not in name:
            raise NotImplementedError(f"buffer {name} is uninitialized (meta)")
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
    """Swap the Triton RMSNorm / RoPE / SwiGLU kernels into the layers (the head fuses its own loss),
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


def _install_proxies(model, adapter, engine) -> None:
    from .functions import EmbedFunction, LayerFunction

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
    for i, layer in enumerate(adapter.layers(model)):
        def layer_forward(hidden_states, *args, _i=i, **kwargs):
            if torch.is_grad_enabled() and hidden_states.requires_grad:
                return LayerFunction.apply(hidden_states, engine, _i, args, kwargs)
            return engine.layer_forward(_i, hidden_states, args, kwargs, save=False)
        layer.forward = layer_forward
    adapter.final_norm(model).forward = lambda hidden_states, *a, **k: hidden_states   # applied by the head


class SlideModel:
    """Mixin of every slid model; also the entry point `SlideModel.from_pretrained`.

    A slid model is its HF class plus: `create_optimizer`, `slide_stats`, a forward through the
    engine, and `save_pretrained` / `state_dict` reading the host masters.
    """

    slide_engine: SlideEngine
    slide_config: SlideConfig

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, slide_config: SlideConfig | None = None, *,
                        peft_config=None, **kwargs):
        """Load a local HF checkpoint (single or sharded safetensors) layer by layer into the host store.

        The full model is never materialized: the HF model is built on the meta device and each
        tensor is read from its file straight into its master.

        Args:
            path: a directory with config.json and *.safetensors.
            slide_config: the SlideConfig.
            peft_config: a `peft.LoraConfig`: the PEFT LoRA model of the checkpoint, its base frozen
                from the start (kept in the compute dtype: 2 bytes per parameter with bf16), its
                adapters initialised as `get_peft_model` does and trained on the device; the copies
                of its `modules_to_save` (embedding, lm_head) start from the checkpoint's weights and
                train in full. Returns the PEFT model.
            kwargs: extra config overrides (e.g. attn_implementation="sdpa").
        """
        from .checkpoint import load_model_meta, load_weights

        model = load_model_meta(path, **kwargs)
        if peft_config is None:
            slide(model, slide_config, _fill=False)
            dp = model.slide_engine.dp
            if dp is None or dp.writes:           # several ranks share the masters: rank 0 reads the files
                load_weights(model, path)
            if dp is not None:
                dp.barrier()
            return model
        from .lora import peft_on_meta

        peft_model = peft_on_meta(model, peft_config)
        slide(peft_model, slide_config, _fill=False)
        load_weights(peft_model.get_base_model(), path)
        fill_originals(peft_model)          # modules_to_save: the originals start as their copies, loaded
        return peft_model

    # ------------------------------------------------------------------ training API
    def create_optimizer(self, lr: float = 1e-5, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                         param_groups=None, **kwargs) -> SlideOptimizer:
        """A `SlideOptimizer` (AdamW) over this model's master weights.

        Args:
            lr, betas, eps: as torch.optim.AdamW.
            weight_decay: decoupled weight decay; default 0.0, as the HF Trainer's and
                `SlideOptimizer`'s (torch.optim.AdamW's default is 0.01).
            param_groups: optional param-group dicts (e.g. decay / no-decay); default: one group.
        """
        params = param_groups if param_groups is not None else list(self.parameters())
        return SlideOptimizer(params, self.slide_engine, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              **kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, inputs_embeds=None,
                num_items_in_batch=None, shift_labels=None, logits_to_keep=0, use_cache=None, return_dict=None,
                fused_lm_head=False, **kwargs):
        """HF causal-LM forward through the sliding engine.

        With `labels`, returns the loss (fused linear cross-entropy; logits are not materialized).
        Without labels, or under `torch.no_grad()`, returns logits for evaluation. With
        `fused_lm_head=True` and labels, returns a `FusedLMHeadOutput`: per-token log-probabilities
        (differentiable), entropies and top-1 hits, as TRL's fused LM head does, from the engine's
        own head (`functions.TokenHeadFunction`).
        """
        eng = self.slide_engine
        check_active(eng.lora.saved)
        if inputs_embeds is not None:
            raise NotImplementedError("inputs_embeds is not supported by the sliding engine; pass input_ids")
        if input_ids is None:
            raise ValueError("input_ids is required")
        check_token_ids(input_ids)
        check_label_dtype(labels)
        check_label_dtype(shift_labels, "shift_labels")
        eng.labels.raise_pending()               # a bad batch of an earlier step, once the device got there
        past = kwargs.pop("past_key_values", None)
        past = kwargs.pop("cache", None) if past is None else past
        if use_cache or past is not None:
            # Generation: each call slides the layers once for the new tokens, and every decoder
            # layer appends its keys and values to the cache on the device (HF's own cache object).
            if torch.is_grad_enabled() and (labels is not None or shift_labels is not None):
                raise NotImplementedError("a KV cache is for generation: train without use_cache / past_key_values")
            use_cache = True
        for k in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(k, None):
                raise NotImplementedError(f"{k} is not supported by the sliding engine")
        dev = eng.device
        if attention_mask is not None:
            attention_mask = attention_mask.to(dev)
        if position_ids is not None:
            position_ids = position_ids.to(dev)
        # Tensors among the rest (generate's cache_position, made on the prompt's device) go to the compute device.
        kwargs = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        base = eng.adapter.base(self)
        t0 = time.perf_counter()
        if use_cache:
            key = _cache_key(type(base))         # "past_key_values", or "cache" in newer transformers
            with torch.no_grad():
                out = base(input_ids=input_ids.to(dev), attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=True, **{key: past}, **kwargs)
            # The logits go back to the prompt's device, where generate() appends the next tokens
            # (the cache stays on the compute device).
            logits = eng.head.logits(out.last_hidden_state, logits_to_keep).to(input_ids.device)
            return CausalLMOutputWithPast(logits=logits, **{key: getattr(out, key)})
        if eng.router_aux is not None:          # HF's rule: the forward's output_router_logits, else the config's
            ask = kwargs.pop("output_router_logits", None)
            eng.router_aux.begin(attention_mask, bool(self.config.output_router_logits if ask is None else ask))
        out = base(input_ids=input_ids.to(dev), attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, **kwargs)
        h = out.last_hidden_state
        if torch.is_grad_enabled():
            eng.stats.tokens += input_ids.numel()
        aux = eng.router_aux.value(h) if eng.router_aux is not None else None
        if fused_lm_head:
            if labels is None and shift_labels is None:
                raise ValueError("fused_lm_head=True needs labels (or shift_labels): it scores each next-token label")
            out = fused_head(eng, h, labels, shift_labels, num_items_in_batch)
            out.aux_loss = aux                   # the caller adds it (TRL: coef * aux_loss): router_aux.py
            if torch.is_grad_enabled():
                eng.stats.forward_s += time.perf_counter() - t0
            return out
        if labels is None and shift_labels is None:
            return CausalLMOutputWithPast(logits=eng.head.logits(h, logits_to_keep))
        if labels is not None:
            labels = labels.to(dev)
        if torch.is_grad_enabled() and h.requires_grad:
            from .functions import HeadFunction
            if shift_labels is not None:
                raise NotImplementedError("shift_labels with gradients: pass labels instead")
            loss = HeadFunction.apply(h, eng, labels, num_items_in_batch)
            eng.stats.forward_s += time.perf_counter() - t0
        else:
            loss, _ = eng.head.forward(h, labels, num_items_in_batch, with_grad=False, shift_labels=shift_labels)
        if aux is not None:
            # HF's loss + router_aux_loss_coef * aux; its gradient reaches the routers in each
            # layer's recompute (router_aux.py).
            return MoeCausalLMOutputWithPast(loss=loss + eng.router_aux.coef * aux, aux_loss=aux)
        return CausalLMOutputWithPast(loss=loss)

    def __setattr__(self, name, value):
        # Note: [Why TRL's fused LM head is not installed on a slid model] TRL's trainers replace
        # `model.forward` by one that runs the decoder stack and scores `lm_head.weight` itself,
        # so the engine's head, where its backward starts, would be bypassed. The slid forward
        # answers `fused_lm_head=True` itself with the same fields (`fused_head.fused_head`), so that
        # patch is checked for what it asks and then left out (`trl_support.adopt_forward`).
        if name == "forward" and "slide_engine" in self.__dict__:
            trl_support = importlib.import_module(f"{__package__}.trl_support")   # the HF glue builds on this module
            if trl_support.adopt_forward(self, value):
                return
        super().__setattr__(name, value)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """A no-op: the sliding engine already recomputes every layer from its saved input in backward."""
        if not getattr(self, "_slide_checkpointing_noted", False):
            logger.info("gradient checkpointing on a slid model changes nothing: the sliding engine already "
                        "recomputes every layer from its saved input")
            self.__dict__["_slide_checkpointing_noted"] = True

    def gradient_checkpointing_disable(self):
        """A no-op (see `gradient_checkpointing_enable`)."""

    activation_checkpointing_enable = gradient_checkpointing_enable      # transformers' newer names
    activation_checkpointing_disable = gradient_checkpointing_disable

    def slide_stats(self) -> dict:
        """Cumulative engine telemetry (take differences between two calls for a window of steps).

        Keys: steps, tokens; h2d/d2h/activation bytes; forward_s and backward_s (host wall time
        inside the engine); gpu_compute_s (CUDA-event time of the layers' and head's kernels);
        cpu_adam_s and worker_busy_s (the CPU worker); wait_update_s, wait_grad_buffer_s,
        wait_other_s (main thread blocked on the worker); step_wall_s (time between optimizer
        steps), tokens_per_s and gpu_busy (GPU kernel time / wall time) from it; peak GPU memory
        and host RSS; gpu_updated_params and resident_layers (layers updated on the GPU, see
        SlideConfig.resident_layers); device_updated_layers (host-held layers whose clipping-mode
        update runs on the GPU, see SlideConfig.device_update_share); worker_wait_s (the worker
        blocked on GPU copies). With layers on disk (SlideConfig.host_memory_limit): disk_layers
        (with any state on disk), disk_moment_layers (of them, those with only their moments there),
        disk_buffers, disk_read_bytes, disk_write_bytes and wait_disk_s (time the main thread and
        the worker waited for a buffer, a read or a write). optimizer_state (SlideConfig's) and
        host_state_bytes: the masters and optimizer state the host store holds, as each unit's
        format declares them (host_optim.py; the embedding's own: `host_optim.embed_format`).
        """
        eng = self.slide_engine
        out = eng.stats.snapshot(eng.worker.busy_s)
        out["optimizer_state"] = eng.config.optimizer_state
        out["host_state_bytes"] = eng.store.state_bytes()
        out["resident_layers"] = len(eng.residents.layers)
        out["resident_embedding"] = eng.embedding.resident is not None
        out["device_updated_layers"] = len(eng.device_updates.units)
        if eng.store.disk is not None:                  # host_memory_limit: layers' state on disk
            out.update(eng.store.disk.stats())
        return out

    # ------------------------------------------------------------------ state
    def slide_synchronize(self) -> None:
        """Wait for every queued update and copy: the parameters are then the current masters.

        The updates of an optimizer step overlap the next forward, so a parameter read directly
        right after `optimizer.step()` (`model.parameters()`, a view kept from earlier) may be
        older than the step. `state_dict()`, `save_pretrained()` and the optimizer's
        `state_dict()` wait by themselves; call this before reading parameters any other way.
        """
        self.slide_engine.synchronize()

    def state_dict(self, *args, **kwargs):
        """The current weights under HF names: the fp32 masters, once every queued update has run."""
        self.slide_engine.synchronize()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load weights under HF names into the fp32 masters (in place: they stay the engine's).

        Every queued update runs first and the resident units go back to the host store, so the
        loaded values are what the next step trains from.
        """
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the slid model's master weights; "
                             "load in place (assign=False)")
        self.slide_engine.synchronize()
        out = super().load_state_dict(state_dict, strict=strict)
        for u in self.slide_engine.store.units:
            u.version += 1                        # device copies of the old weights are stale
        self.slide_engine.note_restored(weights=True)
        return out

    def save_pretrained(self, save_directory, max_shard_size: str | int = "5GB", dtype: torch.dtype | None = None,
                        **kwargs):
        """Write sharded safetensors + config that `AutoModelForCausalLM.from_pretrained` loads.

        Weights are written layer by layer from the masters in `dtype` (default: float32, the
        masters themselves, as HF saves a model trained in mixed precision). Over an earlier
        save, a save killed at any step leaves the directory loading as the old save or the new
        one (see `checkpoint.save_model`); other files in the directory are kept. With several
        ranks, every rank may call it and rank 0 writes.
        """
        from .checkpoint import save_model

        self.slide_engine.synchronize()
        dp = self.slide_engine.dp
        if dp is not None and not dp.writes:
            return                  # several ranks share one state (data_parallel.py): rank 0 writes it
        save_model(self, save_directory, max_shard_size=max_shard_size, dtype=dtype or torch.float32)

    def to(self, *args, **kwargs):
        """Device moves are ignored (the engine places the weights); dtype changes are refused."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != torch.float32:
            raise ValueError("a slid model keeps fp32 masters on the host; choose the compute dtype with SlideConfig.dtype")
        return self

    def cuda(self, *args, **kwargs):
        return self

    def cpu(self):
        return self

    def half(self):
        raise ValueError("a slid model keeps fp32 masters; choose the compute dtype with SlideConfig.dtype")

    bfloat16 = half

    def float(self):
        return self
