"""Resident units: the optimizer state of the embedding and a few layers kept on the GPU and
updated there.

Under a memory cap the GPU usually has room left after the window, the activations and the
head: a 3B model trained at 16 x 2048 under 24 GiB peaks near 13 GiB. That room is worth more
as optimizer state than as nothing: a resident layer keeps its fp32 master, Adam moments and
compute-dtype weights on the GPU, is never copied in, and is updated by torch's fused CUDA
AdamW right after its backward, instead of by the CPU worker (tens of ms per layer). The CPU
worker, the bound at small batches, has that much less to do, and the next forward does not
wait for those layers.

While a unit is resident its device copy is the current state: `evict_resident()` writes the
master, moments and step counters back before anything reads or replaces the host state
(`engine.synchronize()`: checkpoints, state_dict, save_pretrained, load_state_dict). The embedding goes first (its update, the per-row folding of its
gradient and, when tied, the lm_head's (V, H) gradient copy all leave the CPU, and it is what
the next forward needs first), then layers 0..k-1, the next ones the forward needs.
"""
from __future__ import annotations

import logging

import torch

from . import optim as _optim
from .budget import plan_resident
from .memory import GiB, lazy_zeros, release_pages
from .optim import sq_norm as _sq_norm
from .planner import plan as _estimate
from .store import Unit

logger = logging.getLogger(__name__)

__all__ = ["ResidentState", "ResidentUnits", "plan_resident", "measured_peak"]


class ResidentState:
    """Device copies of one layer unit's master, moments, step counters and compute weights."""

    def __init__(self, u: Unit, dtype: torch.dtype, device: torch.device, with_grad: bool = False):
        self.unit = u
        self.master = torch.empty(u.numel, dtype=torch.float32, device=device)
        self.exp_avg = torch.empty_like(self.master)
        self.exp_avg_sq = torch.empty_like(self.master)
        self.weights = torch.empty(u.numel, dtype=dtype, device=device) if dtype != torch.float32 else self.master
        self.steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in u.entries]
        # The step's gradient, kept until optimizer.step() when it clips, or summed over the
        # micro-batches with accumulation (layers in-backward with one backward share one).
        self.grad = torch.empty_like(self.master) if with_grad else None
        self.grad_valid = False           # with accumulation: `grad` holds this step's running sum

    def _pairs(self):
        """(device tensor, host tensor) of the master, the moments and each step counter."""
        u = self.unit
        return [(self.master, u.master), (self.exp_avg, u.exp_avg), (self.exp_avg_sq, u.exp_avg_sq),
                *zip(self.steps, u.steps)]

    def load_from_host(self) -> None:
        for dev, host in self._pairs():
            dev.copy_(host)
        if self.weights is not self.master:
            self.weights.copy_(self.master)

    def store_to_host(self) -> None:
        """Write moments, counters and master back (the caller has synchronized the device)."""
        for dev, host in self._pairs():
            host.copy_(dev)

    def views(self) -> list[torch.Tensor]:
        return self.unit.views(self.weights)


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


class ResidentUnits:
    """Engine-side methods of the resident units (a mixin of SlideEngine: they share its state)."""

    def _plan_resident(self) -> tuple[bool, int]:
        c = self.config
        if not self.single_micro:
            # Note: [Why accumulation keeps resident layers opt-in] with accumulation a resident
            # layer sums its micro-batches' gradients on the GPU and is updated there when the step
            # ends (`_resident_update`); the embedding stays on the host (its tied head gradient
            # and per-row folding have no device path across micro-batches). The layers are taken
            # only as many as `resident_layers` asks: "auto" keeps none here until the mode has
            # been measured on a GPU.
            return False, (0 if c.resident_layers == "auto" else int(c.resident_layers))
        embed = None if c.resident_embedding == "auto" else bool(c.resident_embedding)
        layers = None if c.resident_layers == "auto" else int(c.resident_layers)
        if not self.streams.cuda:                       # nothing to gain on a CPU device unless asked
            return bool(embed), layers or 0
        if embed is not None and layers is not None:
            return embed, layers
        limit = (int(c.gpu_memory_limit * GiB) if c.gpu_memory_limit is not None
                 else torch.cuda.get_device_properties(self.device).total_memory)
        if self._plan_peak is None:      # the first step's peak, less the resident state it began with
            self._plan_peak = max(0, measured_peak(self.device) - self._resident_bytes())
            self._plan_tokens = self._last_tokens
        plan = plan_resident(limit_bytes=limit, peak_bytes=self._plan_peak,
                             layer_numel=max(u.numel for u in self.layer_units), n_layers=len(self.layer_units),
                             embed_numel=self.embed_unit.numel, dtype=self.dtype, embed=embed, layers=layers,
                             clipping=c.max_grad_norm is not None)
        logger.info("resident on the GPU: embedding %s, layers 0..%d", "yes" if plan[0] else "no", plan[1] - 1)
        return plan

    def _first_embed_plan(self, tokens: int) -> bool:
        """Before the first training step: is the embedding resident from the start?

        Note: [Why the embedding can be resident before the first step] the plan measures a step
        first, and a step with the embedding on the host touches its moments, dense gradient and
        row buffers (9 GB at 8B, batch 16) only for them to be given back when it goes resident:
        that first step set the run's peak host memory. When the option says so, or when the
        planner's estimate (`planner.plan`, the same one `hf-slideformer plan` prints) already
        finds room for it, the embedding is resident from the first step; the measured plan then
        confirms it or writes it back (`_promote_resident`).
        """
        c = self.config
        if c.resident_embedding != "auto":
            return bool(c.resident_embedding)
        if not self.streams.cuda or self._model_config is None:
            return False
        limit = (c.gpu_memory_limit if c.gpu_memory_limit is not None
                 else torch.cuda.get_device_properties(self.device).total_memory / GiB)
        try:
            p = _estimate(self._model_config, batch=1, seq=max(1, tokens), gpu_mem=limit, host_mem=1e6,
                     max_grad_norm=c.max_grad_norm, window=c.window, activation_tier=c.activation_tier,
                     grad_buffers=c.grad_buffers)
        except (ValueError, KeyError, TypeError) as e:     # a config the planner cannot read: measure first
            logger.info("no estimate before the first step (%s); the embedding waits for the measured plan", e)
            return False
        return bool(p.resident_embedding)

    def _resident_bytes(self) -> int:
        """Device bytes the resident units hold now (outside any step's own peak)."""
        ts = [self._embed_rgrad, self._resident_grad]
        for r in list(self.resident.values()) + ([self.resident_embed] if self.resident_embed is not None else []):
            ts += [r.master, r.exp_avg, r.exp_avg_sq, r.grad] + ([r.weights] if r.weights is not r.master else [])
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def _make_embed_resident(self) -> None:
        eu = self.embed_unit
        self.resident_embed = self._make_resident(eu)
        self._release_embed_host()
        if self._embed_rgrad is None:
            self._embed_rgrad = torch.zeros(eu.numel, dtype=torch.float32, device=self.device)

    def _ensure_embed_grad(self) -> None:
        """The host's dense (V, H) fp32 gradient of an embedding on the host, made on first use.
        Pinned (a tied lm_head's gradient lands there straight from the GPU), unless the embedding
        is only out for a while (written back for a checkpoint, resident again after this step)."""
        if self.embed_grad is not None:
            return
        self.embed_grad = lazy_zeros(self.embed_unit.numel)
        target = self._resident_target
        if target is None or not target[0]:
            self.pinned.adopt(self.embed_grad)

    def _fit_resident(self, tokens: int) -> None:
        """Before a training forward: a batch larger than the one the plan measured may need the
        memory the resident units hold, so they go back to the host for it, and the next plan
        scales the measured peak by the new size (an over-estimate: part of the peak is fixed).
        The plan only grows, so a run settles at its longest batch.

        Before the first step, the embedding may go resident at once ([Why the embedding can be
        resident before the first step])."""
        self._last_tokens = tokens
        if (self._plan_peak is None and self._resident_target is None and self.resident_embed is None
                and self.single_micro and self.optimizer is not None and self._first_embed_plan(tokens)):
            self._make_embed_resident()
        if self._plan_peak is None or not self._plan_tokens or tokens <= self._plan_tokens:
            return
        if self.resident or self.resident_embed is not None:
            self.evict_resident()
        self._plan_peak = int(self._plan_peak * tokens / self._plan_tokens)
        self._plan_tokens = tokens
        self._resident_target = None

    def _make_resident(self, u: Unit, with_grad: bool = False) -> ResidentState:
        self._wait(u.updated, "update")                 # its last CPU update has landed in the host store
        self.flush_device_updates(u)                    # ... or its device update (written back on the d2h stream)
        self.streams.wait(u.host_write)
        r = ResidentState(u, self.dtype, self.device, with_grad=with_grad)
        r.load_from_host()
        # The host moments are not read again until evict_resident() writes them back; a clipping
        # layer's host accumulator is not used while its gradient stays on the device (it reads as
        # zeros, its reset state).
        release_pages(u.exp_avg)
        release_pages(u.exp_avg_sq)
        if u.grad is not None and not u.grad_valid:
            release_pages(u.grad)
        return r

    def _promote_resident(self) -> None:
        """Make the embedding and layers 0..k-1 resident (between optimizer steps)."""
        if self.optimizer is None:
            return
        if self._resident_target is None:
            self._resident_target = self._plan_resident()
        embed, n = self._resident_target
        n = min(n, len(self.layer_units))
        if not embed and self.embed_grad is not None and self.pinned.enabled and not self.embed_grad.is_pinned():
            # The plan no longer keeps the embedding resident: its dense gradient is read by d2h
            # copies every step again, so it is pinned again (after an eviction for a checkpoint
            # the embedding comes back at once, and one step's pageable copy costs less than
            # pinning 2 GB).
            self.pinned.adopt(self.embed_grad)
        eu = self.embed_unit
        if not embed and self.tied and self.pinned.enabled and not eu.master.is_pinned():
            self.pinned.adopt(eu.master)             # the head slot copies a tied one in again
        if not embed and self.resident_embed is not None:
            self.evict_resident()                    # resident from the first step, not in the measured plan
        if embed and self.resident_embed is None:
            self._make_embed_resident()
        if len(self.resident) >= n:
            return
        own_grad = self.config.max_grad_norm is not None or not self.single_micro   # a gradient per layer
        if self._resident_grad is None and not own_grad:
            self._resident_grad = torch.empty(max(u.numel for u in self.layer_units), dtype=torch.float32,
                                              device=self.device)
        for i in range(n):
            if i not in self.resident:
                self.resident[i] = self._make_resident(self.layer_units[i], with_grad=own_grad)

    def _release_embed_host(self) -> None:
        """Give back the host memory of an embedding that went resident (at 8B, batch 16: 2.1 GB
        of master, 2.1 GB of dense gradient, ~2.7 GB of row buffers): the device holds the current
        master, and `evict_resident()` writes it back into the same (then re-faulted) pages; the
        dense gradient reads as zeros, its reset state."""
        u = self.embed_unit
        for t in (u.master, self.embed_grad):      # no copy reads them: load_from_host copied synchronously
            if t is not None:
                self.pinned.release(t)
                release_pages(t)
        if self.embed_fwd_ev is not None:
            self.embed_fwd_ev.synchronize()          # the last forward's rows have left the buffer
            self.embed_fwd_ev = None
        self._wait(self.embed_host_free, "other")    # the worker is done with the last gradient rows
        for name in ("embed_fwd_buf", "embed_host"):
            buf = getattr(self, name)
            if buf is not None:
                self.pinned.release(buf)
                setattr(self, name, None)
        self._row_bufs = [None] * len(self._row_bufs)   # the worker's (idle: the embedding's update has landed)

    def evict_resident(self) -> None:
        """Write the resident units' state back to the host store and drop the device copies."""
        if not self.resident and self.resident_embed is None:
            return
        embed_mid_step = self.resident_embed is not None and self.live_generation is not None
        if self.resident_embed is not None:
            self.tier.materialize()      # a layer input gathered from the embedding's master
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)
        if embed_mid_step:
            # A forward's backward is still to come and takes the host path: the host gradient it
            # needs, holding what the head put in the resident one (a tied lm_head's gradient).
            self._ensure_embed_grad()
            if self.tied and self._embed_rgrad is not None:
                self.embed_grad.copy_(self._embed_rgrad)
        for r in list(self.resident.values()) + ([self.resident_embed] if self.resident_embed is not None else []):
            r.store_to_host()
            if r.grad_valid:
                # Between micro-batches: the running sum goes on in the host accumulator.
                u = r.unit
                u.grad.copy_(r.grad)
                u.grad_valid = True
                r.grad_valid = False
        self.resident.clear()
        self.resident_embed = None

    def _resident_update(self, u: Unit, r: ResidentState, grads: list) -> None:
        """AdamW of a resident layer on the compute stream right after its backward; with clipping,
        its gradient waits on the device for optimizer.step(). With accumulation the gradient is
        summed on the device over the micro-batches, and the last one updates (or, with clipping,
        leaves the sum for optimizer.step()); the squared norm is the sum's."""
        if self.single_micro:
            self.norm_dev += _sq_norm([g for g in grads if g is not None])
            g32 = self._resident_grad[:u.numel] if self.mode.updates else r.grad
            first = True
        else:
            g32, first = r.grad, not r.grad_valid
        for e, g in zip(u.entries, grads):
            d = e.view(g32)
            if g is None:
                if first:
                    d.zero_()
            elif first:
                d.copy_(g.reshape(d.shape))
            else:
                d.add_(g.reshape(d.shape))
        if not self.single_micro:
            r.grad_valid = True
            if self.mode.ends_step:
                self.norm_dev += _sq_norm([g32])
        if self.mode.updates:
            self._resident_step(u, r, g32, found_inf=self._found_inf_dev())
            r.grad_valid = False

    def _resident_step(self, u: Unit, r: ResidentState, g32: torch.Tensor, hp=None, clip_coef=None,
                       found_inf=None) -> None:
        """AdamW of resident unit `u` with its fp32 gradient on the device.

        Note: [Why the master is not copied back every step] the device master is the current
        one while the unit is resident; `evict_resident()` writes it back with the moments. A
        copy after every update would cost 4 bytes per parameter of d2h each step, and the last
        ones (layer 0, the embedding) would end the step with the GPU idle. Host-side readers of
        the weights (state_dict, save_pretrained, checkpoints) synchronize first, which evicts.
        """
        _optim.apply_adamw(u, g32, *(hp or self.hp), state=r, clip_coef=clip_coef, found_inf=found_inf)
        if r.weights is not r.master:
            r.weights.copy_(r.master)
        u.version += 1                                   # any slot copy of the old weights is stale
        self.stats.gpu_adam_params += u.numel

    def _pace(self) -> None:
        """Keep the host at most one resident layer ahead of the GPU.

        Note: [Why resident layers are paced] without a copy or an update to wait for, the host
        would queue resident layers' kernels as fast as Python runs, and the CPU worker, its
        AdamW done, could not return from its task until the resident stretch ended (it does
        not get the interpreter lock back; docs/benchmarks.md has the traces). Waiting on the
        previous layer's event releases the lock, so a worker task takes its AdamW plus its
        waits and nothing more. One layer of queued work covers the host's launch overhead.
        """
        if not self.streams.cuda:
            return
        prev, self._pace_ev = self._pace_ev, self.streams.record()
        if prev is not None:
            prev.synchronize()

    def _device_clip_coef(self):
        """The clip factor from the GPU-side norm of a one-backward step: on CUDA a device scalar (no
        sync, torch's clip_grad_norm_ arithmetic), on the CPU a float with the host tasks' own
        arithmetic (see _clip_task), so that the results are identical there."""
        mx = self.config.max_grad_norm
        if self.streams.cuda:
            return (mx / (self.norm_dev.sqrt() + 1e-6)).clamp(max=1.0)
        return min(mx / (float(self.norm_dev) ** 0.5 + 1e-6), 1.0)

    def _step_resident(self, hp, clip_done=None) -> set[int]:
        """Clip and update the resident units at optimizer.step() (clipping, or a step that ends
        before its last micro-batch); their unit ids. With accumulation the clip factor is the
        worker's (`clip_done`: its clip task has run), from the host units' norms and the device's."""
        units = ([(self.embed_unit, self.resident_embed, self._embed_rgrad)] if self.resident_embed is not None else [])
        units += [(self.layer_units[i], r, r.grad) for i, r in sorted(self.resident.items())]
        if not units:
            return set()
        found_inf = self._found_inf_dev() if self.single_micro else None
        if self.config.max_grad_norm is None:
            coef = None
        elif self.single_micro:
            coef = self._device_clip_coef()
        else:
            self._wait(clip_done, "update")
            coef = self._clip_coef
            found_inf = torch.tensor(float(self._poisoned), device=self.device)
        for u, r, g in units:
            # the clip factor applied in the fused AdamW, as on the host; skipped where not finite
            self._resident_step(u, r, g, hp, clip_coef=coef, found_inf=found_inf)
            r.grad_valid = False
        return {id(u) for u, _, _ in units}
