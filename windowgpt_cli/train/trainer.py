"""The training loop: plain Python that the `train` stage and the tests call.

It follows the reference step for step (gradient accumulation, clipping, the overlapped
optimizer step, EMA and SWA, wallclock-aware warm-down) and adds what a pre-emptible job
needs: checkpoints with every piece of state, an exact resume, and a graceful stop on
Ctrl-C or SIGTERM at the next step boundary.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..artifacts.checkpoint import FILENAME as CHECKPOINT_FILENAME
from ..artifacts.checkpoint import HESSIANS_FILENAME, Checkpoint, keep_checkpoint, save_checkpoint
from ..config import ModelConfig, RunConfig, grad_accum_steps_for
from ..data.loader import Prefetcher, TokenStream, load_validation_tokens
from ..data.manifest import read_manifest, verify_data
from ..data.tokenizer import (
    ByteLuts,
    has_byte_fallback,
    load_byte_luts,
    load_sentencepiece,
    no_byte_fallback_warning,
    tokenizer_vocab_size,
)
from ..distributed import DistContext, all_reduce_, average_gradients, barrier, gather_from_ranks
from ..errors import ConfigError, DataError, Interrupted, Terminated, TrainingDiverged
from ..eval.scoring import evaluate_standard
from ..kernels.fp8_products import fp8_available
from ..kernels.quack_products import QuackUnavailable, quack_targets
from ..model.attention import window_kernel_builds
from ..model.fp8_ops import Fp8Ops
from ..model.gpt import GPT, build_model, check_fits
from ..model.ops import TorchOps
from ..model.state_dict import BANK_NAMES
from ..model.weight_grid import RowGrid
from ..quant.calibration import calibrate, save_hessians
from ..quant.schemes import QuantPlan, bank_grids
from ..runtime import (
    autocast,
    compiled,
    device_name,
    enable_fast_math,
    has_tma,
    hopper_or_blackwell,
    phase,
    seed_everything,
    synchronize,
    threads_meanwhile,
    triton_available,
)
from ..storage.files import json_text, sha256_file, tensors_sha256
from ..timing import Phases, compiled_graphs
from .optim import Optimizers, WeightAverages, build_optimizers, lr_scale, muon_momentum_at

TRAINING_BYTES_PER_PARAMETER = 24
SWA_LR_THRESHOLD = 0.2  # SWA collects snapshots once the LR scale falls below this
# The model's switches that training may turn on part way (GPT attributes), and how the log names them;
# TRAIN_OPS is on throughout training and off in validation where the ops change the numbers.
RECURRING, ROUNDING, TRAIN_OPS = "recurring", "rounding_weights", "train_ops_on"
SWITCH_LOG_NAMES = {RECURRING: "recurrence", ROUNDING: "qat"}


def qat_text(grids: tuple[RowGrid | None, ...] | None) -> str:
    """The log's line on what quantization-aware training rounds."""
    if grids is None:
        return "qat:nothing to round: every bank's matrices stay float (quant_passthrough_max_numel)"
    return "qat:grids " + " ".join(f"{bank}:{grid}" for bank, grid in zip(BANK_NAMES, grids) if grid is not None)


def switch_states(fractions: dict[str, float], validation_off: tuple[str, ...] = ()) -> list[dict[str, bool]]:
    """The states of the switches (attribute -> on) that a run's forward passes take, each
    one graph to compile: training's, as each switch turns on at its fraction of the budget
    (ties in the order given) and the switches of validation_off on throughout, and
    validation's, which sees the weights unrounded, those switches off and, at the end,
    recurrence on."""
    order = sorted(fractions, key=lambda name: fractions[name])
    always = dict.fromkeys(validation_off, True)
    path = [{name: i < k for i, name in enumerate(order)} | always for k in range(len(order) + 1)]
    off = ((ROUNDING,) if ROUNDING in fractions else ()) + validation_off
    states = list(path)
    if off:
        states += [state | dict.fromkeys(off, False) for state in path]
    unique: list[dict[str, bool]] = []
    for state in states:
        if state not in unique:
            unique.append(state)
    return unique


@dataclass(frozen=True)
class StepPhases:
    """The names of a training step's profiler ranges (see runtime.phase)."""

    data: str = "train.data"
    forward: str = "train.forward"
    backward: str = "train.backward"
    grad_clip: str = "train.grad_clip"
    grad_sync: str = "train.grad_sync"
    adam: str = "train.adam"
    muon: str = "train.muon"
    ema: str = "train.ema"


PHASES = StepPhases()


@dataclass
class TrainResult:
    step: int
    training_time_ms: float
    finished: bool  # False when stopped early (--stop-at-step or an interrupt)
    interrupted: bool = False  # stopped by Ctrl-C or SIGTERM (with a checkpoint)
    stop_signal: int | None = None  # the signal that asked the run to stop (also when it came after the last step)
    val_loss: float | None = None
    val_bpb: float | None = None
    post_ema_val_loss: float | None = None
    post_ema_val_bpb: float | None = None
    checkpoint: Path | None = None
    calibration: dict[str, Any] | None = None  # GPTQ calibration inside training (summary.json's record)
    devices: list[str] | None = None  # each rank's GPU name, or "cpu"
    # Graphs torch.compile built during the training loop, after the warm-up: 0 when every
    # variant (depth recurrence on and off, validation) was compiled ahead.
    graphs_compiled_in_training: int = 0
    kernels: dict[str, str] | None = None  # what the settings left to auto chose here (`step_kernels`)


class RunLog:
    """The reference's log lines on stdout and in train.log, one JSON object per logged
    step in metrics.jsonl; silent on every rank but the first."""

    def __init__(self, out_dir: Path, enabled: bool, echo: Callable[[str], None] = print, sink: Any = None):
        self.enabled, self.echo = enabled, echo
        self.log_path, self.metrics_path = out_dir / "train.log", out_dir / "metrics.jsonl"
        self.sink = sink  # `metric_sinks.MetricSink`: TensorBoard or W&B, or None

    def line(self, message: str) -> None:
        if not self.enabled:
            return
        self.echo(message)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(message + "\n")

    def metrics(self, **values: Any) -> None:
        if self.enabled:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json_text(values, indent=None) + "\n")
            if self.sink is not None:
                self.sink.log(values)


class StopRequests:
    """Ctrl-C / SIGTERM set a flag that the loop reads at step boundaries, so the run stops
    with a consistent checkpoint; a second one stops at once. `signal` is the first one's."""

    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequests"]:
        def handler(signum, frame):
            if self.requested:
                raise Terminated if signum == signal.SIGTERM else Interrupted
            self.signal = signum

        try:
            previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: no signal handling
            yield self
            return
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


@dataclass
class Setup:
    """Everything a run needs, built once from the configuration."""

    cfg: RunConfig
    ctx: DistContext
    model: GPT
    forward: Callable  # the training loss (x, y) -> mean cross-entropy: the model, compiled or not
    optimizers: Optimizers
    averages: WeightAverages
    luts: ByteLuts
    val_tokens: torch.Tensor
    train_files: list[Path]
    tokenizer_sha256: str
    grad_accum_steps: int
    seq_len: int  # this rank's training sequence length
    tokenizer: Path | None = None
    micro_batches_per_pass: int = 1  # micro-batches concatenated into one forward and backward
    compiled: bool = False  # whether forward is torch.compile'd

    @property
    def passes_per_step(self) -> int:
        return self.grad_accum_steps // self.micro_batches_per_pass


# Activations may take this share of a GPU's memory (the rest: weights, optimizer state,
# the compiler's workspace and the allocator's slack). The bound below overstates them: the
# record model's four micro-batches a pass, bounded at 91 GiB, peaked at 85 GiB on an H200
# (139 GiB), whose step they shorten by 0.8% against two (docs/performance.md).
TRAIN_MEMORY_FRACTION = 0.7


def training_bytes_per_token(cfg: ModelConfig, fused_loss: bool = False, chunked_loss: bool = False) -> int:
    """A bound on what one training token keeps alive for the backward: per layer the
    float32 residual stream's parts and the bfloat16 inputs and outputs of its matrix
    products and attention, and the float32 logits and their gradient (with the fused loss
    the bfloat16 logits and their gradient alone; over chunks of rows, no logits at all)."""
    bf16_per_layer = 5 * cfg.model_dim + 2 * cfg.kv_dim + 3 * cfg.mlp_dim
    per_logit = 0 if chunked_loss else 2 * 2 if fused_loss else 4 * 3
    return cfg.num_layers * (4 * 3 * cfg.model_dim + 2 * bf16_per_layer) + per_logit * cfg.vocab_size


def fused_loss_on(cfg: RunConfig, device: torch.device) -> bool:
    """Whether training computes its loss with the fused kernels (alone, or over chunks of
    rows with the output layer): asked for, and where they run."""
    return (cfg.train.fused_cross_entropy or cfg.train.loss_chunk_rows > 0) and triton_available(device)


def fused_mlp_products(cfg: RunConfig, device: torch.device) -> str | None:
    """Whose products the training step's fused MLP runs ("triton" or "quack"), or None for
    the compiler's MLP: as `fused_mlp` names them where they run (Triton's: a GPU with TMA,
    Hopper or later; quack's: Hopper or Blackwell with the package, whose absence there is an
    error), or for auto quack's where they run on bf16 products of a slope they take."""
    asked = cfg.train.fused_mlp
    if asked == "auto":
        takes = not fp8_kinds(cfg) and 0 <= cfg.model.negative_slope <= 1
        return "quack" if takes and quack_targets(device) else None
    if asked == "triton":
        return asked if triton_available(device) and has_tma(device) else None
    if asked == "quack":
        if quack_targets(device):
            return asked
        if hopper_or_blackwell(device):
            raise ConfigError("fused_mlp quack needs the quack-kernels package, which flash-attn-4 installs "
                              "(pip install 'windowgpt[fa4]')")
    return None


def fold_output_scales_on(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the training step folds the output scales into their projections
    (`fold_output_scales`; auto: on a CUDA device, where it shortens the step)."""
    return cfg.train.fold_output_scales == "on" or (cfg.train.fold_output_scales == "auto" and device.type == "cuda")


def stack_qkv_on(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the training step makes each block's q, k and v in one product (`stack_qkv`
    on or qk; auto: on a CUDA device, where it shortens the step)."""
    return cfg.train.stack_qkv in ("on", "qk") or (cfg.train.stack_qkv == "auto" and device.type == "cuda")


def pairs_heads(cfg: RunConfig, device: torch.device) -> bool:
    """Whether a stacked product's queries and keys go through one heads' op where the fused
    heads run (`stack_qkv` qk; auto: on a CUDA device, where it shortens the step): stacked, and
    not asked for `on` alone."""
    return stack_qkv_on(cfg, device) and cfg.train.stack_qkv != "on"


def fused_op_on(asked: str, device: torch.device) -> bool:
    """Whether the training step runs one of its fused Triton ops (`fused_head_prep`,
    `fused_xsa`) set to `asked`: on (or the heads' apart), or auto on a CUDA device; either
    where Triton runs."""
    return (asked in ("on", "apart") or (asked == "auto" and device.type == "cuda")) and triton_available(device)


def set_fused_ops(model: GPT, cfg: RunConfig, device: torch.device) -> None:
    """The training step's fused Triton ops that the settings ask for, in its ops."""
    heads, output = fused_op_on(cfg.train.fused_head_prep, device), fused_op_on(cfg.train.fused_xsa, device)
    if not (heads or output):
        return
    from ..kernels.attention_output import fused_attention_output  # imports Triton: only when used
    from ..kernels.fused_heads import fused_head_prep, fused_head_prep_pair

    heads_op, pair_op = fused_head_prep, fused_head_prep_pair
    if cfg.train.fused_head_prep == "apart":
        heads_op, pair_op = (functools.partial(op, rotated_apart=True) for op in (heads_op, pair_op))
    model.train_ops = model.train_ops or TorchOps()
    model.train_ops.fused_heads = heads_op if heads else None
    model.train_ops.fused_head_pair = pair_op if heads and pairs_heads(cfg, device) else None
    model.train_ops.fused_output = fused_attention_output if output else None


def set_sum_in_product(model: GPT, cfg: RunConfig) -> None:
    """Each block's input added in its attention's output product (`residual_in_product`),
    where the scales fold (else the sum needs the scale first)."""
    if cfg.train.residual_in_product and model.fold_output_scales:
        model.train_ops = model.train_ops or TorchOps()
        model.train_ops.sum_in_product = True


def fp8_kinds(cfg: RunConfig) -> tuple[str, ...]:
    """The kinds of products (`model.ops.TorchOps.product`) asked for in float8."""
    return tuple(kind for kind, on in (("attention", cfg.train.fp8_attention), ("mlp", cfg.train.fp8_mlp)) if on)


def fp8_products_on(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the training step runs some products in float8: asked for, and where they run."""
    return bool(fp8_kinds(cfg)) and fp8_available(device)


def micro_batches_per_pass_for(cfg: RunConfig, world_size: int, accum: int, device: torch.device) -> int:
    """How many of a step's micro-batches run as one forward and backward: the setting, or
    for 0 on CUDA the most (a divisor of accum) whose activations fit in
    TRAIN_MEMORY_FRACTION of the GPU's memory. The micro-batches themselves, and so the data
    and the gradient, do not change: the sampler still draws grad_accum_steps of them."""
    chosen = cfg.train.micro_batches_per_pass
    if chosen > 0:
        if accum % chosen:
            raise ConfigError(f"micro_batches_per_pass={chosen} must divide grad_accum_steps={accum}")
        return chosen
    if device.type != "cuda":
        return 1
    micro_tokens = cfg.train.train_batch_tokens // (world_size * accum)
    budget = torch.cuda.get_device_properties(device).total_memory * TRAIN_MEMORY_FRACTION
    fused = fused_loss_on(cfg, device)
    per_token = training_bytes_per_token(cfg.model, fused, fused and cfg.train.loss_chunk_rows > 0)
    fitting = int(budget // (micro_tokens * per_token))
    return max(d for d in range(1, accum + 1) if accum % d == 0 and d <= max(fitting, 1))


def check_batch_divides(cfg: RunConfig, world_size: int, accum: int) -> None:
    """The loader takes train_batch_tokens / (world_size * accum) tokens per micro-batch in
    whole sequences: refuse a batch that would silently shrink."""
    t = cfg.train
    for seq_len in {t.train_seq_len, t.train_seq_len_long or t.train_seq_len}:
        unit = world_size * accum * seq_len
        if t.train_batch_tokens % unit:
            lower = max(unit, t.train_batch_tokens // unit * unit)
            raise ConfigError(f"train_batch_tokens={t.train_batch_tokens} is not a multiple of world size "
                              f"{world_size} x grad_accum_steps {accum} x sequence length {seq_len} = {unit} "
                              f"(e.g. {lower} or {lower + unit})")


def rank_seq_len(cfg: RunConfig, ctx: DistContext) -> int:
    t = cfg.train
    long_rank = t.train_seq_len_long > 0 and ctx.rank >= ctx.world_size - t.num_gpus_long
    return t.train_seq_len_long if long_rank else t.train_seq_len


@dataclass
class RunInputs:
    """The shards and tokenizer a configuration names, found and checked."""

    train_files: list[Path]
    val_files: list[Path]
    tokenizer: Path
    vocab_size: int
    tokenizer_sha256: str


def find_inputs(cfg: RunConfig) -> RunInputs:
    """Check that the data and tokenizer exist and fit the model, before anything is built."""
    if not cfg.data.data_path:
        raise ConfigError("--data DATA_DIR is required")
    data_dir = Path(cfg.data.data_path)
    manifest = verify_data(data_dir, hash_splits=("val",))
    train_files = manifest.shards("train")
    tokenizer = Path(cfg.data.tokenizer_path) if cfg.data.tokenizer_path else manifest.tokenizer
    if not tokenizer.is_file():
        raise DataError(f"{tokenizer}: no such tokenizer file")
    tokenizer_sha256 = sha256_file(tokenizer)
    if tokenizer_sha256 != manifest.tokenizer_sha256:
        raise DataError(f"{tokenizer}: not the tokenizer {data_dir}'s shards were encoded with (its manifest "
                        f"records sha256 {manifest.tokenizer_sha256[:16]}...)")
    val_files = manifest.shards("val")
    vocab = tokenizer_vocab_size(tokenizer)
    if vocab != cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer {tokenizer} has {vocab} tokens but vocab_size={cfg.model.vocab_size}")
    return RunInputs(train_files, val_files, tokenizer, vocab, tokenizer_sha256)


def data_vocab_size(cfg: RunConfig) -> int | None:
    """The vocabulary of the tokenizer cfg's data was encoded with (the one its manifest
    names, or cfg's tokenizer_path); None where they cannot be read (`find_inputs` then
    says why, before anything is built)."""
    try:
        manifest = read_manifest(Path(cfg.data.data_path))
        tokenizer = Path(cfg.data.tokenizer_path) if cfg.data.tokenizer_path else manifest.tokenizer
        return tokenizer_vocab_size(tokenizer) if tokenizer.is_file() else None
    except (DataError, OSError, RuntimeError):
        return None


def build_setup(cfg: RunConfig, ctx: DistContext) -> Setup:
    data_dir = Path(cfg.data.data_path)
    inputs = find_inputs(cfg)
    train_files, tokenizer = inputs.train_files, inputs.tokenizer
    meta = Path(cfg.data.tokenizer_meta_path) if cfg.data.tokenizer_meta_path else None
    luts = load_byte_luts(tokenizer, meta, cfg.model.vocab_size).to(ctx.device)
    val_seq_len = max(cfg.train.train_seq_len, cfg.eval.eval_seq_len)
    val_tokens = load_validation_tokens(data_dir, val_seq_len, cfg.model.vocab_size, inputs.val_files)
    accum = grad_accum_steps_for(cfg, ctx.world_size)
    check_batch_divides(cfg, ctx.world_size, accum)
    per_pass = micro_batches_per_pass_for(cfg, ctx.world_size, accum, ctx.device)

    # float32 weights, gradients, two Adam moments (or Muon's momentum), EMA and SWA
    check_fits(cfg.model, ctx.device, TRAINING_BYTES_PER_PARAMETER, "train")
    seed_everything(cfg.train.seed)
    enable_fast_math(ctx.device)
    model = build_model(cfg.model, ctx.device)
    model.set_attention_backend(cfg.train.attn_backend, ctx.device, training=True)
    if cfg.train.copy_kv_heads != "off":
        model.copy_kv_heads()
    model.fused_loss = fused_loss_on(cfg, ctx.device)
    model.fold_output_scales = fold_output_scales_on(cfg, ctx.device)
    model.stack_qkv = stack_qkv_on(cfg, ctx.device)
    model.loss_chunk_rows = cfg.train.loss_chunk_rows
    products = fused_mlp_products(cfg, ctx.device)
    if products is not None:
        from ..model.fused_train_ops import ProductEpilogueOps  # imports Triton: only when used

        model.train_ops = ProductEpilogueOps(products=products, keep_activation=cfg.train.keep_mlp_activation != "off")
    elif fp8_products_on(cfg, ctx.device):
        model.train_ops = Fp8Ops(fp8_kinds(cfg), mlp_kernels=cfg.train.fp8_mlp_kernels and triton_available(ctx.device))
    set_fused_ops(model, cfg, ctx.device)
    set_sum_in_product(model, cfg)
    if cfg.train.qat_start_fraction > 0:  # the grids quantize will round the matrices to
        grids = bank_grids(QuantPlan.from_config(cfg.quant), dict(model.named_parameters()), cfg.model.num_layers)
        model.weight_grids = grids if any(grids) else None
    compile_model = cfg.train.compile and ctx.device.type == "cuda"
    forward = compiled(model, compile_model, tuning=cfg.train.compile_tuning, mix_order=cfg.train.compile_mix_order,
                       multi_kernel=cfg.train.compile_multi_kernel)
    return Setup(
        cfg=cfg, ctx=ctx, model=model, forward=forward, compiled=compile_model,
        optimizers=build_optimizers(model, cfg.optim),
        averages=WeightAverages(model, cfg.train.ema_decay, cfg.train.ema_warmup), luts=luts, val_tokens=val_tokens,
        train_files=train_files, tokenizer_sha256=inputs.tokenizer_sha256,
        grad_accum_steps=accum, seq_len=rank_seq_len(cfg, ctx), tokenizer=tokenizer, micro_batches_per_pass=per_pass,
    )


def _on_cpu(value: Any) -> Any:
    """value (dicts, lists and tuples of tensors and the like) with every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


class Trainer:
    def __init__(self, setup: Setup, out_dir: Path, log: RunLog, progress: Callable[[dict], None] | None = None,
                 phases: Phases | None = None):
        self.s, self.out_dir, self.log, self.progress = setup, out_dir, log, progress
        self.phases = phases or Phases()  # where the time outside the training steps goes
        self.graphs_before_loop = 0
        t = setup.cfg.train
        self.wallclock_ms = 1000.0 * t.max_wallclock_seconds if t.max_wallclock_seconds > 0 else None
        # GPTQ calibration counts as training: under a cap, training leaves it this much time.
        self.gptq_reserve_ms = 0.0
        if setup.cfg.quant.use_gptq and self.wallclock_ms is not None:
            self.gptq_reserve_ms = 1000.0 * setup.cfg.quant.gptq_reserve_seconds
            self.wallclock_ms -= self.gptq_reserve_ms
        data_seed = t.data_seed if t.data_seed >= 0 else t.seed
        self.stream = TokenStream(setup.train_files, data_seed, setup.ctx.rank, setup.ctx.world_size,
                                  setup.cfg.model.vocab_size)
        self.step = 0
        self.training_time_ms = 0.0
        self.stop_after_step: int | None = None

    # --- one optimizer step ---

    def _optimizer_step(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], scale: float,
                        passes: int | None = None) -> torch.Tensor:
        s = self.s
        opt = s.optimizers
        opt.zero_grad()
        train_loss = torch.zeros((), device=s.ctx.device)
        # Each pass is micro_batches_per_pass micro-batches of equal size, so the mean of
        # the passes' mean losses is the step's mean loss.
        for _ in range(passes or s.passes_per_step):
            with phase(PHASES.data):
                x, y = next_batch()
            with phase(PHASES.forward), autocast(s.ctx.device):
                loss = s.forward(x, y)
            train_loss += loss.detach()
            with phase(PHASES.backward):
                (loss / s.passes_per_step).backward()
        train_loss /= s.passes_per_step
        opt.set_muon_momentum(muon_momentum_at(self.step, s.cfg.optim))
        opt.set_lr_scale(scale)
        if s.cfg.optim.grad_clip_norm > 0:
            with phase(PHASES.grad_clip):
                torch.nn.utils.clip_grad_norm_(s.model.parameters(), s.cfg.optim.grad_clip_norm)
        # Bank gradients travel while the replicated ones are averaged and Adam steps.
        with phase(PHASES.muon):
            opt.muon.launch_reduce_scatters()
        with phase(PHASES.grad_sync):
            average_gradients(opt.replicated)
        with phase(PHASES.adam):
            opt.step_adams()
        with phase(PHASES.muon):
            opt.muon.step()
        opt.zero_grad()
        return train_loss

    def train_step(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
        """One optimizer step and its EMA update; the step's mean training loss (on the device)."""
        train_loss = self._optimizer_step(next_batch, scale)
        with phase(PHASES.ema):
            self.s.averages.update_ema(self.s.model, self.step)
        self.step += 1
        return train_loss

    def warm_up(self) -> None:
        """Run warmup_steps real steps (compilation, allocator) and restore the initial
        weights, optimizer state and data stream: they change nothing but speed. Each takes
        one forward and backward: every pass has the same shape and runs the same graphs, so
        a step's other passes would only spend time. Meanwhile threads build the window
        attention's Triton kernels: the builds wait on compiler processes while the first
        step compiles, and are done long before its graph first runs them."""
        s, t = self.s, self.s.cfg.train
        builds = window_kernel_builds(s.cfg.model, s.model.attention_backend, s.seq_len, s.ctx.device,
                                      eager=not s.compiled, backward=True)
        with self.phases.timed("warmup", sync=s.ctx.device), threads_meanwhile(builds, s.ctx.device):
            if t.warmup_steps > 0:
                self._warm_up_steps_without_failing_auto(t.warmup_steps)

    def _warm_up_steps_without_failing_auto(self, steps: int) -> None:
        """The warm-up's steps; where `fused_mlp auto` chose quack's products and quack cannot
        build or run them here (it loads, but an install it was not built for can still fail
        at the first product), the compiler's MLP instead, said in the log: auto never ends a
        run that `--fused-mlp off` would train. A named `--fused-mlp quack` stays an error."""
        s = self.s
        try:
            self._warm_up_steps(steps)
        except QuackUnavailable as error:
            if s.cfg.train.fused_mlp != "auto":
                raise
            self.log.line(f"fused_mlp: auto leaves quack's products ({error.detail}); the compiler's MLP instead")
            s.model.train_ops = None
            set_fused_ops(s.model, s.cfg, s.ctx.device)  # the other fused ops stay as asked
            s.model.zero_grad(set_to_none=True)  # the failed step's partial gradients
            self._warm_up_steps(steps)

    def _warm_up_steps(self, steps: int) -> None:
        s = self.s
        model_state = {k: v.detach().clone() for k, v in s.model.state_dict().items()}
        optimizer_state = copy.deepcopy(s.optimizers.state_dict())
        stream_state = self.stream.state_dict()
        try:
            self._run_warm_up_steps(steps)
        finally:  # a warm-up step that failed part way leaves nothing either
            s.model.load_state_dict(model_state, strict=True)
            s.optimizers.load_state_dict(optimizer_state)
            self.stream.load_state_dict(stream_state)

    def _run_warm_up_steps(self, steps: int) -> None:
        s = self.s
        # With switches turned on part way (depth recurrence, rounding to the grid) or off to
        # validate (float8 products), the warm-up's steps run each state the run will take in
        # equal shares: every graph compiles here, none in training.
        states = switch_states(self._switch_fractions(), self._validation_off())
        if steps < len(states):
            self.log.line(f"warmup: {steps} steps run {steps} of the {len(states)} states the run's passes take "
                          "(--warmup-steps); the others compile during training")
        for i in range(steps):
            for name, on in states[i * len(states) // steps].items():
                setattr(s.model, name, on)
            self._optimizer_step(self._direct_batch, 1.0, passes=1)
            if steps <= 20 or (i + 1) % 10 == 0 or i + 1 == steps:
                self.log.line(f"warmup_step:{i + 1}/{steps}")
        for name in self._validation_off():  # on throughout training (the fractions' switches are set by the loop)
            setattr(s.model, name, True)

    def _switch_fractions(self) -> dict[str, float]:
        """The model's switches this run turns on part way, with the fraction of its budget at
        which each turns on."""
        m, t = self.s.cfg.model, self.s.cfg.train
        fractions = {}
        if m.recur_layers and m.recur_count > 1 and t.recur_start_fraction > 0:
            fractions[RECURRING] = t.recur_start_fraction
        if t.qat_start_fraction > 0 and self.s.model.weight_grids is not None:
            fractions[ROUNDING] = t.qat_start_fraction
        return fractions

    def _validation_off(self) -> tuple[str, ...]:
        """The switches on throughout training that validation turns off: the training
        forward's ops where they change its numbers (float8 products), so that validation
        scores the model as eval will."""
        return (TRAIN_OPS,) if isinstance(self.s.model.train_ops, Fp8Ops) else ()

    def _passed(self, fraction: float, elapsed_ms: float) -> bool:
        """Whether `fraction` of the wallclock budget (under a cap) or of the iterations has passed."""
        if self.wallclock_ms:
            return elapsed_ms >= fraction * self.wallclock_ms
        return self.step >= fraction * self.s.cfg.train.iterations

    def _set_switches(self, elapsed_ms: float, last_step: bool = False, quiet: bool = False) -> None:
        """Each switch on once its fraction has passed (recurrence also at the last step, which
        validates the model as it scores), each change logged."""
        for name, fraction in self._switch_fractions().items():
            on = self._passed(fraction, elapsed_ms) or (last_step and name == RECURRING)
            if getattr(self.s.model, name) == on:
                continue
            setattr(self.s.model, name, on)
            if not quiet:
                self.log.line(f"{SWITCH_LOG_NAMES[name]}:{'on' if on else 'off'} step:{self.step}"
                              + (self._loop_text() if name == RECURRING else ""))

    def _loop_text(self) -> str:
        m = self.s.cfg.model
        return f" layers:{','.join(map(str, m.recur_layers))} count:{m.recur_count}"

    @contextlib.contextmanager
    def _as_validated(self) -> Iterator[None]:
        """The model as validation sees it (validation, EMA, samples): its weights as they
        are, not rounded to their grids, and the switches of `_validation_off` off."""
        model = self.s.model
        names = (ROUNDING, *self._validation_off())
        before = {name: getattr(model, name) for name in names}
        for name in names:
            setattr(model, name, False)
        try:
            yield
        finally:
            for name, on in before.items():
                setattr(model, name, on)

    def _direct_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        x, y = self.stream.next_pass(s.cfg.train.train_batch_tokens, s.seq_len, s.grad_accum_steps,
                                     s.micro_batches_per_pass)
        return x.to(s.ctx.device), y.to(s.ctx.device)

    # --- validation ---

    def validate(self) -> tuple[float, float]:
        """val_loss and val_bpb; a compiled model validates through its training graph, in
        batches of a training micro-batch's shape, so that no second graph is compiled."""
        s, t = self.s, self.s.cfg.train
        training_graph = s.compiled and s.seq_len == t.train_seq_len
        if training_graph:
            local_batch_tokens = t.train_batch_tokens // (s.ctx.world_size * s.passes_per_step)
        else:
            local_batch_tokens = t.val_batch_size // (s.ctx.world_size * s.grad_accum_steps)
        with self.phases.timed("validation", sync=s.ctx.device), self._as_validated():
            result = evaluate_standard(s.forward, s.val_tokens, s.luts, seq_len=t.train_seq_len,
                                       batch_tokens=local_batch_tokens, device=s.ctx.device,
                                       rank=s.ctx.rank, world_size=s.ctx.world_size, training_graph=training_graph)
        s.model.train()
        return result.val_loss, result.val_bpb

    # --- checkpoints ---

    def checkpoint(self, prefetcher: Prefetcher | None) -> Path:
        """Rank 0 writes RUN_DIR/checkpoint.pt; every rank takes part (Muon's momentum
        shards and every rank's loader state are gathered) and waits until it is on disk."""
        with self.checkpoint_written_meanwhile(prefetcher) as path:
            pass
        return path

    @contextlib.contextmanager
    def checkpoint_written_meanwhile(self, prefetcher: Prefetcher | None) -> Iterator[Path]:
        """`checkpoint`, its file written by a thread while the block runs: the state is
        copied to the CPU first, so the block may change the model; on leaving the block
        the write is waited for (its error raised) and every rank waits for it too."""
        with self.phases.timed("checkpoint"):
            contents = self._checkpoint_contents(prefetcher)
        path = self.out_dir / CHECKPOINT_FILENAME
        with ThreadPoolExecutor(max_workers=1) as writer:
            written = writer.submit(save_checkpoint, path, contents) if contents is not None else None
            try:
                yield path
            finally:
                with self.phases.timed("checkpoint"):
                    if written is not None:
                        written.result()
        barrier()  # no rank stops or goes on before the checkpoint exists

    def _checkpoint_contents(self, prefetcher: Prefetcher | None) -> Checkpoint | None:
        """What rank 0 writes, all on the CPU (None on the other ranks); every rank takes part."""
        s = self.s
        loader_state = prefetcher.state_dict() if prefetcher is not None else self.stream.state_dict()
        # Ranks with a longer sequence length draw differently from their stream: keep each rank's.
        loaders = gather_from_ranks(loader_state)
        optimizer_state = s.optimizers.state_dict()
        if not s.ctx.is_main:
            return None
        rng = {"torch": torch.get_rng_state()}
        if s.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(s.ctx.device)
        return Checkpoint(
            config=s.cfg, model={k: v.detach().cpu().clone() for k, v in s.model.state_dict().items()},
            ema=s.averages.ema_state(), swa=s.averages.swa_state(), swa_count=s.averages.swa_count,
            step=self.step, training_time_ms=self.training_time_ms, tokenizer_sha256=s.tokenizer_sha256,
            state={"optimizers": _on_cpu(optimizer_state), "loaders": loaders, "rng": rng,
                   "stop_after_step": self.stop_after_step, "world_size": s.ctx.world_size},
        )

    def restore(self, ckpt: Checkpoint) -> None:
        s = self.s
        if ckpt.state.get("world_size", 1) != s.ctx.world_size:
            raise ConfigError(f"the checkpoint was written by {ckpt.state.get('world_size')} process(es); "
                              f"resume it with the same number")
        steps = gather_from_ranks(ckpt.step)
        if len(set(steps)) > 1:
            raise ConfigError(f"the ranks read checkpoints of different steps {steps}: the run directory must be "
                              "on a filesystem that every host shares")
        s.model.load_state_dict({k: v.to(s.ctx.device) for k, v in ckpt.model.items()}, strict=True)
        s.optimizers.load_state_dict(ckpt.state["optimizers"])
        s.averages.load(ckpt.ema, ckpt.swa, ckpt.swa_count)
        self.stream.load_state_dict(ckpt.state["loaders"][s.ctx.rank])
        torch.set_rng_state(ckpt.state["rng"]["torch"])
        if "cuda" in ckpt.state["rng"] and s.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(ckpt.state["rng"]["cuda"], s.ctx.device)
        self.step, self.training_time_ms = ckpt.step, ckpt.training_time_ms
        self.stop_after_step = ckpt.state.get("stop_after_step")

    # --- the loop ---

    def run(self, stop_at_step: int | None, stops: StopRequests) -> TrainResult:
        s, t = self.s, self.s.cfg.train
        device = s.ctx.device
        prefetcher = Prefetcher(self.stream, t.train_batch_tokens, s.seq_len, s.grad_accum_steps, device,
                                per_pass=s.micro_batches_per_pass)
        tokens_per_step = t.train_batch_tokens
        last_val: tuple[float, float] | None = None
        if self.gptq_reserve_ms > 0:
            self.log.line(f"gptq:reserving {self.gptq_reserve_ms:.0f}ms from training budget, "
                          f"effective={self.wallclock_ms:.0f}ms")
        if t.qat_start_fraction > 0:
            self.log.line(qat_text(s.model.weight_grids))
        if (t.fused_cross_entropy or t.loss_chunk_rows) and not s.model.fused_loss:
            asked = "fused_cross_entropy" if t.fused_cross_entropy else "loss_chunk_rows"
            self.log.line(f"{asked}: off on this device (its kernels need CUDA and Triton)")
        if t.fused_mlp in ("triton", "quack") and s.model.train_ops is None:
            needs = ("Triton and a GPU with TMA, Hopper or later" if t.fused_mlp == "triton"
                     else "a Hopper or Blackwell GPU")
            self.log.line(f"fused_mlp: off on this device (its {t.fused_mlp} products need {needs})")
        if t.stack_qkv == "qk" and stacked_as(s.model) != "qk":
            self.log.line("stack_qkv: on, not qk (the queries' and keys' steps run as one op only where the fused "
                          "heads' op runs: fused_head_prep, CUDA and Triton)")
        if fp8_kinds(s.cfg) and s.model.train_ops is None:
            asked = " and ".join(f"fp8_{kind}" for kind in fp8_kinds(s.cfg))
            self.log.line(f"{asked}: off on this device (float8 products need a GPU of compute capability 8.9 or "
                          "later)")
        self._set_switches(self.training_time_ms, quiet=True)  # where training stands (a resumed run may be past them)
        self.graphs_before_loop = compiled_graphs()
        try:
            synchronize(device)
            t0 = time.perf_counter()
            while True:
                last_step = self.step == t.iterations or (
                    self.stop_after_step is not None and self.step >= self.stop_after_step)
                self._set_switches(self.training_time_ms + 1000.0 * (time.perf_counter() - t0), last_step)
                if last_step or (t.val_loss_every > 0 and self.step % t.val_loss_every == 0):
                    synchronize(device)
                    self.training_time_ms += 1000.0 * (time.perf_counter() - t0)
                    last_val = self.validate()
                    self._check_finite(last_val[0], "validation loss")
                    self._log_validation(*last_val)
                    synchronize(device)
                    t0 = time.perf_counter()
                if last_step:
                    if self.stop_after_step is not None and self.step < t.iterations:
                        self.log.line(f"stopping_early: wallclock_cap train_time:{self.training_time_ms:.0f}ms "
                                      f"step:{self.step}/{t.iterations}")
                    break
                elapsed_ms = self.training_time_ms + 1000.0 * (time.perf_counter() - t0)
                scale = lr_scale(self.step, elapsed_ms, t, self.wallclock_ms)
                train_loss = self.train_step(prefetcher.next, scale)
                approx_ms = self.training_time_ms + 1000.0 * (time.perf_counter() - t0)
                if t.swa_enabled and scale < SWA_LR_THRESHOLD and self.step % t.swa_every == 0:
                    if s.averages.swa_count == 0:
                        self.log.line(f"swa:start step:{self.step}")
                    s.averages.add_swa_snapshot(s.model)
                if t.train_log_every > 0 and (self.step <= 10 or self.step % t.train_log_every == 0
                                              or self.stop_after_step is not None):
                    loss = self._check_finite(self._global_mean(train_loss), "training loss")
                    self._log_train(loss, approx_ms, scale, tokens_per_step)
                if t.sample_every > 0 and self.step % t.sample_every == 0 and s.ctx.is_main:
                    synchronize(device)  # sampling time is not training time
                    self.training_time_ms += 1000.0 * (time.perf_counter() - t0)
                    self._log_sample()
                    t0 = time.perf_counter()
                if self.progress is not None:
                    self.progress({"step": self.step, "iterations": t.iterations, "loss": train_loss,
                                   "tokens_per_s": tokens_per_step * self.step / max(approx_ms / 1000.0, 1e-9),
                                   "elapsed_ms": approx_ms, "wallclock_ms": self.wallclock_ms})
                reached_cap, interrupted = self._agree_on_stop(approx_ms, stops.requested)
                if self.stop_after_step is None and reached_cap:
                    self.stop_after_step = self.step
                asked_to_pause = stop_at_step is not None and stop_at_step < t.iterations and self.step >= stop_at_step
                pause = interrupted or asked_to_pause
                periodic = t.checkpoint_every > 0 and self.step % t.checkpoint_every == 0
                if pause or periodic:
                    self._check_finite(self._global_mean(train_loss), "training loss")  # never save such weights
                    synchronize(device)
                    self.training_time_ms += 1000.0 * (time.perf_counter() - t0)
                    path = self.checkpoint(prefetcher)
                    if periodic and t.keep_checkpoints and s.ctx.is_main:
                        self.log.line(f"checkpoint:kept step:{self.step} path:"
                                      f"{keep_checkpoint(self.out_dir, self.step, t.keep_checkpoints)}")
                    if pause:
                        why = "interrupted" if interrupted else "stop-at-step"
                        self.log.line(f"checkpoint:{why} step:{self.step}/{t.iterations} path:{path}")
                        return TrainResult(self.step, self.training_time_ms, finished=False, checkpoint=path,
                                           interrupted=interrupted, stop_signal=stops.signal)
                    t0 = time.perf_counter()
        finally:
            prefetcher.close()
        return self._finish(prefetcher, last_val)

    def _check_finite(self, value: float, what: str) -> float:
        if not math.isfinite(value):
            raise TrainingDiverged(f"the {what} is {value} at step {self.step}: training diverged (try a lower "
                                   "learning rate); the last checkpoint, if any, is unchanged")
        return value

    def _global_mean(self, local_loss: torch.Tensor) -> float:
        """The loss over the whole global batch, not only rank 0's share of it (every rank
        logs on the same steps, so every rank takes part)."""
        if not self.s.ctx.distributed:
            return local_loss.item()
        return all_reduce_(local_loss.detach().clone(), op="sum").item() / self.s.ctx.world_size

    def _agree_on_stop(self, approx_ms: float, interrupted: bool) -> tuple[bool, bool]:
        reached_cap = self.wallclock_ms is not None and approx_ms >= self.wallclock_ms
        if not self.s.ctx.distributed:
            return reached_cap, interrupted
        flags = torch.tensor([int(reached_cap), int(interrupted)], device=self.s.ctx.device)
        all_reduce_(flags, op="max")
        return bool(flags[0].item()), bool(flags[1].item())

    def _finish(self, prefetcher: Prefetcher, last_val: tuple[float, float] | None) -> TrainResult:
        s = self.s
        recompiled = compiled_graphs() - self.graphs_before_loop
        if s.compiled:
            self.log.line(f"compile:graphs_after_warmup:{recompiled}")
        if s.ctx.device.type == "cuda":
            self.log.line(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 1024 // 1024} MiB "
                          f"reserved: {torch.cuda.max_memory_reserved() // 1024 // 1024} MiB")
        s.model.rounding_weights = False  # what follows (EMA, calibration) sees the weights themselves
        # The checkpoint's file is written while the EMA weights are scored and calibrated.
        with self.checkpoint_written_meanwhile(prefetcher) as path:
            live = {k: v.detach().clone() for k, v in s.model.state_dict().items()}
            self.log.line("ema:applying EMA weights")
            ema = {k: v.to(live[k].dtype) for k, v in zip(s.averages.names, s.averages.ema)}
            s.model.load_state_dict(ema, strict=True)
            synchronize(s.ctx.device)
            t_eval = time.perf_counter()
            ema_loss, ema_bpb = self.validate()
            synchronize(s.ctx.device)
            self.log.line(f"DIAGNOSTIC post_ema val_loss:{ema_loss:.4f} val_bpb:{ema_bpb:.4f} "
                          f"eval_time:{1000.0 * (time.perf_counter() - t_eval):.0f}ms")
            self.log.metrics(step=self.step, post_ema_val_loss=ema_loss, post_ema_val_bpb=ema_bpb)
            calibration = self.calibrate_gptq(ema) if s.cfg.quant.use_gptq else None
            s.model.load_state_dict(live, strict=True)
        val_loss, val_bpb = last_val if last_val is not None else (None, None)
        return TrainResult(self.step, self.training_time_ms, finished=True, val_loss=val_loss, val_bpb=val_bpb,
                           post_ema_val_loss=ema_loss, post_ema_val_bpb=ema_bpb, checkpoint=path,
                           calibration=calibration, devices=gather_from_ranks(device_name(s.ctx.device)),
                           graphs_compiled_in_training=recompiled, kernels=step_kernels(s.model))

    def calibrate_gptq(self, ema: dict[str, torch.Tensor]) -> dict[str, Any]:
        """GPTQ's Hessians from training batches under the EMA weights (loaded in the model),
        as the reference collects them in its reserve; rank 0 writes RUN/hessians.safetensors."""
        s, q = self.s, self.s.cfg.quant
        self.log.line(f"gptq:calibrating with {q.gptq_calib_samples} batches (training data)...")
        with self.phases.timed("calibration"):
            calibration = calibrate(s.model, s.cfg, s.train_files, s.ctx.device, rank=s.ctx.rank,
                                    world_size=s.ctx.world_size)
        total_ms = self.training_time_ms + 1000.0 * calibration.seconds
        self.log.line(f"gptq:calibrated {calibration.layers} layers in {calibration.seconds:.1f}s "
                      f"({calibration.batches} batches, {calibration.tokens} tokens)")
        overran = self.gptq_reserve_ms > 0 and 1000.0 * calibration.seconds > self.gptq_reserve_ms
        if overran:
            self.log.line(f"gptq:calibration overran its reserve of {self.gptq_reserve_ms:.0f}ms: "
                          f"training+calibration={total_ms:.0f}ms, "
                          f"max_wallclock={self.wallclock_ms + self.gptq_reserve_ms:.0f}ms")
        if s.ctx.is_main:
            calibration.step, calibration.weights_sha256 = self.step, tensors_sha256(ema)
            save_hessians(self.out_dir / HESSIANS_FILENAME, calibration)
        barrier()
        return {"seconds": round(calibration.seconds, 3), "batches": calibration.batches,
                "tokens": calibration.tokens, "layers": calibration.layers, "world_size": s.ctx.world_size,
                "reserve_seconds": self.gptq_reserve_ms / 1000.0 if self.gptq_reserve_ms > 0 else None,
                "overran_reserve": overran, "hessians": HESSIANS_FILENAME}

    def _log_train(self, loss: float, approx_ms: float, scale: float, tokens_per_step: int) -> None:
        t = self.s.cfg.train
        step_avg = approx_ms / max(self.step, 1)
        self.log.line(f"step:{self.step}/{t.iterations} train_loss:{loss:.4f} "
                      f"train_time:{approx_ms:.0f}ms step_avg:{step_avg:.2f}ms")
        self.log.metrics(step=self.step, train_loss=loss, train_time_ms=round(approx_ms, 1),
                         step_avg_ms=round(step_avg, 2), lr_scale=scale,
                         tokens_per_s=round(tokens_per_step / max(step_avg / 1000.0, 1e-9)))

    def _log_sample(self) -> None:
        from ..generate.decoding import greedy_sample

        with self._as_validated():  # the model as validation sees it
            text = greedy_sample(self.s.model, self.s.tokenizer, self.s.cfg.train.sample_prompt)
        self.log.line(f"sample step:{self.step} {self.s.cfg.train.sample_prompt + text!r}")

    def _log_validation(self, val_loss: float, val_bpb: float) -> None:
        t = self.s.cfg.train
        step_avg = self.training_time_ms / max(self.step, 1)
        self.log.line(f"step:{self.step}/{t.iterations} val_loss:{val_loss:.4f} val_bpb:{val_bpb:.4f} "
                      f"train_time:{self.training_time_ms:.0f}ms step_avg:{step_avg:.2f}ms")
        self.log.metrics(step=self.step, val_loss=val_loss, val_bpb=val_bpb,
                         train_time_ms=round(self.training_time_ms, 1))


def step_kernels(model: GPT) -> dict[str, str]:
    """What the training step runs where a setting may be auto: the attention's kernels (the
    first layer's backend), whose products the fused MLP runs (and whether quack's keep the
    forward's activation), whether the scales fold, whether windowed layers take copied key
    heads, whether q, k and v are one product, whether the heads' steps and XSA are fused
    ops, whether the block's input joins the attention's output product."""
    products = getattr(model.train_ops, "products", None)
    return {"attn_backend": model.blocks[0].attn.backend,
            "fused_mlp": products or "off",
            "keep_mlp_activation": "on" if products == "quack" and model.train_ops.keep_activation else "off",
            "fold_output_scales": "on" if model.fold_output_scales else "off",
            "copy_kv_heads": "on" if any(block.attn.kv_copies > 1 for block in model.blocks) else "off",
            "stack_qkv": stacked_as(model),
            "fused_head_prep": heads_as(getattr(model.train_ops, "fused_heads", None)),
            "fused_xsa": "on" if getattr(model.train_ops, "fused_output", None) is not None else "off",
            "residual_in_product": "on" if getattr(model.train_ops, "sum_in_product", False) else "off"}


def heads_as(fused_heads) -> str:
    """How the training step's heads' op runs (`fused_head_prep`): off, on, or apart (the
    forward's rotated channels in a block of their own)."""
    if fused_heads is None:
        return "off"
    return "apart" if getattr(fused_heads, "keywords", {}).get("rotated_apart") else "on"


def stacked_as(model: GPT) -> str:
    """How the training step makes q, k and v (`stack_qkv`): off (three products), on (one),
    qk (one, the queries' and keys' steps one op)."""
    if not model.stack_qkv:
        return "off"
    return "qk" if getattr(model.train_ops, "fused_head_pair", None) is not None else "on"


def describe(setup: Setup, log: RunLog) -> None:
    """The reference's preamble: what was built and how it will train (every rank calls
    it, since it gathers each rank's sequence length)."""
    cfg, model, ctx = setup.cfg, setup.model, setup.ctx
    if setup.tokenizer is not None and not has_byte_fallback(load_sentencepiece(setup.tokenizer)):
        log.line(f"warning: {no_byte_fallback_warning(setup.tokenizer)}")
    log.line(f"model_params:{sum(p.numel() for p in model.parameters())}")
    log.line(f"XSA:last_{cfg.model.xsa_last_n} active_layers:{[b.attn.layer for b in model.blocks if b.attn.use_xsa]}")
    windows = [b.attn.layer for b in model.blocks if b.attn.window > 0]
    if windows:
        sinks = f" sink_tokens={cfg.model.num_sink_tokens}" if cfg.model.num_sink_tokens > 0 else ""
        log.line(f"window_attn:size={cfg.model.window_attn_size} layers:{windows}{sinks}")
    kernels = step_kernels(model)
    log.line(f"world_size:{ctx.world_size} grad_accum_steps:{setup.grad_accum_steps} "
             f"micro_batches_per_pass:{setup.micro_batches_per_pass} device:{ctx.device} "
             f"attn_backend:{kernels['attn_backend']}")
    log.line(" ".join(f"{name}:{kernels[name]}" for name in
                      ("fused_mlp", "keep_mlp_activation", "fold_output_scales", "copy_kv_heads",
                       "stack_qkv", "fused_head_prep", "fused_xsa", "residual_in_product")))
    log.line(f"rank_seq_lens:{gather_from_ranks(setup.seq_len)}")
    log.line(f"train_batch_tokens:{cfg.train.train_batch_tokens} train_seq_len:{cfg.train.train_seq_len} "
             f"iterations:{cfg.train.iterations} warmup_steps:{cfg.train.warmup_steps} "
             f"max_wallclock_seconds:{cfg.train.max_wallclock_seconds:.3f}")
    log.line(f"seed:{cfg.train.seed} val_tokens:{setup.val_tokens.numel() - 1} train_shards:{len(setup.train_files)}")
