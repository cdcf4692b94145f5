"""The hook that makes a plain `transformers.Trainer` slide: given `SlideArgs`, or a slid model,
its instance becomes the sliding trainer's subclass before `Trainer.__init__` runs.

`trainer.install_trainer_hook()` installs it, with `trainer.SlideTrainer` as the sliding base.
"""
from __future__ import annotations

import functools
import inspect

from transformers import Trainer

from .engine.lora import peft_base
from .model import is_slid
from .training_args import SlideArgs, SlideArgsError

__all__ = ["install", "sliding_class"]

_SLIDE_CLASSES: dict[type, type] = {}


def sliding_class(cls: type, sliding: type) -> type:
    """The sliding trainer's behaviour (`sliding`, `trainer.SlideTrainer`) on top of a (user)
    Trainer subclass `cls`."""
    if issubclass(cls, sliding):
        return cls
    if cls is Trainer:
        return sliding
    if cls not in _SLIDE_CLASSES:
        _SLIDE_CLASSES[cls] = type(f"Slide{cls.__name__}", (sliding, cls), {})
    return _SLIDE_CLASSES[cls]


def _model_is_slid(model) -> bool:
    if model is None:
        return False
    base = peft_base(model)
    return is_slid(model) or (base is not None and is_slid(base))


def _bind_slide_args(trainer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Trainer.__init__'s (args, kwargs) with `args` as keyword; a slid model's plain arguments
    become their slide class (`trl_support.upgrade_args`), and what cannot work is refused."""
    from .trl_support import check_trainer, upgrade_args

    args = list(args)
    model = kwargs.get("model", args[0] if args else None)
    targs = args[1] if len(args) > 1 else kwargs.get("args")
    if _model_is_slid(model) or isinstance(targs, SlideArgs):
        if targs is None:
            targs = SlideArgs(output_dir="trainer_output")
        elif not isinstance(targs, SlideArgs):
            targs = upgrade_args(targs)
        if len(args) > 1:
            args[1] = targs
        else:
            kwargs["args"] = targs
        check_trainer(type(trainer), targs, kwargs)
    return tuple(args), kwargs


def install(sliding: type) -> None:
    """Make `transformers.Trainer(..., args=SlideArgs(...))` (and its subclasses) slide, and any
    Trainer given a slid model (its arguments upgraded to their slide class); `sliding` is the
    sliding trainer (`trainer.SlideTrainer`).

    Note: [Why Trainer.__init__ is wrapped] the Trainer offers no hook that receives the model
    from its arguments before it builds the optimizer. The wrapper switches the instance to its
    sliding subclass before `Trainer.__init__` runs, so every step is the SlideTrainer's.
    Idempotent: a second call finds the wrapper and returns. If this version's
    `Trainer.__init__` has no `args` parameter, the call fails with what to do instead of
    training an unslid model later.
    """
    original = Trainer.__init__
    if getattr(original, "_slide_hook", False):
        return
    params = list(inspect.signature(original).parameters)
    if params[:3] != ["self", "model", "args"]:
        raise SlideArgsError("this transformers version's Trainer.__init__ cannot be hooked; use "
                             "hf_slideformer.SlideTrainer(model=..., args=SlideArgs(...)) instead of Trainer")

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        args, kwargs = _bind_slide_args(self, args, kwargs)
        if isinstance(args[1] if len(args) > 1 else kwargs.get("args"), SlideArgs) \
                and not isinstance(self, sliding):
            self.__class__ = sliding_class(type(self), sliding)
        original(self, *args, **kwargs)

    __init__._slide_hook = True
    Trainer.__init__ = __init__
