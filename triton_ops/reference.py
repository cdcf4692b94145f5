"""Pure-torch reference implementations of the fused ops.

They are the test oracle for the Triton kernels, the benchmark baseline, and the fallback where
Triton or a GPU is absent. Each function computes the same mathematics as its kernel, with the
casting of the Hugging Face modules it replaces (`LlamaRMSNorm`, Gemma's (1 + w) `Gemma3RMSNorm`,
`apply_rotary_pos_emb`, `LlamaMLP`'s and `Gemma3MLP`'s activations, the causal-LM loss).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "geglu",
    "linear_cross_entropy",
    "token_statistics",
    "LinearCrossEntropyFunction",
    "loss_denominator",
    "rms_norm",
    "rope",
    "swiglu",
    "E4M3_MAX",
    "FP8_SCALE_EPS",
    "fp8_scales",
    "fp8_quantize_rows",
    "fp8_quantize_cols_t",
]


def loss_denominator(labels: torch.Tensor, ignore_index: int, reduction: str, num_items_in_batch) -> float | torch.Tensor:
    """What the summed token losses are divided by, as Hugging Face's causal-LM loss does it."""
    if reduction == "sum":
        return 1.0
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            return num_items_in_batch.to(device=labels.device, dtype=torch.float32)
        return float(num_items_in_batch)
    # HF's mean over the non-ignored tokens (NaN when there are none, as F.cross_entropy gives).
    return (labels != ignore_index).sum().to(torch.float32)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(hidden @ weight.T, labels), chunked over tokens; gradients computed in forward.

    hidden (T, H), weight (V, H), labels (T,) int64. The (T, V) logits are never held whole:
    each chunk of `chunk_tokens` rows is projected, soft-maxed in fp32 and turned into its
    gradient contribution at once. The loss ends the graph, so backward only scales.

    With z = logits (optionally soft-capped: z = c * tanh(x / c)), lse = logsumexp(z) and
    target y, the token loss is `lse - z_y + z_loss * lse**2` and its gradient with respect to
    the logits is `softmax(z) * (1 + 2 * z_loss * lse) - onehot(y)`, times `1 - tanh**2` when
    capped. Ignored tokens contribute zero to the loss and to every gradient. With
    `token_weights` w, each token's loss and gradient are multiplied by w_t instead of divided by
    the mean's denominator.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, num_items_in_batch, softcap, z_loss, chunk_tokens,
                token_weights=None):
        T, H = hidden.shape
        denom = loss_denominator(labels, ignore_index, reduction, num_items_in_batch) if token_weights is None else 1.0
        need_dh = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        dh = torch.zeros_like(hidden) if need_dh else None
        acc = torch.promote_types(weight.dtype, torch.float32)    # fp32, or fp64 for an fp64 oracle
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        chunk = int(chunk_tokens or T or 1)
        for s in range(0, T, chunk):
            h = hidden[s:s + chunk]                                   # (C, H)
            y = labels[s:s + chunk]                                   # (C,)
            logits = (h @ weight.t()).to(acc)                         # (C, V) fp32
            if softcap is not None:
                t = torch.tanh(logits / softcap)
                logits = softcap * t
            lse = torch.logsumexp(logits, dim=-1)                     # (C,)
            valid = y != ignore_index
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            target = logits.gather(1, safe_y[:, None]).squeeze(1)
            tok_loss = lse - target
            if z_loss:
                tok_loss = tok_loss + z_loss * lse * lse
            w = None if token_weights is None else token_weights[s:s + chunk].to(acc)   # (C,)
            if w is not None:
                tok_loss = tok_loss * w
            total += torch.where(valid, tok_loss, torch.zeros_like(tok_loss)).sum()
            if not (need_dh or need_dw):
                continue
            g = torch.softmax(logits, dim=-1)                          # (C, V) d lse / d logits
            if z_loss:
                g = g * (1.0 + 2.0 * z_loss * lse)[:, None]
            g.scatter_add_(1, safe_y[:, None], -torch.ones_like(lse)[:, None])
            if softcap is not None:
                g = g * (1.0 - t * t)
            # Ignored rows are exactly zero (not 0/0 when every token of the batch is ignored).
            g = g / denom if w is None else g * w[:, None]
            g = torch.where(valid[:, None], g, torch.zeros_like(g))
            if need_dh:
                dh[s:s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_dw:
                dw += g.t() @ h.to(acc)
        loss = (total / denom).to(torch.float32)
        ctx.save_for_backward(dh if dh is not None else torch.empty(0), dw.to(weight.dtype) if dw is not None else torch.empty(0))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        gh = dh * grad_loss.to(dh.dtype) if ctx.needs_input_grad[0] else None
        gw = dw * grad_loss.to(dw.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch=None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    chunk_tokens: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels` without materializing the logits.

    Args:
        hidden: (T, H) final hidden states.
        weight: (V, H) lm_head weight.
        labels: (T,) target ids; `ignore_index` entries contribute nothing.
        reduction: "mean" (over non-ignored tokens, or over `num_items_in_batch` when given) or "sum".
        num_items_in_batch: HF's token count across gradient-accumulation micro-batches.
        softcap: optional logit soft-capping, logits = softcap * tanh(logits / softcap).
        z_loss: coefficient of the auxiliary lse**2 term.
        chunk_tokens: tokens per chunk (default: 4096 rows at a time).
        token_weights: optional (T,) fp32 weight of each token's loss: the loss is then
            `sum_t token_weights[t] * loss_t` (`reduction` and `num_items_in_batch` are not used),
            the gradient of any loss that is a function of the per-token log-probabilities
            (w_t = -d loss / d log p_t).

    Returns:
        Scalar fp32 loss; its backward yields the gradients already computed in forward.
    """
    if chunk_tokens is None:
        chunk_tokens = 4096
    return LinearCrossEntropyFunction.apply(
        hidden, weight, labels, ignore_index, reduction, num_items_in_batch, softcap, z_loss, chunk_tokens,
        token_weights,
    )


@torch.no_grad()
def token_statistics(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                     chunk_tokens: int | None = None, softcap: float | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token statistics of the distribution `softmax(hidden @ weight.T)`, without the (T, V) logits.

    Args:
        hidden: (T, H) final hidden states.
        weight: (V, H) lm_head weight.
        labels: (T,) target ids; `ignore_index` entries get zeros (False).
        chunk_tokens: tokens per chunk (default: as many as make 256 MiB of fp32 logits, so that
            the few (C, V) temporaries stay near 1 GiB whatever the vocabulary).
        softcap: optional logit soft-capping, logits = softcap * tanh(logits / softcap) (as
            `linear_cross_entropy`'s).

    Returns:
        (T,) each, fp32 unless said: `log_probs` log p(label); `entropy` of the distribution;
        `is_top1` (bool) the label is the most likely token; `mean_logits` the logits' mean over
        the vocabulary; `log_sum_sq_probs` log(sum_v p_v**2). No gradient.
    """
    T, V = hidden.shape[0], weight.shape[0]
    chunk = int(chunk_tokens or max(64, (256 << 20) // (4 * V) // 64 * 64))
    acc = torch.promote_types(weight.dtype, torch.float32)
    out = [torch.zeros(T, dtype=torch.float32, device=hidden.device) for _ in range(5)]
    out[2] = out[2].bool()
    log_probs, entropy, is_top1, mean_logits, log_sum_sq = out
    for s in range(0, T, chunk):
        y = labels[s:s + chunk]                                               # (C,)
        valid = y != ignore_index
        logits = (hidden[s:s + chunk].to(weight.dtype) @ weight.t()).to(acc)  # (C, V)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        lsm = torch.log_softmax(logits, dim=-1)
        safe_y = torch.where(valid, y, torch.zeros_like(y))
        log_probs[s:s + chunk] = torch.where(valid, lsm.gather(1, safe_y[:, None]).squeeze(1), 0.0).float()
        entropy[s:s + chunk] = torch.where(valid, -(lsm.exp() * lsm).sum(-1), 0.0).float()
        is_top1[s:s + chunk] = valid & (logits.argmax(-1) == y)
        mean_logits[s:s + chunk] = torch.where(valid, logits.mean(-1), 0.0).float()
        log_sum_sq[s:s + chunk] = torch.where(valid, torch.logsumexp(2 * lsm, dim=-1), 0.0).float()
    return log_probs, entropy, is_top1, mean_logits, log_sum_sq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: bool = False) -> torch.Tensor:
    """RMS normalization with Hugging Face Llama/Qwen casting, or with Gemma's (1 + w) and casting.

    Llama (offset False): y = weight * (x_f32 * rsqrt(mean(x_f32**2, -1) + eps)).to(x.dtype); the
    product follows torch type promotion, so a float32 weight on bfloat16 input yields float32.
    Gemma (offset True, `Gemma3RMSNorm`): y = (x_f32 * rsqrt(mean(x_f32**2, -1) + eps)
    * (1 + weight_f32)).to(x.dtype): no rounding before the product, the output in x's dtype.

    Args:
        x: (..., H) input.
        weight: (H,) scale (with `offset`, the scale is 1 + weight).
        eps: added to the mean square.
        offset: Gemma's (1 + weight) scale and casting.

    Returns:
        (..., H) normalized tensor of dtype promote(x.dtype, weight.dtype), x.dtype with `offset`.
    """
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    if offset:
        return (xf * (1.0 + weight.float())).type_as(x)
    return weight * xf.to(input_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys, as HF's `apply_rotary_pos_emb`.

    out = x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) on the two halves
    of the head dimension. Out of place (the Triton kernel works in place).

    Args:
        q: (B, Hq, S, D) queries (or (B, S, Hq, D) with unsqueeze_dim=2).
        k: (B, Hk, S, D) keys; Hk may differ from Hq (grouped-query attention).
        cos, sin: (B or 1, S, D) tables, as HF's rotary embedding returns them.
        unsqueeze_dim: the head axis of q and k (1 or 2).

    Returns:
        (q_rotated, k_rotated).
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, the activation of the Llama/Qwen/Mistral MLP.

    Args:
        gate: (..., I) output of gate_proj.
        up: (..., I) output of up_proj.

    Returns:
        (..., I) tensor of the inputs' dtype.
    """
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, the activation of the Gemma MLP (`hidden_activation` "gelu_pytorch_tanh").

    Args:
        gate: (..., I) output of gate_proj.
        up: (..., I) output of up_proj.

    Returns:
        (..., I) tensor of the inputs' dtype: the activation is rounded to it before the product,
        as HF's `act_fn(gate) * up`.
    """
    return F.gelu(gate, approximate="tanh") * up


E4M3_MAX = 448.0              # torch.finfo(torch.float8_e4m3fn).max
FP8_SCALE_EPS = 1e-12         # the amax floor of torchao's amax_to_scale (no division by zero)


def fp8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-wise e4m3 scales of torchao's float8 "rowwise" recipe, from fp32 row maxima.

    scale = 448 / max(amax, 1e-12), divided in float64 and rounded to float32 (as torchao's
    `amax_to_scale`), then rounded down to a power of two (`round_scales_to_power_of_2`) by
    clearing its mantissa bits. torchao writes that rounding `exp2(floor(log2(s)))`; the bit form
    is the exact floor where the float32 log2 rounds a value just below 2^k up to k (the scale
    is then 2x larger and the row's amax saturates at 448: the only difference).

    Args:
        amax: (..., 1) float32 maxima of |x| along the reduction dimension.

    Returns:
        (scale, inverse): float32, powers of two; q = x * scale, and x ~ q * inverse exactly as
        `torch._scaled_mm` reads its `scale_a` / `scale_b`.
    """
    scale = (E4M3_MAX / amax.double().clamp(min=FP8_SCALE_EPS)).float()
    scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale, scale.reciprocal()


def fp8_quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (M, K) to e4m3 with one scale per row (amax along K, the reduction dimension).

    Args:
        x: (M, K) tensor.
        amax: (M,) or (M, 1) float32 row maxima of |x| already known (they must be exactly
            those), or None to take them here.

    Returns:
        (q, inverse): q (M, K) float8_e4m3fn, row-major; inverse (M, 1) float32, so that
        x ~ q.float() * inverse. Values beyond +-448 after scaling saturate (torchao's
        `to_fp8_saturated`); the cast rounds to nearest even.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if amax is None else amax.float().reshape(-1, 1)
    scale, inverse = fp8_scales(amax)
    q = (xf * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), inverse


def fp8_quantize_cols_t(x: torch.Tensor, pad_to: int = 1,
                        amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (R, C) along R (one scale per column) and write it transposed: (C, R) row-major.

    This is the column-major operand `torch._scaled_mm` takes as its second argument
    (`out.t()` is (R, C) with the layout it wants), for the GEMMs that reduce over R: the
    weight in dgrad (R = out features), the gradient and the input in wgrad (R = tokens).

    Args:
        x: (R, C) tensor.
        pad_to: R is padded with zero columns of the output to a multiple of this (16 for
            `torch._scaled_mm`); zeros change neither a maximum nor a product.
        amax: (C,) float32 column maxima of |x| already known (exactly those), or None.

    Returns:
        (q, inverse): q (C, R_padded) float8_e4m3fn; inverse (C, 1) float32.
    """
    q, inverse = fp8_quantize_rows(x.t(), amax)
    pad = -q.shape[1] % pad_to
    if pad:
        q = torch.cat([q, q.new_zeros(q.shape[0], pad)], dim=1)
    return q, inverse


def causal_conv(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    """SiLU (when `silu`) of the causal depthwise convolution of x (B, C, T) by weight (C, K), as
    transformers' `causal_conv1d_fn` of the linear-attention layers computes it without a bias:
    the convolution in weight's dtype over x zero-padded by K - 1 positions on the left, the
    activation, then the result in x's dtype."""
    K = weight.shape[1]
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), padding=K - 1, groups=x.shape[1])[..., :x.shape[-1]]
    if silu:
        out = F.silu(out)
    return out.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(weight * RMSNorm(x)) * SiLU(gate) over the last dimension, as Qwen3.5's
    `Qwen3_5RMSNormGated` computes it: the norm in fp32 rounded to x's dtype, the weight's product
    in the tensors' dtype, the gate's SiLU in fp32, the result in x's dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


def qk_l2norm(x: torch.Tensor, repeat: int = 1, scale: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """Queries or keys (B, T, Hk, D) as the chunked gated delta rule takes them: each head repeated
    `repeat` times, heads first in fp32 (B, Hk * repeat, T, D), each row L2-normalized
    (transformers' l2norm: x * rsqrt(sum(x**2) + eps)), then multiplied by `scale` (left out at 1)."""
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=2)
    x = x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    x = x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
    return x * scale if scale != 1.0 else x
