"""How a decoder layer's linear projections compute: in the compute dtype, or in FP8.

The engine asks one object, chosen once at slide() (`SlideConfig.matmuls`), for a context around
each layer's forward and around its recompute in backward:

    with engine.matmuls.forward(i, slot):              y = layer(x)
    with engine.matmuls.recompute(i, slot, skip):      y = layer(x); autograd.grad(y, ...)

`DtypeMatmuls` ('dtype') leaves the projections as they are, and makes the recompute's last
projection output-free (`functions.grad_only`, docs/engine.md). `Fp8Matmuls` ('fp8') runs every
plain `nn.Linear` of the layer (q, k, v, o, gate, up, down in the Llama layout) through
`fp8.Fp8Linear`, the output-free one too, so its backward is the same FP8 math; an input that
several projections read (q, k, v; gate, up) is quantized once per form (`fp8.SharedInputs`). Where
the layer runs the project's kernels (`triton_ops.patch`), the RMSNorms before the attention and the
MLP and the SwiGLU activation write their output's per-token e4m3 form in the same kernel and hand
it to the projections through `SharedInputs.provide` (`triton_ops.patching.rows_forward`), in the
forward and in the recompute (but for the MLP whose down projection is the recompute's
output-free one). Norms, attention, the embedding, the loss head and the gradients
sent to the host are unchanged.

Note: [Why FP8 weights are cached by the slot's fill] a layer's weights are quantized once per
visit of a slot and reused by its forward and, when the slot was not refilled in between (the
last layers of the forward, which serve the start of the backward), by its recompute. The cache
is keyed by the slot object and its fill count (`Slot.fills`, bumped by every completed fill),
never by a tensor's id or data pointer: a refilled slot has the same storage and other values.
A layer without a slot (resident on the GPU, updated in place there) is quantized at each use.
The cache holds GPU memory only while it serves: the entries of a slot refilled since are dropped
when the next layer call begins, a weight's forward form after the recompute (the last forward
of that fill), its dgrad form after its backward (`fp8.QuantizedWeight`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .fp8 import GEMM_ALIGN, CudaFp8, EmulatedFp8, Fp8Linear, Fp8Ops, QuantizedWeight, SharedInputs, fp8_unsupported
from .functions import grad_only
from triton_ops.patching import patched_op, rows_forward

__all__ = ["DtypeMatmuls", "Fp8Matmuls", "layer_matmuls", "check_matmuls", "fp8_refusals", "install_emulation", "projections",
           "producers"]


class DtypeMatmuls:
    """The projections in the compute dtype (the default)."""

    def forward(self, index: int, slot) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def recompute(self, index: int, slot, skip: nn.Linear | None) -> contextlib.AbstractContextManager:
        return grad_only(skip)


def projections(layer: nn.Module) -> list[nn.Linear]:
    """The plain `nn.Linear` modules of a decoder layer, in module order."""
    return [m for m in layer.modules() if type(m) is nn.Linear]


def producers(layer: nn.Module) -> list[nn.Module]:
    """The modules of a decoder layer whose outputs FP8 projections read and whose kernels can
    write them quantized (`rows_forward`): the layer's own RMSNorms (input_layernorm,
    post_attention_layernorm; not a per-head q/k norm inside the attention) and its SwiGLU MLP."""
    own_norms = [m for m in layer.children() if patched_op(m) == "rms_norm"]
    return own_norms + [m for m in layer.modules() if patched_op(m) == "swiglu"]


class Fp8Matmuls:
    """Every projection of the decoder layers through `Fp8Linear`, weights cached per slot fill.

    Args:
        layers: the decoder layer modules.
        ops: the FP8 primitives (`CudaFp8`, or `EmulatedFp8` for the CPU tests).
        fused: the norms and the SwiGLU hand their outputs over quantized (`producers`); False
            quantizes them in the projections (the reference the fused path is tested against).
        hp_wgrad: torchao's "rowwise_with_gw_hp" backward ('fp8_gw_hp'; fp8.py), else "rowwise".
    """

    def __init__(self, layers: list[nn.Module], ops: Fp8Ops, fused: bool = True, hp_wgrad: bool = False):
        self.ops, self.hp_wgrad = ops, hp_wgrad
        self.projections = [projections(layer) for layer in layers]
        self.producers = [producers(layer) if fused else [] for layer in layers]
        self.cache: dict = {}          # Slot -> (fills, {id(projection module): QuantizedWeight})

    def forward(self, index: int, slot) -> contextlib.AbstractContextManager:
        return self._patched(index, slot, None, False)

    def recompute(self, index: int, slot, skip: nn.Linear | None) -> contextlib.AbstractContextManager:
        return self._patched(index, slot, skip, True)

    def quantized(self, slot, proj: nn.Linear) -> QuantizedWeight | None:
        """`proj`'s weight in FP8, from the cache of `slot`'s current fill (None without a slot)."""
        if slot is None:
            return None
        fills, weights = self.cache.get(slot, (None, None))
        if fills != slot.fills:                # [Why FP8 weights are cached by the slot's fill]
            weights = {}
            self.cache[slot] = (slot.fills, weights)
        qweight = weights.get(id(proj))
        if qweight is None:
            qweight = weights[id(proj)] = QuantizedWeight(proj.weight, self.ops, self.hp_wgrad)
        return qweight

    def _prune(self) -> None:
        """Drop the cached forms of the slots refilled since they were made."""
        for slot in [slot for slot, (fills, _) in self.cache.items() if slot.fills != fills]:
            del self.cache[slot]

    @contextlib.contextmanager
    def _patched(self, index: int, slot, skip, last_forward: bool):
        self._prune()
        projs = self.projections[index]
        # A producer holding the output-free projection (the MLP, whose down projection is the
        # layer's last) keeps its plain forward: nothing would read its output's FP8 rows.
        makers = [m for m in self.producers[index] if skip is None or not any(c is skip for c in m.modules())]
        mods = projs + makers
        shared = SharedInputs(self.ops)        # one layer call's inputs, each quantized once
        before = [m.__dict__.get("forward") for m in mods]     # an instance forward of its own stays
        for proj in projs:
            proj.forward = self._runner(proj, slot, proj is not skip, shared)
        for maker in makers:
            maker.forward = rows_forward(maker, shared.provide)
        try:
            yield
        finally:
            shared.drop_rows()
            if last_forward and slot in self.cache:        # the recompute: no forward of this fill follows
                for qweight in self.cache[slot][1].values():
                    qweight.drop_rows()
            for module, prev in zip(mods, before):
                if prev is None:
                    del module.forward
                else:
                    module.forward = prev

    def _runner(self, proj: nn.Linear, slot, output: bool, shared: SharedInputs):
        def run(x):
            return Fp8Linear.apply(x, proj.weight, proj.bias, self.quantized(slot, proj), self.ops, output, shared,
                                   self.hp_wgrad)
        return run


def fp8_refusals(config, adapter, model, layers: list[nn.Module], lora: bool = False) -> list[str]:
    """What keeps this model and config from the FP8 mode (empty when nothing does)."""
    out = []
    why = fp8_unsupported(config.torch_device)
    if why:
        out.append(why)
    if config.dtype != torch.bfloat16:
        out.append(f"dtype={str(config.dtype).removeprefix('torch.')} (FP8 GEMMs write bfloat16: use dtype='bfloat16')")
    if lora:
        out.append("a LoRA model (its base's projections are frozen wrappers; train the adapters in bf16)")
    if adapter.family.router_class is not None:
        out.append(f"the mixture of experts {adapter.family.model_type!r} (its experts are not nn.Linear modules)")
    if config.mlp_chunk_tokens is not None:
        out.append("mlp_chunk_tokens (the chunked MLP recomputes outside the FP8 projections: unset it)")
    bad = sorted({f"{type(m).__name__}({m.in_features}, {m.out_features})" for layer in layers[:1]
                  for m in projections(layer) if m.in_features % GEMM_ALIGN or m.out_features % GEMM_ALIGN})
    if bad:
        out.append(f"projections whose sizes are not multiples of {GEMM_ALIGN} ({', '.join(bad)}), which "
                   "torch._scaled_mm needs")
    return out


def check_matmuls(config, adapter, model, lora: bool = False) -> None:
    """At slide(), before anything is allocated: refuse `matmuls='fp8'` where it cannot run
    (ValueError naming each reason)."""
    if config.matmuls == "dtype":
        return
    bad = fp8_refusals(config, adapter, model, list(adapter.layers(model)), lora)
    if bad:
        raise ValueError(f"SlideConfig.matmuls={config.matmuls!r} cannot run here: " + "; ".join(bad)
                         + ". Use matmuls='dtype'.")


def layer_matmuls(config, layers: list[nn.Module]):
    """The engine's `matmuls` object for `config.matmuls` (checked by `check_matmuls`)."""
    if config.matmuls == "dtype":
        return DtypeMatmuls()
    return Fp8Matmuls(layers, CudaFp8(), hp_wgrad=config.matmuls == "fp8_gw_hp")


def install_emulation(model, hp_wgrad: bool = False) -> Fp8Matmuls:
    """Test hook: run a slid model's projections through the FP8 recipe's CPU emulation
    (`EmulatedFp8`; `hp_wgrad`: the gw_hp recipe), on any device. The public switch
    (`matmuls='fp8'`) refuses the CPU."""
    engine = model.slide_engine
    engine.matmuls = Fp8Matmuls(engine.layers, EmulatedFp8(), hp_wgrad=hp_wgrad)
    return engine.matmuls
