"""Every registered family on CUDA (models/registry.py): fp32 sliding against fp32 HF on the GPU,
and bf16 compute with the family's kernels against fp32 HF, with stated tolerances."""
import copy
import math

import pytest
import torch

import hf_slideformer as hs
from hf_slideformer.models import FAMILIES as REGISTRY
from helpers import QUIRK_VARIANTS, batches, family_config, model_type_of, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]
LR = 1e-3
VOCAB = 1001




def _pair(family, dtype, tied, **kw):
    torch.manual_seed(0)
    ref = tiny_model(family, tied, vocab_size=VOCAB, hidden_size=256, intermediate_size=704,
                     num_attention_heads=8, num_key_value_heads=2)
    ref.config.use_cache = False
    slid = hs.slide(copy.deepcopy(ref), hs.SlideConfig(device="cuda", dtype=dtype, **kw))
    return ref.cuda(), slid


def _data(steps, device="cuda"):
    return [{k: v.to(device) for k, v in b.items()} for b in batches(steps, bsz=4, seq=96, vocab=VOCAB, pad=True)]


def _train_hf(ref, steps, clip=0.5, autocast=False, device="cuda"):
    """HF + torch AdamW on `device` (fp32 weights; with `autocast`, bf16 compute): the losses."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for b in _data(steps, device):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            r = ref(**b).loss
        r.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(r.item())
    return losses


def _train(ref, slid, steps, clip=0.5):
    opt = slid.create_optimizer(lr=LR, weight_decay=0.01)
    losses = []
    for b in _data(steps):
        s = slid(**b).loss
        s.backward()
        opt.step()
        opt.zero_grad()
        losses.append(s.item())
    return list(zip(losses, _train_hf(ref, steps, clip)))


def _mean_diff(model, ref_sd):
    sd = model.state_dict()
    return torch.cat([(sd[k].float().cpu() - ref_sd[k]).abs().flatten() for k in ref_sd]).mean().item()


# Every registered family, and the variants of a family whose checkpoints differ in a part the
# engine handles apart (helpers.QUIRK_VARIANTS: Gemma 4's MoE).
ALL = tuple(REGISTRY) + tuple(v for v in QUIRK_VARIANTS if v not in REGISTRY)


def _routed(family) -> bool:
    entry = REGISTRY[model_type_of(family)]
    return entry.router_class is not None or (entry.routed is not None and entry.routed(family_config(family).to_dict()))


@pytest.mark.parametrize("family", ALL)
def test_fp32_cuda_matches_hf(family):
    """fp32 sliding against fp32 HF on the GPU, three steps: losses within 1e-4 relative, the mean
    parameter difference under 5% of one lr step, the largest under 2 lr steps per step.

    A mixture of experts: HF's gradients are summed on the device, the engine's on the host; a 1e-7
    difference of summation order flips a top-k routing choice whose scores tie, and the token then
    trains another expert. Its bounds are HF's own: the same HF model trained in fp32 on the CPU
    against fp32 HF on CUDA, the loss tolerance 3 times that gap (the largest over the steps), the
    mean bound 1.5 times that drift (a wrong gradient moves most weights by a full step: far above
    either)."""
    ref, slid = _pair(family, torch.float32, tied=False, max_grad_norm=0.5, use_kernels=False)
    steps = 3
    hf_cpu = copy.deepcopy(ref).cpu() if _routed(family) else None
    losses = _train(ref, slid, steps)
    rel_tol, bound = 1e-4, 0.05 * LR
    sd, rsd = slid.state_dict(), ref.cpu().state_dict()
    if hf_cpu is not None:
        cpu_losses = _train_hf(hf_cpu, steps, device="cpu")
        gap = max(abs(c - r) / abs(r) for c, (_, r) in zip(cpu_losses, losses))
        rel_tol = max(rel_tol, 3 * gap)
        bound = max(bound, 1.5 * _mean_diff(hf_cpu, rsd))
    for s, r in losses:
        assert math.isclose(s, r, rel_tol=rel_tol), (losses, rel_tol)
    # Why a mean and a cap: AdamW's first steps move each weight by
    # about lr * g / |g|: where g is ~0, a 1e-7 difference of summation order on the GPU (HF's
    # gradients on the device, the engine's summed on the host) flips the step of that one weight.
    # A wrong gradient moves most weights: the mean is held to 5% of a step (or HF's own CPU-CUDA
    # drift, routed), the largest to 2 steps per step.
    diffs = torch.cat([(sd[k].cpu() - rsd[k]).abs().flatten() for k in rsd])   # a layer buffer stays on the GPU
    assert diffs.mean().item() < bound and diffs.max().item() < 2 * LR * steps, (diffs.mean(), diffs.max(), bound)


@pytest.mark.parametrize("family", ALL)
def test_bf16_with_the_family_kernels_tracks_fp32_hf(family):
    """bf16 compute, the kernels the entry lists: losses within 2% per step, the mean parameter
    difference under the larger of 10% of one lr step and 1.5 times HF's own bf16 drift (the same
    HF model with bf16 autocast against fp32 HF), the largest under 2 lr steps per step.

    bf16 rounding is a perturbation that a chaotic tiny model (Gemma 4's) grows until it moves
    weights by a large part of a step; in a mixture of experts a token whose top-k scores tie
    within bf16 rounding picks another expert in bf16 than in fp32, a real divergence that Adam
    turns into whole lr steps on the experts' weights. HF's own bf16 drift measures both; a wrong
    gradient moves most weights by a full step: far above either bound."""
    ref, slid = _pair(family, torch.bfloat16, tied=True, max_grad_norm=0.5, use_kernels=True)
    hf_bf16 = copy.deepcopy(ref)
    handle = getattr(slid, "_triton_ops_patch", None)
    if REGISTRY[model_type_of(family)].kernels:
        assert handle is not None and (handle.forwards or handle.functions), family
    steps = 4
    losses = _train(ref, slid, steps)
    for s, r in losses:
        assert abs(s - r) / r < 2e-2, losses
    sd, rsd = slid.state_dict(), ref.cpu().state_dict()
    diffs = torch.cat([(sd[k].cpu() - rsd[k]).abs().flatten() for k in rsd])   # a layer buffer stays on the GPU
    _train_hf(hf_bf16, steps, autocast=True)
    bound = max(0.1 * LR, 1.5 * _mean_diff(hf_bf16, rsd))
    assert diffs.mean().item() < bound and diffs.max().item() < 2 * LR * steps, (diffs.mean(), diffs.max(), bound)
