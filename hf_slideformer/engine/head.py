"""The loss head's side of the schedule: final norm + lm_head + fused linear cross-entropy.

The head runs once per forward on its own slot (norm + lm_head, or + the tied embedding), loaded a
chunk per forward layer. With gradients its backward happens inside its forward (the loss ends
the graph): the gradients go to the host at once, into the front of the gradient ring when the
ring holds them, and the CPU worker updates the head while the layers' backward runs.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..errors import SlideStateError
from ..compute.functions import swapped
from .lm_weight import lm_weight_of
from .slots import SlotQueue
from ..host.store import Unit

__all__ = ["LossHead"]


class LossHead:
    """The head unit, its slot and its gradient buffers.

    Args:
        engine: the SlideEngine.
        unit: the head's unit (the final norm and an untied lm_head).
        lm_module: the lm_head `nn.Linear`.
        norm_fn: the final norm's forward (HF's or the kernel's).
        slots: its one-slot queue, sized for `units`.

    Attributes:
        lm_weight: where the lm_head weight lives (lm_weight.py): the head unit, or a tied
            lm_head's embedding table.
        units: what the head slot carries: the head unit, and a tied lm_head's embedding unit.
        host_grad: the host buffer the pending head gradient lands in; `ring`: the ring buffers it holds.
        scale_host, scale_dev: the loss gradient (pinned for the worker, and on the device).
        training: whether it takes gradients (end_training.py): `TrainedHead` or `FrozenHead`,
            given by `Placements.refresh_ends`.
    """

    def __init__(self, engine, unit: Unit, lm_module, norm_fn, slots: SlotQueue):
        self.engine, self.unit = engine, unit
        self.lm_module, self.slots = lm_module, slots
        # The family's logit transform (registry.LogitTransform): its divisor divides the normed
        # hidden states, (h / d) @ W.T = (h @ W.T) / d, and its soft-cap goes to the loss.
        transform = engine.logit_transform
        self.softcap = transform.softcap
        self.norm_fn = norm_fn if transform.divisor == 1.0 else (lambda h: norm_fn(h) / transform.divisor)
        self.lm_weight = lm_weight_of(engine, unit, lm_module)
        self.units = self.lm_weight.units
        self.training = None                      # set with the embedding's (end_training.choose)
        self.host_grad: torch.Tensor | None = None
        self.own_buffer: torch.Tensor | None = None     # a head buffer of its own, when the ring is too small
        self.ring: tuple[int, ...] = ()
        self.host_free = threading.Event()
        self.host_free.set()
        self.pending = False
        self.done = None                          # d2h event: the pending gradient is on the host
        self._scale = 1.0                         # its loss gradient (read by the worker's head task)
        self._prefetch = None                     # load_steps generator of the head slot during a forward
        self._sq = None
        pin = engine.config.pin_memory and engine.config.is_cuda
        self.scale_host = torch.ones(1, dtype=torch.float32, pin_memory=pin)
        self.scale_dev = None

    @property
    def trainable(self) -> bool:
        """Does the head take gradients (its own parameters, or a tied lm_head's embedding)?"""
        return self.lm_weight.trainable()

    def step(self, deferred) -> None:
        """optimizer.step() after a backward that did not update: the worker updates the head
        (a frozen head unit's step is `Placements.updater_of`'s `NoUpdate`)."""
        engine, unit = self.engine, self.unit
        engine.begin_update(unit)
        engine.worker.submit(engine.host_updates.deferred_task, unit, deferred.hp, deferred.grads_ev,
                             done=(unit.updated,))

    # ----------------------------------------------------------------- forward (main thread)
    def forward(self, hidden, labels, num_items_in_batch, with_grad: bool, shift_labels=None, token_weights=None):
        """(loss, the gradient of `hidden` or None): with gradients, the head's own are sent to the host now.

        `token_weights` (B*S,) fp32, when given, weighs each token's cross-entropy instead of the
        mean (`triton_ops.linear_cross_entropy`): the gradients are then those of a loss made from
        the per-token log-probabilities (`token_statistics`), `w_t = -d loss / d log p_t`.
        """
        engine, hu = self.engine, self.unit
        slot, hv, weight = self._weights()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        sl = shift_labels.reshape(-1).to(engine.device, torch.long)
        sl, poison = engine.labels.prepare(sl, weight.shape[0])  # poison: NaN for a bad batch on CUDA (model_inputs.py)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(engine.device)
        if not with_grad:
            with torch.no_grad(), swapped(hu, hv):
                loss = self._loss(hidden, weight, sl, num_items_in_batch, poison)
            self.slots.release(slot)
            return loss, None
        if engine.dp is not None:
            engine.dp.meet(engine.meeting())     # before this micro-batch's first collective (data_parallel.py)
        span = engine.clock.span_start()
        hx = hidden.detach().requires_grad_()
        batch = (sl, num_items_in_batch, poison, token_weights)
        return self.training.grads_forward(self, hx, hv, weight, batch, slot, span)

    def input_grad_forward(self, hx, hv, weight, batch, slot, span):
        """A frozen head's training forward (`FrozenHead`): (loss, the gradient of `hx`) alone.
        `batch`: the labels, the item count, the poison and the token weights of `_loss`."""
        engine, hu = self.engine, self.unit
        with torch.enable_grad(), swapped(hu, hv):
            loss = self._loss(hx, weight, *batch)
        (gh,) = torch.autograd.grad(loss, [hx])
        engine.clock.span_end(span)
        self.slots.release(slot)
        self.pending, self.done = True, None
        return loss.detach(), gh

    def grads_forward(self, hx, hv, weight, batch, slot, span):
        """A trained head's training forward (`TrainedHead`): (loss, the gradient of `hx`), the
        head's own gradients (and a tied lm_head's) sent to the host now."""
        engine, hu = self.engine, self.unit
        # Note: [Why a frozen part of a trained head takes no gradient] the head unit trains when
        # any of its parameters does (PEFT's lm_head copy beside the base's frozen norm). A frozen
        # one is a leaf without gradient: zeros cross in its place, so the step's norm counts the
        # trained parameters only, as torch's clipping of the trainable parameters does.
        leaves = [t.detach().requires_grad_(x.param is None or x.param.requires_grad) for t, x in zip(hv, hu.entries)]
        wl, tied_leaves = self.lm_weight.leaf(leaves, weight)
        with torch.enable_grad(), swapped(hu, leaves):
            loss = self._loss(hx, wl, *batch)
        trained = [t for t in leaves if t.requires_grad]
        wrt = [hx] + trained + tied_leaves
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        own = iter(grads[1:1 + len(trained)])
        pgrads = [next(own) if t.requires_grad else None for t in leaves] + list(grads[1 + len(trained):])
        self._sq = engine.step_shape.head_norm_terms(self.lm_weight, pgrads, len(leaves))
        engine.clock.span_end(span)
        self.slots.release(slot)
        self._send(pgrads)
        self.pending = True
        return loss.detach(), grads[0]

    def _loss(self, hidden, weight, labels, num_items_in_batch, poison, token_weights=None) -> torch.Tensor:
        """The final norm and the fused linear cross-entropy of `hidden` against `labels` (B*S,), NaN
        where `poison` marks a bad batch."""
        from triton_ops import linear_cross_entropy
        hn = self.norm_fn(hidden)
        loss = linear_cross_entropy(hn.reshape(-1, self.engine.hidden), weight, labels,
                                    num_items_in_batch=num_items_in_batch,
                                    chunk_tokens=self.engine.config.head_chunk_tokens, softcap=self.softcap,
                                    token_weights=token_weights)
        return loss if poison is None else loss * poison

    def _send(self, pgrads: list) -> None:
        """The head's gradients (entry order, then a tied lm_head's) to the host now: they are final
        (the loss ends the graph)."""
        engine, hu = self.engine, self.unit
        if self.pending:        # an earlier forward's gradients were never consumed by a backward
            if self.done is not None:
                self.done.synchronize()
            self.pending = False
            self.host_free.set()
            self._return_ring()
        engine.clock.wait(self.host_free, "other")
        self.host_free.clear()
        try:
            # A tied lm_head's gradient may join the head's host buffer (lm_weight.py).
            self.host_grad = self._buffer(hu.numel + self.lm_weight.host_numel(), own=self.updates_last)
            dsts = [x.view(self.host_grad) for x in hu.entries]
            dsts += self.lm_weight.destinations(pgrads, self.host_grad[hu.numel:])
            self.done = engine.grad_ring.d2h(pgrads, dsts)
        except BaseException:
            # Interrupted (Ctrl-C, an error) before the gradients were in flight: the buffers are
            # free again, so the next forward does not wait for them forever.
            self._return_ring()
            self.host_free.set()
            raise

    def token_statistics(self, hidden, shift_labels):
        """Per-token (log p(label), entropy, is the label the argmax, the logits' mean, log sum p**2) of
        `hidden` (B, S, H) against `shift_labels` (B, S), each (B, S), without gradients or logits
        (`triton_ops.token_statistics`)."""
        from triton_ops import token_statistics
        engine, hu = self.engine, self.unit
        slot, hv, weight = self._weights()
        sl = shift_labels.reshape(-1).to(engine.device, torch.long)
        try:
            sl, poison = engine.labels.prepare(sl, weight.shape[0])
            with torch.no_grad(), swapped(hu, hv):
                hn = self.norm_fn(hidden)
                stats = token_statistics(hn.reshape(-1, engine.hidden), weight, sl,
                                         chunk_tokens=engine.config.head_chunk_tokens,
                                         softcap=self.softcap)
                if poison is not None:
                    stats = tuple(x * poison if x.is_floating_point() else x for x in stats)
        finally:
            self.slots.release(slot)
        return tuple(x.view(shift_labels.shape) for x in stats)

    def logits(self, hidden, logits_to_keep=0):
        """The logits of `hidden` (no loss), e.g. for generation."""
        hu = self.unit
        slot, hv, weight = self._weights()
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:, :]
        with torch.no_grad(), swapped(hu, hv):
            logits = F.linear(self.norm_fn(hidden), weight)
            if self.softcap is not None:
                logits = self.softcap * torch.tanh(logits / self.softcap)
        self.slots.release(slot)
        return logits

    @property
    def updates_last(self) -> bool:
        """Does the head's update run last in its step, after the embedding's?

        Note: [Why an untied head is updated when the backward ends] with updates in backward a
        layer's AdamW on the worker takes about as long as its backward on the GPU, so whatever the
        worker meets at the front of the backward delays the last updates, of layers 1, 0 and the
        embedding, which the next forward waits for (late_updates.py: [Why the top layers are
        updated late]). An untied lm_head (as large as the embedding) is needed only at the end of
        the next forward, so its update is held for the end of the backward (`LateUpdates`), after
        every layer's and the embedding's: it runs during the next forward, where the worker was
        idle. Its gradient waits in a buffer of its own (the ring is the layers' from the start of
        the backward); its norm is still judged first. Only an untied head, and only with one
        backward per step and no clipping: a tied lm_head is the embedding's table, and with
        accumulation or clipping every update waits for optimizer.step() anyway.
        """
        engine, hu = self.engine, self.unit
        return (hu.trainable and self.lm_weight.may_update_last() and engine.step_shape.head_may_update_last()
                and engine.config.max_grad_norm is None and hu.grad is None)

    def _buffer(self, numel: int, own: bool = False) -> torch.Tensor:
        """Host buffer of `numel` elements (the ring's dtype) for the head's gradient: the front of the ring when the ring
        holds it (the layers' next gradients take the buffers after it first), else a pinned
        buffer of its own, made when first needed.

        Note: [Why the head's gradient borrows the ring] the head's gradients are copied out at the
        end of the forward, while the ring is idle, and the layers' backward needs it only after:
        the head's gradient lands in the first ring buffers when they hold it, and each buffer
        goes back to the ring as the head's update passes it (`_head_task`). An untied 8B
        lm_head's own buffer was 2.1 GB of pinned host memory.
        """
        engine = self.engine
        borrowed = None if own else engine.grad_ring.borrow_front(numel)
        if borrowed is not None:
            buffer, self.ring = borrowed
            return buffer
        if self.own_buffer is None or self.own_buffer.numel() < numel:
            if self.own_buffer is not None:
                engine.pinned.release(self.own_buffer)   # idle: host_free was waited for
            self.own_buffer = engine.pinned.empty(numel, dtype=engine.grad_ring.dtype)
        return self.own_buffer[:numel]

    def _return_ring(self) -> None:
        self.engine.grad_ring.give_back(self.ring)
        self.ring = ()

    def slot_units(self) -> tuple:
        """What the head slot carries: the head unit, and a tied lm_head's embedding unless it is resident."""
        return self.lm_weight.slot_units()

    def prefetch(self) -> None:
        """One chunk of the head slot's h2d copy per forward layer.

        Note: [Why the head slot is loaded in chunks during the forward] an untied lm_head is
        the largest unit (525M parameters at 8B: 2.1 GB of fp32). Loaded when the head runs, the
        GPU would wait for its copy every step where the forward ends. One
        256 MiB chunk after each layer's own prefetch fits in the h2d stream's idle time while
        that layer computes. It starts only once the head's previous update has landed (never
        blocking the forward on the worker)."""
        if self._prefetch is None:
            units = self.slot_units()
            if not all(u.updated.is_set() for u in units):
                return
            self._prefetch = self.slots.load_steps(units)
        next(self._prefetch, None)

    def drop_prefetch(self) -> None:
        """A new forward: a load started by one that stopped half way starts over."""
        self._prefetch = None

    def _finish_prefetch(self) -> None:
        if self._prefetch is not None:
            for _ in self._prefetch:
                pass
            self._prefetch = None

    def _weights(self):
        """(slot, the head unit's views, the lm_head weight): a tied lm_head is the resident
        embedding's compute copy when there is one, else it travels in the head slot."""
        self._finish_prefetch()
        return self.lm_weight.weights(self.slots)

    # ----------------------------------------------------------------- backward (main thread)
    def backward(self, gloss: torch.Tensor) -> None:
        """The first step of a backward: the loss gradient scales the head's gradients, sent in forward."""
        if not self.pending:
            raise SlideStateError("backward() without a matching forward")
        self.pending = False
        engine, hu, emb = self.engine, self.unit, self.engine.embedding
        loss_grad = gloss.detach().float().reshape(1)
        self.scale_dev = loss_grad.reshape(())
        if self.done is None:                      # a frozen head sent nothing
            return
        plan = engine.backward_plan
        plan.norm.add(lambda: self._sq * self.scale_dev ** 2)
        # The loss gradient reaches the worker through a pinned scalar: no host sync here.
        norm = plan.norm.slot(hu)
        self.scale_host.copy_(loss_grad, non_blocking=True)     # (synchronous on a CPU device)
        if norm is not None:
            norm.copy_(engine.norm.dev.reshape(1), non_blocking=True)
        scale_ev = engine.streams.record()
        update = plan.updates
        table = emb.table                         # where the embedding's table is for this backward
        self.lm_weight.scale_on_device(self.scale_dev)
        bulk = table.updates_on_worker()          # the embedding's update starts in the head task
        if update:
            engine.begin_update(hu)
            if bulk:
                engine.begin_update(engine.embed_unit)
        ring, self.ring = self.ring, ()
        last = update and not ring and self.updates_last
        if last:                                  # [Why an untied head is updated when the backward ends]
            engine.late.hold(len(engine.layer_units), self._update_task, (plan.host_norms, engine.hp),
                        done=(self.host_free, hu.updated))
        engine.worker.submit(self._head_task, self.done, scale_ev, update, plan.host_norms, engine.hp,
                        emb.touch if bulk else None, table, ring, norm, last,
                        done=(() if last else (self.host_free,)) + tuple(engine.grad_ring.free[k] for k in ring)
                        + ((hu.updated,) if update and not last else ()))

    # ----------------------------------------------------------------- worker side
    def _head_task(self, done, scale_ev, update, host_norms, hp, touch=None, table=None, ring=(), norm=None,
                   last=False):
        engine, host_updates, emb = self.engine, self.engine.host_updates, self.engine.embedding
        host_updates.sync(done, "wait_d2h:head")
        host_updates.sync(scale_ev, "wait_d2h:scale")
        if norm is not None:
            host_updates.check_norm(float(norm[0]), "the gradient of the head")
        scale = float(self.scale_host[0])
        if last:                  # the update comes when the backward ends (`_update_task`)
            self._scale = scale
            if touch is not None:
                emb.bulk_update(touch, hp)
            return
        hu = self.unit
        # The head's gradient (in the ring's dtype) times the loss gradient `scale`: each element
        # is widened to fp32, then multiplied, wherever that happens (the update, the accumulator).
        src = self.host_grad[:hu.numel]
        self.lm_weight.scale_on_host(self.host_grad[hu.numel:], scale, table)
        # Read by the update alone, front to back: each ring buffer goes back once it is passed.
        returned = engine.grad_ring.returner(ring) if ring and hu.grad is None else None
        host_updates.consume(hu, src, update, host_norms, hp, returned, grad_mul=scale)
        if update and touch is not None:
            emb.bulk_update(touch, hp)

    def _update_task(self, host_norms, hp):
        """Worker, after the embedding's update: the head's AdamW from its gradient times the loss gradient."""
        hu = self.unit
        self.engine.host_updates.consume(hu, self.host_grad[:hu.numel], True, host_norms, hp, grad_mul=self._scale)
