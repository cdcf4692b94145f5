"""The planner's free constants: hardware peaks, efficiencies and per-token counts, calibrated on
measurements of the Llama-3.2-3B and Llama-3.1-8B shapes on an H200 (docs/planner.md,
"Calibration"; `plan_estimate.Estimator` applies them).
"""
from __future__ import annotations

from ..host.memory import GiB

__all__ = [
    "PEAK_TFLOPS", "GPU_EFFICIENCY", "ACT_HIDDEN", "ACT_INTER", "PROCESS_HOST_BYTES", "NVME_BUFFERS",
    "GRAD_BYTES", "GPU_USABLE", "GPU_CONTEXT_BYTES", "DUPLEX", "ADD_VS_ADAM", "ADAM_GPS", "FP8_GEMM_SPEEDUP",
    "FP8_QUANT_HBM_SHARE",
    "ENGINE_EFFICIENCY", "FORWARD_SHARE", "DEVICE_UPDATE_LINK", "RESERVED_VS_ALLOCATED",
    "LINEAR_ATTENTION_S_PER_TOKEN", "ACT_LINEAR",
]

# Calibration (docs/planner.md, "Calibration"). Change them together with the table there.
PEAK_TFLOPS = 989.4          # dense bf16 peak of an H100 / H200 SXM, as benchmarks' MFU column
GPU_EFFICIENCY = 0.61        # achieved / peak FLOPs of the layer and head kernels (H200: 0.60-0.62)
ACT_HIDDEN, ACT_INTER = 11, 4  # bf16 tensors per token live while one layer is recomputed + backpropagated
PROCESS_HOST_BYTES = int(1.7 * GiB)   # torch, the CUDA runtime, Python and transformers, resident (at 8B)
# Pinned bounce buffers of the nvme activation tier (activations.FileTier).
NVME_BUFFERS = 4
GRAD_BYTES = 2               # a layer's gradient crosses PCIe in the compute dtype (bf16 on CUDA)
GPU_USABLE = 0.90            # share of the card the caching allocator can fill (fragmentation)
GPU_CONTEXT_BYTES = GiB // 2  # CUDA context and library workspaces, outside the allocator
DUPLEX = 0.79                # both directions at once: 43.2 of 54.6 GB/s each way (docs/benchmarks.md, "The machine")
ADD_VS_ADAM = 28 / 12        # an fp32 accumulate streams <= 12 B/param, a fused AdamW step 28 B/param
ADAM_GPS = 3.5               # the H200 machine's host AdamW, G params/s, the CPU term was fitted with (torch's fused)
# FP8 (e4m3, row-wise scales, torch._scaled_mm) over bf16 GEMM time at the Llama-3.1-8B layer shapes
# of a 16 x 2048 micro-batch on the H200 (docs/fp8.md, "Planner").
FP8_GEMM_SPEEDUP = 1.70
FP8_QUANT_HBM_SHARE = 0.75   # achieved share of the HBM peak by the FP8 quantization passes (as the LoRA kernels')
ENGINE_EFFICIENCY = {"gpu": 0.92, "pcie": 0.80, "cpu": 0.65, "disk": 0.90}  # bound / measured step
FORWARD_SHARE = 0.25  # the forward's part of the GPU time: F of F + (recompute F + backward 2F)
DEVICE_UPDATE_LINK = 35 / 54.6  # h2d rate of a clipping forward with device updates (budget.PCIE_BOTH_WAYS) / one-way
RESERVED_VS_ALLOCATED = 1.10  # reserved peak over allocated, expandable segments on (see docs/planner.md)
# GPU seconds per token of one linear-attention layer beyond its projections' FLOPs: the chunked gated
# delta rule, the causal conv, the gating and norms, forward + recompute + backward (Qwen3.5-9B shape,
# batch 16 x 2048, the project's rule, convolution, gated norm and q/k norm kernels, an H100: 30.5 +
# 94.3 ms a layer less 29 ms of projections, less the 14.5 ms that the UT transform's inverse saves;
# docs/planner.md, "Calibration").
LINEAR_ATTENTION_S_PER_TOKEN = 2.5e-6
# fp32 tensors of the value width (value heads x their dim) per token that a linear-attention layer's
# recompute + backward holds beyond ACT_HIDDEN H + ACT_INTER I: the Qwen3.5-9B shape at batch 16 under
# 24 GiB, no resident unit, 20.3 GiB allocated at the peak on an H100 with the q/k norm kernel (docs/planner.md,
# "Calibration").
ACT_LINEAR = 19
