"""FP8 quality: one Llama-shaped model trained in bf16 and with its projections in FP8, same seed
and data, its train loss and a held-out loss side by side.

    python3 benchmarks/fp8_quality.py --steps 500 --json fp8_quality.json            # --control: a third arm
    python3 benchmarks/fp8_quality_plot.py fp8_quality.json docs/fp8_quality.svg     # the figure

The held-out split (`corpus_split`): the bundled corpus (hf_slideformer/data/corpus.txt) is 120
paragraphs; paragraph i is held out when i % 10 == 9 (12 paragraphs, 841 of its 8,246 tokens
with the corpus's own BPE tokenizer, which has 695 tokens). It is one token stream, <eos> after
each paragraph; the held-out loss is the mean loss over it cut into whole `--seq`-token blocks
(the tail shorter than a block left out), taken with the arm's own forward under
`torch.no_grad()` at step 0 and at every logged step.

The train stream (`--train-stream`):

- `grammar` (the default; `corpus_grammar`, `grammar_stream`): every corpus sentence is a subject
  phrase, a one-word verb, an object phrase and an ending (16 x 16 x 16 x 12 phrases, found from
  the corpus's sentences alone by `induce_grammar`; all 536 parse, each one way). The train
  stream is new paragraphs of that grammar from a seeded generator: 3 to 6 sentences (the
  corpus's range), each of uniformly drawn parts, never one of the 55 sentences of the held-out
  paragraphs, joined as in the corpus, <eos> after each paragraph, and tokenized with the same
  tokenizer; `--steps` x `--batch` x `--seq` tokens laid end to end, so that no window is seen
  twice. Each train loss is then a loss on text neither arm has seen, and no model can go below
  the stream's entropy (printed: 0.72 nats a token, log 49,097 for a sentence's choice and log 4
  for a paragraph's size over its tokens). The held-out paragraphs are more text of the same
  grammar: the held-out loss follows the train loss down instead of rising as the model memorizes.
- `corpus`: `--steps` batches of `--batch` windows of `--seq` tokens at seeded random starts in the
  corpus's train split (the other 108 paragraphs, 7,405 tokens), drawn again and again. A model
  of the default shape memorizes it within about 80 steps (docs/benchmarks.md, "FP8 quality: a
  train / held-out split").

Both arms take the same batches in the same order. The model (default 0.76 B parameters: hidden
2048, 12 layers, 16 heads, 8 kv heads, intermediate 8192, vocab 1024, the tokenizer's 695 tokens
padded; docs/benchmarks.md says why) starts from the same random weights in both arms, trains
with AdamW and a linear warm-up, slid on the GPU (`hs.slide`), the second arm with
`SlideConfig(matmuls="fp8")` (docs/fp8.md). At each logged step the train loss is the mean of the
steps since the last log (as the Trainer logs it). `--control` adds a third arm, bf16 again from
the same weights with each one's last mantissa bit flipped at random (`flip_last_bits`, a 1-ulp
change): its gap to bf16 is the noise of bf16 against itself, printed beside FP8's.
`--recipes fp8,fp8_gw_hp` adds an arm per further FP8 recipe, each judged against bf16.
`--torchao` adds two arms trained without sliding, the model GPU-resident (fp32 masters, bf16
autocast, torch's AdamW): bf16, and torchao's own float8 rowwise recipe on the decoder layers
(`train_resident_arm`), judged against that bf16 arm: the reference recipe's own gap on the
same data, beside the engine's.

The criterion (`judge`), after `--warmup` steps. With the grammar stream it is the requirement's
own: FP8's train loss and its held-out loss within `--tolerance` (1.5%) of bf16's at every logged
step after the warm-up; the learning phase is the whole run, since nothing can be memorized. With
the corpus stream the learning phase ends at bf16's lowest held-out loss: FP8's held-out loss is
judged up to there, its train loss where both arms' train loss is above the floor (the lowest
held-out loss either arm reached). Below the floor the train loss measures memorization and
falls toward 0; past its lowest point the held-out loss rises at a pace that follows each arm's
own path: there the gap is reported, and only FP8 above bf16 counts against it. With either
stream, FP8's losses are nowhere more than the tolerance above bf16's over the judged steps.

`--max-seconds` bounds the whole run from the start: the bf16 arm stops once its share has passed
(a half, a third with `--control`), and the other arms run the steps the bf16 arm made (all curves
cover the same steps; the output says when they are fewer than `--steps`). `--emulate` runs the
FP8 arm through the recipe's CPU emulation instead (a smoke test on a machine without FP8 tensor
cores).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import math
import os
import random
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import hf_slideformer as hs  # noqa: E402
from hf_slideformer.demo import corpus_path, train_tokenizer  # noqa: E402

HELD_OUT_EVERY = 10      # paragraph i is held out when i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def corpus_paragraphs(path: str | None = None) -> list[str]:
    """The corpus's paragraphs (separated by a blank line), in order."""
    with open(path or corpus_path(), encoding="utf-8") as f:
        return [p.strip() for p in f.read().split("\n\n") if p.strip()]


def is_held_out(i: int) -> bool:
    return i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def corpus_split(tokenizer, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's (train, held-out) token streams: paragraph i held out when i % 10 == 9."""
    paras = corpus_paragraphs(path)
    train: list[int] = []
    held: list[int] = []
    for i, para in enumerate(paras):
        ids = tokenizer(para)["input_ids"] + [tokenizer.eos_token_id]
        (held if is_held_out(i) else train).extend(ids)
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


# The grammar of the corpus: every sentence is a subject phrase, a one-word verb, an object phrase
# and an ending, then a full stop; a paragraph is sentences joined by a space.
ROLES = ("subject", "verb", "object", "ending")


def sentences(paragraph: str) -> list[str]:
    """A paragraph's sentences, each with its full stop."""
    return re.split(r"(?<=\.) ", paragraph)


def candidate_parses(sentence: str):
    """Every split of `sentence` (words, its full stop dropped) into a subject, a one-word verb, an
    object and an ending, none empty."""
    w = sentence.rstrip(".").split()
    for i in range(1, len(w) - 2):
        for k in range(i + 2, len(w)):
            yield " ".join(w[:i]), w[i], " ".join(w[i + 1:k]), " ".join(w[k:])


def induce_grammar(corpus_sentences: list[str], rounds: int = 100) -> tuple[list[str], ...]:
    """The four phrase sets of the corpus, found from its sentences alone (hard EM): each sentence
    takes the split whose four parts are the most frequent in their roles (the sum of their log
    counts, a part not counted in its role 1e-9), starting from every split's parts counted once,
    the counts then taken over the chosen splits, until no choice changes. A phrase that recurs in
    one role across many sentences wins over a fragment that occurs in one; on the bundled corpus
    the sets settle in 11 rounds. The sets, each sorted."""
    unique = sorted(set(corpus_sentences))
    options = {s: list(candidate_parses(s)) for s in unique}
    counts = [collections.Counter(p[r] for s in unique for p in options[s]) for r in range(4)]
    chosen: dict[str, tuple] = {}
    for _ in range(rounds):
        new = {s: max(options[s], key=lambda p: sum(math.log(counts[r][p[r]] or 1e-9) for r in range(4)))
               for s in unique if options[s]}
        if new == chosen:
            break
        chosen = new
        counts = [collections.Counter(chosen[s][r] for s in corpus_sentences if s in chosen) for r in range(4)]
    return tuple(sorted({p[r] for p in chosen.values()}) for r in range(4))


def parse(sentence: str, grammar) -> list[tuple[int, int, int, int]]:
    """Every parse of `sentence` in `grammar`: the four parts' indices in the phrase sets (one for
    every sentence of the bundled corpus; none for a sentence the grammar does not make)."""
    index = [{phrase: n for n, phrase in enumerate(phrases)} for phrases in grammar]
    return [tuple(index[r][p[r]] for r in range(4)) for p in candidate_parses(sentence)
            if sentence.endswith(".") and all(p[r] in index[r] for r in range(4))]


def sentence_of(parts: tuple[int, int, int, int], grammar) -> str:
    return " ".join(grammar[r][n] for r, n in enumerate(parts)) + "."


def corpus_grammar(path: str | None = None) -> dict:
    """The bundled corpus's grammar: its phrase sets, the sentences of the held-out paragraphs (as
    part indices), the corpus sentences no parse makes (reported, never generated), and the
    paragraph sizes (the fewest and most sentences of a corpus paragraph)."""
    paras = corpus_paragraphs(path)
    split = [sentences(p) for p in paras]
    grammar = induce_grammar([s for ss in split for s in ss])
    held, unparsed, ambiguous = set(), [], []
    for i, ss in enumerate(split):
        for s in ss:
            found = parse(s, grammar)
            if not found:
                unparsed.append(s)
            elif len(found) > 1:
                ambiguous.append(s)
            if is_held_out(i):
                held.update(found)
    return {"phrases": grammar, "held_out": held, "unparsed": unparsed, "ambiguous": ambiguous,
            "corpus_sentences": sum(map(len, split)),
            "paragraph_sizes": (min(map(len, split)), max(map(len, split)))}


def grammar_stream(tokenizer, g: dict, tokens: int, seed: int) -> tuple[torch.Tensor, float]:
    """`tokens` tokens of paragraphs drawn from the grammar `g` with a generator seeded by `seed`:
    each paragraph a number of sentences drawn uniformly from the corpus's paragraph sizes, each
    sentence's four parts drawn uniformly, a sentence of the held-out paragraphs drawn again; the
    sentences joined by a space as in the corpus, <eos> after each paragraph. With the stream, its
    entropy per token in nats (the generator's information over the tokens it made): the lowest
    mean loss any model can reach on it."""
    rng = random.Random(seed)
    sizes = [len(p) for p in g["phrases"]]
    allowed = math.prod(sizes) - len(g["held_out"])
    lo, hi = g["paragraph_sizes"]
    ids: list[int] = []
    nats = 0.0
    while len(ids) < tokens:
        paras = []
        for _ in range(256):
            n = rng.randint(lo, hi)
            sents = []
            while len(sents) < n:
                parts = tuple(rng.randrange(k) for k in sizes)
                if parts not in g["held_out"]:
                    sents.append(sentence_of(parts, g["phrases"]))
            paras.append(" ".join(sents))
            nats += math.log(hi - lo + 1) + n * math.log(allowed)
        for para in tokenizer(paras)["input_ids"]:
            ids.extend(para + [tokenizer.eos_token_id])
    return torch.tensor(ids[:tokens], dtype=torch.long), nats / len(ids)


def grammar_batches(stream: torch.Tensor, steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    """`steps` (batch, seq) windows of `stream` laid end to end: no token is seen twice."""
    if stream.numel() < steps * batch * seq:
        raise ValueError(f"the grammar stream has {stream.numel()} tokens: {steps} x {batch} x {seq} need more")
    return list(stream[:steps * batch * seq].view(steps, batch, seq))


def flip_last_bits(model, seed: int) -> None:
    """The control arm's start: every bf16 weight's last mantissa bit flipped with probability 1/2
    (a 1-ulp change, up or down), from a generator seeded by `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dtype == torch.bfloat16:
                p.data.view(torch.int16).bitwise_xor_(torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int16))


def train_batches(stream: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """`steps` (batch, seq) windows of `stream` at seeded random starts: the same for both arms."""
    if stream.numel() <= seq:
        raise ValueError(f"the train split has {stream.numel()} tokens: --seq {seq} needs more")
    gen = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, stream.numel() - seq, (steps, batch), generator=gen)
    return [torch.stack([stream[s:s + seq] for s in row.tolist()]) for row in starts]


def held_out_blocks(stream: torch.Tensor, seq: int) -> torch.Tensor:
    """The held-out stream as (n, seq) whole blocks, the shorter tail left out."""
    n = stream.numel() // seq
    if n == 0:
        raise ValueError(f"the held-out split has {stream.numel()} tokens: --seq {seq} needs fewer")
    return stream[:n * seq].view(n, seq)


def model_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                       vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False,
                       use_cache=False)


def initial_model(args, device: str):
    """Random weights (normal(0, 0.02), norms 1), made on `device` from `--seed`, returned on the CPU."""
    from benchmarks.providers.base import build_model
    return build_model(model_config(args), device, torch.bfloat16, fill="normal", seed=args.seed).cpu()


def held_out_loss(model, blocks: torch.Tensor, device: str) -> float:
    """The mean loss over the held-out blocks (equal lengths: the mean of the blocks' losses)."""
    with torch.no_grad():
        losses = [model(input_ids=b[None].to(device), labels=b[None].to(device)).loss.float() for b in blocks]
    return torch.stack(losses).mean().item()


def train_arm(args, matmuls: str, data: list[torch.Tensor], blocks: torch.Tensor, device: str,
              deadline: float = float("inf"), name: str | None = None, perturb: bool = False) -> dict:
    """Train on `data` in order, stopping after the step that ends past `deadline` (perf_counter):
    every step's train loss, and the held-out loss at step 0 and every `--log-every` steps.
    `perturb`: the initial weights' last bits flipped (`flip_last_bits`, the control arm)."""
    name = name or matmuls
    model = initial_model(args, device)
    if perturb:
        flip_last_bits(model, args.seed + 3)
    emulate = matmuls != "dtype" and args.emulate
    model = hs.slide(model, hs.SlideConfig(device=device, dtype=torch.bfloat16, matmuls="dtype" if emulate else matmuls))
    if emulate:
        from hf_slideformer.compute.layer_matmuls import install_emulation
        install_emulation(model, hp_wgrad=matmuls == "fp8_gw_hp")
    arm = train_steps(args, model, model.create_optimizer(lr=args.lr, weight_decay=0.0), data, blocks, device,
                      deadline, name)
    model.slide_engine.close()
    del model
    gc.collect()
    return arm


def train_steps(args, model, opt, data: list[torch.Tensor], blocks: torch.Tensor, device: str, deadline: float,
                name: str, autocast=None) -> dict:
    """The arms' loop: `opt` with the linear warm-up over `data` in order, the forwards under
    `autocast` (a context manager, or none), stopping after the step that ends past `deadline`."""
    autocast = autocast or contextlib.nullcontext()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    with autocast:
        train, held = [], {0: held_out_loss(model, blocks, device)}
    t0 = time.perf_counter()
    for n, ids in enumerate(data, start=1):
        ids = ids.to(device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        train.append(loss.item())
        if n % args.log_every == 0:
            with autocast:
                held[n] = held_out_loss(model, blocks, device)
            print(f"  {name:7s} step {n:4d}  train {sum(train[-args.log_every:]) / args.log_every:.4f}  "
                  f"held-out {held[n]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if time.perf_counter() > deadline:
            print(f"  {name:7s} stopped after step {n}: its share of --max-seconds reached", flush=True)
            break
    del opt, sched
    return {"train": train, "held_out": held, "seconds": time.perf_counter() - t0}


def train_resident_arm(args, kind: str, data: list[torch.Tensor], blocks: torch.Tensor, device: str,
                       deadline: float = float("inf"), name: str | None = None, perturb: bool = False) -> dict:
    """As `train_arm`, the model GPU-resident and not slid: fp32 masters, the forward and backward
    under bf16 autocast, torch's AdamW (fused on CUDA), the same warm-up; `kind`
    'resident_torchao' converts the decoder layers' linears with torchao's float8 rowwise recipe
    (`convert_to_float8_training`), the reference the engine's 'fp8' follows."""
    model = initial_model(args, device).float().to(device)
    if kind == "resident_torchao":
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as exc:
            raise SystemExit(f"--torchao needs torchao installed ({exc})") from exc
        convert_to_float8_training(model.model.layers, config=Float8LinearConfig.from_recipe_name("rowwise"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.startswith("cuda"))
    arm = train_steps(args, model, opt, data, blocks, device, deadline, name or kind,
                      autocast=torch.autocast(device.split(":")[0], dtype=torch.bfloat16))
    del model, opt
    gc.collect()
    return arm


def logged_rows(arms: dict[str, dict], log_every: int) -> list[dict]:
    """One row per logged step every arm reached: the step, each arm's mean train loss since the
    last log (None at step 0) and its held-out loss."""
    steps = sorted(set.intersection(*(set(arm["held_out"]) for arm in arms.values())))
    rows = []
    for step in steps:
        row = {"step": step}
        for name, arm in arms.items():
            window = arm["train"][max(0, step - log_every):step]
            row[f"{name}_train"] = sum(window) / len(window) if window else None
            row[f"{name}_held_out"] = arm["held_out"][step]
        rows.append(row)
    return rows


def rel_gap(a: float, b: float) -> float:
    """|b - a| / |a|: FP8's (b) distance from bf16's (a)."""
    return abs(b - a) / abs(a)


def judge(rows: list[dict], warmup: int, tolerance: float, memorizable: bool = True, other: str = "fp8",
          base: str = "bf16") -> dict:
    """The criterion on the logged rows after `warmup`, over the learning phase: the `other` arm's
    (FP8's) held-out loss within `tolerance` of bf16's at every logged step of the learning phase,
    and its train loss within it wherever both train losses are above the floor (the lowest
    held-out loss of either arm). Over the whole run after `warmup`, its loss (held-out, and train
    above the floor) nowhere more than `tolerance` above bf16's (`fp8_not_worse`: lower is no loss
    of quality). `met`: both hold.

    `memorizable` (the corpus stream, windows of 7,405 tokens drawn again and again): the learning
    phase ends at bf16's lowest held-out loss (past it the held-out loss rises as the model
    memorizes; the gap there is `memorizing_max_gap`). Not `memorizable` (the grammar stream: every
    train window is new, and no loss falls below the stream's entropy): the learning phase is the
    whole run, and every train loss is judged, whatever the floor. `base` names the arm the gaps
    are taken to (bf16, or the GPU-resident bf16 arm for torchao's)."""
    floor = min(min(r[f"{base}_held_out"], r[f"{other}_held_out"]) for r in rows)
    best = min(rows, key=lambda r: r[f"{base}_held_out"])["step"]
    end = best if memorizable else rows[-1]["step"]
    after = [r for r in rows if r["step"] > warmup]
    learning = [r for r in after if r["step"] <= end]
    above = [r for r in after if r[f"{base}_train"] is not None
             and (not memorizable or min(r[f"{base}_train"], r[f"{other}_train"]) > floor)]
    held = max(((rel_gap(r[f"{base}_held_out"], r[f"{other}_held_out"]), r["step"]) for r in learning), default=(0.0, 0))
    train = max(((rel_gap(r[f"{base}_train"], r[f"{other}_train"]), r["step"]) for r in above), default=(0.0, 0))
    late = max(((rel_gap(r[f"{base}_held_out"], r[f"{other}_held_out"]), r["step"]) for r in after if r["step"] > end),
               default=(0.0, 0))
    excess = max(((r[f"{other}_{kind}"] - r[f"{base}_{kind}"]) / r[f"{base}_{kind}"] for kind, rs in
                  (("held_out", after), ("train", above)) for r in rs), default=0.0)
    not_worse = bool(after) and excess <= tolerance
    return {"floor": floor, "best_step": best, "learning_end": end, "memorizable": memorizable,
            "tolerance": tolerance, "held_out_max_gap": held[0], "held_out_max_step": held[1],
            "held_out_steps_judged": [r["step"] for r in learning],
            "train_max_gap": train[0], "train_max_step": train[1], "train_steps_judged": [r["step"] for r in above],
            "memorizing_max_gap": late[0], "memorizing_max_step": late[1],
            "fp8_max_excess": excess, "fp8_not_worse": not_worse,
            "met": bool(learning) and held[0] <= tolerance and train[0] <= tolerance and not_worse}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=1024, help="at least the tokenizer's 695 tokens")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (linear lr), not judged")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=0.015, help="the largest relative gap the criterion allows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--emulate", action="store_true", help="the FP8 arm through the CPU emulation (smoke test)")
    p.add_argument("--max-seconds", type=float, default=200,
                   help="the whole run's time from the start: the bf16 arm stops at its share (a half, a third with "
                        "--control), the other arms make as many steps")
    p.add_argument("--train-stream", choices=("grammar", "corpus"), default="grammar",
                   help="grammar: new sentences of the corpus's grammar, no window seen twice (the default); "
                        "corpus: windows of the corpus's train split, drawn again and again (it is memorized)")
    p.add_argument("--recipes", default="fp8",
                   help="the FP8 arms, comma-separated SlideConfig.matmuls values (fp8: torchao's rowwise recipe; "
                        "fp8_gw_hp: its rowwise_with_gw_hp); the first is judged as 'fp8', each other beside it")
    p.add_argument("--torchao", action="store_true",
                   help="two more arms, the model GPU-resident (fp32 masters, bf16 autocast, torch AdamW): bf16, and "
                        "torchao's own float8 rowwise recipe on the decoder layers (convert_to_float8_training), "
                        "judged against that bf16 arm: the reference recipe's gap on the same run")
    p.add_argument("--control", action="store_true",
                   help="a third arm: bf16 from the initial weights with their last bits flipped, bf16's own noise")
    p.add_argument("--json", required=True, help="where to write the results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    tokenizer = train_tokenizer(vocab_size=4096)          # the corpus's BPE saturates at 695 tokens
    if len(tokenizer) > args.vocab:
        raise SystemExit(f"--vocab {args.vocab} is below the tokenizer's {len(tokenizer)} tokens")
    train_stream, held_stream = corpus_split(tokenizer)
    blocks = held_out_blocks(held_stream, args.seq)
    stream = {"kind": args.train_stream}
    if args.train_stream == "grammar":
        g = corpus_grammar()
        train_stream, entropy = grammar_stream(tokenizer, g, args.steps * args.batch * args.seq, args.seed + 2)
        data = grammar_batches(train_stream, args.steps, args.batch, args.seq)
        sizes = [len(p) for p in g["phrases"]]
        stream.update(phrase_sets=dict(zip(ROLES, sizes)), sentences=math.prod(sizes),
                      held_out_sentences=len(g["held_out"]), corpus_sentences=g["corpus_sentences"],
                      unparsed=g["unparsed"], ambiguous=g["ambiguous"], paragraph_sizes=g["paragraph_sizes"],
                      entropy_floor=entropy)
        print(f"grammar: {' x '.join(f'{n} {r}s' for r, n in zip(ROLES, sizes))} = {math.prod(sizes):,} sentences, "
              f"{len(g['held_out'])} of them in the held-out paragraphs and never drawn; "
              f"{g['corpus_sentences'] - len(g['unparsed'])} of the corpus's {g['corpus_sentences']} sentences parse"
              + (f" (not: {g['unparsed']})" if g["unparsed"] else "") + "; paragraphs of "
              f"{g['paragraph_sizes'][0]}-{g['paragraph_sizes'][1]} sentences; "
              f"entropy floor {entropy:.4f} nats a token",
              flush=True)
    else:
        data = train_batches(train_stream, args.steps, args.batch, args.seq, args.seed)
    print(f"split: {train_stream.numel()} train tokens ({args.train_stream}), {held_stream.numel()} held out "
          f"({blocks.shape[0]} blocks of {args.seq}); {args.steps} steps of {args.batch} x {args.seq}", flush=True)
    recipes = args.recipes.split(",")
    plan = ([("bf16", "dtype", False)] + [("fp8" if i == 0 else m, m, False) for i, m in enumerate(recipes)]
            + ([("control", "dtype", True)] if args.control else [])
            + ([("resident_bf16", "resident", False), ("torchao", "resident_torchao", False)] if args.torchao else []))
    arms = {}
    for name, matmuls, perturb in plan:
        deadline = start + args.max_seconds / len(plan) if name == "bf16" else float("inf")
        run = train_resident_arm if matmuls.startswith("resident") else train_arm
        arms[name] = run(args, matmuls, data, blocks, args.device, deadline, name=name, perturb=perturb)
        data = data[:len(arms[name]["train"])]        # the other arms cover the steps the bf16 arm made
    rows = logged_rows(arms, args.log_every)
    memorizable = args.train_stream == "corpus"
    verdict = judge(rows, args.warmup, args.tolerance, memorizable)
    for name, _, _ in plan[2:]:                  # the other recipes and the control, each against bf16
        if name != "resident_bf16":              # torchao's arm against the resident bf16 arm
            verdict[name] = judge(rows, args.warmup, args.tolerance, memorizable, other=name,
                                  base="resident_bf16" if name == "torchao" else "bf16")
    print_table(rows, verdict, len(data), args)
    doc = {"args": vars(args), "steps_run": len(data), "rows": rows, "verdict": verdict, "stream": stream,
           "split": {"held_out_every": HELD_OUT_EVERY, "train_tokens": train_stream.numel(),
                     "held_out_tokens": held_stream.numel(), "held_out_blocks": blocks.shape[0],
                     "tokenizer_tokens": len(tokenizer)},
           **arms, "seconds": time.perf_counter() - start,
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "fp8_emulated": args.emulate}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


def print_table(rows: list[dict], verdict: dict, steps: int, args) -> None:
    """The logged rows (train and held-out per arm, their gaps to bf16) and the verdict, last."""
    others = ["fp8"] + [k for k, v in verdict.items() if isinstance(v, dict) and "met" in v]
    if "torchao" in others:
        others.insert(others.index("torchao"), "resident_bf16")
    if steps < args.steps:
        print(f"all arms ran {steps} of {args.steps} steps (--max-seconds {args.max_seconds:.0f})")
    head = f"\n{'step':>5} {'bf16 train':>10}" + "".join(f" {a + ' train':>13} {'gap':>7}" for a in others)
    head += f" {'bf16 held':>10}" + "".join(f" {a + ' held':>12} {'gap':>7}" for a in others)
    print(head)
    for r in rows:
        line = f"{r['step']:5d}"
        if r["bf16_train"] is None:
            line += f" {'':>10}" + "".join(f" {'':>13} {'':>7}" for _ in others)
        else:
            line += f" {r['bf16_train']:10.4f}" + "".join(
                f" {r[a + '_train']:13.4f} {rel_gap(r['bf16_train'], r[a + '_train']):7.2%}" for a in others)
        line += f" {r['bf16_held_out']:10.4f}" + "".join(
            f" {r[a + '_held_out']:12.4f} {rel_gap(r['bf16_held_out'], r[a + '_held_out']):7.2%}" for a in others)
        print(line)
    for name, v in [("FP8", verdict)] + [(a, verdict[a]) for a in others[1:] if a in verdict]:
        who = {"FP8": f"FP8 ({args.recipes.split(',')[0]})", "control": "bf16 control (last bits flipped)",
               "torchao": "torchao's rowwise, GPU-resident (against the resident bf16 arm; the table's gaps are to bf16)"
               }.get(name, name)
        print(f"{who} against bf16:")
        if v["memorizable"]:
            print(f"  held-out, steps {args.warmup + 1}-{v['learning_end']} (to bf16's lowest): max gap "
                  f"{v['held_out_max_gap']:.2%} (step {v['held_out_max_step']}); past it, memorizing: max gap "
                  f"{v['memorizing_max_gap']:.2%} (step {v['memorizing_max_step']})")
            print(f"  train above the floor {v['floor']:.4f} (the lowest held-out loss): max gap "
                  f"{v['train_max_gap']:.2%} (step {v['train_max_step']}, {len(v['train_steps_judged'])} "
                  f"logged steps judged)")
        else:
            print(f"  held-out, steps {args.warmup + 1}-{v['learning_end']} (the whole run; nothing to memorize): "
                  f"max gap {v['held_out_max_gap']:.2%} (step {v['held_out_max_step']})")
            print(f"  train, every logged step after the warm-up: max gap {v['train_max_gap']:.2%} "
                  f"(step {v['train_max_step']}, {len(v['train_steps_judged'])} logged steps judged)")
        print(f"  at most {v['fp8_max_excess']:+.2%} above bf16 at the judged steps: "
              f"{'not worse' if v['fp8_not_worse'] else 'WORSE'} (within {v['tolerance']:.1%} one way)")
    line = f"criterion (every FP8 gap within {verdict['tolerance']:.1%}): {'met' if verdict['met'] else 'NOT met'}"
    for name in others[1:]:
        if name in verdict and name != "control":
            line += f"; {name}: {'met' if verdict[name]['met'] else 'NOT met'}"
    if "control" in verdict:
        c = verdict["control"]
        line += f"; bf16 against itself: max gap {max(c['held_out_max_gap'], c['train_max_gap']):.2%}"
    print(line)


if __name__ == "__main__":
    sys.exit(main())
