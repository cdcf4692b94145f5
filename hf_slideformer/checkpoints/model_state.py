"""What a slid model does with its state: it is the host store's, so reads and saves wait for the
queued updates, loads write into the masters in place, and device or dtype moves are no-ops or
refused (`SlideModelState`, a base of `model.SlideModel`).
"""
from __future__ import annotations

import torch

__all__ = ["SlideModelState"]


class SlideModelState:
    """The state methods of every slid model (mixed in through `SlideModel`; `self.slide_engine`
    is the model's engine)."""

    def slide_synchronize(self) -> None:
        """Wait for every queued update and copy: the parameters are then the current masters.

        The updates of an optimizer step overlap the next forward, so a parameter read directly
        right after `optimizer.step()` (`model.parameters()`, a view kept from earlier) may be
        older than the step. `state_dict()`, `save_pretrained()` and the optimizer's
        `state_dict()` wait by themselves; call this before reading parameters any other way.
        """
        self.slide_engine.synchronize()

    def state_dict(self, *args, **kwargs):
        """The current weights under HF names: the fp32 masters, once every queued update has run."""
        self.slide_engine.synchronize()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load weights under HF names into the fp32 masters (in place: they stay the engine's).

        Every queued update runs first and the resident units go back to the host store, so the
        loaded values are what the next step trains from.
        """
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the slid model's master weights; "
                             "load in place (assign=False)")
        self.slide_engine.synchronize()
        out = super().load_state_dict(state_dict, strict=strict)
        for unit in self.slide_engine.store.units:
            unit.version += 1                        # device copies of the old weights are stale
        self.slide_engine.note_restored(weights=True)
        return out

    def save_pretrained(self, save_directory, max_shard_size: str | int = "5GB", dtype: torch.dtype | None = None,
                        **kwargs):
        """Write sharded safetensors + config that `AutoModelForCausalLM.from_pretrained` loads.

        Weights are written layer by layer from the masters in `dtype` (default: float32, the
        masters themselves, as HF saves a model trained in mixed precision). Over an earlier
        save, a save killed at any step leaves the directory loading as the old save or the new
        one (see `checkpoint.save_model`); other files in the directory are kept. With several
        ranks, every rank may call it and rank 0 writes.
        """
        from .checkpoint import save_model

        self.slide_engine.synchronize()
        dp = self.slide_engine.dp
        if dp is not None and not dp.writes:
            return                  # several ranks share one state (data_parallel.py): rank 0 writes it
        save_model(self, save_directory, max_shard_size=max_shard_size, dtype=dtype or torch.float32)

    def to(self, *args, **kwargs):
        """Device moves are ignored (the engine places the weights); dtype changes are refused."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != torch.float32:
            raise ValueError("a slid model keeps fp32 masters on the host; choose the compute dtype with SlideConfig.dtype")
        return self

    def cuda(self, *args, **kwargs):
        return self

    def cpu(self):
        return self

    def half(self):
        raise ValueError("a slid model keeps fp32 masters; choose the compute dtype with SlideConfig.dtype")

    bfloat16 = half

    def float(self):
        return self
