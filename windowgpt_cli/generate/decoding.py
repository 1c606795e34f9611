"""Text generation: a batch of samples decoded one token at a time over static key/value
buffers, the prompt prefilled in one forward, each later step the same fixed-shape work (on
CUDA compiled, and replayed as a CUDA graph).

Each layer keeps what its attention will read again (`StaticCache`): a full causal layer
every position of the context, a windowed layer only its sink tokens and its last `window`
positions plus the current one, in a ring, so its memory stays bounded however long the
text grows. What depends on neighbouring positions is carried from step to step: the
bigram hash reads the previous token and SmearGate the previous position's normed
embedding; rotary tables are built once, for the whole context, and read at the step's
position. The logits are those of recomputing the whole context at every step
(`RecomputingDecoder`, the definition the tests hold the cache to).

The context is capped at the model's trained length (`rope_train_seq_len`): beyond it the
rotary tables are rescaled for the whole sequence, which a cache cannot follow. When the
text outgrows the cap, the context drops its oldest tokens in jumps, keeping the last three
quarters, and is prefilled again (`context_start` says which tokens the model sees at every
length; the recomputation follows the same rule).

Sampling draws its noise from a counter-based hash of (seed, sample, position), not from a
generator's state: a sample's text depends on its seed and index alone, the same in a batch
of 64 as on its own, and the draw is part of the step a CUDA graph replays.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.tokenizer import BOS_ID, TextCodec, load_text_codec
from ..model.attention import attention, may_attend
from ..model.gpt import GPT, matmul_dtype
from ..model.ops import embed_sum
from ..runtime import autocast, compiled, synchronize

SAMPLE_TOKENS = 32  # the length of the samples training logs
OnTokens = Callable[[list[list[int]]], None]  # after each step: every sample's new tokens so far


def context_start(length: int, limit: int) -> int:
    """The index of the first token the model sees when the text holds `length` tokens:
    0 up to `limit`; beyond it, the context restarts with the last 3/4 of `limit` tokens and
    grows again to `limit` (so the caches are filled again once every limit/4 tokens)."""
    if length <= limit:
        return 0
    keep = limit - limit // 4
    period = limit - keep + 1
    return length - keep - (length - limit - 1) % period


class CacheLayout:
    """Where the layers of one (window, sinks) keep their keys in a static buffer of
    `capacity` slots, and which slots a query at each position sees. Bounded (a window
    shorter than the context): slots 0..sinks-1 hold the sink tokens, the next window + 1 a
    ring of the latest positions; otherwise slot p holds position p. Both rules are tables
    over the context's positions, built once, so a step looks its slot and its additive
    mask up (`at`) once for all the layers that share them."""

    def __init__(self, window: int, sinks: int, limit: int, dtype: torch.dtype, device: torch.device):
        self.window, self.sinks = window, sinks
        self.bounded = 0 < window and sinks + window + 1 < limit
        self.capacity = sinks + window + 1 if self.bounded else limit
        positions = torch.arange(limit, device=device)
        self.slot_of = self.slots(positions)  # [limit]
        held = self._held(positions)  # [limit, capacity]: the position each slot holds
        visible = (held >= 0) & may_attend(positions[:, None], held, window, sinks)
        self.masks = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        self.slot = self.slot_of[:1]
        self.mask = self.masks[:1, None, None]

    def slots(self, positions: Tensor) -> Tensor:
        if not self.bounded:
            return positions
        return torch.where(positions < self.sinks, positions, self.sinks + (positions - self.sinks) % (self.window + 1))

    def _held(self, positions: Tensor) -> Tensor:
        """held[p, s]: the position slot s holds once position p is stored (-1: none yet),
        the latest p' <= p with slot(p') = s."""
        p, s = positions[:, None], torch.arange(self.capacity, device=positions.device)[None, :]
        if not self.bounded:
            return torch.where(s <= p, s, -1)
        ring = p - (p - s) % (self.window + 1)  # s - sinks = (p' - sinks) mod (window + 1)
        return torch.where(s < self.sinks, torch.where(s <= p, s, -1), torch.where(ring >= self.sinks, ring, -1))

    def at(self, position: Tensor) -> None:
        """This step's slot [1] and mask [1, 1, 1, capacity], for a position (0-d tensor)."""
        self.slot = self.slot_of.index_select(0, position.view(1))
        self.mask = self.masks.index_select(0, position.view(1)).view(1, 1, 1, -1)


class StaticCache:
    """One layer's keys and values in fixed buffers [batch, kv_heads, capacity, head_dim]
    (the layout attention reads, so a step copies nothing but its own key and value)."""

    def __init__(self, decoder: "StaticDecoder", layout: CacheLayout):
        self.decoder, self.layout = decoder, layout
        cfg = decoder.model.cfg
        shape = (decoder.batch, cfg.num_kv_heads, layout.capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=decoder.dtype, device=decoder.device)
        self.v = torch.zeros_like(self.k)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> Tensor:
        """The attention of the new positions' queries q [B, n, H, D]: a prefill's (the
        context's first n positions) over its own keys, or one step's over the buffers once
        its key is stored (`may_attend`'s rule either way)."""
        if self.decoder.prefilling:
            y = attention(q, k, v, window, sinks, "sdpa")
            self._store_prefix(k, v)
            return y
        layout, dtype = self.layout, self.k.dtype
        self.k.index_copy_(2, layout.slot, k.transpose(1, 2).to(dtype))
        self.v.index_copy_(2, layout.slot, v.transpose(1, 2).to(dtype))
        y = F.scaled_dot_product_attention(q.transpose(1, 2).to(dtype), self.k, self.v, attn_mask=layout.mask,
                                           enable_gqa=q.shape[2] != k.shape[2])
        return y.transpose(1, 2)

    def _store_prefix(self, k: Tensor, v: Tensor) -> None:
        """Keep the keys and values of the context's first n positions that later steps read."""
        n = k.shape[1]
        keep = torch.arange(n, device=k.device)
        layout = self.layout
        if layout.bounded:  # the sinks, and the positions a later query may still see
            keep = keep[(keep < layout.sinks) | (keep >= n - layout.window - 1)]
        slots = layout.slots(keep)
        self.k.index_copy_(2, slots, k[:, keep].transpose(1, 2).to(self.k.dtype))
        self.v.index_copy_(2, slots, v[:, keep].transpose(1, 2).to(self.v.dtype))


class CycledCache:
    """The caches of a layer that runs several times a forward (depth recurrence), one per
    run, each call the next: a forward's runs of the layer, in order, cycle once through them."""

    def __init__(self, caches: list[StaticCache]):
        self.caches, self.turn = caches, 0

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> Tensor:
        cache = self.caches[self.turn]
        self.turn = (self.turn + 1) % len(self.caches)
        return cache.attend(q, k, v, window, sinks)


class StaticDecoder:
    """Next-token choices for a batch of samples of one growing text: the context prefilled
    once, then one fixed-shape step per token, compiled (compile_step) and on CUDA, from its
    second call, replayed as a CUDA graph (graphs). Used as a context manager:
    while it is entered, the model's attention layers read and write its caches."""

    def __init__(self, model: GPT, batch: int, *, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
                 limit: int | None = None, compile_step: bool = False, graphs: bool = True):
        self.model, self.batch = model, batch
        self.limit = limit or model.cfg.rope_train_seq_len
        self.device = model.tok_emb.weight.device
        self.dtype = matmul_dtype_on(self.device, model)
        with autocast(self.device):
            self.weights = model.layer_weights(self.dtype, stack_qkv=True)  # cast once, not at every token
        self.cos, self.sin = model.rotary(self.limit, self.device)
        self.layouts: dict[tuple[int, int], CacheLayout] = {}
        for block in model.blocks:
            geometry = (block.attn.window, block.attn.sinks)
            if geometry not in self.layouts:
                self.layouts[geometry] = CacheLayout(*geometry, self.limit, self.dtype, self.device)
        runs = model.cfg.block_order(model.recurring)  # a looped layer keeps a cache for each of its runs
        self.caches: list[StaticCache | CycledCache] = []
        for i, block in enumerate(model.blocks):
            caches = [StaticCache(self, self.layouts[block.attn.window, block.attn.sinks])
                      for _ in range(max(runs.count(i), 1))]
            self.caches.append(caches[0] if len(caches) == 1 else CycledCache(caches))
        self.position = torch.zeros((), dtype=torch.long, device=self.device)  # in the context
        self.offset = torch.zeros((), dtype=torch.long, device=self.device)  # the context's start in the text
        self.token = torch.zeros(batch, dtype=torch.long, device=self.device)  # the step's input, then its output
        self.previous = torch.zeros(batch, dtype=torch.long, device=self.device)  # the token before it
        self.previous_source: Tensor | None = None  # what its SmearGate blends [B, 1, D]
        self.chooser = Chooser(batch, temperature, top_k, seed, self.device)
        self.prefilling = False
        self.start = 0  # index of the context's first token in the text
        self.restarts = -1  # context fills after the first
        self.graphs = graphs and self.device.type == "cuda"
        self.run_step = compiled(self._step, compile_step)
        self.warmup_steps = 2 if self.graphs else int(compile_step)  # the steps that compile, then capture
        self.replay: Callable[[], None] | None = None
        self.steps = 0
        self.stream = torch.cuda.Stream(self.device) if self.graphs else None
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(batch, dtype=torch.long, pin_memory=cuda)  # the tokens sent to the host
        self.sent = torch.cuda.Event() if cuda else None

    # --- the context ---

    def prefill(self, ids: Tensor, start: int) -> Tensor:
        """Fill the caches with each sample's context ids [B, n] (tokens start.. of its text)
        and choose its next token; returns the tokens [B] on the device."""
        self.start, self.restarts = start, self.restarts + 1
        self.offset.fill_(start)
        with autocast(self.device):
            self.prefilling = True
            try:
                source = self._smear_source(ids)
                x0 = self.model.smear(source, ids, self.model.cfg.doc_boundary_token)
                n = ids.shape[1]
                hidden = self.model.trunk(ids, x0, (self.cos[:, :n], self.sin[:, :n]), weights=self.weights)
                logits = self.model.logits(hidden[:, -1]).float()
            finally:
                self.prefilling = False
        self.previous_source = source[:, -1:].clone() if self.previous_source is None else \
            self.previous_source.copy_(source[:, -1:])
        self.previous.copy_(ids[:, -1])
        self.position.fill_(n)
        self.token.copy_(self.chooser.choose(logits, self.offset + self.position))
        return self.token

    def _smear_source(self, ids: Tensor) -> Tensor:
        """What the SmearGate blends (`SmearGate.source`), for ids [B, T] of a context's start."""
        bigram = self.model.bigram
        return self.model.smear.source(embed_sum(ids, self.model.tok_emb.weight,
                                                 bigram(ids) if bigram is not None else None,
                                                 bigram.scale if bigram is not None else None))

    # --- one step ---

    def step(self) -> Tensor:
        """Feed each sample's last chosen token, choose the next; returns them [B] on the device."""
        if self.replay is not None:
            self.replay()
        elif self.graphs and self.steps == 1:  # the second step: captured (which runs nothing), then replayed
            self.replay = self._capture()
            self.replay()
        else:
            with self._on_stream():
                self._run()
        self.steps += 1
        return self.token

    def _run(self) -> None:
        with autocast(self.device, cache=False):  # the decoder casts its weights itself, once
            self.run_step()

    def _step(self) -> None:
        ids = self.token.view(self.batch, 1)
        bigram = self.model.bigram
        pair = bigram.of_pairs(self.previous.view(self.batch, 1), ids) if bigram is not None else None
        source = self.model.smear.source(embed_sum(ids, self.model.tok_emb.weight, pair,
                                                   bigram.scale if bigram else None))
        x0 = self.model.smear.blend(source, self.previous_source, ids, self.model.cfg.doc_boundary_token)
        rotary = (self.cos.index_select(1, self.position.view(1)), self.sin.index_select(1, self.position.view(1)))
        for layout in self.layouts.values():
            layout.at(self.position)
        hidden = self.model.trunk(ids, x0, rotary, weights=self.weights)
        logits = self.model.logits(hidden[:, -1]).float()
        self.previous_source.copy_(source)
        self.previous.copy_(self.token)
        self.position.add_(1)
        self.token.copy_(self.chooser.choose(logits, self.offset + self.position))

    def _capture(self) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream), torch.cuda.graph(graph, stream=self.stream):
            self._run()
        return graph.replay

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Eager steps before a capture run on the capture's side stream, as CUDA graphs want."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    # --- the tokens to the host ---

    def send(self, tokens: Tensor) -> None:
        """Start copying tokens [B] to the host, behind the work queued so far."""
        self.host.copy_(tokens, non_blocking=True)
        if self.sent is not None:
            self.sent.record()

    def received(self) -> list[int]:
        """The tokens last sent, once they are on the host."""
        if self.sent is not None:
            self.sent.synchronize()
        return self.host.tolist()

    # --- the model's layers read the caches while the decoder is entered ---

    def __enter__(self) -> "StaticDecoder":
        for block, cache in zip(self.model.blocks, self.caches):
            block.attn.kv_cache = cache
        return self

    def __exit__(self, *exc: object) -> None:
        for block in self.model.blocks:
            block.attn.kv_cache = None


def matmul_dtype_on(device: torch.device, model: GPT) -> torch.dtype:
    """The dtype the model's products run in under `runtime.autocast` on this device."""
    with autocast(device):
        return matmul_dtype(model.tok_emb.weight)


class Chooser:
    """The next token of each sample from its logits: the likeliest at temperature 0, else a
    draw from softmax(logits / temperature) over the top_k likeliest (all when top_k is 0),
    made as the Gumbel-max trick with noise hashed from (seed, sample, position): the same
    draw for a sample whatever the batch, and on every device."""

    def __init__(self, batch: int, temperature: float, top_k: int, seed: int, device: torch.device):
        self.temperature, self.top_k = temperature, top_k
        self.samples = torch.arange(batch, dtype=torch.long, device=device)
        self.seed = seed

    def choose(self, logits: Tensor, position: Tensor) -> Tensor:
        if self.temperature <= 0:
            return logits.argmax(dim=-1)
        scores = logits / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return (scores + gumbel_noise(self.seed, self.samples, position, scores.shape[-1])).argmax(dim=-1)


_MASK63 = (1 << 63) - 1


def gumbel_noise(seed: int, samples: Tensor, position: Tensor, vocab: int) -> Tensor:
    """Standard Gumbel noise [len(samples), vocab], a pure function of (seed, sample,
    position, token): a splitmix64-style hash in 63-bit integer arithmetic (products wrap
    the same on every device), turned into a uniform in (0, 1)."""
    tokens = torch.arange(vocab, dtype=torch.long, device=samples.device)
    seed_mix = (seed * 0x2545F4914F6CDD1D) & _MASK63  # in Python: a seed may be any int64
    h = (samples[:, None] * 0x9E3779B9 + position * 0x632BE5AB + tokens[None, :] * 0x85EBCA6B + seed_mix) & _MASK63
    for multiplier, shift in ((0x3FB58476D1CE4E5B, 31), (0x14C3E0FE6EA2A9B9, 29), (0x0D49BBB133111EB, 32)):
        h = ((h ^ (h >> shift)) * multiplier) & _MASK63
    uniform = ((h >> 23).to(torch.float64) + 0.5) / float(1 << 40)
    return -torch.log(-torch.log(uniform)).to(torch.float32)


class RecomputingDecoder:
    """The same choices, the whole context recomputed for every token: the definition the
    static cache must match (and a baseline for its speed)."""

    def __init__(self, model: GPT, batch: int = 1, *, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
                 limit: int | None = None):
        self.model, self.batch = model, batch
        self.limit = limit or model.cfg.rope_train_seq_len
        self.device = model.tok_emb.weight.device
        self.chooser = Chooser(batch, temperature, top_k, seed, self.device)
        self.restarts = 0
        self.warmup_steps = 0

    def next_logits(self, tokens: Tensor) -> Tensor:
        """Logits [B, V] (float32) for the token after each row of tokens [B, n]."""
        context = tokens[:, context_start(tokens.shape[1], self.limit):]
        with autocast(self.device):
            return self.model.forward_logits(context)[:, -1].float()

    def next_tokens(self, tokens: Tensor) -> Tensor:
        return self.chooser.choose(self.next_logits(tokens), torch.tensor(tokens.shape[1], device=self.device))


@dataclass
class Generation:
    prompt_tokens: list[int]
    samples: list[list[int]]  # each sample's new tokens (cut after the stop token)
    prefill_seconds: float  # the prompt, up to every sample's first new token
    decode_seconds: float  # every later token
    context_restarts: int  # times the context outgrew the trained length and was filled again
    steps: int = 0  # the decoding steps decode_seconds counts
    first_call_seconds: float = 0.0  # the warm-up steps, not in decode_seconds: compilation, capture

    @property
    def new_tokens(self) -> list[int]:
        return self.samples[0]

    @property
    def tokens_per_second(self) -> float:
        """New tokens of all samples after the first, per second of decoding."""
        decoded = self.steps * len(self.samples)
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else 0.0


def generate(model: GPT, prompt: Sequence[int], max_new_tokens: int, *, num_samples: int = 1,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0, use_cache: bool = True,
             stop_token: int | None = None, compile_step: bool = False, graphs: bool = True,
             on_tokens: OnTokens | None = None) -> Generation:
    """Continue `prompt` (token ids, at least one) with num_samples samples of up to
    max_new_tokens tokens each; a sample stops after `stop_token`. on_tokens sees every
    sample's tokens so far after each step. Runs under bf16 autocast on CUDA, as the other stages."""
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    device = model.tok_emb.weight.device
    text = torch.tensor(prompt, device=device).expand(num_samples, len(prompt))
    done = [False] * num_samples
    samples: list[list[int]] = [[] for _ in range(num_samples)]

    def record(tokens: list[int]) -> bool:
        for i, token in enumerate(tokens):
            if not done[i]:
                samples[i].append(token)
                done[i] = token == stop_token
        if on_tokens is not None:
            on_tokens(samples)
        return all(done)

    with torch.inference_mode(), contextlib.ExitStack() as entered:
        synchronize(device)
        t0 = time.perf_counter()
        if use_cache:
            decoder = entered.enter_context(StaticDecoder(model, num_samples, temperature=temperature, top_k=top_k,
                                                          seed=seed, compile_step=compile_step, graphs=graphs))
            tokens = _cached_tokens(decoder, text, max_new_tokens)
        else:
            decoder = RecomputingDecoder(model, num_samples, temperature=temperature, top_k=top_k, seed=seed)
            tokens = _recomputed_tokens(decoder, text)
        finished = record(next(tokens))
        seconds = [time.perf_counter() - t0]  # to the first token, then each step's
        while not finished and len(seconds) < max_new_tokens:
            t1 = time.perf_counter()
            finished = record(next(tokens))
            seconds.append(time.perf_counter() - t1)
    # The warm-up steps (compilation, the graph's capture) are reported apart, one step kept timed.
    steps = seconds[1:]
    warm = min(decoder.warmup_steps, max(len(steps) - 1, 0))
    return Generation(list(prompt), samples, seconds[0], sum(steps[warm:]), decoder.restarts, len(steps) - warm,
                      sum(steps[:warm]))


def _cached_tokens(decoder: StaticDecoder, text: Tensor, count: int) -> Iterator[list[int]]:
    """Up to count steps' tokens (on the host) of the static decoder, for texts [B, n]. The next
    step is launched before this one's tokens reach the host, so that the device does not
    wait on the host's work between steps, unless it needs them: when the context restarts
    (it is prefilled again from each sample's own text) or it is a warm-up step (timed apart)."""
    texts = text.tolist()  # every sample's text so far, on the host
    start = context_start(len(texts[0]), decoder.limit)
    decoder.send(decoder.prefill(text[:, start:], start))
    for left in range(count - 1, -1, -1):
        start = context_start(len(texts[0]) + 1, decoder.limit)  # of the step after the token in flight
        ahead = left > 0 and start == decoder.start and decoder.steps >= decoder.warmup_steps
        if ahead:
            decoder.step()
        tokens = decoder.received()
        yield tokens
        if left == 0:
            return
        for sample, token in zip(texts, tokens):
            sample.append(token)
        if ahead:
            decoder.send(decoder.token)
        elif start == decoder.start:
            decoder.send(decoder.step())
        else:
            decoder.send(decoder.prefill(torch.tensor([t[start:] for t in texts], device=decoder.device), start))


def _recomputed_tokens(decoder: RecomputingDecoder, text: Tensor) -> Iterator[list[int]]:
    starts = set()
    while True:
        starts.add(context_start(text.shape[1], decoder.limit))
        decoder.restarts = len(starts) - 1
        chosen = decoder.next_tokens(text)
        yield chosen.tolist()
        text = torch.cat([text, chosen[:, None]], dim=1)


def greedy_sample(model: GPT, tokenizer: Path, prompt: str, max_new_tokens: int = SAMPLE_TOKENS) -> str:
    """The model's greedy continuation of prompt, as a document's start (after BOS)."""
    codec = load_text_codec(tokenizer)
    out = generate(model, [BOS_ID, *codec.encode(prompt)], max_new_tokens, stop_token=BOS_ID, graphs=False)
    return continuation(codec, out.prompt_tokens, out.new_tokens)


def continuation(codec: TextCodec, prompt_tokens: list[int], new_tokens: list[int]) -> str:
    """The new tokens' text as it follows the prompt's (decoded on their own, a leading space
    would be dropped); a BOS, which starts the next document, is left out."""
    prompt = codec.decode(prompt_tokens)
    return codec.decode(prompt_tokens + [t for t in new_tokens if t != BOS_ID])[len(prompt):]


if sys.byteorder != "little":  # pinned host copies of token ids are read as the host lays them out
    raise ImportError("windowgpt's decoder needs a little-endian host")
