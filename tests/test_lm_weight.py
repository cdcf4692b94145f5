"""Where the lm_head weight lives (`lm_weight.py`): an entry of the head unit, or the tied
embedding's table; the head asks it which units its slot carries and which weight it multiplies."""
import torch

from helpers import batches, make_pair
from hf_slideformer.engine.lm_weight import OwnWeight, TiedWeight


def _head_weight(model):
    """The weight the head multiplies by, as the head's lm_weight gives it, copied off its slot."""
    head = model.slide_engine.head
    slot, _, weight = head.lm_weight.weights(head.slots)
    try:
        return weight.detach().clone()
    finally:
        head.slots.release(slot)


def test_an_untied_lm_head_is_an_entry_of_the_head_unit():
    ref, slid = make_pair("llama", False)
    eng = slid.slide_engine
    assert isinstance(eng.head.lm_weight, OwnWeight)
    assert eng.head.slot_units() == (eng.head_unit,)
    assert eng.head.updates_last                       # one backward per step, no clipping
    assert torch.equal(_head_weight(slid), ref.lm_head.weight.detach())


def test_a_tied_lm_head_is_the_embeddings_table():
    ref, slid = make_pair("llama", True)
    eng = slid.slide_engine
    assert isinstance(eng.head.lm_weight, TiedWeight)
    assert eng.head.slot_units() == (eng.head_unit, eng.embed_unit)
    assert not eng.head.updates_last                   # updated with the embedding
    assert torch.equal(_head_weight(slid), ref.model.embed_tokens.weight.detach())


def test_a_resident_tied_embedding_leaves_the_head_slot():
    """Once the embedding is resident the head multiplies by its device copy: the slot carries the head alone."""
    ref, slid = make_pair("llama", True, resident_embedding=True, resident_layers=0)
    opt = slid.create_optimizer(lr=1e-2)
    for batch in batches(2):
        slid(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    eng = slid.slide_engine
    assert eng.embedding.resident is not None
    assert eng.head.slot_units() == (eng.head_unit,)
    table = eng.embedding.resident.weights.view(eng.vocab, eng.hidden)
    assert torch.equal(_head_weight(slid), table)
