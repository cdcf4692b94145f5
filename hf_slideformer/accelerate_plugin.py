"""The Accelerate side: `SlidePlugin` (the settings) and `SlideAccelerator` (the custom-loop glue).

`accelerate launch --config_file slideformer.yaml train.py` runs a plain Accelerate loop on a
sliding model. The slide settings live in the same yaml file. Accelerate rejects unknown
*top-level* keys in its config files, so they sit in a nested `slideformer:` mapping inside
`mpirun_config`, a free-form section that a single-process launch never reads (`accelerate
launch` only looks at `mpirun_hostfile` there). The launched script does not receive the config
path, so `SlidePlugin.from_launch()` reads it from the launcher's command line (its parent
process), falling back to Accelerate's default config file; `SlidePlugin.from_yaml(path)` names
it explicitly. A standalone yaml with a top-level `slideformer:` mapping is read as well.

This module is also the one place that reads Accelerate's environment variables
(`launch_environment`): the process count, DeepSpeed / FSDP switches and mixed precision.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from .compute.fp8_recipes import take_fp8_recipe
from .config import FLOAT16_REFUSED, SETTINGS, SlideConfig
from .options import check_fields, option_fields

logger = logging.getLogger(__name__)

__all__ = ["SlidePlugin", "SlideAccelerator", "LaunchEnvironment", "launch_environment", "wrap_optimizer", "worker_threads",
           "multi_process_message", "SECTION"]

SECTION = "slideformer"
_HOST_SECTION = "mpirun_config"


def multi_process_message(processes: int) -> str:
    """The error for a launch whose kind of parallelism sliding does not support."""
    return (f"hf_slideformer was launched with {processes} processes of a kind it does not slide with: several GPUs "
            "of one host train data parallel (distributed_type MULTI_GPU, or MULTI_CPU on CPUs; docs/multi_gpu.md); "
            "several hosts, XLA, DeepSpeed and FSDP launches are not supported.")


@dataclass
class LaunchEnvironment:
    """What the launcher (`accelerate launch`, `torchrun`) told this process through the environment."""

    world_size: int = 1
    use_deepspeed: bool = False
    use_fsdp: bool = False
    mixed_precision: Optional[str] = None
    launched_by_accelerate: bool = False
    omp_num_threads: Optional[int] = None


def _truthy(value: Optional[str]) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def launch_environment() -> LaunchEnvironment:
    """Read the launcher's environment variables (the only place in the package that does)."""
    env = os.environ
    omp = env.get("OMP_NUM_THREADS")
    return LaunchEnvironment(
        world_size=int(env.get("WORLD_SIZE", "1") or 1),
        use_deepspeed=_truthy(env.get("ACCELERATE_USE_DEEPSPEED")),
        use_fsdp=_truthy(env.get("ACCELERATE_USE_FSDP")),
        mixed_precision=env.get("ACCELERATE_MIXED_PRECISION"),
        launched_by_accelerate="ACCELERATE_DYNAMO_BACKEND" in env or "ACCELERATE_MIXED_PRECISION" in env,
        omp_num_threads=int(omp) if omp and omp.isdigit() else None,
    )


def _launcher_config_file() -> Optional[str]:
    """The `--config_file` of the `accelerate launch` that started this process, else Accelerate's default."""
    try:
        import psutil

        argv = psutil.Process(os.getppid()).cmdline()
    except Exception:  # noqa: BLE001 - no psutil or no access: fall back to the default file
        argv = []
    if any("accelerate" in a for a in argv[:3]):
        for position, arg in enumerate(argv):
            if arg in ("--config_file", "--config-file") and position + 1 < len(argv):
                return argv[position + 1]
            if arg.startswith(("--config_file=", "--config-file=")):
                return arg.split("=", 1)[1]
    from accelerate.commands.config import default_config_file

    return default_config_file if os.path.isfile(default_config_file) else None


@dataclass
@option_fields(SETTINGS, surface="plugin")
class SlidePlugin:
    """The sliding settings of an Accelerate run: one field per `SlideConfig` option (the settings table).

    Written in the accelerate config yaml under `mpirun_config: {slideformer: {...}}` (see the
    module docstring for why there), or built in code. Values are checked and normalized as
    `SlideConfig` does (`'24'` -> 24, `'true'` -> True); an error names `slideformer.<key>`.
    `dtype` unset follows the launch's mixed_precision (bf16; fp16 is refused).
    """

    def __post_init__(self):
        check_fields(self, SETTINGS, surface="plugin", label=SECTION + ".{}")

    @classmethod
    def from_dict(cls, values: dict, source: str = "settings") -> "SlidePlugin":
        """Build from a mapping, rejecting unknown keys (a typo must not be ignored silently)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown slideformer setting(s) {unknown} in {source}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str) -> "SlidePlugin":
        """Read the `slideformer` mapping of a yaml file (inside `mpirun_config`, or at the top level)."""
        import yaml

        with open(path, encoding="utf-8") as handle:
            doc = yaml.safe_load(handle) or {}
        section = doc.get(SECTION)
        if section is None:
            section = (doc.get(_HOST_SECTION) or {}).get(SECTION)
        if section is None:
            logger.info("no %s settings in %s: using the defaults", SECTION, path)
            section = {}
        return cls.from_dict(section, source=path)

    @classmethod
    def from_launch(cls) -> "SlidePlugin":
        """The settings of the accelerate config this process was launched with (defaults without one)."""
        path = _launcher_config_file()
        return cls.from_yaml(path) if path else cls()

    def to_slide_config(self, device: str | torch.device, mixed_precision: Optional[str] = None) -> SlideConfig:
        """The `SlideConfig` for `device`; `mixed_precision` ("bf16", "fp8", "no") picks the dtype when
        unset, and "fp8" turns on the FP8 projections (`matmuls='fp8'`, with bf16 around them)."""
        values = {name: getattr(self, name) for name, opt in SETTINGS.items() if "plugin" in opt.surfaces}
        if mixed_precision == "fp8":
            if values["matmuls"] == "dtype":
                values["matmuls"] = "fp8"
            mixed_precision = "bf16"
        if values["dtype"] is None and mixed_precision not in (None, "no"):
            values["dtype"] = mixed_precision
        return SlideConfig(device=str(device), **values)


def wrap_optimizer(optimizer) -> AcceleratedOptimizer:
    """Wrap a SlideOptimizer for Accelerate without moving its state.

    Note: [Why the optimizer is wrapped before prepare] `AcceleratedOptimizer(device_placement=True)`
    round-trips `state_dict()` through the GPU, which would copy every Adam moment (8 bytes per
    parameter) to the device. The wrapper made here skips that; it is marked prepared, so
    `accelerator.prepare` keeps it, and its `step` still runs only when Accelerate syncs gradients.
    """
    wrapped = AcceleratedOptimizer(optimizer, device_placement=False, scaler=None)
    wrapped._is_accelerate_prepared = True
    return wrapped


class SlideAccelerator(Accelerator):
    """An `Accelerator` for a sliding model: same loop, the engine owns precision and placement.

    Args:
        slide_plugin: the settings; default: `SlidePlugin.from_launch()` (the launch yaml).
        *args, **kwargs: as `accelerate.Accelerator`. `mixed_precision` (or the launch's) picks the
            engine's compute dtype; Accelerate itself runs with mixed_precision="no".
    """

    def __init__(self, *args, slide_plugin: Optional[SlidePlugin] = None, **kwargs):
        env = launch_environment()
        if env.use_deepspeed or env.use_fsdp or kwargs.get("deepspeed_plugin") or kwargs.get("fsdp_plugin"):
            raise ValueError("DeepSpeed / FSDP is configured together with sliding: they are alternatives. Use "
                             "distributed_type: 'NO' in the accelerate config, or train without sliding.")
        plugin = slide_plugin if slide_plugin is not None else SlidePlugin.from_launch()
        precision = kwargs.pop("mixed_precision", None) or env.mixed_precision or "no"
        if precision == "fp16":
            raise ValueError(f"mixed_precision 'fp16' is refused with sliding: {FLOAT16_REFUSED}")
        if precision not in ("no", "bf16", "fp8"):
            raise ValueError(f"mixed_precision {precision!r} is not supported with sliding (use bf16, fp8 or no)")
        kwargs["kwargs_handlers"], recipe = take_fp8_recipe(kwargs.get("kwargs_handlers"), precision)
        if recipe is not None and plugin.matmuls != recipe:
            if plugin.matmuls not in ("dtype", recipe):
                raise ValueError(f"the FP8 recipe given ({recipe}) contradicts the slideformer setting "
                                 f"matmuls={plugin.matmuls!r}")
            plugin.matmuls = recipe
        ga = kwargs.get("gradient_accumulation_steps")
        if ga not in (None, 1) and plugin.gradient_accumulation_steps not in (1, ga):
            raise ValueError(f"gradient_accumulation_steps={ga} contradicts the slideformer setting "
                             f"{plugin.gradient_accumulation_steps}")
        if ga not in (None, 1):
            plugin.gradient_accumulation_steps = ga
        kwargs["gradient_accumulation_steps"] = plugin.gradient_accumulation_steps
        super().__init__(*args, mixed_precision="no", **kwargs)
        if self.distributed_type not in (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
            raise RuntimeError(multi_process_message(self.num_processes))
        self.slide_plugin = plugin
        self.slide_precision = precision

    def slide_config(self) -> SlideConfig:
        """The engine configuration of this run (device, dtype, accumulation, clipping, plugin settings)."""
        return self.slide_plugin.to_slide_config(self.device, self.slide_precision)

    def slide(self, model):
        """Slide an HF causal LM (on the CPU) in place with this run's settings and return it."""
        from .model import slide

        return slide(model, self.slide_config())

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        from .model import is_slid

        if not is_slid(model):
            raise ValueError("SlideAccelerator.prepare got a model that is not slid: call model = "
                             "accelerator.slide(model) (or SlideModel.from_pretrained) before building the optimizer")
        cfg = model.slide_config
        if cfg.gradient_accumulation_steps != self.gradient_accumulation_steps:
            raise ValueError(f"the model slides with gradient_accumulation_steps={cfg.gradient_accumulation_steps} "
                             f"but the accelerator accumulates {self.gradient_accumulation_steps}; slide it with "
                             "accelerator.slide(model)")
        # Never wrapped in DistributedDataParallel (evaluation_mode): with several processes the
        # engine reduces the gradients itself (data_parallel.py).
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def _slid_pair(self):
        from .model import is_slid

        models = [m for m in self._models if is_slid(m)]
        return (models[0], self._optimizers[0] if self._optimizers else None) if models else (None, None)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs):
        """`Accelerator.save_state`, with the slid model and its optimizer streamed per unit, atomically.

        Accelerate writes what it owns (schedulers, RNG, samplers, registered objects); the model's
        fp32 masters, moments and step counters go to `slide_state/` (see `save_training_state`),
        not into one pickle of the whole optimizer. With an explicit `output_dir` the whole state is
        written beside it and swapped in by renames (`train_checkpoint.atomic_directory`, keeping
        other files of `output_dir`): killed at any step, `load_state` reads the old state or the
        new one. With automatic checkpoint naming Accelerate writes a fresh folder, whose
        `slide_state/index.json`, written last, marks it complete: `load_state` refuses one without it.
        """
        from .checkpoints.atomic_save import final_paths_in_logs, fsync_tree
        from .checkpoints.train_checkpoint import atomic_directory, save_training_state

        model, opt = self._slid_pair()
        if model is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        dp = model.slide_engine.dp
        if dp is not None:
            return self._save_state_ranks(dp, model, opt, output_dir, safe_serialization, **kwargs)
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            if output_dir is None or self.project_configuration.automatic_checkpoint_naming:
                location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
                fsync_tree(location)
                save_training_state(location, model, opt)
                return location
            final = os.path.abspath(output_dir)
            with atomic_directory(final, merge=True) as tmp, \
                    final_paths_in_logs(tmp, final, loggers=("accelerate", "transformers", "")):
                super().save_state(tmp, safe_serialization=safe_serialization, **kwargs)
                save_training_state(tmp, model, opt)
            return final
        finally:
            self._models, self._optimizers = models, optimizers

    def _save_state_ranks(self, dp, model, opt, output_dir, safe_serialization, **kwargs):
        """`save_state` with several ranks (every rank calls it): rank 0 stages the directory, every
        rank writes Accelerate's files there (its RNG state among them), rank 0 adds the shared
        `slide_state/` and swaps the directory in."""
        from .checkpoints.atomic_save import final_paths_in_logs
        from .checkpoints.train_checkpoint import atomic_directory, save_training_state

        if output_dir is None or self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("with several processes, SlideAccelerator.save_state needs an explicit output_dir "
                             "(automatic checkpoint naming is not supported there)")
        final = os.path.abspath(output_dir)
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            if dp.writes:
                with atomic_directory(final, merge=True) as tmp, \
                        final_paths_in_logs(tmp, final, loggers=("accelerate", "transformers", "")):
                    dp.broadcast(tmp)
                    super().save_state(tmp, safe_serialization=safe_serialization, **kwargs)
                    dp.barrier()                      # every rank's files are in
                    save_training_state(tmp, model, opt)
            else:
                tmp = dp.broadcast(None)
                super().save_state(tmp, safe_serialization=safe_serialization, **kwargs)
                dp.barrier()
            dp.barrier()                              # swapped in: every rank may read it
            return final
        finally:
            self._models, self._optimizers = models, optimizers

    def load_state(self, input_dir: Optional[str] = None, **kwargs):
        """`Accelerator.load_state` for a checkpoint written by `save_state` above.

        The slid model's state is verified before anything is loaded: a state that a killed save
        left half-written is refused (`CheckpointError`), and one whose swap was interrupted is
        first resolved to the old or the new state (`train_checkpoint.recover_checkpoint`).
        """
        from .checkpoints.train_checkpoint import load_training_state, recover_checkpoint, verify_training_state

        model, opt = self._slid_pair()
        if model is None:
            return super().load_state(input_dir, **kwargs)
        if input_dir is None:
            raise ValueError("SlideAccelerator.load_state needs the checkpoint directory (input_dir)")
        dp = model.slide_engine.dp
        if dp is None or dp.writes:
            recover_checkpoint(input_dir)
        if dp is not None:
            dp.barrier()                              # rank 0 has finished an interrupted swap, if any
        verify_training_state(input_dir, model)
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            out = super().load_state(input_dir, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
        load_training_state(input_dir, model, opt)
        return out

    def prepare_optimizer(self, optimizer, device_placement=None):
        from .host.optim import SlideOptimizer

        if isinstance(optimizer, SlideOptimizer):
            optimizer = wrap_optimizer(optimizer)
            self._optimizers.append(optimizer)
            return optimizer
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """For a slid model: the engine clips at optimizer.step() with the configured max_grad_norm;
        this returns the pre-clip norm (the value `torch.nn.utils.clip_grad_norm_` would return)."""
        from .model import is_slid

        params = list(parameters)
        owned = {id(p) for m in self._models if is_slid(m) for p in m.parameters()}
        if not params or not all(id(p) in owned for p in params):
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        configured = self.slide_plugin.max_grad_norm
        if configured is None or abs(configured - float(max_norm)) > 1e-12 or norm_type != 2:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}) on a slid model: the engine clips during "
                             f"optimizer.step() with slideformer.max_grad_norm (now {configured}); set it in the "
                             "config (L2 norm only)")
        engine = next(m for m in self._models if is_slid(m)).slide_engine
        return torch.tensor(engine.last_grad_norm())


def worker_threads(model) -> int:
    """The thread count the CPU optimizer worker of a slid model actually runs with.

    Launchers export OMP_NUM_THREADS=1; the worker sets its own count from
    `SlideConfig.cpu_threads`, on its own thread. This asks that thread.
    """
    import threading

    seen, done = {}, threading.Event()
    worker = model.slide_engine.worker
    worker.submit(lambda: seen.update(n=torch.get_num_threads()), done=(done,))
    worker.wait(done)
    return seen["n"]
