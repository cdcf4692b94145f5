"""The loss head's side of the schedule: final norm + lm_head + fused linear cross-entropy.

The head runs once per forward on its own slot (norm + lm_head, or + the tied embedding), loaded a
chunk per forward layer. With gradients its backward happens inside its forward (the loss ends
the graph): the gradients go to the host at once, into the front of the gradient ring when the
ring holds them, and the CPU worker updates the head while the layers' backward runs. Methods of
`SlideEngine` (a mixin, like `HostTasks`): they share its state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import SlideStateError
from .functions import leaves as _leaves, swapped
from .optim import sq_norm as _sq_norm

__all__ = ["LossHead"]


class LossHead:
    """Engine-side methods of the head unit (a mixin of SlideEngine)."""

    def head_forward(self, h, labels, num_items_in_batch, with_grad: bool, shift_labels=None):
        from triton_ops import linear_cross_entropy
        hu = self.head_unit
        slot, hv, W = self._head_weights()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        sl = shift_labels.reshape(-1).to(self.device, torch.long)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(self.device)
        if not with_grad:
            with torch.no_grad(), swapped(hu, hv):
                hn = self._norm(h)
                loss = linear_cross_entropy(hn.reshape(-1, self.hidden), W, sl, num_items_in_batch=num_items_in_batch,
                                            chunk_tokens=self.config.head_chunk_tokens)
            self.head_slots.release(slot)
            return loss, None
        t = self._span_start()
        hx = h.detach().requires_grad_()
        leaves = _leaves(hv)
        wl = leaves[self._lm_index()] if not self.tied else W.detach().requires_grad_()
        with torch.enable_grad(), swapped(hu, leaves):
            hn = self._norm(hx)
            loss = linear_cross_entropy(hn.reshape(-1, self.hidden), wl, sl, num_items_in_batch=num_items_in_batch,
                                        chunk_tokens=self.config.head_chunk_tokens)
        wrt = [hx] + leaves + ([wl] if self.tied else [])
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        pgrads = list(grads[1:])
        if self.single_micro:
            own = [g for g in pgrads[:len(leaves)] if g is not None]
            self._head_sq = _sq_norm(own)
            if self.tied:
                dw = pgrads[-1]
                self._dw_sq = _sq_norm([dw])
                self._dw_rows = dw.index_select(0, self._fwd_rows[0]).float()
        self._span_end(t)
        self.head_slots.release(slot)
        # Send the head's gradients to the host now: they are final (the loss ends the graph).
        if self.head_pending:        # an earlier forward's gradients were never consumed by a backward
            self.head_done.synchronize()
            self.head_pending = False
            self.head_host_free.set()
            self._return_head_ring()
        self._wait(self.head_host_free, "other")
        self.head_host_free.clear()
        try:
            # A tied lm_head's gradient joins the head's with accumulation (else it goes to the embedding's).
            extra = self.tied and self.resident_embed is None and not self.single_micro
            self.head_host = self._head_buffer(hu.numel + (self.embed_unit.numel if extra else 0))
            dsts = [e.view(self.head_host) for e in hu.entries]
            if self.tied and self.resident_embed is not None:
                # The resident embedding's gradient starts as the lm_head's, on the device (scaled by
                # the loss gradient in head_backward, the batch rows added in embed_backward).
                dw = pgrads.pop()
                self._embed_rgrad.view(self.vocab, self.hidden).copy_(dw)
            elif self.tied:
                # With one backward per step the tied gradient goes straight into the embedding's
                # pinned gradient buffer (which the previous step's update has released).
                dsts.append(self.embed_grad if self.single_micro else self.head_host[hu.numel:])
            self.head_done = self._d2h(pgrads, dsts)
        except BaseException:
            # Interrupted (Ctrl-C, an error) before the gradients were in flight: the buffers are
            # free again, so the next forward does not wait for them forever.
            self._return_head_ring()
            self.head_host_free.set()
            raise
        self.head_pending = True
        return loss.detach(), grads[0]

    def _head_buffer(self, numel: int) -> torch.Tensor:
        """Host buffer of `numel` elements (the ring's dtype) for the head's gradient: the front of the ring when the ring
        holds it (the layers' next gradients take the buffers after it first), else a pinned
        buffer of its own, made when first needed.

        Note: [Why the head's gradient borrows the ring] the head's gradients are copied out at the
        end of the forward, while the ring is idle, and the layers' backward needs it only after:
        the head's gradient lands in the first ring buffers when they hold it, and each buffer
        goes back to the ring as the head's update passes it (`HostTasks._head_task`). An untied
        8B lm_head's own buffer was 2.1 GB of pinned host memory.
        """
        if numel <= self.ring_size * len(self.ring):
            n = -(-numel // self.ring_size)
            for k in range(n):
                self._claim_ring(k)
            self.head_ring = tuple(range(n))
            self.ring_next = n % len(self.ring)
            return self.ring_slab[:numel]
        if self._head_own is None or self._head_own.numel() < numel:
            if self._head_own is not None:
                self.pinned.release(self._head_own)   # idle: head_host_free was waited for
            self._head_own = self.pinned.empty(numel, dtype=self.grad_dtype)
        return self._head_own[:numel]

    def _ring_passed(self, held: list, passed: int | None):
        """Pop from the front of `held` (ring buffers holding the head's gradient, in order) those
        a front-to-back reader has passed: up to element `passed` of the gradient, or all (None)."""
        while held and (passed is None or (held[0] + 1) * self.ring_size <= passed):
            yield held.pop(0)

    def _return_head_ring(self) -> None:
        for k in self.head_ring:
            self.ring_free[k].set()
        self.head_ring = ()

    def _lm_index(self) -> int:
        for k, e in enumerate(self.head_unit.entries):
            if any(attr == "weight" and mod is self._lm_module for mod, attr in e.holders):
                return k
        raise RuntimeError("lm_head weight not found in the head unit")

    def _norm(self, h):
        return self._norm_fn(h)

    def _head_slot_units(self) -> tuple:
        """What the head slot carries: the head unit, and a tied lm_head's embedding unless it is resident."""
        return (self.head_unit,) if self.tied and self.resident_embed is not None else self.head_units

    def _prefetch_head(self) -> None:
        """One chunk of the head slot's h2d copy per forward layer.

        Note: [Why the head slot is loaded in chunks during the forward] an untied lm_head is
        the largest unit (525M parameters at 8B: 2.1 GB of fp32). Loaded when the head runs, the
        GPU would wait for its copy every step where the forward ends. One
        256 MiB chunk after each layer's own prefetch fits in the h2d stream's idle time while
        that layer computes. It starts only once the head's previous update has landed (never
        blocking the forward on the worker)."""
        if self._head_prefetch is None:
            units = self._head_slot_units()
            if not all(u.updated.is_set() for u in units):
                return
            self._head_prefetch = self.head_slots.load_steps(units)
        next(self._head_prefetch, None)

    def _finish_head_prefetch(self) -> None:
        if self._head_prefetch is not None:
            for _ in self._head_prefetch:
                pass
            self._head_prefetch = None

    def _head_weights(self):
        """(slot, the head unit's views, the lm_head weight): a tied lm_head is the resident
        embedding's compute copy when there is one, else it travels in the head slot."""
        hu = self.head_unit
        self._finish_head_prefetch()
        if self.tied and self.resident_embed is not None:
            slot = self.head_slots.acquire((hu,))
            return slot, slot.views(hu), self.resident_embed.weights.view(self.vocab, self.hidden)
        slot = self.head_slots.acquire(self.head_units)
        hv = slot.views(hu)
        return slot, hv, (slot.views(self.embed_unit)[0] if self.tied else hv[self._lm_index()])

    def head_logits(self, h, logits_to_keep=0):
        hu = self.head_unit
        slot, hv, W = self._head_weights()
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:, :]
        with torch.no_grad(), swapped(hu, hv):
            logits = F.linear(self._norm(h), W)
        self.head_slots.release(slot)
        return logits

    def head_backward(self, gloss: torch.Tensor) -> None:
        if not self.head_pending:
            raise SlideStateError("backward() without a matching forward")
        self.head_pending = False
        hu = self.head_unit
        g = gloss.detach().float().reshape(1)
        self._scale_dev = g.reshape(())
        if self.single_micro:
            self.norm_dev += self._head_sq * self._scale_dev ** 2
        # The loss gradient reaches the worker through a pinned scalar: no host sync here.
        norm = self._norm_slot(hu) if self.single_micro else None
        if self.streams.cuda:
            self.scale_host.copy_(g, non_blocking=True)
            if norm is not None:
                norm.copy_(self.norm_dev.reshape(1), non_blocking=True)
        else:
            self.scale_host.copy_(g)
            if norm is not None:
                norm.copy_(self.norm_dev.reshape(1))
        scale_ev = self.streams.record()
        update = self.mode.updates
        embed_on_host = self.resident_embed is None
        if self.tied and not embed_on_host:
            self._embed_rgrad.mul_(self._scale_dev)
        if update:
            self._schedule(hu)
            if embed_on_host:
                self._schedule(self.embed_unit)      # its bulk update starts in the head task
        ring, self.head_ring = self.head_ring, ()
        self.worker.submit(self._head_task, self.head_done, scale_ev, update, self.mode.ends_step, self.hp,
                           self._fwd_touch if embed_on_host else None, embed_on_host, ring, norm,
                           done=(self.head_host_free,) + tuple(self.ring_free[k] for k in ring)
                           + ((hu.updated,) if update else ()))
