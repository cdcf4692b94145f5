"""The slid forward's input checks (model_inputs.py; slide_checks.py for the weights): token ids and labels must be
integers, labels inside the vocabulary or -100 (HF raises; truncating would train on other tokens), weights finite."""
import pytest
import torch

import hf_slideformer as hs
import hf_slideformer.compute.model_inputs

from helpers import batches, make_pair


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.bool])
def test_non_integer_input_ids_raise(dtype):
    _, model = make_pair()
    batch = batches(1)[0]
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        model(input_ids=batch["input_ids"].to(dtype), labels=batch["labels"])
    with pytest.raises(TypeError, match="input_ids"):
        with torch.no_grad():
            model(input_ids=batch["input_ids"].to(dtype))


def test_integer_input_ids_of_any_width_run():
    ref, model = make_pair()
    batch = batches(1)[0]
    with torch.no_grad():
        want = ref(**batch).loss
        for dtype in (torch.long, torch.int32):
            got = model(input_ids=batch["input_ids"].to(dtype), labels=batch["labels"]).loss
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- labels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_float_or_bool_labels_raise_as_in_hf(dtype):
    """They were cast to token ids (a fractional label gave the integer label's loss)."""
    _, model = make_pair()
    batch = batches(1)[0]
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        labels = batch["labels"].to(dtype)
        model(input_ids=batch["input_ids"], labels=labels if dtype == torch.bool else labels + 0.3)
    with pytest.raises(TypeError, match="shift_labels must be an integer tensor"):
        with torch.no_grad():
            model(input_ids=batch["input_ids"], shift_labels=batch["labels"].to(dtype))


@pytest.mark.parametrize("bad", [97, 300, -1, -7])
def test_labels_outside_the_vocabulary_raise_naming_the_value(bad):
    _, model = make_pair()
    opt = model.create_optimizer(lr=1e-2)
    batch = batches(1)[0]
    labels = batch["labels"].clone()
    labels[0, 3] = bad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hs.compute.model_inputs.LabelError, match=rf"in \[0, 97\) or -100.*\[{bad}\]"):
        model(input_ids=batch["input_ids"], labels=labels).loss.backward()
    with pytest.raises(hs.compute.model_inputs.LabelError):
        model(input_ids=batch["input_ids"], labels=labels, fused_lm_head=True)
    opt.zero_grad()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    labels[0, 3] = -100                                   # ignored, as in HF
    model(input_ids=batch["input_ids"], labels=labels).loss.backward()
    opt.step()


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [300, -1, -7])
def test_labels_outside_the_vocabulary_on_cuda_train_nothing_and_raise(bad):
    """On CUDA the check holds no synchronization in the forward: the step's gradients are NaN (so
    every update is skipped) and `optimizer.step()` raises naming the value (model_inputs.py)."""
    from transformers import AutoModelForCausalLM
    from helpers import family_config
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(family_config("llama", vocab_size=256)).float()
    model = hs.slide(ref, hs.SlideConfig(device="cuda", dtype=torch.bfloat16))
    opt = model.create_optimizer(lr=1e-2)
    ids = torch.randint(2, 256, (2, 16))
    labels = ids.clone()
    labels[1, 5] = bad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    with pytest.raises(hs.compute.model_inputs.LabelError, match=rf"\[{bad}\]"):
        opt.step()
    assert torch.isnan(loss).item()
    opt.zero_grad()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    model(input_ids=ids, labels=ids).loss.backward()      # a good batch trains again
    opt.step()
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in before.items())


# ---------------------------------------------------------------------------------------- weights
def _nan_model():
    from transformers import AutoModelForCausalLM
    from helpers import family_config
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(family_config("llama")).float()
    with torch.no_grad():
        m.model.layers[1].self_attn.v_proj.weight[2, 3] = float("nan")
    return m


def test_a_nan_weight_is_refused_at_slide_naming_the_parameter():
    with pytest.raises(hs.NonFiniteWeightError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight.*"
                                                      r"check_finite_weights=False"):
        hs.slide(_nan_model(), hs.SlideConfig(device="cpu"))
    model = hs.slide(_nan_model(), hs.SlideConfig(device="cpu", check_finite_weights=False))   # the way past it
    assert torch.isnan(model.model.layers[1].self_attn.v_proj.weight).any()


def test_a_nan_weight_in_a_checkpoint_is_refused_at_load(tmp_path):
    _nan_model().save_pretrained(tmp_path)
    with pytest.raises(hs.NonFiniteWeightError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        hs.SlideModel.from_pretrained(tmp_path, hs.SlideConfig(device="cpu"))
    hs.SlideModel.from_pretrained(tmp_path, hs.SlideConfig(device="cpu", check_finite_weights=False))
