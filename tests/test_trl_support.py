"""TRL's SFTTrainer and DPOTrainer on a slid model against the same trainer on the plain model (CPU, fp32).

The slid model answers TRL's `fused_lm_head=True` forward from the engine's own head
(`fused_head.fused_head`, `functions.TokenHeadFunction`); the only change to a TRL script is
the model. Losses, gradient norms and TRL's metrics agree to 1e-5 relative; weights within 5% of
one lr=1e-2 update (Adam divides by sqrt(v), amplifying 1e-7 gradient differences, from sums
taken in another order, where the gradient is ~0; a wrong gradient moves them by a whole step).
"""
from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config  # noqa: E402

import hf_slideformer as hs  # noqa: E402
from hf_slideformer.training_args import SlideArgsError  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5
WEIGHT_ATOL = 0.05 * 1e-2
WORDS = ("the a lighthouse keeper repaired long harbour wall with great care ship sea night light user assistant "
         "system : question answer yes no").split()
CHAT = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    out.chat_template = CHAT
    return out


def sentences(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    content = WORDS[:16]
    return [" ".join(content[int(i)] for i in torch.randint(0, 16, (int(torch.randint(3, 9, (1,), generator=g)),),
                                                           generator=g)) for _ in range(n)]


def dataset(kind: str):
    a, b = sentences(16, 0), sentences(16, 1)
    if kind == "text":
        return datasets.Dataset.from_dict({"text": [x + " " + y for x, y in zip(a, b)]})
    if kind == "completion":
        return datasets.Dataset.from_dict({"prompt": a, "completion": b})
    if kind == "conversational":
        return datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": x},
                                                         {"role": "assistant", "content": y}] for x, y in zip(a, b)]})
    if kind == "preference":
        return datasets.Dataset.from_dict({"prompt": a, "chosen": b, "rejected": sentences(16, 2)})
    raise ValueError(kind)


def tiny(family: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(WORDS) + 4, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    cfg = LlamaConfig(**common) if family == "llama" else Qwen3Config(head_dim=8, **common)
    model = AutoModelForCausalLM.from_config(cfg).float()
    return model, copy.deepcopy(model)


def slid(model):
    return hs.slide(model, hs.SlideConfig(device="cpu", dtype=torch.float32))


def sft_args(tmp_path, name, **kw):
    args = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                max_grad_norm=0.05, learning_rate=1e-2, max_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                save_strategy="no", bf16=False, disable_tqdm=True, max_length=32, seed=0)
    args.update(kw)
    return args


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def assert_same_run(plain, slide_trainer, keys=("loss", "grad_norm", "mean_token_accuracy", "entropy")):
    for key in keys:
        a, b = logged(plain, key), logged(slide_trainer, key)
        assert a and len(a) == len(b), key
        torch.testing.assert_close(torch.tensor(b, dtype=torch.float64), torch.tensor(a, dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
    sa, sb = plain.model.state_dict(), slide_trainer.model.state_dict()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("family,kind,extra", [
    ("llama", "text", {}),
    ("qwen3", "text", {}),
    ("llama", "completion", {}),                   # completion-only loss (TRL's default for this format)
    ("qwen3", "conversational", {}),               # the chat template
    ("llama", "text", {"packing": True}),
])
def test_sft_trainer_on_a_slid_model_matches_the_plain_model(tmp_path, family, kind, extra):
    ref, copy_ = tiny(family)
    tok, data = tokenizer(), dataset(kind)
    plain = trl.SFTTrainer(model=ref, args=trl.SFTConfig(**sft_args(tmp_path, "plain", **extra)), train_dataset=data,
                           processing_class=tok)
    plain.train()
    sliding = trl.SFTTrainer(model=slid(copy_), args=trl.SFTConfig(**sft_args(tmp_path, "slide", **extra)),
                             train_dataset=data, processing_class=tok)
    sliding.train()
    assert isinstance(sliding, hs.SlideTrainer) and isinstance(sliding.args, hs.SlideArgs)
    assert_same_run(plain, sliding)


def test_sft_loss_with_no_trainable_token_is_a_finite_zero(tmp_path):
    model = slid(tiny()[1])
    ids = torch.randint(4, 20, (2, 7))
    out = model(input_ids=ids, labels=torch.full_like(ids, -100), fused_lm_head=True)
    assert out.loss.item() == 0.0 and out.log_probs.shape == (2, 6) and not out.label_mask.any()


def test_slide_sft_config_takes_the_slide_settings_and_resumes_exactly(tmp_path):
    """`hs.SlideSFTConfig` carries `slide_*` settings; a run resumed from a TRL checkpoint equals the uninterrupted run."""
    tok, data = tokenizer(), dataset("text")
    whole_model = tiny()[0]
    kw = sft_args(tmp_path, "whole", max_steps=4, save_strategy="steps", save_steps=2, slide_window=3)
    whole = trl.SFTTrainer(model=whole_model, args=hs.SlideSFTConfig(**kw), train_dataset=data, processing_class=tok)
    whole.train()
    assert whole.model.slide_config.window == 3
    resumed = trl.SFTTrainer(model=tiny()[0], args=hs.SlideSFTConfig(**{**kw, "output_dir": str(tmp_path / "again")}),
                             train_dataset=data, processing_class=tok)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    sa, sb = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert logged(resumed, "loss")[-2:] == logged(whole, "loss")[-2:]
    # The saved model is a plain HF checkpoint with the same logits.
    whole.save_model(str(tmp_path / "export"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    ids = torch.randint(4, 20, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, whole.model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def dpo_args(tmp_path, name, **kw):
    args = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                max_grad_norm=0.5, learning_rate=1e-2, max_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                save_strategy="no", bf16=False, disable_tqdm=True, max_length=32, seed=0,
                precompute_ref_log_probs=True)
    args.update(kw)
    return args


def test_dpo_trainer_on_a_slid_model_matches_the_plain_model(tmp_path):
    ref, copy_ = tiny()
    tok, data = tokenizer(), dataset("preference")
    plain = trl.DPOTrainer(model=ref, args=trl.DPOConfig(**dpo_args(tmp_path, "plain")), train_dataset=data,
                           processing_class=tok)
    plain.train()
    sliding = trl.DPOTrainer(model=slid(copy_), args=trl.DPOConfig(**dpo_args(tmp_path, "slide")),
                             train_dataset=data, processing_class=tok)
    sliding.train()
    assert_same_run(plain, sliding, keys=("loss", "grad_norm", "rewards/margins"))


def test_dpo_without_precomputed_reference_is_refused(tmp_path):
    with pytest.raises(SlideArgsError, match="precompute_ref_log_probs=True"):
        trl.DPOTrainer(model=slid(tiny()[0]), args=trl.DPOConfig(**dpo_args(tmp_path, "x", precompute_ref_log_probs=False)),
                       train_dataset=dataset("preference"), processing_class=tokenizer())


def test_what_the_engine_head_cannot_compute_is_refused(tmp_path):
    from trl.trainer.utils import add_fused_lm_head

    model = slid(tiny()[0])
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))       # SFT's: left out
    assert "forward" not in model.__dict__
    with pytest.raises(NotImplementedError, match="temperature=0.7"):
        add_fused_lm_head(model, temperature=0.7)                                # GRPO's sampling temperature
    with pytest.raises(NotImplementedError, match="mystery"):
        add_fused_lm_head(model, outputs=("log_probs", "mystery"))
    with pytest.raises(SlideArgsError, match="compute_loss_func"):
        trl.SFTTrainer(model=model, args=trl.SFTConfig(**sft_args(tmp_path, "x")), train_dataset=dataset("text"),
                       processing_class=tokenizer(), compute_loss_func=lambda out, labels, **kw: out.logits.sum())


def test_a_loss_made_outside_the_model_head_is_named():
    model = slid(tiny()[0])
    model.create_optimizer()
    ids = torch.randint(4, 20, (2, 7))
    hidden = model.model(input_ids=ids).last_hidden_state            # bypasses the head
    with pytest.raises(hs.SlideStateError, match="without passing through its loss head"):
        hidden.float().pow(2).mean().backward()
