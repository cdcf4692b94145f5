"""`ds2` and `ds3`: DeepSpeed ZeRO-Offload baselines, in-process, under the GPU memory cap.

- `ds2`: ZeRO-2 with the optimizer offloaded (`offload_optimizer: cpu`, pinned): bf16
  parameters and gradients on the GPU, fp32 masters and DeepSpeed's CPU Adam on the host.
- `ds3`: ZeRO-3 with parameters offloaded too (`offload_param: cpu`, pinned), ZeRO-Infinity
  style; the model is built under `deepspeed.zero.Init` through transformers' own ZeRO-3 path
  (an `HfDeepSpeedConfig` alive while `from_config` runs), so it never exists whole anywhere.

Both run as DeepSpeed's users run them (docs/benchmarks.md, "Providers"): Hugging Face's gradient checkpointing,
non-reentrant (on unless `--checkpointing off`; `auto` counts as on, since DeepSpeed's engine
cannot change it after an OOM), and the fused kernels of `recipe.apply_kernels` (Liger, else
triton_ops), applied to the model before `deepspeed.initialize`. The fused loss reads
`lm_head.weight` outside `lm_head`'s own forward, where ZeRO-3 would hand it over partitioned,
so `ds3` registers it as an external parameter of the causal LM (`register_external_parameter`),
which gathers it for the whole forward. The batch to measure is found by `--search-batches`:
one process per batch, upward until out of memory.

No launcher: the parent process exports RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR
MASTER_PORT DS_SKIP_CUDA_CHECK=1 and DeepSpeed opens a one-rank NCCL group; with
`bench_train.py --nproc N` it starts N processes with RANK=r WORLD_SIZE=N LOCAL_RANK=r
LOCAL_WORLD_SIZE=N, as a launcher would, and each rank takes the GPU of its LOCAL_RANK, trains
`train_micro_batch_size_per_gpu` sequences of its own per step, and holds 1/N of the partitioned
state (ZeRO's data parallelism over the N GPUs, gradients reduced over NCCL). Bucket sizes,
prefetch and persistence thresholds are DeepSpeed's defaults; no gradient clipping (the other
providers clip none either). DeepSpeed's CPU Adam JIT-builds on first use (about a minute,
cached under ~/.cache/torch_extensions for the next process).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .base import Provider, attention_of, build_model
from .recipe import apply_kernels, enable_checkpointing

__all__ = ["ZeRO2Provider", "ZeRO3Provider", "ds_config"]


def ds_config(stage: int, micro_batch: int, lr: float) -> dict[str, Any]:
    """The DeepSpeed config of the benchmark (docs/benchmarks.md, "Providers")."""
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class _ZeROProvider(Provider):
    capped = True
    multi_process = True
    stage = 0
    default_checkpointing = "on"
    default_kernels = "auto"

    def setup(self) -> None:
        import deepspeed

        if self.device.type != "cuda" and deepspeed.get_accelerator().device_name() != "cpu":
            raise RuntimeError("DeepSpeed ZeRO-Offload needs CUDA (or DeepSpeed's CPU accelerator: DS_ACCELERATOR=cpu)")
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        if self.device.type == "cuda":   # this rank's GPU (the launcher's LOCAL_RANK; 0 for one process)
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # The group from the environment the parent set: RANK, WORLD_SIZE (1, or --nproc), MASTER_*.
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        world = torch.distributed.get_world_size()
        if world != self.spec.nproc:
            raise RuntimeError(f"DeepSpeed's group has {world} ranks, --nproc asked for {self.spec.nproc}")
        if world > 1:
            self.notes.append(f"data parallel: rank {torch.distributed.get_rank()} of {world} processes, batch "
                              f"{self.spec.batches[0]} each")
        self.ds_config = ds_config(self.stage, self.spec.batches[0], self.spec.lr)
        model = self.build()
        self.count(model)
        self.prepare(model)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=self.ds_config)
        self.notes.append(f"optimizer {type(self.engine.optimizer).__name__}")

    def build(self) -> torch.nn.Module:
        raise NotImplementedError

    def prepare(self, model: torch.nn.Module) -> None:
        """Gradient checkpointing and fused kernels, as a DeepSpeed user's Trainer sets them."""
        self.checkpointing = self.spec.checkpointing != "off"
        if self.checkpointing:
            enable_checkpointing(model)
        self.kernels = apply_kernels(model, self.spec.kernels)
        self.notes.append(f"kernels: {self.kernels}")
        if self.spec.kernels != "none":
            self.fused_loss_reads_head(model)

    def fused_loss_reads_head(self, model: torch.nn.Module) -> None:
        """Hook for ZeRO-3: the fused loss reads `lm_head.weight` outside `lm_head.forward`."""

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.engine(input_ids=input_ids, labels=labels).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def after_oom(self, batch: int) -> bool:
        # Best effort: a backward cut short leaves gradient buckets half reduced. If the state is
        # beyond repair the next attempt fails with another error, and the parent starts a fresh
        # process for the remaining batches.
        epilogue = getattr(self.engine.optimizer, "independent_gradient_partition_epilogue", None)
        if self.stage == 2 and callable(epilogue):
            try:
                epilogue()
            except Exception:
                pass
        self.engine.zero_grad()
        return False

    def report(self) -> dict[str, Any]:
        return {"deepspeed_config": self.ds_config, "gradient_checkpointing": self.checkpointing,
                "kernels": self.kernels, "data_parallel": {"rank": torch.distributed.get_rank(),
                                                           "world": torch.distributed.get_world_size()}}


class ZeRO2Provider(_ZeROProvider):
    name = "ds2"
    stage = 2

    def build(self) -> torch.nn.Module:
        return build_model(self.config, self.device, torch.bfloat16, fill="normal", seed=self.spec.seed)


class ZeRO3Provider(_ZeROProvider):
    name = "ds3"
    stage = 3

    def build(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)  # transformers' ZeRO-3 switch, on while referenced
        model = AutoModelForCausalLM.from_config(self.config, dtype=torch.bfloat16, attn_implementation=attention_of(self.config))
        model.train()
        return model

    def fused_loss_reads_head(self, model: torch.nn.Module) -> None:
        import deepspeed

        deepspeed.zero.register_external_parameter(model, model.lm_head.weight)
