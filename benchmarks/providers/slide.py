"""`slide`: hf_slideformer through its public API, under the consumer-card GPU memory cap.

The random-init model is built on the meta device and slid in place with `hs.slide`; its weights
are then written into the engine's masters one unit at a time, as `SlideModel.from_pretrained`
reads a checkpoint: the same values `build_model`'s "tiled" fill gives (rounded to the benchmark
dtype), and the host never holds a second copy of the model (a 24B model's bf16 copy alone is
44 GiB). It is trained exactly as a user would: `model(...).loss`, `loss.backward()`, `opt.step()`,
`opt.zero_grad()`. SlideConfig fields the engine does not have (yet) are dropped and noted,
so a renamed field costs a note in the row, not the run. The engine's own step breakdown comes
from `model.slide_stats()` when that method exists: its counters' change over the timed
steps, per step.

With several processes (`bench_train.py --nproc N`: the launcher's environment in each), `hs.slide`
finds the group itself (NCCL on CUDA, gloo on the CPU), a bare "cuda" device becomes the rank's
GPU (LOCAL_RANK), and the ranks share one copy of the host state (docs/multi_gpu.md); each rank
trains on its own batch. The report says the engine's rank and world (`data_parallel`).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from .base import Provider, call_with_known_fields, empty_model, fill_tensor, tiled_block

__all__ = ["SlideProvider", "Slide8bitProvider", "Slide8bitBf16Provider", "SlideFp8Provider"]


class SlideProvider(Provider):
    name = "slide"
    capped = True
    multi_process = True
    optimizer_state: str | None = None     # SlideConfig.optimizer_state of the row (None: the default)
    matmuls: str | None = None             # SlideConfig.matmuls of the row (None: the default)

    def setup(self) -> None:
        import hf_slideformer as hs

        options = {"device": self.spec.device, "dtype": self.spec.torch_dtype}
        if self.spec.cap_gib is not None and self.device.type == "cuda":
            options["gpu_memory_limit"] = self.spec.cap_gib
        if self.optimizer_state is not None:
            options["optimizer_state"] = self.optimizer_state
        if self.matmuls is not None:
            options["matmuls"] = self.matmuls
        options.update(self.spec.slide_options)
        self.slide_config = call_with_known_fields(hs.SlideConfig, options, self.notes)
        self.model = self.build_slid()
        self.optimizer = self.model.create_optimizer(lr=self.spec.lr)
        dp = self._dp()
        if dp is not None:
            self.notes.append(f"data parallel: rank {dp.rank} of {dp.world} processes, batch {self.spec.batches[0]} "
                              "each")
        elif self.spec.nproc > 1:
            raise RuntimeError(f"--nproc {self.spec.nproc}, but the engine saw one process (no data parallelism): "
                               "this hf_slideformer does not read the launcher's environment")

    def build_slid(self):
        """The slid model: built on the meta device, slid in place, its masters filled unit by unit
        (rank 0 writes them where the ranks share them, as `from_pretrained` does)."""
        import hf_slideformer as hs

        model = empty_model(self.config, self.spec.torch_dtype)
        model.tie_weights()
        model.train()
        self.count(model)
        hs.slide(model, self.slide_config, _fill=False)
        store, dp = model.slide_engine.store, model.slide_engine.dp
        if dp is None or dp.writes:
            block = tiled_block(self.spec.torch_dtype, self.spec.seed)
            with torch.no_grad():
                for unit in store.units:
                    with store.unit_state(unit, write=True):
                        for entry in unit.entries:
                            fill_tensor(entry.view(unit.master), entry.name, "tiled", None, block)
        if dp is not None:
            dp.barrier()
        return model

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # With gradient_accumulation_steps in --slide-config, one step is that many micro-batches.
        for _ in range(self.slide_config.gradient_accumulation_steps):
            loss = self.model(input_ids=input_ids, labels=labels).loss
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def _dp(self):
        """The engine's DataParallel (rank, world), None for one process."""
        return getattr(getattr(self.model, "slide_engine", None), "dp", None)

    def _writes_trace(self) -> bool:
        dp = self._dp()
        return bool(os.environ.get("SLIDE_TRACE")) and (dp is None or dp.rank == 0)   # one file: rank 0's

    def _stats(self) -> dict[str, Any] | None:
        stats = getattr(self.model, "slide_stats", None)
        return dict(stats()) if callable(stats) else None

    def begin_timed(self) -> None:
        try:
            self._stats_start = self._stats()
        except Exception:
            self._stats_start = None
        engine = getattr(self.model, "slide_engine", None)
        if self._writes_trace() and engine is not None:
            engine.stats.start_trace()

    def after_oom(self, batch: int) -> bool:
        self.optimizer.zero_grad()
        return False

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"slide_config": {k: str(v) for k, v in vars(self.slide_config).items()},
                               "micro_batches": self.slide_config.gradient_accumulation_steps}
        dp = self._dp()
        out["data_parallel"] = {"rank": dp.rank, "world": dp.world} if dp is not None else None
        try:
            stats = self._stats()
        except Exception as exc:  # the stats are a report, never a reason to lose the row
            out["slide_stats_error"] = f"{type(exc).__name__}: {exc}"
            return out
        if stats is None:
            self.notes.append("model.slide_stats() not available: no step breakdown")
            return out
        out["slide_stats"] = stats
        engine = getattr(self.model, "slide_engine", None)
        path = os.environ.get("SLIDE_TRACE") if self._writes_trace() else None
        if path and engine is not None and engine.stats.trace is not None:
            events = engine.stats.stop_trace()
            t0 = events[0][2] if events else 0.0
            with open(path, "w") as f:
                json.dump([[th, label, round(a - t0, 6), round(b - t0, 6)] for th, label, a, b in events], f)
            out["trace"] = path
        start = getattr(self, "_stats_start", None) or {}
        # Counters are cumulative: their change over the timed steps, per step, is the breakdown.
        out["slide_stats_per_step"] = {
            k: (v - start[k]) / self.spec.steps if isinstance(v, (int, float)) and isinstance(start.get(k), (int, float))
            else v for k, v in stats.items()}
        return out


class Slide8bitProvider(SlideProvider):
    """`slide` with 8-bit block-wise AdamW moments (docs/host_state.md)."""

    name = "slide_8bit"
    multi_process = False
    optimizer_state = "adamw_8bit"


class Slide8bitBf16Provider(SlideProvider):
    """`slide` with 8-bit moments and a bf16 master (docs/host_state.md)."""

    name = "slide_8bit_bf16"
    multi_process = False
    optimizer_state = "adamw_8bit_bf16"


class SlideFp8Provider(SlideProvider):
    """`slide` with the decoder layers' projections in FP8 (docs/fp8.md)."""

    name = "slide_fp8"
    matmuls = "fp8"
