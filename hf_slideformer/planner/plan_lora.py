"""The planner's LoRA model: a PEFT LoRA run on a streamed frozen base, as the engine runs it.

`LoraEstimator` is `plan_estimate.Estimator` for a model whose base is frozen (`lora.py`,
`placements.FrozenLayer`) and whose adapters, rank r on the targeted linear layers and
parameters of the decoder layers (`plan_lora_targets`: PEFT's `target_modules` and
`target_parameters`, the experts' fused weights of a mixture of experts), stay on the GPU. What
changes against full fine-tuning:

- host: the frozen base alone, without moments, accumulators or gradient buffers (the gradient
  ring is made but unused): the layers and the head at `base_bytes` per parameter, the
  embedding's master in fp32; no CPU AdamW;
- GPU: the adapters in fp32 with their gradient and moments (16 B/param), and their inputs,
  which PEFT casts to fp32 and autograd keeps for their gradients; an adapted parameter (PEFT's
  `ParamWrapper`) is materialized at each pass as W + B A in its own dtype, and the backward
  keeps that copy and makes its gradient;
- compute: the forward and the recompute as for full fine-tuning, the backward the input
  gradients only (no weight-gradient products of the base), but the weight gradients of the
  adapted parameters, which their factors' gradients come from; plus the adapters' own work;
- PCIe: the frozen layers for the forward and the recompute; nothing of theirs crosses back.
  The adapters never cross: they live on the GPU.

With PEFT `modules_to_save` (`trained`: "embed_tokens", "lm_head"; modules_to_save.py) the
copy trains in full as the embedding or head unit does in full fine-tuning: fp32 master and
moments on the host (the embedding's dense fp32 gradient too), the frozen original beside it in
the compute dtype, the CPU AdamW over it, the head's gradient back over PCIe and its weights in
again after each update. On a tied model the lm_head is the embedding.

`advise_lora` is the advice of such a plan. `planner.plan(..., lora_r=r)` picks both, once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .plan_estimate import (
    ACT_HIDDEN, ACT_INTER, PROCESS_HOST_BYTES, Estimator, ModelShape, batch_limit, gpu_binds,
)
from .plan_lora_targets import LoraTargets, llama_targets
from .plan_report import gib

__all__ = ["LoraEstimator", "advise_lora", "lora_linears", "adapter_params", "FROZEN_BASE_BYTES", "MODULES_TO_SAVE",
           "ADAPTER_GPU_BYTES", "PARAM_PASS_BYTES", "PARAM_BACKWARD_BYTES", "ADAPTER_STEP_BYTES"]

# Host bytes per parameter of a frozen layer or head: the engine keeps them in the compute dtype
# (store.py: [Why a frozen unit is kept in the compute dtype]). 4 where the adapters were added to
# a model already slid, which keeps its fp32 masters. The embedding's master stays fp32 (its rows
# are gathered from it on the host).
FROZEN_BASE_BYTES = 2
MODULES_TO_SAVE = ("embed_tokens", "lm_head")      # what modules_to_save may name (modules_to_save.py)
ADAPTER_GPU_BYTES = 16       # fp32 weight, gradient, Adam m and v, all on the GPU
# GPU memory traffic of one adapted linear, bytes per token per input / output feature. PEFT's
# `lora.Linear.forward` with fp32 adapters on a bf16 base: x cast to fp32 (2 + 4), read by
# lora_A (4); lora_B's output written (4), scaled (4 + 4), added to the base's bf16 output
# into fp32 (2 + 4 + 4) and cast back (4 + 2). Its backward: the output gradient cast up (2 + 4),
# down for the base (4 + 2), scaled (4 + 4), read by both of lora_B's products (8); lora_A reads
# its saved fp32 input (4) and writes the input's gradient (4), cast down (4 + 2) and added to the
# base's (6). The rank-r intermediates are negligible while r is small against the features.
LORA_PASS_BYTES = (10, 28)        # one forward (the engine runs two: forward and recompute)
LORA_BACKWARD_BYTES = (20, 28)
# GPU memory traffic of an adapted parameter (PEFT's ParamWrapper, a 3-D expert weight of a bf16
# base), bytes per element per micro-batch: each pass reads the weight and writes W + B A, one
# `baddbmm` (2 + 2); the backward writes the adapted weight's gradient (2) and reads it for both
# factors' gradients (2 + 2). Per micro-batch, whatever its tokens.
PARAM_PASS_BYTES = 4
PARAM_BACKWARD_BYTES = 6
# The adapters' fused AdamW on the GPU, once per optimizer step: reads the fp32 weight, gradient,
# m and v, writes the weight, m and v.
ADAPTER_STEP_BYTES = 28
PEAK_HBM_GBS = 4800.0        # H200 memory bandwidth, GB/s (H100 SXM: 3350)
PEAK_FP32_TFLOPS = 66.9      # H100 / H200 SXM fp32 peak without TF32 (torch's default for fp32 matmuls)
# Achieved share of PEAK_HBM_GBS by the adapters' kernels: fitted to the measured slide_lora row
# (docs/planner.md, "LoRA"); PEFT's own run of the same adapters checks it.
HBM_EFFICIENCY = 0.75


def lora_linears(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(input, output) features of each linear layer of one decoder layer (the Llama layout)."""
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    hidden, intermediate = shape.hidden, shape.intermediate
    return {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}


def adapter_params(shape: ModelShape, r: int) -> int:
    """LoRA parameters of rank r on every linear layer of every Llama-layout decoder layer: r (in + out) each."""
    return shape.layers * sum(r * (i + o) for i, o in lora_linears(shape).values())


@dataclass(frozen=True)
class LoraEstimator(Estimator):
    """The formulas for a LoRA run of rank `r` on `targets` whose frozen layers and head take
    `base_bytes` per parameter on the host and over PCIe (rates as `Estimator`'s, plus
    `gpu_hbm_gbs` and `gpu_fp32_tflops`)."""

    r: int = 16
    base_bytes: int = FROZEN_BASE_BYTES
    trained: tuple[str, ...] = ()       # PEFT modules_to_save: a subset of MODULES_TO_SAVE
    targets: LoraTargets | None = None  # what the adapters adapt; None: every linear of a Llama-layout layer

    host_updates = False     # the engine keeps frozen layers streaming: no resident units, no device updates

    @property
    def lora_targets(self) -> LoraTargets:
        return self.targets if self.targets is not None else llama_targets(self.s, self.r)

    @property
    def adapter_params(self) -> int:
        """The adapters' parameters, as PEFT makes them (`LoraTargets.params`)."""
        return self.lora_targets.params

    @property
    def param_adapter_params(self) -> int:
        """Of them, those on targeted parameters (PEFT's ParamWrapper: the experts' weights)."""
        return self.lora_targets.param_params

    @property
    def frozen_params(self) -> int:
        """Parameters the engine keeps at `base_bytes`: the layers and the head (the embedding's
        master stays fp32; a tied lm_head is the embedding; a trained lm_head is not frozen)."""
        return self.s.layers * self.s.layer_params + self.s.head_params - self.trained_head_params

    @property
    def trained_head_params(self) -> int:
        """The untied lm_head's parameters when modules_to_save trains it (the final norm stays frozen)."""
        shape = self.s
        return shape.head_params - shape.hidden if "lm_head" in self.trained and not shape.tied else 0

    @property
    def trained_embed_params(self) -> int:
        """The embedding's parameters when modules_to_save trains it (or the lm_head tied to it)."""
        shape = self.s
        on = "embed_tokens" in self.trained or ("lm_head" in self.trained and shape.tied)
        return shape.embed_params if on else 0

    @property
    def trained_params(self) -> int:
        """Parameters the CPU AdamW updates: the modules_to_save copies."""
        return self.trained_head_params + self.trained_embed_params

    def host(self, B: int, tier: str, deferred: bool = False, disk_layers: int = 0) -> dict:
        """Host bytes by item (no moments, accumulators, gradients or gradient ring: nothing of the
        base trains)."""
        shape, head, emb = self.s, self.trained_head_params, self.trained_embed_params
        out = {
            f"embedding master (fp32, {'trained' if emb else 'frozen'})": 4 * shape.embed_params,
            f"frozen layers and head ({self.base_bytes} B/param)": self.base_bytes * self.frozen_params,
            # the forward's gather in bf16 (the native kernel); a trained embedding's row sums in fp32
            f"embedding row buffers (B*S*H bf16{' + fp32' if emb else ''}, pinned)":
                (2 + (4 if emb else 0)) * B * self.seq * shape.hidden,
            f"layer inputs ({tier} tier)": self.layer_inputs_host(B, tier),
            "process (torch, CUDA runtime, Python)": PROCESS_HOST_BYTES,
        }
        if head:
            out["lm_head copy (modules_to_save: fp32 master, m, v)"] = 12 * head
        if emb:
            out["embedding copy's moments and gradient (modules_to_save: m, v, fp32 gradient)"] = 12 * emb
        if head or emb:
            out["modules_to_save originals (frozen, bf16)"] = 2 * (head + emb)
        return out

    def layer_adapter_bytes(self, T: int) -> tuple[int, int, int]:
        """(bytes, its linears' input features, its parameters' bytes) of the layer whose adapters
        hold the most in its recompute + backward: the adapted linears' fp32 inputs, T x their
        input features x 4; each adapted parameter's W + B A (2 B/element, kept for the backward)
        and its bf16 factors, and the largest one's gradient (2 B/element)."""
        best = (0, 0, 0)
        for layer in self.lora_targets.layers:
            params = 2 * layer.param_numel + 2 * layer.param_largest + 2 * layer.param_params
            best = max(best, (4 * T * layer.linear_in + params, layer.linear_in, params))
        return best

    def gpu(self, B: int, tier: str) -> tuple[dict, dict]:
        """As full fine-tuning's, plus the adapters, their fp32 inputs and the adapted parameters'
        copies; a frozen head has no gradient."""
        shape, T = self.s, B * self.seq
        fixed, _ = super().gpu(B, tier)
        fixed[f"LoRA adapters (fp32 weight, gradient, Adam m, v: {ADAPTER_GPU_BYTES} B/param)"] = \
            ADAPTER_GPU_BYTES * self.adapter_params
        held, ins, params = self.layer_adapter_bytes(T)
        copies = f", the adapted parameters' W + B A and the largest's gradient (bf16, {gib(params)})" if params else ""
        phases = {
            f"layer recompute + backward (B*S*{ACT_HIDDEN} H + {ACT_INTER} I x "
            f"{'the MLP chunk' if self.inter_tokens(T) < T else 'B*S'} bf16, the adapters' fp32 inputs B*S*{ins}"
            f"{copies})":
                2 * T * ACT_HIDDEN * shape.hidden + 2 * self.inter_tokens(T) * ACT_INTER * shape.intermediate + held,
            "head: logits chunk, hidden states (frozen: no gradient)" if not self.trained_head_params else
            "head: gradient (bf16, modules_to_save), logits chunk, hidden states":
                2 * self.logits_rows(T) * shape.vocab + T * (8 * shape.hidden + 4) + 2 * self.trained_head_params,
        }
        return fixed, phases

    def gpu_extras(self, N: int, clipping: bool) -> dict:
        """None: the adapters' gradients are summed and clipped on the GPU where they are."""
        return {}

    def flops_per_token(self, recompute: bool = True) -> float:
        """bf16 matmul FLOPs per token: layers 4 P (forward, input gradients) plus the recompute's
        2 P less down_proj's 2 I H, head 4 V H (its forward and its input's gradient), attention
        as for full fine-tuning (its backward has no weights); the adapted parameters' weight
        gradients, 2 per element a token computes with (top-k of the experts), which their
        factors' gradients are taken from; a trained lm_head (modules_to_save) adds its weight
        gradient's 2 V H. The adapters' products are timed by `adapter_seconds`. P: the parameters
        a token computes with (`ModelShape.compute_layer_params`)."""
        shape = self.s
        attn = (9 if recompute else 7) * self.seq * shape.heads * shape.head_dim * shape.layers
        compute_params = shape.compute_layer_params       # a mixture of experts: its top-k experts' share
        lin = 4 * compute_params + (2 * (compute_params - shape.skipped_product_params) if recompute else 0)
        # a trained head: its weight gradient
        head = (6 if self.trained_head_params else 4) * shape.vocab * shape.hidden
        return shape.layers * lin + head + attn + 2 * self.lora_targets.param_active

    def adapter_traffic_seconds(self, B: int, N: int, recompute: bool = True) -> float:
        """The adapters' memory traffic per optimizer step at the achieved bandwidth: the adapted
        linears' per token, the adapted parameters' per micro-batch, the adapters' AdamW once."""
        passes, targets = 2 if recompute else 1, self.lora_targets
        per_token = sum((passes * LORA_PASS_BYTES[0] + LORA_BACKWARD_BYTES[0]) * layer.linear_in
                        + (passes * LORA_PASS_BYTES[1] + LORA_BACKWARD_BYTES[1]) * layer.linear_out
                        for layer in targets.layers)
        per_micro = (passes * PARAM_PASS_BYTES + PARAM_BACKWARD_BYTES) * targets.param_numel
        total = N * (B * self.seq * per_token + per_micro) + ADAPTER_STEP_BYTES * self.adapter_params
        return total / (self.rates["gpu_hbm_gbs"] * 1e9 * HBM_EFFICIENCY)

    def adapter_product_seconds(self, B: int, N: int, recompute: bool = True) -> float:
        """The adapters' products per optimizer step: the linears' in fp32, 2 FLOPs per adapter
        parameter per token in each forward, 4 in the backward (both of each adapter's
        gradients); an adapted parameter's per micro-batch in its dtype (bf16), 2 r per element
        for W + B A in each pass, 4 r in the backward."""
        rates, passes, targets = self.rates, 2 if recompute else 1, self.lora_targets
        linear = N * B * self.seq * (2 * passes + 4) * targets.linear_params
        params = N * (2 * passes + 4) * targets.param_rank_numel
        return (linear / (rates["gpu_fp32_tflops"] * 1e12 * rates["gpu_efficiency"])
                + params / (rates["gpu_tflops"] * 1e12 * rates["gpu_efficiency"]))

    def adapter_seconds(self, B: int, N: int, recompute: bool = True) -> float:
        """The adapters' GPU time per optimizer step: their memory traffic, or their fp32 products
        where the rank makes those the longer (from about r = 90 at the 8B shape on the H200)."""
        return max(self.adapter_traffic_seconds(B, N, recompute), self.adapter_product_seconds(B, N, recompute))

    def gpu_seconds(self, B: int, N: int, recompute: bool = True) -> float:
        return super().gpu_seconds(B, N, recompute) + self.adapter_seconds(B, N, recompute)

    def traffic(self, B: int, N: int, tier: str, res: tuple[bool, int] = (False, 0)) -> tuple[int, int]:
        """Bytes host-to-device and device-to-host per optimizer step (steady state).

        A frozen layer's copy never goes stale (its version does not change), so the window's
        layers stay in their slots: the last ones from the forward into the backward, the first
        ones from a backward into the next forward; every other layer crosses for the forward and
        for the recompute. The head stays in its slot. Only the embedding rows and the layer
        inputs cross besides; nothing of the base crosses back."""
        shape, TH = self.s, B * self.seq * self.s.hidden
        layers = 2 * max(0, shape.layers - self.window) * shape.layer_params * self.base_bytes
        acts = 2 * (shape.layers - 1) * TH if tier in ("cpu", "nvme") else 0
        # a trained lm_head: its bf16 gradient out per micro-batch, its updated weights in once per
        # step; a trained embedding: its rows' fp32 gradient out
        head = 2 * self.trained_head_params
        rows = 4 * TH if self.trained_embed_params else 0
        return N * (layers + 4 * TH + acts) + head, N * (acts + head + rows)

    def times(self, B: int, N: int, tier: str, deferred: bool | None = None,
              res: tuple[bool, int] = (False, 0), disk_layers: int = 0) -> dict:
        """As `Estimator.times`; the `cpu` term is the modules_to_save copies' AdamW, absent without them."""
        out = super().times(B, N, tier, False)
        if self.trained_params:
            out["cpu"] = self.trained_params / (self.rates["adam_gps"] * 1e9)
        else:
            del out["cpu"]
        return out


def advise_lora(plan, est: LoraEstimator) -> list[str]:
    """What to change in a LoRA plan, from its shortfalls and its binding term."""
    shape, out, N, tier = plan.shape, [], plan.gradient_accumulation_steps, plan.activation_tier
    bf16 = (f"get_peft_model before slide() keeps the frozen layers and head in bf16 (saves "
            f"{gib((est.base_bytes - 2) * est.frozen_params)} of host memory and halves their copies)"
            if est.base_bytes > 2 else None)
    if plan.host_fits is False:
        fixes = [bf16] if bf16 else []
        acts = plan.host[f"layer inputs ({tier} tier)"]
        if tier == "cpu" and acts:
            if est.gpu_peak(plan.batch, "device") <= plan.gpu_limit:
                fixes.append(f"activation_tier='device' saves {gib(acts)} (the GPU has room for them)")
            fixes.append(f"activation_tier='nvme' saves {gib(acts - est.layer_inputs_host(plan.batch, 'nvme'))} "
                         f"(costs about {est.times(plan.batch, N, 'nvme')['disk']:.1f} s of disk time per step)")
        if plan.max_batch_host and plan.max_batch_host < plan.batch:
            fixes.append(f"batch {plan.max_batch_host} fits")
        out.append(f"host memory short by {gib(plan.host_total - plan.host_mem_bytes)}"
                   + (": " + "; ".join(fixes) if fixes else ": use a host with more memory or a smaller model"))
    if not plan.gpu_fits:
        max_gpu = plan.max_batch_gpu
        if max_gpu >= 1:
            out.append(f"GPU memory short by {gib(plan.gpu_peak - plan.gpu_limit)} at batch {plan.batch}: "
                       f"the largest batch that fits is {max_gpu}; batch {max_gpu} with "
                       f"gradient_accumulation_steps={math.ceil(plan.batch * N / max_gpu)} "
                       f"keeps about {plan.batch * N} sequences per step (the adapters' gradients are summed on "
                       "the GPU)")
        else:
            out.append(f"GPU memory short by {gib(plan.gpu_peak - plan.gpu_limit)} even at batch 1: lower seq, a lower "
                       "rank, window=1, or a GPU with more memory")
    times = plan.times
    if plan.bound_by == "pcie":
        hiding_batch = est.hiding_batch(N, tier, batch_limit(plan.max_batch_gpu, plan.max_batch_host))
        base = f"the frozen base crosses PCIe twice per micro-batch whatever its size ({times['pcie']:.2f} s)"
        if hiding_batch > plan.batch:
            out.append(f"PCIe-bound: {base}; raise the batch to {hiding_batch} to hide it behind the GPU's compute "
                       f"({est.times(hiding_batch, N, tier)['gpu']:.2f} s at batch {hiding_batch})")
        elif hiding_batch and not gpu_binds(est.times(hiding_batch, N, tier)):
            out.append(f"PCIe-bound at the largest batch that fits ({hiding_batch}): {base}; a larger window re-sends "
                       "fewer layers")
        if bf16:
            out.append(bf16)
        if tier == "cpu" and est.gpu_peak(plan.batch, "device") <= plan.gpu_limit:
            out.append("activation_tier='device' fits on this GPU and takes the layer inputs off PCIe")
    elif plan.bound_by == "disk":
        out.append(f"disk-bound: the nvme tier writes and reads "
                   f"{gib(2 * shape.layers * plan.batch * plan.seq * shape.hidden * N)} per step; "
                   f"activation_tier='cpu' needs {gib(est.layer_inputs_host(plan.batch, 'cpu'))} of host memory "
                   "instead")
    else:
        products = est.adapter_product_seconds(plan.batch, N) >= est.adapter_traffic_seconds(plan.batch, N)
        out.append(f"GPU-bound: the frozen base's copies hide behind the compute; {plan.adapter_s:.2f} s of the "
                   f"{times['gpu']:.2f} s is the adapters' work (PEFT runs them in fp32; "
                   + ("at this rank their products bind: a lower rank is faster)" if products else
                      "their memory traffic binds, not their FLOPs)"))
    if bf16 and plan.host_fits is not False and plan.bound_by != "pcie":
        out.append(bf16)
    return out
