"""FA4's forward at other tiles than its own, for this model's attention. flash-attn-4's sm90
forward takes 192 x 128 tiles for head_dim 64 (`_tile_size_fwd_sm90`), full causal and
windowed alike. Over a window of 512 a tile of 192 queries spans six blocks of 128 keys for
about 512 useful a query; one of 128 queries spans five. This times one layer's forward
(FA4's kernel; a windowed layer's sinks too), full causal and windowed, key heads grouped as
the model makes them, under each candidate, and checks each candidate's output and
log-sum-exp against those of FA4's own tiles.

    python bench/fa4_forward_tiles.py [--positions 196608] [--repeats 20] [--json PATH]

Needs an sm90 GPU and flash-attn-4. A candidate FA4 cannot build or run is reported with its
error's first line; `best` names, for each kind of layer, the fastest whose outputs match.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fa4_backward_tiles import (HEAD_DIM, HEADS, KV_HEADS, SINKS, WINDOW, check_candidates,  # noqa: E402
                                      tiles_report, time_candidates)
from bench.one_pass import check_pass_args, pass_parser, pass_randn, report  # noqa: E402
from windowgpt_cli.kernels.flash4 import FULL, fa4_attention, fa4_window_sinks  # noqa: E402

# Each candidate: the fields of FA4's FwdConfig it changes from FA4's own choice.
CANDIDATES: dict[str, dict] = {
    "fa4": {},
    "m128": {"m_block_size": 128},
    "m128_n96": {"m_block_size": 128, "n_block_size": 96},
    "m64": {"m_block_size": 64},
    "n96": {"n_block_size": 96},
    "n64": {"n_block_size": 64},
    "m128_ss": {"m_block_size": 128, "mma_pv_is_rs": False},
}


def layer_forward(kind: str, positions: int):
    """One layer's forward on random inputs, as the training step calls it: (out, lse)."""
    randn = pass_randn(positions)
    q, k, v = randn(HEADS, HEAD_DIM), randn(KV_HEADS, HEAD_DIM), randn(KV_HEADS, HEAD_DIM)
    if kind == "full":
        return lambda: fa4_attention(q, k, v, FULL)
    return lambda: fa4_window_sinks(q, k, v, WINDOW, SINKS)


def main() -> None:
    args = pass_parser(__doc__.split("\n\n")[0]).parse_args()
    check_pass_args(args, "fa4_forward_tiles.py")
    interface = importlib.import_module("flash_attn.cute.interface")
    check_candidates(interface.FwdConfig, CANDIDATES)
    result = tiles_report(interface, "_tile_size_fwd_sm90", CANDIDATES, args.positions)
    with torch.no_grad():
        for kind in ("full", "window"):
            result[kind] = time_candidates(interface, "_tile_size_fwd_sm90", CANDIDATES,
                                           layer_forward(kind, args.positions), args.repeats, "forward_ms",
                                           "output_difference")
    report(result, args.json)


if __name__ == "__main__":
    main()
