"""`windowgpt generate`: cached decoding gives the logits of recomputing the whole context,
windowed layers keep a bounded cache, and the command prints text, JSON and one-line errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.cli.app import app
from windowgpt_cli.generate.decoding import CachedDecoder, RecomputingDecoder, context_start, generate

pytestmark = pytest.mark.usefixtures("eval_single_thread")

# The tiny model: context limit 128, windows of 32 with 4 sinks on layers 1 and 3. 170 tokens
# pass the window many times over and restart the context.
LENGTH = 170


def random_tokens(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def restarts(lengths) -> int:
    """How often the context restarts while the text runs through these lengths."""
    return len({context_start(n, 128) for n in lengths}) - 1


def assert_cache_matches_recomputation(model, tokens: list[int], atol: float) -> None:
    cached, recomputed = CachedDecoder(model), RecomputingDecoder(model)
    with torch.inference_mode():
        for length in range(1, len(tokens) + 1):
            a, b = cached.next_logits(tokens[:length]), recomputed.next_logits(tokens[:length])
            assert torch.allclose(a, b, atol=atol, rtol=0), (length, (a - b).abs().max().item())
    assert cached.restarts == restarts(range(1, len(tokens) + 1)) >= 1


def test_context_start_caps_the_context_and_restarts_it_in_jumps():
    limit = 128
    starts = [context_start(n, limit) for n in range(1, 600)]
    assert starts[:limit] == [0] * limit
    assert all(0 < n - s <= limit for n, s in zip(range(1, 600), starts))
    assert all(b == a or b - a == limit // 4 + 1 for a, b in zip(starts, starts[1:]))  # whole jumps only
    assert context_start(limit + 1, limit) == limit + 1 - (limit - limit // 4)


def test_cached_logits_equal_recomputed_ones_at_every_step(eval_model):
    assert_cache_matches_recomputation(eval_model, random_tokens(LENGTH), atol=1e-4)


def test_windowed_layers_keep_only_their_sinks_and_window(eval_model):
    decoder = CachedDecoder(eval_model)
    tokens = random_tokens(120)
    with torch.inference_mode():
        for length in (60, 61, 120):  # a prompt, one step, then several tokens at once
            decoder.next_logits(tokens[:length])
    sizes = {block.attn.layer: cache.k.shape[1] for block, cache in zip(eval_model.blocks, decoder.caches)}
    assert sizes == {0: 128, 1: 4 + 32, 2: 128, 3: 4 + 32}
    ring = decoder.caches[1]
    assert sorted(ring.positions.tolist()) == [0, 1, 2, 3, *range(120 - 32, 120)]


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.9, 20)])
def test_generation_with_the_cache_equals_recomputation(eval_model, temperature, top_k):
    prompt = random_tokens(40, seed=4)
    runs = [generate(eval_model, prompt, LENGTH - 40, temperature=temperature, top_k=top_k, seed=7, use_cache=cache)
            for cache in (True, False)]
    assert runs[0].new_tokens == runs[1].new_tokens
    assert len(runs[0].new_tokens) == LENGTH - 40 and runs[0].context_restarts == restarts(range(40, LENGTH))
    if temperature > 0:  # another seed draws other tokens
        other = generate(eval_model, prompt, 20, temperature=temperature, top_k=top_k, seed=8)
        assert other.new_tokens != runs[0].new_tokens[:20]


@pytest.mark.gpu
def test_cached_decoding_equals_recomputation_on_cuda(eval_model):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import copy

    from windowgpt_cli.model.gpt import use_cuda_dtypes

    model = copy.deepcopy(eval_model).cuda()  # float32, no autocast: as exact as on the CPU
    assert_cache_matches_recomputation(model, random_tokens(LENGTH), atol=1e-3)
    # CUDA's kernels for one query and for a whole context round differently, so two
    # near-equal logits of the random model may swap: every greedy token of the cached run
    # must be a greedy choice of recomputation, to that rounding.
    prompt = random_tokens(40, seed=4)
    chosen = generate(model, prompt, 100, temperature=0.0, seed=7, use_cache=True).new_tokens
    recomputed = RecomputingDecoder(model)
    with torch.inference_mode():
        for i, token in enumerate(chosen):
            logits = recomputed.next_logits(prompt + chosen[:i])
            assert logits[token] >= logits.max() - 1e-3, (i, token, int(logits.argmax()))
    use_cuda_dtypes(eval_model)  # as generate runs on CUDA: bf16 tables, bf16 autocast
    model = eval_model.cuda()
    tokens = random_tokens(LENGTH)
    cached, recomputed = CachedDecoder(model), RecomputingDecoder(model)
    diffs = []
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for length in range(1, LENGTH + 1):
            a, b = cached.next_logits(tokens[:length]), recomputed.next_logits(tokens[:length])
            diffs.append((a - b).abs().mean().item())
    assert max(diffs) < 0.02, max(diffs)  # bf16 rounding; a wrong cache is off by whole units


def test_generate_command_continues_a_prompt(eval_run_dir, eval_data_dir):
    args = ["generate", str(eval_run_dir), "--prompt", "It was", "--max-new-tokens", "12", "--temperature", "0",
            "--data", str(eval_data_dir)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["new_tokens"] == len(out["token_ids"]) <= 12 and out["artifact_kind"] == "run"
    assert out["kv_cache"] is True and out["context_limit"] == 128 and out["tokens_per_second"] >= 0
    recomputed = json.loads(CliRunner().invoke(app, [*args, "--json", "--no-kv-cache"]).stdout)
    assert recomputed["token_ids"] == out["token_ids"] and recomputed["completion"] == out["completion"]
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "It was" + out["completion"] in shown.stdout and "tokens/s" in shown.stdout


def test_generate_refuses_another_tokenizer_in_one_line(eval_run_dir, eval_data_dir, tmp_path):
    other = tmp_path / "other.model"
    shutil.copyfile(eval_data_dir / "tokenizer.model", other)
    other.write_bytes(other.read_bytes() + b"\0")
    result = CliRunner().invoke(app, ["generate", str(eval_run_dir), "--prompt", "x", "--tokenizer", str(other)])
    assert result.exit_code == 1
    assert "differs from the tokenizer" in result.output and "Traceback" not in result.output
