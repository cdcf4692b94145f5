"""The slid forward's input checks: token ids must be integers (HF raises; truncating would train on other tokens)."""
import pytest
import torch

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
