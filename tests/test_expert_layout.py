"""Checkpoints of a mixture of experts stored one tensor per expert (HF's own save of Qwen3-MoE,
Qwen3.5-MoE and Mixtral, as the released checkpoints are): `SlideModel.from_pretrained` reads them
into the fused expert weights as HF's loader does (expert_layout.py)."""
import logging

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from helpers import batches, tiny_model

LAYOUT = {"qwen3_moe": "mlp.experts.0.gate_proj.weight", "qwen3_5_moe_text": "mlp.experts.0.gate_proj.weight",
          "mixtral": "block_sparse_moe.experts.0.w1.weight"}


def _keys(path):
    import json
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.parametrize("family", sorted(LAYOUT))
def test_a_per_expert_checkpoint_loads_as_hf_loads_it(tmp_path, family, caplog):
    """HF's save in shards small enough that a layer's experts lie in several files: the slid model
    holds HF's weights exactly (the fused experts, Mixtral's renamed router) and gives HF's loss,
    with no checkpoint tensor left unused."""
    torch.manual_seed(0)
    tiny_model(family).save_pretrained(tmp_path, max_shard_size="20KB")
    keys = _keys(tmp_path)
    assert f"model.layers.0.{LAYOUT[family]}" in keys and len(set(keys.values())) > 3
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="hf_slideformer.checkpoints.checkpoint"):
        slid = hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu", dtype=torch.float32))
    assert "not used" not in caplog.text
    theirs = hf.state_dict()
    for name, w in slid.state_dict().items():
        assert torch.equal(w, theirs[name]), name
    b = batches(1, seed=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(slid(**b).loss, hf(**b).loss, rtol=1e-6, atol=0)


def test_an_expert_missing_from_a_per_expert_checkpoint_is_refused(tmp_path):
    """The experts counted from the checkpoint's names must be the model's: one missing fails the
    shape check, never loads as fewer experts."""
    import json
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if ".experts.3." not in k}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="wrong shape"):
        hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu", dtype=torch.float32))
