"""Planner: will a model fit, with which batch, and how fast, from its config.json alone.

The estimate follows the engine's allocations (engine.py, store.py, activations.py) and the
performance model of DESIGN.md section 6; its free constants are calibrated on measurements
of the Llama-3.2-3B and Llama-3.1-8B shapes on an H200 (docs/planner.md has the table). Nothing
here touches a GPU or builds a model: the parameter counts come from the config's sizes.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch

from .budget import DEVICE_PIECE, balanced_share, pick_device_units, plan_resident, resident_bytes_per_param
from .memory import COPY_CHUNK, GiB, available_host_bytes
from .models import LayerDims, get_family

__all__ = ["ModelShape", "Plan", "load_model_config", "model_shape", "plan"]

TIERS = ("cpu", "device", "nvme")

# Calibration (docs/planner.md, "Calibration"). Change them together with the table there.
PEAK_TFLOPS = 989.4          # dense bf16 peak of an H100 / H200 SXM, as benchmarks' MFU column
GPU_EFFICIENCY = 0.61        # achieved / peak FLOPs of the layer and head kernels (H200: 0.60-0.62)
ACT_HIDDEN, ACT_INTER = 11, 4  # bf16 tensors per token live while one layer is recomputed + backpropagated
PROCESS_HOST_BYTES = int(1.7 * GiB)   # torch, the CUDA runtime, Python and transformers, resident (at 8B)
# Pinned bounce buffers of the nvme activation tier (activations.FileTier).
NVME_BUFFERS = 4
GRAD_BYTES = 2               # a layer's gradient crosses PCIe in the compute dtype (bf16 on CUDA)
GPU_USABLE = 0.85            # share of the card the caching allocator can fill (fragmentation)
GPU_CONTEXT_BYTES = GiB // 2  # CUDA context and library workspaces, outside the allocator
DUPLEX = 0.79                # both directions at once: 43.2 of 54.6 GB/s each way (DESIGN.md section 6)
ADD_VS_ADAM = 28 / 12        # an fp32 accumulate streams <= 12 B/param, a fused AdamW step 28 B/param
ENGINE_EFFICIENCY = {"gpu": 0.92, "pcie": 0.80, "cpu": 0.65, "disk": 0.65}  # bound / measured step
FORWARD_SHARE = 0.25  # the forward's part of the GPU time: F of F + (recompute F + backward 2F)
DEVICE_UPDATE_LINK = 35 / 54.6  # h2d rate of a clipping forward with device updates (budget.PCIE_BOTH_WAYS) / one-way
RESERVED_VS_ALLOCATED = 1.45  # reserved peak over allocated, expandable segments on (see docs/planner.md)


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-layout decoder: what the engine slides, in parameters."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    layer_params: int        # one decoder layer
    embed_params: int        # the token embedding (V * H)
    head_params: int         # final norm + lm_head (the norm alone when tied)

    @property
    def n_params(self) -> int:
        return self.embed_params + self.layers * self.layer_params + self.head_params

    @property
    def head_slot_params(self) -> int:
        """Parameters in the GPU head slot: norm + lm_head, or norm + the tied embedding."""
        return self.head_params + (self.embed_params if self.tied else 0)


def load_model_config(config_or_path) -> dict:
    """The config as a dict, from a dict, an HF config object, a model directory or a config.json path."""
    if isinstance(config_or_path, dict):
        return dict(config_or_path)
    if hasattr(config_or_path, "to_dict"):
        return config_or_path.to_dict()
    path = os.fspath(config_or_path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{os.path.dirname(path)!r} holds no config.json: pass a model directory "
                                    "with a config.json, or the path of a config.json")
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} does not exist: pass a model directory with a config.json, or the path "
                                "of a config.json (hub ids are not fetched: download the model's config.json first)")
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path!r} does not hold a JSON object")
    return cfg


def model_shape(cfg: dict) -> ModelShape:
    """Count the parameters of a supported family from its config (HF's layouts, biases and norms)."""
    model_type = cfg.get("model_type")
    family = get_family(model_type)      # ValueError naming the supported model types
    try:
        H, I, L, V = (int(cfg[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
        nh = int(cfg["num_attention_heads"])
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}, which a {model_type} config must have") from None
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or H // nh)
    layer = family.layer_params(cfg, LayerDims(hidden=H, intermediate=I, q=nh * hd, kv=nkv * hd, head_dim=hd))
    tied = bool(cfg.get("tie_word_embeddings", True))               # PretrainedConfig's default
    return ModelShape(model_type, H, I, L, V, nh, nkv, hd, tied, layer_params=layer, embed_params=V * H,
                      head_params=H + (0 if tied else V * H))


@dataclass
class Plan:
    """The planner's answer for one model and one setting. Sizes in bytes, times in seconds."""

    shape: ModelShape
    batch: int
    seq: int
    gradient_accumulation_steps: int
    max_grad_norm: float | None
    window: int
    activation_tier: str
    grad_buffers: int
    gpu_mem_bytes: int
    host_mem_bytes: int | None        # None: unknown (no limit checked)
    host_mem_source: str
    gpu_mem_source: str
    rates: dict                       # pcie_gbs, adam_gps, gpu_tflops, gpu_efficiency, nvme_*_gbs
    batch_chosen: bool = False        # the batch was picked by the planner
    host: dict = field(default_factory=dict)       # name -> bytes
    gpu_fixed: dict = field(default_factory=dict)  # name -> bytes, held all step
    gpu_phases: dict = field(default_factory=dict)  # name -> bytes, the larger one adds to the fixed part
    host_total: int = 0
    host_steady: int = 0              # after the first step: the resident units' host pages released
    gpu_peak: int = 0
    gpu_limit: int = 0                # bytes the allocator may fill on this card
    max_batch_gpu: int = 0
    max_batch_host: int | None = None
    flops_per_token: float = 0.0
    h2d_bytes: int = 0                # per optimizer step
    d2h_bytes: int = 0
    times: dict = field(default_factory=dict)      # term -> seconds per optimizer step
    gpu_resident_s: float = 0.0
    resident_embedding: bool = False  # units the engine keeps and updates on the GPU (SlideConfig.resident_*)
    resident_layers: int = 0
    bound_s: float = 0.0
    bound_by: str = ""
    expected_step_s: float = 0.0
    advice: list = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq * self.gradient_accumulation_steps

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_mem_bytes is None else self.host_total <= self.host_mem_bytes

    @property
    def gpu_fits(self) -> bool:
        return self.gpu_peak <= self.gpu_limit

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits is not False

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second at the step-time bound (a ceiling)."""
        return self.tokens_per_step / self.bound_s

    @property
    def expected_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.expected_step_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"]["n_params"] = self.shape.n_params
        d.update(tokens_per_step=self.tokens_per_step, host_fits=self.host_fits, gpu_fits=self.gpu_fits,
                 fits=self.fits, tokens_per_s=self.tokens_per_s, expected_tokens_per_s=self.expected_tokens_per_s)
        return d

    def report(self) -> str:
        """The plan as text: memory, largest batch, step-time terms, advice."""
        return _format_report(self)




def _check(name, value, ok, what):
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class _Estimator:
    """The formulas, for one model, sequence length, window and set of rates (docs/planner.md)."""

    s: ModelShape
    seq: int
    window: int
    grad_buffers: int
    rates: dict

    def host(self, B: int, tier: str, deferred: bool) -> dict:
        s, tok_h = self.s, B * self.seq * self.s.hidden
        # Pinned buffers count their exact size: the engine registers what it allocates
        # (memory.pin_slab), without the caching host allocator's power-of-two rounding.
        # the last layer's input stays on the device (activations.py)
        acts = {"cpu": (s.layers - 1) * 2 * tok_h, "device": 0,
                "nvme": NVME_BUFFERS * 2 * tok_h}[tier]   # nvme: the I/O thread's bounce buffers
        out = {"fp32 masters + Adam m, v (12 B/param)": 12 * s.n_params}
        head = s.head_params + (s.embed_params if s.tied and deferred else 0)
        if deferred:
            out["fp32 gradient accumulator (4 B/param, embedding excluded)"] = 4 * (s.n_params - s.embed_params)
        out.update({
            "embedding gradient (fp32, pinned)": 4 * s.embed_params,
            f"gradient ring ({self.grad_buffers} x largest layer, bf16)":
                GRAD_BYTES * self.grad_buffers * s.layer_params,
            # borrowed from the ring when it fits there (engine: [Why the head's gradient borrows the ring]);
            # a tied lm_head's gradient joins it with accumulation only
            "head host buffer (bf16, pinned)": (0 if head <= self.grad_buffers * s.layer_params else GRAD_BYTES * head),
            "embedding row buffers (2 x B*S*H fp32, pinned)": 2 * 4 * tok_h,
            f"layer inputs ({tier} tier)": acts,
            "process (torch, CUDA runtime, Python)": PROCESS_HOST_BYTES,
        })
        return out

    def gpu(self, B: int, tier: str) -> tuple[dict, dict]:
        """(bytes held all step, bytes of each phase); the peak is the first plus the larger phase."""
        s, T = self.s, B * self.seq
        H, head = s.hidden, s.head_slot_params
        fixed = {
            f"layer slots ({self.window} x largest layer, bf16)": 2 * self.window * s.layer_params,
            "fp32 staging (h2d + d2h chunks)": 2 * 4 * min(max(s.layer_params, head), COPY_CHUNK),
            "head slot (bf16)": 2 * head,
        }
        if tier == "device":
            fixed["layer inputs (device tier)"] = 2 * s.layers * T * H
        # triton_ops' default_chunk_tokens: a (C, V) bf16 buffer of max(T*H, V*H/8) elements, >= 32 MiB
        rows = max(2 * max(T * H, s.vocab * H // 8), 32 << 20) // (2 * s.vocab)
        rows = min(T, max(64, rows // 64 * 64) if rows >= 64 else max(1, rows))
        phases = {
            f"layer recompute + backward (B*S*({ACT_HIDDEN} H + {ACT_INTER} I) bf16)":
                2 * T * (ACT_HIDDEN * H + ACT_INTER * s.intermediate),
            # hidden states: the head's input, its gradient and the norm's output (bf16), the fp32
            # loss-gradient rows, and the last layer's input, kept for its backward
            "head: gradient (bf16), logits chunk, hidden states": 2 * head + 2 * rows * s.vocab + T * (8 * H + 4),
        }
        return fixed, phases

    def gpu_peak(self, B: int, tier: str) -> int:
        fixed, phases = self.gpu(B, tier)
        return sum(fixed.values()) + max(phases.values())

    def flops_per_token(self, recompute: bool = True) -> float:
        """Matmul FLOPs per token: layers 6 N (fwd, bwd) plus the recompute's 2 N less down_proj's
        2 I H (its product is not recomputed), head 6 V H, causal attention (forward 2 S d per
        layer, backward 2.5 x the forward)."""
        s = self.s
        attn = (9 if recompute else 7) * self.seq * s.heads * s.head_dim * s.layers
        lin = 6 * s.layer_params + (2 * (s.layer_params - s.intermediate * s.hidden) if recompute else 0)
        return s.layers * lin + 6 * s.vocab * s.hidden + attn

    def traffic(self, B: int, N: int, tier: str, res: tuple[bool, int] = (False, 0)) -> tuple[int, int]:
        """Bytes host-to-device and device-to-host per optimizer step of N micro-batches
        (res: resident embedding?, resident layers)."""
        s, TH = self.s, B * self.seq * self.s.hidden
        embed_res, k = res
        sent = s.layers - k
        layers = sent * s.layer_params
        # the last layer's input stays on the device, the first is gathered again from a resident embedding
        acts = 2 * max(0, s.layers - 1 - embed_res) * TH if tier in ("cpu", "nvme") else 0
        resent = max(0, sent - self.window) * s.layer_params   # the last `window` layers stay for backward
        head = s.head_slot_params - (s.embed_params if embed_res and s.tied else 0)
        rows = 0 if embed_res else 4 * TH
        h2d = 4 * (layers + resent + head) + rows + acts          # fp32 masters, embedding rows
        # gradients of the units updated on the host (resident ones stay): in the compute dtype
        # into the ring with one micro-batch, fp32 sums into the accumulators with several
        # (engine: [Why gradients cross in the compute dtype]); embedding rows
        d2h = (GRAD_BYTES if N == 1 else 4) * (sent * s.layer_params + head) + rows + acts
        # With accumulation each later micro-batch brings the layers' running sums back in (accumulate.py).
        return N * h2d + (N - 1) * 4 * layers, N * d2h

    def resident_params(self, res: tuple[bool, int]) -> int:
        return (self.s.embed_params if res[0] else 0) + res[1] * self.s.layer_params

    def times(self, B: int, N: int, tier: str, deferred: bool | None = None,
              res: tuple[bool, int] = (False, 0)) -> dict:
        """Seconds per optimizer step of each term of the bound (deferred: default N > 1)."""
        deferred = N > 1 if deferred is None else deferred
        r, s = self.rates, self.s
        h2d, d2h = self.traffic(B, N, tier, res)
        bw, adam = r["pcie_gbs"] * 1e9, r["adam_gps"] * 1e9
        on_cpu = s.n_params - self.resident_params(res)
        layers_on_cpu = on_cpu - (0 if res[0] else s.embed_params)
        out = {
            "gpu": N * B * self.seq * self.flops_per_token() / (r["gpu_tflops"] * 1e12 * r["gpu_efficiency"]),
            "pcie": max(h2d / bw, d2h / bw, (h2d + d2h) / (2 * DUPLEX * bw)),
            # deferred mode: each micro-batch's gradients are copied (first) or added into the host
            # accumulator; with accumulation the GPU adds the layers' (accumulate.py), with clipping
            # alone the device-updated layers' land there directly (device_update.py)
            "cpu": on_cpu / adam + (N * (on_cpu - layers_on_cpu) if N > 1 else
                                    (1 - balanced_share()) * layers_on_cpu if deferred else 0) / (adam * ADD_VS_ADAM),
        }
        if tier == "nvme":
            acts = N * 2 * s.layers * B * self.seq * s.hidden
            out["disk"] = acts / (r["nvme_write_gbs"] * 1e9) + acts / (r["nvme_read_gbs"] * 1e9)
        return out

    def hiding_batch(self, N: int, tier: str, limit: int, deferred: bool | None = None) -> int:
        """Smallest power-of-two batch whose GPU term is the largest, capped at `limit` (0 if < 1)."""
        b = 1
        while b < limit:
            if _gpu_binds(self.times(b, N, tier, deferred)):
                return b
            b *= 2
        return max(0, limit)


def _gpu_binds(times: dict) -> bool:
    return times["gpu"] >= max(times.values())


def _largest(fits, hi: int = 1 << 16) -> int:
    """Largest n in [0, hi] with fits(n), for a monotone fits (0 when even 1 does not)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _batch_limit(max_gpu: int, max_host: int | None) -> int:
    """The largest batch to consider: both memories', or the GPU's when the host cannot fit even batch 1
    (the host advice then says what to change)."""
    return max_gpu if not max_host else min(max_gpu, max_host)


def _default_gpu_gib() -> tuple[float, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB, "this GPU"
    return 24.0, "assumed: no GPU here"


def plan(config_or_path, *, batch: int | None = None, seq: int = 2048, gpu_mem: float | None = None,
         host_mem: float | None = None, pcie_gbs: float = 54.6, adam_gps: float = 3.5,
         gpu_tflops: float = PEAK_TFLOPS, gpu_efficiency: float = GPU_EFFICIENCY,
         gradient_accumulation_steps: int = 1, max_grad_norm: float | None = None, window: int = 2,
         activation_tier: str = "cpu", grad_buffers: int = 4, nvme_write_gbs: float = 1.2,
         nvme_read_gbs: float = 0.9, resident: bool = True) -> Plan:
    """Estimate host and GPU memory, the largest batch and the step time of training a model.

    Args:
        config_or_path: a model directory holding config.json, a config.json path, a dict or an HF config.
        batch: sequences per micro-batch (default: the smallest power of two whose GPU compute
            hides AdamW and the transfers, or the largest that fits when none does).
        seq: tokens per sequence.
        gpu_mem: GPU memory in GiB (default: the current CUDA device's, else 24).
        host_mem: host memory in GiB (default: this machine's MemAvailable).
        pcie_gbs: pinned host<->device bandwidth, GB/s each way (H200 machine: 54.6).
        adam_gps: CPU fused AdamW rate, G parameters/s (H200 machine, 16 cores: 3.5).
        gpu_tflops: the GPU's dense bf16 peak, TFLOPS (H100 / H200 SXM: 989.4).
        gpu_efficiency: achieved share of that peak (calibrated on the H200: 0.61).
        gradient_accumulation_steps, max_grad_norm, window, activation_tier, grad_buffers: as in
            SlideConfig ("auto" means "cpu").
        nvme_write_gbs, nvme_read_gbs: disk rates for the "nvme" activation tier, GB/s.
        resident: model the engine's resident units (SlideConfig.resident_embedding / resident_layers
            "auto"): in what the step leaves free under the card's memory, the embedding then layers
            keep their optimizer state on the GPU and leave the CPU's AdamW and PCIe. The engine
            decides from the reserved peak it measures; the plan from its allocated-peak estimate
            times RESERVED_VS_ALLOCATED. No resident units with gradient accumulation.

    Returns:
        A Plan; `Plan.report()` formats it, `Plan.to_dict()` serialises it.

    Raises:
        FileNotFoundError: no config.json at the path.
        ValueError: an unsupported model_type (the message names the supported ones) or a bad setting.
    """
    shape = model_shape(load_model_config(config_or_path))
    tier = "cpu" if activation_tier == "auto" else activation_tier
    _check("activation_tier", activation_tier, tier in TIERS, f"one of {TIERS}")
    _check("seq", seq, isinstance(seq, int) and seq >= 1, "an int >= 1")
    _check("window", window, isinstance(window, int) and 1 <= window <= 16, "an int in [1, 16]")
    _check("grad_buffers", grad_buffers, isinstance(grad_buffers, int) and grad_buffers >= 1, "an int >= 1")
    N = gradient_accumulation_steps
    _check("gradient_accumulation_steps", N, isinstance(N, int) and N >= 1, "an int >= 1")
    if batch is not None:
        _check("batch", batch, isinstance(batch, int) and batch >= 1, "an int >= 1")
    rates = dict(pcie_gbs=pcie_gbs, adam_gps=adam_gps, gpu_tflops=gpu_tflops, gpu_efficiency=gpu_efficiency,
                 nvme_write_gbs=nvme_write_gbs, nvme_read_gbs=nvme_read_gbs)
    for k, v in rates.items():
        _check(k, v, isinstance(v, (int, float)) and v > 0, "a positive number")
    clip = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else None
    deferred = N > 1 or clip is not None
    gpu_source = "given"
    if gpu_mem is None:
        gpu_mem, gpu_source = _default_gpu_gib()
    _check("gpu_mem", gpu_mem, isinstance(gpu_mem, (int, float)) and gpu_mem > 0, "a positive number of GiB")
    if host_mem is None:
        host_bytes = available_host_bytes()
        host_source = "available here" if host_bytes else "unknown"
    else:
        _check("host_mem", host_mem, isinstance(host_mem, (int, float)) and host_mem > 0, "a positive number of GiB")
        host_bytes, host_source = int(host_mem * GiB), "given"
    est = _Estimator(shape, seq, window, grad_buffers, rates)
    gpu_limit = int(gpu_mem * GiB * GPU_USABLE) - GPU_CONTEXT_BYTES
    # Device buffers of the deferred modes: one layer's fp32 running sum with accumulation
    # (accumulate.py), two sets of fp32 master / gradient / moments pieces with clipping (device_update.py).
    extras = {}
    if N > 1:
        extras["accumulation buffer (fp32, one layer)"] = 4 * shape.layer_params
    if clip is not None:
        extras["device-update buffers (2 x 4 fp32 pieces)"] = 2 * 4 * 4 * min(2 * DEVICE_PIECE, shape.layer_params)
    max_gpu = _largest(lambda b: est.gpu_peak(b, tier) + sum(extras.values()) <= gpu_limit)
    max_host = None if not host_bytes else _largest(lambda b: sum(est.host(b, tier, deferred).values()) <= host_bytes)
    chosen = batch is None
    if chosen:
        batch = est.hiding_batch(N, tier, _batch_limit(max_gpu, max_host), deferred) or 1

    p = Plan(shape, batch, seq, N, clip, window, tier, grad_buffers, int(gpu_mem * GiB), host_bytes or None,
             host_source, gpu_source, rates, batch_chosen=chosen, gpu_limit=gpu_limit, max_batch_gpu=max_gpu,
             max_batch_host=max_host)
    p.host = est.host(batch, tier, deferred)
    p.host_total = sum(p.host.values())
    p.gpu_fixed, p.gpu_phases = est.gpu(batch, tier)
    p.gpu_fixed.update(extras)
    p.gpu_peak = est.gpu_peak(batch, tier) + sum(extras.values())
    p.flops_per_token = est.flops_per_token()
    res = (False, 0)
    if resident and N == 1:
        res = plan_resident(limit_bytes=int(gpu_mem * GiB), peak_bytes=int(p.gpu_peak * RESERVED_VS_ALLOCATED),
                            layer_numel=shape.layer_params, n_layers=shape.layers, embed_numel=shape.embed_params,
                            dtype=torch.bfloat16, clipping=clip is not None)
    p.resident_embedding, p.resident_layers = res
    if res != (False, 0):
        per = resident_bytes_per_param(torch.bfloat16)
        held = ((per + 4) * shape.embed_params if res[0] else 0) + res[1] * shape.layer_params * per
        if res[1]:
            held += (res[1] if clip is not None else 1) * 4 * shape.layer_params     # fp32 gradient buffer(s)
        p.gpu_fixed["resident units (fp32 master, m, v, gradient; bf16 weights)"] = held
        p.gpu_peak += held
    if res[0]:
        # Resident from the first step (engine: [Why the embedding can be resident before the first
        # step]): its moments are never written, its master is given back, its dense gradient and
        # row buffers are never made.
        key = "fp32 masters + Adam m, v (12 B/param)"
        dropped = ("embedding gradient (fp32, pinned)", "embedding row buffers (2 x B*S*H fp32, pinned)")
        p.host = {(k + ", the resident embedding's given back" if k == key else k):
                  (v - 12 * shape.embed_params if k == key else v) for k, v in p.host.items() if k not in dropped}
        acts = f"layer inputs ({tier} tier)"
        if tier == "cpu" and shape.layers > 1:
            # the first layer's input is gathered again from the resident embedding (activations.py)
            p.host[acts] -= 2 * batch * seq * shape.hidden
        p.host_total = sum(p.host.values())
    # Resident layers are updated by the CPU in the first step: their host moments (and, with clipping,
    # accumulators) are released after it.
    p.host_steady = p.host_total - (8 + (4 if clip is not None else 0)) * res[1] * shape.layer_params
    p.h2d_bytes, p.d2h_bytes = est.traffic(batch, N, tier, res)
    p.times = est.times(batch, N, tier, deferred, res)
    p.gpu_resident_s = N * batch * seq * est.flops_per_token(recompute=False) / (
        gpu_tflops * 1e12 * gpu_efficiency)
    p.bound_by = max(p.times, key=p.times.get)
    p.bound_s = p.times[p.bound_by]
    # The file tier reads and writes on a thread of its own: its time overlaps the GPU's, like the
    # other terms (activations.py: [Why the nvme tier's file work is on its own thread]).
    serial = p.times["gpu"]
    if clip is not None:
        # With clipping no host unit can be updated before the backward has ended (the clip factor
        # needs the global norm); their AdamW then paces the next forward. A share of the host-held
        # layers is updated by the GPU as it is copied in (device_update.py): the CPU and the link
        # share that work (docs/benchmarks.md has the measured steps).
        host_params = shape.n_params - est.resident_params(res)
        f = balanced_share()
        layers = (shape.layers - res[1]) * shape.layer_params
        link = layers * (4 * (1 - f) + 16 * f) / (pcie_gbs * 1e9 * DEVICE_UPDATE_LINK)
        adam_after = max((host_params - f * layers) / (adam_gps * 1e9), link)
        # Only the first micro-batch's forward overlaps it.
        first_forward = FORWARD_SHARE * p.times["gpu"] / N
        serial = max(serial, p.times["gpu"] - first_forward + max(first_forward, adam_after))
    p.expected_step_s = max(p.bound_s, serial) / ENGINE_EFFICIENCY[p.bound_by]
    p.advice = _advise(p, est, deferred)
    return p


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _advise(p: Plan, est: _Estimator, deferred: bool) -> list[str]:
    """What to change, from the plan's shortfalls and its binding term."""
    s, out, N, tier = p.shape, [], p.gradient_accumulation_steps, p.activation_tier
    if p.host_fits is False:
        short = p.host_total - p.host_mem_bytes
        fixes = []
        if deferred:
            fixes.append(f"no clipping and no accumulation (max_grad_norm=None, gradient_accumulation_steps=1) "
                         f"saves {_gib(4 * (s.n_params - s.embed_params))}")
        acts = p.host[f"layer inputs ({tier} tier)"]
        if tier == "cpu" and acts:
            if est.gpu_peak(p.batch, "device") <= p.gpu_limit:
                fixes.append(f"activation_tier='device' saves {_gib(acts)} (the GPU has room for them)")
            saved = acts - est.host(p.batch, "nvme", deferred)["layer inputs (nvme tier)"]
            fixes.append(f"activation_tier='nvme' saves {_gib(saved)} (costs about "
                         f"{est.times(p.batch, N, 'nvme')['disk']:.1f} s of disk time per step)")
        if p.grad_buffers > 2:
            fixes.append(f"grad_buffers=2 saves {_gib(4 * (p.grad_buffers - 2) * s.layer_params)}")
        if p.max_batch_host and p.max_batch_host < p.batch:
            fixes.append(f"batch {p.max_batch_host} fits")
        floor = 12 * s.n_params + 4 * s.embed_params + PROCESS_HOST_BYTES
        msg = f"host memory short by {_gib(short)}: " + "; ".join(fixes) if fixes else \
            f"host memory short by {_gib(short)}"
        if p.host_mem_bytes < floor:
            msg += (f". Masters, moments and the embedding gradient alone need {_gib(floor)}: use a host with "
                    "more memory or a smaller model")
        out.append(msg)
    if not p.gpu_fits:
        m = p.max_batch_gpu
        if m >= 1:
            k = math.ceil(p.batch * N / m)
            out.append(f"GPU memory short by {_gib(p.gpu_peak - p.gpu_limit)} at batch {p.batch}: the largest batch "
                       f"that fits is {m}; batch {m} with gradient_accumulation_steps={k} keeps about "
                       f"{p.batch * N} sequences per step (+{_gib(4 * (s.n_params - s.embed_params))} of host "
                       "memory for the accumulator)")
        else:
            out.append(f"GPU memory short by {_gib(p.gpu_peak - p.gpu_limit)} even at batch 1: lower seq, use "
                       "window=1, or a GPU with more memory")
    limit = _batch_limit(p.max_batch_gpu, p.max_batch_host)
    t = p.times
    if p.bound_by in ("cpu", "pcie"):
        what = {"cpu": f"AdamW ({t['cpu']:.2f} s)", "pcie": f"the transfers ({t['pcie']:.2f} s)"}[p.bound_by]
        b = est.hiding_batch(N, tier, limit, deferred)
        tb = est.times(b, N, tier, deferred) if b else {}
        hides = bool(tb) and _gpu_binds(tb)
        if b > p.batch:
            out.append(f"{p.bound_by.upper()}-bound: raise the batch to {b} to hide {what} behind the GPU's "
                       f"compute ({tb['gpu']:.2f} s at batch {b}"
                       + ("" if hides else f", still short of {max(tb.values()):.2f} s") + ")")
        k = next((k for k in range(2, 65) if _gpu_binds(est.times(b, k, tier, True))), None) if b else None
        if b and not hides and p.bound_by == "cpu" and k:
            need = sum(est.host(b, tier, True).values())
            room = ("" if p.host_mem_bytes is None else
                    "; it fits in host memory" if need <= p.host_mem_bytes else
                    f"; that needs {_gib(need)} of host memory, more than the {_gib(p.host_mem_bytes)} there is")
            out.append(f"CPU-bound at the largest batch that fits ({b}): gradient_accumulation_steps={k} hides "
                       f"AdamW behind {k} micro-batches (the fp32 accumulator adds "
                       f"{_gib(4 * (s.n_params - s.embed_params))}{room}), or use a host with a faster AdamW "
                       "(more cores, more memory bandwidth)")
        if b and not hides and p.bound_by == "pcie":
            out.append(f"PCIe-bound at the largest batch that fits ({b}): the weights cross PCIe twice per "
                       "micro-batch whatever its size; a larger window re-sends fewer layers in backward")
        if p.bound_by == "pcie" and tier == "cpu" and est.gpu_peak(p.batch, "device") <= p.gpu_limit:
            out.append("activation_tier='device' fits on this GPU and takes the layer inputs off PCIe")
    elif p.bound_by == "disk":
        need = est.host(p.batch, "cpu", deferred)["layer inputs (cpu tier)"]
        out.append(f"disk-bound: the nvme tier writes and reads {_gib(2 * s.layers * p.batch * p.seq * s.hidden * N)} "
                   f"per step; activation_tier='cpu' needs {_gib(need)} of host memory instead")
    else:
        out.append("GPU-bound: AdamW and the transfers hide behind the compute; only faster kernels or a faster "
                   "GPU raise tokens/s")
        if not deferred and p.grad_buffers > 3:
            # 3 buffers cost nothing while the GPU is the bound and nothing is clipped or
            # accumulated; they slow a step the CPU paces (docs/benchmarks.md).
            out.append(f"grad_buffers=3 saves {_gib(4 * (p.grad_buffers - 3) * s.layer_params)} of host memory at "
                       "no cost while the GPU is the bound and nothing is clipped or accumulated")
    return out


def _format_report(p: Plan) -> str:
    s = p.shape
    tie = "tied" if s.tied else "untied"
    lines = [
        f"{s.model_type}: {s.n_params / 1e9:.2f} B parameters ({s.layers} layers x {s.layer_params / 1e6:.1f} M, "
        f"hidden {s.hidden}, intermediate {s.intermediate}, vocab {s.vocab}, {tie})",
        f"batch {p.batch}{' (chosen)' if p.batch_chosen else ''} x seq {p.seq}"
        f"{f' x {p.gradient_accumulation_steps} micro-batches' if p.gradient_accumulation_steps > 1 else ''}"
        f" = {p.tokens_per_step} tokens per step; window {p.window}, activations on {p.activation_tier}"
        f"{f', clipping at {p.max_grad_norm}' if p.max_grad_norm else ''}",
        "",
    ]
    if p.host_mem_bytes is None:
        verdict = "limit unknown"
    else:
        verdict = (f"of {_gib(p.host_mem_bytes)} ({p.host_mem_source}): "
                   + ("fits" if p.host_fits else f"SHORT by {_gib(p.host_total - p.host_mem_bytes)}"))
    lines.append(f"host memory  {_gib(p.host_total)} {verdict}")
    lines += [f"  {v / GiB:7.2f} GiB  {k}" for k, v in p.host.items() if v]
    if p.host_steady < p.host_total:
        lines.append(f"  peak in the first step; {_gib(p.host_steady)} once the resident units' host pages are released")
    gverdict = "fits" if p.gpu_fits else f"SHORT by {_gib(p.gpu_peak - p.gpu_limit)}"
    lines.append(f"GPU memory   {_gib(p.gpu_peak)} peak allocated, {_gib(p.gpu_limit)} usable of "
                 f"{_gib(p.gpu_mem_bytes)} ({p.gpu_mem_source}): {gverdict}")
    lines += [f"  {v / GiB:7.2f} GiB  {k}" for k, v in p.gpu_fixed.items()]
    big = max(p.gpu_phases, key=p.gpu_phases.get)
    lines += [f"  {v / GiB:7.2f} GiB  {k}{'  <- peak phase' if k == big else ''}" for k, v in p.gpu_phases.items()]
    host_b = "" if p.max_batch_host is None else f", {p.max_batch_host} by host memory"
    lines += [f"largest batch {p.max_batch_gpu} by GPU memory{host_b}"]
    res_params = (s.embed_params if p.resident_embedding else 0) + p.resident_layers * s.layer_params
    if res_params:
        what = (["the embedding"] if p.resident_embedding else []) + (
            [f"layers 0..{p.resident_layers - 1}"] if p.resident_layers else [])
        lines.append(f"resident on the GPU (optimizer state, updated there): {' and '.join(what)}, "
                     f"{res_params / 1e9:.2f} B parameters (the engine decides after its first step)")
    if p.max_grad_norm:
        host_layers = list(range(s.layers - p.resident_layers))
        n = len(pick_device_units(host_layers, balanced_share()))
        lines.append(f"clipping: the host-held units are updated after the backward; {n} of the {len(host_layers)} "
                     f"host-held layers on the GPU as they are copied in (device_update_share 'auto': "
                     f"{balanced_share():.2f})")
    lines.append("")
    eff = p.rates["gpu_tflops"] * p.rates["gpu_efficiency"]
    lines.append(f"step time    bound {p.bound_s:.3f} s by {p.bound_by} ({p.tokens_per_s / 1e3:.1f} k tokens/s); "
                 f"expected about {p.expected_step_s:.2f} s ({p.expected_tokens_per_s / 1e3:.1f} k tokens/s)")
    detail = {
        "gpu": f"fwd + recompute + bwd, {p.flops_per_token / 1e9:.1f} GFLOP/token at {eff:.0f} TFLOPS "
               f"(resident, no recompute: {p.gpu_resident_s:.3f} s)",
        "pcie": f"h2d {p.h2d_bytes / 1e9:.1f} GB, d2h {p.d2h_bytes / 1e9:.1f} GB at {p.rates['pcie_gbs']} GB/s",
        "cpu": f"AdamW over {(s.n_params - res_params) / 1e9:.2f} B parameters at {p.rates['adam_gps']} G/s",
        "disk": f"layer inputs written at {p.rates['nvme_write_gbs']} and read at {p.rates['nvme_read_gbs']} GB/s",
    }
    lines += [f"  {k:5s} {v:7.3f} s  {detail[k]}" for k, v in p.times.items()]
    lines += ["", "advice"] + [f"  - {a}" for a in p.advice]
    lines.append("(estimates calibrated on H200 measurements; see docs/planner.md)")
    return "\n".join(lines)
