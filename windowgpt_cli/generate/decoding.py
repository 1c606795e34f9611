"""Text generation: incremental decoding with a key/value cache that follows each layer's
attention.

A full causal layer keeps the keys and values of every position; a windowed layer keeps
only its sink tokens and its last `window` positions, in a ring, so its memory stays
bounded however long the text grows. What depends on neighbouring positions is carried
over: the bigram hash and SmearGate read the previous tokens, rotary positions continue.
The logits are those of recomputing the whole context at every step (`recompute_logits`).

The context is capped at the model's trained length (`rope_train_seq_len`): beyond it the
rotary tables are rescaled for the whole sequence, which a cache cannot follow. When the
text outgrows the cap, the context drops its oldest tokens in jumps, keeping the last
three quarters, and the cache is rebuilt from them (`context_start` says which tokens the
model sees at every length; the recomputation follows the same rule).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.tokenizer import BOS_ID, load_sentencepiece
from ..model.attention import may_attend
from ..model.gpt import GPT
from ..runtime import autocast, synchronize

# x0 of a position depends on the two tokens before it: SmearGate blends in the previous
# position's normed embedding, whose bigram hash reads the token before that.
EMBED_LOOKBEHIND = 2
SAMPLE_TOKENS = 32  # the length of the samples training logs


def context_start(length: int, limit: int) -> int:
    """The index of the first token the model sees when the text holds `length` tokens:
    0 up to `limit`; beyond it, the context restarts with the last 3/4 of `limit` tokens and
    grows again to `limit` (so a cache is rebuilt once every limit/4 tokens)."""
    if length <= limit:
        return 0
    keep = limit - limit // 4
    period = limit - keep + 1
    return length - keep - (length - limit - 1) % period


class LayerCache:
    """One layer's keys and values. Bounded (a windowed layer shorter than the context):
    slots 0..sinks-1 hold the sink tokens, the next `window` slots a ring of the latest
    positions. Otherwise slot p holds position p. Either way the filled slots are a prefix."""

    def __init__(self, window: int, sinks: int, limit: int):
        self.window, self.sinks = window, sinks
        self.bounded = 0 < window and sinks + window < limit
        self.capacity = sinks + window if self.bounded else limit
        self.length = 0  # positions seen
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.positions: Tensor | None = None  # [capacity], position held by each slot

    @property
    def filled(self) -> int:
        return min(self.length, self.capacity)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> Tensor:
        """Attention of the new positions' queries q [B, n, H, D] over the cached keys and
        the new ones k, v [B, n, Hkv, D], by the rule of `attention.may_attend`; then the
        new keys and values are kept as far as later positions will need them."""
        n = q.shape[1]
        new_positions = torch.arange(self.length, self.length + n, device=q.device)
        keys, values, key_positions = k, v, new_positions
        if self.k is not None and self.filled:
            keys = torch.cat((self.k[:, :self.filled], k), dim=1)
            values = torch.cat((self.v[:, :self.filled], v), dim=1)
            key_positions = torch.cat((self.positions[:self.filled], new_positions))
        visible = may_attend(new_positions[:, None], key_positions[None, :], window, sinks)
        group = q.shape[2] // keys.shape[2]
        if group > 1:  # the heads of a group share keys and values
            keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=visible)
        self._store(k, v)
        return y.transpose(1, 2)

    def _store(self, k: Tensor, v: Tensor) -> None:
        n = k.shape[1]
        end = self.length + n
        if self.k is None:
            shape = (k.shape[0], self.capacity, *k.shape[2:])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
            self.positions = torch.full((self.capacity,), -1, dtype=torch.long, device=k.device)
        if self.bounded:  # later queries see the sinks and the last `window` positions only
            kept = [p for p in range(self.length, end) if p < self.sinks or p >= end - self.window]
            slots = [p if p < self.sinks else self.sinks + (p - self.sinks) % self.window for p in kept]
        else:
            kept = slots = list(range(self.length, end))
        if kept:
            rows = torch.tensor([p - self.length for p in kept], device=k.device)
            index = torch.tensor(slots, device=k.device)
            self.k[:, index] = k[:, rows].to(self.k.dtype)
            self.v[:, index] = v[:, rows].to(self.v.dtype)
            self.positions[index] = torch.tensor(kept, device=k.device)
        self.length = end


class CachedDecoder:
    """The model's next-token logits for a growing list of tokens, each token run once
    (until the context restarts: see `context_start`)."""

    def __init__(self, model: GPT, limit: int | None = None):
        self.model = model
        self.limit = limit or model.cfg.rope_train_seq_len
        self.device = model.tok_emb.weight.device
        self.caches: list[LayerCache] | None = None
        self.start = 0  # index of the context's first token
        self.fed = 0  # tokens already in the caches (an index into the text)
        self.restarts = 0

    def next_logits(self, tokens: Sequence[int]) -> Tensor:
        """Logits [V] (float32) for the token after `tokens`, which extend those of the
        previous call."""
        start = context_start(len(tokens), self.limit)
        if self.caches is None or start != self.start:
            self.restarts += self.caches is not None
            self.start, self.fed = start, start
            self.caches = [LayerCache(block.attn.window, block.attn.sinks, self.limit) for block in self.model.blocks]
        context = tokens[self.start:]
        first_new = self.fed - self.start
        ids = torch.tensor(context[max(0, first_new - EMBED_LOOKBEHIND):], device=self.device)[None]
        new_ids = ids[:, -(len(context) - first_new):]
        with self._installed():
            x0 = self.model.embed(ids)[:, -new_ids.shape[1]:]
            rotary = self.model.rotary(len(context), self.device, start=first_new)
            hidden = self.model.trunk(new_ids, x0, rotary)
        self.fed = len(tokens)
        return self.model.logits(hidden[0, -1]).float()

    @contextlib.contextmanager
    def _installed(self) -> Iterator[None]:
        for block, cache in zip(self.model.blocks, self.caches):
            block.attn.kv_cache = cache
        try:
            yield
        finally:
            for block in self.model.blocks:
                block.attn.kv_cache = None


class RecomputingDecoder:
    """The same logits, recomputed over the whole context at every step: the definition
    the cache must match (and a baseline for its speed)."""

    def __init__(self, model: GPT, limit: int | None = None):
        self.model = model
        self.limit = limit or model.cfg.rope_train_seq_len
        self.device = model.tok_emb.weight.device
        self.restarts = 0

    def next_logits(self, tokens: Sequence[int]) -> Tensor:
        context = tokens[context_start(len(tokens), self.limit):]
        ids = torch.tensor(context, device=self.device)[None]
        return self.model.forward_logits(ids)[0, -1].float()


def pick_token(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise a draw (on the CPU, so that a seed gives the same
    text on every device) from the softmax of logits / temperature over the top_k tokens
    (all when top_k is 0)."""
    logits = logits.detach().float().cpu()
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@dataclass
class Generation:
    prompt_tokens: list[int]
    new_tokens: list[int]
    prefill_seconds: float  # the prompt, up to the first new token's logits
    decode_seconds: float  # every later token
    context_restarts: int  # times the context outgrew the trained length and restarted

    @property
    def tokens_per_second(self) -> float:
        """New tokens after the first, per second of decoding."""
        decoded = len(self.new_tokens) - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else 0.0


def generate(model: GPT, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, use_cache: bool = True, stop_token: int | None = None) -> Generation:
    """Continue `prompt` (token ids, at least one) by up to max_new_tokens tokens; stops
    early after `stop_token`. Runs under bf16 autocast on CUDA, as the other stages."""
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    device = model.tok_emb.weight.device
    decoder = CachedDecoder(model) if use_cache else RecomputingDecoder(model)
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    t0 = time.perf_counter()
    prefill = 0.0
    with torch.inference_mode(), autocast(device):
        for i in range(max_new_tokens):
            token = pick_token(decoder.next_logits(tokens), temperature, top_k, generator)
            tokens.append(token)
            if i == 0:
                synchronize(device)
                prefill = time.perf_counter() - t0
            if token == stop_token:
                break
    synchronize(device)
    total = time.perf_counter() - t0
    return Generation(list(prompt), tokens[len(prompt):], prefill, total - prefill, decoder.restarts)


def greedy_sample(model: GPT, tokenizer: Path, prompt: str, max_new_tokens: int = SAMPLE_TOKENS) -> str:
    """The model's greedy continuation of prompt, as a document's start (after BOS)."""
    sp = load_sentencepiece(tokenizer)
    out = generate(model, [BOS_ID, *sp.encode(prompt)], max_new_tokens, stop_token=BOS_ID)
    return continuation(sp, out)


def continuation(sp, out: Generation) -> str:
    """The new tokens' text as it follows the prompt's (decoded on their own, a leading space
    would be dropped); a BOS, which starts the next document, is left out."""
    prompt = sp.decode(out.prompt_tokens)
    return sp.decode(out.prompt_tokens + [t for t in out.new_tokens if t != BOS_ID])[len(prompt):]
