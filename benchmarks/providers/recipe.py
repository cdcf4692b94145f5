"""How a user of a baseline configures the model: gradient checkpointing and fused kernels.

A baseline is measured as its users run it (docs/benchmarks.md, "Providers"): Hugging Face's gradient
checkpointing, non-reentrant, and the fused kernels a Trainer user turns on with
`use_liger_kernel=True` (RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy that never
materialises the logits). Liger is used when it imports (and its patch accepts the model);
otherwise the project's own `triton_ops.patch` applies the same four ops, and the row says which
and why (`apply_kernels`' answer).

`LIGER_PATCHES` is the one table of model families: adding a family is one entry.
"""
from __future__ import annotations

import importlib
import importlib.metadata

from torch import nn

__all__ = ["KERNEL_CHOICES", "LIGER_PATCHES", "apply_kernels", "enable_checkpointing", "is_liger_available"]

KERNEL_CHOICES = ("auto", "liger", "triton_ops", "none")

# model_type -> Liger's patch function for that family (liger_kernel.transformers) and the ops it is
# asked for besides rope, rms_norm and the fused linear cross-entropy: the MLP's gated activation
# (SwiGLU; Gemma 3's GeGLU, which its patch names `geglu`)
LIGER_PATCHES = {
    "llama": ("apply_liger_kernel_to_llama", {"swiglu": True}),
    "qwen2": ("apply_liger_kernel_to_qwen2", {"swiglu": True}),
    "qwen3": ("apply_liger_kernel_to_qwen3", {"swiglu": True}),
    "mistral": ("apply_liger_kernel_to_mistral", {"swiglu": True}),
    "gemma3_text": ("apply_liger_kernel_to_gemma3_text", {"geglu": True}),
    # the experts stay HF's grouped GEMMs, as a slid Qwen3-MoE runs them (swiglu would swap in
    # Liger's fused MoE function)
    "qwen3_moe": ("apply_liger_kernel_to_qwen3_moe", {"swiglu": False}),
}


def is_liger_available() -> bool:
    """True when `liger_kernel.transformers` imports (it needs triton and a GPU build of torch)."""
    try:
        importlib.import_module("liger_kernel.transformers")
    except ImportError:
        return False
    return True


def enable_checkpointing(model: nn.Module) -> None:
    """Hugging Face's gradient checkpointing, non-reentrant (what `TrainingArguments` turns on).

    transformers 5.2x renames it `activation_checkpointing_enable`; earlier 5.x have only the old name.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_kernels(model: nn.Module, choice: str) -> str:
    """Patch the fused kernels into `model` in place; return what was applied, for the row.

    Args:
        model: a Hugging Face causal LM (a family of `LIGER_PATCHES` for Liger; any family the
            engine slides for triton_ops, which patches the ops the family's entry lists).
        choice: "auto" (Liger if it imports, else triton_ops), "liger", "triton_ops" or "none".

    Raises:
        ImportError: "liger" asked for and not importable, or no Liger patch for the family.
    """
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "none":
        return "none (plain Hugging Face layers and loss)"
    family = model.config.model_type
    if choice == "liger" or (choice == "auto" and is_liger_available() and family in LIGER_PATCHES):
        if family not in LIGER_PATCHES:
            raise ImportError(f"Liger has no patch for model_type {family!r} here; known: {sorted(LIGER_PATCHES)}")
        liger = importlib.import_module("liger_kernel.transformers")
        name, mlp = LIGER_PATCHES[family]
        try:
            getattr(liger, name)(rope=True, **mlp, rms_norm=True, cross_entropy=False,
                                 fused_linear_cross_entropy=True, model=model)
        except Exception as exc:  # a Liger that does not know this transformers: "auto" falls back, and says so
            if choice == "liger":
                raise
            why = f"Liger's {name} failed: {type(exc).__name__}: {str(exc)[:120]}"
        else:
            return f"liger {_version('liger-kernel')}: {name}(rope, {', '.join(mlp)}, rms_norm, fused linear CE)"
    else:
        why = "Liger not importable"
    import triton_ops
    from hf_slideformer.models import get_family
    from triton_ops.patching import supported_families

    if choice == "auto" and family not in supported_families():
        return f"none (plain Hugging Face layers and loss: {why}, and triton_ops does not patch {family!r})"
    triton_ops.patch(model)
    return f"triton_ops.patch({', '.join(get_family(family).kernels + ('linear_cross_entropy',))})" + (
        "" if choice == "triton_ops" else f" ({why})")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"
