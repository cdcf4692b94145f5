"""Several ranks over gloo on the CPU (data_parallel.py, sharded.py): two processes, each sliding
the same model over its half of the global batch with one shared copy of the state, against one
process on the whole batch."""
import contextlib
import math
import os
import socket
import sys
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import hf_slideformer as hs

sys.path.insert(0, os.path.dirname(__file__))
from helpers import family_config  # noqa: E402

LR = 1e-2
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _as_rank(rank: int, port: int):
    """Run the block as rank `rank` of a launch on this host (the environment torchrun sets); its
    traceback printed if it fails; the group ended after it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    try:
        yield
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _model(tied: bool, cfg: dict, device: str = "cpu"):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(family_config("llama", tied)).float()
    m.config.use_cache = False
    if device == "cuda":                                  # fp32 on the GPU: no TF32, the reference kernels
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        cfg = dict(cfg, use_kernels=False)
    return hs.slide(m, hs.SlideConfig(device=device, dtype=torch.float32, **cfg))


def _data(steps: int, ga: int, bsz: int = 4, seq: int = 11, vocab: int = 97):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(2, vocab, (bsz, seq), generator=g) for _ in range(ga)] for _ in range(steps)]


def _train(model, opt, data, ga: int, rows=slice(None), dp=False, poison=None):
    """Steps over `data` (each a list of ga micro-batches), this process's `rows` of each; the loss
    of every micro-batch, averaged over the ranks, and after each step its gradient norm. At step
    `poison` the loss is made infinite (with several ranks, on the last rank only)."""
    losses = []
    for n, step in enumerate(data):
        for ids in step:
            ids = ids[rows]
            loss = model(input_ids=ids, labels=ids).loss
            if n == poison and (not dp or torch.distributed.get_rank() == WORLD - 1):
                loss = loss * float("inf")
            (loss / ga).backward()
            x = loss.detach().clone()
            if dp:
                torch.distributed.all_reduce(x)
                x /= WORLD
            losses.append(float(x))
        opt.step()
        losses.append(opt.last_grad_norm)       # the step's norm, the same on every rank
        opt.zero_grad()
    return losses


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank_main(rank: int, port: int, out: str, cases: list, fail_at):
    results = []
    with _as_rank(rank, port):
        for case in cases:
            tied, ga, clip, steps = case["tied"], case["ga"], case["clip"], case["steps"]
            model = _model(tied, dict(gradient_accumulation_steps=ga, max_grad_norm=clip), case.get("device", "cpu"))
            assert model.slide_engine.dp is not None and model.slide_engine.dp.world == WORLD
            opt = model.create_optimizer(lr=LR)
            half = 4 // WORLD
            rows = slice(rank * half, (rank + 1) * half)
            data = _data(steps, ga)
            if fail_at is not None and rank == 1:
                _train(model, opt, data[:fail_at], ga, rows, dp=True)
                raise RuntimeError("rank 1 fails on purpose")
            res = {"losses": _train(model, opt, data, ga, rows, dp=True, poison=case.get("poison")),
                   "state": _state(model),
                   "opt": opt.state_dict()["state"]}
            if case.get("resume"):
                # Save after the first steps (rank 0 writes), go on; a fresh model loads and goes on the same way.
                ck = os.path.join(out, f"ck_{len(results)}")
                from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state
                model2 = _model(tied, dict(gradient_accumulation_steps=ga, max_grad_norm=clip))
                opt2 = model2.create_optimizer(lr=LR)
                _train(model2, opt2, data[:2], ga, rows, dp=True)
                save_training_state(ck, model2, opt2)
                torch.distributed.barrier()
                after = _train(model2, opt2, data[2:], ga, rows, dp=True)
                model3 = _model(tied, dict(gradient_accumulation_steps=ga, max_grad_norm=clip))
                opt3 = model3.create_optimizer(lr=LR)
                load_training_state(ck, model3, opt3)
                resumed = _train(model3, opt3, data[2:], ga, rows, dp=True)
                res.update(after=after, after_state=_state(model2), resumed=resumed, resumed_state=_state(model3))
                model2.slide_engine.close()
                model3.slide_engine.close()
            results.append(res)
            model.slide_engine.close()
        if rank == 0:
            torch.save(results, os.path.join(out, "ranks.pt"))


def _one_process(case: dict) -> dict:
    ga, clip = case["ga"], case["clip"]
    model = _model(case["tied"], dict(gradient_accumulation_steps=ga, max_grad_norm=clip), case.get("device", "cpu"))
    assert model.slide_engine.dp is None
    opt = model.create_optimizer(lr=LR)
    losses = _train(model, opt, _data(case["steps"], ga), ga, poison=case.get("poison"))
    out = {"losses": losses, "state": _state(model), "opt": opt.state_dict()["state"]}
    model.slide_engine.close()
    return out


def _spawn(tmp_path, cases, fail_at=None):
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path), cases, fail_at), nprocs=WORLD, join=True)
    return torch.load(os.path.join(tmp_path, "ranks.pt"))


CASES = [dict(tied=False, ga=1, clip=None, steps=3), dict(tied=True, ga=1, clip=None, steps=3),
         dict(tied=False, ga=1, clip=0.3, steps=3), dict(tied=True, ga=2, clip=0.3, steps=3),
         dict(tied=False, ga=2, clip=None, steps=3, resume=True), dict(tied=True, ga=1, clip=None, steps=3, poison=1),
         dict(tied=False, ga=2, clip=0.3, steps=3, poison=1)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("dp"), CASES)


@pytest.mark.parametrize("k", range(len(CASES)), ids=[
    "untied", "tied", "clip", "tied-ga2-clip", "ga2-resume", "nonfinite", "nonfinite-ga2-clip"])
def test_two_ranks_equal_one_process_on_the_same_global_batch(ranks, k):
    """Loss and gradient norm within 1e-5 relative, every parameter within 5% of one lr step after
    three steps, the AdamW moments close and the step counters equal: with and without
    accumulation and clipping, tied and untied embeddings. A step whose gradient is not finite on
    one rank is skipped by every rank, as one process skips it."""
    ref, got = _one_process(CASES[k]), ranks[k]
    for a, b in zip(ref["losses"], got["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5) or not (math.isfinite(a) or math.isfinite(b)), \
            (ref["losses"], got["losses"])
    worst = max(float((ref["state"][n] - got["state"][n]).abs().max()) for n in ref["state"])
    assert worst < 0.05 * LR, worst
    for i, st in ref["opt"].items():
        assert torch.equal(torch.as_tensor(st["step"]), torch.as_tensor(got["opt"][i]["step"]))
        assert torch.allclose(st["exp_avg"], got["opt"][i]["exp_avg"], rtol=1e-3, atol=1e-6)


def test_two_ranks_resume_exactly(ranks):
    """A training checkpoint written by rank 0 after two steps, loaded by both ranks into fresh
    models: the next step gives the same losses and weights, bit for bit."""
    got = ranks[next(k for k, c in enumerate(CASES) if c.get("resume"))]
    assert got["after"] == got["resumed"]
    for n, t in got["after_state"].items():
        assert torch.equal(t, got["resumed_state"][n]), n


def test_a_failing_rank_ends_every_rank_with_its_traceback(tmp_path, capfd):
    """Rank 1 raises after one step while rank 0 waits for it in a collective: rank 0's collective
    fails at once (its peer is gone), the launch ends without a hang, and rank 1's traceback is
    there (the launcher reports whichever rank it saw end first)."""
    import time
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        _spawn(tmp_path, [dict(tied=False, ga=1, clip=None, steps=3)], fail_at=1)
    assert time.monotonic() - t0 < 120
    seen = str(err.value) + capfd.readouterr().err
    assert "rank 1 fails on purpose" in seen


def test_unsupported_options_are_refused_with_several_processes(monkeypatch):
    """One process that sees WORLD_SIZE=2 without a group: the options that stay single-process are
    refused before anything is allocated (checked without starting a group)."""
    from hf_slideformer.engine.data_parallel import DataParallel
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    for kw, word in ((dict(host_memory_limit=8, nvme_path="/tmp"), "host_memory_limit"),
                     (dict(resident_layers=2), "resident_layers"),
                     (dict(device_update_share=0.5), "device_update_share"),
                     (dict(optimizer_state="adamw_8bit"), r"optimizer_state='adamw_8bit' \(use 'adamw': .*blocks")):
        with pytest.raises(ValueError, match=word):
            DataParallel.from_environment(hs.SlideConfig(device="cpu", **kw))
    with pytest.raises(ValueError, match="frozen parameters"):
        DataParallel.from_environment(hs.SlideConfig(device="cpu"), frozen=True)
    from hf_slideformer.engine.data_parallel import check_one_host
    check_one_host(["gpu-box"] * 4)
    with pytest.raises(ValueError, match="several hosts.*FSDP"):
        check_one_host(["gpu-box", "gpu-box", "other-box"])


def test_the_example_trains_under_torchrun(tmp_path):
    """`torchrun --nproc_per_node 2 examples/finetune_tiny.py`: the launcher's environment alone
    starts the group (gloo on the CPU); the two processes train the one model and rank 0 saves it."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), os.path.join(root, "examples", "finetune_tiny.py"),
                          "--steps", "12", "--device", "cpu", "--save", str(tmp_path / "model")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 processes" in out.stdout and "OK: fine-tuned" in out.stdout
    assert (tmp_path / "model" / "config.json").is_file()


# ---------------------------------------------------------------------------------------------
# the Trainer with several processes
# ---------------------------------------------------------------------------------------------
def _trainer(out: str, steps: int, batch: int, **kw):
    from torch.utils.data import SequentialSampler
    from transformers import LlamaConfig, LlamaForCausalLM

    class InOrder(hs.SlideTrainer):
        def _get_train_sampler(self, *a, **k):      # the same global batches whatever the ranks
            return SequentialSampler(self.train_dataset)

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (x := torch.randint(0, 128, (16,), generator=g)), "labels": x.clone()} for _ in range(24)]
    args = hs.SlideArgs(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=LR,
                        max_grad_norm=0.3, logging_steps=1, report_to=[], use_cpu=True, lr_scheduler_type="constant",
                        disable_tqdm=True, seed=0, **kw)
    return InOrder(model=LlamaForCausalLM(cfg), args=args, train_dataset=data)


def _trainer_rank(rank: int, port: int, out: str):
    with _as_rank(rank, port):
        # Three steps with a checkpoint after the second, then a resume from it for the third.
        t = _trainer(os.path.join(out, "run"), 3, 2, save_strategy="steps", save_steps=2)
        assert t.model.slide_engine.dp is not None
        t.train()
        first = {"losses": [h["loss"] for h in t.state.log_history if "loss" in h],
                 "norms": [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h], "state": _state(t.model)}
        t.model.slide_engine.close()
        r = _trainer(os.path.join(out, "run"), 3, 2, save_strategy="no")
        r.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
        resumed = _state(r.model)
        if rank == 0:
            torch.save({"first": first, "resumed": resumed,
                        "files": sorted(os.listdir(os.path.join(out, "run", "checkpoint-2")))},
                       os.path.join(out, "trainer.pt"))
        r.model.slide_engine.close()


def test_the_trainer_with_two_processes(tmp_path):
    """`SlideTrainer` under two processes (the launcher's environment; Accelerate starts gloo): no
    DistributedDataParallel around the slid model, each rank its half of the global batch, the same
    losses and weights as one process on the whole batch; the checkpoint (written by rank 0, with
    every rank's RNG state) resumes both ranks to the same weights."""
    mp.spawn(_trainer_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    got = torch.load(os.path.join(tmp_path, "trainer.pt"))
    one = _trainer(str(tmp_path / "one"), 3, 4, save_strategy="no")
    assert one.model.slide_engine.dp is None
    one.train()
    ref = [h["loss"] for h in one.state.log_history if "loss" in h]
    assert len(ref) == len(got["first"]["losses"]) == 3
    for a, b in zip(ref, got["first"]["losses"]):
        assert math.isclose(a, b, rel_tol=1e-4), (ref, got["first"]["losses"])
    norms = [h["grad_norm"] for h in one.state.log_history if "grad_norm" in h]
    assert len(norms) == 3
    for a, b in zip(norms, got["first"]["norms"]):
        assert math.isclose(a, b, rel_tol=1e-4), (norms, got["first"]["norms"])
    state = _state(one.model)
    worst = max(float((state[n] - got["first"]["state"][n]).abs().max()) for n in state)
    assert worst < 0.05 * LR, worst
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(got["files"])
    for n, t in got["first"]["state"].items():
        assert torch.equal(t, got["resumed"][n]), n


# ---------------------------------------------------------------------------------------------
# a plain Accelerate loop with several processes
# ---------------------------------------------------------------------------------------------
def _accelerate_run(acc, steps: int, batch: int, load: str | None = None, save_at: int | None = None,
                    save: str | None = None):
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = acc.slide(LlamaForCausalLM(cfg))
    opt = model.create_optimizer(lr=LR)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (x := torch.randint(0, 128, (16,), generator=g)), "labels": x.clone()} for _ in range(24)]
    model, opt, dl = acc.prepare(model, opt, DataLoader(data, batch_size=batch))
    if load is not None:
        acc.load_state(load)
    losses, it = [], iter(dl)
    done = 0 if load is None else save_at
    for step in range(steps):
        b = next(it)
        if step < done:
            continue                                  # the batches the checkpoint already trained on
        loss = model(**b).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
        if save is not None and step + 1 == save_at:
            acc.save_state(save)
    return model, losses


def _accelerate_rank(rank: int, port: int, out: str):
    from hf_slideformer.accelerate_plugin import SlideAccelerator, SlidePlugin
    with _as_rank(rank, port):
        acc = SlideAccelerator(cpu=True, slide_plugin=SlidePlugin(max_grad_norm=0.3))
        assert acc.num_processes == WORLD
        model, losses = _accelerate_run(acc, 3, 2, save_at=2, save=os.path.join(out, "ck"))
        assert model.slide_engine.dp is not None
        first = _state(model)
        model.slide_engine.close()
        acc = SlideAccelerator(cpu=True, slide_plugin=SlidePlugin(max_grad_norm=0.3))    # a fresh run
        again, _ = _accelerate_run(acc, 3, 2, load=os.path.join(out, "ck"), save_at=2)
        if rank == 0:
            torch.save({"losses": losses, "state": first, "resumed": _state(again),
                        "files": sorted(os.listdir(os.path.join(out, "ck")))}, os.path.join(out, "acc.pt"))
        again.slide_engine.close()


def test_an_accelerate_loop_with_two_processes(tmp_path):
    """`SlideAccelerator` under two processes: the model is not wrapped in DistributedDataParallel,
    the data loader gives each rank its half of the global batch, the result equals one process;
    `save_state` (every rank's RNG state, the shared slide state written once) and `load_state`
    resume both ranks to the same weights."""
    from hf_slideformer.accelerate_plugin import SlideAccelerator, SlidePlugin
    mp.spawn(_accelerate_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    got = torch.load(os.path.join(tmp_path, "acc.pt"))
    one, ref = _accelerate_run(SlideAccelerator(cpu=True, slide_plugin=SlidePlugin(max_grad_norm=0.3)), 3, 4)
    for a, b in zip(ref, got["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (ref, got["losses"])
    state = _state(one)
    worst = max(float((state[n] - got["state"][n]).abs().max()) for n in state)
    assert worst < 0.05 * LR, worst
    assert "slide_state" in got["files"] and any(f.startswith("random_states_1") for f in got["files"])
    for n, t in got["state"].items():
        assert torch.equal(t, got["resumed"][n]), n


def _weights_rank(rank: int, port: int, ckpt: str):
    from transformers import AutoModelForCausalLM
    with _as_rank(rank, port):
        torch.manual_seed(rank)                           # each rank's own random init ...
        m = AutoModelForCausalLM.from_config(family_config("llama", False)).float()
        expect = {k: v.clone() for k, v in m.state_dict().items()}
        slid = hs.slide(m, hs.SlideConfig(device="cpu", dtype=torch.float32))
        from hf_slideformer.config import worker_threads      # the ranks' workers share the cores
        assert slid.slide_config.cpu_threads == worker_threads(max(1, (os.cpu_count() or 1) // WORLD))
        torch.manual_seed(0)                              # ... and rank 0's, which both must train
        ref = AutoModelForCausalLM.from_config(family_config("llama", False)).float().state_dict()
        got = slid.state_dict()
        assert all(torch.equal(got[k], ref[k]) for k in ref), "rank 0's weights are not the model's"
        assert rank == 0 or any(not torch.equal(expect[k], ref[k]) for k in ref)
        loaded = hs.SlideModel.from_pretrained(ckpt, slide_config=hs.SlideConfig(device="cpu", dtype=torch.float32))
        from safetensors.torch import load_file
        saved = load_file(os.path.join(ckpt, "model.safetensors"))
        got = loaded.state_dict()
        assert all(torch.equal(got[k], saved[k]) for k in saved)
        slid.slide_engine.close()
        loaded.slide_engine.close()


@pytest.mark.parametrize("shared", ["memory files", "a directory"])
def test_rank_0_weights_are_the_models(tmp_path, monkeypatch, shared):
    """Each rank built its model from its own random init: after slide() the shared masters hold
    rank 0's, as DistributedDataParallel broadcasts them. `SlideModel.from_pretrained` reads the
    checkpoint once (rank 0) and every rank sees it. The state shared through anonymous memory
    files (the default) or through files in $HF_SLIDEFORMER_SHM_DIR, removed once mapped."""
    from transformers import AutoModelForCausalLM
    if shared == "a directory":
        (tmp_path / "shm").mkdir()
        monkeypatch.setenv("HF_SLIDEFORMER_SHM_DIR", str(tmp_path / "shm"))
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(family_config("llama", False)).float().save_pretrained(tmp_path / "ck")
    mp.spawn(_weights_rank, args=(_free_port(), str(tmp_path / "ck")), nprocs=WORLD, join=True)
    if shared == "a directory":
        assert not list((tmp_path / "shm").iterdir())            # every name removed once mapped


def test_a_shared_memory_directory_without_room_is_reported(tmp_path, monkeypatch):
    """$HF_SLIDEFORMER_SHM_DIR that cannot hold the state: every rank stops at slide() with an error
    naming the directory and the fix, not a crash in the middle of training."""
    monkeypatch.setenv("HF_SLIDEFORMER_SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(Exception, match="HF_SLIDEFORMER_SHM_DIR"):
        mp.spawn(_weights_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)


GPU_CASES = [dict(tied=False, ga=1, clip=None, steps=3, device="cuda"),
             dict(tied=True, ga=2, clip=0.3, steps=3, device="cuda")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                    reason="needs two GPUs (NCCL between them)")
def test_two_gpus_equal_one_gpu_on_the_same_global_batch(tmp_path):
    """The CUDA path: NCCL reduce-scatter of each unit's gradient, shards copied out of the device,
    the shared state page-locked by each rank. fp32 (no TF32): losses within 1e-4 relative and
    parameters within 5% of one lr step of one GPU on the whole batch."""
    got = _spawn(tmp_path, GPU_CASES)
    for case, g in zip(GPU_CASES, got):
        ref = _one_process(case)
        for a, b in zip(ref["losses"], g["losses"]):
            assert math.isclose(a, b, rel_tol=1e-4), (case, ref["losses"], g["losses"])
        worst = max(float((ref["state"][n] - g["state"][n]).abs().max()) for n in ref["state"])
        assert worst < 0.05 * LR, (case, worst)


# ---------------------------------------------------------------------------------------- ranks that disagree
# (what rank 0 slides with, what rank 1 slides with, the words of the error): each setting that changes the
# mathematics, and the model's shape.
MISMATCHES = [
    ("max_grad_norm", dict(max_grad_norm=1.0), dict(max_grad_norm=0.3), r"SlideConfig\.max_grad_norm: rank 0 has 1\.0, rank 1 has 0\.3"),
    ("accumulation", dict(gradient_accumulation_steps=1), dict(gradient_accumulation_steps=2),
     r"SlideConfig\.gradient_accumulation_steps: rank 0 has 1, rank 1 has 2"),
    ("dtype", dict(dtype=torch.float32), dict(dtype=torch.bfloat16), r"SlideConfig\.dtype: rank 0 has torch\.float32, rank 1 has torch\.bfloat16"),
    ("window", dict(window=2), dict(window=3), r"SlideConfig\.window: rank 0 has 2, rank 1 has 3"),
    ("model shape", dict(), dict(intermediate_size=64), r"model config intermediate_size: rank 0 has 48, rank 1 has 64"),
    ("lr", dict(lr=1e-2), dict(lr=1e-3), r"lr of param group 0: rank 0 has 0\.01, rank 1 has 0\.001"),
]


def _mismatch_main(rank: int, port: int, out: str):
    from transformers import AutoModelForCausalLM
    import time
    got = {}
    with _as_rank(rank, port):
        for name, kw0, kw1, _ in MISMATCHES:
            kw = dict(kw0 if rank == 0 else kw1)
            lr = kw.pop("lr", LR)
            shape = {k: kw.pop(k) for k in ("intermediate_size",) if k in kw}
            torch.manual_seed(0)
            m = AutoModelForCausalLM.from_config(family_config("llama", **shape)).float()
            try:
                model = hs.slide(m, hs.SlideConfig(device="cpu", **{"dtype": torch.float32, **kw}))
                opt = model.create_optimizer(lr=lr)
                ids = _data(1, 1)[0][0][rank * 2:rank * 2 + 2]
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                got[name] = "no error"
            except (hs.RankMismatchError, hs.RankTimeoutError) as e:
                got[name] = f"{type(e).__name__}: {e}"
        # Uneven steps: rank 0 takes one step more than rank 1, which then stays alive, idle.
        model = _model(False, dict(rank_timeout=2.0))
        opt = model.create_optimizer(lr=LR)
        t0 = time.monotonic()
        try:
            for n, step in enumerate(_data(2 if rank == 0 else 1, 1)):
                ids = step[0][rank * 2:rank * 2 + 2]
                t0 = time.monotonic()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
            got["uneven"] = "no error"
            if rank == 1:
                time.sleep(12)
        except (hs.RankMismatchError, hs.RankTimeoutError) as e:
            got["uneven"] = f"{type(e).__name__}: {e}"
            got["uneven_s"] = time.monotonic() - t0
        torch.save(got, os.path.join(out, f"rank{rank}.pt"))


def test_ranks_that_differ_stop_naming_the_setting_and_a_lone_rank_stops_in_bounded_time(tmp_path):
    """Every rank stops at slide() (the settings, the model) or at the first forward (the
    optimizer's hyper-parameters) with an error naming what differs and both values; a rank that
    runs one step more than its peer stops after rank_timeout seconds (2 here), not never."""
    import time
    t0 = time.monotonic()
    mp.spawn(_mismatch_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    assert time.monotonic() - t0 < 120
    got = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(WORLD)]
    import re
    for name, _, _, words in MISMATCHES:
        for r in range(WORLD):
            assert got[r][name].startswith("RankMismatchError") and re.search(words, got[r][name]), (r, got[r][name])
    assert got[1]["uneven"] == "no error"
    assert got[0]["uneven"].startswith("RankTimeoutError") and "rank_timeout" in got[0]["uneven"], got[0]["uneven"]
    assert got[0]["uneven_s"] < 10, got[0]["uneven_s"]
