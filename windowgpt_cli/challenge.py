"""The Parameter Golf challenge's limits and the words its records use, written once.

The track: the code plus the compressed model in at most 16,000,000 bytes, training
(GPTQ calibration on training data included) in at most 600 s on 8 H100s, evaluation in at
most 600 s on the same, and test-time training only on tokens already scored. `record`
checks a run against these; `quantize` and `inspect` measure an artifact against the budget.
"""
from __future__ import annotations

BUDGET_BYTES = 16_000_000  # code plus compressed model
TRAIN_SECONDS = 600.0  # training plus GPTQ calibration, on GPUS GPUs
EVAL_SECONDS = 600.0  # every evaluation command together, on GPUS GPUs
GPUS = 8
GPU_MODEL = "H100"

# GPUs whose speed on this model the challenge's is taken to equal, by a word of their names
# (the H200 has the H100's compute, with more memory bandwidth).
AS_FAST_AS_GPU_MODEL = ("H100", "H200")


def scaled_eval_cap(device_name: str, world_size: int) -> float | None:
    """The evaluation cap on world_size devices named device_name: EVAL_SECONDS x GPUS /
    world_size on GPUs as fast as the challenge's (the same work spread over fewer of
    them); None for other hardware, which the cap cannot be scaled to."""
    if not any(word in device_name for word in AS_FAST_AS_GPU_MODEL):
        return None
    return EVAL_SECONDS * GPUS / world_size


# Where GPTQ's Hessians came from, as quantize reports it: only Hessians collected inside
# training's budget make a record artifact.
INSIDE_TRAINING = "inside training"
AFTER_TRAINING = "calibrated after training"

# The order test-time training keeps, as records state it: each chunk is scored before the
# model trains on it, so no token is scored by a model that has seen it.
TTT_ORDER = "score-first"

# The record model's attention: the reference's model with windows of 512 tokens and 4 sink
# tokens on layers 2,4,6,8,10 (model settings; the Makefile's RECORD_MODEL_FLAGS say the same).
RECORD_WINDOWS = {"window_attn_size": 512, "num_sink_tokens": 4, "window_attn_layers": (2, 4, 6, 8, 10)}
