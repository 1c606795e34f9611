"""Shared fixtures. The shared reference material (the reference script, its data) sits
beside the repository, or where `--shared DIR` says."""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]

# One torch thread per test process (and the processes tests start), set before torch is
# imported: the tiny models run fastest so, the more so when several test processes
# (`pytest -n`) share the cores (docs/development.md has the measurements).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that a session fixture builds, built once for all the test processes of a
    `pytest -n` run (the first to ask builds it, under a lock; the others wait and read it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    target, done = root / name, root / f"{name}.done"
    with _locked(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)  # a build that failed half-way
            build(target)
            done.touch()
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shared", type=Path, default=REPO.parent / "shared",
                     help="folder holding seed/ (the reference) and data/ (default: ../shared)")


@pytest.fixture(scope="session")
def shared_dir(pytestconfig: pytest.Config) -> Path:
    shared = pytestconfig.getoption("--shared")
    if not shared.is_dir():
        pytest.skip(f"no shared reference folder at {shared} (pass --shared DIR)")
    return shared.resolve()


# --- A stand-in for FlashAttention-4 ---------------------------------------------------

@pytest.fixture
def fake_fa4(monkeypatch):
    """flash-attn-4's interface as `fake_fa4.FakeFA4` computes it, importable as
    flash_attn.cute.interface."""
    from fake_fa4 import FakeFA4

    interface = types.SimpleNamespace(flash_attn_func=FakeFA4.flash_attn_func,
                                      _flash_attn_bwd=FakeFA4._flash_attn_bwd)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)


# --- Triton's interpreter ---------------------------------------------------------------

def interpret_kernels_without_cuda() -> None:
    """For a test module of Triton kernels, before it imports them: skip the module where
    Triton is not installed; without CUDA, have the kernels run in Triton's interpreter
    (read when a kernel is defined)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed", allow_module_level=True)
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def count_launches(monkeypatch, module, name: str, launches: list[str]) -> None:
    """Record each launch of module's Triton kernel `name` in launches."""
    original = getattr(module, name)

    class Counted:
        def __getitem__(self, grid):
            launches.append(name)
            return original[grid]

    monkeypatch.setattr(module, name, Counted())


def compiled_steps_agree(plain_ops, fused_ops, grads_of) -> None:
    """The compiled step (`compiled_step_on_cuda`) with the training ops plain_ops, then
    fused_ops: the losses within 1e-3, each gradient of grads_of within 2% of its size."""
    (plain, plain_grads), (fused, fused_grads) = compiled_step_on_cuda(
        [lambda model, ops=ops: setattr(model, "train_ops", ops) for ops in (plain_ops, fused_ops)], grads_of)
    assert abs(plain - fused) < 1e-3
    for got, want in zip(fused_grads, plain_grads):
        assert want.abs().amax() > 0
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


def bf16_training_step(model, inputs, targets, ops=None) -> tuple:
    """The model's training loss under bf16 autocast on the CPU, its steps through the
    training ops `ops` (None: torch's), and every parameter's gradient: (loss, {name: grad})."""
    import torch

    model.train()
    model.train_ops = ops
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(inputs, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def within(got, want, tol: float) -> bool:
    """got within tol of want, relative to want's largest value (at least 1)."""
    return bool(((got.float() - want.float()).abs().max() <= tol * want.float().abs().max().clamp(min=1.0)).item())


def training_steps_agree(plain_step: tuple, fused_step: tuple, names, close) -> None:
    """Two `bf16_training_step` results: the losses within 2e-3, the same parameters with
    gradients, and each named one's gradients within 2^-4 by close(got, want, tol)."""
    import torch

    (plain, plain_grads), (fused, fused_grads) = plain_step, fused_step
    assert torch.allclose(plain, fused, atol=2e-3) and plain_grads.keys() == fused_grads.keys()
    for name in names:
        assert close(fused_grads[name], plain_grads[name], 2 ** -4), name


def compiled_step_on_cuda(variants, grads_of, model_changes: dict | None = None,
                          training_backend: bool = False) -> list[tuple[float, list]]:
    """The full-size model's compiled training loss in bf16 autocast at a micro-batch of 8
    sequences, once per variant (a function that sets the model up): (loss, grads_of(model)).
    Every weight is moved off its initialization first: at it the output projections are zero,
    and so are the gradients of every matrix behind them. model_changes: settings of the
    model other than the defaults; training_backend: the attention `auto` picks to train."""
    import dataclasses

    import torch

    from windowgpt_cli.config import RunConfig
    from windowgpt_cli.model.gpt import build_model

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(RunConfig().model, **(model_changes or {})), device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.set_attention_backend("auto", device, training=training_backend)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, 1024, (8, 2048), device="cuda", generator=g)
    y = torch.randint(0, 1024, (8, 2048), device="cuda", generator=g)
    step = torch.compile(model, dynamic=False, fullgraph=True)
    results = []
    for variant in variants:
        variant(model)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(x, y)
        loss.backward()
        results.append((loss.item(), [grad.float().clone() for grad in grads_of(model)]))
    return results


def bank_grads(model) -> list:
    """The gradients of the model's parameter banks (for `compiled_step_on_cuda`)."""
    return [p.grad for name, p in model.named_parameters() if name.endswith("_bank")]


def assert_compiled_record_steps_agree(base, *changes) -> None:
    """The record model (its windows, the attention training picks), compiled, in bf16, after
    base(model) and after each change(model): each change's loss within 1e-3 of base's, its
    parameter banks' gradients within 2% of their size (`compiled_step_on_cuda`)."""
    from windowgpt_cli.challenge import RECORD_WINDOWS

    (loss, grads), *changed = compiled_step_on_cuda([base, *changes], bank_grads, model_changes=RECORD_WINDOWS,
                                                    training_backend=True)
    for changed_loss, changed_grads in changed:
        assert abs(loss - changed_loss) <= 1e-3
        for grad, changed_grad in zip(grads, changed_grads):
            assert (grad - changed_grad).abs().max() <= 0.02 * grad.abs().max()


@pytest.fixture
def interpreter_fixes(monkeypatch):
    """Two gaps of Triton's interpreter that the compiled kernels do not have. It holds a
    scalar as a one-element array, which numpy >= 2.4 no longer turns into an int, so `range`
    over bounds computed in the kernel fails: index through .item(). And its tl.dot
    multiplies bfloat16 operands as their raw 16-bit integers: widen them to float32 first.
    (Test modules whose kernels run interpreted without CUDA ask for it.)"""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    dot = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, *rest: dot(self, widened(a), widened(b), *rest))


# --- Data stages (corpus, tokenizer, prepare) -------------------------------------------

DATA_DEMO_CORPUS = REPO / "data" / "demo" / "gutenberg_1mb.jsonl"
DATA_MULTILINGUAL = (
    "Ça déjà vu: naïve café in Zürich, São Paulo, Kraków. Η γρήγορη καφέ αλεπού. "
    "Съешь же ещё этих мягких булок. 我能吞下玻璃而不伤身体。ガラスを食べられます。유리를 먹을 수 있어요. "
    "🚀🎉👍🏽 def f(x): return {'k': [x[0]]}  # @a_b = 1 2 3 4 5 6 7 8 9 0"
)


@pytest.fixture(scope="session")
def data_demo_corpus() -> Path:
    return DATA_DEMO_CORPUS


@pytest.fixture(scope="session")
def data_bytefallback_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tokenizer with the project's recipe (byte fallback on), trained once per session."""
    from windowgpt_cli.data.corpus import iter_documents
    from windowgpt_cli.data.tokenizer import train_sentencepiece

    texts = [DATA_MULTILINGUAL, *iter_documents(DATA_DEMO_CORPUS)]
    path = tmp_path_factory.mktemp("tokenizer") / "bf512.model"
    path.write_bytes(train_sentencepiece(texts, 512, max_bytes=300_000))
    return path


@pytest.fixture(scope="session")
def data_multiword_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same recipe with pieces that span words (`prepare --no-split-words`)."""
    from windowgpt_cli.data.corpus import iter_documents
    from windowgpt_cli.data.tokenizer import train_sentencepiece
    from windowgpt_cli.data.tokenizer_options import TokenizerOptions

    texts = [DATA_MULTILINGUAL, *iter_documents(DATA_DEMO_CORPUS)]
    path = tmp_path_factory.mktemp("tokenizer") / "words512.model"
    path.write_bytes(train_sentencepiece(texts, 512, max_bytes=300_000, options=TokenizerOptions(split_words=False)))
    return path


@pytest.fixture(scope="session")
def data_fineweb_tokenizer(shared_dir: Path) -> Path:
    """The shared third-party sp1024 tokenizer, which has no byte fallback."""
    path = shared_dir / "data" / "tokenizers" / "fineweb_1024_bpe.model"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


# --- Evaluation fixtures ------------------------------------------------------------------

EVAL_SEQS = 4  # validation sequences of the tiny preset's 128 tokens


@pytest.fixture(scope="session")
def eval_tokenizer(data_fineweb_tokenizer: Path) -> Path:
    """The Parameter Golf 1024-token SentencePiece model (the tiny preset's vocabulary)."""
    return data_fineweb_tokenizer


@pytest.fixture(scope="session")
def eval_luts(eval_tokenizer: Path):
    from windowgpt_cli.data.tokenizer import load_byte_luts

    return load_byte_luts(eval_tokenizer, None, 1024)


@pytest.fixture
def eval_model():
    """The tiny preset's model (CPU, float32) with every weight moved off its initialization."""
    import torch

    from windowgpt_cli.config import tiny_preset
    from windowgpt_cli.model.gpt import build_model

    torch.manual_seed(0)
    model = build_model(tiny_preset().model, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture
def eval_val_tokens():
    """EVAL_SEQS sequences of 128 random tokens, plus the one the last target needs, plus a
    few that the reference's truncation drops."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 1024, (EVAL_SEQS * 128 + 1 + 37,), generator=g).to(torch.uint16)


def index_data_dir(data: Path, tokenizer: Path) -> Path:
    """Give a directory of shards the tokenizer and the manifest every stage requires."""
    from windowgpt_cli.data.prepare import index_data

    index_data(data, tokenizer)
    return data


@pytest.fixture
def eval_data_dir(tmp_path: Path, eval_tokenizer: Path, eval_val_tokens) -> Path:
    """A data directory: one validation shard (eval_val_tokens), a training shard,
    tokenizer.model and the manifest."""
    from windowgpt_cli.data.shards import shard_name, write_shard

    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / shard_name("val", 0), eval_val_tokens.numpy())
    write_shard(data / shard_name("train", 0), eval_val_tokens.numpy())
    return index_data_dir(data, eval_tokenizer)


@pytest.fixture
def eval_run_dir(tmp_path: Path, eval_model, eval_tokenizer: Path) -> Path:
    """A training run directory whose EMA weights are eval_model's, trained with eval_tokenizer."""
    from windowgpt_cli.storage.files import atomic_write_json, sha256_file
    from windowgpt_cli.artifacts.checkpoint import Checkpoint, save_checkpoint
    from windowgpt_cli.config import tiny_preset

    cfg = tiny_preset().resolved()
    run = tmp_path / "run"
    run.mkdir()
    atomic_write_json(run / "config.json", cfg.to_dict())
    weights = {k: v.detach().clone() for k, v in eval_model.state_dict().items()}
    save_checkpoint(run / "checkpoint.pt", Checkpoint(
        config=cfg, model=weights, ema={k: v.clone() for k, v in weights.items()}, swa=None, swa_count=0,
        step=1, training_time_ms=0.0, tokenizer_sha256=sha256_file(eval_tokenizer), state={}))
    return run


# --- Quantization, export and .ptz fixtures ---------------------------------------------

def quant_small_config():
    """The tiny preset widened to 264 so that its attention and MLP matrices (69,696
    elements) and embedding (1024 x 264) are above the 65,536-element passthrough limit."""
    import dataclasses

    from windowgpt_cli.config import tiny_preset

    cfg = tiny_preset()
    model = dataclasses.replace(cfg.model, num_layers=2, model_dim=264, num_heads=4, num_kv_heads=4, mlp_mult=1.0,
                                xsa_last_n=1, ve_layers=(1,), window_attn_layers=(1,))
    train = dataclasses.replace(cfg.train, train_seq_len=64, train_batch_tokens=8 * 2 * 64)
    quant = dataclasses.replace(cfg.quant, gptq_calib_samples=2, quant_passthrough_max_numel=65_536)
    return dataclasses.replace(cfg, model=model, train=train, quant=quant).resolved()


@pytest.fixture
def quant_single_thread():
    """One torch thread: on a small shared machine two threads spin against each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quant_config():
    return quant_small_config()


@pytest.fixture
def quant_run_dir(tmp_path: Path, quant_config, eval_tokenizer: Path) -> Path:
    """A run directory whose last, EMA and SWA weights all differ (SWA: a sum of 2 snapshots)."""
    import torch

    from windowgpt_cli.storage.files import atomic_write_json, sha256_file
    from windowgpt_cli.artifacts.checkpoint import Checkpoint, save_checkpoint
    from windowgpt_cli.model.gpt import build_model

    torch.manual_seed(0)
    model = build_model(quant_config.model, torch.device("cpu"))
    last = {k: v.detach() + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    ema = {k: v + 0.01 * torch.randn_like(v) for k, v in last.items()}
    swa = {k: 2 * v + 0.01 * torch.randn_like(v) for k, v in last.items()}
    run = tmp_path / "run"
    run.mkdir()
    atomic_write_json(run / "config.json", quant_config.to_dict())
    save_checkpoint(run / "checkpoint.pt", Checkpoint(
        config=quant_config, model=last, ema=ema, swa=swa, swa_count=2, step=7, training_time_ms=1.0,
        tokenizer_sha256=sha256_file(eval_tokenizer), state={}))
    return run


@pytest.fixture
def quant_data_dir(tmp_path: Path, eval_tokenizer: Path) -> Path:
    """Shards of random tokens (one for training: GPTQ calibration), with the manifest."""
    import torch

    from windowgpt_cli.data.shards import shard_name, write_shard

    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(2)
    write_shard(data / shard_name("train", 0), torch.randint(0, 1024, (4096,), generator=g).to(torch.uint16).numpy())
    write_shard(data / shard_name("val", 0), torch.randint(0, 1024, (1024,), generator=g).to(torch.uint16).numpy())
    return index_data_dir(data, eval_tokenizer)


@pytest.fixture
def eval_single_thread():
    """One intra-op thread: the tiny model's small matrices run far faster without
    contending for the cores (use with pytest.mark.usefixtures)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """The shipped demo corpus, prepared once: shards, tokenizer and metadata."""
    from windowgpt_cli.data.prepare import prepare

    return built_once(tmp_path_factory, "tiny-data", lambda out: prepare(
        [REPO / "data" / "demo" / "gutenberg_1mb.jsonl"], out, vocab_size=1024, val_fraction=0.05))


@pytest.fixture(scope="session")
def tiny_run_dir(tmp_path_factory, tiny_data_dir) -> Path:
    """A finished tiny training run (30 steps), shared by the tests of later stages."""
    from windowgpt_cli.config import apply_overrides, tiny_preset
    from windowgpt_cli.train.run import train

    cfg = apply_overrides(tiny_preset(), {"data": {"data_path": str(tiny_data_dir)}, "train": {"iterations": 30}})
    return built_once(tmp_path_factory, "tiny-run", lambda out: train(cfg, out / "run")) / "run"


# --- The quick subset (`make test-fast`: -m "not gpu and not slow") ---------------------

# Tests of over 1.5 s on one core are marked slow where they are written; so is any test that
# uses one of these fixtures, which train or prepare something for seconds to a minute.
SLOW_FIXTURES = {"tiny_data_dir", "tiny_run_dir", "world", "record_flow", "dist_two_rank_run", "dist_mixed_run",
                 "two_runs"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The files with the most slow tests first: `make test` hands whole files to its processes
    # (`--dist loadfile`, so that a file's module fixtures are built once), and starting with
    # the longest leaves no process idle at the end while another finishes one.
    slow: dict[str, int] = {}
    for item in items:
        slow[item.fspath.strpath] = slow.get(item.fspath.strpath, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.fspath.strpath])  # stable: a file's own order is kept
