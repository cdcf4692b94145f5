"""The family registry: one entry per supported `model_type`, read by everything that needs the families.

An entry says what hf_slideformer does for one Hugging Face family: where the adapter finds the
parts the engine slides (`adapters.DecoderAdapter`, made from the entry), whether
`triton_ops.patch` swaps its fused kernels in (and from which transformers module it takes
`apply_rotary_pos_emb`), and the parameters a decoder layer holds beyond the Llama core, which
the planner counts from a config.json. Every
family whose decoder follows the Llama layout (embed_tokens / layers / norm / lm_head) is one
entry here; `docs/engine.md` ("How to add a model family") lists what to check.

Readers: `models.get_adapter` (the engine, checkpoints), `triton_ops.patching` (the kernel
patch), `planner.model_shape` (parameter counts), and the tests' family list (tests/helpers.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["LayerDims", "Family", "FAMILIES", "SUPPORTED_MODEL_TYPES", "get_family", "llama_core_params"]


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one Llama-layout decoder layer, read from a config."""

    hidden: int           # H
    intermediate: int     # I
    q: int                # heads x head_dim
    kv: int               # kv_heads x head_dim
    head_dim: int


def llama_core_params(d: LayerDims) -> int:
    """q, k, v, o projections, gate / up / down, and the two RMSNorms, without biases."""
    return d.hidden * d.q + 2 * d.hidden * d.kv + d.q * d.hidden + 3 * d.hidden * d.intermediate + 2 * d.hidden


def _no_extra(cfg: dict, d: LayerDims) -> int:
    return 0


def _llama_extra(cfg: dict, d: LayerDims) -> int:
    n = d.q + 2 * d.kv + d.hidden if cfg.get("attention_bias") else 0        # q/k/v/o biases
    return n + (2 * d.intermediate + d.hidden if cfg.get("mlp_bias") else 0)  # gate/up/down biases


def _qwen2_extra(cfg: dict, d: LayerDims) -> int:
    return d.q + 2 * d.kv                                                       # q/k/v biases, always


def _qwen3_extra(cfg: dict, d: LayerDims) -> int:
    n = d.q + 2 * d.kv + d.hidden if cfg.get("attention_bias") else 0        # q/k/v/o biases
    return n + 2 * d.head_dim                                                   # q_norm, k_norm


@dataclass(frozen=True)
class Family:
    """What hf_slideformer does for one `model_type`.

    Attributes:
        model_type: the config's `model_type`.
        extra_layer_params: (config dict, LayerDims) -> parameters of one decoder layer beyond
            `llama_core_params` (biases, q/k norms).
        kernels: `triton_ops.patch` applies: RMSNorm modules, SwiGLU MLPs and a module-level
            `apply_rotary_pos_emb` in `modeling`.
        base_attr: the causal LM's attribute holding the base model (embed_tokens / layers / norm).
    """

    model_type: str
    extra_layer_params: Callable[[dict, LayerDims], int] = _no_extra
    kernels: bool = True
    base_attr: str = "model"

    @property
    def modeling(self) -> str:
        """The transformers module of the family's modeling code."""
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    def layer_params(self, cfg: dict, d: LayerDims) -> int:
        """Parameters of one decoder layer of a model with config `cfg`."""
        return llama_core_params(d) + self.extra_layer_params(cfg, d)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", _llama_extra),
    Family("qwen2", _qwen2_extra),
    Family("qwen3", _qwen3_extra),
    Family("mistral"),
)}
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))


def get_family(model_type: str) -> Family:
    """The registry entry of `model_type`, or a ValueError naming the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported by hf_slideformer; supported model_types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None

