"""SlideTrainer.log: the logged grad norm and loss are the true values, NaN included (as the plain Trainer logs)."""
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_slideformer as hs


def broken_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    return model


def data(n=4, seq=16):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (x := torch.randint(0, 128, (seq,), generator=g)), "labels": x.clone()} for _ in range(n)]


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if "loss" in h and key in h]


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_a_non_finite_step_is_logged_as_it_is(tmp_path, max_grad_norm, caplog):
    kw = dict(per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
              save_strategy="no", disable_tqdm=True, max_grad_norm=max_grad_norm, logging_nan_inf_filter=False)
    plain = Trainer(model=broken_model(), args=TrainingArguments(output_dir=str(tmp_path / "p"), **kw),
                    train_dataset=data())
    plain.train()
    # An inf weight on purpose (the step's norm is then NaN): let it past slide()'s check.
    slid = hs.SlideTrainer(model=broken_model(), args=hs.SlideArgs(output_dir=str(tmp_path / "s"),
                                                                   slide_check_finite_weights=False, **kw),
                           train_dataset=data())
    with caplog.at_level("WARNING", logger="hf_slideformer"):
        slid.train()
    norms = logged(slid, "grad_norm")
    assert len(norms) == 2 and all(math.isnan(n) for n in norms)          # the old log dropped them
    assert all(math.isnan(x) for x in logged(slid, "loss"))
    assert [math.isnan(x) for x in logged(plain, "loss")] == [math.isnan(x) for x in logged(slid, "loss")]
    if max_grad_norm:                                                       # the plain Trainer logs its norm then
        assert all(math.isnan(n) for n in logged(plain, "grad_norm"))
    assert "step 1: the gradient norm is nan" in caplog.text
    assert "not checked when it was slid (check_finite_weights=False)" in caplog.text


def test_a_skipped_step_is_not_reported_as_weights_gone_non_finite(tmp_path, caplog):
    """The engine skips a non-finite step's updates: the warning says the weights stayed finite
    (it said they "may now hold non-finite values"); only unchecked weights may."""
    class InfAtFirstStep(hs.SlideTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * float("inf") if self.state.global_step == 0 else loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    kw = dict(per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
              save_strategy="no", disable_tqdm=True)
    trainer = InfAtFirstStep(model=model, args=hs.SlideArgs(output_dir=str(tmp_path), **kw), train_dataset=data())
    with caplog.at_level("WARNING", logger="hf_slideformer"):
        trainer.train()
    assert "step 1: the gradient norm is" in caplog.text
    assert "no weight took a non-finite value" in caplog.text and "may hold non-finite" not in caplog.text
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_tokens_per_second_counts_the_batches_of_hf_collators(tmp_path):
    """DataCollatorForLanguageModeling returns a BatchEncoding (a Mapping, not a dict)."""
    from transformers import BatchEncoding

    def collate(rows):
        ids = torch.stack([r["input_ids"] for r in rows])
        return BatchEncoding({"input_ids": ids, "labels": ids.clone()})

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    trainer = hs.SlideTrainer(model=model, args=hs.SlideArgs(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True), train_dataset=data(), data_collator=collate)
    trainer.train()
    rates = logged(trainer, "tokens_per_s")
    assert len(rates) == 2 and all(r > 0 for r in rates)


def test_a_mixture_of_experts_logs_its_aux_loss_beside_the_loss(tmp_path):
    """Each log line carries `aux_loss` (HF's name), the mean of the logged steps' forwards: with
    the whole data set one batch (a step of one micro-batch), the first step's is HF's aux of it."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from helpers import family_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("qwen3_moe", vocab_size=128))
    batch = data(2)
    with torch.no_grad():
        ids = torch.stack([b["input_ids"] for b in batch])
        expected = model(input_ids=ids, labels=ids).aux_loss.item()
    kw = dict(per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
              save_strategy="no", disable_tqdm=True)
    slid = hs.SlideTrainer(model=model, args=hs.SlideArgs(output_dir=str(tmp_path / "s"), **kw),
                           train_dataset=batch)
    slid.train()
    aux = logged(slid, "aux_loss")
    assert len(aux) == 2 and all(math.isfinite(a) and a > 0 for a in aux)
    assert math.isclose(aux[0], expected, rel_tol=1e-5), (aux, expected)
