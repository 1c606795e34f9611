"""Sliding-window and TTT evaluation: windowgpt against the reference, same weights, same GPU.

    python bench/eval_speed.py --reference-model final_model.pt --data DATA_DIR \
        --seed-dir SEED_COPY [--what sliding|ttt|both] [--ttt-chunks N] [--batch-seqs 128]

final_model.pt is a state dict written by the reference script (default settings, the
model of `RunConfig().resolved()`); DATA_DIR holds fineweb_val_*.bin and tokenizer.model
(or pass --tokenizer); SEED_COPY is a copy of shared/seed (its shim stands in for FA3, and
run_reference fixes the reference's TTT crash). Each side loads the weights afresh, runs
in this process with its own compilation, and is timed between CUDA synchronizations. TTT
runs with the reference's freezing (--no-ttt-freeze-bank-slices); --ttt-chunks N scores
the first N chunks only, on both sides. The last lines are a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.evaluation import evaluate_sliding, evaluate_ttt, load_validation_tokens  # noqa: E402
from windowgpt_cli.model import GPT, build_model  # noqa: E402
from windowgpt_cli.runtime import enable_fast_math  # noqa: E402
from windowgpt_cli.tokenizer import load_byte_luts  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference-model", type=Path, required=True, help="final_model.pt of the reference")
    p.add_argument("--data", type=Path, required=True, help="directory with fineweb_val_*.bin")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: DATA/tokenizer.model")
    p.add_argument("--seed-dir", type=Path, required=True, help="a copy of shared/seed")
    p.add_argument("--what", choices=("sliding", "ttt", "both"), default="sliding")
    p.add_argument("--ttt-chunks", type=int, default=None, help="score only the first N TTT chunks (both sides)")
    p.add_argument("--batch-seqs", type=int, default=128, help="windows per forward pass, windowgpt's side")
    p.add_argument("--repeat", type=int, default=1, help="run each side N times (later runs: compiled already)")
    p.add_argument("--ttt-compile-training", action="store_true",
                   help="windowgpt's TTT also compiles its training step (default: eager, as eval-ttt)")
    return p.parse_args()


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


# --- Timing ---------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


@dataclasses.dataclass
class Row:
    what: str
    ref_bpb: float
    ours_bpb: float
    ref_s: list[float]
    ours_s: list[float]


def main() -> None:
    a = parse_args()
    device = torch.device("cuda")
    enable_fast_math(device)
    cfg = RunConfig().resolved()
    tokenizer = a.tokenizer or a.data / "tokenizer.model"
    ref = import_reference(a.seed_dir)
    args = reference_args(ref, cfg)
    state = torch.load(a.reference_model, map_location="cpu", weights_only=True)

    val_seq_len = max(cfg.train.train_seq_len, cfg.eval.eval_seq_len)
    val_tokens = load_validation_tokens(a.data, val_seq_len, cfg.model.vocab_size)
    ref_val = ref.load_validation_tokens(str(a.data / "fineweb_val_*.bin"), val_seq_len)
    assert torch.equal(ref_val.long(), val_tokens.long()), "the two loaders disagree on the validation tokens"
    ref_luts, _ = ref.load_tokenizer_luts(str(tokenizer), "", args.vocab_size, device)
    luts = load_byte_luts(tokenizer, None, cfg.model.vocab_size).to(device)
    print(f"validation tokens: {val_tokens.numel() - 1:,}  seq_len {cfg.eval.eval_seq_len}  "
          f"stride {cfg.eval.eval_stride}  our batch {a.batch_seqs}", flush=True)

    def ours_model() -> GPT:
        model = build_model(cfg.model, device)
        model.load_state_dict(state, strict=True)
        model.set_attention_backend("auto", device)
        return model.eval()

    rows: list[Row] = []
    if a.what in ("sliding", "both"):
        rows.append(compare_sliding(a, ref, args, state, cfg, val_tokens, ref_luts, luts, ours_model, device))
    if a.what in ("ttt", "both"):
        rows.append(compare_ttt(a, ref, args, state, cfg, val_tokens, ref_luts, luts, ours_model, device))
    print_table(rows)


def compare_sliding(a, ref, args, state, cfg, val_tokens, ref_luts, luts, ours_model, device) -> Row:
    stride, seq_len = cfg.eval.eval_stride, cfg.eval.eval_seq_len
    ref_model = reference_model(ref, args, state, device)
    ref_s, ours_s = [], []
    for _ in range(a.repeat):
        (_, ref_bpb), seconds = timed(lambda: ref.eval_val_sliding(
            args, ref_model, 0, 1, device, val_tokens, *ref_luts, stride=stride, batch_seqs=32, eval_seq_len=seq_len))
        ref_s.append(seconds)
        print(f"reference sliding: val_bpb {ref_bpb:.8f} in {seconds:.1f}s", flush=True)
    del ref_model
    model = ours_model()
    for _ in range(a.repeat):
        result, seconds = timed(lambda: evaluate_sliding(model, val_tokens, luts, seq_len=seq_len, stride=stride,
                                                         batch_seqs=a.batch_seqs, device=device))
        ours_s.append(seconds)
        print(f"windowgpt sliding: val_bpb {result.val_bpb:.8f} in {seconds:.1f}s "
              f"(peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)", flush=True)
    return Row("sliding", ref_bpb, result.val_bpb, ref_s, ours_s)


def compare_ttt(a, ref, args, state, cfg, val_tokens, ref_luts, luts, ours_model, device) -> Row:
    ttt = dataclasses.replace(cfg.ttt, ttt_freeze_bank_slices=False)  # the reference's freezing
    stride, seq_len = cfg.eval.eval_stride, cfg.train.train_seq_len
    label = "ttt"
    if a.ttt_chunks:
        val_tokens = val_tokens[: min(a.ttt_chunks * ttt.ttt_chunk_tokens, val_tokens.numel() - 1) + 1]
        label = f"ttt ({a.ttt_chunks} chunks)"
    ref_s, ours_s = [], []
    for _ in range(a.repeat):
        ref_model = reference_model(ref, args, state, device)  # TTT changes the weights: fresh each time
        (_, ref_bpb), seconds = timed(lambda: ref.eval_val_sliding_ttt(
            args, ref_model, 0, 1, device, val_tokens, *ref_luts, stride=stride, batch_seqs=32,
            log0=lambda message: None))
        ref_s.append(seconds)
        print(f"reference {label}: val_bpb {ref_bpb:.8f} in {seconds:.1f}s", flush=True)
        del ref_model
    for _ in range(a.repeat):
        model = ours_model()
        result, seconds = timed(lambda: evaluate_ttt(model, val_tokens, luts, ttt, seq_len=seq_len, stride=stride,
                                                     batch_seqs=a.batch_seqs, device=device,
                                                     compile_training=a.ttt_compile_training))
        ours_s.append(seconds)
        print(f"windowgpt {label}: val_bpb {result.val_bpb:.8f} in {seconds:.1f}s", flush=True)
    return Row(label, ref_bpb, result.val_bpb, ref_s, ours_s)


def print_table(rows: list[Row]) -> None:
    warm = any(len(r.ref_s) > 1 for r in rows)
    header = f"{'':<18} {'reference bpb':>14} {'windowgpt bpb':>14} {'|diff|':>9} {'ref s':>7} {'ours s':>7} {'speed-up':>8}"
    if warm:
        header += f" {'warm ref s':>10} {'warm ours s':>11} {'warm x':>7}"
    print()
    print(header)
    for r in rows:
        line = (f"{r.what:<18} {r.ref_bpb:>14.8f} {r.ours_bpb:>14.8f} {abs(r.ref_bpb - r.ours_bpb):>9.2e} "
                f"{r.ref_s[0]:>7.1f} {r.ours_s[0]:>7.1f} {r.ref_s[0] / r.ours_s[0]:>7.2f}x")
        if warm:
            ref_warm, ours_warm = min(r.ref_s[1:] or r.ref_s), min(r.ours_s[1:] or r.ours_s)
            line += f" {ref_warm:>10.1f} {ours_warm:>11.1f} {ref_warm / ours_warm:>6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
