"""Per-document LoRA test-time training (`eval-ttt --method lora`): documents and chunks,
the adapters, the score-first order, and the command."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.cli.app import app
from windowgpt_cli.config import TTTConfig, tiny_preset
from windowgpt_cli.eval.lora_ttt import (
    BatchedLoRA,
    adapted_shapes,
    chunk_rows,
    evaluate_lora_ttt,
    find_documents,
    phase_groups,
)

CPU = torch.device("cpu")
SEQ = 64
BOS_AT = (0, 90, 100, 300, 420, 650)  # six documents, two of them longer than SEQ


@pytest.fixture
def doc_tokens():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 1024, (700,), generator=g)
    tokens[list(BOS_AT)] = 1
    return tokens


def lora_config(**changes) -> TTTConfig:
    base = dataclasses.replace(tiny_preset().ttt, ttt_method="lora", ttt_lora_rank=4, ttt_lora_chunk_tokens=16,
                               ttt_lora_batch_docs=3, ttt_lora_phases=2, ttt_lora_prefix_docs=4, ttt_lora_lr=1e-2)
    return dataclasses.replace(base, **changes)


def scores(model, tokens, luts, **changes) -> tuple[dict[int, float], object]:
    """{target position: nats} of every scored target, and the result."""
    seen: dict[int, float] = {}

    def record(positions, nats):
        for p, n in zip(positions.tolist(), nats.tolist()):
            assert p not in seen, f"target {p} scored twice"
            seen[p] = n

    result = evaluate_lora_ttt(model, tokens, luts, lora_config(**changes), seq_len=SEQ, device=CPU, on_target=record)
    return seen, result


def test_documents_partition_the_targets_and_phases_split_the_prefix(doc_tokens):
    docs = find_documents(doc_tokens)
    assert [(d.start, d.end) for d in docs] == [(0, 90), (90, 100), (100, 300), (300, 420), (420, 650), (650, 699)]
    no_bos_first = doc_tokens.clone()
    no_bos_first[0] = 5  # a stream that does not start with BOS still starts a document
    assert find_documents(no_bos_first)[0].start == 0
    groups = phase_groups(docs, 3, 4)
    assert [[d.index for d in g] for g in groups] == [[0], [1, 2], [3], [4, 5]]
    assert [[d.index for d in g] for g in phase_groups(docs, 0, 4)] == [[0, 1, 2, 3, 4, 5]]
    assert [len(g) for g in phase_groups(docs, 2, 100)] == [3, 3, 0]


@pytest.mark.parametrize("stream", [False, True])
def test_chunk_windows_end_with_their_chunk_within_the_document_or_the_stream(doc_tokens, stream):
    docs = find_documents(doc_tokens)
    for index in range(15):
        rows = chunk_rows(docs, index, 16, SEQ, stream_context=stream)
        assert rows.width % 64 == 0 or rows.width == SEQ
        for b, d in enumerate(docs):
            targets = (rows.window_start[b] + rows.queries[b][rows.valid[b]]).tolist()
            want = list(range(d.start + 16 * index, min(d.start + 16 * (index + 1), d.end)))
            assert targets == want
            if want:  # the window: at most SEQ tokens of the document (or stream), ending with the chunk's last input
                first = 0 if stream else d.start
                assert rows.window_start[b] >= first
                assert rows.window_start[b] + rows.window_len[b] == want[-1] + 1
                assert rows.window_len[b] == min(SEQ, want[-1] + 1 - first)
            assert bool(rows.trains[b]) == (d.start + 16 * (index + 1) < d.end)
            if want:  # what the window span trains on: the document's targets in the window, up to the chunk's end
                trained = (rows.window_start[b] + rows.window_targets()[b].nonzero().flatten()).tolist()
                assert trained == list(range(max(d.start, int(rows.window_start[b])), want[-1] + 1))


SPANS = [("document", "chunk", "share"), ("stream", "chunk", "share"), ("stream", "window", "share"),
         ("stream", "chunk", "prefix")]


@pytest.mark.parametrize("context,span,phase_span", SPANS)
def test_every_target_is_scored_once_and_the_bytes_are_the_streams(eval_model, doc_tokens, eval_luts, context,
                                                                     span, phase_span):
    seen, result = scores(eval_model, doc_tokens, eval_luts, ttt_lora_context=context, ttt_lora_train_span=span,
                          ttt_lora_phase_span=phase_span)
    assert sorted(seen) == list(range(doc_tokens.numel() - 1))
    assert result.tokens == doc_tokens.numel() - 1
    assert result.bytes == int(eval_luts.count_bytes(doc_tokens[:-1], doc_tokens[1:]).sum())
    assert sum(g.tokens for g in result.per_chunk) == result.tokens  # one score per phase group
    assert result.ttt_steps["adapter_steps"] > 0 and result.ttt_steps["phase_eager"] == 2


@pytest.mark.parametrize("context,span,phase_span", SPANS)
def test_a_later_token_never_changes_an_earlier_score(eval_model, doc_tokens, eval_luts, context, span, phase_span):
    """Score first: altering token p (not a BOS) leaves the score of every target before p
    unchanged: adapters, phases and batching notwithstanding. Token p does change later scores
    in its document (through the adapters and the context) and in later phase groups."""
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    settings = dict(ttt_lora_context=context, ttt_lora_train_span=span, ttt_lora_phase_span=phase_span)
    base, _ = scores(eval_model, doc_tokens, eval_luts, **settings)
    for p in (40, 150, 350, 500):
        altered = doc_tokens.clone()
        altered[p] = 7 if altered[p] != 7 else 8
        eval_model.load_state_dict(state)
        got, _ = scores(eval_model, altered, eval_luts, **settings)
        for target in range(p - 1):  # target p - 1 predicts token p itself
            assert got[target] == pytest.approx(base[target], abs=1e-6), (p, target)
        assert any(abs(got[t] - base[t]) > 1e-5 for t in range(p, doc_tokens.numel() - 1))


def test_adapters_learn_within_a_document_and_start_as_the_model(eval_model, doc_tokens, eval_luts):
    """With a zero learning rate and no phases each document scores as the model alone on
    the document (its first chunk is the model's, whatever the adapters' rate); a nonzero
    rate changes its later chunks."""
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    still, _ = scores(eval_model, doc_tokens, eval_luts, ttt_lora_lr=0.0, ttt_lora_phases=0,
                      ttt_lora_context="document")
    for d in find_documents(doc_tokens):
        if d.targets <= SEQ:
            x = doc_tokens[d.start: d.end][None]
            y = doc_tokens[d.start + 1: d.end + 1][None]
            with torch.no_grad():
                want = eval_model.token_nll(x, y)[0].tolist()
            assert [still[t] for t in range(d.start, d.end)] == pytest.approx(want, abs=1e-5)
    eval_model.load_state_dict(state)
    learned, _ = scores(eval_model, doc_tokens, eval_luts, ttt_lora_phases=0, ttt_lora_context="document")
    first_chunk = [t for d in find_documents(doc_tokens) for t in range(d.start, min(d.start + 16, d.end))]
    assert [learned[t] for t in first_chunk] == pytest.approx([still[t] for t in first_chunk], abs=1e-6)
    later = [t for t in learned if t not in set(first_chunk)]
    assert max(abs(learned[t] - still[t]) for t in later) > 1e-3


def test_the_window_span_scores_each_documents_first_chunk_alike_and_learns_more_from_the_rest(
        eval_model, doc_tokens, eval_luts):
    """Training on the document's window (its earlier chunks again) leaves the first chunk's
    scores as they are (no step precedes them) and moves the later ones."""
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    chunk, _ = scores(eval_model, doc_tokens, eval_luts, ttt_lora_phases=0)
    eval_model.load_state_dict(state)
    window, _ = scores(eval_model, doc_tokens, eval_luts, ttt_lora_phases=0, ttt_lora_train_span="window")
    first_chunk = {t for d in find_documents(doc_tokens) for t in range(d.start, min(d.start + 16, d.end))}
    assert [window[t] for t in sorted(first_chunk)] == pytest.approx([chunk[t] for t in sorted(first_chunk)], abs=1e-5)
    # the second chunk follows one step on the first chunk either way: alike; from the third on they part
    second_chunk = [t for d in find_documents(doc_tokens) for t in range(d.start + 16, min(d.start + 32, d.end))]
    assert [window[t] for t in second_chunk] == pytest.approx([chunk[t] for t in second_chunk], abs=1e-5)
    third_on = [t for d in find_documents(doc_tokens) for t in range(d.start + 32, d.end)]
    assert max(abs(window[t] - chunk[t]) for t in third_on) > 1e-3


def test_prefix_phases_train_on_every_document_scored_so_far(eval_model, doc_tokens, eval_luts):
    """Groups [0, 1], [2, 3], [4, 5]: the first phase trains on documents 0-1 either way, so
    the first two groups score alike; the second trains on 2-3 (share) or 0-3 (prefix), so
    the last group's scores part."""
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    lines: dict[str, list[str]] = {"share": [], "prefix": []}
    got = {}
    for span in lines:
        eval_model.load_state_dict(state)
        got[span] = evaluate_lora_ttt(eval_model, doc_tokens, eval_luts, lora_config(ttt_lora_phase_span=span),
                                      seq_len=SEQ, device=CPU, log=lines[span].append)
    share, prefix = got["share"].per_chunk, got["prefix"].per_chunk
    assert [g.loss_sum for g in prefix[:2]] == pytest.approx([g.loss_sum for g in share[:2]], abs=1e-9)
    assert abs(prefix[2].loss_sum - share[2].loss_sum) > 1e-4
    phases = {span: [line for line in log if "ttt_lora:phase" in line] for span, log in lines.items()}
    assert "trained on documents 2..3 (targets 100..419)" in phases["share"][1]
    assert "trained on documents 0..3 (targets 0..419)" in phases["prefix"][1]


def test_a_documents_scores_do_not_depend_on_its_batch(eval_model, doc_tokens, eval_luts):
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    alone, _ = scores(eval_model, doc_tokens, eval_luts, ttt_lora_batch_docs=1, ttt_lora_phases=0)
    eval_model.load_state_dict(state)
    together, _ = scores(eval_model, doc_tokens, eval_luts, ttt_lora_batch_docs=6, ttt_lora_phases=0)
    assert sorted(alone) == sorted(together)
    assert [together[t] for t in sorted(alone)] == pytest.approx([alone[t] for t in sorted(alone)], abs=1e-5)


def test_adapters_cover_the_targets_and_start_at_zero(eval_model):
    shapes = adapted_shapes(eval_model, ("q", "down", "head"))
    cfg = eval_model.cfg
    assert shapes["blocks.0.attn.c_q.weight"] == (cfg.model_dim, cfg.model_dim)
    assert shapes[f"blocks.{cfg.num_layers - 1}.mlp.proj.weight"] == (cfg.mlp_dim, cfg.model_dim)
    assert shapes["tok_emb.weight"] == (cfg.model_dim, cfg.vocab_size)
    assert len(shapes) == 2 * cfg.num_layers + 1
    lora = BatchedLoRA(shapes, rows=2, rank=3, device=CPU)
    x = torch.randn(2, 5, cfg.model_dim)
    assert torch.equal(lora("blocks.0.attn.c_q.weight", x), torch.zeros(2, 5, cfg.model_dim))
    assert lora("blocks.0.attn.c_k.weight", x) is None
    with torch.no_grad():
        lora.up["blocks_0_attn_c_q_weight"][1].fill_(1.0)
    delta = lora("blocks.0.attn.c_q.weight", x)
    assert torch.equal(delta[0], torch.zeros_like(delta[0])) and delta[1].abs().sum() > 0  # rows are independent


def test_eval_ttt_method_lora_reports_and_saves_its_score(eval_run_dir, tmp_path, eval_tokenizer):
    from windowgpt_cli.data.shards import shard_name, write_shard
    from conftest import index_data_dir

    data = tmp_path / "docs"
    data.mkdir()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, 1024, (4 * 128 + 1,), generator=g)
    tokens[[0, 100, 260, 300]] = 1
    write_shard(data / shard_name("val", 0), tokens.to(torch.uint16).numpy())
    write_shard(data / shard_name("train", 0), tokens.to(torch.uint16).numpy())
    index_data_dir(data, eval_tokenizer)
    runner = CliRunner()
    args = ["eval-ttt", str(eval_run_dir), "--data", str(data), "--method", "lora", "--ttt-lora-rank", "2",
            "--ttt-lora-phases", "1", "--ttt-lora-prefix-docs", "2", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["mode"] == "ttt_lora" and record["tokens"] == 4 * 128
    assert len(record["per_phase"]) == 2 and record["ttt"]["ttt_lora_rank"] == 2
    assert record["eval_cap"]["cap_seconds"] is None and record["eval_cap"]["hardware"] == "1 x cpu"
    assert record["eval_cap"]["seconds"] == pytest.approx(record["timings_s"]["total"], abs=1e-3)  # the whole command
    assert record["eval_cap"]["seconds"] > record["seconds"]
    saved = json.loads((eval_run_dir / "eval-ttt_lora.json").read_text())
    assert saved["val_bpb"] == record["val_bpb"]
    table = runner.invoke(app, args[:-1])
    assert table.exit_code == 0 and "phase group 2" in table.output and "no cap for 1 x cpu" in table.output
    bad = runner.invoke(app, args[:-1] + ["--ttt-lora-targets", "q,mlp"])
    assert bad.exit_code == 1
    assert bad.output == "error: --ttt-lora-targets 'q,mlp': 'mlp' is none of q, k, v, o, up, down, head\n"
    assert runner.invoke(app, args[:-1] + ["--method", "sgd"]).exit_code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_scoring_with_fused_steps_agrees_with_torchs(eval_model, doc_tokens, eval_luts):
    """On CUDA (bf16 autocast): every target scored once, and the fused training kernels give
    the scores torch's steps give, to bf16 rounding."""
    from windowgpt_cli.model.gpt import use_cuda_dtypes

    cuda = torch.device("cuda")
    state = {k: v.clone() for k, v in eval_model.state_dict().items()}
    results = []
    for fused in (False, True):
        eval_model.load_state_dict(state)
        model = eval_model.to(cuda)
        use_cuda_dtypes(model)
        model.set_attention_backend("auto", cuda)
        seen: dict[int, float] = {}
        result = evaluate_lora_ttt(model, doc_tokens, eval_luts, lora_config(), seq_len=SEQ, device=cuda,
                                   fused=fused, on_target=lambda p, n: seen.update(zip(p.tolist(), n.tolist())))
        assert sorted(seen) == list(range(doc_tokens.numel() - 1)) and result.tokens == doc_tokens.numel() - 1
        results.append(result)
        eval_model.to(CPU)
    assert results[1].val_bpb == pytest.approx(results[0].val_bpb, rel=2e-3)
