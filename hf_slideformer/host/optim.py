"""SlideOptimizer: a torch.optim.Optimizer facade over the engine's CPU AdamW.

The optimizer owns the hyper-parameters (`param_groups`, so HF lr schedulers and per-group
weight decay work unchanged); the engine owns *when* each unit is updated: inside backward when
the backward ends the optimizer step, else at `step()`. Both read the groups at update time.
The update of host state runs the engine's `HostAdam` kernel (host_adam.py: a native one-pass
AdamW that reads a bf16 gradient directly, or torch's fused CPU AdamW); device state (resident
layers, device updates) runs torch's fused AdamW on the GPU. Both over views of the flat fp32
masters and moments.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .host_adam import torch_fused_adamw
from .host_optim import ADAMW, StateFormatMismatchError, formats_holding
from .store import Unit

__all__ = ["SlideOptimizer", "apply_adamw", "apply_batch", "grad_scale", "groups_of", "piece_batches", "sq_norm"]


def sq_norm(tensors) -> torch.Tensor:
    """Sum of squared L2 norms, in fp32, as a scalar on the tensors' device."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def apply_adamw(unit: Unit, grad: torch.Tensor, groups: list[dict], group_of: dict[int, int], state=None,
                piece: int | None = None, on_piece=None, before_piece=None, clip_coef=None, kernel=None,
                grad_mul: float = 1.0, found_inf: torch.Tensor | None = None, span: tuple[int, int] | None = None
                ) -> None:
    """One AdamW step of `unit` with the flat gradient `grad` (the unit's layout).

    Args:
        unit: the unit; its master, moments and per-entry step counters are updated in place.
        grad: (unit.numel,) gradient: fp32, or bf16 for host state with a `kernel` (widened
            exactly inside the update).
        groups: hyper-parameter snapshot per param group (lr, betas, eps, weight_decay, maximize).
        group_of: id(parameter) -> index into `groups`; parameters absent are not updated.
        state: another holder of `master`, `exp_avg`, `exp_avg_sq`, `steps` in the unit's layout
            (a resident layer's device copies); default the unit's host store.
        piece: update in offset order, about this many elements per call, and report each
            finished prefix to `on_piece(n)` (the first n elements of the flat master are final),
            so that a reader can copy the front of the unit while the back is being updated.
            `piece` must be a power of two: every parameter is cut at multiples of it from its
            own start, so the vectorized kernel sees the same alignment as in one call per group
            and the result is bit-identical to it (an odd cut can move a rounding).
        before_piece: with `piece`, called with the end offset of each piece before it is
            updated (to wait until the gradient of that prefix has arrived).
        clip_coef: the gradient-clipping factor (a float, or a scalar tensor on the state's
            device), applied inside the fused kernel (its `grad_scale`, the reciprocal) instead
            of a separate pass over the gradient.
        kernel: the `HostAdam` that updates host (CPU) state; None: torch's fused AdamW.
        grad_mul: a factor the gradient is multiplied by first (a loss scale; host state only).
        found_inf: a float scalar tensor; where it is nonzero the update leaves master, moments
            and step counters unchanged (on a GPU, torch's fused-kernel skip, decided on the
            device without a host sync).
        span: update only the flat range [lo, hi) of the unit (a data-parallel rank's shard);
            `grad` then holds hi - lo elements, from lo. The step counters of every entry
            advance as for the whole unit (each rank keeps them all).
    """
    state = unit if state is None else state
    fmt = unit.state_format or ADAMW
    if found_inf is not None and found_inf.device.type == "cpu":
        if float(found_inf):                # decided on the host: nothing to do
            return
        found_inf = None
    by_group = groups_of(unit, group_of)
    for ks in by_group.values():
        torch._foreach_add_([state.steps[k] for k in ks], 1)
    scale = grad_scale(clip_coef, state.master.device)
    if state.master.device.type != "cpu":
        kernel = None
    elif kernel is None and (grad.dtype != torch.float32 or grad_mul != 1.0):
        raise ValueError("a bf16 or scaled gradient of host state needs a HostAdam kernel")
    if piece is not None and (piece <= 0 or piece & (piece - 1)):
        raise ValueError(f"piece must be a power of two, got {piece}")
    if found_inf is not None:
        # the kernel skips the update itself; the counters advanced above go back (as torch.optim does)
        _revert = [state.steps[k] for ks in by_group.values() for k in ks]

    def run(gi, ranges, lo=0):
        # the unit's format updates its flat ranges [(entry, a, b)] (host_optim.py)
        fmt.run(kernel, groups[gi], unit, state, ranges, [grad[a - lo:b - lo] for _, a, b in ranges],
                [state.steps[k] for k, _, _ in ranges], scale, grad_mul=grad_mul, found_inf=found_inf)

    if piece is None and span is None:
        for gi, ks in by_group.items():
            run(gi, [(k, unit.entries[k].offset, unit.entries[k].offset + unit.entries[k].numel) for k in ks])
        if found_inf is not None and _revert:
            torch._foreach_sub_(_revert, [found_inf] * len(_revert))
        return
    lo, hi = span if span is not None else (0, unit.numel)
    for _, end, batch in piece_batches(unit, by_group, piece or 1 << 40):
        if before_piece is not None:
            before_piece(end)
        for gi, ranges in batch.items():
            cut = [(k, max(a, lo), min(b, hi)) for k, a, b in ranges if max(a, lo) < min(b, hi)]
            if cut:
                run(gi, cut, lo)
        if on_piece is not None:
            on_piece(end)
    if found_inf is not None and _revert:
        torch._foreach_sub_(_revert, [found_inf] * len(_revert))


def groups_of(unit: Unit, group_of: dict[int, int]) -> dict[int, list[int]]:
    """Param group -> indices of the unit's entries it updates (those `group_of` leaves out: frozen
    when it was made, or in no group)."""
    by_group: dict[int, list[int]] = {}
    for index, entry in enumerate(unit.entries):
        gi = group_of.get(id(entry.param))
        if gi is None:
            continue
        by_group.setdefault(gi, []).append(index)
    return by_group


def piece_batches(unit: Unit, by_group: dict[int, list[int]], piece: int, span: bool = False):
    """The ranges of a piecewise update, in offset order: yields (start, end, batch).

    batch maps a param group to [(entry index, lo, hi)] flat ranges; every entry is cut at
    multiples of `piece` from its own start. A batch closes once it holds `piece` elements; the
    last one (possibly empty) ends at `unit.numel`. With `span`, the entries outside every group
    count too (they lie in [start, end) unchanged), so that [start, end) is at most
    2 * piece - 1 elements: the flat range a copy of the batch has to move.
    """
    group_of_entry = {k: gi for gi, ks in by_group.items() for k in ks}
    batch: dict[int, list[tuple]] = {}
    start, size = 0, 0
    for index in sorted(range(len(unit.entries)), key=lambda index: unit.entries[index].offset):
        gi = group_of_entry.get(index)
        if gi is None and not span:
            continue
        entry = unit.entries[index]
        for lo in range(0, entry.numel, piece):
            hi = min(lo + piece, entry.numel)
            if gi is not None:
                batch.setdefault(gi, []).append((index, entry.offset + lo, entry.offset + hi))
            size += hi - lo
            if size >= piece:
                yield start, entry.offset + hi, batch
                start, batch, size = entry.offset + hi, {}, 0
    yield start, unit.numel, batch


def grad_scale(clip_coef, device) -> torch.Tensor | None:
    """The fused kernel divides the gradient by `grad_scale`: the reciprocal of the clip factor."""
    if clip_coef is None:
        return None
    if torch.is_tensor(clip_coef):
        return clip_coef.to(device=device, dtype=torch.float32).reshape(()).reciprocal()
    if clip_coef == 1.0:
        return None
    return torch.tensor(1.0 / clip_coef, dtype=torch.float32, device=device)


def apply_batch(batch: dict, lo: int, master, grad, exp_avg, exp_avg_sq, steps, groups: list[dict],
                scale=None, found_inf=None) -> None:
    """AdamW of one `piece_batches` batch on copies of the flat range that starts at offset `lo`
    (master, grad and moments index from `lo`); `steps` are the per-entry counters, already
    advanced for this step; a nonzero `found_inf` (a device scalar) skips it."""
    for gi, ranges in batch.items():
        torch_fused_adamw(groups[gi], [master[a - lo:b - lo] for _, a, b in ranges],
                          [grad[a - lo:b - lo] for _, a, b in ranges],
                          [exp_avg[a - lo:b - lo] for _, a, b in ranges],
                          [exp_avg_sq[a - lo:b - lo] for _, a, b in ranges],
                          [steps[k] for k, _, _ in ranges], scale, found_inf)




class SlideOptimizer(torch.optim.Optimizer):
    """AdamW over a slid model's master weights, with torch.optim.AdamW's semantics.

    Build it with `model.create_optimizer(...)`, or directly with the model's parameters (or
    param groups of them, e.g. HF's decay / no-decay split).

    Args:
        params: parameters of the slid model, or param-group dicts.
        engine: the model's SlideEngine (`model.slide_engine`).
        lr, betas, eps, maximize: as torch.optim.AdamW.
        weight_decay: decoupled weight decay, as torch.optim.AdamW's; the default is 0.0, the HF
            Trainer's and `model.create_optimizer`'s (torch's own default is 0.01: pass it for that).
    """

    def __init__(self, params: Iterable, engine, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False, **unused):
        if amsgrad:
            raise ValueError("SlideOptimizer does not support amsgrad=True")
        for name in unused:
            if unused[name] not in (None, False):
                raise ValueError(f"SlideOptimizer got an unsupported option {name}={unused[name]!r}")
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self.engine = engine
        engine.lora.adopt_all()              # LoRA adapters a PEFT model added (lora.py)
        owned = {id(p) for p in engine.store.params()} | {id(p) for p in engine.lora.params}
        for group in self.param_groups:
            for param in group["params"]:
                # A frozen parameter outside the store (the original beside a PEFT modules_to_save
                # copy, modules_to_save.py) is in `model.parameters()` but never updated.
                if id(param) not in owned and param.requires_grad:
                    raise ValueError(
                        "SlideOptimizer got a parameter that is not a master weight of the slid model "
                        f"(shape {tuple(param.shape)}). Build the optimizer after slide()/from_pretrained, from "
                        "model.parameters(), e.g. with model.create_optimizer()."
                    )
        store = engine.store
        store.allocate_optimizer_state()
        for unit in store.units:
            for index, entry in enumerate(unit.entries):
                # a layer on disk has no moments in memory: state_dict() reads them (`_disk_moments`)
                # the arrays the unit's format declares (host_optim.py), views of the host store
                self.state[entry.param] = {"step": unit.steps[index]} if store.on_disk(unit) else {
                    "step": unit.steps[index], **unit.state_format.entry_state(unit, index)}
        engine.lora.allocate(self.state)
        engine.attach_optimizer(self)

    def snapshot(self) -> tuple[list[dict], dict[int, int]]:
        """The current hyper-parameters per group and the parameter -> group map of the parameters
        that train now: an update queued with it updates those, whenever the worker runs it (a
        parameter frozen after `step()` returned keeps that step's update, as in torch)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"] if p.requires_grad}
        return groups, group_of

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the optimizer step: the updates inside backward already run; deferred ones
        (accumulation, clipping) are scheduled now and overlap the next forward."""
        if closure is not None:
            raise ValueError("SlideOptimizer.step does not take a closure")
        self.engine.optimizer_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients accumulated since the last step (a no-op right after step())."""
        self.engine.zero_grad()

    @property
    def last_grad_norm(self) -> float:
        """Global L2 norm of the gradients of the last optimizer step (before clipping)."""
        return self.engine.last_grad_norm()

    def state_dict(self) -> dict:
        """torch.optim's state dict, once every queued update has run and resident units' moments
        are back in the host store (which the state's tensors view)."""
        self.engine.synchronize()
        out = super().state_dict()
        self._disk_moments(out["state"])
        return out

    def _indexed_units(self):
        """(unit, [(entry index, entry, the state dict's index of its parameter)]) of the layers on disk."""
        index, start = {}, 0
        for group in self.param_groups:              # torch.optim's numbering of the parameters
            for number, param in enumerate(group["params"], start):
                index.setdefault(id(param), number)
            start += len(group["params"])
        store = self.engine.store
        for unit in store.units:
            if store.on_disk(unit):
                yield unit, [(k, e, index[id(e.param)]) for k, e in enumerate(unit.entries) if id(e.param) in index]

    def _disk_moments(self, state: dict) -> None:
        """Fill in the moments of the layers on disk (the arrays of their format), read one unit at
        a time (copies)."""
        for unit, entries in self._indexed_units():
            with self.engine.store.unit_state(unit):
                for index, _, number in entries:
                    if number in state:
                        arrays = unit.state_format.entry_state(unit, index)
                        state[number] = {**state[number], **{n: t.clone() for n, t in arrays.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load hyper-parameters and moments in place (the moments are views of the host store)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        self.engine.synchronize()
        saved = state_dict["state"]
        on_disk = {}                                # id(param) -> (unit, entry) of the layers on disk
        for unit, entries in self._indexed_units():
            on_disk.update({id(e.param): (unit, k) for k, e, _ in entries})
        disk_moments: dict[int, list] = {}
        fmt_of = {id(e.param): u.state_format for u in self.engine.store.units for e in u.entries}
        for sg, group in zip(groups, self.param_groups):
            if len(sg["params"]) != len(group["params"]):
                raise ValueError("optimizer state does not match this model's parameter groups")
            for key, value in sg.items():
                if key != "params":
                    group[key] = tuple(value) if key == "betas" else value
            for idx, param in zip(sg["params"], group["params"]):
                saved_state = saved.get(idx)
                if saved_state is None:
                    continue
                st = self.state[param]
                if id(param) in on_disk:            # written to disk below, one unit at a time
                    disk_moments.setdefault(id(on_disk[id(param)][0]), []).append(
                        (*on_disk[id(param)], param, saved_state))
                else:
                    _copy_entry_state(st, saved_state, param, fmt_of[id(param)])
                st["step"].copy_(torch.as_tensor(saved_state["step"], dtype=torch.float32))
        for items in disk_moments.values():
            unit = items[0][0]
            with self.engine.store.unit_state(unit, write=True):
                for _, index, param, saved_state in items:     # checked as a host unit's, before its copy
                    _copy_entry_state(unit.state_format.entry_state(unit, index), saved_state, param,
                                      unit.state_format)
        self.engine.note_restored(optimizer=True)


def _copy_entry_state(st: dict, saved: dict, param, fmt) -> None:
    """Copy one parameter's saved optimizer state into its views `st`, checked against the format."""
    names = [a.name for a in fmt.arrays]
    missing = [n for n in names if n not in saved]
    extra = [n for n in saved if n not in names and n != "step"]
    bad_dtype = [n for n in names if n in saved and saved[n].dtype != st[n].dtype]
    if missing or extra or bad_dtype:
        theirs = formats_holding({k: v.dtype for k, v in saved.items() if torch.is_tensor(v) and k != "step"})
        raise StateFormatMismatchError(
            f"the optimizer state is of format {' or '.join(map(repr, theirs)) or 'unknown'}; this model's "
            f"optimizer_state is {fmt.name!r} with {names}: load it into a model slid with the same "
            "SlideConfig.optimizer_state")
    for name in names:
        if saved[name].shape != st[name].shape:
            raise ValueError(f"optimizer state {name} for a parameter of shape {tuple(param.shape)} has shape "
                             f"{tuple(saved[name].shape)}, expected {tuple(st[name].shape)}")
        fmt.check(name, saved[name], f"optimizer state of a parameter of shape {tuple(param.shape)}")
    for name in names:
        st[name].copy_(saved[name])
