"""Shard headers, the sampler's determinism and resumability, and the prefetcher."""
import numpy as np
import pytest
import torch

from windowgpt_cli.data.loader import Prefetcher, TokenStream
from windowgpt_cli.errors import DataError
from windowgpt_cli.data.shards import encode_shard, list_shards, load_tokens, read_token_count, write_shard


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate((5000, 3000, 800, 20)):  # the last is too short for one window
        paths.append(write_shard(tmp_path / f"fineweb_train_{i:06d}.bin", rng.integers(0, 500, n)))
    return paths


def test_shard_round_trip_and_listing(tmp_path):
    tokens = np.arange(1000) % 65535
    write_shard(tmp_path / "fineweb_val_000000.bin", tokens)
    assert read_token_count(tmp_path / "fineweb_val_000000.bin") == 1000
    assert torch.equal(load_tokens(list_shards(tmp_path, "val")).long(), torch.from_numpy(tokens).long())
    with pytest.raises(DataError, match="no train shards"):
        list_shards(tmp_path, "train")


@pytest.mark.parametrize("corrupt,message", [
    (lambda b: b[:100], "truncated"),
    (lambda b: b"\x00" * 4 + b[4:], "magic"),
    (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "version"),
    (lambda b: b[:-2], "bytes"),
])
def test_bad_shard_headers_name_the_file(tmp_path, corrupt, message):
    path = tmp_path / "fineweb_train_000000.bin"
    path.write_bytes(corrupt(encode_shard(np.arange(50))))
    with pytest.raises(DataError, match=message) as err:
        read_token_count(path)
    assert str(path) in str(err.value)


def _batches(stream, n, seq_len=16):
    return [stream.next_batch(8 * 4 * seq_len, seq_len, 4) for _ in range(n)]


def test_sampler_is_deterministic_from_the_seed_not_the_paths(shards, tmp_path):
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    copies = []
    for p in shards:
        copies.append(moved / p.name)
        copies[-1].write_bytes(p.read_bytes())
    a = _batches(TokenStream(shards, seed=7), 30)
    b = _batches(TokenStream(copies, seed=7), 30)
    c = _batches(TokenStream(shards, seed=8), 30)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b))
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, c))
    x, y = a[0]
    assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_windows_are_contiguous_runs_of_the_shard(shards):
    stream = TokenStream(shards[:1], seed=1)
    data = np.asarray(load_tokens(shards[:1]), dtype=np.int64)
    for _ in range(9):  # 9 x 8 windows of 33 tokens < one pass over 5000 tokens
        x, y = stream.next_batch(8 * 32, 32, 1)
        for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
            hits = np.flatnonzero((data[:-32] == row[0]))
            assert any(np.array_equal(data[h:h + 33], row) for h in hits)


def test_state_restores_the_exact_continuation(shards):
    stream = TokenStream(shards, seed=3)
    _batches(stream, 5)
    state = stream.state_dict()
    expected = _batches(stream, 10)
    resumed = TokenStream(shards, seed=999)
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, _batches(resumed, 10)))


def test_prefetcher_yields_the_stream_order_and_tracks_consumed_state(shards):
    direct = _batches(TokenStream(shards, seed=5), 6)
    stream = TokenStream(shards, seed=5)
    pre = Prefetcher(stream, 8 * 4 * 16, 16, 4, torch.device("cpu"), depth=3)
    try:
        got = [pre.next() for _ in range(4)]
        state = pre.state_dict()
    finally:
        pre.close()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(direct, got))
    again = TokenStream(shards, seed=0)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch(8 * 4 * 16, 16, 4)[0], direct[4][0])


def test_out_of_vocabulary_tokens_are_an_error(shards):
    stream = TokenStream(shards, seed=0, vocab_size=100)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        stream.next_batch(8 * 16, 16, 1)


def test_a_pass_is_the_next_micro_batches_in_the_stream_order(shards):
    direct = _batches(TokenStream(shards, seed=7), 4)
    stream = TokenStream(shards, seed=7)
    pre = Prefetcher(stream, 8 * 4 * 16, 16, 4, torch.device("cpu"), depth=2, per_pass=2)
    try:
        passes = [pre.next() for _ in range(2)]
        state = pre.state_dict()
    finally:
        pre.close()
    for (x, y), pair in zip(passes, (direct[:2], direct[2:])):
        assert torch.equal(x, torch.cat([b[0] for b in pair])) and torch.equal(y, torch.cat([b[1] for b in pair]))
    again = TokenStream(shards, seed=0)
    again.load_state_dict(state)  # the state after a pass is the state after its last micro-batch
    assert torch.equal(again.next_batch(8 * 4 * 16, 16, 4)[0], _batches(TokenStream(shards, seed=7), 5)[4][0])
