"""hf_slideformer: full-parameter fine-tuning of LLMs larger than the GPU, on one GPU.

The GPU is a sliding window over the model's layers; fp32 master weights and Adam moments live
in host memory; a CPU worker runs AdamW while the GPU computes.
"""
from .config import SlideConfig
from .engine.slide_engine import SlideEngine, SlideStateError
from .errors import NonFiniteGradientError, NonFiniteWeightError, RankMismatchError, RankTimeoutError
from .engine.lora import merge_and_unload
from .host.memory import HostMemoryError
from .model import SlideModel, is_slid, slide
from .models import SUPPORTED_MODEL_TYPES
from .host.optim import SlideOptimizer
from .planner.planner import Plan, plan
from .checkpoints.checkpoint import CheckpointError
from .host.worker import WorkerError

__version__ = "0.1.0"

_LAZY = {  # the HF integration imports transformers.Trainer: loaded on first use
    "SlideArgs": "training_args", "SlideArgsError": "training_args", "SlideTrainer": "trainer",
    "SlidePlugin": "accelerate_plugin", "SlideAccelerator": "accelerate_plugin",
    "save_training_state": "checkpoints.train_checkpoint",
    "load_training_state": "checkpoints.train_checkpoint",
    "SlideSFTConfig": "trl_support", "SlideDPOConfig": "trl_support",     # need trl
}


def install_trainer_hook() -> None:
    """Make a plain `transformers.Trainer(model=..., args=SlideArgs(...))` (or a subclass's) slide.

    Wraps `Trainer.__init__` once (idempotent: later calls do nothing); see
    `trainer.install_trainer_hook`. Loading `SlideArgs` or `SlideTrainer` from this package calls
    it, so `hs.SlideArgs(...)` handed to a plain Trainer slides; code that imports
    `hf_slideformer.training_args` directly calls it itself.
    """
    from .trainer import install_trainer_hook as install

    install()


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        if module in ("training_args", "trainer", "trl_support"):
            install_trainer_hook()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SlideConfig", "SlideEngine", "SlideModel", "SlideOptimizer", "SlideStateError", "NonFiniteGradientError",
           "NonFiniteWeightError", "RankMismatchError", "RankTimeoutError", "HostMemoryError",
           "CheckpointError", "WorkerError", "SUPPORTED_MODEL_TYPES", "slide", "is_slid", "__version__",
           "plan", "Plan", "install_trainer_hook", "merge_and_unload",
           *_LAZY]
