"""Sliding-window and TTT evaluation: windowgpt against the reference, same weights, same GPU.

    python bench/eval_speed.py (--reference-model final_model.pt | --random-weights) --data DATA_DIR \
        --seed-dir SEED_COPY [--what sliding|ttt|both] [--ttt-chunks N] [--repeat N] [--cold]

final_model.pt is a state dict written by the reference script (default settings, the
model of `RunConfig().resolved()`); --random-weights times both sides on random weights
instead (speed only). DATA_DIR holds fineweb_val_*.bin and tokenizer.model (or pass
--tokenizer); SEED_COPY is a copy of shared/seed (its shim stands in for FA3, and
run_reference fixes the reference's TTT crash). Each side loads the weights afresh, runs
with its own compilation, and is timed between CUDA synchronizations; windowgpt's side
runs as `eval` does (its batch, its compilation). --repeat N runs each side N times in one
process (later runs have nothing left to compile). --cold runs each side in a fresh process
with empty compiler caches, as on a new machine; otherwise both share this process and the
second inherits what the first warmed up. TTT runs with the reference's freezing
(--no-ttt-freeze-bank-slices); --ttt-chunks N scores the first N chunks only, on both
sides. The last lines are a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fresh import run_fresh  # noqa: E402
from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.eval.scoring import evaluate_sliding
from windowgpt_cli.eval.ttt import evaluate_ttt
from windowgpt_cli.data.loader import load_validation_tokens  # noqa: E402
from windowgpt_cli.model.gpt import GPT, build_model  # noqa: E402
from windowgpt_cli.runtime import enable_fast_math  # noqa: E402
from windowgpt_cli.data.tokenizer import load_byte_luts  # noqa: E402

SIDES = ("reference", "windowgpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--reference-model", type=Path, help="final_model.pt of the reference")
    weights.add_argument("--random-weights", action="store_true", help="random weights (times only)")
    p.add_argument("--data", type=Path, required=True, help="directory with fineweb_val_*.bin")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: DATA/tokenizer.model")
    p.add_argument("--seed-dir", type=Path, required=True, help="a copy of shared/seed")
    p.add_argument("--what", choices=("sliding", "ttt", "both"), default="sliding")
    p.add_argument("--ttt-chunks", type=int, default=None, help="score only the first N TTT chunks (both sides)")
    p.add_argument("--batch-seqs", type=int, default=None, help="windowgpt's windows per pass (default: as eval)")
    p.add_argument("--repeat", type=int, default=1, help="run each side N times (later runs: compiled already)")
    p.add_argument("--cold", action="store_true", help="each side in a fresh process with empty compiler caches")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, its result as a JSON line
    p.add_argument("--ttt-compile-training", action="store_true",
                   help="windowgpt's TTT also compiles its training step (default: eager, as eval-ttt)")
    return p.parse_args(argv)


# --- The reference side ---------------------------------------------------------------------

def import_reference(seed_dir: Path):
    sys.path[:0] = [str(seed_dir / "shim"), str(seed_dir)]
    import run_reference  # noqa: E402  (patches the reference's Rotary for TTT)

    return run_reference.reference


def reference_args(ref, cfg: RunConfig):
    """Hyperparameters() with every setting windowgpt's configuration shares with it."""
    args = ref.Hyperparameters()
    for group in ("model", "train", "eval", "ttt"):
        for name, value in dataclasses.asdict(getattr(cfg, group)).items():
            if hasattr(args, name):
                setattr(args, name, ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value)
    return args


def reference_model(ref, args, state: dict, device: torch.device):
    """The model as the reference's main() builds its evaluation model."""
    model = ref.GPT(
        vocab_size=args.vocab_size, num_layers=args.num_layers, model_dim=args.model_dim, num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads, mlp_mult=args.mlp_mult, tie_embeddings=args.tie_embeddings,
        tied_embed_init_std=args.tied_embed_init_std, logit_softcap=args.logit_softcap, rope_base=args.rope_base,
        qk_gain_init=args.qk_gain_init, bigram_vocab_size=args.bigram_vocab_size, bigram_dim=args.bigram_dim,
        xsa_last_n=args.xsa_last_n, rope_dims=args.rope_dims, ln_scale=args.ln_scale, ve_enabled=args.ve_enabled,
        ve_dim=args.ve_dim, ve_layers=args.ve_layers, neg_slope=args.negative_slope,
        window_attn_size=args.window_attn_size, window_attn_layers=args.window_attn_layers,
        num_sink_tokens=args.num_sink_tokens, train_seq_len=args.train_seq_len,
        train_seq_len_long=args.train_seq_len_long,
    ).to(device).bfloat16()
    for bank in (model.qo_bank, model.kv_bank, model.mlp_up_bank, model.mlp_down_bank):
        bank.data = bank.data.float()
    for module in model.modules():
        if isinstance(module, ref.CastedLinear):
            module.float()
    ref.restore_low_dim_params_to_fp32(model)
    model.load_state_dict(state, strict=True)
    return model


# --- One side ----------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def random_state(cfg: RunConfig) -> dict:
    """A state dict of the default model with random, non-zero matrices."""
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(std=0.02)
    return model.state_dict()


class Side:
    """What one side needs: the weights, the validation tokens and byte tables, each side's
    own loader checked against the other's."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.device = a, torch.device("cuda")
        enable_fast_math(self.device)
        self.cfg = RunConfig().resolved()
        tokenizer = a.tokenizer or a.data / "tokenizer.model"
        self.ref = import_reference(a.seed_dir)
        self.args = reference_args(self.ref, self.cfg)
        self.state = (random_state(self.cfg) if a.random_weights
                      else torch.load(a.reference_model, map_location="cpu", weights_only=True))
        val_seq_len = max(self.cfg.train.train_seq_len, self.cfg.eval.eval_seq_len)
        self.val_tokens = load_validation_tokens(a.data, val_seq_len, self.cfg.model.vocab_size)
        ref_val = self.ref.load_validation_tokens(str(a.data / "fineweb_val_*.bin"), val_seq_len)
        assert torch.equal(ref_val.long(), self.val_tokens.long()), "the two loaders disagree on the validation tokens"
        self.ref_luts, _ = self.ref.load_tokenizer_luts(str(tokenizer), "", self.args.vocab_size, self.device)
        self.luts = load_byte_luts(tokenizer, None, self.cfg.model.vocab_size).to(self.device)
        self._models: dict[str, Any] = {}  # loaded once per process, except TTT's

    def ours_model(self) -> GPT:
        model = build_model(self.cfg.model, self.device)
        model.load_state_dict(self.state, strict=True)
        model.set_attention_backend("auto", self.device)
        return model.eval()

    def ttt_tokens(self) -> Tensor:
        if not self.a.ttt_chunks:
            return self.val_tokens
        targets = min(self.a.ttt_chunks * self.cfg.ttt.ttt_chunk_tokens, self.val_tokens.numel() - 1)
        return self.val_tokens[: targets + 1]

    def run(self, what: str, side: str) -> dict:
        """val_bpb and the seconds of each of --repeat runs."""
        runs = [timed(lambda: self._once(what, side)) for _ in range(self.a.repeat)]
        for bpb, seconds in runs:
            print(f"{side} {what}: val_bpb {bpb:.8f} in {seconds:.1f}s", flush=True)
        return {"bpb": runs[-1][0], "seconds": [seconds for _, seconds in runs]}

    def _once(self, what: str, side: str) -> float:
        cfg, a, device = self.cfg, self.a, self.device
        stride, seq_len = cfg.eval.eval_stride, cfg.eval.eval_seq_len
        if what == "sliding" and side == "reference":
            return self.ref.eval_val_sliding(self.args, self._reference_model(), 0, 1, device, self.val_tokens,
                                             *self.ref_luts, stride=stride, batch_seqs=32, eval_seq_len=seq_len)[1]
        if what == "sliding":
            return evaluate_sliding(self._cached_ours(), self.val_tokens, self.luts, seq_len=seq_len, stride=stride,
                                    batch_seqs=a.batch_seqs or 0, device=device).val_bpb
        # TTT changes the weights: a fresh model each time.
        if side == "reference":
            return self.ref.eval_val_sliding_ttt(self.args, self._reference_model(fresh=True), 0, 1, device,
                                                 self.ttt_tokens(), *self.ref_luts, stride=stride, batch_seqs=32,
                                                 log0=lambda message: None)[1]
        ttt = dataclasses.replace(cfg.ttt, ttt_freeze_bank_slices=False)  # the reference's freezing
        return evaluate_ttt(self.ours_model(), self.ttt_tokens(), self.luts, ttt, seq_len=cfg.train.train_seq_len,
                            stride=stride, batch_seqs=a.batch_seqs or 0, device=device,
                            compile_training=a.ttt_compile_training).val_bpb

    def _reference_model(self, fresh: bool = False):
        if fresh or "reference" not in self._models:
            self._models["reference"] = reference_model(self.ref, self.args, self.state, self.device)
        return self._models["reference"]

    def _cached_ours(self) -> GPT:
        if "windowgpt" not in self._models:
            self._models["windowgpt"] = self.ours_model()
        return self._models["windowgpt"]


# --- Both sides ---------------------------------------------------------------------------------

def child_argv(a: argparse.Namespace, what: str, side: str) -> list[str]:
    argv = [__file__, "--data", str(a.data), "--seed-dir", str(a.seed_dir), "--what", what, "--side", side,
            "--repeat", str(a.repeat)]
    argv += ["--random-weights"] if a.random_weights else ["--reference-model", str(a.reference_model)]
    for flag, value in (("--tokenizer", a.tokenizer), ("--ttt-chunks", a.ttt_chunks), ("--batch-seqs", a.batch_seqs)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--ttt-compile-training"] if a.ttt_compile_training else [])


def main() -> None:
    a = parse_args()
    whats = ("sliding", "ttt") if a.what == "both" else (a.what,)
    if a.side:  # a child of --cold
        print(json.dumps(Side(a).run(whats[0], a.side)))
        return
    side = None if a.cold else Side(a)
    where = "each side in a fresh process" if a.cold else "one process"
    print(f"windowgpt batch: {a.batch_seqs or 'as eval picks'}; {where}", flush=True)
    results = {(what, s): run_fresh(child_argv(a, what, s)) if a.cold else side.run(what, s)
               for what in whats for s in SIDES}
    print_table(a, whats, results)


def print_table(a: argparse.Namespace, whats: tuple[str, ...], results: dict) -> None:
    header = (f"{'':<18} {'reference bpb':>14} {'windowgpt bpb':>14} {'|diff|':>9} {'ref s':>7} {'ours s':>7} "
              f"{'speed-up':>8}")
    if a.repeat > 1:
        header += f" {'warm ref s':>10} {'warm ours s':>11} {'warm x':>7}"
    print()
    print(header)
    for what in whats:
        ref, ours = results[(what, "reference")], results[(what, "windowgpt")]
        label = f"{what} ({a.ttt_chunks} chunks)" if what == "ttt" and a.ttt_chunks else what
        rs, os_ = ref["seconds"], ours["seconds"]
        line = (f"{label:<18} {ref['bpb']:>14.8f} {ours['bpb']:>14.8f} {abs(ref['bpb'] - ours['bpb']):>9.2e} "
                f"{rs[0]:>7.1f} {os_[0]:>7.1f} {rs[0] / os_[0]:>7.2f}x")
        if a.repeat > 1:
            line += f" {min(rs[1:]):>10.1f} {min(os_[1:]):>11.1f} {min(rs[1:]) / min(os_[1:]):>6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
