"""Which FP8 recipe Accelerate's recipe handlers ask for, as a `SlideConfig.matmuls` value: the
engine runs torchao's row-wise recipes itself (docs/fp8.md), so torchao need not be installed, and
every other FP8 backend or recipe is refused with what differs."""
from __future__ import annotations

__all__ = ["take_fp8_recipe"]


def _disabled(cast) -> bool:
    """Is torchao's `CastConfig` `cast` one that leaves its tensor in high precision?"""
    return str(getattr(cast, "scaling_type", "")).upper().endswith("DISABLED")


def take_fp8_recipe(handlers, precision: str) -> tuple[list, str | None]:
    """The kwargs handlers less an FP8 recipe, which the engine carries out itself (docs/fp8.md),
    and the `SlideConfig.matmuls` it asks for (None: no recipe given).

    torchao's (`AORecipeKwargs`) is accepted when it is a row-wise recipe the engine runs: no
    config, or one whose input, weight and gradient casts are axis-wise and whose scales are
    rounded to powers of two ('fp8'); "rowwise_with_gw_hp" ('fp8_gw_hp') is known by its weight
    gradient's casts, which leave both operands in high precision. Other FP8 backends (Transformer
    Engine, MS-AMP) and other torchao recipes are refused, naming what differs; an FP8 recipe
    without mixed_precision='fp8' too.
    """
    handlers = list(handlers or [])
    matmuls = None
    recipes = [h for h in handlers if type(h).__name__ in ("AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs")]
    for recipe in recipes:
        if precision != "fp8":
            raise ValueError(f"{type(recipe).__name__} was given with mixed_precision={precision!r}: an FP8 recipe "
                             "needs mixed_precision='fp8'")
        if type(recipe).__name__ != "AORecipeKwargs":
            raise ValueError(f"{type(recipe).__name__} is not supported with sliding: the engine's FP8 is torchao's "
                             "float8 rowwise recipe; pass AORecipeKwargs() or none")
        matmuls = "fp8"
        cfg = getattr(recipe, "config", None)
        if cfg is not None:
            casts = [getattr(cfg, f"cast_config_{n}", None) for n in ("input", "weight", "grad_output")]
            axiswise = all(str(getattr(c, "scaling_granularity", "")).upper().endswith("AXISWISE") for c in casts)
            gw_hp = all(_disabled(getattr(cfg, f"cast_config_{n}_for_grad_weight", None)) for n in ("input", "grad_output"))
            if gw_hp and axiswise:
                matmuls = "fp8_gw_hp"
            elif not (axiswise and getattr(cfg, "round_scales_to_power_of_2", False)):
                raise ValueError("AORecipeKwargs(config=...) asks for a float8 recipe other than the rowwise ones (axis-"
                                 "wise e4m3 casts, power-of-two scales), which are the ones the engine runs: pass "
                                 "AORecipeKwargs() or Float8LinearConfig.from_recipe_name('rowwise' or "
                                 "'rowwise_with_gw_hp')")
    return [h for h in handlers if h not in recipes], matmuls
