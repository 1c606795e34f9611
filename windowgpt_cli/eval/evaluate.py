"""The `eval` and `eval-ttt` stages: an artifact scored on a data directory's validation
shards, as the reference scores it (standard, sliding windows, or score-first test-time
training), the result saved beside the artifact.

A stride of 0, or one equal to the sequence length, gives the standard evaluation
(consecutive sequences); a smaller stride gives sliding windows. The model, and the
default sequence length, stride and batch, come from the artifact alone; eval-ttt's
windows are the training length, as in the reference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch

from ..artifacts import weights as model_io
from ..artifacts.results import claim_eval_result, save_eval_result
from ..challenge import TTT_ORDER, scaled_eval_cap
from ..config import RunConfig, apply_overrides, validate
from ..data.loader import load_validation_tokens
from ..data.manifest import DataManifest, check_same_tokenizer, verify_data
from ..data.tokenizer import ByteLuts, has_byte_fallback, load_byte_luts, load_sentencepiece
from ..distributed import DistContext, init_distributed, shutdown
from ..errors import SettingError
from ..model.gpt import GPT
from ..runtime import compiled, enable_fast_math, out_of_memory_as_error, use_cpu_threads
from ..timing import Phases
from .scoring import (
    BatchProgress,
    EvalResult,
    batch_windows,
    evaluate_sliding,
    evaluate_standard,
    should_compile,
    should_fuse,
)
from .lora_ttt import evaluate_lora_ttt
from .ttt import ChunkProgress, evaluate_ttt

Echo = Callable[[str], None]
Settings = dict[str, dict[str, Any]]  # {group: {setting: value}} over the artifact's configuration
# What shows scoring's progress: given a label and whether the first batches compile, a
# context yielding a callback for each batch (or None).
BatchDisplay = Callable[[str, bool], ContextManager[BatchProgress | None]]
# The same for eval-ttt's chunks: given whether the first chunk compiles.
ChunkDisplay = Callable[[bool], ContextManager[Callable[[ChunkProgress], None] | None]]
LOG_EVERY_CHUNKS = 10  # without a display, a line every this many chunks (as the reference)


@dataclass
class EvalInputs:
    """An artifact's model on the device, with the byte tables of its tokenizer."""
    weights: model_io.LoadedWeights
    model: GPT
    luts: ByteLuts
    tokenizer: Path
    ctx: DistContext
    attn_backend: str
    data: DataManifest | None = None  # the validation data, checked against its manifest
    byte_fallback: bool = True  # whether the tokenizer has it (without, bits per byte come out too low)

    @property
    def config(self) -> RunConfig:
        return self.weights.config


def load_inputs(artifact: Path, data_dir: Path, tokenizer: Path | None, ctx: DistContext,
                attn_backend: str = "auto") -> EvalInputs:
    """Build the artifact's model and check that the data and the tokenizer are those it
    was trained with."""
    data = verify_data(data_dir, hash_splits=("val",))
    return load_model(artifact, Path(tokenizer) if tokenizer is not None else data.tokenizer, ctx, attn_backend, data)


def load_model(artifact: Path, tokenizer_path: Path, ctx: DistContext, attn_backend: str = "auto",
               data: DataManifest | None = None) -> EvalInputs:
    """Build the artifact's model, with the byte tables of its tokenizer (checked by hash),
    and check that the data, when given, was encoded with that tokenizer."""
    weights, model = model_io.build_model(Path(artifact), ctx.device)
    if data is not None:
        check_same_tokenizer(data, weights.tokenizer_sha256, f"{artifact} was trained with")
    model_io.check_tokenizer(weights, tokenizer_path, artifact)
    tables = data.byte_tables if data is not None and tokenizer_path == data.tokenizer else None
    luts = load_byte_luts(tokenizer_path, tables, weights.config.model.vocab_size).to(ctx.device)
    backend = model.set_attention_backend(attn_backend, ctx.device)
    enable_fast_math(ctx.device)
    byte_fallback = has_byte_fallback(load_sentencepiece(tokenizer_path))
    return EvalInputs(weights, model, luts, tokenizer_path, ctx, backend, data, byte_fallback)


def eval_record(result: EvalResult, inputs: EvalInputs, artifact: Path) -> dict[str, Any]:
    """What --json prints and the table shows."""
    return {
        "mode": result.mode, "val_loss": result.val_loss, "val_bpb": result.val_bpb, "tokens": result.tokens,
        "bytes": result.bytes, "seconds": result.seconds, "tokens_per_second": result.tokens_per_second,
        "seq_len": result.seq_len, "stride": result.stride, "batch_seqs": result.batch_seqs,
        "artifact": str(artifact),
        "artifact_kind": inputs.weights.kind, "artifact_sha256": inputs.weights.sha256,
        "tokenizer": str(inputs.tokenizer), "tokenizer_byte_fallback": inputs.byte_fallback,
        "attn_backend": inputs.attn_backend,
    }


def add_timings(record: dict[str, Any], phases, result: EvalResult) -> None:
    """The command's wall time by phase (timing.Phases), scoring's own phases beside it."""
    phases.add("scoring", result.seconds)
    record["timings_s"] = phases.as_dict()
    record["scoring_timings_s"] = result.timings


@dataclass
class EvalReport:
    result: EvalResult
    record: dict[str, Any]  # what --json prints
    is_main: bool  # rank 0 (only it prints)


def evaluate_artifact(artifact: Path, data_dir: Path, *, settings: Settings | None = None,
                      tokenizer: Path | None = None, device: str = "auto", attn_backend: str = "auto",
                      score_once: bool = False, compile_model: bool | None = None, fused: bool | None = None,
                      progress: BatchDisplay | None = None) -> EvalReport:
    """Score the artifact on DATA_DIR's validation shards (standard or sliding evaluation).
    settings ({"eval": {setting: value}}) change the artifact's eval settings."""
    settings = settings or {}
    apply_overrides(RunConfig(), settings)  # every value within its bounds before anything is read
    phases = Phases()
    ctx = init_distributed(device)
    try:
        inputs, cfg = _load_with_settings(artifact, data_dir, settings, tokenizer, ctx, attn_backend, phases)
        seq_len, stride, batch_seqs = cfg.eval.eval_seq_len, cfg.eval.eval_stride, cfg.eval.eval_batch_seqs
        standard = stride == 0 or stride == seq_len
        if ctx.is_main:
            claim_eval_result(Path(artifact), "standard" if standard else "sliding")
        # As the reference: the tokens are cut to whole sequences of the longer of the
        # training and evaluation lengths.
        with phases.timed("tokens"):
            val_tokens = load_validation_tokens(data_dir, max(cfg.train.train_seq_len, seq_len),
                                                cfg.model.vocab_size, inputs.data.shards("val"))
        compile_model = should_compile(compile_model, ctx.device)
        compiling = compile_model or (not standard and should_fuse(fused, ctx.device))
        display = progress if progress is not None and ctx.is_main else _no_display
        with display("eval", compiling) as progress, out_of_memory_as_error(
                ctx.device, "scoring", "lower --batch-seqs (0 fits itself to the free memory)"):
            if standard:
                loss_fn = compiled(inputs.model, compile_model, autotune=False)
                batch = batch_windows(batch_seqs, cfg.model, seq_len, ctx.device, full_logits=True)
                result = evaluate_standard(loss_fn, val_tokens, inputs.luts, seq_len=seq_len,
                                           batch_tokens=batch * seq_len, device=ctx.device, rank=ctx.rank,
                                           world_size=ctx.world_size, progress=progress)
            else:
                result = evaluate_sliding(inputs.model, val_tokens, inputs.luts, seq_len=seq_len, stride=stride,
                                          batch_seqs=batch_seqs, device=ctx.device, rank=ctx.rank,
                                          world_size=ctx.world_size, score_once=score_once,
                                          compile_model=compile_model, fused=fused, progress=progress)
        record = eval_record(result, inputs, Path(artifact))
        if result.mode == "sliding":
            record["score_once"] = score_once
        return _saved_report(Path(artifact), result, record, phases, ctx)
    finally:
        shutdown()


def ttt_evaluate_artifact(artifact: Path, data_dir: Path, *, settings: Settings | None = None,
                          tokenizer: Path | None = None, device: str = "auto", attn_backend: str = "auto",
                          score_once: bool = False, compile_model: bool | None = None, fused: bool | None = None,
                          progress: ChunkDisplay | None = None, echo: Echo | None = None) -> EvalReport:
    """Score the artifact with score-first TTT on DATA_DIR's validation shards.

    settings ({"eval": {...}, "ttt": {...}}) change the artifact's saved eval and TTT settings;
    the windows are ttt_seq_len (default: the training length, as the reference).
    echo receives the log lines (settings, parameter counts, and without a display the
    running bpb every few chunks).
    """
    settings = settings or {}
    apply_overrides(RunConfig(), settings)  # every value within its bounds before anything is read
    phases = Phases()
    ctx = init_distributed(device)
    try:
        inputs, cfg = _load_with_settings(artifact, data_dir, settings, tokenizer, ctx, attn_backend, phases)
        ttt = cfg.ttt
        lora = ttt.ttt_method == "lora"
        seq_len, stride, batch_seqs = ttt.ttt_seq_len or cfg.train.train_seq_len, cfg.eval.eval_stride, \
            cfg.eval.eval_batch_seqs
        if not lora and not 1 <= stride <= seq_len:
            raise SettingError("eval_stride", f"eval_stride={stride} must be in 1..{seq_len}: test-time training "
                                              "scores sliding windows of its training sequences")
        mode = "ttt_lora" if lora else "ttt"
        if ctx.is_main:
            claim_eval_result(Path(artifact), mode)
        # As the reference: the tokens are cut to whole sequences of the longer of the
        # training (here: TTT window) and evaluation lengths.
        with phases.timed("tokens"):
            val_tokens = load_validation_tokens(data_dir, max(seq_len, cfg.eval.eval_seq_len), cfg.model.vocab_size,
                                                inputs.data.shards("val"))
        echo = echo if ctx.is_main else None
        compiling = not lora and (should_fuse(fused, ctx.device) or should_compile(compile_model, ctx.device))
        display = progress if progress is not None and ctx.is_main else \
            functools.partial(_chunk_lines, echo, unit="ttt_lora_batch" if lora else "ttt_chunk")
        remedy = "lower --ttt-lora-batch-docs" if lora else "lower --ttt-batch-seqs or --batch-seqs"
        with display(compiling) as on_chunk, out_of_memory_as_error(ctx.device, "scoring and training", remedy):
            if lora:
                result = evaluate_lora_ttt(inputs.model, val_tokens, inputs.luts, ttt, seq_len=seq_len,
                                           device=ctx.device, rank=ctx.rank, world_size=ctx.world_size,
                                           fused=should_fuse(fused, ctx.device), on_batch=on_chunk, log=echo)
            else:
                result = evaluate_ttt(inputs.model, val_tokens, inputs.luts, ttt, seq_len=seq_len, stride=stride,
                                      batch_seqs=batch_seqs, device=ctx.device, rank=ctx.rank,
                                      world_size=ctx.world_size, score_once=score_once, compile_model=compile_model,
                                      fused=fused, on_chunk=on_chunk, log=echo)
        record = eval_record(result, inputs, Path(artifact))
        record["ttt"] = dataclasses.asdict(ttt)
        record["ttt_order"] = TTT_ORDER
        record["ttt_steps"] = result.ttt_steps
        scores = [{"loss_sum": c.loss_sum, "tokens": c.tokens, "bytes": c.bytes, "val_bpb": c.val_bpb}
                  for c in result.per_chunk]
        if lora:
            record["per_phase"] = scores
        else:
            record["score_once"] = score_once
            record["per_chunk"] = scores
        return _saved_report(Path(artifact), result, record, phases, ctx)
    finally:
        shutdown()


def eval_cap(seconds: float, ctx: DistContext) -> dict[str, Any]:
    """The command's wall time so far (from its process's start) against the challenge's
    evaluation cap scaled to this hardware (None where the hardware is not one the
    challenge's GPU can be compared with)."""
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    cap = scaled_eval_cap(name, ctx.world_size)
    return {"seconds": round(seconds, 3), "cap_seconds": cap, "hardware": f"{ctx.world_size} x {name}",
            "within": None if cap is None else seconds <= cap}


def _load_with_settings(artifact: Path, data_dir: Path, settings: Settings, tokenizer: Path | None,
                        ctx: DistContext, attn_backend: str, phases: Phases) -> tuple[EvalInputs, RunConfig]:
    """The artifact's model and data, and its configuration with the stage's settings over it, checked."""
    with phases.timed("load"):
        inputs = load_inputs(artifact, data_dir, tokenizer, ctx, attn_backend)
    cfg = apply_overrides(inputs.config, settings)
    validate(cfg)
    use_cpu_threads(cfg.train.cpu_threads, ctx.device)
    return inputs, cfg


def _saved_report(artifact: Path, result: Any, record: dict[str, Any], phases: Phases,
                  ctx: DistContext) -> EvalReport:
    """The report, its timings added, and saved beside the artifact (for `compare` and `inspect`) by rank 0."""
    add_timings(record, phases, result)
    record["eval_cap"] = eval_cap(record["timings_s"]["total"], ctx)
    if ctx.is_main:
        save_eval_result(artifact, record)
    return EvalReport(result, record, ctx.is_main)


@contextlib.contextmanager
def _no_display(*args: Any) -> Iterator[None]:
    yield None


@contextlib.contextmanager
def _chunk_lines(echo: Echo | None, compiling: bool, unit: str = "ttt_chunk"
                 ) -> Iterator[Callable[[ChunkProgress], None] | None]:
    """Without a display: a line every few chunks (or LoRA's batches of documents), as the
    reference logs them."""
    if echo is None:
        yield None
        return
    start = time.perf_counter()

    def print_line(info: ChunkProgress) -> None:
        if info.chunk % LOG_EVERY_CHUNKS == 1 or info.chunk == info.num_chunks:
            echo(f"  {unit} [{info.chunk}/{info.num_chunks}] bpb={info.val_bpb:.6f} "
                 f"time={time.perf_counter() - start:.1f}s")

    yield print_line
