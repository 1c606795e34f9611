"""TTT's training step on CUDA: eager steps against CUDA-graph replays, from the same weights.

    PYTHONPATH=$PWD python3 bench/ttt_speed.py [--steps 30] [--seqs 16] [--seq-len 2048] [--deterministic]
        [--fused]

The record model (windows of 512 tokens with 4 sinks on layers 2,4,6,8,10), freshly built on
one GPU with its weights moved off their initialization by a little seeded noise, trains
--steps steps of --seqs sequences of random tokens, as eval-ttt's trainer does (one step per
chunk, the learning rate decayed across them): once with ttt_cuda_graphs off, once on. Each
step is timed between CUDA synchronizations; ms/step leaves out the first two steps (the
eager first step compiles the attention kernel; the graph side captures at its second). The
last line is the largest weight difference between the two sides after the last step, which
must be 0. Should it not be, a second eager run tells whether eager steps themselves differ
run to run (the attention backward's atomics): --deterministic asks torch for deterministic
kernels, under which eager and graph steps must agree bit for bit. --fused runs both
sides with the fused training kernels (`train_kernels.TrainingOps`, as eval-ttt does on
CUDA), then times a third side, graph replays without them, and prints the ratio of the
two graph sides and their largest weight difference.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from windowgpt_cli.challenge import RECORD_WINDOWS  # noqa: E402
from windowgpt_cli.config import RunConfig, apply_overrides  # noqa: E402
from windowgpt_cli.eval.ttt import ChunkTrainer, select_ttt_parameters, ttt_learning_rate  # noqa: E402
from windowgpt_cli.model.gpt import GPT, build_model  # noqa: E402
from windowgpt_cli.runtime import enable_fast_math, run_in_threads  # noqa: E402

WARM_UP_STEPS = 2  # left out of ms/step: the first (eager, compiles) and the second (captured)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="training steps per side (at least 3)")
    p.add_argument("--seqs", type=int, default=16, help="sequences per step (the record: a 32,768-token chunk)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--attn-backend", default="auto", help="as eval-ttt's --attn-backend")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms, warn only)")
    p.add_argument("--fused", action="store_true", help="fused training kernels on both sides, and a third "
                                                          "side without them")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps <= WARM_UP_STEPS:
        p.error(f"--steps must be above {WARM_UP_STEPS}")
    return args


def record_model(args: argparse.Namespace, device: torch.device) -> GPT:
    cfg = apply_overrides(RunConfig(), {"model": RECORD_WINDOWS}).resolved()
    torch.manual_seed(args.seed)
    model = build_model(cfg.model, device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.set_attention_backend(args.attn_backend, device)
    return model


def train_side(model: GPT, state: dict[str, Tensor], tokens: Tensor, args: argparse.Namespace,
               graphs: bool, fused: bool) -> tuple[list[float], dict[str, int], dict[str, Tensor]]:
    """Seconds of each step, the trainer's step counts, and the weights after the last step."""
    model.load_state_dict(state)
    ttt = dataclasses.replace(RunConfig().ttt, ttt_epochs=1, ttt_cuda_graphs=graphs)
    params = select_ttt_parameters(model, ttt.ttt_freeze_blocks, ttt.ttt_freeze_bank_slices)
    device = tokens.device
    trainer = ChunkTrainer(model, params, ttt, tokens, seq_len=args.seq_len, device=device, rank=0, world_size=1,
                           compile_model=False, fused=fused)
    run_in_threads(trainer.kernel_builds(), device)
    chunk = args.seqs * args.seq_len
    seconds = []
    for step in range(args.steps):
        torch.cuda.synchronize(device)
        begun = time.perf_counter()
        trainer.train_chunk(step * chunk, (step + 1) * chunk, ttt_learning_rate(ttt.ttt_lr, step, args.steps))
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - begun)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    counts = dict(trainer.counts)
    del trainer
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return seconds, counts, weights


def max_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def describe(name: str, seconds: list[float], counts: dict[str, int]) -> str:
    steady = seconds[WARM_UP_STEPS:]
    first = ", ".join(f"{s:.2f}" for s in seconds[:WARM_UP_STEPS])
    return (f"{name}: {1000 * statistics.mean(steady):.2f} ms/step (median {1000 * statistics.median(steady):.2f}, "
            f"over steps {WARM_UP_STEPS + 1}..{len(seconds)}; steps 1-{WARM_UP_STEPS}: {first} s) "
            f"eager={counts['eager']} captured={counts['captured']} replayed={counts['replayed']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/ttt_speed.py times CUDA graphs and needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    enable_fast_math(device)
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    model = record_model(args, device)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.steps * args.seqs * args.seq_len + 1,), generator=g)
    tokens = tokens.to(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: {args.steps} TTT steps of "
          f"{args.seqs} x {args.seq_len} tokens, attention {args.attn_backend}, "
          f"deterministic={'on' if args.deterministic else 'off'}")
    eager_s, eager_counts, eager_w = train_side(model, state, tokens, args, graphs=False, fused=args.fused)
    print(describe("eager", eager_s, eager_counts))
    graph_s, graph_counts, graph_w = train_side(model, state, tokens, args, graphs=True, fused=args.fused)
    print(describe("graph", graph_s, graph_counts))
    speedup = statistics.mean(eager_s[WARM_UP_STEPS:]) / statistics.mean(graph_s[WARM_UP_STEPS:])
    print(f"speed-up: {speedup:.2f}x")
    if args.fused:
        plain_s, plain_counts, plain_w = train_side(model, state, tokens, args, graphs=True, fused=False)
        print(describe("graph, unfused", plain_s, plain_counts))
        ratio = statistics.mean(graph_s[WARM_UP_STEPS:]) / statistics.mean(plain_s[WARM_UP_STEPS:])
        print(f"fused / unfused graph steps: {ratio:.3f}; max |weight difference| after {args.steps} steps: "
              f"{max_difference(graph_w, plain_w):g}")
    difference = max_difference(eager_w, graph_w)
    print(f"max |weight difference| after {args.steps} steps, eager vs graph: {difference:g}")
    if difference == 0:
        return 0
    _, _, again_w = train_side(model, state, tokens, args, graphs=False, fused=args.fused)
    control = max_difference(eager_w, again_w)
    print(f"max |weight difference|, eager vs eager: {control:g}"
          + ("" if control == 0 else " (eager steps differ run to run: compare with --deterministic)"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
