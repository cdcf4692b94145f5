"""TRL on a slid model: its fused LM head answered by the engine, its configs with the slide settings.

TRL's trainers (`SFTTrainer`, `DPOTrainer`) score the next-token labels with a fused LM head
that they install over `model.forward`; on a slid model the forward answers `fused_lm_head=True`
itself (`fused_head.fused_head`), so `adopt_forward` checks what TRL's patch asks for and leaves
it out. `slide_config_class` makes, for a TRL config class, the class holding its fields and the
`slide_*` ones (`hs.SlideSFTConfig`, `hs.SlideDPOConfig`); `check_trainer` refuses, at the
trainer's construction, what cannot work on a slid model. TRL is imported only here and only
when it is used.
"""
from __future__ import annotations

import dataclasses
import logging
import math

logger = logging.getLogger(__name__)

__all__ = ["adopt_forward", "check_trainer", "slide_config_class", "SUPPORTED_TRAINERS", "SlideSFTConfig",
           "SlideDPOConfig"]

# The per-token fields the engine's head computes (FusedLMHeadOutput); TRL asks for a subset.
_HEAD_OUTPUTS = frozenset({"log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs"})
SUPPORTED_TRAINERS = ("SFTTrainer", "DPOTrainer")


def _closure(fn) -> dict:
    func = getattr(fn, "__func__", fn)
    cells = getattr(func, "__closure__", None) or ()
    return dict(zip(func.__code__.co_freevars, (c.cell_contents for c in cells)))


def adopt_forward(model, fn) -> bool:
    """Whether `fn`, assigned to a slid model's `forward`, is TRL's fused LM head (and so left out).

    See note [Why TRL's fused LM head is not installed on a slid model] (model.py). What the patch
    asks for beyond the engine's head is refused: a temperature other than 1, logit scaling or
    soft-capping other than the family's own, per-token fields other than `FusedLMHeadOutput`'s.
    """
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)           # not its __name__ / __module__: functools.wraps copies them
    if code is None or code.co_name != "_fused_forward" or \
            not str(getattr(func, "__globals__", {}).get("__name__", "")).startswith("trl."):
        return False
    spec = _closure(func)
    asked = []
    # The family's own logit transform (Gemma's soft-cap, Granite's 1 / logits_scaling) is the
    # head's already (registry.LogitTransform): asked for, it is what the head computes.
    own = getattr(getattr(model, "slide_engine", None), "logit_transform", None)
    own_cap, own_scale = (own.softcap, 1.0 / own.divisor) if own is not None else (None, 1.0)
    if spec.get("temperature", 1.0) != 1.0:
        asked.append(f"temperature={spec['temperature']}")
    cap = spec.get("final_logit_softcapping")
    if cap != own_cap and not (cap is not None and own_cap is not None and math.isclose(cap, own_cap)):
        asked.append(f"final_logit_softcapping={cap}")
    if not math.isclose(spec.get("logit_scale", 1.0), own_scale, rel_tol=1e-6):
        asked.append(f"logit_scale={spec['logit_scale']}")
    extra = sorted(set(spec.get("outputs", ("log_probs",))) - _HEAD_OUTPUTS)
    if extra:
        asked.append(f"outputs {extra}")
    if asked:
        raise NotImplementedError(
            f"TRL's fused LM head asks for {', '.join(asked)}, which the sliding engine's head does not compute "
            f"(it scores at temperature 1: log-probabilities, entropies, top-1 hits, mean logits, log sum p**2). Supported TRL trainers: "
            f"{', '.join(SUPPORTED_TRAINERS)}.")
    logger.debug("TRL's fused LM head on %s: answered by the sliding engine's head", type(model).__name__)
    return True


_CLASSES: dict[type, type] = {}


def slide_config_class(cls: type) -> type:
    """The dataclass with the fields of training-arguments class `cls` (a TRL config, say) and
    `SlideArgs`' (`slide_*`): `SlideArgs`' checks first, then `cls`'s own `__post_init__`."""
    from .training_args import SlideArgs

    from transformers import TrainingArguments

    if issubclass(cls, SlideArgs):
        return cls
    if cls is TrainingArguments:
        return SlideArgs
    if cls not in _CLASSES:
        made = dataclasses.dataclass(type(f"Slide{cls.__name__}", (SlideArgs, cls), {
            "__doc__": f"`{cls.__name__}` plus the sliding engine's `slide_*` settings (see `SlideArgs`).",
            "__module__": __name__}))
        _CLASSES[cls] = made
        globals().setdefault(made.__name__, made)       # found by name when the Trainer pickles its args
    return _CLASSES[cls]


def upgrade_args(args):
    """`args` (any `TrainingArguments`) as the matching slide class, every field copied."""
    cls = slide_config_class(type(args))
    if type(args) is cls:
        return args
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    if "hub_token" in values:
        values["hub_token"] = args.hub_token
    return cls(**values)


def _trl_trainer_name(trainer_cls: type) -> str | None:
    for klass in trainer_cls.__mro__:
        if (klass.__module__ or "").startswith("trl.") and klass.__name__.endswith("Trainer"):
            return klass.__name__
    return None


def check_trainer(trainer_cls: type, args, kwargs: dict) -> None:
    """Refuse, at construction, a trainer on a slid model that cannot work.

    A TRL trainer other than `SUPPORTED_TRAINERS`; DPO with a reference model of its own (a slid
    model slides one model: the reference log-probabilities are precomputed with
    `precompute_ref_log_probs=True`); a `compute_loss_func` (it needs logits with gradients,
    which the sliding head never materializes).
    """
    from .training_args import SlideArgsError

    if kwargs.get("compute_loss_func") is not None:
        raise SlideArgsError("compute_loss_func on a slid model: it needs the logits with gradients, which the "
                             "sliding head never materializes; use the model's loss (labels), or TRL's loss types")
    name = _trl_trainer_name(trainer_cls)
    if name is None:
        return
    if name not in SUPPORTED_TRAINERS:
        raise SlideArgsError(f"{name} is not supported on a slid model; supported TRL trainers: "
                             f"{', '.join(SUPPORTED_TRAINERS)} (docs/integration.md, 'TRL')")
    if name == "DPOTrainer":
        if kwargs.get("ref_model") is not None or not getattr(args, "precompute_ref_log_probs", False):
            raise SlideArgsError("DPOTrainer on a slid model needs precompute_ref_log_probs=True and no ref_model: "
                                 "the reference log-probabilities are computed once, by the slid model before "
                                 "training, instead of by a second copy of the model")
        if getattr(args, "sync_ref_model", False):
            raise SlideArgsError("sync_ref_model=True needs a second model: not supported on a slid model")


def __getattr__(name):
    if name in ("SlideSFTConfig", "SlideDPOConfig"):
        import trl

        return slide_config_class(getattr(trl, name[len("Slide"):]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
