"""The token embedding's side of the schedule: its gather in the forward, its gradient in the
backward, and the CPU worker's two-part update of the (V, H) table.

Where its table lives is its `table` (embedding_table.py): resident on the GPU when the plan has
room (`ResidentTable`; `rgrad` its dense device gradient), else in the host store (`HostTable`):
the forward gathers the batch's rows on the host and copies them in, the backward sums the token
gradients per distinct row on the GPU and sends those sums, and the worker folds them into the
dense host gradient (`grad`) and updates.
"""
from __future__ import annotations

import threading
import time

import torch

from ..host.memory import lazy_zeros, release_pages
from .embedding_table import HostTable, ResidentTable
from .placements import DeferredStep
from ..host.store import Unit

__all__ = ["Embedding"]

GATHER_CHUNK = 4096      # rows per step of the forward's host gather (its copy overlaps the next)


class Embedding:
    """The embedding unit, its buffers and its tasks.

    Args:
        engine: the SlideEngine.
        unit: the embedding's unit.
        module: the HF `nn.Embedding`.

    Attributes:
        grad: the host's dense (V * H,) fp32 gradient, made on first use (None while resident).
        host: pinned (n, H) buffer the batch rows' gradient sums land in.
        table: where its table lives and how it is updated (embedding_table.py): `HostTable` or
            `ResidentTable`, swapped by the resident plan.
        rgrad: the resident embedding's (V * H,) fp32 device gradient (kept once made).
        touch: the distinct token ids of the last training forward (host); `rows_dev`: those, the
            inverse index and the non-padding mask, on the device.
        dw_sq, dw_rows: a tied lm_head's squared gradient norm and its gradient's batch rows
            (set by the head's forward, for the norm of one-backward steps).
        training: whether its unit trains (end_training.py): `TrainedEmbedding` or
            `FrozenEmbedding`, given by `Placements.refresh_ends` at the start of every forward.
    """

    def __init__(self, engine, unit: Unit, module: torch.nn.Embedding):
        self.engine, self.unit = engine, unit
        self.vocab, self.hidden = module.weight.shape
        self.padding_idx = module.padding_idx
        self.host_grad: torch.Tensor | None = None
        self.host_free = threading.Event()
        self.host_free.set()
        self.fwd_buf: torch.Tensor | None = None
        self.fwd_ev = None
        self.grad: torch.Tensor | None = None
        self.touched: list[torch.Tensor] = []
        self.table: HostTable | ResidentTable = HostTable(self)
        self.training = None                     # set with the head's (end_training.choose)
        self.rgrad: torch.Tensor | None = None
        self.touch = None
        self.rows_dev = None
        self.dw_sq = self.dw_rows = None
        self._out = None               # (x_0, its version, its gather) while layer 0's forward is ahead
        self._bulk = None
        self.row_buffers: list[torch.Tensor | None] = [None]   # see rows_buffer

    # ----------------------------------------------------------------- forward (main thread)
    def forward(self, input_ids: torch.Tensor, with_grad: bool = False) -> torch.Tensor:
        """The embedded batch (B, S, H) in the compute dtype."""
        engine, unit = self.engine, self.unit
        engine.stats.event("forward_begin", time.perf_counter())
        engine.places.refresh_ends()                      # requires_grad may have changed since the last forward
        engine.head.drop_prefetch()                       # a forward that stopped half way left it
        self._out = None
        engine.clock.wait(unit.updated, "update")
        ids = input_ids.detach().to("cpu", torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise ValueError(f"input_ids out of range [0, {self.vocab}): min {int(ids.min())}, max {int(ids.max())}")
        if with_grad:
            # The rows this batch touches: their gradient is summed per row on the GPU (see
            # backward), and they are the rows the layers' backward will still change (see
            # bulk_update). The padding row is among them with a zero sum: updating it again with
            # its full gradient reproduces the bulk update exactly.
            uniq, inv = torch.unique(ids, return_inverse=True)
            keep = (ids != self.padding_idx) if self.padding_idx is not None else torch.ones_like(ids, dtype=torch.bool)
            self.touch = uniq
            self.rows_dev = tuple(t.to(engine.device, non_blocking=True) for t in (uniq, inv, keep))
            engine.residents.fit(ids.numel())
            self.table.prepare_gradient()            # after fit: it may have moved the table
        first = engine.places.first_streamed()
        if first is not None and first.unit.updated.is_set():
            first.prefetch()                             # its h2d overlaps the gather below
        # else its update runs behind the embedding's rows (late_updates.py: [Why layer 0 is updated
        # after the embedding's rows]) and its copy would wait for it here: the gather goes first.
        return self.table.gather(ids, input_ids.shape, with_grad)

    def gather_on_host(self, ids: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The embedded batch (`shape` + (H,)) in the compute dtype: the rows of the host master
        (`HostTable`), copied in."""
        master = self.unit.master.view(self.vocab, self.hidden)
        rows_out = self.engine.streams.gather_rows(master, ids, self.gather_staged)
        return rows_out.to(self.engine.dtype).view(*shape, self.hidden)

    def gather_staged(self, master: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` of the host `master` on a CUDA device (`Streams.gather_rows`), in the
        gather's dtype: gathered into a pinned buffer in chunks, each copied in as the next is
        gathered."""
        engine = self.engine
        num_tokens = ids.numel()
        if self.fwd_ev is not None:
            self.fwd_ev.synchronize()          # the previous batch's rows have left the buffer
        # Note: [Why the rows are gathered in bf16, in chunks] the gather is on the path from the
        # backward's end to the first layer's compute. Rounded to bf16 on the host (the native
        # kernel, the rounding the GPU's cast applies), it writes and copies half the bytes; from a
        # bf16 master (optimizer_state='adamw_8bit_bf16') it is a plain row copy. In chunks, each
        # chunk's copy runs while the next is gathered. It shares the host's memory
        # with layer 0's update, hence half the worker's threads.
        adam = engine.host_adam
        rounded = adam.native and engine.dtype == torch.bfloat16 and master.dtype == torch.float32
        dt = torch.bfloat16 if rounded else master.dtype
        if self.fwd_buf is None or self.fwd_buf.shape[0] < num_tokens or self.fwd_buf.dtype != dt:
            if self.fwd_buf is not None:
                engine.pinned.release(self.fwd_buf)
            self.fwd_buf = engine.pinned.empty(num_tokens, self.hidden, dtype=dt)
        buf = self.fwd_buf[:num_tokens]
        rows_out = torch.empty(num_tokens, self.hidden, dtype=dt, device=engine.device)
        for lo in range(0, num_tokens, GATHER_CHUNK):
            hi = min(lo + GATHER_CHUNK, num_tokens)
            if dt != master.dtype:                 # an fp32 master's rows rounded on the way
                adam.gather_bf16(master, ids[lo:hi], buf[lo:hi], threads=max(1, adam.threads // 2))
            else:
                torch.index_select(master, 0, ids[lo:hi], out=buf[lo:hi])
            rows_out[lo:hi].copy_(buf[lo:hi], non_blocking=True)
        self.fwd_ev = engine.streams.record()
        engine.stats.add_h2d(buf.numel() * buf.element_size())
        return rows_out

    def keep_gather(self, out: torch.Tensor, gather) -> None:
        """A training forward's output `out` and the `gather` that makes it again (`ResidentTable`)."""
        self._out = (out, out._version, gather)

    def remake_input(self, layer_no: int, hidden: torch.Tensor):
        """Layer 0's input `hidden` as a recipe when it is the resident embedding's gather itself (not
        a product of it, as Gemma's scaled embedding is) and unchanged since."""
        if layer_no != 0 or self._out is None:
            return None
        out, version, gather = self._out
        self._out = None
        same = (hidden.data_ptr() == out.data_ptr() and hidden.shape == out.shape
                and hidden.stride() == out.stride() and hidden.dtype == out.dtype and hidden._version == version)
        return gather if same else None

    # ----------------------------------------------------------------- backward (main thread)
    def backward(self, gx: torch.Tensor) -> None:
        """The last step of a backward: the embedding's gradient from the first layer's input
        gradient, unless it is frozen (the base under LoRA; `FrozenEmbedding`)."""
        self.training.backward(self, gx)

    def take_gradient(self, gx: torch.Tensor) -> None:
        """A trained embedding's backward (`TrainedEmbedding`): its gradient from the first layer's
        input gradient `gx`, then the backward ends."""
        engine = self.engine
        num_tokens = gx.numel() // self.hidden
        _, inv, keep = self.rows_dev
        distinct = self.touch.numel()
        # Note: [Why the embedding gradient is summed on the GPU] the worker's embedding task is on
        # the path to the next forward. Summed per distinct row on the GPU (a sorted, deterministic
        # accumulate), the d2h copy and the worker's folding shrink from one row per token to one
        # per distinct token (far fewer in real text), and the worker's gather / scatter are
        # parallel copies instead of an index_add_ over every token.
        span = engine.clock.span_start()
        token_grads = gx.reshape(num_tokens, self.hidden).float() * keep[:, None]
        row_sums = torch.zeros(distinct, self.hidden, dtype=torch.float32, device=gx.device)
        row_sums.index_put_((inv,), token_grads, accumulate=True)
        # The embedding's gradient is `row_sums`, the per-row sums of the token gradients over the batch's rows
        # (padding dropped), plus a tied lm_head's dW: its norm without the (V, H) gradient (lm_weight.py).
        engine.backward_plan.norm.add(engine.head.lm_weight.embedding_sq, row_sums)
        self.table.take_sums(row_sums, span)

    def send_sums(self, sums: torch.Tensor, span) -> None:
        """The batch rows' gradient sums `sums` (distinct rows, H) to the host, and the worker's task
        that folds them into the dense gradient (and updates, when the backward does); then the
        backward ends (`HostTable`)."""
        engine, unit, rows = self.engine, self.unit, self.touch
        distinct = rows.numel()
        engine.clock.span_end(span)
        engine.clock.wait(self.host_free, "other")          # the worker is done with the previous gradient
        if self.host_grad is None or self.host_grad.shape[0] < distinct:
            if self.host_grad is not None:
                engine.pinned.release(self.host_grad)
            self.host_grad = engine.pinned.empty(max(distinct, 1), self.hidden)
        host_rows = self.host_grad[:distinct]
        self.host_free.clear()
        norm = engine.backward_plan.norm.slot(unit)
        done = engine.grad_ring.d2h([sums], [host_rows], norm_dst=norm)
        update = engine.backward_plan.updates                   # begun with the head's (see head.backward) ...
        if update:                                        # ... unless the head is frozen and sent nothing
            engine.head.training.begin_embedding_update(engine, unit)
        engine.worker.submit(self._embed_task, host_rows, rows, done, update, engine.backward_plan.host_norms,
                             engine.hp, norm, done=(self.host_free,) + engine.backward_plan.updating.signals(unit))
        engine.end_backward()

    def step(self, deferred: DeferredStep) -> None:
        """optimizer.step() after a backward that did not update: the worker updates from the dense
        gradient (a frozen embedding's step is `Placements.updater_of`'s `NoUpdate`)."""
        engine, unit = self.engine, self.unit
        engine.begin_update(unit)
        engine.worker.submit(engine.host_updates.deferred_task, unit, deferred.hp, deferred.grads_ev, self.grad,
                             self.reset_grad, done=(unit.updated,))

    # ----------------------------------------------------------------- worker side
    def rows_buffer(self, index: int, rows: int) -> torch.Tensor:
        """Persistent (`rows`, H) fp32 scratch number `index` of the worker's embedding-row work.

        Note: [Why the row buffers persist] a fresh 100-400 MB tensor per step is a fresh mmap whose
        pages fault in on first touch (the cost is measured in docs/engine.md, "Where the time
        goes"). The buffers grow to the largest batch seen and stay.
        """
        bufs = self.row_buffers
        if bufs[index] is None or bufs[index].shape[0] < rows:
            grow = rows if bufs[index] is None else max(rows, bufs[index].shape[0] * 5 // 4)
            bufs[index] = torch.empty(grow, self.hidden, dtype=torch.float32)
        return bufs[index][:rows]

    def _embed_task(self, sums, rows, done, update, host_norms, hp, norm=None):
        """Fold the batch's per-row gradient sums (distinct rows) into the embedding's gradient."""
        engine, host_updates = self.engine, self.engine.host_updates
        host_updates.sync(done, "wait_d2h:embed")
        if norm is not None:
            host_updates.check_norm(float(norm[0]), "the gradient of the embedding (or of a layer)")
        elif not bool(torch.isfinite(sums).all()):    # (no running norm: accumulation)
            # judged now: the sum it joins is read by the next micro-batch's early bulk update
            host_updates.poison("the gradient of the embedding")
        table_grad = self.grad.view(self.vocab, self.hidden)
        rows_update = update and self._bulk is not None
        if rows_update and engine.step_shape.rows_update(self, rows, sums, hp):   # step_shape.py
            return
        grad_rows = torch.index_select(table_grad, 0, rows, out=self.rows_buffer(0, rows.numel())).add_(sums)
        table_grad.index_copy_(0, rows, grad_rows)
        self.touched.append(rows)
        if host_norms:
            host_updates.norm_sq.append(float(torch.linalg.vector_norm(self.grad)) ** 2)
            host_updates.check_norm(host_updates.norm_sq[-1], "the gradient of the embedding")
        if update:
            if self._bulk is not None:
                self._rows_update(hp)
            else:
                host_updates.update(self.unit, self.grad, hp)
            self.reset_grad()

    # Note: [Why the embedding is updated in two parts] with updates in backward, the embedding's
    # gradient is final for every row but the batch's own tokens as soon as the head is done (a
    # tied lm_head's dW, else zero). So the head task runs AdamW over every other row of the table
    # early, in place; the last task of the backward updates the batch's rows with their full
    # gradient. Each row takes one step either way (the same mathematics as one update of the
    # whole table), and the next forward waits for a few thousand rows instead of the (V, H) table.
    def bulk_update(self, rows: torch.Tensor, hp) -> None:
        """Worker: AdamW of every row but `rows` (the batch's, distinct), in place."""
        table_grad = self.grad.view(self.vocab, self.hidden)
        if self.engine.host_updates.update_rows(self.unit, table_grad, rows, hp, advance=True, exclude=True):
            self._bulk = rows

    def update_rows_with_sums(self, rows: torch.Tensor, sums: torch.Tensor, hp) -> None:
        """Worker, with one backward per step (step_shape.py): the batch's rows after the bulk
        update, their gradient sums `sums` added inside their AdamW."""
        # On the path to the next forward: the rows' gradient sums added inside their AdamW, one
        # pass, and the gradient's rows cleared in it (a tied one is overwritten by the next head).
        self.touched.append(rows)
        cleared = not self.engine.head.lm_weight.overwrites_embedding_grad
        if self._rows_update(hp, sums=sums, zero_grad=cleared):
            self.touched.pop()
        self.reset_grad()

    def _rows_update(self, hp, sums: torch.Tensor | None = None, zero_grad: bool = False) -> bool:
        """AdamW of the batch's rows after the bulk update, with the dense gradient's rows (plus
        `sums`, those rows of it zeroed after when `zero_grad`). Returns whether it ran (a
        non-finite step skips it)."""
        rows, self._bulk = self._bulk, None
        return self.engine.host_updates.update_rows(self.unit, self.grad.view(self.vocab, self.hidden), rows, hp,
                                            advance=False, sums=sums, zero_grad=zero_grad)

    def reset_grad(self) -> None:
        """The dense host gradient back to zeros (only the rows a batch touched are cleared)."""
        if self.grad is None:                  # never on the host since it was made
            self.touched = []
            self.unit.grad_valid = False
            return
        table_grad = self.grad.view(self.vocab, self.hidden)
        self.engine.head.lm_weight.clear_rows(table_grad, self.touched)
        self.touched = []
        self.unit.grad_valid = False

    # ----------------------------------------------------------------- host and device state
    def ensure_grad(self) -> None:
        """The host's dense (V, H) fp32 gradient of an embedding on the host, made on first use.

        Note: [Why only a tied embedding's dense gradient is pinned] a tied lm_head's gradient
        lands there straight from the GPU, so its pages must be page-locked, which backs every one
        of them (4 B/param of the table). An untied embedding's gradient crosses as the batch rows'
        sums (`host`), and with one backward per step the dense one only ever reads as zeros (the
        sums are added inside the rows' AdamW, which writes a row back only when it is nonzero):
        left pageable and lazily mapped, it takes no host memory. Not pinned either while the
        embedding is only out for a while (written back for a checkpoint, resident again after
        this step)."""
        if self.grad is not None:
            return
        self.grad = lazy_zeros(self.unit.numel)
        self.engine.head.lm_weight.adopt_embedding_grad(self.grad, self.engine.residents.planned)

    @property
    def resident(self):
        """Its `ResidentState` while it is on the device, else None (for reports and tests: the
        engine asks `table`)."""
        return self.table.state

    def make_resident(self) -> None:
        """Move the embedding's state to the device and give its host buffers back."""
        engine, unit = self.engine, self.unit
        self.table = ResidentTable(self, engine.residents.make_state(unit))
        self._release_host()
        if self.rgrad is None:
            self.rgrad = torch.zeros(unit.numel, dtype=torch.float32, device=engine.device)

    def return_to_host(self) -> None:
        """The resident plan has written the embedding's state back to the host store."""
        self.table = HostTable(self)

    def _release_host(self) -> None:
        """Give back the host memory of an embedding that went resident (at 8B, batch 16: 2.1 GB
        of master, 2.1 GB of dense gradient, ~2.7 GB of row buffers): the device holds the current
        master, and `ResidentPlan.evict()` writes it back into the same (then re-faulted) pages;
        the dense gradient reads as zeros, its reset state."""
        engine, unit = self.engine, self.unit
        for tensor in (unit.master, self.grad):            # no copy reads them: load_from_host copied synchronously
            if tensor is not None:
                engine.pinned.release(tensor)
                release_pages(tensor)
        if self.fwd_ev is not None:
            self.fwd_ev.synchronize()              # the last forward's rows have left the buffer
            self.fwd_ev = None
        engine.clock.wait(self.host_free, "other")          # the worker is done with the last gradient rows
        for name in ("fwd_buf", "host_grad"):
            buf = getattr(self, name)
            if buf is not None:
                engine.pinned.release(buf)
                setattr(self, name, None)
        self.row_buffers = [None] * len(self.row_buffers)   # the worker's (idle: the embedding's update has landed)
