"""The sliding engine: the forward / backward schedule of one training step.

Forward keeps no autograd graph inside a layer: each decoder layer runs under `no_grad` on the
weights of a GPU slot and only its input x_i goes to the activation tier. Backward recomputes
layer i from x_i with gradients, sends the parameter gradients to the host and lets the CPU
worker update the layer's masters, while layer i-1's weights and input are already arriving.

The HF model's own forward runs unchanged around the engine: the embedding, each decoder layer
and the final norm get a proxy `forward` that hands the work to the engine, so masks, RoPE,
GQA and sliding-window attention remain HF's code. Three autograd Functions connect the pieces:
`EmbedFunction` -> `LayerFunction` x L -> `HeadFunction` (`functions.py`; norm + lm_head + loss, whose
gradients are computed in its forward: the loss ends the graph).
"""
from __future__ import annotations

import logging
import weakref

import torch

from .accumulate import DeviceAccumulator
from .activations import make_tier
from .device_update import DeviceUpdater
from ..disk.disk_placement import DiskLayer
from .embedding import Embedding
from ..errors import SlideStateError
from ..compute.model_inputs import LabelCheck
from ..compute.functions import RngReplay
from .grad_ring import GradientRing
from .late_updates import LateUpdates
from ..compute.layer_matmuls import layer_matmuls
from .head import LossHead
from .lora import AdapterSet
from ..host.host_adam import HostAdam
from ..host.host_tasks import HostUpdates
from ..host.memory import COPY_CHUNK
from .mode import BackwardGuard
from .placements import FrozenLayer, HostLayer, Placements
from .resident import ResidentPlan
from .schedule import BackwardPlan, Schedule
from .step_norm import StepNorm
from .step_shape import AccumulatedStep, OneBackwardStep
from .slots import SlotQueue
from ..host.store import HostStore, Unit
from .telemetry import MainClock, StepStats
from .transfer import Streams
from ..host.worker import CpuWorker

logger = logging.getLogger(__name__)

__all__ = ["SlideEngine", "SlideStateError"]



class SlideEngine:
    """Runs an HF causal LM through a window of device slots, with its state on the host.

    Args:
        model: the HF model (its parameters are replaced by views of the host masters).
        adapter: the family adapter.
        config: the SlideConfig.
        units: embed, layer and head units in schedule order, with masters filled.
        store: the host store holding them.
    """

    def __init__(self, model, adapter, config, store: HostStore):
        try:
            self._build(model, adapter, config, store)
        except BaseException:
            self._close_built()          # a failed slide() leaves no thread or file behind (the store is the caller's)
            raise

    def _close_built(self) -> None:
        """Release what a failed `_build` made: the worker's threads, the activation tier's files and thread."""
        for name in ("worker", "tier"):
            part = self.__dict__.get(name)
            if part is not None:
                try:
                    part.close()
                except Exception:        # noqa: BLE001 - the build's own error is the one to raise
                    logger.debug("closing the %s of a failed build", name, exc_info=True)

    def _build(self, model, adapter, config, store: HostStore) -> None:
        # No strong reference to the model itself: the model owns the engine, and the finalizer that
        # closes the engine when the model is collected must not keep the model alive.
        self.adapter, self.config, self.store = adapter, config, store
        # Several ranks (data_parallel.py): every unit sharded over them, one copy of the host state.
        self.dp = store.dp
        self.model_ref = weakref.ref(model)
        self.device, self.dtype = config.torch_device, config.dtype
        self.labels = LabelCheck(self.device)       # labels outside the vocabulary (model_inputs.py)
        units = store.units
        self.embed_unit: Unit = units[0]
        self.layer_units: list[Unit] = [unit for unit in units if unit.kind == "layer"]
        self.head_unit: Unit = units[-1]
        self.layers = list(adapter.layers(model))
        # Note: [Why the recompute skips the last projection] backward needs the input of a
        # layer's closing down_proj, never its output (it only feeds the residual add), so the
        # recompute returns zeros there: a quarter of a Llama layer's linear FLOPs saved on
        # every recompute. Set False to recompute the whole layer.
        self.skip_output_projection = True
        # Note: [Why a layer with dropout replays its random state] a dropout inside a layer (a LoRA
        # adapter's) draws its mask in the forward and again in the recompute: the recompute runs
        # from the random state the forward started from, so both draw the same mask.
        self.rng = RngReplay(self.device)
        self.dropouts: list[list[torch.nn.Module]] = []
        self.find_dropouts()
        self.output_projections = [adapter.output_projection(layer) for layer in self.layers]
        self.matmuls = layer_matmuls(config, self.layers)     # the projections' math (layer_matmuls.py)
        self.tied = adapter.lm_head(model).weight is adapter.embed(model).weight
        self.vocab, self.hidden = adapter.embed(model).weight.shape
        self.streams = Streams.for_device(self.device)       # CudaStreams or HostStreams (transfer.py)
        self.stats = StepStats(config.is_cuda)
        self.streams.tracer = self.stats            # copy spans join the step trace
        self.worker = CpuWorker(config.cpu_threads)
        self.worker.on_task = self.stats.event
        self.clock = MainClock(self.stats, self.streams, self.worker)   # timed waits and GPU spans
        self.pinned = store.pinned
        cast = config.is_cuda and self.dtype != torch.float32
        max_layer = max(unit.numel for unit in self.layer_units)
        head_numel = self.head_unit.numel + (self.embed_unit.numel if self.tied else 0)
        self.staging = torch.empty(min(max(max_layer, head_numel), COPY_CHUNK), dtype=torch.float32,
                                   device=self.device) if cast else None
        # Each layer's place (placements.py): swapped whole when the plan moves the layer.
        if self.dp is not None:
            from .sharded import ShardedEmbedding, ShardedHead, ShardedHostLayer
            host_layer, embedding, head = ShardedHostLayer, ShardedEmbedding, ShardedHead
        else:
            host_layer, embedding, head = HostLayer, Embedding, LossHead
        self.places = Placements(self.layer_units,
                                 lambda unit: host_layer(self, unit) if unit.trainable else FrozenLayer(self, unit))
        count, waiter = self.stats.add_h2d, self.clock.wait_master
        self.slots = SlotQueue(config.window, max_layer, self.dtype, self.streams, self.staging, count, waiter,
                               filler=lambda unit, dst: self.place_of(unit).fill(dst))
        self.host_adam = HostAdam(config.host_adam, config.cpu_threads)
        self.grad_ring = GradientRing(self, max_layer, config.grad_buffers, max(max_layer, head_numel))
        self.late = LateUpdates(self, max_layer)
        self.norm = StepNorm(self)
        self.set_step_shape()
        self.tier = make_tier(config, self.streams, self.stats.add_bytes, self.pinned)
        self.tier.keep_index = len(self.layer_units) - 1   # activation_tiers.py: [Why the last layer's input stays on the device]
        for layer_no, unit in enumerate(self.layer_units):       # host_memory_limit: the last layers' state on disk
            if store.on_disk(unit):
                self.places.assign(unit, DiskLayer(self, unit, store.disk, self.layers[layer_no]))
        head_slots = SlotQueue(1, head_numel, self.dtype, self.streams, self.staging, count, waiter)
        self._build_parts(model, adapter, embedding, head, head_slots)
        self.step_no = 0              # optimizer steps taken
        self.guard = BackwardGuard(self._release_interrupted)
        self.anchor = torch.zeros((), requires_grad=True)
        self.optimizer = None
        self.hp = None                 # the optimizer's hyper-parameters, snapshot at each backward
        self.micro = 0                 # backward passes since the last optimizer step
        self.generation = 0            # bumped by each forward that records a graph
        self.live_generation = None    # the forward whose backward may still run
        self.updated_in_backward = False
        self.backward_plan = BackwardPlan()   # the current (or last) backward's (schedule.py)
        self.schedule = Schedule(self)

    def _build_parts(self, model, adapter, embedding, head, head_slots: SlotQueue) -> None:
        """The parts that own their state: the worker's host updates, the embedding, the head, the
        resident plan, the device updates, the device accumulation and the LoRA adapters."""
        self.host_updates = HostUpdates(self)
        self.embedding = embedding(self, self.embed_unit, adapter.embed(model))
        self.logit_transform = adapter.logit_transform(model)
        self.router_aux = adapter.router_aux(model, self.layers)   # a mixture of experts' aux loss, or None
        norm_fn = adapter.final_norm(model).forward      # HF's or the kernel's (model.py replaces it later)
        self.head = head(self, self.head_unit, adapter.lm_head(model), norm_fn, head_slots)
        self.places.attach_ends(self.embedding, self.head)
        cfg = getattr(model, "config", None)
        self.residents = ResidentPlan(self, cfg.to_dict() if hasattr(cfg, "to_dict") else None)
        self.device_updates = DeviceUpdater(self)
        self.accumulator = DeviceAccumulator(self)
        self.lora = AdapterSet(self)                 # the LoRA adapters (lora.py), on the device

    # ----------------------------------------------------------------- bookkeeping
    def attach_optimizer(self, optimizer) -> None:
        self.optimizer = optimizer

    def meeting(self) -> dict:
        """What every rank must agree on before a training forward (`DataParallel.meet`)."""
        out = {"optimizer step": self.step_no, "micro-batch": self.micro,
               "gradient_accumulation_steps": self.config.gradient_accumulation_steps,
               "max_grad_norm": self.config.max_grad_norm}
        for group_no, group in enumerate(getattr(self.optimizer, "param_groups", ())):
            for key in ("lr", "weight_decay", "eps", "betas"):
                value = group.get(key)
                out[f"{key} of param group {group_no}"] = tuple(map(float, value)) if key == "betas" else float(value)
        return out

    @property
    def single_micro(self) -> bool:
        return self.config.gradient_accumulation_steps == 1

    def set_step_shape(self) -> None:
        """What the parts do with one backward per step or with accumulation (step_shape.py),
        chosen whenever the accumulation setting is set."""
        self.step_shape = OneBackwardStep(self) if self.single_micro else AccumulatedStep(self)

    def configure_steps(self, gradient_accumulation_steps: int, max_grad_norm: float | None) -> None:
        """Change accumulation and clipping between optimizer steps (e.g. to follow a Trainer's arguments)."""
        if self.micro:
            raise SlideStateError("configure_steps() in the middle of an optimizer step: call optimizer.step() first")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
        clip = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else None
        changed = (gradient_accumulation_steps, clip) != (self.config.gradient_accumulation_steps,
                                                         self.config.max_grad_norm)
        if changed:
            # Resident units are planned for one mode (a gradient per layer when clipping, none with
            # accumulation): write them back; the next optimizer step plans again. So are the
            # device-updated layers (updated at the step with clipping, in the backward without).
            self.worker.join()
            self.device_updates.reset()
            self.accumulator.drop()                  # its buffer, if any (a plan measures after this)
            self.residents.evict()
            self.residents.planned = None
        self.config.gradient_accumulation_steps = gradient_accumulation_steps
        self.config.max_grad_norm = clip
        self.set_step_shape()
        if self.config.deferred:
            if self.store.optimizer_ready:
                self.store.allocate_grad_accumulators()
            else:
                self.store.deferred = True

    @property
    def in_backward(self) -> bool:
        """Is a backward running (the schedule walks the layers from the last to the first)?"""
        return self.guard.open

    def check_generation(self, gen: int) -> None:
        if gen != self.live_generation:
            raise SlideStateError(
                "backward() of a forward whose saved layer inputs were replaced by a later forward: "
                "hf_slideformer keeps one graph at a time; call backward() before the next forward with gradients "
                "(or run that forward under torch.no_grad())."
            )

    def check_head_passed(self) -> None:
        """A layer's or the embedding's backward: the backward must have started at the engine's head."""
        if not self.guard.open:
            raise SlideStateError(
                "the backward reached the slid model's layers without passing through its loss head: the loss was "
                "computed outside the model (from the decoder's hidden states or lm_head.weight). Compute it with "
                "model(..., labels=...).loss, or from model(..., labels=..., fused_lm_head=True).log_probs")

    def _release_interrupted(self) -> None:
        """An error stopped a backward half way: let every waiter go (BackwardGuard)."""
        try:
            self.worker.join()
        finally:
            self.late.drop()
            for unit in self.store.units:
                unit.updated.set()
            self.micro = 0

    def note_restored(self, weights: bool = False, optimizer: bool = False) -> None:
        """The weights and/or the optimizer state were just loaded from a consistent source."""
        self.guard.note_restored(weights=weights, optimizer=optimizer)

    def begin_graph(self) -> None:
        """A forward that records a graph: earlier unfinished graphs become invalid."""
        self.worker.raise_if_failed()
        self.guard.check()
        ga = self.config.gradient_accumulation_steps
        if self.micro >= ga:
            # The step's gradients wait for optimizer.step() (the lm_head's and the embedding's are
            # written by the forward): a forward with gradients now would overwrite them.
            raise SlideStateError(
                f"a forward with gradients after {self.micro} backward pass(es) since the last optimizer step "
                f"(gradient_accumulation_steps={ga}): call optimizer.step() first, or run this forward under "
                "torch.no_grad()")
        self.generation += 1
        self.live_generation = self.generation
        self.tier.clear()

    def begin_backward(self) -> None:
        """The loss's backward starts (`Schedule.begin_backward`)."""
        self.schedule.begin_backward()

    def end_backward(self) -> None:
        """The backward reached the embedding (`Schedule.end_backward`)."""
        self.schedule.end_backward()

    def synchronize(self) -> None:
        """Wait for every queued host task (updates included) and device copy; the host store is
        then the complete state (resident layers are written back and re-made resident at the
        next optimizer step)."""
        self.worker.join()
        self.device_updates.flush()
        self.streams.settle()
        self.streams.synchronize()
        self.worker.raise_if_failed()
        self.store.flush()                             # the disk layers' writes behind
        self.residents.evict()

    # ----------------------------------------------------------------- layers
    def layer_forward(self, layer_no: int, hidden: torch.Tensor, args, kwargs, save: bool) -> torch.Tensor:
        """Layer `layer_no`'s forward (`Schedule.layer_forward`)."""
        return self.schedule.layer_forward(layer_no, hidden, args, kwargs, save)

    def layer_backward(self, layer_no: int, gy: torch.Tensor, args, kwargs) -> torch.Tensor:
        """Layer `layer_no`'s backward (`Schedule.layer_backward`); the input's gradient."""
        return self.schedule.layer_backward(layer_no, gy, args, kwargs)

    def call_layer(self, layer_no: int, hidden: torch.Tensor, args, kwargs) -> torch.Tensor:
        """Run HF's own forward of decoder layer `layer_no` on `hidden`; its hidden states."""
        layer = self.layers[layer_no]
        out = type(layer).forward(layer, hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def find_dropouts(self) -> None:
        """Note each layer's dropout modules with p > 0 (their random state is replayed in the recompute)."""
        self.dropouts = [[module for module in layer.modules()
                          if isinstance(module, torch.nn.Dropout) and module.p > 0] for layer in self.layers]

    def layer_no(self, unit: Unit) -> int:
        """The index of layer unit `unit` in the model."""
        return self.places.layer_no(unit)

    def place_of(self, unit: Unit):
        """The placement of layer unit `unit`."""
        return self.places.of(unit)

    def updater_of(self, unit: Unit):
        """What runs unit `unit`'s deferred update: its placement, the embedding or the head
        (`Placements.updater_of`)."""
        return self.places.updater_of(unit)

    def set_place(self, unit: Unit, place) -> None:
        """Give layer unit `unit` another placement (between optimizer steps; `Placements.assign`).
        A device update still pending on the placement it leaves runs first: its state is that
        placement's (device_update.py)."""
        self.device_updates.flush(unit)
        self.places.assign(unit, place)

    # ----------------------------------------------------------------- gradients -> host -> update
    def begin_update(self, unit: Unit) -> None:
        """Main thread: mark `unit` as being updated (device copies of the old version are stale)."""
        unit.version += 1
        unit.set_progress(0)
        unit.updated.clear()

    # ----------------------------------------------------------------- optimizer step
    def optimizer_step(self) -> None:
        """`optimizer.step()` (`Schedule.optimizer_step`)."""
        self.schedule.optimizer_step()

    def finish_step(self) -> None:
        """The optimizer step's updates are queued: count it and plan the next one."""
        self.step_no += 1
        self.micro = 0
        self.updated_in_backward = False
        self.stats.mark_step()
        self.stats.fold()
        self.residents.promote()
        # After the step (skipped: its gradients were NaN), so that the engine stays consistent.
        self.labels.raise_pending(wait=True)

    def step_sum(self, unit: Unit):
        """The host's sum of `unit`'s gradients so far this step (this rank's shard of it with several
        ranks), or None."""
        if self.dp is not None:
            if unit.grad is None:
                return None
            lo, hi = self.dp.span(unit.numel)
            return unit.grad[lo:hi]
        return self.embedding.grad if unit is self.embed_unit else unit.grad

    def zero_grad(self) -> None:
        if self.micro == 0:
            return
        if self.updated_in_backward:
            raise SlideStateError("zero_grad() after the last backward of an optimizer step: its updates were "
                                  "already applied during backward; call optimizer.step() before zero_grad()")
        self.worker.join()
        for unit in self.store.units:
            unit.grad_valid = False
        for state in self.residents.layers.values():
            state.grad_valid = False
        self.accumulator.reset()
        self.embedding.reset_grad()
        self.lora.zero_grad()
        self.micro = 0

    def last_grad_norm(self) -> float:
        return self.norm.last()

    def close(self) -> None:
        """Stop the worker and unpin the host buffers (the model is unusable afterwards)."""
        self.worker.close()
        self.device_updates.drop_pending()
        self.streams.synchronize()
        self.tier.close()
        self.store.close()                             # the host slabs, and the disk layers' file

