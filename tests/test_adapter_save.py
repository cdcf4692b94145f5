"""`save_pretrained` of a slid PEFT model (adapter_save.py): killed at any file-system step over an
earlier adapter (PEFT's weights write killed half-way), the folder loads with
`PeftModel.from_pretrained` as the old adapter or the new one, never neither; once it loads as new
no later step loads as old; other files in the folder stay."""
import copy

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from helpers import batches, family_config
from kill_points import every_kill

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _base():
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(family_config("llama")).float()
    base.config.use_cache = False
    return base


def _loaded(path) -> dict:
    m = PeftModel.from_pretrained(_base(), path)
    return {n: p.detach().clone() for n, p in m.named_parameters() if "lora_" in n}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_adapter_save_killed_at_every_step_loads_old_or_new(tmp_path):
    pm = get_peft_model(_base(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    slid = hs.slide(pm, hs.SlideConfig(device="cpu", dtype=torch.float32))
    old_dir, out = tmp_path / "old", tmp_path / "out"
    slid.save_pretrained(old_dir)
    old = _loaded(old_dir)
    opt = slid.create_optimizer(lr=1e-2)
    b = batches(1)[0]
    slid(**b).loss.backward()
    opt.step()
    new_dir = tmp_path / "new"
    slid.save_pretrained(new_dir)
    new = _loaded(new_dir)
    assert not _same(old, new)

    def prepare():
        import shutil
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(old_dir, out)
        (out / "tokenizer.json").write_text("{}")          # a file of the user's

    seen_new, steps = False, 0
    for step, killed in every_kill(prepare, lambda: slid.save_pretrained(out)):
        got = _loaded(out)
        is_new = _same(got, new)
        assert is_new or _same(got, old), f"killed at step {step}: the folder loads as neither"
        assert not (seen_new and not is_new), f"killed at step {step}: back to the old adapter"
        seen_new |= is_new
        assert (out / "tokenizer.json").read_text() == "{}"
        steps = step
    assert seen_new and steps >= 2
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in new_dir.iterdir()) + ["tokenizer.json"]
