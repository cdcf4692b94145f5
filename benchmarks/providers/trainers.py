"""`slide_trainer` and `slide_sft`: a slid model driven by a Trainer's own step, as Trainer users run it.

`slide_trainer` is `SlideTrainer(model, SlideArgs(...))`; `slide_sft` is TRL's `SFTTrainer(model,
SFTConfig(...))` with the only change TRL users make: the model is slid. Each timed step is the
trainer's `training_step` (its `compute_loss`, its backward through Accelerate), then the trainer's
optimizer step: for TRL that is the fused-LM-head forward (per-token log-probabilities, entropy and
token accuracy) and its loss reduction, so the row measures what TRL costs on top of the engine's
own loss. Both rows share the slide provider's model, GPU cap and `--slide-config` options.
"""
from __future__ import annotations

import tempfile
from typing import Any

import torch

from .slide import SlideProvider

__all__ = ["SlideTrainerProvider", "SlideSFTProvider"]


def _tokenizer(pad_id: int):
    """A stand-in tokenizer: the data arrive tokenized, the trainer only needs the pad id."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(max(pad_id + 1, 2))}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<t0>")),
                                  pad_token=f"<t{pad_id}>", unk_token="<t0>", eos_token=f"<t{pad_id}>")
    return tok


class _TrainerProvider(SlideProvider):
    """The slide provider, its step taken by a Trainer built over the slid model."""

    def setup(self) -> None:
        self.slide_config_options()
        self.model = self.build_slid()
        self._dir = tempfile.TemporaryDirectory(prefix="bench-trainer-")
        self.trainer = self.build_trainer(self.common_args())
        self.trainer.create_optimizer()
        self.trainer.current_gradient_accumulation_steps = 1   # what Trainer's loop sets before its first step
        self.model.train()
        self.optimizer = self.trainer.optimizer
        self.notes.append(f"trainer: {type(self.trainer).__name__}, arguments {type(self.trainer.args).__name__}")

    def slide_config_options(self) -> None:
        import hf_slideformer as hs

        from .base import call_with_known_fields

        options = {"device": self.spec.device, "dtype": self.spec.torch_dtype}
        if self.spec.cap_gib is not None and self.device.type == "cuda":
            options["gpu_memory_limit"] = self.spec.cap_gib
        options.update(self.spec.slide_options)
        self.slide_config = call_with_known_fields(hs.SlideConfig, options, self.notes)

    def common_args(self) -> dict[str, Any]:
        bf16 = self.spec.torch_dtype == torch.bfloat16
        return dict(output_dir=self._dir.name, per_device_train_batch_size=self.spec.batches[0], learning_rate=self.spec.lr,
                    weight_decay=0.0, max_grad_norm=self.slide_config.max_grad_norm or 0.0, report_to=[], save_strategy="no", disable_tqdm=True,
                    bf16=bf16, use_cpu=self.device.type != "cuda", logging_steps=10 ** 9, seed=self.spec.seed,
                    gradient_accumulation_steps=1)

    def build_trainer(self, args: dict[str, Any]):
        raise NotImplementedError

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)}
        loss = self.trainer.training_step(self.model, inputs)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def report(self) -> dict[str, Any]:
        out = super().report()
        out["trainer"] = type(self.trainer).__name__
        return out


class SlideTrainerProvider(_TrainerProvider):
    name = "slide_trainer"

    def build_trainer(self, args: dict[str, Any]):
        import hf_slideformer as hs

        # The model is slid already (with the provider's SlideConfig); the arguments carry the Trainer's side.
        return hs.SlideTrainer(model=self.model, args=hs.SlideArgs(**args))


class SlideSFTProvider(_TrainerProvider):
    name = "slide_sft"

    def build_trainer(self, args: dict[str, Any]):
        import datasets
        from trl import SFTConfig, SFTTrainer

        pad = self.config.pad_token_id if getattr(self.config, "pad_token_id", None) is not None else 0
        seq = self.spec.seq
        data = datasets.Dataset.from_dict({"input_ids": [[1] * seq for _ in range(self.spec.batches[0])]})
        return SFTTrainer(model=self.model, args=SFTConfig(**args, max_length=seq),
                          train_dataset=data, processing_class=_tokenizer(pad))
