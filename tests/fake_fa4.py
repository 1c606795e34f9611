"""FlashAttention-4's interface (`flash_attn.cute.interface`) computed naively, for the tests'
`fake_fa4` fixture (conftest), where the package cannot run."""
from __future__ import annotations

import math

import torch


class FakeFA4:
    """flash_attn.cute.interface's calling convention, computed in float64 from FlashAttention's
    formulas: the forward returns the log-sum-exp; the backward recomputes the probabilities
    from the log-sum-exp it is given and takes the log-sum-exp's gradient."""

    @staticmethod
    def _scores(q, k, window_left):
        b, t, h, d = q.shape
        kk = k.double().repeat_interleave(h // k.shape[2], dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q.double(), kk) / math.sqrt(d)
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = (j <= i) & (True if window_left is None else (i - j <= window_left))
        return scores.masked_fill(~allowed, float("-inf")), kk

    @staticmethod
    def flash_attn_func(q, k, v, causal=False, window_size=(None, None), return_lse=False):
        assert causal and window_size[1] is None
        q.data_ptr()  # as FA4 does: a traced tensor has none, so the call must stay opaque
        scores, _ = FakeFA4._scores(q, k, window_size[0])
        lse = scores.logsumexp(-1)  # [B, H, T]
        vv = v.double().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        out = torch.einsum("bhij,bjhd->bihd", (scores - lse[..., None]).exp(), vv)
        return out.to(q.dtype), lse.float()

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, causal=False, window_size_left=None, window_size_right=None,
                        dlse=None):
        assert causal and window_size_right is None
        dout.data_ptr()  # as FA4 does (see flash_attn_func)
        h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
        scores, kk = FakeFA4._scores(q, k, window_size_left)
        p = (scores - lse.double()[..., None]).exp()  # [B, H, I, J]
        vv = v.double().repeat_interleave(h // hkv, dim=2)
        do = dout.double()
        dv = torch.einsum("bhij,bihd->bjhd", p, do)
        dp = torch.einsum("bihd,bjhd->bhij", do, vv)
        delta = (do * out.double()).sum(-1).transpose(1, 2)  # [B, H, I]
        if dlse is not None:
            delta = delta - dlse.double()
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("bhij,bjhd->bihd", ds, kk) / math.sqrt(d)
        dk = torch.einsum("bhij,bihd->bjhd", ds, q.double()) / math.sqrt(d)
        fold = lambda x: x.unflatten(2, (hkv, h // hkv)).sum(3)  # noqa: E731  the group's heads share k, v
        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)
