"""Whether the embedding and the head train (end_training.py): chosen at slide() and again at the
start of every forward, so that a part frozen after slide() between steps, or trained again,
trains as torch does."""
import math

import pytest
import torch

from hf_slideformer.engine.end_training import FrozenEmbedding, FrozenHead, TrainedEmbedding, TrainedHead
from helpers import batches, make_pair, max_param_diff

LR = 1e-2
PARAM_TOL = 0.05 * LR        # a few percent of one learning-rate step
LOSS_RTOL = 1e-5


def _freeze(model, embedding: bool, head: bool) -> None:
    """requires_grad off for the embedding and/or the head (the lm_head and the final norm)."""
    model.get_input_embeddings().weight.requires_grad_(not embedding)
    for param in (model.get_output_embeddings().weight, model.model.norm.weight):
        param.requires_grad_(not head)


@pytest.mark.parametrize("ga, clip", [(1, None), (2, None), (1, 1.0), (2, 1.0)])
def test_parts_frozen_after_slide_between_steps_train_as_torch(ga, clip):
    """The embedding and the head (lm_head and final norm) frozen after the first step, the
    embedding trained again after the third: the same losses and weights as torch's AdamW, which
    skips a frozen parameter, with updates in the backward and at `optimizer.step()` (clipping)."""
    ref, slid = make_pair("llama", tied=False, gradient_accumulation_steps=ga, max_grad_norm=clip)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.0)
    engine = slid.slide_engine
    frozen = [(False, False), (True, True), (True, True), (False, True)]
    data = batches(len(frozen) * ga)
    for step, (embedding, head) in enumerate(frozen):
        engine.synchronize()           # the last step's updates, queued on the worker, have run
        for model in (ref, slid):
            _freeze(model, embedding, head)
        for batch in data[step * ga:(step + 1) * ga]:
            loss_ref, loss = ref(**batch).loss, slid(**batch).loss
            assert math.isclose(loss.item(), loss_ref.item(), rel_tol=LOSS_RTOL, abs_tol=1e-6)
            assert isinstance(engine.embedding.training, FrozenEmbedding if embedding else TrainedEmbedding)
            assert isinstance(engine.head.training, FrozenHead if head else TrainedHead)
            (loss_ref / ga).backward()
            (loss / ga).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.zero_grad()
    assert max_param_diff(ref, slid) < PARAM_TOL
