"""The projections' math in the engine (layer_matmuls.py): a tiny Llama slid with the FP8 recipe's
CPU emulation trains close to the bf16 run, weights are quantized once per slot fill, and the
switch (`SlideConfig.matmuls`, SlideArgs, Accelerate's mixed_precision='fp8') and its refusals."""
import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from hf_slideformer.compute import layer_matmuls
from hf_slideformer.compute.fp8 import Fp8Linear
from hf_slideformer.compute.layer_matmuls import Fp8Matmuls, fp8_refusals, install_emulation
from hf_slideformer.models import get_adapter
from helpers import batches, family_config

# The FP8 run's loss beside the bf16 run's, over 3 AdamW steps of a 4-layer model: e4m3's
# ~3% error per GEMM output moves a loss of ~4.6 by far less than 1%; 2% is the bound.
LOSS_RTOL = 0.02


def tiny_llama(seed=0, **kw):
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=4)
    cfg = family_config("llama", **{**shape, **kw})
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.config.use_cache = False
    return model


def train(model, data, steps=3):
    opt = model.create_optimizer(lr=1e-3)
    losses = []
    for b in data[:steps]:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fp8_emulation_trains_close_to_bf16(monkeypatch):
    base = tiny_llama()
    data = batches(3, bsz=2, seq=16)
    bf16 = hs.slide(copy.deepcopy(base), hs.SlideConfig(device="cpu", dtype=torch.bfloat16))
    fp8 = hs.slide(copy.deepcopy(base), hs.SlideConfig(device="cpu", dtype=torch.bfloat16))
    mm = install_emulation(fp8)
    calls = {"n": 0}
    real = Fp8Linear.forward

    def counted(ctx, *a):
        calls["n"] += 1
        return real(ctx, *a)
    monkeypatch.setattr(Fp8Linear, "forward", staticmethod(counted))
    a, b = train(bf16, data), train(fp8, data)
    # 7 projections x 4 layers, in the forward and the recompute, per step
    assert calls["n"] == 3 * 2 * 7 * 4
    assert a != b                                      # the FP8 math ran
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=LOSS_RTOL), (a, b)
    assert len(mm.projections[0]) == 7
    assert not any("forward" in proj.__dict__ for mods in mm.projections for proj in mods)   # patches undone


class FakeSlot:
    def __init__(self):
        self.fills = 0


def test_weights_are_quantized_once_per_slot_fill():
    layer = tiny_llama().model.layers[0]
    mm = Fp8Matmuls([layer], layer_matmuls.EmulatedFp8())
    slot, proj = FakeSlot(), layer.self_attn.q_proj
    first = mm.quantized(slot, proj)
    first_rows = first.rows
    assert mm.quantized(slot, proj) is first                 # forward, then recompute: one quantization
    assert first.rows is first_rows
    with torch.no_grad():
        proj.weight.mul_(2)                                  # a refill writes other values into the same storage
    slot.fills += 1
    second = mm.quantized(slot, proj)
    assert second is not first and not torch.equal(second.rows[1], first_rows[1])
    assert mm.quantized(None, proj) is None                  # no slot (resident): quantized at each use


def test_fp8_forms_are_freed_after_their_last_reader():
    model = tiny_llama().bfloat16()
    layers = list(model.model.layers)
    mm = Fp8Matmuls(layers, layer_matmuls.EmulatedFp8())
    slots = [FakeSlot(), FakeSlot()]
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with mm.forward(0, slots[0]), mm.forward(1, slots[1]), torch.no_grad():
        model.model(input_ids=ids)
    q0 = mm.quantized(slots[0], layers[0].self_attn.q_proj)
    assert q0._rows is not None                               # kept for the recompute of this fill
    slots[1].fills += 1                                       # slot 1 refilled: its forms go at the next call
    with mm.recompute(0, slots[0], None):
        assert slots[1] not in mm.cache
        h = model.model.layers[0](model.model.embed_tokens(ids), position_embeddings=model.model.rotary_emb(
            model.model.embed_tokens(ids), torch.arange(5)[None]))
        h = h[0] if isinstance(h, tuple) else h
    assert q0._rows is None                                   # the recompute was the fill's last forward
    h.float().sum().backward()
    assert q0._cols_t is None                                 # dropped after its backward


def test_the_switch_refuses_the_cpu_at_slide():
    with pytest.raises(ValueError, match=r"matmuls='fp8' cannot run here: .*capability 8\.9.*device is cpu"):
        hs.slide(tiny_llama(), hs.SlideConfig(device="cpu", dtype=torch.bfloat16, matmuls="fp8"))
    with pytest.raises(ValueError, match="matmuls"):
        hs.SlideConfig(device="cpu", matmuls="int8")


def test_each_refusal_names_its_reason(monkeypatch):
    monkeypatch.setattr(layer_matmuls, "fp8_unsupported", lambda device: None)
    model = tiny_llama()
    adapter = get_adapter("llama")
    layers = list(adapter.layers(model))
    ok = hs.SlideConfig(device="cpu", dtype=torch.bfloat16, matmuls="fp8")
    assert fp8_refusals(ok, adapter, model, layers) == []
    fp32 = hs.SlideConfig(device="cpu", dtype=torch.float32, matmuls="fp8")
    assert "dtype='bfloat16'" in fp8_refusals(fp32, adapter, model, layers)[0]
    assert "LoRA" in fp8_refusals(ok, adapter, model, layers, lora=True)[0]
    tiled = hs.SlideConfig(device="cpu", dtype=torch.bfloat16, matmuls="fp8", mlp_chunk_tokens=8)
    assert "mlp_chunk_tokens" in fp8_refusals(tiled, adapter, model, layers)[0]
    odd = tiny_llama(intermediate_size=120)
    assert "multiples of 16" in fp8_refusals(ok, adapter, odd, list(adapter.layers(odd)))[0]
    moe = get_adapter("qwen3_moe")
    assert "mixture of experts" in fp8_refusals(ok, moe, model, layers)[0]


def test_slide_args_and_accelerate_map_fp8(monkeypatch, tmp_path):
    args = hs.SlideArgs(output_dir=str(tmp_path), use_cpu=True, slide_matmuls="fp8", report_to=[])
    assert args.to_slide_config().matmuls == "fp8"
    with pytest.raises(Exception, match="slide_matmuls"):
        hs.SlideArgs(output_dir=str(tmp_path), use_cpu=True, slide_matmuls="fp4", report_to=[])
    from hf_slideformer.accelerate_plugin import SlidePlugin
    from hf_slideformer.compute.fp8_recipes import take_fp8_recipe
    cfg = SlidePlugin().to_slide_config("cpu", "fp8")
    assert cfg.matmuls == "fp8" and cfg.dtype == torch.bfloat16
    assert SlidePlugin().to_slide_config("cpu", "bf16").matmuls == "dtype"
    assert SlidePlugin.from_dict({"matmuls": "fp8"}).matmuls == "fp8"

    class AORecipeKwargs:                        # accelerate's, without torchao installed
        config = None

    class TERecipeKwargs:
        pass
    assert take_fp8_recipe([AORecipeKwargs()], "fp8") == ([], "fp8")
    assert take_fp8_recipe([], "fp8") == ([], None)
    with pytest.raises(ValueError, match="rowwise"):
        take_fp8_recipe([TERecipeKwargs()], "fp8")
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        take_fp8_recipe([AORecipeKwargs()], "bf16")
    tensorwise = AORecipeKwargs()
    tensorwise.config = type("Cfg", (), {"round_scales_to_power_of_2": False})()
    with pytest.raises(ValueError, match="rowwise"):
        take_fp8_recipe([tensorwise], "fp8")
    # torchao's casts as Float8LinearConfig.from_recipe_name names them (torchao is not installed here)
    cast = lambda granularity="ScalingGranularity.AXISWISE", kind="ScalingType.DYNAMIC": type(   # noqa: E731
        "CastConfig", (), {"scaling_granularity": granularity, "scaling_type": kind})()
    gw_hp = AORecipeKwargs()
    gw_hp.config = type("Cfg", (), {"cast_config_input": cast(), "cast_config_weight": cast(),
                                    "cast_config_grad_output": cast(),
                                    "cast_config_input_for_grad_weight": cast(kind="ScalingType.DISABLED"),
                                    "cast_config_grad_output_for_grad_weight": cast(kind="ScalingType.DISABLED"),
                                    "round_scales_to_power_of_2": False})()
    assert take_fp8_recipe([gw_hp], "fp8") == ([], "fp8_gw_hp")
    assert SlidePlugin.from_dict({"matmuls": "fp8_gw_hp"}).to_slide_config("cpu", "fp8").matmuls == "fp8_gw_hp"
    assert hs.SlideArgs(output_dir=str(tmp_path), use_cpu=True, slide_matmuls="fp8_gw_hp",
                        report_to=[]).to_slide_config().matmuls == "fp8_gw_hp"


def _fp8_layers_run(model, ids, fused, recompute=True, skip_down=False):
    """The model's hidden states and every parameter's gradient with each layer's projections in
    FP8 (the CPU emulation), the norms and the SwiGLU handing their outputs over quantized or not;
    with `skip_down` the down projections are the recompute's output-free ones."""
    import contextlib
    layers = list(model.model.layers)
    mm = Fp8Matmuls(layers, layer_matmuls.EmulatedFp8(), fused=fused)
    model.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as stack:
        for i, layer in enumerate(layers):
            skip = layer.mlp.down_proj if skip_down else None
            stack.enter_context(mm.recompute(i, None, skip) if recompute else mm.forward(i, None))
        h = model.model(input_ids=ids).last_hidden_state
    h.float().pow(2).mean().backward()
    return mm, h.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_fused_producers_leave_the_fp8_layers_unchanged(monkeypatch):
    import triton_ops
    model = tiny_llama(intermediate_size=176).bfloat16()             # I not a power of two
    handle = triton_ops.patch(model, cross_entropy=False)
    ids = torch.randint(0, model.config.vocab_size, (3, 7))           # 21 tokens
    calls = []
    real = layer_matmuls.EmulatedFp8.quantize_rows

    def counted(self, x):
        calls.append(tuple(x.shape))
        return real(self, x)
    monkeypatch.setattr(layer_matmuls.EmulatedFp8, "quantize_rows", counted)
    mm, h_ref, g_ref = _fp8_layers_run(model, ids, fused=False)
    plain = len(calls)
    calls.clear()
    mm, h, g = _fp8_layers_run(model, ids, fused=True)
    assert [type(m).__name__ for m in mm.producers[0]] == ["LlamaRMSNorm", "LlamaRMSNorm", "LlamaMLP"]
    # the two norms' outputs and the activation arrive quantized: 3 row passes fewer per layer
    assert plain - len(calls) == 3 * len(model.model.layers), (plain, len(calls))
    assert torch.equal(h, h_ref)
    assert g_ref["model.layers.0.mlp.down_proj.weight"] is not None
    for name in g_ref:                                 # the head is not run: no gradient there
        assert (g[name] is None and g_ref[name] is None) or torch.equal(g[name], g_ref[name]), name
    assert not any("forward" in m.__dict__ for mods in mm.projections for m in mods)   # patches undone
    from triton_ops.patching import patched_op
    assert all(patched_op(m) for mods in mm.producers for m in mods)                  # the kernels' forwards back

    # The recompute with the down projections output-free: the MLP keeps its plain forward (no rows
    # that nothing reads), the norms still hand theirs over; the gradients are the same.
    calls.clear()
    _, _, g_skip_ref = _fp8_layers_run(model, ids, fused=False, skip_down=True)
    plain = len(calls)
    calls.clear()
    _, _, g_skip = _fp8_layers_run(model, ids, fused=True, skip_down=True)
    assert plain - len(calls) == 2 * len(model.model.layers), (plain, len(calls))
    for name in g_skip_ref:
        assert (g_skip[name] is None and g_skip_ref[name] is None) or torch.equal(g_skip[name], g_skip_ref[name]), name

    # The projections read the handed-over form, not a quantization of their own: a scale off by
    # a power of two in it moves the output.
    def doubled(fn):
        def run(*a, **kw):
            y, (q, inv) = fn(*a, **kw)
            return y, (q, inv * 2)
        return run
    for name in ("rms_norm_rows", "swiglu_rows"):
        monkeypatch.setattr(triton_ops, name, doubled(getattr(triton_ops, name)))
        _, h_bad, _ = _fp8_layers_run(model, ids, fused=True, recompute=False)
        assert not torch.equal(h_bad, h_ref), name
        monkeypatch.undo()
        monkeypatch.setattr(layer_matmuls.EmulatedFp8, "quantize_rows", counted)
    handle.revert()
