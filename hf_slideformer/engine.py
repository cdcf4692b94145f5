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
import threading
import time

import torch

from .activations import make_tier
from .host_adam import HostAdam
from .mode import BackwardMode
from .host_tasks import HostTasks
from .memory import COPY_CHUNK
from .slots import SlotQueue, staged_copy
from .store import HostStore, Unit
from .telemetry import StepStats
from .transfer import Streams
from .worker import CpuWorker
from .errors import SlideStateError
from .optim import sq_norm as _sq_norm, _grad_scale
from .resident import ResidentState, ResidentUnits
from .device_update import DeviceUpdates
from .accumulate import DeviceAccumulation
from .head import LossHead
from .functions import grad_only, leaves as _leaves, swapped

logger = logging.getLogger(__name__)

__all__ = ["SlideEngine", "SlideStateError"]



class SlideEngine(LossHead, HostTasks, ResidentUnits, DeviceUpdates, DeviceAccumulation):
    """Runs an HF causal LM through a window of device slots, with its state on the host.

    Args:
        model: the HF model (its parameters are replaced by views of the host masters).
        adapter: the family adapter.
        config: the SlideConfig.
        units: embed, layer and head units in schedule order, with masters filled.
        store: the host store holding them.
    """

    def __init__(self, model, adapter, config, store: HostStore):
        # No strong reference to the model itself: the model owns the engine, and the finalizer that
        # closes the engine when the model is collected must not keep the model alive.
        self.adapter, self.config, self.store = adapter, config, store
        self._lm_module = adapter.lm_head(model)
        self.device, self.dtype = config.torch_device, config.dtype
        units = store.units
        self.embed_unit: Unit = units[0]
        self.layer_units: list[Unit] = [u for u in units if u.kind == "layer"]
        self.head_unit: Unit = units[-1]
        self.layers = list(adapter.layers(model))
        cfg = getattr(model, "config", None)
        self._model_config = cfg.to_dict() if hasattr(cfg, "to_dict") else None   # for the first plan
        # Note: [Why the recompute skips the last projection] backward needs the input of a
        # layer's closing down_proj, never its output (it only feeds the residual add), so the
        # recompute returns zeros there: a quarter of a Llama layer's linear FLOPs saved on
        # every recompute. Set False to recompute the whole layer.
        self.skip_output_projection = True
        self._out_proj = [adapter.output_projection(layer) for layer in self.layers]
        self.tied = adapter.lm_head(model).weight is adapter.embed(model).weight
        self.head_units = (self.head_unit, self.embed_unit) if self.tied else (self.head_unit,)
        emb = adapter.embed(model)
        self.vocab, self.hidden = emb.weight.shape
        self.padding_idx = emb.padding_idx
        self.norm_module = adapter.final_norm(model)
        self._norm_fn = self.norm_module.forward      # HF's or the kernel's; the proxy replaces it later
        self.streams = Streams(self.device)
        self.stats = StepStats(self.streams.cuda)
        cast = config.is_cuda and self.dtype != torch.float32
        max_layer = max(u.numel for u in self.layer_units)
        head_numel = sum(u.numel for u in self.head_units)
        self.staging = torch.empty(min(max(max_layer, head_numel), COPY_CHUNK), dtype=torch.float32,
                                   device=self.device) if cast else None
        self.d2h_stage = torch.empty(min(max(max_layer, head_numel), COPY_CHUNK), dtype=torch.float32,
                                     device=self.device) if cast else None
        count, waiter = self.stats.add_h2d, self._wait_master
        self._init_device_updates()
        self._init_device_accumulation()
        self._dev_norm_valid = False       # norm_dev holds the layers' part of an accumulated step's norm
        self.slots = SlotQueue(config.window, max_layer, self.dtype, self.streams, self.staging, count, waiter,
                               filler=self._device_fill)
        self.head_slots = SlotQueue(1, head_numel, self.dtype, self.streams, self.staging, count, waiter)
        pin = config.pin_memory and config.is_cuda
        # One slab for the gradient ring, registered once (no power-of-two rounding of large pins).
        self.pinned = store.pinned
        # Note: [Why gradients cross in the compute dtype] a layer's parameter gradients are
        # computed in the compute dtype (its weights' dtype), so widening them to fp32 on the GPU
        # adds no information: they cross PCIe and land in the ring as they are (bf16: half the
        # bytes), and the host AdamW widens them in registers (`HostAdam`), exactly.
        self.grad_dtype = self.dtype if self.dtype == torch.bfloat16 else torch.float32
        self.host_adam = HostAdam(config.host_adam, config.cpu_threads)
        self.ring_slab = self.pinned.empty(max_layer * config.grad_buffers, dtype=self.grad_dtype)
        self.ring = list(self.ring_slab.split(max_layer))
        self.ring_free = [threading.Event() for _ in self.ring]
        for ev in self.ring_free:
            ev.set()
        self.ring_next = 0
        self.ring_size = max_layer
        # The head's gradient lands in the ring's first buffers (head.py: [Why the head's gradient borrows the ring]).
        self.head_host: torch.Tensor | None = None    # where the pending head gradient lands
        self._head_own: torch.Tensor | None = None     # a head buffer of its own, when the ring is too small
        self.head_ring: tuple[int, ...] = ()    # the ring buffers the pending head gradient holds
        self.head_host_free = threading.Event()
        self.head_host_free.set()
        self.head_pending = False
        self.embed_host: torch.Tensor | None = None
        self.embed_host_free = threading.Event()
        self.embed_host_free.set()
        self.embed_fwd_buf: torch.Tensor | None = None
        self.embed_fwd_ev = None
        self.embed_grad: torch.Tensor | None = None
        self.touched: list[torch.Tensor] = []
        self.tier = make_tier(config, self.streams, self.stats.add_bytes, self.pinned)
        self.tier.keep_index = len(self.layer_units) - 1   # activations.py: [Why the last layer's input stays on the device]
        # With one backward per step, this backward's gradients are the step's: their norm is
        # taken on the GPU (free) instead of by an extra CPU pass over every gradient.
        self.norm_dev = torch.zeros((), dtype=torch.float32, device=self.device)
        self.norm_host = torch.zeros(1, dtype=torch.float32, pin_memory=pin)
        # Note: [Why each host task reads the running norm] with one backward per step the norm of
        # the gradients so far is on the GPU (norm_dev); a copy of it lands beside each gradient
        # the worker updates from (one scalar per ring buffer, the head's, the embedding's), so a
        # non-finite gradient stops the host updates that follow it without a host sync.
        self.norm_snap = torch.zeros(len(store.units), dtype=torch.float32, pin_memory=pin)
        self._snap_of = {id(u): k for k, u in enumerate(store.units)}
        self.step_norm = torch.zeros(4, dtype=torch.float32, pin_memory=pin)
        self._poisoned = False        # worker side: this step has a non-finite gradient
        self._step_no = 0              # optimizer steps taken
        self._worker_step = 0
        self.scale_host = torch.ones(1, dtype=torch.float32, pin_memory=pin)
        self._head_sq = None
        self._dw_rows = None
        self._fwd_rows = None
        self._fwd_touch = None
        self._embed_out = None         # (x_0, its version, its gather) while layer 0's forward is ahead
        self._bulk = None
        self._row_bufs: list[torch.Tensor | None] = [None] * 4   # see HostTasks._rows_buffer
        self._fold_buf: torch.Tensor | None = None                # see HostTasks._fold
        self._backward_open = False
        self._inconsistent: str | None = None    # why training may not go on (see _close_interrupted_backward)
        self._restored: set[str] = set()
        # The head's device update is spread over the backward of its first layers (device_update.py).
        self.worker = CpuWorker(config.cpu_threads)
        self.worker.on_task = self.stats.event
        self.resident: dict[int, ResidentState] = {}     # layer index -> its device state
        self.resident_embed: ResidentState | None = None
        self._resident_target: tuple[bool, int] | None = None   # decided after the first optimizer step
        self._resident_grad: torch.Tensor | None = None
        self._plan_peak: int | None = None              # GPU peak the plan is based on ...
        self._plan_tokens: int | None = None            # ... and the tokens of that step's batch
        self._last_tokens = 0
        self._embed_rgrad: torch.Tensor | None = None    # the resident embedding's (V*H,) fp32 gradient
        self._pace_ev = None
        self._head_prefetch = None     # load_steps generator of the head slot during a forward
        self.anchor = torch.zeros((), requires_grad=True)
        self.optimizer = None
        self.micro = 0                 # backward passes since the last optimizer step
        self.generation = 0            # bumped by each forward that records a graph
        self.live_generation = None    # the forward whose backward may still run
        self.updated_in_backward = False
        self.mode = BackwardMode()      # the current (or last) backward's; see mode.py
        self._norm_sq: list[float] = []
        self._clip_coef = 1.0

    # ----------------------------------------------------------------- bookkeeping
    def attach_optimizer(self, optimizer) -> None:
        self.optimizer = optimizer

    @property
    def single_micro(self) -> bool:
        return self.config.gradient_accumulation_steps == 1

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
            # device-updated layers (clipping only).
            self.worker.join()
            self._reset_device_updates()
            self._acc_buf = None                     # the accumulation buffer, if any (a plan measures after this)
            self._reset_accumulator()
            self.evict_resident()
            self._resident_target = None
        self.config.gradient_accumulation_steps = gradient_accumulation_steps
        self.config.max_grad_norm = clip
        if self.config.deferred:
            if self.store.optimizer_ready:
                self.store.allocate_grad_accumulators()
            else:
                self.store.deferred = True

    def _wait(self, event: threading.Event, reason: str) -> None:
        """Main thread blocks on the CPU worker; timed by reason, worker failures re-raised."""
        if event.is_set():
            self.worker.raise_if_failed()
            return
        t0 = time.perf_counter()
        self.worker.wait(event)
        t1 = time.perf_counter()
        self.stats.wait_s[reason] += t1 - t0
        self.stats.event(f"main_wait:{reason}", t0, t1)

    def _wait_master(self, u: Unit, start: int) -> int:
        """Main thread: block until element `start` of `u.master` holds the update in progress
        (the worker reports finished prefixes, see `Unit.set_progress`); returns how many leading
        elements are final (`u.numel` once the update is complete). Worker failures re-raised."""
        if u.updated.is_set():
            self.worker.raise_if_failed()
            return u.numel
        t0 = time.perf_counter()
        with u.progress_cv:
            while not u.updated.is_set() and u.progress <= start:
                u.progress_cv.wait(0.05)
                self.worker.check_alive()
            ready = u.numel if u.updated.is_set() else u.progress
        t1 = time.perf_counter()
        self.stats.wait_s["update"] += t1 - t0
        self.stats.event("main_wait:update", t0, t1)
        self.worker.raise_if_failed()
        return ready

    def _span_start(self):
        return self.streams.record(timing=True) if self.streams.cuda else None

    def _span_end(self, start) -> None:
        if start is not None:
            self.stats.gpu_span(start, self.streams.record(timing=True))

    def check_generation(self, gen: int) -> None:
        if gen != self.live_generation:
            raise SlideStateError(
                "backward() of a forward whose saved layer inputs were replaced by a later forward: "
                "hf_slideformer keeps one graph at a time; call backward() before the next forward with gradients "
                "(or run that forward under torch.no_grad())."
            )

    def _close_interrupted_backward(self) -> None:
        """An exception stopped a backward half way: some layers of this step were updated, others
        not. Release every waiter so nothing hangs, and mark the state inconsistent until both the
        weights and the optimizer state are restored (`note_restored`)."""
        if not self._backward_open:
            return
        self._backward_open = False
        try:
            self.worker.join()
        finally:
            for u in self.store.units:
                u.updated.set()
            self.micro = 0
            self._inconsistent = ("the previous backward() was interrupted by an error after some layers were "
                                  "updated: the weights and AdamW state are inconsistent for this step. Reload the "
                                  "model, or restore both its weights and optimizer state (load_training_state, a "
                                  "Trainer resume, or model.load_state_dict and optimizer.load_state_dict), before "
                                  "training on.")
            self._restored = set()

    def _check_backward_closed(self) -> None:
        self._close_interrupted_backward()
        if self._inconsistent is not None:
            raise SlideStateError(self._inconsistent)

    def note_restored(self, weights: bool = False, optimizer: bool = False) -> None:
        """The weights and/or the optimizer state were just loaded from a consistent source; once
        both have been since an interrupted backward, training may go on."""
        self._close_interrupted_backward()
        if weights:
            self._restored.add("weights")
        if optimizer:
            self._restored.add("optimizer")
        if self._restored >= {"weights", "optimizer"}:
            self._inconsistent = None

    def begin_graph(self) -> None:
        """A forward that records a graph: earlier unfinished graphs become invalid."""
        self.worker.raise_if_failed()
        self._check_backward_closed()
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
        if self.optimizer is None:
            raise SlideStateError("call model.create_optimizer(...) (or build a SlideOptimizer) before backward(): "
                                  "the engine updates the weights during backward")
        ga = self.config.gradient_accumulation_steps
        if self.micro >= ga:
            raise SlideStateError(
                f"backward() number {self.micro + 1} since the last optimizer step, but "
                f"SlideConfig.gradient_accumulation_steps={ga}: call optimizer.step() after every {ga} backward passes")
        self.worker.raise_if_failed()
        if self.micro == 0:
            self.worker.submit(self._begin_step_task, self._step_no + 1)
        self._backward_open = True
        self.mode = BackwardMode.of(self.micro, ga, clipping=self.config.max_grad_norm is not None)
        self.hp = self.optimizer.snapshot()
        if self.mode.ends_step:
            self._norm_sq = []
            self._dev_norm_valid = not self.single_micro
        if self.single_micro or self.mode.ends_step:
            self.norm_dev.zero_()
        self._bwd_t0 = time.perf_counter()
        self.stats.event("backward_begin", self._bwd_t0)

    def end_backward(self) -> None:
        self._backward_open = False
        self.micro += 1
        self.live_generation = None
        self.updated_in_backward = self.mode.updates
        self.stats.backward_s += time.perf_counter() - self._bwd_t0
        self.stats.event("backward_end", time.perf_counter())

    def synchronize(self) -> None:
        """Wait for every queued host task (updates included) and device copy; the host store is
        then the complete state (resident layers are written back and re-made resident at the
        next optimizer step)."""
        self.worker.join()
        self.flush_device_updates()
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)
        self.worker.raise_if_failed()
        self.evict_resident()

    # ----------------------------------------------------------------- embedding
    def embed_forward(self, input_ids: torch.Tensor, with_grad: bool = False) -> torch.Tensor:
        u = self.embed_unit
        self.stats.event("forward_begin", time.perf_counter())
        self._head_prefetch = None                   # a forward that stopped half way left it
        self._embed_out = None
        self._wait(u.updated, "update")
        ids = input_ids.detach().to("cpu", torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise ValueError(f"input_ids out of range [0, {self.vocab}): min {int(ids.min())}, max {int(ids.max())}")
        if with_grad:
            # The rows this batch touches: their gradient is summed per row on the GPU (see
            # embed_backward), and they are the rows the layers' backward will still change (see
            # _embed_bulk_update). The padding row is among them with a zero sum: updating it
            # again with its full gradient reproduces the bulk update exactly.
            uniq, inv = torch.unique(ids, return_inverse=True)
            keep = (ids != self.padding_idx) if self.padding_idx is not None else torch.ones_like(ids, dtype=torch.bool)
            self._fwd_touch = uniq
            self._fwd_rows = tuple(t.to(self.device, non_blocking=True) for t in (uniq, inv, keep))
        T = ids.numel()
        if with_grad:
            self._fit_resident(T)
            if self.resident_embed is None:
                self._ensure_embed_grad()
        table = u.master.view(self.vocab, self.hidden)
        first = next((i for i in range(len(self.layer_units)) if i not in self.resident), None)
        if first is not None:
            self.slots.load((self.layer_units[first],))     # its h2d overlaps the gather below
        r = self.resident_embed
        if r is not None:                            # gathered on the device from the resident master
            ids_dev = ids.to(self.device, non_blocking=True)

            def gather():
                if self.resident_embed is not r:
                    raise SlideStateError("internal: the resident embedding left the device before the first "
                                          "layer's input was saved")
                x = r.master.view(self.vocab, self.hidden).index_select(0, ids_dev)
                return x.to(self.dtype).view(*input_ids.shape, self.hidden)
            out = gather()
            # activations.py: [Why the first layer's input can be gathered again]
            self._embed_out = (out, out._version, gather) if with_grad else None
            return out
        if not self.streams.cuda:
            x = table.index_select(0, ids).to(self.dtype)
            return x.view(*input_ids.shape, self.hidden)
        if self.embed_fwd_ev is not None:
            self.embed_fwd_ev.synchronize()          # the previous batch's rows have left the buffer
        if self.embed_fwd_buf is None or self.embed_fwd_buf.shape[0] < T:
            if self.embed_fwd_buf is not None:
                self.pinned.release(self.embed_fwd_buf)
            self.embed_fwd_buf = self.pinned.empty(T, self.hidden)
        buf = self.embed_fwd_buf[:T]
        torch.index_select(table, 0, ids, out=buf)
        x = torch.empty(T, self.hidden, dtype=torch.float32, device=self.device)
        x.copy_(buf, non_blocking=True)
        self.embed_fwd_ev = self.streams.record()
        self.stats.add_h2d(buf.numel() * 4)
        return x.to(self.dtype).view(*input_ids.shape, self.hidden)

    def embed_backward(self, input_ids: torch.Tensor, gx: torch.Tensor) -> None:
        T = gx.numel() // self.hidden
        rows = self._fwd_touch
        uniq, inv, keep = self._fwd_rows
        n = rows.numel()
        # Note: [Why the embedding gradient is summed on the GPU] the worker's embedding task is on
        # the path to the next forward. Summed per distinct row on the GPU (a sorted, deterministic
        # accumulate), the d2h copy and the worker's folding shrink from one row per token to one
        # per distinct token (far fewer in real text), and the worker's gather / scatter are
        # parallel copies instead of an index_add_ over every token.
        t = self._span_start()
        g = gx.reshape(T, self.hidden).float() * keep[:, None]
        S = torch.zeros(n, self.hidden, dtype=torch.float32, device=gx.device)
        S.index_put_((inv,), g, accumulate=True)
        if self.single_micro:
            self._embed_norm(S)
        r = self.resident_embed
        if r is not None:
            G = self._embed_rgrad.view(self.vocab, self.hidden)
            if not self.tied:
                G.zero_()                        # tied: it holds the lm_head's gradient (head_backward)
            G.index_add_(0, uniq, S)             # distinct rows: one add per element, deterministic
            if self.mode.updates:                 # else optimizer.step() clips and updates it
                self._resident_step(self.embed_unit, r, self._embed_rgrad, found_inf=self._found_inf_dev())
            self._span_end(t)
            self.end_backward()
            return
        self._span_end(t)
        self._wait(self.embed_host_free, "other")  # the worker is done with the previous gradient
        if self.embed_host is None or self.embed_host.shape[0] < n:
            if self.embed_host is not None:
                self.pinned.release(self.embed_host)
            self.embed_host = self.pinned.empty(max(n, 1), self.hidden)
        host = self.embed_host[:n]
        self.embed_host_free.clear()
        norm = self._norm_slot(self.embed_unit) if self.single_micro else None
        done = self._d2h([S], [host], norm_dst=norm)
        u = self.embed_unit
        update = self.mode.updates           # scheduled with the head (see head_backward)
        self.worker.submit(self._embed_task, host, rows, done, update, self.mode.ends_step, self.hp, norm,
                           done=(self.embed_host_free,) + ((u.updated,) if update else ()))
        self.end_backward()

    def _embed_norm(self, S: torch.Tensor) -> None:
        """Add the embedding's squared gradient norm on the GPU, without the (V, H) gradient.

        The gradient is S, the per-row sums of the token gradients over the batch's rows (padding
        dropped), plus for a tied lm_head its dW: |dW + S|^2 = |dW|^2 - |dW[rows]|^2 + |dW[rows] + S|^2.
        """
        if self.tied:
            rows = self._dw_rows * self._scale_dev
            sq = self._dw_sq * self._scale_dev ** 2 - rows.square().sum() + (rows + S).square().sum()
        else:
            sq = S.square().sum()
        self.norm_dev += sq

    # ----------------------------------------------------------------- layers
    def layer_forward(self, i: int, x: torch.Tensor, args, kwargs, save: bool) -> torch.Tensor:
        u = self.layer_units[i]
        r = self.resident.get(i)
        slot = self.slots.acquire((u,)) if r is None else None
        busy = (slot,) if slot is not None else ()
        for j in range(i + 1, min(i + self.config.window, len(self.layer_units))):
            if j not in self.resident:
                self.slots.load((self.layer_units[j],), busy=busy)
        self._prefetch_head()
        if save:
            self.tier.save(i, x, self._remake_input(i, x))
        t = self._span_start()
        with torch.no_grad(), swapped(u, slot.views(u) if r is None else r.views()):
            y = self._call_layer(i, x, args, kwargs)
        self._span_end(t)
        if slot is not None:
            self.slots.release(slot)
        else:
            self._pace()
        return y

    def _remake_input(self, i: int, x: torch.Tensor):
        """Layer 0's input as a recipe when it is the resident embedding's gather itself (not a
        product of it, as Gemma's scaled embedding is) and unchanged since."""
        if i != 0 or self._embed_out is None:
            return None
        out, version, gather = self._embed_out
        self._embed_out = None
        same = (x.data_ptr() == out.data_ptr() and x.shape == out.shape and x.stride() == out.stride()
                and x.dtype == out.dtype and x._version == version)
        return gather if same else None

    def _call_layer(self, i, x, args, kwargs):
        layer = self.layers[i]
        out = type(layer).forward(layer, x, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def layer_backward(self, i: int, gy: torch.Tensor, args, kwargs) -> torch.Tensor:
        u = self.layer_units[i]
        r = self.resident.get(i)
        slot = self.slots.acquire((u,)) if r is None else None
        if r is None:
            self._prefetch_accumulator(u)         # accumulation: the running sum comes in during the recompute
        if i > 0:
            if self.config.window > 1 and (i - 1) not in self.resident:
                self.slots.load((self.layer_units[i - 1],), busy=(slot,) if slot is not None else ())
            self.tier.prefetch(i - 1)
        x = self.tier.load(i).detach().requires_grad_()
        ws = _leaves(slot.views(u) if r is None else r.views())
        t = self._span_start()
        skip = self._out_proj[i] if self.skip_output_projection else None
        with torch.enable_grad(), swapped(u, ws), grad_only(skip):
            y = self._call_layer(i, x, args, kwargs)
        grads = torch.autograd.grad(y, [x] + ws, gy, allow_unused=True)
        self._span_end(t)
        if slot is not None:
            self.slots.release(slot)
        self.tier.drop(i)
        gx = grads[0]
        if r is not None:
            self._resident_update(u, r, list(grads[1:]))
            self._pace()
        else:
            self._send(u, list(grads[1:]))
        return gx

    # ----------------------------------------------------------------- gradients -> host -> update
    def _d2h(self, grads: list, dsts: list[torch.Tensor], ends: list[int] | None = None, marks: list | None = None,
             norm_dst: torch.Tensor | None = None):
        """Copy device gradients into host buffers on the d2h stream: as they are where the buffer
        has their dtype, else widened to the buffer's fp32 on the device (never narrowed).

        With `ends` and `marks` (CUDA only), `marks` receives (ends[k], event) after the k-th
        gradient's copy: the worker can start on the front of a unit while the rest is in flight.
        `norm_dst` (a pinned scalar) receives the running squared norm first.
        """
        st = self.streams
        if not st.cuda:
            if norm_dst is not None:
                norm_dst.copy_(self.norm_dev.reshape(1))
            for g, d in zip(grads, dsts):
                if g is None:
                    d.zero_()
                else:
                    _check_lossless(g, d)
                    d.copy_(g.reshape(d.shape))
            return st.record()
        # Note: [Why the d2h waits for the compute event] gradients are produced on the compute stream.
        st.wait(st.record(), st.d2h)
        with st.on(st.d2h):
            if norm_dst is not None:
                norm_dst.copy_(self.norm_dev.reshape(1), non_blocking=True)
            for g, d in zip(grads, dsts):
                d = d.view(-1)
                if g is None:
                    d.zero_()
                else:
                    _check_lossless(g, d)
                    g.record_stream(st.d2h)
                    gf = g.reshape(-1)
                    if gf.dtype == d.dtype:
                        d.copy_(gf, non_blocking=True)
                    else:                    # widened on the device, all on the d2h stream
                        staged_copy(d, gf, self.d2h_stage)
                    self.stats.add_bytes("d2h", d.numel() * d.element_size())
                if marks is not None:
                    marks.append((ends[len(marks)], st.record(st.d2h)))
        return st.record(st.d2h)

    def _send(self, u: Unit, grads: list) -> None:
        """Gradients of layer unit `u` -> a host ring buffer -> accumulate and/or update on the worker."""
        if self.single_micro:
            self.norm_dev += _sq_norm([g for g in grads if g is not None])
        if u.index in self._device_units and self.device_updates_on and self.single_micro and not self.mode.updates:
            self._send_to_accumulator(u, grads)     # straight into its pinned accumulator (device_update.py)
            return
        if self._accumulates_on_device(u):          # accumulation: the GPU adds (accumulate.py)
            done = self._accumulate(u, grads)
            if self.mode.updates:
                self._schedule(u)
                self.worker.submit(self._accumulated_update_task, u, done, self.hp, self._norm_slot(u),
                                   done=(u.updated,))
            return
        k = self.ring_next
        self.ring_next = (k + 1) % len(self.ring)
        self._claim_ring(k)
        buf = self.ring[k]
        # Per-gradient events let the update start on the unit's front while its back is copied
        # (HostStore lays the entries out in order, so copy order is offset order).
        marks = [] if self.streams.cuda else None
        norm = self._norm_slot(u) if self.single_micro else None
        done = self._d2h(grads, [e.view(buf) for e in u.entries], [e.offset + e.numel for e in u.entries], marks,
                         norm_dst=norm)
        update = self.mode.updates
        if update:
            self._schedule(u)
        self.worker.submit(self._layer_task, u, buf[:u.numel], done, update, self.mode.ends_step, self.hp, marks, norm,
                           done=(self.ring_free[k],) + ((u.updated,) if update else ()))

    def _claim_ring(self, k: int) -> None:
        """Main thread: wait until ring buffer k is free, then hold it (its task's `done` frees it)."""
        self._wait(self.ring_free[k], "grad_buffer")
        self.ring_free[k].clear()

    def _schedule(self, u: Unit) -> None:
        """Main thread: mark `u` as being updated (device copies of the old version are stale)."""
        u.version += 1
        u.set_progress(0)
        u.updated.clear()

    # ----------------------------------------------------------------- optimizer step
    def optimizer_step(self) -> None:
        self.worker.raise_if_failed()
        self._check_backward_closed()
        if self.micro == 0:
            raise SlideStateError("optimizer.step() without a backward pass since the last step")
        if not self.updated_in_backward:
            hp = self.optimizer.snapshot()
            self._prepare_device_updates()          # the first clipping step picks the device-updated layers
            norm_ev = None
            early = self.micro < self.config.gradient_accumulation_steps
            grads_ev = self.streams.record(self.streams.d2h)   # every gradient copy into the host accumulators
            if early:
                self._dev_norm_valid = False
                if self.resident and self.config.max_grad_norm is not None:
                    # The norm is taken from every unit's sum now; the resident layers' sums are
                    # on the device (the host accumulators of resident layers read as zeros).
                    self.norm_dev.zero_()
                    self.norm_dev += _sq_norm([r.grad for r in self.resident.values() if r.grad_valid])
                    self._dev_norm_valid = True
            if self.single_micro or self._dev_norm_valid:
                if self.streams.cuda:
                    self.norm_host.copy_(self.norm_dev.reshape(1), non_blocking=True)
                else:
                    self.norm_host.copy_(self.norm_dev.reshape(1))
                norm_ev = self.streams.record()
            clip_done = (threading.Event() if (self.device_updates_on or self.resident) and not self.single_micro
                         else None)
            # `known`: the worker has judged the step's norm (a device update is skipped when it is
            # not finite, see HostTasks._clip_task)
            known = threading.Event() if self.device_updates_on else None
            self.worker.submit(self._clip_task, early, norm_ev, grads_ev,
                               frozenset(id(r.unit) for r in self.resident.values()),
                               done=tuple(e for e in (clip_done, known) if e is not None))
            t = self._span_start()
            on_device = self._step_resident(hp, clip_done)
            scale, ready = (self._device_scale() if self.device_updates_on and self.single_micro
                            else (None, None))
            self._span_end(t)
            for u in self.store.units:
                if id(u) in on_device:
                    continue
                if u.index in self._device_units and self.device_updates_on:
                    self._schedule_device(u, hp, scale, ready, clip_done, known)
                    continue
                self._schedule(u)
                self.worker.submit(self._deferred_task, u, hp, grads_ev, done=(u.updated,))
        elif self.single_micro:
            # The updates ran in backward; the worker judges the whole step's norm (resident units
            # included) after them, to report a non-finite step once.
            k = self._step_no % self.step_norm.numel()       # a slot per step in flight
            slot = self.step_norm[k:k + 1]
            if self.streams.cuda:
                slot.copy_(self.norm_dev.reshape(1), non_blocking=True)
            else:
                slot.copy_(self.norm_dev.reshape(1))
            self.worker.submit(self._step_check_task, self.streams.record(), slot)
        self._step_no += 1
        self.micro = 0
        self.updated_in_backward = False
        self.stats.mark_step()
        self.stats.fold()
        self._promote_resident()

    def _norm_slot(self, u: Unit) -> torch.Tensor:
        """The pinned scalar that receives the running norm with `u`'s gradient. Written again only
        by `u`'s next backward, which follows its update (the forward in between waits for it)."""
        k = self._snap_of[id(u)]
        return self.norm_snap[k:k + 1]

    def _found_inf_dev(self) -> torch.Tensor:
        """1.0 on the device where the running norm of this backward's gradients is not finite
        (the device updates' skip flag, decided without a host sync), else 0.0."""
        return (~torch.isfinite(self.norm_dev)).to(torch.float32)

    def _device_scale(self):
        """The clip factor's reciprocal for the device updates (the fused kernel's grad_scale), and
        the compute-stream event after which it is valid (the resident units' clip factor)."""
        return _grad_scale(self._device_clip_coef(), self.device), self.streams.record()

    def zero_grad(self) -> None:
        if self.micro == 0:
            return
        if self.updated_in_backward:
            raise SlideStateError("zero_grad() after the last backward of an optimizer step: its updates were "
                                  "already applied during backward; call optimizer.step() before zero_grad()")
        self.worker.join()
        for u in self.store.units:
            u.grad_valid = False
        for r in self.resident.values():
            r.grad_valid = False
        self._reset_accumulator()
        self._reset_embed_grad()
        self.micro = 0

    def last_grad_norm(self) -> float:
        if self.single_micro:              # on the GPU: no need to wait for the CPU updates
            self.worker.raise_if_failed()
            return float(self.norm_dev) ** 0.5
        self.worker.join()
        if not self._norm_sq and not self._dev_norm_valid:
            return float("nan")
        return (sum(self._norm_sq) + (float(self.norm_dev) if self._dev_norm_valid else 0.0)) ** 0.5

    def close(self) -> None:
        """Stop the worker and unpin the host buffers (the model is unusable afterwards)."""
        self.worker.close()
        for u in self.layer_units:
            u.device_pending = None
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)
        self.tier.close()
        self.pinned.close()


def _check_lossless(g: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.dtype != g.dtype and dst.dtype != torch.float32:
        raise RuntimeError(f"a {g.dtype} gradient cannot land in a {dst.dtype} host buffer without rounding")
