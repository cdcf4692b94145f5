"""The user-facing model: `slide(hf_model)` and `SlideModel.from_pretrained(path)`.

A slid model stays the HF model object (its class becomes a subclass, `Slide<Class>`, so
`isinstance` checks, `config` and the Trainer keep working): its parameters become views of the
host fp32 masters, and its forward runs through the sliding engine.
"""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import logging
import os
import time
import weakref

import torch
import torch.nn as nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from .checkpoints.adapter_save import slid_peft_class
from .config import SlideConfig, configure_logging
from .engine.data_parallel import DataParallel
from .engine.slide_engine import SlideEngine
from .compute.fused_head import FusedLMHeadOutput, fused_head
from .engine.lora import peft_base
from .host.memory import enable_expandable_segments
from .models import get_adapter
from .engine.modules_to_save import check_active, fill_originals
from .compute.model_inputs import check_label_dtype, check_token_ids
from .checkpoints.model_state import SlideModelState
from .host.optim import SlideOptimizer
from .compute.layer_matmuls import check_matmuls
from .engine.slide_build import (build_units, check_on_cpu, drop_hub_kernels, fill_and_build, install_proxies,
                          lora_held_params, refuse_adapters_outside_layers, released_on_failure)
from .engine.slide_checks import align_grouped_experts, check_finite_weights, check_gpu_limit, rank_fingerprint
from .host.store import HostStore

logger = logging.getLogger(__name__)

__all__ = ["SlideModel", "slide", "is_slid", "FusedLMHeadOutput"]

_CLASSES: dict[type, type] = {}


def is_slid(model: nn.Module) -> bool:
    """Whether `model` runs through the sliding engine."""
    return getattr(model, "slide_engine", None) is not None


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
    adapters, originals = lora_held_params(model, adapter) if base is not None else (set(), set())
    adapter.check(model)
    check_matmuls(config, adapter, model, lora=base is not None)
    if adapters:
        refuse_adapters_outside_layers(model, adapter, adapters)
    if config.expandable_segments and config.is_cuda:
        enable_expandable_segments()
    drop_hub_kernels(model)
    units = build_units(model, adapter, skip=adapters | originals)
    if _fill:
        check_on_cpu(units)
    if _fill and config.check_finite_weights:
        check_finite_weights(model.named_parameters())
    if dp is not None:                  # before any shared memory: its sizes follow the model
        dp.check_same(rank_fingerprint(config, model, units))
    if config.is_cuda:
        check_gpu_limit(config, units, tied=adapter.lm_head(model).weight is adapter.embed(model).weight)
    with released_on_failure(config) as built:
        built["store"] = HostStore(units, config, dp)
        if config.is_cuda:                  # the slot offsets are set: HF's grouped GEMM needs them aligned
            align_grouped_experts(model, units, config.dtype)
        fill_and_build(model, adapter, config, built, units, dp, _fill)
    engine = built["engine"]
    model.__class__ = _slid_class(type(model))
    model.slide_engine = engine
    model.slide_config = config.read_only()
    install_proxies(model, adapter, engine)
    closer = weakref.finalize(model, engine.close)   # unpin and stop the worker when the model goes
    closer.atexit = False                             # at exit the process tears everything down anyway
    if base is not None:
        engine.lora.adopt_all()
        peft_model.__class__ = slid_peft_class(type(peft_model))     # its save_pretrained, crash-safe
    return peft_model


def _loss_output(engine, hidden, labels, shift_labels, num_items_in_batch, aux, t0: float):
    """The loss of the final hidden states through the engine's head (its backward starts there
    when they carry gradients), plus a mixture of experts' router loss when there is one."""
    if labels is not None:
        labels = labels.to(engine.device)
    if torch.is_grad_enabled() and hidden.requires_grad:
        from .compute.functions import HeadFunction
        if shift_labels is not None:
            raise NotImplementedError("shift_labels with gradients: pass labels instead")
        loss = HeadFunction.apply(hidden, engine, labels, num_items_in_batch)
        engine.stats.forward_s += time.perf_counter() - t0
    else:
        loss, _ = engine.head.forward(hidden, labels, num_items_in_batch, with_grad=False, shift_labels=shift_labels)
    if aux is not None:
        # HF's loss + router_aux_loss_coef * aux; its gradient reaches the routers in each
        # layer's recompute (router_aux.py).
        return MoeCausalLMOutputWithPast(loss=loss + engine.router_aux.coef * aux, aux_loss=aux)
    return CausalLMOutputWithPast(loss=loss)


class SlideModel(SlideModelState):
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
        from .checkpoints.checkpoint import load_model_meta, load_weights

        model = load_model_meta(path, **kwargs)
        if peft_config is None:
            slide(model, slide_config, _fill=False)
            dp = model.slide_engine.dp
            if dp is None or dp.writes:           # several ranks share the masters: rank 0 reads the files
                load_weights(model, path)
            if dp is not None:
                dp.barrier()
            return model
        from .engine.lora import peft_on_meta

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
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(flag, None):
                raise NotImplementedError(f"{flag} is not supported by the sliding engine")
        dev = eng.device
        if attention_mask is not None:
            attention_mask = attention_mask.to(dev)
        if position_ids is not None:
            position_ids = position_ids.to(dev)
        # Tensors among the rest (generate's cache_position, made on the prompt's device) go to the compute device.
        kwargs = {key: value.to(dev) if torch.is_tensor(value) else value for key, value in kwargs.items()}
        base = eng.adapter.base(self)
        t0 = time.perf_counter()
        if use_cache:
            return self._generation_forward(base, input_ids, attention_mask, position_ids, past, logits_to_keep,
                                            kwargs)
        if eng.router_aux is not None:          # HF's rule: the forward's output_router_logits, else the config's
            ask = kwargs.pop("output_router_logits", None)
            eng.router_aux.begin(attention_mask, bool(self.config.output_router_logits if ask is None else ask))
        out = base(input_ids=input_ids.to(dev), attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, **kwargs)
        hidden = out.last_hidden_state
        if torch.is_grad_enabled():
            eng.stats.tokens += input_ids.numel()
        aux = eng.router_aux.value(hidden) if eng.router_aux is not None else None
        if fused_lm_head:
            if labels is None and shift_labels is None:
                raise ValueError("fused_lm_head=True needs labels (or shift_labels): it scores each next-token label")
            out = fused_head(eng, hidden, labels, shift_labels, num_items_in_batch)
            out.aux_loss = aux                   # the caller adds it (TRL: coef * aux_loss): router_aux.py
            if torch.is_grad_enabled():
                eng.stats.forward_s += time.perf_counter() - t0
            return out
        if labels is None and shift_labels is None:
            return CausalLMOutputWithPast(logits=eng.head.logits(hidden, logits_to_keep))
        return _loss_output(eng, hidden, labels, shift_labels, num_items_in_batch, aux, t0)

    def _generation_forward(self, base, input_ids, attention_mask, position_ids, past, logits_to_keep, kwargs):
        """Generation: one slide over the layers for the new tokens, each decoder layer appending
        its keys and values to HF's cache object on the device."""
        eng = self.slide_engine
        key = _cache_key(type(base))         # "past_key_values", or "cache" in newer transformers
        with torch.no_grad():
            out = base(input_ids=input_ids.to(eng.device), attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=True, **{key: past}, **kwargs)
        # The logits go back to the prompt's device, where generate() appends the next tokens
        # (the cache stays on the compute device).
        logits = eng.head.logits(out.last_hidden_state, logits_to_keep).to(input_ids.device)
        return CausalLMOutputWithPast(logits=logits, **{key: getattr(out, key)})

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
        SlideConfig.resident_layers) and resident_plan (what the measured plan read: the limit, the
        step's reserved and allocated peaks, a resident layer's bytes per parameter); device_updated_layers (host-held layers whose
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
        out["resident_plan"] = dict(eng.residents.inputs)     # the measured plan's peak, limit and bytes
        out["device_updated_layers"] = len(eng.device_updates.units)
        if eng.store.disk is not None:                  # host_memory_limit: layers' state on disk
            out.update(eng.store.disk.stats())
        return out
