"""save_pretrained / SlideModel.from_pretrained: HF-format round trips, sharding, bad checkpoints,
and the host-memory bound of loading layer by layer."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from helpers import batches, make_pair


def _trained(tied, **kw):
    ref, slid = make_pair("qwen2", tied, **kw)
    opt = slid.create_optimizer(lr=1e-2)
    for b in batches(2):
        slid(**b).loss.backward(); opt.step(); opt.zero_grad()
    return slid


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", ["5GB", "20KB"])
def test_save_load_round_trip(tmp_path, tied, shard):
    slid = _trained(tied)
    slid.save_pretrained(tmp_path, max_shard_size=shard)
    files = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in files) == (shard == "20KB")
    assert not [f for f in files if f.startswith(".slide-save-")]
    masters = slid.state_dict()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    for k, v in hf.state_dict().items():
        assert torch.equal(v, masters[k]), k
    again = hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu"))
    assert (again.lm_head.weight is again.model.embed_tokens.weight) == tied
    for k, v in again.state_dict().items():
        assert torch.equal(v, masters[k]), k
    b = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(again(**b).loss, slid(**b).loss, rtol=0, atol=0)


def test_save_in_bf16(tmp_path):
    slid = _trained(False)
    slid.save_pretrained(tmp_path, dtype=torch.bfloat16)
    sd = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert json.load(open(tmp_path / "config.json"))["dtype"] == "bfloat16"


def test_save_pretrained_writes_the_fp32_masters_by_default(tmp_path):
    """A model trained in bf16 exports its fp32 masters and an fp32 config, as HF saves one."""
    from helpers import family_config
    torch.manual_seed(0)
    slid = hs.slide(AutoModelForCausalLM.from_config(family_config("llama")),
                    hs.SlideConfig(device="cpu", dtype=torch.bfloat16))
    slid.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf.dtype == torch.float32 and json.load(open(tmp_path / "config.json"))["dtype"] == "float32"
    masters = slid.state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(v, masters[k]), k


def test_one_file_wins_over_an_index_as_in_hf(tmp_path):
    """With both `model.safetensors` and an index present, both loaders read `model.safetensors`."""
    slid = _trained(False)
    slid.save_pretrained(tmp_path / "a", max_shard_size="20KB")
    other = _trained(False, seed=3)
    other.save_pretrained(tmp_path / "b")
    shutil.copy(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    again = hs.SlideModel.from_pretrained(tmp_path / "a", slide_config=hs.SlideConfig(device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    want = other.state_dict()
    for sd in (again.state_dict(), hf.state_dict()):
        for k, v in sd.items():
            assert torch.equal(v, want[k]), k


def test_missing_and_mismatched_tensors_are_named(tmp_path):
    slid = _trained(False)
    slid.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(hs.CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu"))
    sd = load_file(path) | {"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)}
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(hs.CheckpointError, match=r"up_proj\.weight: checkpoint \(3, 3\)"):
        hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu"))


def test_unsupported_checkpoint_and_missing_dir(tmp_path):
    with pytest.raises(hs.CheckpointError, match="not a directory"):
        hs.SlideModel.from_pretrained(tmp_path / "nope", slide_config=hs.SlideConfig(device="cpu"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(ValueError, match="supported model_types: " + ", ".join(hs.SUPPORTED_MODEL_TYPES)):
        hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu"))


def test_from_pretrained_peak_host_memory_is_bounded(tmp_path):
    """Loading reads tensor by tensor into the store: the peak stays near the fp32 masters, far
    below a materialized model plus its fp32 copy. Measured in a fresh process (ru_maxrss)."""
    from hf_slideformer.demo import tiny_config
    cfg = tiny_config("llama", vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path, max_shard_size="20MB")
    del model
    code = textwrap.dedent(f"""
        import torch, hf_slideformer as hs
        import transformers.models.llama.modeling_llama, safetensors.torch   # code, not data
        import importlib.util
        if importlib.util.find_spec("bitsandbytes"):     # code too: transformers imports it while loading
            import bitsandbytes
        import hf_slideformer.trainer, hf_slideformer.accelerate_plugin   # code too: a slid model imports them
        def hwm():
            return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
        base = hwm()
        m = hs.SlideModel.from_pretrained({str(tmp_path)!r}, slide_config=hs.SlideConfig(device="cpu"))
        print(base, hwm())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    base, peak = map(int, out.stdout.split()[-2:])
    masters = 4 * n
    grew = peak - base
    # The fp32 masters must be resident (the measurement sees them), plus the engine's buffers, the
    # mapped shard being read and one tensor in flight: well under masters + a materialized fp32
    # model (2x masters).
    print(f"from_pretrained: RSS grew {grew / 2 ** 20:.0f} MiB for {masters / 2 ** 20:.0f} MiB of fp32 masters")
    assert 0.9 * masters < grew < 1.3 * masters + 128 * 2 ** 20, (grew / 2 ** 20, masters / 2 ** 20)


def test_two_threads_saving_into_one_folder_leave_one_save_and_name_the_cause(tmp_path, monkeypatch):
    """The second save into a folder another thread is saving into stops at once with an error saying
    so (it removed the first one's staging folder, which then failed with a bare FileNotFoundError);
    the first completes and the folder loads."""
    import threading
    import time

    import hf_slideformer.checkpoints.checkpoint as checkpoint_mod
    from hf_slideformer.checkpoints.atomic_save import ConcurrentSaveError

    _, slid = make_pair()
    real = checkpoint_mod.save_file
    writing = threading.Event()

    def slow(*args, **kwargs):
        writing.set()
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_mod, "save_file", slow)
    errors = []

    def save():
        try:
            slid.save_pretrained(tmp_path / "out")
        except Exception as e:             # noqa: BLE001 - collected for the assertions
            errors.append(e)

    first = threading.Thread(target=save)
    first.start()
    writing.wait(30)
    save()
    first.join()
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentSaveError), errors
    assert "another save into the same folder" in str(errors[0])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in slid.state_dict().items())


# ---------------------------------------------------------------- MXFP4 (gpt-oss's released format)
def _mxfp4(w):
    """An expert weight (E, K, N) in HF's MXFP4 layout: blocks (E, N, K/32, 16) of two 4-bit codes
    a byte, the even element in the low nibble, and scales (E, N, K/32) of biased exponents."""
    from transformers.integrations.mxfp4 import FP4_VALUES
    x = w.transpose(1, 2).reshape(w.shape[0], w.shape[2], -1, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 6.0))
    codes = ((x / torch.exp2(exp))[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp[..., 0] + 127).to(torch.uint8)


def _mxfp4_checkpoint(path):
    """A tiny gpt-oss checkpoint with MXFP4 experts, as released: the scales in a second shard."""
    from helpers import family_config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("gpt_oss", hidden_size=64, intermediate_size=64))
    shards = ({}, {})
    for k, v in model.state_dict().items():
        if ".experts." in k and k.endswith("proj"):
            shards[0][k + "_blocks"], shards[1][k + "_scales"] = _mxfp4(v.float())
        else:
            shards[0][k] = v.float().contiguous()
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    os.makedirs(path)
    for name, tensors in zip(names, shards):
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: n for n, t in zip(names, shards) for k in t}}, f)
    cfg = model.config.to_dict()
    cfg.update(architectures=["GptOssForCausalLM"], quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def test_an_mxfp4_checkpoint_trains_from_its_dequantized_weights_and_saves_plain(tmp_path):
    """The masters are exactly HF's dequantized copy (`Mxfp4Config(dequantize=True)`); the model
    trains; its save has no quantization config and loads in HF to the same logits."""
    from transformers import Mxfp4Config
    src = _mxfp4_checkpoint(str(tmp_path / "mxfp4"))
    hf = AutoModelForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32)
    slid = hs.SlideModel.from_pretrained(src, slide_config=hs.SlideConfig(device="cpu"))
    masters = {k: v.clone() for k, v in slid.state_dict().items()}
    assert set(masters) == set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert torch.equal(masters[k], v), k
    b = batches(1, pad=True)[0]
    with torch.no_grad():
        torch.testing.assert_close(slid(**b).loss, hf(**b).loss, rtol=1e-6, atol=0)
    opt = slid.create_optimizer(lr=1e-2)
    for batch in batches(2, pad=True):
        slid(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(slid.state_dict()["model.layers.0.mlp.experts.down_proj"],
                           masters["model.layers.0.mlp.experts.down_proj"])
    slid.save_pretrained(tmp_path / "saved")
    with open(tmp_path / "saved" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    with torch.no_grad():
        expected = slid(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        torch.testing.assert_close(again(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                   expected, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_quantized_otherwise_is_refused(tmp_path):
    _trained(False).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(hs.CheckpointError, match="bitsandbytes.*dequantized copy"):
        hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu"))
