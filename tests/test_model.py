"""The model: shapes, causality, and compatibility with the reference's state dicts."""
import dataclasses
import importlib
import math
import sys

import pytest
import torch

from windowgpt_cli.config import ModelConfig, tiny_preset
from windowgpt_cli.model.attention import may_attend
from windowgpt_cli.model.gpt import GPT, build_model, matmul_dtype, use_cuda_dtypes, window_key_rows
from windowgpt_cli.model.state_dict import rebank_state_dict, unbank_state_dict
from windowgpt_cli.model.ops import rms_norm, scaled_rms_norm


def perturbed_tiny(**changes) -> GPT:
    """The tiny model with every weight moved off its (partly zero) initialization."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(tiny_preset().model, **changes), torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_shapes_and_finite_loss():
    model = perturbed_tiny()
    x = torch.randint(0, 1024, (3, 40))
    assert model.forward_logits(x).shape == (3, 40, 1024)
    assert model.token_nll(x, x).shape == (3, 40)
    loss = model(x, x)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert torch.allclose(loss, model.token_nll(x, x).mean(), atol=1e-6)


@pytest.mark.parametrize("changes", [
    dict(window_attn_size=0, num_sink_tokens=0),  # full causal in the last layer
    dict(window_attn_size=8, num_sink_tokens=3, window_attn_layers=(1, 3)),  # the last layer windowed, with sinks
])
def test_logits_at_positions_equal_the_full_logits_there(changes):
    """The last block runs only at the asked positions: the same logits as the whole
    sequence's, for any positions (unsorted, repeated, the first and the last)."""
    model = perturbed_tiny(**changes)
    x = torch.randint(0, 1024, (3, 40))
    positions = torch.stack([torch.arange(24, 40), torch.arange(0, 16), torch.randint(0, 40, (16,))])
    positions[2, :2] = torch.tensor([0, 39])
    seen: dict[str, tuple[int, ...]] = {}
    last = model.num_layers - 1
    with torch.no_grad(), model.observe_linear_inputs(lambda names, inp: seen.update({names[0]: inp.shape})):
        picked = model.logits_at(x, positions)
    full = model.forward_logits(x).detach()
    expected = full.gather(1, positions[..., None].expand(-1, -1, full.size(-1)))
    assert torch.allclose(picked, expected, atol=1e-5)
    assert seen[f"blocks.{last}.mlp.fc.weight"] == (3, 16, model.cfg.model_dim)  # only the asked positions
    assert seen[f"blocks.{last}.attn.c_q.weight"] == (3, 40, model.cfg.model_dim)  # keys and values: all


def query_runs(firsts: list[int], count: int, seq_len: int) -> torch.Tensor:
    """Each row's `count` positions from its first, clamped to the sequence, as sliding
    evaluation asks for them."""
    return (torch.tensor(firsts)[:, None] + torch.arange(count)).clamp(max=seq_len - 1)


@pytest.mark.parametrize("window, sinks", [(8, 3), (8, 0), (20, 4)])
def test_window_key_rows_hold_every_key_a_query_sees_once(window, sinks):
    seq_len, count = 40, 6
    queries = query_runs([0, 1, 5, 12, 30, 37, 39], count, seq_len)
    keys = window_key_rows(queries, seq_len, window, sinks)
    assert keys.positions.shape == keys.valid.shape == (7, sinks + window + count)
    assert torch.equal(keys.positions.gather(1, keys.queries), queries)
    assert keys.valid.gather(1, keys.queries).all()
    everything = torch.arange(seq_len)
    for b in range(queries.size(0)):
        rows = keys.positions[b][keys.valid[b]]
        assert rows.unique().numel() == rows.numel()  # no key twice
        for q in queries[b]:
            seen = everything[may_attend(q, everything, window, sinks)]
            assert set(seen.tolist()) <= set(rows.tolist())
    # values at the rows go back to their positions; every other position holds zeros
    values = keys.positions.float()[..., None] + 1
    spread = keys.spread(values)
    assert spread.shape == (7, seq_len, 1)
    for b in range(queries.size(0)):
        held = keys.positions[b][keys.valid[b]]
        assert torch.equal(spread[b, held, 0], held.float() + 1)
        assert spread[b].sum() == (held.float() + 1).sum()


@pytest.mark.parametrize("changes, trimmed", [
    (dict(window_attn_size=8, num_sink_tokens=3, window_attn_layers=(1, 3)), True),  # the last layer windowed
    (dict(window_attn_size=8, num_sink_tokens=3, window_attn_layers=(1, 2)), False),  # the last layer full
])
def test_logits_at_query_runs_work_only_where_the_last_block_reads(changes, trimmed):
    """With runs of queries the block before a windowed last block runs its MLP at the
    rows the last block reads, not the whole sequence; the logits do not change."""
    model = perturbed_tiny(**changes)
    x = torch.randint(0, 1024, (4, 48))
    positions = query_runs([0, 5, 30, 44], 8, 48)
    seen: dict[str, tuple[int, ...]] = {}
    with torch.no_grad(), model.observe_linear_inputs(lambda names, inp: seen.update({names[0]: inp.shape})):
        runs = model.logits_at(x, positions, query_runs=True)
    before_last = f"blocks.{model.num_layers - 2}.mlp.fc.weight"
    assert seen[before_last][1] == (3 + 8 + 8 if trimmed else 48)
    assert seen[f"blocks.{model.num_layers - 1}.mlp.fc.weight"][1] == 8
    with torch.no_grad():
        assert torch.allclose(runs, model.logits_at(x, positions), atol=1e-6)


@pytest.mark.parametrize("changes", [
    dict(window_attn_size=0, num_sink_tokens=0),  # full causal everywhere
    dict(window_attn_size=8, num_sink_tokens=0),  # sliding windows
    dict(window_attn_size=8, num_sink_tokens=3),  # windows with sinks
])
def test_changing_a_later_token_never_changes_earlier_logits(changes):
    model = perturbed_tiny(**changes)
    assert model.cfg.xsa_last_n > 0 and model.bigram is not None and model.ve_shared is not None
    x = torch.randint(0, 1024, (2, 48))
    base = model.forward_logits(x)
    for pos in (5, 20, 47):
        changed = x.clone()
        changed[:, pos] = (changed[:, pos] + 17) % 1024
        out = model.forward_logits(changed)
        assert torch.equal(out[:, :pos], base[:, :pos])
        assert not torch.allclose(out[:, pos:], base[:, pos:])


def test_window_limits_what_a_query_sees():
    """With windows on every layer the receptive field is bounded: a token far in the past
    (outside layers x window, and not a sink) cannot influence the last logits."""
    cfg = dict(num_layers=2, window_attn_size=4, window_attn_layers=(0, 1), num_sink_tokens=2,
               ve_layers=(1,), xsa_last_n=1, bigram_vocab_size=0)
    model = perturbed_tiny(**cfg)
    x = torch.randint(0, 1024, (1, 40))
    changed = x.clone()
    changed[0, 10] += 1  # 29 positions before the last; the field spans 2 layers x 4 + smear
    assert torch.equal(model.forward_logits(changed)[0, -1], model.forward_logits(x)[0, -1])
    sink_changed = x.clone()
    sink_changed[0, 1] += 1  # a sink token is always seen
    assert not torch.equal(model.forward_logits(sink_changed)[0, -1], model.forward_logits(x)[0, -1])


def test_unbank_rebank_round_trip():
    model = perturbed_tiny()
    sd = model.state_dict()
    flat = unbank_state_dict(sd, model.num_layers)
    assert "blocks.3.mlp.proj.weight" in flat and "qo_bank" not in flat
    assert flat["blocks.1.attn.proj.weight"].shape == (64, 64)
    back = rebank_state_dict(flat, model.num_layers)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_ntk_rescaling_beyond_training_length_changes_rotary():
    model = perturbed_tiny(rope_train_seq_len=32)
    x = torch.randint(0, 1024, (1, 64))
    long = model.forward_logits(x)
    model.cfg.rope_train_seq_len = 64
    assert not torch.allclose(long, model.forward_logits(x))


def _reference_module(shared_dir):
    sys.path[:0] = [str(shared_dir / "seed" / "shim"), str(shared_dir / "seed")]
    try:
        return importlib.import_module("train_gpt_window")
    except ImportError as exc:
        pytest.skip(f"reference not importable: {exc}")


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.slow
def test_reference_state_dict_loads_strictly_and_gives_same_logits(shared_dir, tie):
    ref = _reference_module(shared_dir)
    cfg = ModelConfig(num_layers=5, model_dim=128, num_heads=4, num_kv_heads=2, mlp_mult=2.0, rope_dims=16,
                      xsa_last_n=2, bigram_vocab_size=256, bigram_dim=64, ve_dim=64, ve_layers=(3, 4),
                      rope_train_seq_len=32, tie_embeddings=tie)
    torch.manual_seed(0)
    reference = ref.GPT(vocab_size=1024, num_layers=5, model_dim=128, num_heads=4, num_kv_heads=2, mlp_mult=2.0,
                        tie_embeddings=tie, tied_embed_init_std=0.005, logit_softcap=30.0, rope_base=10000.0,
                        qk_gain_init=1.5, bigram_vocab_size=256, bigram_dim=64, xsa_last_n=2, rope_dims=16,
                        ln_scale=True, ve_enabled=True, ve_dim=64, ve_layers="3,4", neg_slope=0.5, train_seq_len=32)
    torch.manual_seed(0)
    ours = GPT(cfg)
    ref_sd = reference.state_dict()
    assert list(ref_sd) == list(ours.state_dict())
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in ref_sd.items()), "initialization differs"
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours.load_state_dict(reference.state_dict(), strict=True)
    for length in (32, 48):  # 48 exercises the NTK-rescaled rotary tables
        x = torch.randint(0, 1024, (2, length))
        assert torch.allclose(ours.forward_logits(x), reference.forward_logits(x), atol=1e-6)
        assert torch.allclose(ours(x, x), reference(x, x), atol=1e-6)
    # The same operations in the same order: training's gradients are the reference's, bit for bit.
    ours(x, x).backward()
    reference(x, x).backward()
    reference_grads = dict(reference.named_parameters())
    assert all(torch.equal(p.grad, reference_grads[name].grad) for name, p in ours.named_parameters())


def test_layer_scale_is_a_float32_constant_outside_the_state_dict():
    """Each block's 1/sqrt(layer + 1) is a float32 tensor (so that a compiled model's blocks
    share their kernels), stays float32 under the CUDA dtypes, is in no state dict (the
    reference's load strictly), and scales bfloat16 inputs as the Python float would."""
    model = perturbed_tiny()
    use_cuda_dtypes(model)
    assert model.tok_emb.weight.dtype == torch.bfloat16 and model.qo_bank.dtype == torch.float32
    assert not any("ln_scale" in name for name in model.state_dict())
    x = torch.randn(2, 5, model.cfg.model_dim)
    for i, block in enumerate(model.blocks):
        factor = 1 / math.sqrt(i + 1)
        assert block.ln_scale_factor.dtype == torch.float32
        for inputs in (x, x.bfloat16()):
            assert torch.equal(scaled_rms_norm(inputs, block.ln_scale_factor), rms_norm(inputs) * factor)


def test_layer_weights_are_the_bank_slots_cast_once():
    model = perturbed_tiny()
    flat = unbank_state_dict(model.state_dict(), model.num_layers)
    names = ("attn.c_q", "attn.c_k", "attn.c_v", "attn.proj", "mlp.fc", "mlp.proj")
    for i, weights in enumerate(model.layer_weights(torch.bfloat16)):
        for name, weight in zip(names, weights, strict=True):
            assert torch.equal(weight, flat[f"blocks.{i}.{name}.weight"].bfloat16())
    x = torch.randn(3, 4)
    assert matmul_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert matmul_dtype(x) == torch.bfloat16


def test_an_uninitialized_model_takes_loaded_weights_and_gives_the_same_logits():
    torch.manual_seed(0)
    model = GPT(tiny_preset().model)
    blank = GPT(tiny_preset().model, initialize=False)
    blank.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, 1024, (2, 16))
    assert torch.equal(model.forward_logits(ids), blank.forward_logits(ids))


def test_rotary_tables_up_to_the_training_length_are_made_once_and_equal_fresh_ones():
    """Sequences up to rope_train_seq_len read slices of tables the model made once (no
    state-dict entry); longer ones are computed per call, rescaled; a model built on the
    meta device gets its tables back from restore_constants."""
    from windowgpt_cli.model.rotary import rotary_inv_freq, rotary_magnitude, rotary_tables

    cfg = dataclasses.replace(tiny_preset().model, rope_scaling="yarn")
    model = GPT(cfg)
    assert not any(name.startswith("rotary_") for name in model.state_dict())
    for length, start in ((1, 0), (64, 10), (cfg.rope_train_seq_len, 0), (3 * cfg.rope_train_seq_len, 5)):
        cos, sin = model.rotary(length, torch.device("cpu"), start)
        inv_freq = rotary_inv_freq(model.rotary_dims, cfg.rope_base, length, cfg.rope_train_seq_len,
                                   scaling=cfg.rope_scaling)
        fresh_cos, fresh_sin = rotary_tables(length, inv_freq)
        magnitude = rotary_magnitude(length, cfg.rope_train_seq_len, cfg.rope_scaling)
        assert torch.equal(cos, (fresh_cos * magnitude)[:, start:])
        assert torch.equal(sin, (fresh_sin * magnitude)[:, start:])
        shared = cos.untyped_storage().data_ptr() == model.rotary_cos.untyped_storage().data_ptr()
        assert shared == (length <= cfg.rope_train_seq_len), length
    with torch.device("meta"):
        empty = GPT(cfg, initialize=False)
    empty.to_empty(device="cpu")
    empty.restore_constants()
    assert torch.equal(empty.rotary_cos, model.rotary_cos) and torch.equal(empty.rotary_sin, model.rotary_sin)


def test_a_models_shapes_come_from_the_meta_device_without_importing_torchdynamo():
    """Every stage that reads weights checks their shapes first: building the model on the
    meta device must stay instant, which importing TorchDynamo (seconds on a CPU) is not."""
    import subprocess

    probe = ("import sys; from windowgpt_cli.config import RunConfig; "
             "from windowgpt_cli.artifacts.shapes import expected_shapes; "
             "assert expected_shapes(RunConfig().model, per_layer=True); print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
