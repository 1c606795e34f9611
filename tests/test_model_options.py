"""Model settings beyond the reference, each off by default: gated U-Net skips, the sparse
attention output gate, and SmearGate's document boundary. What each computes, and that
every stage takes a model that has them."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.cli.app import app
from windowgpt_cli.config import RunConfig, tiny_preset, validate
from windowgpt_cli.errors import SettingError
from windowgpt_cli.generate.decoding import generate
from windowgpt_cli.model.gpt import build_model
from windowgpt_cli.model.ops import TORCH_OPS, Residual

from test_generation import assert_greedy_choices_of_recomputation
from test_model import perturbed_tiny

OPTIONS = dict(skip_gates=True, attn_out_gate_width=12, attn_out_gate_scale=0.5, doc_boundary_token=1,
               smear_gate_width=12, parallel_start_layer=2, parallel_mlp_reads_x0=False, recur_layers=(1,),
               recur_count=2)
OPTION_FLAGS = ["--skip-gates", "--attn-out-gate-width", "12", "--attn-out-gate-scale", "0.5",
                "--doc-boundary-token", "1", "--smear-gate-width", "12", "--parallel-start-layer", "2",
                "--no-parallel-mlp-reads-x0", "--recur-layers", "1", "--recur-count", "2",
                "--recur-start-fraction", "0.5"]


def tokens(n: int = 48, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, 1024, (2, n), generator=torch.Generator().manual_seed(seed))


def test_the_defaults_add_no_parameter():
    names = {name for name, _ in perturbed_tiny().named_parameters()}
    assert not any("gate" in n and n != "smear.gate" for n in names)
    added = {name for name, _ in perturbed_tiny(**OPTIONS).named_parameters()} - names
    layers = tiny_preset().model.num_layers
    assert added == {"skip_gates", "lane_mix", "smear.scale"} | {f"blocks.{i}.attn.attn_gate" for i in range(layers)}


def test_a_gated_skip_blends_the_sum_with_the_weighted_skip():
    torch.manual_seed(0)
    base, delta, skip = torch.randn(3, 2, 5, 8).unbind(0)
    scale, weight, gate = torch.randn(3, 8).unbind(0)
    g = torch.sigmoid(gate)
    summed = TORCH_OPS.stream_sum(Residual(base).plus(delta, scale).plus_skip(skip, weight, gate))
    assert torch.allclose(summed, g * (base + scale * delta) + (1 - g) * weight * skip, atol=1e-6)
    itself = TORCH_OPS.stream_sum(Residual(base).plus_skip(None, weight, gate))
    assert torch.allclose(itself, g * base + (1 - g) * weight * base, atol=1e-6)
    ungated = TORCH_OPS.stream_sum(Residual(base).plus_skip(skip, weight))
    assert torch.equal(ungated, base + weight * skip)


def test_open_skip_gates_are_a_model_whose_skips_add_nothing():
    """sigmoid(30) = 1: each decoder block reads the stream alone, as a model whose skip
    weights are zero does."""
    gated = perturbed_tiny(skip_gates=True)
    plain = perturbed_tiny()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if k != "skip_gates"})
    with torch.no_grad():
        gated.skip_gates.fill_(30.0)
        plain.skip_weights.zero_()
        x = tokens()
        assert torch.allclose(gated.forward_logits(x), plain.forward_logits(x), atol=1e-5)
        gated.skip_gates.fill_(0.0)  # an even blend differs
        assert not torch.allclose(gated.forward_logits(x), plain.forward_logits(x), atol=1e-3)


def test_a_zero_attention_gate_halves_each_heads_output():
    gated = perturbed_tiny(attn_out_gate_width=12)
    plain = perturbed_tiny()
    state = {k: v for k, v in gated.state_dict().items() if "attn_gate" not in k}
    n = gated.num_layers
    state["qo_bank"] = state["qo_bank"].clone()
    state["qo_bank"][n:] *= 0.5  # the output projections: sigmoid(0) = 0.5 on every head
    plain.load_state_dict(state)
    with torch.no_grad():
        for block in gated.blocks:
            block.attn.attn_gate.zero_()
        x = tokens()
        assert torch.allclose(gated.forward_logits(x), plain.forward_logits(x), atol=1e-5)


def test_the_attention_gate_reads_the_first_channels_per_head_and_learns():
    model = perturbed_tiny(attn_out_gate_width=12, attn_out_gate_scale=0.5)
    attn = model.blocks[0].attn
    y = torch.randn(2, 5, attn.num_heads, attn.head_dim)
    x = torch.randn(2, 5, model.cfg.model_dim)
    want = y * torch.sigmoid(0.5 * torch.einsum("btc,hc->bth", x[..., :12], attn.attn_gate))[..., None]
    gate = attn._gate(x, y.dtype)
    assert torch.allclose(TORCH_OPS.attention_output(y, None, gate), want, atol=1e-6)
    assert torch.equal(attn._gate(x + torch.cat([torch.zeros(12), torch.ones(52)]), y.dtype), gate)
    x = tokens()
    model(x, x).backward()
    assert all(block.attn.attn_gate.grad.abs().sum() > 0 for block in model.blocks)


def test_the_gate_by_token_adds_the_gated_predecessor_before_the_norm():
    import torch.nn.functional as F

    at_init = build_model(dataclasses.replace(tiny_preset().model, smear_gate_width=12), torch.device("cpu"))
    model = perturbed_tiny(smear_gate_width=12, bigram_vocab_size=0)
    assert model.smear.gate.shape == (12,) and model.smear.scale.shape == (1,)
    x = tokens()
    with torch.no_grad():
        e = F.embedding(x, at_init.tok_emb.weight)
        assert torch.equal(at_init.embed(x), F.rms_norm(e, (e.size(-1),)))  # zero at first: no smear
        e = F.embedding(x, model.tok_emb.weight)
        previous = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], dim=1)
        gate = torch.sigmoid(e[..., :12] @ model.smear.gate)[..., None]
        want = e + model.smear.scale * gate * previous
        assert torch.allclose(model.embed(x), F.rms_norm(want, (want.size(-1),)), atol=1e-6)
        assert not torch.allclose(model.embed(x), F.rms_norm(e, (e.size(-1),)), atol=1e-4)


@pytest.mark.parametrize("width", [0, 12])
def test_the_document_boundary_keeps_each_document_out_of_the_next(width: int):
    """With boundary 1 (BOS) a BOS position's x0 does not depend on the token before it:
    SmearGate blends it with zeros (either form) and BigramHash gives it the first position's
    bucket, as at a sequence's start."""
    model = perturbed_tiny(doc_boundary_token=1, smear_gate_width=width)
    x = tokens()
    x[:, 20] = 1
    other = x.clone()
    other[:, 19] = 7
    with torch.no_grad():
        x0, x0_other = model.embed(x), model.embed(other)
        assert torch.equal(x0[:, 20], x0_other[:, 20])
        assert not torch.equal(x0[:, 19], x0_other[:, 19])
        at_start = model.embed(x[:, 20:])[:, 0]
        assert torch.allclose(x0[:, 20], at_start, atol=1e-6)
        plain = perturbed_tiny(smear_gate_width=width)
        assert not torch.equal(plain.embed(x)[:, 20], plain.embed(other)[:, 20])  # without the boundary it leaks


@pytest.mark.parametrize("mlp_reads_x0", [True, False])
def test_a_parallel_block_runs_attention_and_mlp_side_by_side_on_two_lanes(mlp_reads_x0: bool):
    model = perturbed_tiny(parallel_start_layer=2, parallel_mlp_reads_x0=mlp_reads_x0)
    block, i = model.blocks[3], 3
    with torch.no_grad():
        block.resid_mix.copy_(torch.randn_like(block.resid_mix))  # x0 in every block input
    torch.manual_seed(1)
    lane0, lane1, x0 = torch.randn(3, 2, 16, model.cfg.model_dim).unbind(0)
    mix = torch.randn(3, 2)
    rotary = model.rotary(16, torch.device("cpu"))
    weights = model.layer_weights(torch.float32)[i]
    with torch.no_grad():
        got = block.parallel((Residual(lane0), Residual(lane1)), x0, weights, rotary, None, mix)

        def normed(lane, with_x0=True):  # a block's input: mixed with x0, normed, scaled by the layer's factor
            mixed = block.resid_mix[0] * lane + block.resid_mix[1] * x0 if with_x0 else lane
            return torch.nn.functional.rms_norm(mixed, (mixed.size(-1),)) * block.ln_scale_factor

        attn = block.attn_scale * block.attn(normed(lane0), *weights[:4], rotary, None)
        mlp = block.mlp_scale * block.mlp(normed(lane1, mlp_reads_x0), *weights[4:])
    for k, lane in enumerate((lane0, lane1)):
        want = mix[2, k] * lane + mix[0, k] * attn + mix[1, k] * mlp
        assert torch.allclose(got[k].base, want, atol=1e-5)
    x = tokens()
    model.train()
    model(x, x).backward()
    assert model.lane_mix.grad.abs().sum() > 0 and model.lane_mix.shape == (2, 3, 2)


def test_a_looped_model_is_the_model_with_its_loop_written_out():
    """Layers 1 and 2 of four, run twice: the same logits as six layers whose 3rd and 4th are
    copies of the 1st and 2nd (skip weights, scales and constants alike)."""
    plain = dict(xsa_last_n=0, ve_enabled=False, window_attn_size=0, num_sink_tokens=0, bigram_vocab_size=0)
    looped = perturbed_tiny(recur_layers=(1, 2), recur_count=2, **plain)
    assert looped.cfg.block_order() == [0, 1, 2, 1, 2, 3] and looped.cfg.block_order(False) == [0, 1, 2, 3]
    unrolled = perturbed_tiny(num_layers=6, **plain)
    copies = [0, 1, 2, 1, 2, 3]
    state = looped.state_dict()
    for bank in ("qo_bank", "kv_bank"):  # [2n, ...]: first halves, then second halves
        half = state[bank].size(0) // 2
        state[bank] = torch.cat([state[bank][copies], state[bank][[half + c for c in copies]]])
    for bank in ("mlp_up_bank", "mlp_down_bank"):
        state[bank] = state[bank][copies]
    for name in list(state):
        if name.startswith("blocks."):
            layer, rest = name.split(".", 2)[1:]
            for i, c in enumerate(copies):
                if c == int(layer):
                    state[f"blocks.{i}.{rest}"] = looped.state_dict()[name]
    unrolled.load_state_dict(state)
    for block, c in zip(unrolled.blocks, copies):
        block.ln_scale_factor.fill_(looped.blocks[c].ln_factor)
    x = tokens()
    with torch.no_grad():
        assert torch.allclose(looped.forward_logits(x), unrolled.forward_logits(x), atol=1e-5)
        looped.recurring = False  # training before the switch: each layer once
        assert not torch.allclose(looped.forward_logits(x), unrolled.forward_logits(x), atol=1e-3)


def test_yarn_keeps_high_frequencies_interpolates_low_ones_and_only_beyond_the_training_length():
    import math

    from windowgpt_cli.model.rotary import rotary_inv_freq, rotary_magnitude

    within = [rotary_inv_freq(16, 10000.0, 2048, 2048, scaling=s) for s in ("ntk", "yarn")]
    assert torch.equal(within[0], within[1]) and rotary_magnitude(2048, 2048, "yarn") == 1.0
    base, stretched = within[0], rotary_inv_freq(16, 10000.0, 8192, 2048, scaling="yarn")
    turns = 2048 * base / (2 * math.pi)
    assert torch.equal(stretched[turns >= 32], base[turns >= 32])  # fast dimensions: kept
    assert torch.allclose(stretched[turns <= 1], base[turns <= 1] / 4)  # slow ones: interpolated 4-fold
    assert ((turns > 1) & (turns < 32)).any()  # and some blended between
    assert rotary_magnitude(8192, 2048, "yarn") == pytest.approx(0.1 * math.log(4) + 1)
    model = perturbed_tiny(rope_scaling="yarn")  # trained length 128: a window of 256 stretches
    cos, _ = model.rotary(256, torch.device("cpu"))
    assert cos[0, 0, 0].max() == pytest.approx(0.1 * math.log(2) + 1)
    assert torch.isfinite(model.forward_logits(tokens(256))).all()


@pytest.mark.parametrize("changes, message", [
    (dict(attn_out_gate_width=600), "attn_out_gate_width=600 must be at most model_dim=512"),
    (dict(parallel_start_layer=3), "parallel_start_layer=3 must be 0 or a decoder layer, 5..10"),
    (dict(recur_layers=(3, 5), recur_count=3), "consecutive"),
    (dict(recur_layers=(9, 10), recur_count=3), "lie in 0..9"),
    (dict(recur_layers=(), recur_count=3), "give the layers"),
    (dict(recur_layers=(6, 7, 8), parallel_start_layer=8), "before parallel_start_layer=8"),
    (dict(doc_boundary_token=1024), "doc_boundary_token=1024 is no token"),
])
def test_settings_are_checked(changes, message):
    cfg = RunConfig()
    for name, value in changes.items():
        setattr(cfg.model, name, value)
    with pytest.raises(SettingError, match=message):
        validate(cfg)


@pytest.mark.slow
def test_decoding_with_the_options_chooses_the_tokens_of_recomputation():
    model = perturbed_tiny(**OPTIONS)
    prompt = tokens(30)[0].tolist()
    prompt[10] = prompt[25] = 1
    runs = [generate(model, prompt, 150, temperature=0.0, use_cache=cache).samples for cache in (True, False)]
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_every_stage_takes_a_model_with_the_options(tiny_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # transformers copies the model's code there
    runner = CliRunner()

    def ok(*args: str) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, result.output
        return result.stdout

    run, export, ptz = tmp_path / "run", tmp_path / "export", tmp_path / "model.ptz"
    ok("train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(run), "--iterations", "6",
       "--warmdown-iters", "2", *OPTION_FLAGS)
    assert json.loads((run / "config.json").read_text())["model"]["attn_out_gate_width"] == 12
    assert "recurrence:on step:3 layers:1 count:2" in (run / "train.log").read_text()
    ok("export", str(run), "--out", str(export))
    report = json.loads(ok("quantize", str(export), "--out", str(ptz), "--gptq", "--data", str(tiny_data_dir),
                           "--json"))
    assert report["within_budget"] and report["model_bytes"] > 0
    from windowgpt_cli.artifacts.weights import load_weights

    loaded, trained = load_weights(ptz).state_dict, load_weights(export).state_dict
    for name in ("skip_gates", "blocks.0.attn.attn_gate"):  # small tensors pass in float16, as the reference's
        assert torch.equal(loaded[name].float(), trained[name].to(torch.float16).float())
    for command in (("eval", str(ptz), "--data", str(tiny_data_dir), "--stride", "32", "--json"),
                    ("eval-ttt", str(ptz), "--data", str(tiny_data_dir), "--json"),
                    ("eval-ttt", str(ptz), "--data", str(tiny_data_dir), "--method", "lora", "--json")):
        assert json.loads(ok(*command))["val_bpb"] > 0
    # the packed record code, run on its own, scores the artifact as the package does
    import subprocess
    import sys

    from windowgpt_cli.record.archive import pack

    pack(tmp_path / "code.pyz")
    args = ("eval", str(ptz), "--data", str(tiny_data_dir), "--stride", "32", "--device", "cpu", "--json")
    packed = subprocess.run([sys.executable, str(tmp_path / "code.pyz"), *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert packed.returncode == 0, packed.stderr[-3000:]
    assert json.loads(packed.stdout)["val_bpb"] == json.loads(ok(*args))["val_bpb"]
    assert "It was" in ok("generate", str(ptz), "--prompt", "It was", "--max-new-tokens", "8")
    assert "skip_gates" in ok("inspect", str(ptz))
    transformers = pytest.importorskip("transformers")  # the Hugging Face folder computes the same logits
    ok("export", str(run), "--out", str(tmp_path / "hf"), "--format", "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    from windowgpt_cli.model.gpt import build_model

    ours = build_model(load_weights(export).config.model, torch.device("cpu"), initialize=False)
    ours.load_state_dict(trained)
    x = tokens(40)
    with torch.no_grad():
        assert torch.equal(hf_model.eval()(x).logits, ours.eval().forward_logits(x))


def test_train_takes_the_vocabulary_of_the_datas_tokenizer(data_bytefallback_tokenizer, data_demo_corpus, tmp_path):
    """A data directory encoded with a 512-token tokenizer: without --vocab-size the model
    takes 512 (and says so); a --vocab-size that differs is refused as before."""
    from windowgpt_cli.data.prepare import prepare

    data = tmp_path / "data512"
    prepare([data_demo_corpus], data, tokenizer=data_bytefallback_tokenizer, val_fraction=0.05)
    runner = CliRunner()
    shown = runner.invoke(app, ["train", "--preset", "tiny", "--data", str(data), "--out", str(tmp_path / "r"),
                                "--dry-run"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["model"]["vocab_size"] == 512
    assert "note: vocab_size=512, the data's tokenizer's (not 1024)" in shown.output
    bad = runner.invoke(app, ["train", "--preset", "tiny", "--data", str(data), "--vocab-size", "1024", "--dry-run"])
    assert bad.exit_code == 1 and "has 512 tokens but vocab_size=1024" in bad.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_fused_scoring_and_graphed_decoding_take_the_options():
    """bf16 on CUDA: the fused scoring steps give torch's logits to bf16 rounding, and the
    compiled, graph-replayed decoder (a cache for each run of the looped layer) chooses
    greedy tokens of recomputing the context."""
    from windowgpt_cli.model.fused_ops import FusedOps
    from windowgpt_cli.model.gpt import use_cuda_dtypes

    model = perturbed_tiny(**OPTIONS)
    use_cuda_dtypes(model)
    model = model.cuda()
    model.set_attention_backend("auto", torch.device("cuda"))
    x = tokens(64).cuda()
    x[:, 30] = 1
    positions = torch.arange(32, 64, device="cuda").expand(2, -1)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        fused = model.logits_at(x, positions, ops=FusedOps()).float()
        reference = model.logits_at(x, positions).float()
    assert (fused - reference).abs().max() < 0.05 * reference.abs().max()
    prompt = tokens(30)[0].tolist()
    out = generate(model, prompt, 100, temperature=0.0, compile_step=True)
    assert_greedy_choices_of_recomputation(model, prompt, out.new_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_warm_up_compiles_every_state_and_training_compiles_nothing(tiny_data_dir, tmp_path):
    """Depth recurrence switched on half way and rounding to the grid (QAT) at three
    quarters: the warm-up compiles the graphs of the three states training takes, so no
    training step nor the validations (unrounded) compile another."""
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(run),
                                      "--device", "cuda", "--compile", "--iterations", "12", "--warmdown-iters", "4",
                                      "--val-loss-every", "6", "--qat-start-fraction", "0.75", "--warmup-steps", "3",
                                      *OPTION_FLAGS])
    assert result.exit_code == 0, result.output
    log = (run / "train.log").read_text()
    assert "recurrence:on step:6 layers:1 count:2" in log and "qat:on step:9" in log
    assert json.loads((run / "summary.json").read_text())["graphs_compiled_in_training"] == 0, log
