"""nn.Module front ends of the fused ops: RMSNorm, SwiGLU (the gated MLP) and the loss head.

They call the dispatching functionals of `triton_ops`, so the same module runs the Triton
kernels on CUDA and the torch reference elsewhere. Parameter names match Hugging Face's
(`weight`, `gate_proj`, `up_proj`, `down_proj`), so state dicts load unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

import triton_ops

__all__ = ["LinearCrossEntropyLoss", "RMSNorm", "SwiGLU"]


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x**2, -1) + eps)).to(x.dtype), as LlamaRMSNorm.

    Args:
        hidden_size: H, the normalized (last) dimension.
        eps: added to the mean square.
        in_place_backward: write dx over the incoming gradient (right when only linear layers
            read the output, as in the decoder layers).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, in_place_backward: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.in_place_backward = in_place_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) -> (..., H)."""
        return triton_ops.rms_norm(x, self.weight, self.variance_epsilon, self.in_place_backward)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with the activation fused, as LlamaMLP.

    The activation's backward overwrites the two projections' outputs (temporaries of this
    forward) with their gradients, so the MLP holds no extra (..., I) buffer in backward.

    Args:
        hidden_size: H.
        intermediate_size: I.
        bias: bias on the three projections.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) -> (..., H)."""
        return self.down_proj(triton_ops.swiglu(self.gate_proj(x), self.up_proj(x), in_place_backward=True))


class LinearCrossEntropyLoss(nn.Module):
    """Loss head: `linear_cross_entropy(hidden, weight, labels)` with fixed options.

    Args:
        ignore_index: label value that contributes nothing.
        reduction: "mean" or "sum".
        softcap: logit soft-capping, or None.
        z_loss: coefficient of the lse**2 term.
        chunk_tokens: tokens per chunk (default: automatic).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", softcap: float | None = None,
                 z_loss: float = 0.0, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.softcap, self.z_loss, self.chunk_tokens = softcap, z_loss, chunk_tokens

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                num_items_in_batch=None) -> torch.Tensor:
        """hidden (..., H), weight (V, H), labels (...) -> scalar fp32 loss."""
        return triton_ops.linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
            ignore_index=self.ignore_index, reduction=self.reduction, num_items_in_batch=num_items_in_batch,
            softcap=self.softcap, z_loss=self.z_loss, chunk_tokens=self.chunk_tokens,
        )
