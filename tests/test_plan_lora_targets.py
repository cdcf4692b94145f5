"""The planner's LoRA targets (plan_lora_targets.py): its adapter count equals PEFT's trainable
parameters for the same `target_modules` / `target_parameters`, experts' fused weights included,
and its memory and compute terms follow that count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from helpers import family_config
from hf_slideformer.planner.plan_lora import ADAPTER_GPU_BYTES
from hf_slideformer.planner.plan_lora_targets import DEFAULT_TARGET_MODULES, DEFAULT_TARGET_PARAMETERS
from hf_slideformer.planner.planner import GiB, plan

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
MACHINE = dict(batch=2, gpu_mem=24, host_mem=24, pcie_gbs=54.6, adam_gps=3.5)
MOE = ["qwen3_moe", "mixtral", "qwen3_5_moe_text", "gpt_oss", "gemma4_text-moe"]
DENSE = ["llama", "qwen3_5_text"]          # the Llama formula, and a family read from its modules
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = list(DEFAULT_TARGET_PARAMETERS)


def peft_trainable(cfg, r, modules, parameters) -> int:
    """The requires_grad parameters of PEFT's own LoRA model of this config."""
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                           LoraConfig(r=r, target_modules=modules, target_parameters=parameters))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def planned(cfg, r, modules, parameters, **kw):
    return plan(cfg, lora_r=r, lora_target_modules=modules, lora_target_parameters=parameters, **MACHINE, **kw)


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("r", [1, 4])
def test_attention_and_expert_adapters_count_as_peft_makes_them(family, r):
    """LoRA on the attention projections and both fused expert weights (PEFT's ParamWrapper: A of
    (E r, in), B of (out, E r) per expert weight): the planner's count is PEFT's trainable count."""
    cfg = family_config(family)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if family == "qwen3_5_moe_text":        # its linear-attention layers' projections too
        modules += ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
    want = peft_trainable(cfg, r, modules, EXPERTS)
    p = planned(cfg, r, modules, EXPERTS)
    assert p.lora_params == want
    assert 0 < p.lora_expert_params < want
    assert p.lora_params - p.lora_expert_params == peft_trainable(cfg, r, modules, None)


@pytest.mark.parametrize("family", MOE + DENSE)
def test_the_default_targets_are_the_benchmarks_lora(family):
    """The default: every linear layer the decoder layer has among the Llama layout's names and,
    where the model has experts, both of their weights, at rank r: the benchmark's LoRA
    (benchmarks/providers/lora.py, `lora_config`)."""
    from benchmarks.providers.lora import lora_config

    cfg = family_config(family)
    model = AutoModelForCausalLM.from_config(cfg)
    bench = get_peft_model(model, lora_config(model, 4))
    want = sum(p.numel() for p in bench.parameters() if p.requires_grad)
    assert plan(cfg, lora_r=4, **MACHINE).lora_params == want
    if family == "qwen3_moe":
        # the same names given explicitly are PEFT's: its rewrite adapts gate_up_proj at rank 2r
        explicit = peft_trainable(cfg, 4, list(DEFAULT_TARGET_MODULES), EXPERTS)
        assert planned(cfg, 4, list(DEFAULT_TARGET_MODULES), EXPERTS).lora_params == explicit > want


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gemma4_text-moe", "llama"])
def test_all_linear_and_one_expert_weight_count_as_peft_makes_them(family):
    """"all-linear" (a router's linear too, where it is one) and a single expert weight by its
    full path; a regex."""
    cfg = family_config(family)
    down = ["experts.down_proj"] if family != "llama" else None
    assert planned(cfg, 2, "all-linear", down).lora_params == peft_trainable(cfg, 2, "all-linear", down)
    regex = r".*\.(q|v)_proj"
    assert planned(cfg, 2, regex, None).lora_params == peft_trainable(cfg, 2, regex, None)


def test_qwen3_30b_a3b_at_rank_16_counts_its_experts():
    """The Qwen3-30B-A3B shape, r 16 on the attention and the experts: 0.64 B adapter parameters,
    which take the GPU memory and the compute the planner gives them."""
    path = CONFIGS / "qwen3-30b-a3b.json"
    kw = dict(batch=8, seq=2048, gpu_mem=24, host_mem=125, pcie_gbs=54.6, adam_gps=3.5, lora_r=16)
    p = plan(path, lora_target_modules=ATTENTION, **kw)
    H, q, kv, E, I, L = 2048, 32 * 128, 4 * 128, 128, 768, 48
    attention = 16 * (3 * H + q + q + 2 * kv + H)
    experts = 16 * E * ((2 * I + H) + (I + H))
    assert p.lora_params == L * (attention + experts) and round(p.lora_params / 1e5) == 6425
    assert p.lora_expert_params == L * experts
    adapters = p.gpu_fixed["LoRA adapters (fp32 weight, gradient, Adam m, v: 16 B/param)"]
    assert adapters == ADAPTER_GPU_BYTES * p.lora_params
    # the layer phase holds each adapted expert weight (bf16), its bf16 factors, and the larger one's gradient
    phase = next(v for k, v in p.gpu_phases.items() if k.startswith("layer recompute"))
    attn_only = plan(path, lora_target_modules=ATTENTION, lora_target_parameters=None, **kw)
    attn_phase = next(v for k, v in attn_only.gpu_phases.items() if k.startswith("layer recompute"))
    expert_numel = E * 3 * H * I
    assert phase - attn_phase == 2 * expert_numel + 2 * E * 2 * I * H + 2 * experts
    # the adapted experts' weight gradients: 2 FLOPs per element of the top-8 experts' weights
    assert p.flops_per_token - attn_only.flops_per_token == pytest.approx(2 * L * expert_numel * 8 / E)
    assert p.adapter_s > attn_only.adapter_s and p.max_batch_gpu < attn_only.max_batch_gpu
    assert p.gpu_peak - attn_only.gpu_peak >= 9 * GiB
    assert "q_proj, k_proj, v_proj, o_proj and the experts' gate_up_proj, down_proj" in p.report()
    # the default (the benchmark's LoRA) is the same run: the layer has no gate_proj / up_proj /
    # down_proj linear; named explicitly, PEFT rewrites them onto the fused weights, gate_up_proj
    # at rank 2 r
    assert plan(path, **kw).lora_params == p.lora_params
    named = plan(path, lora_target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"], **kw)
    assert named.lora_params == L * (attention + 16 * E * (2 * (2 * I + H) + (I + H)))
    assert "the experts' gate_up_proj (rank 32), down_proj" in named.report()


def test_targets_that_match_nothing_or_cannot_be_adapted_are_refused():
    cfg = family_config("qwen3_moe")
    with pytest.raises(ValueError, match="match no linear layer or parameter"):
        planned(cfg, 4, ["nothing"], None)
    with pytest.raises(ValueError, match="match no linear layer of a qwen3_moe"):
        planned(cfg, 4, ["nothing"], EXPERTS)            # the experts alone would be planned silently
    with pytest.raises(ValueError, match="PEFT adapts 2-D and 3-D parameters only"):
        planned(cfg, 4, None, ["input_layernorm.weight"])
    with pytest.raises(ValueError, match="lora_target_modules needs lora_r"):
        plan(cfg, lora_target_modules=["q_proj"], **MACHINE)
    with pytest.raises(ValueError, match="lora_target_parameters must be a list"):
        planned(cfg, 4, None, [1])


def test_the_cli_takes_the_targets(capsys):
    """`--lora-targets` and `--lora-target-parameters` are PEFT's target_modules / target_parameters;
    `none` names no parameter; the default is the benchmark's LoRA."""
    from hf_slideformer.cli import main

    args = ["plan", str(CONFIGS / "qwen3-30b-a3b.json"), "--batch", "8", "--gpu-mem", "24", "--host-mem", "125",
            "--lora-r", "16", "--json"]
    counts = {}
    for name, extra, fits in [
            ("default", [], True), ("attention", ["--lora-targets", ",".join(ATTENTION)], True),
            ("named", ["--lora-targets", ",".join(ATTENTION + ["gate_proj", "up_proj", "down_proj"])], False),
            ("no experts", ["--lora-targets", "q_proj, v_proj", "--lora-target-parameters", "none"], True)]:
        assert main(args + extra) == (0 if fits else 1)          # 1: the plan does not fit the GPU
        counts[name] = json.loads(capsys.readouterr().out)["lora_params"]
    assert counts["default"] == counts["attention"] == 642_514_944
    assert counts["named"] == 994_836_480
    assert counts["no experts"] == 48 * 16 * ((2048 + 32 * 128) + (2048 + 4 * 128))
