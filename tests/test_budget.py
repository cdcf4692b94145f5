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
