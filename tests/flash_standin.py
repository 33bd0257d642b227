"""A CPU stand-in for ``torch.ops.aten._flash_attention_forward`` (tests only): the same
arguments and the same outputs, in plain math, so the CPU can check what
apbv/attention/bundled_flash.py hands the op and how it reads the op's answer.

The contract it follows (the CUDA op's, FlashAttention-2's; the shapes are the ones torch's
meta kernel gives, checked in tests/unit/test_bundled_flash.py on meta tensors):
- variable-length form, the one with ``seqused_k``: query (total_q, Hq, D), key/value
  (total_k, Hkv, D) with stride 1 along D; ``cum_seq_q``/``cum_seq_k`` (N + 1,) int32
  offsets; sequence n's rows are query[cu_q[n]:cu_q[n+1]], its keys key[cu_k[n]:cu_k[n+1]],
  of which only the first ``seqused_k[n]`` ((N,) int32) when given. Returns out (total_q, Hq,
  D) in the query's dtype and lse (Hq, total_q) fp32.
- dense form (no offsets): (B, T, H, D) inputs, lse (B, Hq, Tq); no ``seqused_k``.
- query head h reads KV head h // (Hq // Hkv).
- the window (left, right), counted from the bottom-right corner of each sequence's
  (rows, used keys) block: row i sees key j iff j <= i + sk - sq + right (right >= 0) and
  j >= i + sk - sq - left (left >= 0); ``is_causal`` means right = 0.
- a row that sees no key: out 0, lse +inf.
"""

from __future__ import annotations

import torch


def _attend(q, k, v, causal, scale, left, right):
    """One sequence: q (sq, Hq, D), k/v (sk, Hkv, D) -> out (sq, Hq, D) fp32, lse (Hq, sq)."""
    sq, sk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        right = 0
    row = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right is not None and right >= 0:
        visible &= col <= row + right
    if left is not None and left >= 0:
        visible &= col >= row - left
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, lse.masked_fill(~visible.any(-1), float("inf"))


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                  is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                  window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                  num_splits=None):
    """``aten._flash_attention_forward``'s contract on the CPU (see the module doc)."""
    assert dropout_p == 0.0 and not return_debug_mask and alibi_slopes is None
    assert block_table is None and num_splits is None
    for name, t in (("query", query), ("key", key), ("value", value)):
        assert t.stride(-1) == 1, f"{name} must have contiguous last dimension"
    assert key.shape == value.shape and query.shape[-1] == key.shape[-1]
    hq, hkv = query.shape[-2], key.shape[-2]
    assert hq % hkv == 0, "Number of heads in key/value must divide number of heads in query"
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    window = (window_size_left, window_size_right)
    if cum_seq_q is None:
        assert cum_seq_k is None and seqused_k is None, "seqused_k: variable-length form only"
        outs, lses = zip(*(_attend(q, k, v, is_causal, scale, *window)
                           for q, k, v in zip(query, key, value, strict=True)), strict=True)
        return (torch.stack(outs).to(query.dtype), torch.stack(lses), torch.zeros(2),
                torch.empty(()), torch.empty(0))
    assert query.dim() == 3 and key.dim() == 3
    for name, t in (("cu_seqlens_q", cum_seq_q), ("cu_seqlens_k", cum_seq_k)):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.dim() == 1, name
    assert cum_seq_q.shape == cum_seq_k.shape, "cu_seqlens_q/k must have shape (batch_size + 1)"
    n = cum_seq_q.numel() - 1
    assert int(cum_seq_q[-1]) == query.shape[0] and int(cum_seq_k[-1]) <= key.shape[0]
    if seqused_k is not None:
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (n,)
        assert seqused_k.is_contiguous()
    out = torch.zeros(query.shape, dtype=torch.float32)
    lse = torch.empty(hq, query.shape[0], dtype=torch.float32)
    for i in range(n):
        q0, q1 = int(cum_seq_q[i]), int(cum_seq_q[i + 1])
        k0, k1 = int(cum_seq_k[i]), int(cum_seq_k[i + 1])
        assert q1 - q0 <= max_q and k1 - k0 <= max_k, "a sequence longer than max_q/max_k"
        used = k1 - k0 if seqused_k is None else int(seqused_k[i])
        assert 0 <= used <= k1 - k0
        out[q0:q1], lse[:, q0:q1] = _attend(query[q0:q1], key[k0:k0 + used],
                                            value[k0:k0 + used], is_causal, scale, *window)
    return out.to(query.dtype), lse, torch.zeros(2), torch.empty(()), torch.empty(0)
