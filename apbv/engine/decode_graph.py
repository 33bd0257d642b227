"""``decode.graphs``: one greedy decode step captured in a CUDA graph and replayed per token.

An eager decode step is host-bound on GPUs (every op of every layer is dispatched from Python;
see docs/cost_model.md). A captured step is launched as one graph. Its shapes and addresses are
fixed: the fed token, its positions, the step's signal and the owner's valid KV rows are
device tensors written before each replay; the owner (the query rank) writes the step's K and
V at that row of the buffers the decode reservation preallocated and attends over the whole
buffers masked to the valid rows (:func:`apbv.attention.kernels.attention_upto`); the other
ranks' KV does not change during a decode. The layers' all-gathers are captured too, which
NCCL allows and gloo does not: graphs run only with the nccl backend or on one rank.

At the first step of every decode the eager step runs first; the captured step then replays
the same step and its logits must equal the eager ones within the dtype's tolerance
(:data:`TOLERANCE`) on every rank (one extra collective, once), else the decode goes on eager
with a warning saying why. The first token of the step is the eager one either way.

Steps are kept across requests (:class:`GraphSteps`: one per KV-capacity bucket and world
size, their KV buffers reused, captured once into one memory pool), and answers allowed fewer
than ``decode.graphs_min_tokens`` tokens decode eagerly (docs/decode_graphs.md).

On the CPU (tests) the same static step runs uncaptured: the driver, the in-place KV rows and
the masked attention are checked there; the capture itself needs a GPU and has not yet run on
one.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from typing import Any

import torch

from apbv import comm
from apbv.config import DECODE_GRAPHS
from apbv.engine.decode import DecodeContext, decode_step, step_signal, step_token
from apbv.model.adapter import VideoModel

GRAPHS = DECODE_GRAPHS
"""Values of ``decode.graphs``: auto (on for CUDA ranks whose collectives can be captured:
nccl, or one rank), on (the same, refused where it cannot be), off (eager)."""

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""Largest |graph - eager| of the first step's logits, relative to the largest |eager| logit
(at least 1), by the model's dtype."""


def resolve_graphs(setting: str, device: torch.device, backend: str | None,
                   world_size: int) -> tuple[bool, str]:
    """(whether decode steps are captured, why): ``setting`` is ``decode.graphs``; ``device``
    this rank's, ``backend`` the process group's ("nccl", "gloo", None for one rank without
    a group). ValueError for a value not in :data:`GRAPHS`, and for ``on`` where capture
    cannot work (a CPU rank, gloo collectives), before anything is loaded."""
    if setting not in GRAPHS:
        raise ValueError(f"decode.graphs must be one of {', '.join(GRAPHS)}; got {setting!r}")
    why_not = None
    if device.type != "cuda":
        why_not = f"the ranks run on {device.type}, which has no CUDA graphs"
    elif world_size > 1 and backend != "nccl":
        why_not = f"{backend} collectives cannot be captured in a CUDA graph (nccl ones can)"
    if setting == "on" and why_not is not None:
        raise ValueError(f"decode.graphs=on needs CUDA ranks with the nccl backend (or one "
                         f"rank), but {why_not}: use decode.graphs=auto or off")
    if setting == "off":
        return False, "decode.graphs=off"
    if why_not is not None:
        return False, why_not
    return True, "CUDA ranks with a capturable backend"


class GraphStep:
    """One decode step over static buffers: captured on CUDA, run eagerly elsewhere.

    :meth:`run` (:meth:`load`, then :meth:`replay`; :meth:`capture` once in between) feeds
    ``token`` (1,) at ``positions`` (3, 1, 1) with ``signal`` (2,)
    (:func:`apbv.engine.decode.step_signal`) and the owner's ``cached`` rows, writing the
    row's KV in place (the caller counts it: :meth:`RankKVCache.extend`), and returns the
    step's token tensor (:func:`apbv.engine.decode.step_token`) and logits, both the graph's
    own outputs (overwritten by the next run).
    """

    def __init__(self, model: VideoModel, ctx: DecodeContext, device: torch.device, *,
                 pool: Any = None, capacity: int | None = None):
        self.model = model
        self.ctx = dataclasses.replace(ctx, signal=None, received=None,
                                       length=torch.zeros(1, dtype=torch.long, device=device),
                                       static_all=capacity is not None)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, 1, 1), dtype=torch.long, device=device)
        self.signal = step_signal(device)
        self.captures = device.type == "cuda"
        self.pool = pool
        """The graph memory pool the capture allocates from (shared by an engine's steps)."""
        self.capacity = capacity
        """Rows per layer of the step's own KV buffers (a step kept across requests, whose
        caches :meth:`house` holds), or None (the request's cache's own buffers)."""
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.next: torch.Tensor | None = None

    def house(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s (1, :attr:`capacity`, Hkv, D) key and value buffers, shaped as ``like``
        (allocated zeroed at the first request, the same tensors at every later one):
        :meth:`RankKVCache.rehouse`'s ``house``."""
        assert self.capacity is not None, "a step of one request has no buffers of its own"
        if layer not in self.kv:
            shape = (1, self.capacity, *like.shape[2:])
            self.kv[layer] = (like.new_zeros(shape), like.new_zeros(shape))
        return self.kv[layer]

    def adopt(self, ctx: DecodeContext) -> None:
        """Serve ``ctx``'s request: its cache moves into this step's buffers."""
        ctx.cache.rehouse(self.house)
        self.ctx.cache, self.ctx.info = ctx.cache, ctx.info

    def _step(self) -> None:
        self.ctx.signal = self.signal
        self.logits = decode_step(self.model, self.token.view(1, 1), self.positions, self.ctx)
        assert self.ctx.received is not None
        self.next = step_token(self.logits, self.ctx.received)

    def load(self, token: torch.Tensor, positions: torch.Tensor, signal: torch.Tensor,
             cached: int) -> None:
        """Write the step's inputs into the static buffers (small device copies and a fill)."""
        self.token.copy_(token)
        self.positions.copy_(positions)
        self.signal.copy_(signal)
        assert self.ctx.length is not None
        self.ctx.length.fill_(cached)

    @torch.inference_mode()
    def capture(self) -> str | None:
        """Capture the loaded step (on CUDA; nothing to do elsewhere): a warm-up run on a side
        stream (the same step: it writes the same KV row), then the capture, which runs
        nothing. Returns why it failed, or None."""
        if not self.captures or self.graph is not None:  # a kept step: captured before
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a concurrent CUDA call of another thread (a serve actor's second
            # call) cannot invalidate the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._step()
        except RuntimeError as exc:  # e.g. an op that cannot be captured
            return f"the capture failed: {exc}"
        self.graph = graph
        return None

    @torch.inference_mode()
    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the loaded step: the step's token tensor and logits."""
        if self.captures:
            assert self.graph is not None, "replay before a capture"
            self.graph.replay()
        else:
            self._step()
        assert self.next is not None and self.logits is not None
        return self.next, self.logits

    def run(self, token: torch.Tensor, positions: torch.Tensor, signal: torch.Tensor,
            cached: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.load(token, positions, signal, cached)
        return self.replay()


def agrees(graph_logits: torch.Tensor, eager_logits: torch.Tensor, dtype: torch.dtype,
           group: object) -> tuple[bool, str]:
    """(whether the graph's logits equal the eager step's within :data:`TOLERANCE` of
    ``dtype`` on every rank, the measured difference): one read back and one collective."""
    diff = float((graph_logits - eager_logits).abs().max())
    scale = max(1.0, float(eager_logits.abs().max()))
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    bad = comm.any_rank(not diff <= tol * scale, group)  # type: ignore[arg-type]
    return not bad, f"max |graph - eager| logit {diff:.3g} against {tol:g} x {scale:.3g}"


def fall_back(why: str) -> None:
    warnings.warn(f"decode.graphs: the captured decode step is not used, decoding eagerly: "
                  f"{why}", RuntimeWarning, stacklevel=3)


def bucket(rows: int) -> int:
    """The KV capacity of the kept step that serves ``rows`` rows per layer: ``rows`` rounded
    up to a multiple of a quarter of the power of two below it (at least 64): 1000 -> 1024,
    1100 -> 1280, 70000 -> 81920. At most 25% more rows than needed, and four buckets per
    doubling, so requests of similar sizes share a step."""
    if rows <= 64:
        return 64
    step = 1 << max(0, (rows - 1).bit_length() - 3)
    return -(-rows // step) * step


class GraphSteps:
    """An engine's captured decode steps, kept across requests: one per (KV-capacity bucket,
    world size), the least recently used dropped beyond ``kept``, all captured into one CUDA
    graph memory pool. A request of a bucket already captured moves its KV into that step's
    buffers (:meth:`GraphStep.adopt`: one copy of the cache, no capture, no ``empty_cache``);
    answers allowed fewer than ``min_tokens`` tokens decode eagerly (the capture would cost
    more than it saves). ``made`` and ``reused`` count the steps made and served again."""

    def __init__(self, kept: int, min_tokens: int, device: torch.device, pool: Any = None):
        self.kept = kept
        self.min_tokens = min_tokens
        self.steps: OrderedDict[tuple[int, int], GraphStep] = OrderedDict()
        self.pool = pool if pool is not None or device.type != "cuda" else \
            torch.cuda.graph_pool_handle()
        self.made = 0
        self.reused = 0

    def unkept(self) -> GraphSteps:
        """The same pool and threshold for requests whose cache stays their own (a stream's
        ask: its KV outlives the answer): each gets a step of its own, captured anew."""
        return GraphSteps(0, self.min_tokens, torch.device("cpu"), self.pool)

    def wanted(self, max_new_tokens: int) -> bool:
        """Whether an answer of at most ``max_new_tokens`` tokens is worth a captured step."""
        return max_new_tokens >= self.min_tokens

    def step(self, model: VideoModel, ctx: DecodeContext, max_new_tokens: int) -> GraphStep:
        """The step for ``ctx``'s request (its cache rehoused into a kept step's buffers, or a
        step of its own where nothing is kept): the same choice on every rank (two small
        collectives: the rows every rank needs, then whether any rank lacks the step)."""
        device = model.device
        info, cache = ctx.info, ctx.cache
        rows = cache.num_tokens()
        need = rows + (max_new_tokens - 1 if info.rank == ctx.owner else 0)
        every = comm.all_gather_ints([need, rows], info.group) if self.kept else None
        if every is None or int(every[:, 1].min()) == 0:  # kept steps need rows on every rank
            self.made += 1
            return GraphStep(model, ctx, device, pool=self.pool)
        key = (bucket(int(every[:, 0].max())), info.world_size)
        step = self.steps.get(key)
        if comm.any_rank(step is None, info.group):  # one rank lacks it: all capture anew
            self.forget(step)
            step = GraphStep(model, ctx, device, pool=self.pool, capacity=key[0])
            self.made += 1
            self.steps[key] = step
            while len(self.steps) > self.kept:
                self.steps.popitem(last=False)
        else:
            assert step is not None
            self.reused += 1
            self.steps.move_to_end(key)
        step.adopt(ctx)
        return step

    def make_room(self, short: int) -> int:
        """Drop kept steps, least recently used first, until ``short`` bytes of their KV are
        freed or none is left (a request that would not fit otherwise); the bytes freed."""
        freed = 0
        while self.steps and freed < short:
            _, step = self.steps.popitem(last=False)
            freed += sum(t.numel() * t.element_size() for kv in step.kv.values() for t in kv)
        return freed

    def forget(self, step: GraphStep | None) -> None:
        """Drop ``step`` (one that failed its capture or its first-step check)."""
        for key, kept in list(self.steps.items()):
            if kept is step:
                del self.steps[key]
