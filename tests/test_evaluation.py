"""Validation scoring: the reference's windows and arithmetic, rank splits, and the
score-first property of test-time training."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from windowgpt_cli.eval import scoring as evaluation
from windowgpt_cli.eval import ttt as ttt_module
from windowgpt_cli.config import TTTConfig, tiny_preset
from windowgpt_cli.errors import ConfigError, DataError
from windowgpt_cli.eval.scoring import (CPU_BATCH_WINDOWS, MAX_AUTO_BATCH_WINDOWS, WindowScorer,
                                        activation_bytes_per_token, batch_windows, chunk_windows, evaluate_sliding,
                                        evaluate_standard, plan_windows, rank_share, rows_per_window, even_batch)
from windowgpt_cli.eval.ttt import evaluate_ttt, select_ttt_parameters, ttt_learning_rate
from windowgpt_cli.data.loader import load_validation_tokens
from windowgpt_cli.model.gpt import GPT
from windowgpt_cli.data.shards import shard_name, write_shard
from windowgpt_cli.data.tokenizer import ByteLuts

pytestmark = pytest.mark.usefixtures("eval_single_thread")

CPU = torch.device("cpu")
SEQ = 128  # the tiny preset's sequence length


def truncated(tokens: torch.Tensor, seq_len: int = SEQ) -> torch.Tensor:
    return tokens[: ((tokens.numel() - 1) // seq_len) * seq_len + 1]


def reference_windows(total: int, seq_len: int, stride: int, ttt: bool) -> list[tuple[int, int, int]]:
    """(start, length, scored_from) as the reference's loops compute them."""
    out = []
    for ws in range(0, total, stride):
        wlen = min(ws + seq_len, total) - ws
        keep = (wlen >= stride or ws == 0) if ttt else wlen >= 1
        if keep:
            out.append((ws, wlen, 0 if ws == 0 else max(wlen - stride, 0)))
    return out


def naive_sliding(model, val: torch.Tensor, luts, seq_len: int, stride: int) -> tuple[float, int, int]:
    """The reference's eval_val_sliding, one window at a time (float32 on the CPU)."""
    tokens = val.long()
    total = tokens.numel() - 1
    nats, count, n_bytes = 0.0, 0, 0.0
    with torch.no_grad():
        for ws, wlen, s in reference_windows(total, seq_len, stride, ttt=False):
            x = torch.zeros(1, seq_len, dtype=torch.long)
            y = torch.zeros(1, seq_len, dtype=torch.long)
            x[0, :wlen], y[0, :wlen] = tokens[ws:ws + wlen], tokens[ws + 1:ws + wlen + 1]
            nll = F.cross_entropy(model.forward_logits(x)[0].float(), y[0], reduction="none")
            nats += nll[s:wlen].double().sum().item()
            count += wlen - s
            n_bytes += luts.count_bytes(x[0, s:wlen], y[0, s:wlen]).sum().item()
    return nats, count, int(n_bytes)


# --- Window bookkeeping -------------------------------------------------------------------

@pytest.mark.parametrize("total,seq_len,stride", [(512, 128, 32), (500, 128, 32), (97, 32, 7), (40, 64, 16),
                                                  (256, 64, 64), (10, 4, 3)])
@pytest.mark.parametrize("ttt", [False, True])
def test_windows_are_the_references(total, seq_len, stride, ttt):
    plan = plan_windows(total, seq_len, stride, min_length=stride if ttt else 1)
    got = list(zip(plan.starts.tolist(), plan.lengths.tolist(), plan.scored_from.tolist()))
    assert got == reference_windows(total, seq_len, stride, ttt)


def coverage(plan, total: int) -> np.ndarray:
    counts = np.zeros(total, dtype=np.int64)
    for begin, end in zip(plan.scored_begin.tolist(), plan.scored_end.tolist()):
        counts[begin:end] += 1
    return counts


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 600), seq_len=st.integers(1, 80), data=st.data())
def test_score_once_scores_every_target_exactly_once(total, seq_len, data):
    stride = data.draw(st.integers(1, seq_len))
    for min_length in (1, stride):
        plan = plan_windows(total, seq_len, stride, min_length=min_length, score_once=True)
        assert (coverage(plan, total) == 1).all()
        assert (plan.scored_from < plan.lengths).all()


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 600), seq_len=st.integers(1, 80), data=st.data())
def test_reference_windows_cover_everything_and_repeat_only_the_tail(total, seq_len, data):
    """The reference's set: every target scored, and only the last `stride` targets more
    than once (by the final windows, which all end at the end)."""
    stride = data.draw(st.integers(1, seq_len))
    counts = coverage(plan_windows(total, seq_len, stride), total)
    assert (counts >= 1).all()
    assert (counts[: max(total - stride, 0)] == 1).all()


def test_bad_stride_is_an_error():
    with pytest.raises(ConfigError, match="stride"):
        plan_windows(100, 32, 33)
    with pytest.raises(ConfigError, match="stride"):
        plan_windows(100, 32, 0)


def test_windows_go_to_the_chunk_of_their_first_scored_target():
    plan = plan_windows(1000, 128, 32, min_length=32)
    chunks = chunk_windows(plan, 256, 1000)
    assert len(chunks) == 4
    assert sorted(torch.cat(chunks).tolist()) == list(range(len(plan)))
    for ci, windows in enumerate(chunks):
        begins = plan.scored_begin[windows]
        assert (begins // 256 == ci).all() or ci == 3 and (begins >= 3 * 256).all()


def test_rank_share_splits_like_the_reference():
    shares = [rank_share(10, r, 4) for r in range(4)]
    assert shares == [(0, 2), (2, 5), (5, 7), (7, 10)]


# --- Validation tokens --------------------------------------------------------------------

def test_validation_tokens_are_all_shards_cut_to_whole_sequences(tmp_path):
    write_shard(tmp_path / shard_name("val", 0), np.arange(100) % 50)
    write_shard(tmp_path / shard_name("val", 1), np.arange(60) % 50)
    write_shard(tmp_path / shard_name("train", 0), np.arange(999) % 50)
    tokens = load_validation_tokens(tmp_path, 32, 50)
    expected = np.concatenate([np.arange(100) % 50, np.arange(60) % 50])[: 4 * 32 + 1]
    assert tokens.numpy().tolist() == expected.tolist()


def test_validation_token_errors(tmp_path):
    with pytest.raises(DataError, match="no val shards"):
        load_validation_tokens(tmp_path, 32, 50)
    write_shard(tmp_path / shard_name("val", 0), np.arange(32) % 50)
    with pytest.raises(DataError, match="too few"):
        load_validation_tokens(tmp_path, 32, 50)
    write_shard(tmp_path / shard_name("val", 0), np.arange(100))
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        load_validation_tokens(tmp_path, 32, 50)


# --- Sliding and standard evaluation --------------------------------------------------------

def test_bpb_is_nats_over_ln2_over_bytes_by_hand(eval_model, eval_val_tokens, eval_tokenizer, eval_luts):
    """Logits computed directly, bytes counted token by token from the SentencePiece model."""
    import sentencepiece as spm

    val = truncated(eval_val_tokens).long()
    x, y = val[:-1].view(-1, SEQ), val[1:].view(-1, SEQ)
    with torch.no_grad():
        log_probs = torch.log_softmax(eval_model.forward_logits(x).double(), dim=-1)
    nats = -log_probs.gather(-1, y[..., None]).sum().item()
    sp = spm.SentencePieceProcessor(model_file=str(eval_tokenizer))
    n_bytes = 0
    for prev, tgt in zip(val[:-1].tolist(), val[1:].tolist()):
        if sp.is_control(tgt) or sp.is_unknown(tgt) or sp.is_unused(tgt):
            continue
        piece = sp.id_to_piece(tgt)
        prev_is_boundary = sp.is_control(prev) or sp.is_unknown(prev) or sp.is_unused(prev)
        if sp.is_byte(tgt):
            n_bytes += 1
        else:
            n_bytes += len(piece.lstrip("\u2581").encode("utf-8")) if piece.startswith("\u2581") else \
                len(piece.encode("utf-8"))
            n_bytes += piece.startswith("\u2581") and not prev_is_boundary
    want = nats / math.log(2) / n_bytes

    standard = evaluate_standard(eval_model, val, eval_luts, seq_len=SEQ, batch_tokens=3 * SEQ, device=CPU)
    sliding = evaluate_sliding(eval_model, val, eval_luts, seq_len=SEQ, stride=SEQ, batch_seqs=3, device=CPU)
    for result in (standard, sliding):
        assert result.bytes == n_bytes and result.tokens == y.numel()
        assert result.val_bpb == pytest.approx(want, rel=1e-6)
        assert result.val_loss == pytest.approx(nats / y.numel(), rel=1e-6)


@pytest.mark.parametrize("stride,batch", [(32, 16), (24, 5), (128, 2)])
def test_sliding_equals_the_references_window_loop(eval_model, eval_val_tokens, eval_luts, stride, batch):
    val = truncated(eval_val_tokens)
    nats, count, n_bytes = naive_sliding(eval_model, val, eval_luts, SEQ, stride)
    result = evaluate_sliding(eval_model, val, eval_luts, seq_len=SEQ, stride=stride, batch_seqs=batch, device=CPU)
    assert (result.tokens, result.bytes) == (count, n_bytes)
    assert result.loss_sum == pytest.approx(nats, rel=1e-6)


def test_stride_equal_to_the_sequence_length_is_the_standard_evaluation(eval_model, eval_val_tokens, eval_luts):
    val = truncated(eval_val_tokens)
    standard = evaluate_standard(eval_model, val, eval_luts, seq_len=SEQ, batch_tokens=2 * SEQ, device=CPU)
    sliding = evaluate_sliding(eval_model, val, eval_luts, seq_len=SEQ, stride=SEQ, batch_seqs=16, device=CPU)
    assert (sliding.tokens, sliding.bytes) == (standard.tokens, standard.bytes)
    assert sliding.val_bpb == pytest.approx(standard.val_bpb, rel=1e-6)


def test_standard_accepts_any_mean_loss_callable(eval_model, eval_val_tokens, eval_luts):
    val = truncated(eval_val_tokens)
    calls = []

    def loss_fn(x, y):
        calls.append(x.shape)
        return eval_model(x, y)

    result = evaluate_standard(loss_fn, val, eval_luts, seq_len=SEQ, batch_tokens=3 * SEQ + 5, device=CPU)
    assert calls == [(3, SEQ), (1, SEQ)]
    assert result.val_bpb == pytest.approx(
        evaluate_standard(eval_model, val, eval_luts, seq_len=SEQ, batch_tokens=SEQ, device=CPU).val_bpb, rel=1e-6)
    with pytest.raises(ConfigError, match="at least one sequence"):
        evaluate_standard(loss_fn, val, eval_luts, seq_len=SEQ, batch_tokens=SEQ - 1, device=CPU)


def test_standard_through_a_training_graph_pads_the_last_batch_and_scores_the_same(eval_model, eval_val_tokens,
                                                                                    eval_luts):
    val = truncated(eval_val_tokens)
    shapes, grad_modes = [], []

    def loss_fn(x, y):
        shapes.append(tuple(x.shape))
        grad_modes.append(torch.is_grad_enabled() and not torch.is_inference_mode_enabled())
        return eval_model(x, y)

    result = evaluate_standard(loss_fn, val, eval_luts, seq_len=SEQ, batch_tokens=3 * SEQ, device=CPU,
                               training_graph=True)
    assert shapes == [(3, SEQ), (3, SEQ)] and all(grad_modes)  # one shape, autograd on: the training graph's
    want = evaluate_standard(eval_model, val, eval_luts, seq_len=SEQ, batch_tokens=SEQ, device=CPU)
    assert (result.tokens, result.bytes) == (want.tokens, want.bytes)
    assert result.val_loss == pytest.approx(want.val_loss, rel=1e-6)
    assert result.val_bpb == pytest.approx(want.val_bpb, rel=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_shares_add_up_to_the_whole(eval_model, eval_val_tokens, eval_luts, world):
    val = truncated(eval_val_tokens)
    kw = dict(seq_len=SEQ, stride=32, batch_seqs=8, device=CPU)
    whole = evaluate_sliding(eval_model, val, eval_luts, **kw)
    parts = [evaluate_sliding(eval_model, val, eval_luts, rank=r, world_size=world, **kw) for r in range(world)]
    assert sum(p.tokens for p in parts) == whole.tokens and sum(p.bytes for p in parts) == whole.bytes
    assert sum(p.loss_sum for p in parts) == pytest.approx(whole.loss_sum, rel=1e-6)

    std = dict(seq_len=SEQ, batch_tokens=SEQ, device=CPU)
    whole = evaluate_standard(eval_model, val, eval_luts, **std)
    parts = [evaluate_standard(eval_model, val, eval_luts, rank=r, world_size=world, **std) for r in range(world)]
    assert sum(p.tokens for p in parts) == whole.tokens and sum(p.bytes for p in parts) == whole.bytes


def test_score_once_drops_the_repeated_tail(eval_model, eval_val_tokens, eval_luts):
    val = truncated(eval_val_tokens)
    kw = dict(seq_len=SEQ, stride=32, batch_seqs=16, device=CPU)
    reference = evaluate_sliding(eval_model, val, eval_luts, **kw)
    once = evaluate_sliding(eval_model, val, eval_luts, score_once=True, **kw)
    assert once.tokens == val.numel() - 1
    assert reference.tokens == once.tokens + (SEQ // 32 - 1) * 32


# --- Score-first test-time training -----------------------------------------------------

TTT_SEQ, TTT_STRIDE, TTT_CHUNK = 64, 16, 128


def ttt_config(**changes) -> TTTConfig:
    base = TTTConfig(ttt_lr=0.05, ttt_epochs=1, ttt_chunk_tokens=TTT_CHUNK, ttt_freeze_blocks=1,
                     ttt_momentum=0.9, ttt_batch_seqs=2, ttt_grad_clip=1.0)
    return dataclasses.replace(base, **changes)


def run_ttt(model, val, luts, **changes):
    return evaluate_ttt(model, val, luts, ttt_config(**changes), seq_len=TTT_SEQ, stride=TTT_STRIDE, batch_seqs=8,
                        device=CPU)


@pytest.fixture
def ttt_tokens(eval_val_tokens):
    return eval_val_tokens[: 3 * TTT_CHUNK + 1]  # three chunks of two training sequences


def test_chunk_scores_do_not_depend_on_later_tokens(eval_model, ttt_tokens, eval_luts):
    """Score first: altering the tokens of chunk k (targets k*C .. (k+1)*C-1) leaves the
    scores of chunks before k unchanged, although the model trains on every chunk."""
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    base = run_ttt(eval_model, ttt_tokens, eval_luts).per_chunk
    assert len(base) == 3
    for k in (1, 2):
        altered = ttt_tokens.clone()
        altered[k * TTT_CHUNK + 1:] = (altered[k * TTT_CHUNK + 1:].long() * 7 + 3).remainder(1024).to(torch.uint16)
        eval_model.load_state_dict(state)
        scores = run_ttt(eval_model, altered, eval_luts).per_chunk
        assert scores[:k] == base[:k]
        assert scores[k].loss_sum != base[k].loss_sum
    # Not vacuous: training on earlier chunks does change what later chunks score.
    eval_model.load_state_dict(state)
    untrained = run_ttt(eval_model, ttt_tokens, eval_luts, ttt_epochs=0).per_chunk
    assert untrained[0] == base[0]
    assert untrained[1].loss_sum != base[1].loss_sum and untrained[2].loss_sum != base[2].loss_sum


def test_ttt_without_training_is_sliding_evaluation(eval_model, ttt_tokens, eval_luts):
    result = run_ttt(eval_model, ttt_tokens, eval_luts, ttt_epochs=0)
    sliding = evaluate_sliding(eval_model, ttt_tokens, eval_luts, seq_len=TTT_SEQ, stride=TTT_STRIDE, batch_seqs=8,
                               device=CPU)
    assert (result.tokens, result.bytes) == (sliding.tokens, sliding.bytes)
    assert result.loss_sum == pytest.approx(sliding.loss_sum, rel=1e-9)
    assert sum(c.tokens for c in result.per_chunk) == result.tokens


def test_training_after_scoring_in_inference_mode(eval_model, ttt_tokens, eval_luts):
    before = eval_model.qo_bank.detach().clone()
    result = run_ttt(eval_model, ttt_tokens, eval_luts)
    assert math.isfinite(result.val_bpb)
    assert not torch.equal(eval_model.qo_bank.detach(), before)
    assert all(p.requires_grad and p.grad is None for p in eval_model.parameters())


@pytest.mark.parametrize("epochs", [1, 0])
def test_ttt_builds_its_gradient_kernels_once_beside_the_scorers(eval_model, ttt_tokens, eval_luts, monkeypatch,
                                                                 epochs):
    """The window attention's kernels that TTT's steps run are built once, by the scorer's
    set-up (in its threads, before the first chunk is scored), and not at all without training."""
    events = []
    monkeypatch.setattr(ttt_module, "window_kernel_builds",
                        lambda *args, backward, **kwargs: [lambda: events.append(("build", backward))])
    scorer_init = evaluation.WindowScorer.__init__

    def recording_init(self, *args, **kwargs):
        scorer_init(self, *args, **kwargs)
        events.append("scorer ready")

    monkeypatch.setattr(evaluation.WindowScorer, "__init__", recording_init)
    run_ttt(eval_model, ttt_tokens, eval_luts, ttt_epochs=epochs)
    assert events == ([("build", True), "scorer ready"] if epochs else ["scorer ready"])


@pytest.mark.parametrize("freeze_bank_slices", [True, False])
def test_frozen_blocks_stay_bit_identical(eval_model, ttt_tokens, eval_luts, freeze_bank_slices):
    n = eval_model.num_layers
    before = {k: v.clone() for k, v in eval_model.state_dict().items()}
    run_ttt(eval_model, ttt_tokens, eval_luts, ttt_freeze_blocks=1, ttt_freeze_bank_slices=freeze_bank_slices)
    after = eval_model.state_dict()
    block0 = [k for k in before if k.startswith("blocks.0.")]
    assert block0 and all(torch.equal(after[k], before[k]) for k in block0)
    layer0_slices = [("qo_bank", 0), ("qo_bank", n), ("kv_bank", 0), ("kv_bank", n), ("mlp_up_bank", 0),
                     ("mlp_down_bank", 0)]
    for bank, slot in layer0_slices:
        assert torch.equal(after[bank][slot], before[bank][slot]) == freeze_bank_slices
    for bank, slot in [("qo_bank", 1), ("kv_bank", n + 1), ("mlp_up_bank", 2), ("mlp_down_bank", 3)]:
        assert not torch.equal(after[bank][slot], before[bank][slot])
    assert not torch.equal(after["tok_emb.weight"], before["tok_emb.weight"])


def ttt_with_and_without_recorded_steps(model, val, luts, device, graphs_settings=(False, True), **changes):
    """(result, weights) of TTT with each ttt_cuda_graphs setting in turn (default: off, then
    on), from the same weights."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for graphs in graphs_settings:
        model.load_state_dict(state)
        result = evaluate_ttt(model, val, luts, ttt_config(ttt_cuda_graphs=graphs, **changes), seq_len=TTT_SEQ,
                              stride=TTT_STRIDE, batch_seqs=8, device=device)
        runs.append((result, {k: v.clone() for k, v in model.state_dict().items()}))
    assert any(not torch.equal(runs[0][1][k], state[k]) for k in state)  # it trained
    return runs


# Chunks of 3 training sequences in steps of at most 2: two batch shapes, 2 epochs, 2 chunks.
TWO_SHAPES = dict(ttt_chunk_tokens=3 * TTT_SEQ, ttt_batch_seqs=2, ttt_epochs=2)


def test_recorded_steps_train_exactly_as_eager_steps(eval_model, eval_val_tokens, eval_luts):
    """The steps replayed through fixed buffers (CUDA graphs on a GPU; here the same
    bookkeeping, rerun eagerly) give the eager steps' weights and scores bit for bit: each
    shape's first step is eager, its second is recorded and replayed, later ones replayed."""
    (eager, eager_weights), (recorded, recorded_weights) = ttt_with_and_without_recorded_steps(
        eval_model, eval_val_tokens, eval_luts, CPU, **TWO_SHAPES)
    assert eager.ttt_steps == {"eager": 8, "captured": 0, "replayed": 0}
    assert recorded.ttt_steps == {"eager": 2, "captured": 2, "replayed": 6}
    assert recorded.per_chunk == eager.per_chunk and recorded.val_bpb == eager.val_bpb
    assert all(torch.equal(recorded_weights[k], eager_weights[k]) for k in eager_weights)
    assert all(p.grad is None for p in eval_model.parameters())


def chunk_trainer(model, tokens, device, *, graphs: bool):
    ttt = ttt_config(ttt_cuda_graphs=graphs)
    params = select_ttt_parameters(model, ttt.ttt_freeze_blocks, ttt.ttt_freeze_bank_slices)
    return ttt_module.ChunkTrainer(model, params, ttt, tokens.to(device=device, dtype=torch.int64), seq_len=TTT_SEQ,
                                   device=device, rank=0, world_size=1, compile_model=False)


FOUR_SEQS = 4 * TTT_SEQ  # a chunk of 4 sequences: 2 steps of one shape (ttt_batch_seqs=2)


def train_chunk_twice(model, tokens, device, *, graphs: bool, release: bool):
    """A ChunkTrainer's counts after training twice on one chunk of 4 sequences in steps of 2
    (one shape), released after each pass where asked; the model is trained in place."""
    trainer = chunk_trainer(model, tokens, device, graphs=graphs)
    for _ in range(2):
        trainer.train_chunk(0, FOUR_SEQS, 0.05)
        if release:
            trainer.release()
    return trainer.counts


def test_released_steps_record_again_and_train_as_eager_steps(eval_model, eval_val_tokens):
    """After release() a shape's next step is eager and records again; the weights are the
    eager steps' either way."""
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    weights = {}
    for graphs, release in [(False, False), (True, False), (True, True)]:
        eval_model.load_state_dict(state)
        counts = train_chunk_twice(eval_model, eval_val_tokens, CPU, graphs=graphs, release=release)
        weights[graphs, release] = {k: v.clone() for k, v in eval_model.state_dict().items()}
        expected = {(False, False): {"eager": 4, "captured": 0, "replayed": 0},
                    (True, False): {"eager": 1, "captured": 1, "replayed": 3},
                    (True, True): {"eager": 2, "captured": 2, "replayed": 2}}[graphs, release]
        assert counts == expected
    for run in [(True, False), (True, True)]:
        assert all(torch.equal(weights[run][k], weights[False, False][k]) for k in state)


def test_parameter_counts_count_frozen_slices_as_frozen(eval_model):
    m = eval_model
    scalars = sum(p.numel() for name, p in m.named_parameters() if name.startswith(("blocks.0.", "blocks.1.")))
    slices = 2 * (2 * m.qo_bank[0].numel() + 2 * m.kv_bank[0].numel() + m.mlp_up_bank[0].numel()
                  + m.mlp_down_bank[0].numel())
    total = sum(p.numel() for p in m.parameters())
    reference = select_ttt_parameters(m, 2, freeze_bank_slices=False)
    assert (reference.frozen_count, reference.unfrozen_count) == (scalars, total - scalars)
    ours = select_ttt_parameters(m, 2, freeze_bank_slices=True)
    assert (ours.frozen_count, ours.unfrozen_count) == (scalars + slices, total - scalars - slices)


def test_learning_rate_decays_by_cosine_across_chunks():
    assert ttt_learning_rate(0.01, 0, 5) == 0.01
    assert ttt_learning_rate(0.01, 2, 5) == pytest.approx(0.005)
    assert ttt_learning_rate(0.01, 4, 5) == pytest.approx(0.0, abs=1e-18)
    assert ttt_learning_rate(0.01, 0, 1) == 0.01


def test_scorer_pads_to_whole_batches(eval_model, eval_val_tokens, eval_luts):
    scorer = WindowScorer(eval_model, eval_val_tokens.long(), eval_luts, seq_len=SEQ, width=32, batch_rows=5,
                          device=CPU, compile_model=False)
    starts, first, lengths = scorer.rows(plan_windows(eval_val_tokens.numel() - 1, SEQ, 32))
    assert starts.numel() % 5 == 0 and (lengths[-1] == 0).item()


# --- Against the reference's own functions ------------------------------------------------

def reference_module(shared_dir):
    """train_gpt_window with run_reference's fix for inference-mode rotary tables."""
    import importlib
    import sys

    seed = shared_dir / "seed"
    sys.path[:0] = [str(seed / "shim"), str(seed)]
    try:
        return importlib.import_module("run_reference").reference
    except ImportError as exc:
        pytest.skip(f"reference not importable: {exc}")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # the reference's, on a CPU
@pytest.mark.slow
def test_sliding_and_ttt_give_the_reference_functions_numbers(shared_dir, monkeypatch, eval_tokenizer,
                                                              eval_val_tokens):
    """eval_val_sliding and eval_val_sliding_ttt themselves, on the CPU in float32 (the
    reference's CUDA autocast is inactive there; its torch.compile is skipped)."""
    ref = reference_module(shared_dir)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    cfg = dataclasses.replace(tiny_preset().model, window_attn_size=0, num_sink_tokens=0, rope_train_seq_len=TTT_SEQ)
    torch.manual_seed(0)
    ref_model = ref.GPT(vocab_size=1024, num_layers=cfg.num_layers, model_dim=cfg.model_dim, num_heads=cfg.num_heads,
                        num_kv_heads=cfg.num_kv_heads, mlp_mult=cfg.mlp_mult, tie_embeddings=True,
                        tied_embed_init_std=0.005, logit_softcap=30.0, rope_base=10000.0, qk_gain_init=1.5,
                        bigram_vocab_size=cfg.bigram_vocab_size, bigram_dim=cfg.bigram_dim, xsa_last_n=cfg.xsa_last_n,
                        rope_dims=cfg.rope_dims, ln_scale=True, ve_enabled=True, ve_dim=cfg.ve_dim,
                        ve_layers=",".join(map(str, cfg.ve_layers)), neg_slope=0.5, train_seq_len=TTT_SEQ)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = GPT(cfg)
    ours.load_state_dict(ref_model.state_dict(), strict=True)
    luts_tuple, _ = ref.load_tokenizer_luts(str(eval_tokenizer), "", 1024, CPU)
    luts = ByteLuts(*luts_tuple)
    val = eval_val_tokens[: 3 * TTT_CHUNK + 1]
    args = ref.Hyperparameters()
    ttt = ttt_config(ttt_freeze_bank_slices=False, ttt_epochs=2)
    for name, value in dataclasses.asdict(ttt).items():
        setattr(args, name, value)
    args.train_seq_len = TTT_SEQ

    want = ref.eval_val_sliding(args, ref_model, 0, 1, CPU, val, *luts_tuple, stride=TTT_STRIDE, batch_seqs=4,
                                eval_seq_len=TTT_SEQ)
    got = evaluate_sliding(ours, val, luts, seq_len=TTT_SEQ, stride=TTT_STRIDE, batch_seqs=8, device=CPU)
    assert (got.val_loss, got.val_bpb) == pytest.approx(want, rel=1e-6)

    want = ref.eval_val_sliding_ttt(args, ref_model, 0, 1, CPU, val, *luts_tuple, stride=TTT_STRIDE, batch_seqs=4,
                                    log0=lambda message: None)
    got = evaluate_ttt(ours, val, luts, ttt, seq_len=TTT_SEQ, stride=TTT_STRIDE, batch_seqs=8, device=CPU)
    assert (got.val_loss, got.val_bpb) == pytest.approx(want, rel=1e-5)
    assert torch.allclose(ours.qo_bank, ref_model.qo_bank, atol=1e-5)  # trained alike


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_cuda_scoring_and_ttt_agree_with_eager(eval_model, eval_val_tokens, eval_luts):
    """bf16 autocast, torch.compile, FlexAttention windows, and training after inference-mode
    scoring, on the GPU."""
    cuda = torch.device("cuda")
    model = eval_model.to(cuda)
    model.set_attention_backend("auto", cuda)
    val = truncated(eval_val_tokens)
    kw = dict(seq_len=SEQ, stride=32, batch_seqs=8, device=cuda)
    eager = evaluate_sliding(model, val, eval_luts, compile_model=False, **kw)
    compiled = evaluate_sliding(model, val, eval_luts, compile_model=True, **kw)
    assert (compiled.tokens, compiled.bytes) == (eager.tokens, eager.bytes)
    assert compiled.val_bpb == pytest.approx(eager.val_bpb, rel=1e-3)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    results = []
    for compile_model in (False, True):
        model.load_state_dict(state)
        results.append(evaluate_ttt(model, val[: 3 * TTT_CHUNK + 1], eval_luts, ttt_config(), seq_len=TTT_SEQ,
                                    stride=TTT_STRIDE, batch_seqs=8, device=cuda, compile_model=compile_model))
    assert results[1].val_bpb == pytest.approx(results[0].val_bpb, rel=1e-2)


@pytest.fixture
def deterministic_cuda():
    """Deterministic CUDA kernels (the attention backward's, above all), so that two runs of
    the same steps can agree bit for bit."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous)


def cuda_ttt_model(eval_model):
    cuda = torch.device("cuda")
    model = eval_model.to(cuda)
    model.set_attention_backend("auto", cuda)
    return model, cuda


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("deterministic_cuda")
def test_cuda_graph_steps_train_exactly_as_eager_steps(eval_model, eval_val_tokens, eval_luts):
    model, cuda = cuda_ttt_model(eval_model)
    (eager, eager_weights), (again, again_weights), (graphs, graph_weights) = ttt_with_and_without_recorded_steps(
        model, eval_val_tokens, eval_luts, cuda, (False, False, True), **TWO_SHAPES)
    assert again.val_bpb == eager.val_bpb and all(torch.equal(again_weights[k], eager_weights[k])
                                                  for k in eager_weights), "eager steps differ run to run here"
    assert graphs.ttt_steps == {"eager": 2, "captured": 2, "replayed": 6}
    assert graphs.per_chunk == eager.per_chunk and graphs.val_bpb == eager.val_bpb
    assert all(torch.equal(graph_weights[k], eager_weights[k]) for k in eager_weights)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("deterministic_cuda")
def test_released_cuda_graphs_give_their_memory_back_and_train_as_eager_steps(eval_model, eval_val_tokens):
    model, cuda = cuda_ttt_model(eval_model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    train_chunk_twice(model, eval_val_tokens, cuda, graphs=False, release=False)
    eager = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert train_chunk_twice(model, eval_val_tokens, cuda, graphs=True, release=True) == {
        "eager": 2, "captured": 2, "replayed": 2}
    assert all(torch.equal(model.state_dict()[k], eager[k]) for k in eager)
    trainer = chunk_trainer(model, eval_val_tokens, cuda, graphs=True)
    trainer.train_chunk(0, FOUR_SEQS, 0.05)  # one step recorded: its graph holds a pool
    held = torch.cuda.memory_reserved(cuda)
    trainer.release()
    assert torch.cuda.memory_reserved(cuda) < held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("deterministic_cuda")
def test_a_step_that_cannot_be_captured_trains_eagerly_after_one_warning(eval_model, eval_val_tokens, eval_luts,
                                                                         monkeypatch, capfd):
    """A host synchronization in the step (here: reading the gradient norm) breaks the
    capture; the run warns once and trains eagerly, to the same numbers."""
    from windowgpt_cli.eval.ttt import ChunkTrainer

    finish = ChunkTrainer._finish_gradients

    def finish_and_sync(self):
        finish(self)
        self.params.trainable[0].grad.norm().item()

    monkeypatch.setattr(ChunkTrainer, "_finish_gradients", finish_and_sync)
    model, cuda = cuda_ttt_model(eval_model)
    (eager, eager_weights), (fallback, fallback_weights) = ttt_with_and_without_recorded_steps(
        model, eval_val_tokens, eval_luts, cuda, **TWO_SHAPES)
    assert fallback.ttt_steps == {"eager": 8, "captured": 0, "replayed": 0}
    assert fallback.val_bpb == eager.val_bpb
    assert all(torch.equal(fallback_weights[k], eager_weights[k]) for k in eager_weights)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "CUDA graph" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "training eagerly" in warnings[0]
    assert torch.rand(4, device=cuda).isfinite().all()  # the process can still draw random numbers


# --- Batch size -----------------------------------------------------------------------------

def test_a_batch_of_zero_fills_half_the_free_gpu_memory_in_powers_of_two(monkeypatch):
    cfg = tiny_preset().model
    assert batch_windows(7, cfg, SEQ, CPU) == 7
    assert batch_windows(0, cfg, SEQ, CPU) == CPU_BATCH_WINDOWS
    cuda = torch.device("cuda")
    window = SEQ * activation_bytes_per_token(cfg, full_logits=False)
    for fitting, want in [(0, 1), (1, 1), (5, 4), (300, 256), (10**6, MAX_AUTO_BATCH_WINDOWS)]:
        free = 2 * window * fitting + 1
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 2 * free))
        assert batch_windows(0, cfg, SEQ, cuda) == want
        assert batch_windows(3, cfg, SEQ, cuda) == 3
    # Scoring every position keeps float32 logits too: fewer windows fit.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * window * 64, 4 * window * 64))
    assert batch_windows(0, cfg, SEQ, cuda, full_logits=True) < batch_windows(0, cfg, SEQ, cuda) == 64


@pytest.mark.parametrize("rows, most, batch", [(46143, 512, 508), (1024, 512, 512), (1025, 512, 342), (10, 512, 10),
                                               (1, 32, 1)])
def test_an_even_batch_takes_as_few_batches_and_pads_the_least(rows, most, batch):
    batches = -(-rows // batch)
    assert even_batch(rows, most) == batch <= most and batches == -(-rows // most)
    assert batch * batches - rows < batches  # under one row of padding per batch


def test_sliding_evaluation_chooses_an_even_batch_of_rows(eval_model, eval_val_tokens, eval_luts):
    plan = plan_windows(eval_val_tokens.numel() - 1, SEQ, 32)
    rows = int(rows_per_window(plan, 32).sum())
    result = evaluate_sliding(eval_model, eval_val_tokens, eval_luts, seq_len=SEQ, stride=32, device=CPU)
    assert result.batch_seqs == even_batch(rows, CPU_BATCH_WINDOWS) < CPU_BATCH_WINDOWS
    chosen = evaluate_sliding(eval_model, eval_val_tokens, eval_luts, seq_len=SEQ, stride=32, device=CPU,
                              batch_seqs=CPU_BATCH_WINDOWS)
    assert chosen.batch_seqs == CPU_BATCH_WINDOWS and abs(chosen.val_bpb - result.val_bpb) < 1e-6
