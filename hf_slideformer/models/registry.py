"""The family registry: one entry per supported `model_type`, read by everything that needs the families.

An entry says what hf_slideformer does for one Hugging Face family, and names each way in which
the family departs from the Llama decoder:

- where the adapter finds the parts the engine slides (`adapters.DecoderAdapter`, made from the
  entry) and which decoder-layer classes it proves it handles (`layer_classes`);
- the layer types its layers may have (`layer_types`: sliding, full or linear attention). The
  base model's own forward builds each type's mask and rotary embeddings and passes them to each
  layer, so the engine hands a layer exactly what HF's forward gives it;
- an embedding scale that the embedding module applies itself (Gemma's sqrt(hidden)), and a
  transform of the final logits (`LogitTransform`: Granite's divisor, Gemma's soft-capping), which
  the loss head applies (a multiplier that the base model's forward applies, as Granite's
  embedding multiplier, needs nothing: that forward runs unchanged);
- whether the MLP's last projection feeds the residual directly (`mlp_feeds_residual`; Gemma's
  and OLMo's feed a post-norm) and whether the norms scale by (1 + w) (`norm_offset`);
- the ops `triton_ops.patch` replaces by the project's kernels (`kernels`), and the norms whose
  output feeds the residual add (`residual_norms`: their kernel's backward is out of place); the
  others run HF's modules;
- the parameters a decoder layer holds, which the planner counts from a config.json: beyond the
  Llama core by formula (`extra_layer_params`), or, with None, from the family's own modules
  built on the meta device (`layer_params_of`); for a mixture of experts also those one token
  computes with (`active_layer_params_of`: top-k of the routed experts), the planner's compute.

`NOT_SUPPORTED` names families that transformers ships but the engine refuses, with the reason.
`docs/models.md` is the table of the families; `docs/engine.md` ("How to add a model family")
lists what to check for a new entry.

Readers: `models.get_adapter` (the engine, checkpoints), `triton_ops.patching` (the kernel
patch), `planner.model_shape` (parameter counts), and the tests' family list (tests/helpers.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["LayerDims", "LogitTransform", "Family", "FAMILIES", "NOT_SUPPORTED", "SUPPORTED_MODEL_TYPES",
           "get_family", "llama_core_params", "layer_params_of", "active_layer_params_of"]

ATTENTION = ("full_attention", "sliding_attention")
ALL_KERNELS = ("rms_norm", "rope", "swiglu")


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one Llama-layout decoder layer, read from a config."""

    hidden: int           # H
    intermediate: int     # I
    q: int                # heads x head_dim
    kv: int               # kv_heads x head_dim
    head_dim: int


@dataclass(frozen=True)
class LogitTransform:
    """What the family's causal LM does to the lm_head's product before the loss.

    logits = softcap * tanh((h @ W.T / divisor) / softcap), the tanh only with a softcap.

    Attributes:
        divisor: the logits are divided by it (Granite's `logits_scaling`).
        softcap: soft-capping of the logits (Gemma's `final_logit_softcapping`), or None.
    """

    divisor: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.divisor == 1.0 and self.softcap is None


def llama_core_params(dims: LayerDims) -> int:
    """q, k, v, o projections, gate / up / down, and the two RMSNorms, without biases."""
    return (dims.hidden * dims.q + 2 * dims.hidden * dims.kv + dims.q * dims.hidden
            + 3 * dims.hidden * dims.intermediate + 2 * dims.hidden)


def _no_extra(cfg: dict, dims: LayerDims) -> int:
    return 0


def _llama_extra(cfg: dict, dims: LayerDims) -> int:
    biases = dims.q + 2 * dims.kv + dims.hidden if cfg.get("attention_bias") else 0      # q/k/v/o biases
    return biases + (2 * dims.intermediate + dims.hidden if cfg.get("mlp_bias") else 0)  # gate/up/down biases


def _qwen2_extra(cfg: dict, dims: LayerDims) -> int:
    return dims.q + 2 * dims.kv                                                          # q/k/v biases, always


def _qwen3_extra(cfg: dict, dims: LayerDims) -> int:
    biases = dims.q + 2 * dims.kv + dims.hidden if cfg.get("attention_bias") else 0      # q/k/v/o biases
    return biases + 2 * dims.head_dim                                                    # q_norm, k_norm


def _plain(cfg) -> LogitTransform:
    return LogitTransform()


def _gemma_logits(cfg) -> LogitTransform:
    return LogitTransform(softcap=getattr(cfg, "final_logit_softcapping", None))


def _granite_logits(cfg) -> LogitTransform:
    return LogitTransform(divisor=float(getattr(cfg, "logits_scaling", 1.0) or 1.0))


def _gemma_embedding_scale(cfg) -> float:
    return float(cfg.hidden_size) ** 0.5


def _no_parts(cfg) -> list[str]:
    return []


def _gemma4_parts(cfg) -> list[str]:
    """The parts of a Gemma 4 config the engine does not slide (the E2B / E4B checkpoints use both)."""
    parts = []
    if getattr(cfg, "hidden_size_per_layer_input", 0):
        parts.append(f"per-layer inputs (hidden_size_per_layer_input={cfg.hidden_size_per_layer_input}: "
                     "embed_tokens_per_layer and per_layer_model_projection feed a second input to every layer)")
    if getattr(cfg, "num_kv_shared_layers", 0):
        parts.append(f"shared KV layers (num_kv_shared_layers={cfg.num_kv_shared_layers}: the last layers read "
                     "the keys and values of an earlier layer)")
    return parts


def _gemma4_moe(cfg: dict) -> bool:
    return bool(cfg.get("enable_moe_block"))


@dataclass(frozen=True)
class Family:
    """What hf_slideformer does for one `model_type`.

    Attributes:
        model_type: the config's `model_type`.
        layer_classes: class names of the decoder layers the engine proves it handles; a model
            with another layer class is refused at `slide()`.
        extra_layer_params: (config dict, LayerDims) -> parameters of one decoder layer beyond
            `llama_core_params` (biases, q/k norms); None: counted from the family's modules
            built on the meta device (`layer_params_of`).
        kernels: the ops `triton_ops.patch` replaces by the project's kernels ("rms_norm": the
            RMSNorm modules, Llama-cast, or Gemma's (1 + w) with `norm_offset`, but those of
            `residual_norms`; "rope": the module-level `apply_rotary_pos_emb`; "swiglu":
            SiLU-gated MLPs with gate / up / down projections; "geglu": the same MLPs with the
            tanh GeLU; "gated_delta": the module-level `torch_chunk_gated_delta_rule` of the
            linear-attention layers; "causal_conv": their module-level `causal_conv1d_fn`;
            "gated_norm": their `*RMSNormGated` modules);
            empty: the family runs HF's modules only.
        residual_norms: attribute names of the decoder layer's norms whose output feeds the
            residual add: with "rms_norm" listed their kernel's backward writes dx to a buffer of
            its own (note [Why a residual norm's backward is out of place]).
        layer_types: the `config.layer_types` values its layers may take.
        embedding_scale: (config) -> the factor the embedding module multiplies its rows by,
            which the engine's embedding applies in its place; None: no scale.
        final_logits: (config) -> the `LogitTransform` the loss head applies.
        mlp_feeds_residual: the MLP's last projection (`down_proj`) only feeds the layer's closing
            residual add (not a norm), so the recompute may skip its product.
        norm_offset: the family's RMSNorm scales by (1 + weight) (not the Llama kernel's op).
        base_attr: the causal LM's attribute holding the base model (embed_tokens / layers / norm).
        dropouts: config keys of dropout probabilities that must be 0 (recompute would draw
            other masks).
        router_class: for a mixture of experts, the class name of its router module (it returns
            the router logits first): the engine adds the auxiliary load-balancing loss from
            them when the config asks (`output_router_logits`), as HF does (router_aux.py).
        routed: (config dict) -> whether a model of a family without an auxiliary loss (no
            `router_class`) has routed experts, whose top-k share the planner's compute counts.
        unsupported: (config) -> the parts of that model's structure the engine does not slide,
            each named with its config key; a model with any is refused at `slide()`.
    """

    model_type: str
    layer_classes: tuple[str, ...]
    extra_layer_params: Callable[[dict, LayerDims], int] | None = _no_extra
    kernels: tuple[str, ...] = ALL_KERNELS
    layer_types: tuple[str, ...] = ATTENTION
    embedding_scale: Callable[[object], float] | None = None
    final_logits: Callable[[object], LogitTransform] = _plain
    mlp_feeds_residual: bool = True
    norm_offset: bool = False
    residual_norms: tuple[str, ...] = ()
    base_attr: str = "model"
    dropouts: tuple[str, ...] = ("attention_dropout",)
    router_class: str | None = None
    routed: Callable[[dict], bool] | None = None
    unsupported: Callable[[object], list[str]] = _no_parts

    @property
    def modeling(self) -> str:
        """The transformers module of the family's modeling code."""
        name = self.model_type.removesuffix("_text")
        return f"transformers.models.{name}.modeling_{name}"

    def active_layer_params(self, cfg: dict, dims: LayerDims) -> int:
        """Parameters of the largest decoder layer one token computes with: all of them in a
        dense family, the top-k experts' share of the routed experts in a mixture of experts."""
        if self.router_class is None and not (self.routed is not None and self.routed(cfg)):
            return self.layer_params(cfg, dims)
        return active_layer_params_of(cfg)

    def layer_params(self, cfg: dict, dims: LayerDims) -> int:
        """Parameters of the largest decoder layer of a model with config `cfg`."""
        if self.extra_layer_params is None:
            return layer_params_of(cfg)
        return llama_core_params(dims) + self.extra_layer_params(cfg, dims)


def layer_params_of(cfg: dict) -> int:
    """Parameters of the largest decoder layer of the model of config dict `cfg`, counted from
    the family's own modules built on the meta device (no memory is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = getattr(model, "model", model).layers
    return max(sum(p.numel() for p in layer.parameters()) for layer in layers)


def active_layer_params_of(cfg: dict) -> int:
    """Parameters of the largest decoder layer that one token computes with, for a mixture of
    experts: the layer's dense parameters and `num_experts_per_tok` of its routed experts'
    (the modules named `*Experts`; a shared expert is dense). Built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
    top_k = int(getattr(config, "num_experts_per_tok", None) or config.top_k_experts)

    def active(layer) -> int:
        routed = sum(p.numel() for m in layer.modules() if type(m).__name__.endswith("Experts")
                     for p in m.parameters(recurse=False))
        return sum(p.numel() for p in layer.parameters()) - routed + routed * top_k // experts
    return max(active(layer) for layer in getattr(model, "model", model).layers)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", ("LlamaDecoderLayer",), _llama_extra),
    Family("qwen2", ("Qwen2DecoderLayer",), _qwen2_extra),
    Family("qwen3", ("Qwen3DecoderLayer",), _qwen3_extra),
    Family("mistral", ("MistralDecoderLayer",)),
    # Note: [Why a residual norm's backward is out of place] the norm kernel's backward writes dx
    # over the incoming gradient, which is right only when the norm's output feeds linears alone.
    # Gemma's post-norms feed the residual add, whose gradient is the same tensor as the one the
    # residual carries on: they take the (1 + w) kernel with its backward out of place. Gemma 3's
    # other norms (input_layernorm and pre_feedforward_layernorm before the projections, q_norm /
    # k_norm before the in-place rope, the final norm before the head) take it in place; its MLP
    # the GeGLU kernel. OLMo's norms multiply by the weight before the cast (not Llama's order):
    # they run HF's modules.
    Family("gemma3_text", ("Gemma3DecoderLayer",), None, kernels=("rms_norm", "rope", "geglu"),
           embedding_scale=_gemma_embedding_scale, final_logits=_gemma_logits, mlp_feeds_residual=False,
           norm_offset=True, residual_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
    Family("phi3", ("Phi3DecoderLayer",), None, kernels=("rms_norm",),     # fused gate_up, partial rotary
           dropouts=("attention_dropout", "resid_pdrop", "embd_pdrop")),
    Family("olmo2", ("Olmo2DecoderLayer",), None, kernels=("rope", "swiglu"), mlp_feeds_residual=False),
    Family("olmo3", ("Olmo3DecoderLayer",), None, kernels=("rope", "swiglu"), mlp_feeds_residual=False),
    Family("smollm3", ("SmolLM3DecoderLayer",), None),
    Family("granite", ("GraniteDecoderLayer",), None, final_logits=_granite_logits),
    # Linear-attention layers (gated delta rule) run HF's module as the layer body, its chunked
    # rule the project's (same mathematics, own backward for the scan) unless fla is installed,
    # its convolution and its gated output norm the project's kernels (the convolution's unless
    # causal-conv1d is installed); the (1 + w) norms are Gemma 3's (the offset kernel), partial
    # rotary HF's; the MLP takes the SwiGLU kernel.
    Family("qwen3_5_text", ("Qwen3_5DecoderLayer",), None,
           kernels=("rms_norm", "swiglu", "gated_delta", "causal_conv", "gated_norm"),
           layer_types=ATTENTION + ("linear_attention",), norm_offset=True),
    # Mixtures of experts: the router and the experts are part of the layer's unit, and HF's
    # expert code runs as the layer body (its grouped kernels where transformers has them). The
    # auxiliary load-balancing loss (`output_router_logits`) is added as HF adds it (router_aux.py).
    # Qwen3-MoE's and Mixtral's attention is Llama's (Llama-cast norms, q/k norms, full rotary):
    # the norm and rope kernels; the routed experts are HF's (a dense MLP layer takes the SwiGLU).
    Family("qwen3_moe", ("Qwen3MoeDecoderLayer",), None, kernels=("rms_norm", "rope", "swiglu"),
           router_class="Qwen3MoeTopKRouter"),
    Family("mixtral", ("MixtralDecoderLayer",), None, kernels=("rms_norm", "rope", "swiglu"),
           router_class="MixtralTopKRouter"),
    Family("qwen3_5_moe_text", ("Qwen3_5MoeDecoderLayer",), None,
           kernels=("rms_norm", "gated_delta", "causal_conv", "gated_norm"),
           router_class="Qwen3_5MoeTopKRouter", layer_types=ATTENTION + ("linear_attention",), norm_offset=True),
    # Attention sinks (a logit per head beside the keys), sliding and full layers alternating, a
    # router with a bias, experts with a fused, interleaved gate_up and a clamped SwiGLU (with
    # biases): HF's modules. Its released checkpoint is MXFP4: loaded dequantized (checkpoint.py).
    Family("gpt_oss", ("GptOssDecoderLayer",), None, kernels=(), router_class="GptOssTopKRouter"),
    # Gemma 4: sliding and full layers with their own head sizes, keys as values in full layers
    # (attention_k_eq_v), a layer scalar (a buffer saved with the weights), and, in the MoE
    # checkpoints, a dense MLP beside the routed experts (HF computes no auxiliary loss for it).
    # Its RMSNorm scales by w (not 1 + w) but upcasts to fp32 and feeds the residual: HF's modules.
    Family("gemma4_text", ("Gemma4TextDecoderLayer",), None, kernels=(),
           embedding_scale=_gemma_embedding_scale, final_logits=_gemma_logits, mlp_feeds_residual=False,
           routed=_gemma4_moe, unsupported=_gemma4_parts),
)}
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))

_MULTIMODAL = ("a multimodal model: slide its text model, loaded with AutoModelForCausalLM from the "
               "checkpoint's text config ({text} model_type), or use a text-only checkpoint")
NOT_SUPPORTED: dict[str, str] = {
    "qwen3_5_moe": _MULTIMODAL.format(text="qwen3_5_moe_text"),
    "gemma3": _MULTIMODAL.format(text="gemma3_text"),
    "qwen3_5": _MULTIMODAL.format(text="qwen3_5_text"),
    "gemma4": _MULTIMODAL.format(text="gemma4_text"),
}


def get_family(model_type: str) -> Family:
    """The registry entry of `model_type`, or a ValueError naming the supported ones (and, for a
    family transformers ships that the engine refuses, why)."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        why = f" ({model_type}: {NOT_SUPPORTED[model_type]})" if model_type in NOT_SUPPORTED else ""
        raise ValueError(
            f"model_type {model_type!r} is not supported by hf_slideformer{why}; supported model_types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None
