"""`windowgpt generate`: decoding over static key/value buffers chooses the tokens of
recomputing the whole context, windowed layers keep a bounded ring, samples are
reproducible one by one, and the command finds the tokenizer of every kind of artifact."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.artifacts import ptz
from windowgpt_cli.artifacts.export import export
from windowgpt_cli.cli.app import app
from windowgpt_cli.generate.decoding import Chooser, StaticDecoder, context_start, generate, gumbel_noise
from windowgpt_cli.generate.text import generate_text
from windowgpt_cli.quant.quantize import quantize

pytestmark = pytest.mark.usefixtures("eval_single_thread")

# The tiny model: context limit 128, windows of 32 with 4 sinks on layers 1 and 3. 300 new
# tokens pass the window many times over and restart the context.
NEW_TOKENS = 300


def random_tokens(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def restarts(lengths) -> int:
    """How often the context restarts while the text runs through these lengths."""
    return len({context_start(n, 128) for n in lengths}) - 1


def test_context_start_caps_the_context_and_restarts_it_in_jumps():
    limit = 128
    starts = [context_start(n, limit) for n in range(1, 600)]
    assert starts[:limit] == [0] * limit
    assert all(0 < n - s <= limit for n, s in zip(range(1, 600), starts))
    assert all(b == a or b - a == limit // 4 + 1 for a, b in zip(starts, starts[1:]))  # whole jumps only
    assert context_start(limit + 1, limit) == limit + 1 - (limit - limit // 4)


@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.slow
def test_greedy_decoding_equals_recomputing_the_context(eval_model, num_samples):
    prompt = random_tokens(40, seed=4)
    runs = [generate(eval_model, prompt, NEW_TOKENS, num_samples=num_samples, temperature=0.0, use_cache=cache)
            for cache in (True, False)]
    assert runs[0].samples == runs[1].samples
    assert [len(s) for s in runs[0].samples] == [NEW_TOKENS] * num_samples
    assert runs[0].context_restarts == runs[1].context_restarts == restarts(range(40, 40 + NEW_TOKENS)) >= 5


@pytest.mark.slow
def test_every_step_sees_the_logits_of_recomputation(eval_model, monkeypatch):
    """Sampled (so the three samples' texts differ), each step's logits of every sample."""
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    choose = Chooser.choose
    for cache in (True, False):
        monkeypatch.setattr(Chooser, "choose", lambda self, logits, position, cache=cache: (
            seen[cache].append(logits.clone()), choose(self, logits, position))[1])
        out = generate(eval_model, random_tokens(20, seed=5), 150, num_samples=3, temperature=0.9, top_k=20,
                       seed=11, use_cache=cache)
        assert len({tuple(s) for s in out.samples}) == 3
    assert len(seen[True]) == len(seen[False]) == 150
    for step, (a, b) in enumerate(zip(seen[True], seen[False])):
        assert torch.allclose(a, b, atol=1e-4, rtol=0), (step, (a - b).abs().max().item())


def test_a_sample_is_the_same_in_any_batch_and_follows_its_seed(eval_model):
    prompt = random_tokens(10, seed=6)

    def samples(num_samples: int, seed: int = 7) -> list[list[int]]:
        return generate(eval_model, prompt, 40, num_samples=num_samples, temperature=0.9, top_k=20, seed=seed).samples

    three = samples(3)
    assert samples(2) == three[:2] and samples(1) == three[:1] and samples(3) == three
    assert len({tuple(s) for s in three}) == 3
    assert samples(1, seed=8) != three[:1]


def test_gumbel_noise_depends_on_seed_sample_and_position_only():
    noise = gumbel_noise(7, torch.arange(3), torch.tensor(5), 1024)
    assert torch.equal(noise[2:], gumbel_noise(7, torch.tensor([2]), torch.tensor(5), 1024))
    assert not torch.equal(noise, gumbel_noise(7, torch.arange(3), torch.tensor(6), 1024))
    assert not torch.equal(noise, gumbel_noise(-(2 ** 63), torch.arange(3), torch.tensor(5), 1024))
    many = gumbel_noise(0, torch.arange(64), torch.tensor(0), 1024).double()
    assert abs(many.mean().item() - 0.5772) < 0.02 and abs(many.std().item() - 1.2825) < 0.02  # standard Gumbel


def test_top_k_one_samples_the_likeliest_token():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    chosen = Chooser(4, 1.5, 1, seed=3, device=torch.device("cpu")).choose(logits, torch.tensor(9))
    assert torch.equal(chosen, logits.argmax(dim=-1))


def test_windowed_layers_keep_a_bounded_ring(eval_model):
    with StaticDecoder(eval_model, 2) as decoder:
        assert {i: cache.k.shape[2] for i, cache in enumerate(decoder.caches)} == {0: 128, 1: 37, 2: 128, 3: 37}
        visible = {geometry: (layout.masks == 0).sum(dim=1).tolist() for geometry, layout in decoder.layouts.items()}
    assert visible == {(0, 0): list(range(1, 129)), (32, 4): [min(p + 1, 4 + 32 + 1) for p in range(128)]}
    assert all(block.attn.kv_cache is None for block in eval_model.blocks)  # left as it was


def test_generate_command_prints_text_and_json(eval_run_dir, eval_data_dir):
    args = ["generate", str(eval_run_dir), "--prompt", "It was", "--max-new-tokens", "12", "--temperature", "0",
            "--data", str(eval_data_dir)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["new_tokens"] == len(out["token_ids"]) == out["tokens"] <= 12 and out["artifact_kind"] == "run"
    assert out["kv_cache"] is True and out["context_limit"] == 128 and out["samples"] == 1
    assert out["tokens_per_second"] > 0 and out["first_token_seconds"] > 0 and out["decode_seconds"] > 0
    recomputed = json.loads(CliRunner().invoke(app, [*args, "--json", "--no-kv-cache"]).stdout)
    assert recomputed["token_ids"] == out["token_ids"] and recomputed["completion"] == out["completion"]
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "It was" + out["completion"] in shown.stdout and "tokens/s" in shown.output


def test_generate_command_decodes_samples_as_one_batch(eval_run_dir, eval_data_dir):
    args = ["generate", str(eval_run_dir), "--prompt", "It was", "--max-new-tokens", "8", "--num-samples", "3",
            "--seed", "5", "--data", str(eval_data_dir)]
    out = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert len(out["completions"]) == out["samples"] == 3 and out["completion"] == out["completions"][0]
    assert out["tokens"] >= 3 and out["tokens_per_second"] > 0
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert shown.exit_code == 0
    for i, completion in enumerate(out["completions"]):
        assert f"[sample {i}] It was{completion}" in shown.stdout


def test_streamed_pieces_add_up_to_the_completion(eval_run_dir, eval_data_dir):
    pieces: list[tuple[int, str]] = []
    out = generate_text(eval_run_dir, "The", max_new_tokens=30, temperature=0.0, data_dir=eval_data_dir,
                        device="cpu", on_text=lambda sample, text: pieces.append((sample, text)))
    assert len(pieces) > 1 and {sample for sample, _ in pieces} == {0}
    assert "".join(text for _, text in pieces) == out["completion"]


@pytest.fixture
def located_run(eval_run_dir, eval_data_dir):
    """eval_run_dir as if trained on eval_data_dir (its configuration records that directory)."""
    import dataclasses

    from windowgpt_cli.artifacts.checkpoint import load_checkpoint, save_checkpoint
    from windowgpt_cli.storage.files import atomic_write_json

    ckpt = load_checkpoint(eval_run_dir)
    cfg = dataclasses.replace(ckpt.config, data=dataclasses.replace(ckpt.config.data, data_path=str(eval_data_dir)))
    save_checkpoint(eval_run_dir / "checkpoint.pt", dataclasses.replace(ckpt, config=cfg))
    atomic_write_json(eval_run_dir / "config.json", cfg.to_dict())
    return eval_run_dir


def test_an_export_carries_its_tokenizer(located_run, eval_data_dir, tmp_path):
    info = export(located_run, tmp_path / "export")
    assert info["tokenizer_path"] == str(eval_data_dir / "tokenizer.model")
    shutil.rmtree(eval_data_dir)  # the training data is gone: the export's copy serves
    out = generate_text(tmp_path / "export", "It", max_new_tokens=4, temperature=0.0, device="cpu")
    assert out["tokenizer"] == str((tmp_path / "export" / "tokenizer.model").absolute())


@pytest.mark.slow
def test_a_ptz_finds_the_tokenizer_its_report_records(located_run, eval_data_dir, tmp_path):
    artifact = tmp_path / "model.ptz"
    report = quantize(located_run, artifact, device="cpu")
    assert report["tokenizer"]["path"] == str((eval_data_dir / "tokenizer.model").absolute())
    payload = ptz.decompress_payload(artifact.read_bytes(), str(artifact))
    assert str(eval_data_dir).encode() not in payload and b"tokenizer.model" not in payload  # the report has them
    out = generate_text(artifact, "It", max_new_tokens=4, temperature=0.0, device="cpu")
    assert out["tokenizer"] == report["tokenizer"]["path"]
    moved = tmp_path / "elsewhere.model"
    shutil.move(eval_data_dir / "tokenizer.model", moved)
    result = CliRunner().invoke(app, ["generate", str(artifact), "--prompt", "It", "--max-new-tokens", "2"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert report["tokenizer"]["sha256"][:16] in result.output and "--tokenizer" in result.output
    assert len(result.output.strip().splitlines()) == 1
    given = CliRunner().invoke(app, ["generate", str(artifact), "--prompt", "It", "--max-new-tokens", "2",
                                     "--tokenizer", str(moved), "--json"])
    assert given.exit_code == 0 and json.loads(given.stdout)["tokenizer"] == str(moved)


def test_generate_refuses_another_tokenizer_in_one_line(eval_run_dir, eval_data_dir, tmp_path):
    other = tmp_path / "other.model"
    shutil.copyfile(eval_data_dir / "tokenizer.model", other)
    other.write_bytes(other.read_bytes() + b"\0")
    result = CliRunner().invoke(app, ["generate", str(eval_run_dir), "--prompt", "x", "--tokenizer", str(other)])
    assert result.exit_code == 1
    assert "differs from the tokenizer" in result.output and "Traceback" not in result.output


def assert_greedy_choices_of_recomputation(model, prompt: list[int], new_tokens: list[int]) -> None:
    """Each new token is a greedy choice of recomputing its whole context on CUDA, to bf16
    rounding (two near-equal logits of a random model may swap)."""
    from windowgpt_cli.generate.decoding import RecomputingDecoder

    recomputed = RecomputingDecoder(model)
    text = list(prompt)
    with torch.inference_mode():
        for i, token in enumerate(new_tokens):
            logits = recomputed.next_logits(torch.tensor([text], device="cuda"))[0]
            assert logits[token] >= logits.max() - 0.15, (i, token, int(logits.argmax()))
            text.append(token)


@pytest.mark.gpu
def test_graphed_decoding_chooses_the_tokens_of_recomputation_on_cuda(eval_model):
    """bf16 on CUDA, the step compiled and replayed as a CUDA graph: every greedy token is a
    greedy choice of recomputing the context, to bf16 rounding (two near-equal logits of a
    random model may swap), and sampling stays reproducible per sample."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from windowgpt_cli.model.gpt import use_cuda_dtypes

    use_cuda_dtypes(eval_model)
    model = eval_model.cuda()
    prompt = random_tokens(40, seed=4)
    out = generate(model, prompt, NEW_TOKENS, temperature=0.0, compile_step=True)
    assert out.context_restarts == restarts(range(40, 40 + NEW_TOKENS)) and out.first_call_seconds > 0
    assert_greedy_choices_of_recomputation(model, prompt, out.new_tokens)
    sampled = [generate(model, prompt, 64, num_samples=n, temperature=0.9, top_k=20, seed=3).samples for n in (4, 2)]
    assert sampled[0][:2] == sampled[1]
