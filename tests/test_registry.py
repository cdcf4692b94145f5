"""The family registry: every entry is read by the adapters, the kernel patch, the planner and the tests."""
import importlib
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import triton_ops
from helpers import FAMILIES, QUIRK_FAMILIES, family_config
from hf_slideformer.models import SUPPORTED_MODEL_TYPES, get_adapter, get_family
from hf_slideformer.models.registry import FAMILIES as REGISTRY
from hf_slideformer.planner.planner import model_shape


def test_every_reader_sees_the_registry():
    assert FAMILIES + QUIRK_FAMILIES == tuple(REGISTRY)
    assert SUPPORTED_MODEL_TYPES == tuple(sorted(REGISTRY))
    assert triton_ops.patching.supported_families() == tuple(n for n, f in REGISTRY.items() if f.kernels)


@pytest.mark.parametrize("model_type", list(REGISTRY))
def test_an_entry_finds_the_parts_and_counts_the_parameters(model_type):
    config = family_config(model_type)
    model = AutoModelForCausalLM.from_config(config)
    a = get_adapter(model_type)
    assert a.embed(model) is model.model.embed_tokens and a.lm_head(model) is model.lm_head
    assert len(a.layers(model)) == config.num_hidden_layers and a.final_norm(model) is model.model.norm
    a.check(model)
    shape = model_shape(config.to_dict())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert shape.layer_params == max(layers)            # the largest: layer types may differ (Qwen3.5)
    if len(set(layers)) == 1:
        assert shape.n_params == sum(p.numel() for p in model.parameters())


# The ops that replace a module-level function of the family's modeling module (fla absent here).
FUNCTION_OPS = (("rope", "apply_rotary_pos_emb"), ("gated_delta", "torch_chunk_gated_delta_rule"),
                ("causal_conv", "causal_conv1d_fn"))


@pytest.mark.parametrize("model_type", [n for n, f in REGISTRY.items() if f.kernels])
def test_a_kernel_family_is_patched_and_reverted(model_type):
    model = AutoModelForCausalLM.from_config(family_config(model_type))
    family = get_family(model_type)
    modeling = importlib.import_module(family.modeling)
    # What the modeling module holds before (another live patched model of the family keeps its swap).
    before = {name: getattr(modeling, name, None) for _, name in FUNCTION_OPS}
    handle = triton_ops.patch(model)
    assert handle.family == model_type
    assert handle.functions == [(family.modeling, name) for op, name in FUNCTION_OPS if op in family.kernels]
    assert all(getattr(modeling, name) is not before[name] or before[name].__module__.startswith("triton_ops")
               for _, name in handle.functions)
    handle.revert()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {name: getattr(modeling, name, None) for _, name in FUNCTION_OPS} == before


def test_an_unknown_model_type_names_the_supported_ones():
    for ask in (lambda: get_adapter("gpt2"), lambda: get_family(None),
                lambda: model_shape(AutoConfig.for_model("gpt2").to_dict())):
        with pytest.raises(ValueError, match="supported model_types: " + ", ".join(SUPPORTED_MODEL_TYPES)):
            ask()
