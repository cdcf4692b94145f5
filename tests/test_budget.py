"""The GPU budget's arithmetic (resident units, the device-update share) is the one the planner and the engine share."""
import torch

from hf_slideformer.planner import budget, planner

from hf_slideformer.engine import device_update, resident


def test_engine_and_planner_read_the_same_budget():
    assert resident.plan_resident is budget.plan_resident is planner.plan_resident
    assert device_update.balanced_share is budget.balanced_share is planner.balanced_share
    assert device_update.pick_device_units is budget.pick_device_units


def test_resident_bytes_per_param():
    assert budget.resident_bytes_per_param(torch.bfloat16) == 14      # master, m, v (fp32) + bf16 weights
    assert budget.resident_bytes_per_param(torch.float16) == 14
    assert budget.resident_bytes_per_param(torch.float32) == 12       # the master is the weights


def test_device_piece_keeps_a_layer_to_a_bounded_number_of_pieces():
    least, most = budget.DEVICE_PIECE, budget.DEVICE_PIECES_MAX
    for numel in (1, least, least * most, least * most + 1, 218_103_808, 553_000_000, 1_400_000_000):
        piece = budget.device_piece(numel)
        assert piece >= least and piece % least == 0 and (piece // least).bit_count() == 1
        assert numel <= piece * most                             # at most `most` pieces of it
        assert piece == least or numel > piece // 2 * most       # and no larger than that needs
    assert budget.device_piece(218_103_808) == least             # an 8B layer keeps 2^22
    assert budget.device_piece(553_000_000) == 1 << 24           # a 24B layer: 2^24


def _estimator(name: str, **kw):
    """The planner's estimator for benchmarks/configs/<name>.json, sequence 2048, window 2, 4 buffers."""
    from pathlib import Path

    from hf_slideformer.planner.plan_estimate import Estimator
    from hf_slideformer.planner.planner import load_model_config, model_shape

    shape = model_shape(load_model_config(Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / f"{name}.json"))
    return Estimator(shape, 2048, 2, 4, None, **kw)


def test_the_planner_sizes_the_device_buffers_by_the_piece():
    """Two sets of up to 2 pieces of fp32 master, gradient and moments: a 24B layer's are larger."""
    for name, piece in (("llama3-8b", 1 << 22), ("mistral-small-24b", 1 << 24)):
        est = _estimator(name)
        extras = est.gpu_extras(1, clipping=True)
        assert extras["device-update buffers (2 x 4 fp32 pieces)"] == 2 * 4 * 4 * min(2 * piece, est.s.layer_params)


def test_the_planner_counts_the_device_buffers_of_a_share_in_the_backward():
    """Without clipping, a numeric share updates layers on the device in their backward: same buffers."""
    assert not _estimator("mistral-small-24b").gpu_extras(1, clipping=False)
    with_share = _estimator("mistral-small-24b", device_share=0.5).gpu_extras(1, clipping=False)
    assert with_share["device-update buffers (2 x 4 fp32 pieces)"] == 32 * (2 << 24)
