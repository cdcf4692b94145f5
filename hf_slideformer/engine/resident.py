"""Resident units: the optimizer state of the embedding and a few layers kept on the GPU and
updated there.

Under a memory cap the GPU usually has room left after the window, the activations and the
head: a 3B model trained at 16 x 2048 under 24 GiB peaks near 13 GiB. That room is worth more
as optimizer state than as nothing: a resident layer keeps its master, Adam moments (in its state
format: resident_state.py) and compute-dtype weights on the GPU, is never copied in, and is updated
there right after its backward (torch's fused CUDA AdamW; the compact formats' update in torch ops,
adam8_torch.py), instead of by the CPU worker (tens of ms per layer). The CPU
worker, the bound at small batches, has that much less to do, and the next forward does not
wait for those layers.

While a unit is resident its device copy is the current state: `ResidentPlan.evict()` writes the
master, moments and step counters back before anything reads or replaces the host state
(`engine.synchronize()`: checkpoints, state_dict, save_pretrained, load_state_dict). The embedding goes first (its update, the per-row folding of its
gradient and, when tied, the lm_head's (V, H) gradient copy all leave the CPU, and it is what
the next forward needs first), then layers 0..k-1, the next ones the forward needs.
"""
from __future__ import annotations

import logging

import torch

from ..host import optim as _optim
from ..planner.budget import plan_resident
from ..errors import SlideStateError
from ..host.memory import GiB, release_pages
from ..host.optim import sq_norm as _sq_norm
from .placements import DeferredStep, LayerPlacement
from ..planner.planner import plan as _estimate
from .resident_state import ResidentState, resident_bytes_per_param_of
from ..host.store import Unit

logger = logging.getLogger(__name__)

__all__ = ["ResidentState", "ResidentLayer", "ResidentPlan", "plan_resident", "measured_peak"]   # ResidentState: resident_state.py


class ResidentLayer(LayerPlacement):
    """A layer whose state is on the GPU: never copied in, updated by torch's fused CUDA AdamW on
    the compute stream right after its backward (or at `optimizer.step()` with clipping).

    Args:
        engine, unit: as LayerPlacement.
        state: its device copies.
        replaced: the placement it had on the host, which it takes again when evicted.
    """

    resident = True

    def __init__(self, engine, unit: Unit, state: ResidentState, replaced: LayerPlacement):
        super().__init__(engine, unit)
        self.state, self.replaced = state, replaced

    def weights(self, busy: tuple = ()):
        return self.state.views(), None

    def prefetch(self, busy: tuple = ()) -> None:
        pass

    def after_forward(self, slot) -> None:
        self.engine.residents.pace()

    def after_recompute(self, slot) -> None:
        pass

    def take_gradient(self, grads: list) -> None:
        """AdamW on the compute stream right after the backward; with clipping the gradient waits
        on the device for optimizer.step(). With accumulation it is summed on the device over the
        micro-batches, and the last one updates (or, with clipping, leaves the sum for
        optimizer.step()); the squared norm is the sum's."""
        engine, plan = self.engine, self.engine.backward_plan
        g32 = engine.step_shape.resident_gradient(self, grads, plan)     # step_shape.py
        plan.updating.now(lambda: self._update_in_backward(g32))
        engine.residents.pace()

    def take_step_gradient(self, grads: list, plan) -> torch.Tensor:
        """One backward per step: the gradients' squared norm joins the running norm, then they
        are copied into the fp32 gradient the update reads (the layers' shared one when this
        backward updates, else the layer's own, kept for optimizer.step()), which is returned."""
        engine, unit, state = self.engine, self.unit, self.state
        plan.norm.add(_sq_norm, [g for g in grads if g is not None])
        g32 = plan.updating.buffer(lambda: engine.residents.shared_grad[:unit.numel], lambda: state.grad)
        self._sum_gradient(g32, grads, first=True)
        return g32

    def sum_micro_gradient(self, grads: list, plan) -> torch.Tensor:
        """With accumulation: the gradients summed into the layer's fp32 gradient (returned); the
        step's last backward adds the sum's squared norm to the device's part (`plan.sums_norm`)."""
        state = self.state
        g32 = state.grad
        self._sum_gradient(g32, grads, first=not state.grad_valid)
        state.grad_valid = True
        plan.sums_norm.add(_sq_norm, [g32])
        return g32

    def _sum_gradient(self, g32: torch.Tensor, grads: list, first: bool) -> None:
        """Copy (`first`) or add `grads` into the fp32 gradient `g32`, entry by entry (zeros for an
        unused entry's first)."""
        for entry, grad in zip(self.unit.entries, grads):
            dst = entry.view(g32)
            if grad is None:
                if first:
                    dst.zero_()
            elif first:
                dst.copy_(grad.reshape(dst.shape))
            else:
                dst.add_(grad.reshape(dst.shape))

    def _update_in_backward(self, g32: torch.Tensor) -> None:
        """The backward updates: AdamW from the fp32 gradient `g32` now, skipped where the running
        norm is not finite."""
        engine = self.engine
        engine.residents.resident_step(self.unit, self.state, g32, found_inf=engine.norm.found_inf())
        self.state.grad_valid = False

    def step(self, deferred: DeferredStep) -> None:
        coef, found_inf = deferred.resident_clip()
        # the clip factor applied in the fused AdamW, as on the host; skipped where not finite
        self.engine.residents.resident_step(self.unit, self.state, self.state.grad, deferred.hp, clip_coef=coef,
                                            found_inf=found_inf)
        self.state.grad_valid = False


def measured_peak(device) -> int:
    """The GPU memory a training step needed: the allocator's reserved peak.

    Note: [Why the plan measures reserved memory] what the allocator reserves, not the
    allocated peak, must stay under the cap: a plan from the allocated peak fills the gap with
    resident units, the reserved memory then sits at the cap, and the allocator releases and maps
    pages during the step, which costs more than the extra resident layer saves. Expandable
    segments lower the reserved peak itself. (docs/benchmarks.md, "Measurements behind the
    engine's notes".)
    """
    return torch.cuda.max_memory_reserved(device)


def allocated_peak(device) -> int:
    """The allocator's allocated peak (reported beside the reserved one the plan reads)."""
    return torch.cuda.max_memory_allocated(device)


class ResidentPlan:
    """Which units are resident on the GPU, planned from a measured step, and their updates.

    Args:
        engine: the SlideEngine.
        model_config: the HF config as a dict (for the estimate before the first step), or None.

    Attributes:
        planned: (embedding resident, number of resident layers) once planned, else None.
        shared_grad: one fp32 device gradient all resident layers share when they update in backward.
    """

    def __init__(self, engine, model_config: dict | None):
        self.engine = engine
        self.model_config = model_config
        self.planned: tuple[bool, int] | None = None   # decided after the first optimizer step
        self.shared_grad: torch.Tensor | None = None
        self.peak: int | None = None                   # GPU peak the plan is based on ...
        self.tokens: int | None = None                 # ... and the tokens of that step's batch
        self.last_tokens = 0
        self._pace_ev = None
        self.inputs: dict = {}                         # what the measured plan was made from (slide_stats)

    @property
    def layers(self) -> dict[int, ResidentState]:
        """Layer index -> the device state of each resident layer."""
        places = self.engine.places
        return {places.layer_no(place.unit): place.state for place in places.resident()}

    def target(self) -> tuple[bool, int]:
        """The plan, made now if there is none yet."""
        if self.planned is None:
            self.planned = self.plan()
        return self.planned

    def plan(self) -> tuple[bool, int]:
        """(embedding resident, number of resident layers) from the config and the measured peak
        (with accumulation the config's layers alone: step_shape.py)."""
        return self.engine.step_shape.resident_plan(self)

    def measured_plan(self) -> tuple[bool, int]:
        """With one backward per step: (embedding resident, number of resident layers) from the
        config and, where it says "auto", the measured peak (`Streams.plan_resident`: nothing to
        gain on a CPU device unless asked)."""
        config = self.engine.config
        embed = None if config.resident_embedding == "auto" else bool(config.resident_embedding)
        layers = None if config.resident_layers == "auto" else int(config.resident_layers)
        return self.engine.streams.plan_resident((bool(embed), layers or 0), lambda: self.fitted_plan(embed, layers))

    def fitted_plan(self, embed: bool | None, layers: int | None) -> tuple[bool, int]:
        """On a GPU: `embed` and `layers` where the config gives them, else what fits the cap above the peak."""
        engine = self.engine
        config = engine.config
        if embed is not None and layers is not None:
            return embed, layers
        limit = (int(config.gpu_memory_limit * GiB) if config.gpu_memory_limit is not None
                 else torch.cuda.get_device_properties(engine.device).total_memory)
        if self.peak is None:      # the first step's peak, less the resident state it began with
            self.peak = max(0, measured_peak(engine.device) - self.resident_bytes())
            self.tokens = self.last_tokens
        per, held = (resident_bytes_per_param_of(engine.layer_units[0].state_format, engine.dtype),
                     engine.device_updates.held_gradient_bytes())
        plan = plan_resident(limit_bytes=limit, peak_bytes=self.peak, held_bytes=held,
                             layer_numel=max(u.numel for u in engine.layer_units), n_layers=len(engine.layer_units),
                             embed_numel=engine.embed_unit.numel, dtype=engine.dtype, embed=embed, layers=layers,
                             clipping=config.max_grad_norm is not None, layer_bytes_per_param=per)
        self.inputs = {"limit_bytes": limit, "peak_bytes": self.peak, "allocated_peak_bytes": allocated_peak(engine.device),
                       "layer_bytes_per_param": per, "held_bytes": held, "embedding": plan[0], "layers": plan[1]}
        logger.info("resident on the GPU: embedding %s, layers 0..%d (reserved peak %.2f GiB of %.2f, %.2f B/param)",
                    "yes" if plan[0] else "no", plan[1] - 1, self.peak / GiB, limit / GiB, per)
        return plan

    def resident_from_start(self, tokens: int) -> bool:
        """Does the embedding (on the host, trainable) go resident at a training forward of `tokens`
        tokens, before the plan has measured a step (one backward per step, an optimizer built)?"""
        engine = self.engine
        return (self.peak is None and self.planned is None and engine.single_micro and engine.optimizer is not None
                and self.first_embed_plan(tokens))

    def first_embed_plan(self, tokens: int) -> bool:
        """Before the first training step: is the embedding resident from the start?

        Note: [Why the embedding can be resident before the first step] the plan measures a step
        first, and a step with the embedding on the host touches its moments, dense gradient and
        row buffers (9 GB at 8B, batch 16) only for them to be given back when it goes resident:
        that first step set the run's peak host memory. When the option says so, or when the
        planner's estimate (`planner.plan`, the same one `hf-slideformer plan` prints) already
        finds room for it, the embedding is resident from the first step; the measured plan then
        confirms it or writes it back (`promote`).
        """
        config = self.engine.config
        if config.resident_embedding != "auto":
            return bool(config.resident_embedding)
        return self.engine.streams.plan_resident(False, lambda: self.estimated_embed_plan(tokens))

    def estimated_embed_plan(self, tokens: int) -> bool:
        """On a GPU: does the planner's estimate for a batch of `tokens` tokens find room for the
        resident embedding (False without the model's config)?"""
        config = self.engine.config
        if self.model_config is None:
            return False
        limit = (config.gpu_memory_limit if config.gpu_memory_limit is not None
                 else torch.cuda.get_device_properties(self.engine.device).total_memory / GiB)
        try:
            plan = _estimate(self.model_config, batch=1, seq=max(1, tokens), gpu_mem=limit, host_mem=1e6,
                             max_grad_norm=config.max_grad_norm, window=config.window,
                             activation_tier=config.activation_tier, grad_buffers=config.grad_buffers)
        except (ValueError, KeyError, TypeError) as err:     # a config the planner cannot read: measure first
            logger.info("no estimate before the first step (%s); the embedding waits for the measured plan", err)
            return False
        return bool(plan.resident_embedding)

    def resident_bytes(self) -> int:
        """Device bytes the resident units hold now (outside any step's own peak)."""
        emb = self.engine.embedding
        ts = [emb.rgrad, self.shared_grad]
        for state in list(self.layers.values()) + emb.table.device_states():
            ts += state.tensors()
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def fit(self, tokens: int) -> None:
        """Before a training forward: a batch larger than the one the plan measured may need the
        memory the resident units hold, so they go back to the host for it, and the next plan
        scales the measured peak by the new size (an over-estimate: part of the peak is fixed).
        The plan only grows, so a run settles at its longest batch.

        Before the first step, the embedding may go resident at once ([Why the embedding can be
        resident before the first step])."""
        self.last_tokens = tokens
        self.engine.embedding.table.to_device(wanted=lambda: self.resident_from_start(tokens))
        if self.peak is None or not self.tokens or tokens <= self.tokens:
            return
        self.evict()                              # whatever is resident
        self.peak = int(self.peak * tokens / self.tokens)
        self.tokens = tokens
        self.planned = None

    def make_state(self, unit: Unit, with_grad: bool = False) -> ResidentState:
        """`u`'s state copied to the device once its last update has landed; its host moments given back."""
        engine = self.engine
        if unit.kind == "embed" and unit.state_format is not None and unit.state_format.name != "adamw":
            raise SlideStateError(f"{unit.name} keeps optimizer_state={unit.state_format.name!r} on the host: a resident "
                                  "embedding keeps fp32 AdamW (use resident_embedding=False or 'auto')")
        engine.clock.wait(unit.updated, "update")           # its last CPU update has landed in the host store
        engine.device_updates.flush(unit)                    # ... or its device update (written back on the d2h stream)
        engine.streams.wait(unit.host_write)
        state = ResidentState(unit, engine.dtype, engine.device, with_grad=with_grad)
        state.load_from_host()
        # The host moments are not read again until evict() writes them back; a clipping layer's
        # host accumulator is not used while its gradient stays on the device (it reads as zeros,
        # its reset state).
        state.release_host(release_pages)
        if unit.grad is not None and not unit.grad_valid:
            release_pages(unit.grad)
        return state

    def promote(self) -> None:
        """Make the embedding and layers 0..k-1 resident (between optimizer steps)."""
        engine = self.engine
        if engine.optimizer is None:
            return
        embed, count = self.target()
        count = min(count, len(engine.layer_units))
        if embed:
            engine.places.refresh_ends()            # a trained embedding only: as it is now, between steps
            engine.embedding.table.to_device()
        else:
            engine.head.lm_weight.embedding_stays_on_host()   # a tied one's gradient and master pinned again
            engine.embedding.table.to_host()
        if not engine.places.any_streamed_trainable(count):
            return                                # nothing (more) to make resident: a frozen base stays
        own_grad = engine.config.max_grad_norm is not None or not engine.single_micro   # a gradient per layer
        if self.shared_grad is None and not own_grad:
            self.shared_grad = torch.empty(max(u.numel for u in engine.layer_units), dtype=torch.float32,
                                           device=engine.device)
        for place in engine.places.residency_candidates(count):
            state = self.make_state(place.unit, with_grad=own_grad)
            engine.set_place(place.unit, ResidentLayer(engine, place.unit, state, place))

    def evict(self) -> None:
        """Write the resident units' state back to the host store and drop the device copies."""
        engine, emb = self.engine, self.engine.embedding
        states = list(self.layers.values()) + emb.table.device_states()
        if not states:
            return
        emb.table.prepare_eviction()
        engine.streams.synchronize()
        emb.table.keep_backward_gradient()
        for state in states:
            state.store_to_host()
            if state.grad_valid:
                # Between micro-batches: the running sum goes on in the host accumulator.
                unit = state.unit
                unit.grad.copy_(state.grad)
                unit.grad_valid = True
                state.grad_valid = False
        for place in engine.places.resident():
            engine.set_place(place.unit, place.replaced)
        emb.return_to_host()

    def resident_step(self, unit: Unit, state: ResidentState, g32: torch.Tensor, hp=None, clip_coef=None,
                      found_inf=None) -> None:
        """AdamW of resident unit `u` with its fp32 gradient on the device.

        Note: [Why the master is not copied back every step] the device master is the current
        one while the unit is resident; `evict()` writes it back with the moments. A copy after
        every update would cost 4 bytes per parameter of d2h each step, and the last ones (layer
        0, the embedding) would end the step with the GPU idle. Host-side readers of the weights
        (state_dict, save_pretrained, checkpoints) synchronize first, which evicts.
        """
        engine = self.engine
        _optim.apply_adamw(unit, g32, *(hp or engine.hp), state=state, clip_coef=clip_coef, found_inf=found_inf)
        if state.weights is not state.master:
            state.weights.copy_(state.master)
        unit.version += 1                                   # any slot copy of the old weights is stale
        engine.stats.gpu_adam_params += unit.numel

    def pace(self) -> None:
        """Keep the host at most one resident layer ahead of the GPU.

        Note: [Why resident layers are paced] without a copy or an update to wait for, the host
        would queue resident layers' kernels as fast as Python runs, and the CPU worker, its
        AdamW done, could not return from its task until the resident stretch ended (it does
        not get the interpreter lock back; docs/benchmarks.md has the traces). Waiting on the
        previous layer's event releases the lock, so a worker task takes its AdamW plus its
        waits and nothing more. One layer of queued work covers the host's launch overhead.
        """
        st = self.engine.streams                  # (on a CPU device every event is already complete)
        prev, self._pace_ev = self._pace_ev, st.record()
        if prev is not None:
            prev.synchronize()

    def clip_by_running_norm(self) -> tuple:
        """(clip factor or None, found_inf) for the device-side updates at optimizer.step() of a
        step with one backward: from the device's running norm, without a host sync."""
        engine = self.engine
        coef = None if engine.config.max_grad_norm is None else engine.norm.clip_coef()
        return coef, engine.norm.found_inf()

    def clip_by_worker(self, clip_done) -> tuple:
        """(clip factor or None, found_inf or None) for the device-side updates at optimizer.step()
        with accumulation: the worker's (`clip_done`: its clip task has run), from the host units'
        norms and the device's; nothing to wait for without clipping."""
        engine = self.engine
        if engine.config.max_grad_norm is None:
            return None, None
        engine.clock.wait(clip_done, "update")
        return engine.host_updates.clip_coef, torch.tensor(float(engine.host_updates.poisoned), device=engine.device)

    def step(self, deferred: DeferredStep) -> set[int]:
        """Clip and update the resident units at optimizer.step() (clipping, or a step that ends
        before its last micro-batch); their unit ids."""
        places = self.engine.places.resident()
        ids = self.engine.embedding.table.step_on_device(deferred) | {id(p.unit) for p in places}
        for place in places:
            place.step(deferred)
        return ids
