"""The scenarios of `python -m benchmarks.suite`: what one GPU call runs, step by step.

Each scenario is a list of `Step`s that fits one 10-minute device call (the suite also stops
starting steps when its time budget is spent). A step is one command run from the repository
root: a `bench_train.py` row (its JSON gives the table's rows), the GPU tests, or another
script of `benchmarks/`. `SCENARIOS` is the one table of them; docs/benchmarks.md ("How to
run") describes each.

`Settings.smoke` builds the same steps at CPU scale (the tiny shape, short sequences, one timed
step), which is how the CPU tests run every scenario's plumbing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Step", "Settings", "SCENARIOS", "LONG_SEQS", "long_context_model"]

LONG_SEQS = (8192, 16384, 32768, 65536, 131072)
LONG_MLP_CHUNK = 16384           # tokens per MLP chunk of the long-context rows
SMOKE_LONG_SEQS = (64, 256)


@dataclass
class Step:
    """One command of a scenario, run from the root of the tree under test."""

    name: str                     # unique in the scenario; --only selects by it
    argv: list[str]               # a script under the tree and its arguments (run with this Python)
    timeout: float                # seconds; the suite kills the command's whole process group after it
    kind: str = "command"         # "train": bench_train.py, its JSON gives rows; "command": anything else
    project: bool = False         # a row of the project itself: run again from the --old tree
    chain: str | None = None      # steps of one chain stop at the first that does not succeed
    tail: int = 0                 # lines of its log printed above the final table


@dataclass
class Settings:
    """How to build the steps: at GPU scale, or the CPU smoke test's scale."""

    smoke: bool = False
    workdir: Path = Path("/tmp")

    def model(self, name: str) -> str:
        return "tiny" if self.smoke else name

    def device_args(self) -> list[str]:
        return ["--device", "cpu"] if self.smoke else []


# ---------------------------------------------------------------------------------------------
# step builders
# ---------------------------------------------------------------------------------------------
def slide_row(s: Settings, model: str, batch: int, cap: float, *, timeout: float = 150, steps: int = 4,
              warmup: int = 2, seq: int | None = None, slide_config: str | None = None, name: str | None = None,
              chain: str | None = None, nproc: int = 1) -> Step:
    """The project's row: `bench_train.py --providers slide` with the flags older commits also take.

    With nproc > 1, `--nproc` (data parallel, batch per process): a flag older commits lack, so
    the step is not a project row that `--old` runs again.
    """
    short = model.replace("llama3-", "").replace("qwen2.5-", "q")
    name = name or f"{short}_b{batch}_cap{cap:g}"
    if s.smoke:
        batch, steps, warmup, timeout = min(batch, 2), 1, 1, 120
        seq = seq or 32
    argv = ["benchmarks/bench_train.py", "--model", s.model(model) if not Path(model).is_file() else model,
            "--providers", "slide", "--batch", str(batch), "--offload-batches", str(batch), "--cap-gib", f"{cap:g}",
            "--steps", str(steps), "--warmup", str(warmup), "--no-probe", "--timeout", str(int(timeout - 10)),
            *s.device_args()]
    if seq:
        argv += ["--seq", str(seq)]
    if slide_config:
        argv += ["--slide-config", slide_config]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    return Step(name, argv, timeout, kind="train", project=nproc == 1, chain=chain)


def baseline_row(s: Settings, name: str, provider: str, *, batch: int = 16, search: str | None = None,
                 timeout: float = 150, model: str = "llama3-3b", steps: int = 3, warmup: int = 2,
                 nproc: int = 1) -> Step:
    """A baseline (the 3B shape by default) as its users run it: HF's checkpointing and the fused kernels.

    With `search`, the provider runs in one process per batch, upward until out of memory, all
    within the step's time (bench_train's --timeout covers the whole search). With nproc > 1,
    each launch is that many processes (`--nproc`, batch per process).
    """
    steps, warmup = (1, 1) if s.smoke else (steps, warmup)
    argv = ["benchmarks/bench_train.py", "--model", s.model(model), "--providers", provider,
            "--checkpointing", "on", "--kernels", "auto", "--steps", str(steps), "--warmup", str(warmup),
            "--no-probe", "--timeout", str(int(timeout - 10)), *s.device_args()]
    if s.smoke:
        argv += ["--seq", "32"]
    if search:
        argv += ["--cap-gib", "24", "--search-batches", "1,2" if s.smoke else search]
    else:
        argv += ["--batch", str(2 if s.smoke else batch)]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    return Step(name, argv, timeout, kind="train")


def lora_row(s: Settings, provider: str, batch: int, cap: float | None, *, model: str = "llama3-8b",
             r: int = 16, timeout: float = 170) -> Step:
    """A LoRA row (rank r on every linear layer): `hf_lora` uncapped, or `slide_lora` under `cap`."""
    steps, warmup = (1, 1) if s.smoke else (3, 2)
    short = model.replace("llama3-", "").replace("qwen2.5-", "q")
    argv = ["benchmarks/bench_train.py", "--model", s.model(model), "--providers", provider, "--lora-r", str(r),
            "--steps", str(steps), "--warmup", str(warmup), "--no-probe", "--timeout", str(int(timeout - 10)),
            *s.device_args()]
    name = f"{short}_{provider}_b{batch}" + (f"_cap{cap:g}" if cap is not None else "")   # the GPU-scale batch
    batch = min(batch, 2) if s.smoke else batch
    argv += ["--seq", "32"] if s.smoke else []
    argv += ["--batch", str(batch)] if cap is None else ["--offload-batches", str(batch), "--cap-gib", f"{cap:g}"]
    return Step(name, argv, timeout, kind="train")


def tests(name: str, paths: tuple[str, ...] = ("tests",), marker: str | None = "gpu", timeout: float = 180) -> Step:
    """pytest on the GPU machine (on a CPU the `gpu` marker's tests skip themselves)."""
    argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-m", marker] if marker else []), *paths]
    return Step(name, argv, timeout, tail=3)


def long_context_model(model: str, seq: int, workdir: Path) -> str:
    """`model`, or a copy of its config whose max_position_embeddings admits `seq` tokens."""
    from benchmarks.providers.base import CONFIG_DIR

    path = Path(model) if Path(model).is_file() else CONFIG_DIR / f"{model}.json"
    data = json.loads(path.read_text())
    if data.get("max_position_embeddings", 0) >= seq:
        return model
    data["max_position_embeddings"] = seq
    data["_comment"] = f"{data.get('_comment', path.name)} max_position_embeddings raised to {seq}."
    out = Path(workdir) / f"{path.stem}-pos{seq}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    return str(out)


def _k(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


# ---------------------------------------------------------------------------------------------
# scenarios
# ---------------------------------------------------------------------------------------------
def quick(s: Settings) -> list[Step]:
    """GPU tests; 3B batch 16 and 8 under 24 GiB (the check after a change)."""
    return [tests("gpu_tests"), slide_row(s, "llama3-3b", 16, 24, timeout=100),
            slide_row(s, "llama3-3b", 8, 24, timeout=100)]


def full(s: Settings) -> list[Step]:
    """8B batch 16, Qwen2.5-7B batch 16, 3B batch 16 and 8, all under 24 GiB."""
    return [slide_row(s, "llama3-8b", 16, 24), slide_row(s, "qwen2.5-7b", 16, 24),
            slide_row(s, "llama3-3b", 16, 24, timeout=100), slide_row(s, "llama3-3b", 8, 24, timeout=100)]


def small_gpu(s: Settings) -> list[Step]:
    """8B batch 16 under 12 and 16 GiB; 3B batch 16 under 9 GiB; the host AdamW's rate."""
    adam = ["benchmarks/host_adam_rate.py"] + (["--params", "1000000", "--repeat", "2"] if s.smoke else [])
    return [slide_row(s, "llama3-8b", 16, 12), slide_row(s, "llama3-8b", 16, 16),
            slide_row(s, "llama3-3b", 16, 9, timeout=100), Step("host_adam_rate", adam, 100, tail=8)]


def soak(s: Settings) -> list[Step]:
    """200-step soak (memory flat?) with the clipping comparison; 8B batch 1 under 8 GiB; the 3B batch sweep."""
    if s.smoke:
        soak_args = ["--model", "tiny", "--batch", "2", "--seq", "32", "--steps", "30", "--compare-clipping", "6",
                     "--device", "cpu"]
        sweep_args = ["--model", "tiny", "--batches", "4,2", "--seq", "32", "--steps", "1", "--warmup", "1",
                      "--device", "cpu"]
    else:
        soak_args = ["--model", "llama3-3b", "--layers", "4", "--batch", "2", "--seq", "2048", "--steps", "200",
                     "--compare-clipping", "20"]
        sweep_args = ["--model", "llama3-3b", "--batches", "16,12,10,8"]
    return [Step("soak", ["benchmarks/soak.py", *soak_args], 150, project=True, tail=16),
            slide_row(s, "llama3-8b", 1, 8, steps=2, warmup=1, timeout=130),
            Step("batch_sweep", ["benchmarks/batch_sweep.py", *sweep_args], 220, project=True, tail=6)]


def kernels(s: Settings) -> list[Step]:
    """The kernels' tests on the GPU, then bench_kernels.py (torch, Liger and ours)."""
    steps = [tests("kernel_tests", ("tests/test_triton_ops.py", "tests/test_triton_gemma_ops.py",
                                    "tests/test_triton_patching.py"), marker=None, timeout=200)]
    if not s.smoke:  # the kernel benchmark needs CUDA
        steps.append(Step("bench_kernels", ["benchmarks/bench_kernels.py"], 300, tail=22))
    return steps


def baselines(s: Settings) -> list[Step]:
    """3B shape: slide at batch 16 beside ZeRO-2 and ZeRO-3 at their best batch, and HF GPU-resident."""
    # The searches start at the batch measured to fit (ZeRO-2 8, ZeRO-3 16: docs/benchmarks.md) and go
    # up until out of memory; a first batch that does not fit halves downwards. Each DeepSpeed process
    # spends ~90 s setting up, so ZeRO-3 (the stronger) runs first.
    return [slide_row(s, "llama3-3b", 16, 24, timeout=100),
            baseline_row(s, "hf_b16", "hf", batch=16, timeout=80),
            baseline_row(s, "ds3_search", "ds3", search="16,32", timeout=220),
            baseline_row(s, "ds2_search", "ds2", search="8,16,32", timeout=220)]


def long(s: Settings) -> list[Step]:
    """Llama-3.1-8B shape, batch 1, 24 GiB cap, 8k to 128k tokens; stops at the first that fails."""
    seqs = SMOKE_LONG_SEQS if s.smoke else LONG_SEQS
    steps = []
    for seq in seqs:
        model = long_context_model(s.model("llama3-8b"), seq, s.workdir)
        timeout = 120 if seq <= 32768 else 150 if seq <= 65536 else 300
        # The MLP in chunks of 16k tokens (SlideConfig.mlp_chunk_tokens): a no-op up to 16k, and what
        # keeps a layer's recompute within the cap beyond it.
        config = {"mlp_chunk_tokens": LONG_MLP_CHUNK}
        if seq == seqs[-1]:
            # The layer inputs go to files: at 128k they are 32 x 1 GiB, which beside the 8B shape's
            # 89 GiB of masters and moments is more than the H200 host's 125 GiB.
            config.update(activation_tier="nvme", nvme_path=str(Path(s.workdir) / "activations"))
        steps.append(slide_row(s, model, 1, 24, steps=2, warmup=1, seq=seq, timeout=timeout,
                               name=f"8b_seq{_k(seq)}", chain="long", slide_config=json.dumps(config)))
    return steps


def lora(s: Settings) -> list[Step]:
    """Llama-3.1-8B shape, LoRA r16 on every linear layer, batch 16: PEFT GPU-resident, slide under 24 GiB, and PEFT with Accelerate's CPU offload under 24 GiB (batch 16 and 8)."""
    return [lora_row(s, "hf_lora", 16, None), lora_row(s, "slide_lora", 16, 24),
            lora_row(s, "hf_lora_offload", 16, 24, timeout=160), lora_row(s, "hf_lora_offload", 8, 24, timeout=140)]


def lora32(s: Settings) -> list[Step]:
    """Qwen2.5-32B shape, LoRA r16, batch 8: slide under 24 GiB (the frozen base in bf16 in host memory) beside PEFT GPU-resident."""
    return [lora_row(s, "slide_lora", 8, 24, model="qwen2.5-32b", timeout=300),
            lora_row(s, "hf_lora", 8, None, model="qwen2.5-32b", timeout=250)]


def disk_bandwidth(s: Settings) -> Step:
    """`disk_bandwidth.py` on the disk the state goes to: dd with O_DIRECT beside the disk backend."""
    size = "0.0625" if s.smoke else "8"
    return Step("disk_bandwidth", ["benchmarks/disk_bandwidth.py", "--dir", str(Path(s.workdir) / "bandwidth"),
                                   "--size-gib", size], 90, tail=6)


def state_on_disk(s: Settings, model: str, limit: float, timeout: float) -> Step:
    """`model` at batch 16 under 24 GiB with `host_memory_limit=limit` GiB (the rest of the state in
    a file under the suite's directory); two timed steps. At CPU scale the limit does not bite
    (the tiny model's state is smaller than the pool of buffers a disk layer needs)."""
    short = model.replace("llama3-", "").replace("mistral-nemo-", "nemo")
    config = {"host_memory_limit": 1.0 if s.smoke else limit, "nvme_path": str(Path(s.workdir) / "state")}
    return slide_row(s, model, 16, 24, steps=2, warmup=1, timeout=timeout, name=f"{short}_b16_cap24_hml{limit:g}",
                     slide_config=json.dumps(config))


def disk(s: Settings) -> list[Step]:
    """The disk's bandwidth; Llama-3.1-8B shape, batch 16, 24 GiB cap, all in host memory and then with host_memory_limit=48 (the moments of most layers on disk)."""
    return [disk_bandwidth(s), slide_row(s, "llama3-8b", 16, 24, steps=2, warmup=1, timeout=130),
            state_on_disk(s, "llama3-8b", 48, timeout=360)]


def disk12(s: Settings) -> list[Step]:
    """The disk's bandwidth; the Mistral-Nemo-12B shape (147 GB of state: more than the H200 host holds), batch 16, 24 GiB cap, host_memory_limit=100."""
    return [disk_bandwidth(s), state_on_disk(s, "mistral-nemo-12b", 100, timeout=480)]


def multi(s: Settings) -> list[Step]:
    """Llama-3.1-8B shape, batch 16 per GPU, 24 GiB cap, on a 2-GPU host: slide with 1 and with 2 processes, then ZeRO-3 with 2 processes at its best batch."""
    # Two timed steps after one warm-up each. The 2-process rows count both GPUs' tokens; their host
    # memory is the host's used memory (the ranks share the state in shared memory). A DeepSpeed process
    # spends about 90 s setting up the 3B shape on one GPU, more for 8B (and its CPU Adam JIT-builds in
    # the call's first one), so the call's time holds one ZeRO-3 launch, not two: the search starts at
    # 16 (the other rows' batch) and halves only if 16 runs out of memory; one upward from 8 would
    # spend the time on batch 8's set-up and not reach 16.
    return [slide_row(s, "llama3-8b", 16, 24, steps=2, warmup=1, timeout=130),
            slide_row(s, "llama3-8b", 16, 24, steps=2, warmup=1, timeout=170, name="8b_b16_cap24_np2", nproc=2),
            baseline_row(s, "8b_ds3_np2_search", "ds3", search="16", timeout=270, model="llama3-8b", steps=2,
                         warmup=1, nproc=2)]


SCENARIOS: dict[str, Callable[[Settings], list[Step]]] = {
    "quick": quick, "full": full, "small-gpu": small_gpu, "soak": soak, "kernels": kernels,
    "baselines": baselines, "long": long, "lora": lora, "lora32": lora32, "disk": disk, "disk12": disk12,
    "multi": multi,
}
