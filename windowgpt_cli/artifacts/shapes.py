"""What tensors a configuration's model holds, by name and shape, found on PyTorch's meta
device (nothing allocated), and the check that an artifact holds exactly those: every stage
that reads weights makes it before it builds a model, naming the first tensor that differs."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Mapping

from ..config import ModelConfig
from ..errors import ArtifactError
from ..model.state_dict import unbank_state_dict

if TYPE_CHECKING:  # imported where a check runs: modules that import this one describe without torch
    import torch

Described = Mapping[str, "tuple[tuple[int, ...], torch.dtype]"]  # name -> (shape, dtype)


def expected_shapes(cfg: ModelConfig, per_layer: bool) -> dict[str, tuple[int, ...]]:
    """The model's state dict by name and shape: banked, or per layer as exports and .ptz
    files store it."""
    return dict(_shapes(dataclasses.astuple(cfg), per_layer))


@functools.lru_cache(maxsize=8)
def _shapes(fields: tuple, per_layer: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    import torch

    from ..model.gpt import GPT

    cfg = ModelConfig(*fields)
    with torch.device("meta"):
        state = GPT(cfg, initialize=False).state_dict()
    if per_layer:
        state = unbank_state_dict(state, cfg.num_layers)
    return tuple((name, tuple(t.shape)) for name, t in state.items())


def check_tensors(cfg: ModelConfig, tensors: Described, source: str, per_layer: bool) -> None:
    """ArtifactError naming the first tensor missing, unknown, of another shape or not of a
    floating dtype."""
    expected = expected_shapes(cfg, per_layer)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ArtifactError(f"{source}: lacks {missing[0]}, which its configuration's model needs "
                            f"({len(missing)} tensor(s) missing)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ArtifactError(f"{source}: holds {extra[0]}, which its configuration's model has no place for "
                            f"({len(extra)} such tensor(s))")
    for name, shape in expected.items():
        got, dtype = tensors[name]
        if tuple(got) != shape:
            raise ArtifactError(f"{source}: {name} is {list(got)}, its configuration's model needs {list(shape)}")
        if not dtype.is_floating_point:
            raise ArtifactError(f"{source}: {name} is {dtype}, its configuration's model needs floating point")


def described(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
