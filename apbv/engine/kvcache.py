"""The prompt's KV cache, distributed: every prompt token is cached on exactly one rank.

Rank r keeps, per layer, the keys and values of its slice of the anchor, of its blocks and,
on rank 0 only, of the query; decode tokens are appended on rank 0. Exact decode attention is
then the log-sum-exp merge of one partial per rank (see :mod:`apbv.engine.decode`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from apbv.plan import Range


class RankKVCache:
    """Per-layer (1, T_owned, Hkv, D) keys and values of the tokens this rank owns.

    ``reserve`` extra rows per layer are allocated up front for the tokens decode will append,
    so appending copies one token, not the whole cache: the decode's KV goes into buffers
    allocated before it starts (:meth:`make_room` for a stream's question), and attention
    reads views of their valid rows (:meth:`layer`).
    """

    def __init__(self, num_layers: int, reserve: int = 0):
        self.reserve = reserve
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._len = [0] * num_layers

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep all of k/v (1, T, Hkv, D) as ``layer``'s cache (plus the reservation)."""
        self.store_runs(layer, k, v, [(0, k.shape[1])])

    def store_runs(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                   runs: list[Range]) -> None:
        """:meth:`store` of the rows in ``runs`` ([start, end) along dim 1 of k/v, in order),
        copied from slices: no index tensor, no host-to-device transfer."""
        assert self._k[layer] is None, f"layer {layer} stored twice"
        b, _, h, d = k.shape
        t = sum(end - start for start, end in runs)
        buf_k = self._k[layer] = k.new_empty(b, t + self.reserve, h, d)
        buf_v = self._v[layer] = v.new_empty(b, t + self.reserve, h, d)
        buf_k[:, t:], buf_v[:, t:] = 0, 0  # finite: a captured step reads them masked
        at = 0
        for start, end in runs:
            buf_k[:, at : at + end - start] = k[:, start:end]
            buf_v[:, at : at + end - start] = v[:, start:end]
            at += end - start
        self._len[layer] = t

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n, new = self._len[layer], k.shape[1]
        if n + new > self._capacity(layer):  # past the reservation: grow geometrically
            self._grow(layer, max(new, self.reserve, 16, n // 2))
        buf_k, buf_v = self._k[layer], self._v[layer]
        assert buf_k is not None and buf_v is not None
        buf_k[:, n : n + new], buf_v[:, n : n + new] = k, v
        self._len[layer] = n + new

    def make_room(self, rows: int) -> None:
        """Allocate now, at most once per layer, the room for ``rows`` more rows in every
        stored layer, so that the next ``rows`` appends (a stream's question and its decode)
        only copy their rows: no buffer is reallocated while a decode runs."""
        for layer, n in enumerate(self._len):
            if self.holds(layer) and n + rows > self._capacity(layer):
                self._grow(layer, n + rows - self._capacity(layer))

    def _capacity(self, layer: int) -> int:
        k = self._k[layer]
        assert k is not None, f"layer {layer} has no cached KV"
        return k.shape[1]

    def _grow(self, layer: int, rows: int) -> None:
        """Reallocate ``layer``'s buffers with ``rows`` more rows (zeros), the cached ones
        copied."""
        buf_k, buf_v = self._k[layer], self._v[layer]
        assert buf_k is not None and buf_v is not None
        self._k[layer] = torch.cat([buf_k, buf_k.new_zeros(1, rows, *buf_k.shape[2:])], dim=1)
        self._v[layer] = torch.cat([buf_v, buf_v.new_zeros(1, rows, *buf_v.shape[2:])], dim=1)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (1, T, Hkv, D) keys and values of ``layer`` (views, no copy)."""
        k, v, n = self._k[layer], self._v[layer], self._len[layer]
        assert k is not None and v is not None, f"layer {layer} has no cached KV"
        return k[:, :n], v[:, :n]

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (1, capacity, Hkv, D) key and value buffers of ``layer``: its cached rows,
        then the room for appends (a captured decode step writes there in place; then
        :meth:`extend`)."""
        k, v = self._k[layer], self._v[layer]
        assert k is not None and v is not None, f"layer {layer} has no cached KV"
        return k, v

    def rehouse(self, house: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                ) -> None:
        """Move every stored layer's cached rows into the (1, C, Hkv, D) key and value buffers
        ``house(layer, keys)`` gives for its current buffer ``keys`` (C at least the rows the
        layer must hold; rows past the cached ones are left as they are, finite), layer by
        layer, so the old buffers are freed as it goes: a decode step kept across requests
        reads every request's KV at the same addresses."""
        for layer, n in enumerate(self._len):
            k, v = self._k[layer], self._v[layer]
            if k is None or v is None:
                continue
            new_k, new_v = house(layer, k)
            assert new_k.shape[0] == 1 and new_k.shape[1] >= n and \
                new_k.shape[2:] == k.shape[2:] and new_v.shape == new_k.shape, (new_k.shape, n)
            new_k[:, :n], new_v[:, :n] = k[:, :n], v[:, :n]
            self._k[layer], self._v[layer] = new_k, new_v

    def room(self) -> int:
        """Rows every stored layer can still take without growing."""
        return min((self._capacity(layer) - n for layer, n in enumerate(self._len)
                    if self.holds(layer)), default=0)

    def extend(self, rows: int) -> None:
        """Count ``rows`` more rows of every stored layer as cached: rows written in place
        into the :meth:`buffers` (by a captured decode step)."""
        assert 0 <= rows <= self.room(), (rows, self.room())
        for layer in range(len(self._len)):
            if self.holds(layer):
                self._len[layer] += rows

    def holds(self, layer: int) -> bool:
        """Whether ``layer`` has been stored (possibly with zero rows)."""
        return self._k[layer] is not None

    def num_tokens(self, layer: int = 0) -> int:
        return self._len[layer]

    def lengths(self) -> tuple[int, ...]:
        """Cached tokens per layer: a mark that :meth:`truncate` can return to."""
        return tuple(self._len)

    def truncate(self, lengths: tuple[int, ...]) -> None:
        """Forget the tokens appended after ``lengths`` (a :meth:`lengths` mark): the cache is
        then what it was at the mark; the rows stay allocated for the next appends."""
        assert len(lengths) == len(self._len), (len(lengths), len(self._len))
        for layer, n in enumerate(lengths):
            assert 0 <= n <= self._len[layer], f"layer {layer}: mark {n} > {self._len[layer]}"
            self._len[layer] = n

    def drop(self, start: int, end: int) -> None:
        """Forget rows [start, end) of every layer (a stream's evicted chunk): the rows after
        them move down in place; the allocation is kept for the next appends."""
        for layer, n in enumerate(self._len):
            k, v = self._k[layer], self._v[layer]
            assert k is not None and v is not None and 0 <= start <= end <= n, (start, end, n)
            k[:, start:n - (end - start)] = k[:, end:n].clone()
            v[:, start:n - (end - start)] = v[:, end:n].clone()
            self._len[layer] = n - (end - start)

    def map_keys(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every layer's cached keys (1, T, Hkv, D) by ``fn(keys)`` (same shape), e.g.
        re-rotated to shifted positions."""
        for layer, n in enumerate(self._len):
            k = self._k[layer]
            if k is not None and n:
                k[:, :n] = fn(k[:, :n])

    def capacity_bytes(self) -> int:
        """Bytes allocated for keys and values (cached rows plus the room kept for appends)."""
        return sum(2 * k.numel() * k.element_size() for k in self._k if k is not None)

    def nbytes(self) -> int:
        """Bytes of the cached tokens (not counting the reservation)."""
        total = 0
        for k, n in zip(self._k, self._len):
            if k is not None:
                total += 2 * n * k[0, 0].numel() * k.element_size()
        return total
