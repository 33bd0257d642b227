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

On the CPU (tests) the same static step runs uncaptured: the driver, the in-place KV rows and
the masked attention are checked there; the capture itself needs a GPU and has not yet run on
one.
"""

from __future__ import annotations

import dataclasses
import warnings

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

    def __init__(self, qwen: VideoModel, ctx: DecodeContext, device: torch.device):
        self.qwen = qwen
        self.ctx = dataclasses.replace(ctx, signal=None, received=None,
                                       length=torch.zeros(1, dtype=torch.long, device=device))
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, 1, 1), dtype=torch.long, device=device)
        self.signal = step_signal(device)
        self.captures = device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.next: torch.Tensor | None = None

    def _step(self) -> None:
        self.ctx.signal = self.signal
        self.logits = decode_step(self.qwen, self.token.view(1, 1), self.positions, self.ctx)
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
        if not self.captures:
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
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
