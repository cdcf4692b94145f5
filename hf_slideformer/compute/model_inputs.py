"""The slid forward's input checks: token ids and labels must be integer tensors, and labels must
name a row of the vocabulary or be -100 (ignored), on every device, as HF's cross-entropy requires.

On the CPU a label out of range raises at once. On CUDA the check costs no synchronization on the
hot path (`LabelCheck`, see its Note): a bad batch makes the step's loss and every gradient NaN,
so the non-finite policy leaves every weight as it was, and the error naming the labels is raised
at the next point where the host waits for the device anyway (`optimizer.step()`), or at the next
forward once the device has got there.
"""
from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "check_token_ids", "check_label_dtype", "LabelCheck", "LabelError"]

IGNORE_INDEX = -100


class LabelError(ValueError):
    """A label is neither a token id of the vocabulary nor -100."""


def _is_integer(value) -> bool:
    return torch.is_tensor(value) and not (value.dtype.is_floating_point or value.dtype.is_complex
                                           or value.dtype == torch.bool)


def check_token_ids(input_ids) -> None:
    """Raise TypeError unless `input_ids` is an integer tensor (a float would be truncated)."""
    if not _is_integer(input_ids):
        raise TypeError(f"input_ids must be an integer tensor of token ids (torch.long), got "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}; a float would be truncated")


def check_label_dtype(labels, name: str = "labels") -> None:
    """Raise TypeError unless `labels` is None or an integer tensor: float or bool labels would be
    cast to token ids silently (a fractional label would give the integer label's loss)."""
    if labels is not None and not _is_integer(labels):
        raise TypeError(f"{name} must be an integer tensor of token ids or -100 (torch.long), got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}: HF's cross-entropy refuses it too")


def _message(bad: torch.Tensor, vocab: int, where: str) -> str:
    return (f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored); {where} held "
            f"{sorted(set(bad[:8].tolist()))}{' and more' if bad.numel() > 8 else ''}. Fix the data or the "
            "collator (padding must be -100).")


class LabelCheck:
    """Checks the shifted labels of each head forward against the vocabulary.

    Note: [Why a bad label on CUDA poisons the step instead of raising] reading a device flag in
    the forward would make the host wait for the device once per micro-batch, and the queue of
    work ahead of it would drain. So the flag stays on the device: the loss is multiplied by a
    device scalar that is 1 for a good batch and NaN for a bad one (every gradient of the head, and
    through it of every layer, is then NaN, and the non-finite policy skips the whole update), and
    the kernels see the bad labels as -100 (no out-of-bounds read). The flag is copied to pinned
    memory behind an event; `raise_pending` reads it where the host waits anyway.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, object, int]] = []    # (flag, values, event, vocab)

    def prepare(self, sl: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(labels the kernels may read, a loss factor or None) for flat shifted labels `sl` (long)."""
        if sl.numel() == 0:
            return sl, None
        bad = (sl >= vocab) | ((sl < 0) & (sl != IGNORE_INDEX))
        if sl.device.type != "cuda":
            if bool(bad.any()):
                raise LabelError(_message(sl[bad], vocab, "this batch"))
            return sl, None
        flag = bad.any()
        host_flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        host_flag.copy_(flag, non_blocking=True)
        # The first bad value (or 0) for the message: one more scalar, no synchronization.
        first = sl.index_select(0, bad.int().argmax().reshape(1)).reshape(())    # not sl[t]: that reads t
        host_first = torch.empty((), dtype=sl.dtype, pin_memory=True)
        host_first.copy_(first, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._pending.append((host_flag, host_first, ev, vocab))
        factor = torch.where(flag, torch.full((), float("nan"), device=sl.device), torch.ones((), device=sl.device))
        return torch.where(bad, torch.full_like(sl, IGNORE_INDEX), sl), factor

    def raise_pending(self, wait: bool = False) -> None:
        """Raise `LabelError` for a bad batch whose flag has arrived (all of them with `wait`)."""
        keep = []
        for item in self._pending:
            flag, first, ev, vocab = item
            if not wait and not ev.query():
                keep.append(item)
                continue
            ev.synchronize()
            if bool(flag):
                self._pending = []
                raise LabelError(_message(first.reshape(1), vocab, "a batch of this step") +
                                 " That step's update was skipped (its loss and gradients were made NaN).")
        self._pending = keep
