"""hf_slideformer: full-parameter fine-tuning of LLMs larger than the GPU, on one GPU.

The GPU is a sliding window over the model's layers; fp32 master weights and Adam moments live
in host memory; a CPU worker runs AdamW while the GPU computes.
"""
from .config import SlideConfig
from .engine import SlideEngine, SlideStateError
from .memory import HostMemoryError
from .model import SlideModel, is_slid, slide
from .models import SUPPORTED_MODEL_TYPES
from .optim import SlideOptimizer
from .checkpoint import CheckpointError
from .worker import WorkerError

__version__ = "0.1.0"

__all__ = ["SlideConfig", "SlideEngine", "SlideModel", "SlideOptimizer", "SlideStateError", "HostMemoryError",
           "CheckpointError", "WorkerError", "SUPPORTED_MODEL_TYPES", "slide", "is_slid", "__version__"]
