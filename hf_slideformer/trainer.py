"""SlideTrainer: the Hugging Face Trainer on a sliding model.

The Trainer's loop runs unchanged; the model and optimizer underneath change. `SlideTrainer`
slides the model (or takes a slid one), builds a `SlideOptimizer` with HF's decay / no-decay
groups, hands `gradient_accumulation_steps` and `max_grad_norm` to the engine (which clips at
`optimizer.step()`, so the Trainer's own clip path is switched off), logs the engine's grad norm,
tokens/s and step breakdown, and writes exact, atomic checkpoints (`train_checkpoint.py`).

A plain `transformers.Trainer(model=..., args=SlideArgs(...))` slides too: one hook on
`Trainer.__init__` (trainer_hook.py) turns a Trainer given `SlideArgs` into its sliding subclass before anything
else runs. It is installed by one explicit, idempotent call, `install_trainer_hook()`, which
`hf_slideformer` makes when `hs.SlideArgs` or `hs.SlideTrainer` is first loaded from it;
constructing `SlideArgs` has no side effect.
"""
from __future__ import annotations

from collections.abc import Mapping
import logging
import math
import os
import time

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

try:  # transformers >= 5.2x; older versions rotate through a Trainer method
    from transformers.trainer_utils import rotate_checkpoints
except ImportError:  # pragma: no cover - version dependent
    rotate_checkpoints = None

from .accelerate_plugin import wrap_optimizer
from .checkpoints.atomic_save import final_paths_in_logs, recover_directories
from .checkpoints.checkpoint import CheckpointError
from .engine.slide_engine import SlideStateError
from .engine.lora import peft_base
from .model import is_slid, slide
from .host.optim import SlideOptimizer
from .checkpoints.train_checkpoint import (STATE_DIR, atomic_directory, load_training_state, recover_checkpoint,
                               save_training_state, verify_training_state, write_plain_resume_refusal)
from .trainer_hook import install
from .training_args import SlideArgs, SlideArgsError

logger = logging.getLogger(__name__)

__all__ = ["SlideTrainer", "install_trainer_hook", "sync_step_settings"]

SCHEDULER_NAME = "scheduler.pt"
_STATS = (("cpu_adam_s", "slide/cpu_adam_s", 1.0), ("backward_s", "slide/backward_s", 1.0),
          ("worker_busy_s", "slide/worker_busy_s", 1.0), ("h2d_bytes", "slide/h2d_GB", 1e-9),
          ("d2h_bytes", "slide/d2h_GB", 1e-9), ("activation_bytes", "slide/activation_GB", 1e-9))


def sync_step_settings(model, gradient_accumulation_steps: int, max_grad_norm: float | None) -> None:
    """Make a slid model's engine accumulate and clip as the Trainer says.

    Raises:
        SlideStateError: when the optimizer state was allocated without the gradient
            accumulators that accumulation or clipping needs (re-slide the model).
    """
    model.slide_engine.configure_steps(gradient_accumulation_steps, max_grad_norm)


class SlideTrainer(Trainer):
    """`transformers.Trainer` for a sliding model; same arguments as `Trainer`.

    `args` should be `SlideArgs` (plain `TrainingArguments` are upgraded with the default slide
    settings). `model` is an HF causal LM on the CPU (slid here, in place) or an already slid
    model. `optimizers` may carry a `SlideOptimizer` and any LR scheduler.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *positional, **kw):
        from .trl_support import upgrade_args

        if args is None:
            args = SlideArgs(output_dir="trainer_output")
        elif not isinstance(args, SlideArgs):
            args = upgrade_args(args)
        super().__init__(model, args, *positional, **kw)

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        # Trainer.__init__ calls this first, with self.model set: slide before placement or wrapping.
        if not isinstance(self.args, SlideArgs):
            raise SlideArgsError("a sliding Trainer needs SlideArgs")
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise SlideArgsError("DeepSpeed / FSDP is enabled together with sliding: they are alternatives")
        _prepare_without_ddp(self.accelerator)
        self._slide_tokens = 0
        self._slide_mark = None
        if self.model is not None:
            self.model = self._slide(self.model)

    def _slide(self, model):
        if is_slid(model):
            sync_step_settings(model, self.args.gradient_accumulation_steps, self.args.max_grad_norm)
            return model
        if not isinstance(model, PreTrainedModel) and peft_base(model) is None:
            raise SlideArgsError(f"SlideTrainer needs an HF causal LM (PreTrainedModel) or a PEFT LoRA model of one, "
                                 f"got {type(model).__name__}")
        logger.info("sliding %s with %s", type(model).__name__, self.args.to_slide_config())
        return slide(model, self.args.to_slide_config())

    def call_model_init(self, trial=None):
        return self._slide(super().call_model_init(trial))

    def _move_model_to_device(self, model, device) -> None:
        """The engine places the layers; nothing to move."""

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """A `SlideOptimizer` (AdamW on the CPU) with HF's decay / no-decay parameter groups."""
        opt_model = self.model if model is None else model
        if self.optimizer is not None:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            if not isinstance(inner, SlideOptimizer):
                raise SlideArgsError(f"optimizers=({type(inner).__name__}, ...) on a sliding model: pass a "
                                     "SlideOptimizer (model.create_optimizer(...)) or let the Trainer build one")
            if not getattr(self.optimizer, "_is_accelerate_prepared", False):
                self.optimizer = wrap_optimizer(inner)
            return self.optimizer
        args = self.args
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        optimizer = SlideOptimizer(groups, opt_model.slide_engine, lr=args.learning_rate,
                                   betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                   weight_decay=args.weight_decay)
        self.optimizer = wrap_optimizer(optimizer)
        return self.optimizer

    @property
    def slide_optimizer(self) -> SlideOptimizer | None:
        """The `SlideOptimizer` under Accelerate's wrapper (None before training starts)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    @property
    def label_names(self) -> list[str]:
        """The label keys of a batch (the slid forward's `shift_labels` is an alternative, not a must)."""
        return self._slide_label_names

    @label_names.setter
    def label_names(self, names) -> None:
        explicit = self.args.label_names is not None
        self._slide_label_names = list(names) if explicit else [n for n in names if n != "shift_labels"]

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not is_slid(self.model):
            raise SlideStateError("the Trainer's model is not slid; refusing to train it unslid")
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None   # a BatchEncoding too
        if ids is not None:
            self._slide_tokens += ids.numel()
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        # The engine clips at optimizer.step() with args.max_grad_norm; the norm is logged in log().
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the engine's pre-clip grad norm, tokens/s and per-step breakdown to training logs,
        and for a mixture of experts computing it, the mean `aux_loss` of the forwards since the
        last log (the load-balancing loss before its coefficient, as HF returns it).

        The grad norm is logged as it is, NaN or inf included (as the plain Trainer logs it), with a
        warning naming the step; the loss is the Trainer's (its `logging_nan_inf_filter`, on by
        default, replaces a non-finite step loss by the window's mean: set it False to see it).
        """
        if "loss" in logs and self.slide_optimizer is not None and is_slid(self.model):
            norm = self.slide_optimizer.last_grad_norm      # waits for the queued updates: logging steps only
            logs["grad_norm"] = norm
            if not math.isfinite(norm):
                # The engine never lets a non-finite gradient into a master (it skips the updates):
                # only weights that were never checked can hold non-finite values.
                cfg = self.model.slide_engine.config
                why = ("the model's weights were not checked when it was slid (check_finite_weights=False) and may "
                       "hold non-finite values" if not cfg.check_finite_weights else
                       "the engine skipped the step's updates, so no weight took a non-finite value")
                logger.warning("step %d: the gradient norm is %s (loss %s): %s", self.state.global_step, norm,
                               logs["loss"], why)
            now, stats = time.perf_counter(), self.model.slide_stats()
            if self._slide_mark is not None:
                t0, tok0, s0 = self._slide_mark
                steps = max(stats["steps"] - s0["steps"], 1)
                logs["tokens_per_s"] = (self._slide_tokens - tok0) / max(now - t0, 1e-9)
                for key, name, scale in _STATS:
                    logs[name] = (stats[key] - s0[key]) * scale / steps
            self._slide_mark = (now, self._slide_tokens, stats)
            router_aux = self.model.slide_engine.router_aux
            aux = router_aux.logged() if router_aux is not None else None
            if aux is not None:             # a mixture of experts: the mean aux loss since the last log, HF's name
                logs.setdefault("aux_loss", aux)
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True and os.path.isdir(self.args.output_dir):
            # a save killed mid-swap may hide the newest checkpoint-N from HF's search: finish it first
            recover_directories(self.args.output_dir)
        self._slide_mark = (time.perf_counter(), self._slide_tokens, self.model.slide_stats()) \
            if self.model is not None and is_slid(self.model) else None
        if self.model is not None and is_slid(self.model):
            # The arguments may have changed since the last train() (accumulation, clipping).
            sync_step_settings(self.model, self.args.gradient_accumulation_steps, self.args.max_grad_norm)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """As Trainer's; logits (for compute_metrics) come from a second, label-free sliding forward,
        since the loss path never materializes them."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if prediction_loss_only or not (isinstance(logits, tuple) and len(logits) == 0):
            return loss, logits, labels
        free = {k: v for k, v in self._prepare_inputs(inputs).items() if k not in self.label_names}
        with torch.no_grad():
            logits = model(**free).logits
        return loss, logits, labels

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        """Save model export + exact training state + scheduler, RNG and trainer state, atomically.

        The checkpoint is written beside `checkpoint-N` and swapped in by renames (`atomic_directory`);
        logs name the final path. Hidden leftovers of killed saves in the run directory are resolved
        first (to the old or the new checkpoint).
        """
        if self.hp_search_backend is None and trial is None:
            self.store_flos()                         # with several ranks, a collective: every rank
        dp = self.model.slide_engine.dp if is_slid(self.model) else None
        rng_files = self._rank_rng_states(dp) if dp is not None and not self.args.save_only_model else None
        if dp is not None and not dp.writes:
            return                                    # the ranks share one state: rank 0 writes the checkpoint
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with atomic_directory(output_dir) as tmp, final_paths_in_logs(tmp, os.path.abspath(output_dir)):
            self.save_model(tmp, _internal_call=True)
            if self.state.best_global_step:
                best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
                if os.path.exists(best) or self.state.best_global_step == self.state.global_step:
                    self.state.best_model_checkpoint = best
            if not self.args.save_only_model:
                save_training_state(tmp, self.model, self.optimizer)
                write_plain_resume_refusal(tmp)
                if self.lr_scheduler is not None:
                    torch.save(self.lr_scheduler.state_dict(), os.path.join(tmp, SCHEDULER_NAME))
                if rng_files is None:
                    self._save_rng_state(tmp)
                for name, data in rng_files or ():
                    with open(os.path.join(tmp, name), "wb") as handle:
                        handle.write(data)
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
            self.state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if rotate_checkpoints is not None:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        else:  # pragma: no cover - version dependent
            self._rotate_checkpoints(use_mtime=True, output_dir=run_dir)

    def _rank_rng_states(self, dp) -> list[tuple[str, bytes]] | None:
        """Every rank's RNG state file (the Trainer's `rng_state_<rank>.pth`), gathered to rank 0,
        which writes them into its checkpoint (None on the other ranks)."""
        import tempfile

        import torch.distributed as dist
        with tempfile.TemporaryDirectory() as rng_dir:
            self._save_rng_state(rng_dir)
            mine = [(n, open(os.path.join(rng_dir, n), "rb").read()) for n in sorted(os.listdir(rng_dir))]
        got = [None] * dp.world if dp.writes else None
        dist.gather_object(mine, got, dst=0, group=dp.host_group)
        return [f for files in got for f in files] if dp.writes else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Finish an interrupted swap of it, verify it, and restore the fp32 masters from `slide_state/`."""
        model = model if model is not None else self.model
        dp = model.slide_engine.dp
        if dp is None or dp.writes:
            recover_checkpoint(resume_from_checkpoint)
        if dp is not None:
            dp.barrier()                              # rank 0 has finished an interrupted swap, if any
        _check_files(resume_from_checkpoint)
        verify_training_state(resume_from_checkpoint, model)
        load_training_state(resume_from_checkpoint, model, weights=True)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_training_state(checkpoint, self.model, self.optimizer, weights=False)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None:
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing: {checkpoint} holds the optimizer state but not the "
                                      "learning-rate schedule (an incomplete copy?)")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{path} is corrupted: {e}") from e
            self.lr_scheduler.load_state_dict(state)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        load_training_state(best, self.model, weights=True)


def _check_files(checkpoint: str) -> None:
    """Fail early, naming the file, on a damaged trainer state or RNG file."""
    import json

    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {checkpoint} is not a complete checkpoint")
    try:
        with open(path, encoding="utf-8") as handle:
            json.load(handle)
    except ValueError as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from e
    sched = os.path.join(checkpoint, SCHEDULER_NAME)
    if os.path.isdir(os.path.join(checkpoint, STATE_DIR)) and not os.path.isfile(sched):
        raise CheckpointError(f"{sched} is missing: {checkpoint} is not a complete checkpoint (its optimizer "
                              "state is there, its learning-rate schedule is not)")
    rng = os.path.join(checkpoint, "rng_state.pth")
    if os.path.isfile(rng):
        try:
            torch.load(rng, weights_only=False)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{rng} is corrupted: {e}") from e


def _prepare_without_ddp(accelerator) -> None:
    """Make `accelerator.prepare` leave a slid model unwrapped: with several processes the engine
    reduces the gradients itself (data_parallel.py), and DistributedDataParallel's hooks would wait
    for parameter gradients that never come. Other models are prepared as before."""
    original = accelerator.prepare_model
    if getattr(original, "_slide", False):
        return

    def prepare_model(model, device_placement=None, evaluation_mode=False):
        if is_slid(model):
            return original(model, device_placement=False, evaluation_mode=True)
        return original(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    prepare_model._slide = True
    accelerator.prepare_model = prepare_model


def install_trainer_hook() -> None:
    """Make `transformers.Trainer(..., args=SlideArgs(...))` (and its subclasses) slide, and any
    Trainer given a slid model (`trainer_hook.install`, with `SlideTrainer` as the sliding base)."""
    install(SlideTrainer)
