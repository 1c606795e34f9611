"""FA4's backward at other tiles than its own, for this model's attention. flash-attn-4 picks
its sm90 backward's tiles by head size alone (`_tile_size_bwd_sm90`: for head_dim 64 FA3's
choice on an H100, 128 x 128 with its warp layouts and pipeline stages). This times one
layer's backward (FA4's kernel with its pre- and post-processing; a windowed layer's sinks
too) under each candidate, full causal and windowed, key heads grouped as the model makes
them, and checks each candidate's gradients against those of FA4's own tiles.

    python bench/fa4_backward_tiles.py [--positions 196608] [--repeats 20] [--json PATH]

Needs an sm90 GPU and flash-attn-4. A candidate FA4 cannot build or run is reported with its
error's first line; `best` names, for each kind of layer, the fastest whose gradients match.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fused_products import milliseconds  # noqa: E402
from bench.one_pass import (check_pass_args, error_line, pass_parser, pass_randn,  # noqa: E402
                            relative_difference, report)
from windowgpt_cli.kernels.flash4 import (FULL, fa4_attention, fa4_attention_backward,  # noqa: E402
                                          fa4_window_sinks, fa4_window_sinks_backward)

HEADS, KV_HEADS, HEAD_DIM, WINDOW, SINKS = 8, 4, 64, 512, 4
# Each candidate: the fields of FA4's BwdConfig it changes from FA4's own choice; only fields
# that FA4's compiled-kernel cache keys on (num_stages_PdS is not one: a change to it alone
# would run the kernel already built).
CANDIDATES: dict[str, dict] = {
    "fa4": {},
    "m64": {"m_block_size": 64, "AtomLayoutMdQ": 1},
    "m64_single_dq": {"m_block_size": 64, "AtomLayoutMdQ": 1, "dQ_single_wg": True},
    "n64": {"n_block_size": 64},
    "dq_layout1": {"AtomLayoutMdQ": 1},
    "dkv_layout1": {"AtomLayoutNdKV": 1},
    "sdp_unswapped": {"SdP_swapAB": False, "AtomLayoutMSdP": 2},
}
MATCH = 2e-2  # the largest gradient difference, as a fraction of the gradient's largest magnitude


@contextlib.contextmanager
def chosen_tiles(interface, chooser: str, changes: dict) -> Iterator[None]:
    """FA4's interface choosing its tiles with `changes` to its own choice (the config that its
    function `chooser` returns), for the calls inside the block (FA4 compiles a kernel for each
    tile configuration)."""
    own = getattr(interface, chooser)

    def changed(*args, **kwargs):
        return dataclasses.replace(own(*args, **kwargs), **changes)

    setattr(interface, chooser, changed)
    try:
        yield
    finally:
        setattr(interface, chooser, own)


def check_candidates(config_type: type, candidates: dict[str, dict]) -> None:
    """Every candidate names fields of FA4's config (a dataclass: BwdConfig, FwdConfig)."""
    fields = {f.name for f in dataclasses.fields(config_type)}
    for name, changes in candidates.items():
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise SystemExit(f"candidate {name}: {', '.join(unknown)} not in FA4's {config_type.__name__} "
                             f"({', '.join(sorted(fields))})")


def gradient_difference(want: tuple, got: tuple) -> float:
    """The largest difference of any gradient (or output), as a fraction of that tensor's
    largest magnitude."""
    return max(relative_difference(b, a) for a, b in zip(want, got))


def fastest_matching(figures: dict[str, dict], time: str = "backward_ms",
                     difference: str = "gradient_difference") -> str | None:
    """The candidate with the shortest time among those whose results match FA4's own tiles'."""
    matching = {name: f[time] for name, f in figures.items() if time in f and f[difference] <= MATCH}
    return min(matching, key=matching.get) if matching else None


def layer_backward(kind: str, positions: int) -> Callable[[], tuple]:
    """One layer's backward on random inputs, as the training step calls it."""
    randn = pass_randn(positions)
    q, k, v = randn(HEADS, HEAD_DIM), randn(KV_HEADS, HEAD_DIM), randn(KV_HEADS, HEAD_DIM)
    dout = randn(HEADS, HEAD_DIM)
    if kind == "full":
        out, lse = fa4_attention(q, k, v, FULL)
        dlse = torch.zeros_like(lse)
        return lambda: fa4_attention_backward(dout, dlse, q, k, v, out, lse, FULL)
    out, lse = fa4_window_sinks(q, k, v, WINDOW, SINKS)
    return lambda: fa4_window_sinks_backward(dout, q, k, v, out, lse, WINDOW, SINKS)


def time_candidates(interface, chooser: str, candidates: dict[str, dict], call: Callable[[], tuple],
                    repeats: int, time: str = "backward_ms", difference: str = "gradient_difference") -> dict:
    """call()'s time under each candidate's tiles (`chosen_tiles` with `chooser`) and the
    largest difference of its results from those under FA4's own; `best`, the fastest that
    matches (`fastest_matching`)."""
    want = call()
    figures: dict = {}
    for name, changes in candidates.items():
        try:
            with chosen_tiles(interface, chooser, changes):
                difference_value = gradient_difference(want, call())
                figures[name] = {time: round(milliseconds(call, repeats), 4), difference: round(difference_value, 6)}
        except Exception as error:  # a configuration FA4 cannot build: reported, not fatal
            figures[name] = {"error": error_line(error)}
    return {"candidates": figures, "best": fastest_matching(figures, time, difference)}


def tiles_report(interface, chooser: str, candidates: dict[str, dict], positions: int) -> dict:
    """The head of a tile bench's JSON: the GPU, the layer's shape, FA4's own tiles (its
    `chooser`'s for a causal layer) and the candidates."""
    own = getattr(interface, chooser)(HEAD_DIM, HEAD_DIM, True, False)
    return {"gpu": torch.cuda.get_device_name(), "positions": positions, "heads": HEADS, "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "window_size": WINDOW, "sinks": SINKS, "fa4_tiles": dataclasses.asdict(own),
            "candidates": candidates}


def main() -> None:
    args = pass_parser(__doc__.split("\n\n")[0]).parse_args()
    check_pass_args(args, "fa4_backward_tiles.py")
    interface = importlib.import_module("flash_attn.cute.interface")
    check_candidates(interface.BwdConfig, CANDIDATES)
    result = tiles_report(interface, "_tile_size_bwd_sm90", CANDIDATES, args.positions)
    for kind in ("full", "window"):
        result[kind] = time_candidates(interface, "_tile_size_bwd_sm90", CANDIDATES,
                                       layer_backward(kind, args.positions), args.repeats)
    report(result, args.json)


if __name__ == "__main__":
    main()
