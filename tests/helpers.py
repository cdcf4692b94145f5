"""Builders shared by the tests: tiny models of each family and the plain-PyTorch reference loop."""
from __future__ import annotations

import copy
import os

import torch
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from hf_slideformer.demo import tiny_config
from hf_slideformer.models import FAMILIES as _REGISTRY

# The Llama-layout families, tested through every engine path (test_engine.py, test_model.py);
# the families with quirks of their own are the rest of the registry (test_families.py).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
QUIRK_FAMILIES = tuple(f for f in _REGISTRY if f not in FAMILIES)
# A family whose released checkpoints differ in a part the engine handles apart (Gemma 4's dense
# and mixture-of-experts layers) is tested once per variant: "<model_type>-<variant>".
QUIRK_VARIANTS = QUIRK_FAMILIES + ("gemma4_text-moe",)

# Config settings that exercise a family's own features in a tiny model (a family without an
# entry is tested with its defaults).
FAMILY_FEATURES = {
    "mistral": dict(sliding_window=5),     # shorter than the test sequences: exercises the window
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(use_sliding_window=False),
    # Sliding and full layers, soft-capped logits, GeGLU, (1 + w) norms, a scaled embedding.
    "gemma3_text": dict(head_dim=8, sliding_window=5, final_logit_softcapping=10.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3": dict(partial_rotary_factor=0.75),                      # fused qkv / gate_up, partial rotary
    "olmo3": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "smollm3": dict(no_rope_layers=[1, 0, 1]),                     # a NoPE layer between RoPE ones
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                    logits_scaling=4.0),
    # Linear-attention (gated delta rule) layers around a full-attention one, partial rotary.
    "qwen3_5_text": dict(head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_conv_kernel_dim=3,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # A few experts with top-2 routing, the auxiliary load-balancing loss on (a large coefficient,
    # so that its gradient weighs).
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                      output_router_logits=True, router_aux_loss_coef=0.5),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, output_router_logits=True,
                    router_aux_loss_coef=0.5),
    "qwen3_5_moe_text": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             output_router_logits=True, router_aux_loss_coef=0.5,
                             shared_expert_intermediate_size=24, head_dim=8, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_conv_kernel_dim=3,
                             layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # Sinks, alternating sliding (window shorter than the sequences) and full layers, biased router
    # and experts, the SwiGLU clamp low enough to bind.
    # Sliding and full layers with the full layers' own head size and kv heads, keys reused as
    # values there (attention_k_eq_v), GeGLU, soft-capped logits, a scaled embedding, a layer
    # scalar (make_pair sets it off 1); no per-layer inputs and no shared KV layers.
    "gemma4_text": dict(head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                        sliding_window=5, final_logit_softcapping=3.0, hidden_size_per_layer_input=0,
                        num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention", "full_attention"]),
    # The dense MLP beside a few experts with top-2 routing (a normed router with per-expert
    # scales). Tiny Gemma 4 MoEs are chaotic under Adam at the tests' lr: a 1e-7 relative change
    # of the weights moves HF's own third-step gradient norm by 1e-4 and more in most shapes
    # tried; this one (window 8 of the 11 tokens, the released soft-cap 30) stays within the
    # tolerance for three steps.
    "gemma4_text-moe": dict(head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                            sliding_window=8, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                            num_kv_shared_layers=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                            moe_intermediate_size=16,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                            num_hidden_layers=4),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=5, swiglu_limit=0.05,
                    output_router_logits=True, router_aux_loss_coef=0.5, max_position_embeddings=256,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=64, rope_theta=150000.0)),
}


def model_type_of(family: str) -> str:
    """The model_type of a family or a family's variant ("gemma4_text-moe" -> "gemma4_text")."""
    return family.split("-")[0]


def family_config(family: str, tied: bool = False, **kw):
    extra = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
             **FAMILY_FEATURES.get(family, {}), **kw}
    return tiny_config(model_type_of(family), tie_word_embeddings=tied, **extra)


def _set_off_defaults(model) -> None:
    """Buffers a checkpoint loads that init leaves at a neutral value (Gemma 4's layer scalar),
    set off it so that a test sees them carried."""
    with torch.no_grad():
        for i, layer in enumerate(getattr(model, "model", model).layers):
            if hasattr(layer, "layer_scalar"):
                layer.layer_scalar.fill_(0.5 + 0.25 * i)


def tiny_model(family: str, tied: bool = False, **kw):
    """A tiny fp32 model of `family` (a family or a variant), random init."""
    model = AutoModelForCausalLM.from_config(family_config(family, tied, **kw)).float()
    _set_off_defaults(model)
    return model


def make_pair(model_type="llama", tied=False, seed=0, cfg_kw=None, **slide_kw):
    """(reference HF model, slid deep copy) with identical fp32 weights."""
    torch.manual_seed(seed)
    ref = tiny_model(model_type, tied, **(cfg_kw or {}))
    ref.config.use_cache = False
    slid = copy.deepcopy(ref)
    slid = hs.slide(slid, hs.SlideConfig(device="cpu", dtype=torch.float32, **slide_kw))
    return ref, slid


def batches(n, bsz=2, seq=11, vocab=97, pad_left=False, pad=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, vocab, (bsz, seq), generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        if pad:
            for b in range(bsz):
                k = int(torch.randint(1, seq // 2, (1,), generator=g))
                if pad_left and b % 2 == 0:
                    ids[b, :k] = 0
                    mask[b, :k] = 0
                    labels[b, :k] = -100
                else:
                    ids[b, -k:] = 0
                    mask[b, -k:] = 0
                    labels[b, -k:] = -100
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return out


def max_param_diff(ref, slid):
    sd, rsd = slid.state_dict(), ref.state_dict()
    assert set(sd) == set(rsd), (set(sd) ^ set(rsd))
    return max((sd[k] - rsd[k]).abs().max().item() for k in rsd)


def trainer_args(tmp_path, name, **kw):
    """TrainingArguments / SlideArgs keywords of the Trainer comparisons: accumulation 2, active
    clipping, weight decay, a cosine schedule with warm-up, on the CPU, no saves; `kw` overrides."""
    args = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_grad_norm=0.05, learning_rate=1e-2, weight_decay=0.1, max_steps=5, logging_steps=1,
                report_to=[], use_cpu=True, save_strategy="no", lr_scheduler_type="cosine", warmup_steps=1,
                disable_tqdm=True, optim="adamw_torch")
    args.update(kw)
    return args


def open_fds(match) -> list[str]:
    """The targets of this process's open file descriptors for which `match(target)` holds (a
    deleted file's target ends with " (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if match(target):
            out.append(target)
    return out



def record_updates(monkeypatch) -> list:
    """The host updates in the order the worker runs them: unit names, and "<name>:rows" for the
    update of a table's batch rows that follows its whole-table one (embedding.py)."""
    from hf_slideformer.host.host_tasks import HostUpdates
    order = []
    real, real_rows = HostUpdates.update, HostUpdates.update_rows

    def update(self, u, *a, **k):
        order.append(u.name)
        return real(self, u, *a, **k)

    def update_rows(self, u, *a, advance, **k):
        order.append(u.name if advance else u.name + ":rows")
        return real_rows(self, u, *a, advance=advance, **k)
    monkeypatch.setattr(HostUpdates, "update", update)
    monkeypatch.setattr(HostUpdates, "update_rows", update_rows)
    return order


def slow_down(monkeypatch, cls, name: str, seconds: float) -> None:
    """Make `cls.name` sleep `seconds` before it runs (a worker task made late on purpose)."""
    import time
    real = getattr(cls, name)

    def slowed(self, *a, **k):
        time.sleep(seconds)
        return real(self, *a, **k)
    monkeypatch.setattr(cls, name, slowed)


def losses_after_each_step(ref, slid, train, held_out, lr: float):
    """Train both models a step per batch of `train` (torch AdamW for the reference), and after
    each step, right after optimizer.step() returns, the loss of `held_out` without gradients:
    a list of (reference, slid) losses."""
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
    opt = slid.create_optimizer(lr=lr, weight_decay=0.0)
    out = []
    for b in train:
        ref(**b).loss.backward()
        ropt.step()
        ropt.zero_grad()
        slid(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            out.append((ref(**held_out).loss.item(), slid(**held_out).loss.item()))
    return out
