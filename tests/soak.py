"""The chaos soak's engine: many random cmap calls on every rank of a world, each with a random failure or none.

Every rank draws the same scenarios from one seed (:func:`scenario`): a placement (``src``, ``dst``), a mode, a
collective inside func or none, gradients or not, and a failure on one random rank:

- ``forward``: func raises on that rank (before its collective, when it has one);
- ``backward``: a custom ``autograd.Function`` in func raises in backward on that rank;
- ``fault``: the documented fault injection (:mod:`colossalai_cmap.faults`) at a random phase;
- ``shape``: func returns an output of another shape on that rank;
- ``skip``: that rank skips the call (on a fresh group, with a short timeout).

After each call, every rank checks its own outcome against the expectation (torch's result on the whole batch, or
the CmapError naming that rank), then that a raw ``torch.distributed`` collective and a small cmap call work. The
outcomes come back per rank, for the test to compare across ranks. :func:`run` also returns the RSS and open file
descriptors it grew by after a warm-up.
"""

import os
import random
import time
from collections import Counter
from datetime import timedelta
from typing import Any, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

import colossalai_cmap as cm
from colossalai_cmap.faults import PHASES, InjectedFault, inject_fault

KINDS = ("ok",) * 4 + ("forward", "backward") * 3 + ("fault",) * 4 + ("shape",) * 2
COLLECTIVES = (None, None, "psum", "pmean", "all_gather")
SKIP_TIMEOUT = 1.0


class Scenario(NamedTuple):
    kind: str
    rank: int  # the failing (or skipping) rank
    src: Any
    dst: Any
    mode: str
    collective: Optional[str]
    grad: bool
    batch: int
    width: int
    phase: str = ""


def scenario(rng: random.Random, size: int, skip_rate: float) -> Scenario:
    kind = "skip" if rng.random() < skip_rate else rng.choice(KINDS)
    src, dst = rng.choice((None, None, 0, "local")), rng.choice((-1, -1, 0, "local"))
    mode = rng.choice(("vmap", "vmap", "batched", "loop"))
    collective = rng.choice(COLLECTIVES) if mode != "batched" else None
    grad = src in (None, "local") and dst in (-1, "local") and rng.random() < 0.6
    grad = grad and not (mode == "loop" and collective)  # collectives in loop mode are not differentiable
    if kind == "backward" and not grad:
        kind = "ok"
    width = 200 if rng.random() < 0.2 else 3  # 200 float64 per row: a data phase beside the round
    return Scenario(
        kind, rng.randrange(size), src, dst, mode, collective, grad, rng.randint(1, 2 * size + 2), width,
        rng.choice(PHASES) if kind == "fault" else "",
    )  # fmt: skip


def _fires(s: Scenario, size: int) -> bool:
    """Whether the injected phase exists in this call on the faulty rank (as in test_faults)."""
    if s.phase == "args":
        return not isinstance(s.src, int) or s.rank == s.src
    if s.phase == "scatter":
        return isinstance(s.src, int)
    if s.phase in ("record", "backward"):
        return s.grad
    if s.phase == "gather":
        return False  # may or may not run, by the sizes: not asserted
    return True


class FailsInBackward(torch.autograd.Function):
    """Identity, whose backward raises on the chosen rank: a failure in the user's own backward code (the soak's and
    test_faults')."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, rank):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rank = inputs[1]

    @staticmethod
    def backward(ctx, g):
        if dist.get_rank() == ctx.rank:
            raise ValueError("the user's backward failed")
        return g, None


def _collective(name: Optional[str], v: torch.Tensor) -> Any:
    if name == "psum":
        return cm.psum(v, "i")
    if name == "pmean":
        return cm.pmean(v, "i")
    if name == "all_gather":
        return cm.all_gather(v, "i").sum(0)
    return 0


def _func(s: Scenario, w: torch.Tensor):
    rank = dist.get_rank()

    def f(v):
        if s.kind == "forward" and rank == s.rank:
            raise ValueError("func raised (soak)")
        y = (v * w).sin() + _collective(s.collective, v)
        if s.kind == "backward":
            y = FailsInBackward.apply(y, s.rank)
        if s.kind == "shape" and rank == s.rank:
            y = y[..., :-1]
        return y

    return f


def _oracle(s: Scenario, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    extra = {"psum": x.sum(0), "pmean": x.mean(0), "all_gather": x.sum(0)}.get(s.collective, 0)
    return (x * w).sin() + extra


def one_call(s: Scenario, seed: int, group: Any = None) -> str:
    """One scenario on this rank; returns its outcome (the same string on every rank, but the skipping one's)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s.batch, s.width, dtype=torch.float64, generator=gen)
    w0 = torch.rand(s.width, dtype=torch.float64, generator=gen)
    xs = x.tensor_split(size)
    given = xs[rank] if s.src == "local" else (x if s.src is None or rank == s.src else None)
    if given is not None and s.grad:
        given = given.clone().requires_grad_()
    w = w0.clone().requires_grad_(s.grad)
    opts: Dict[str, Any] = dict(src=s.src, dst=s.dst, mode=s.mode, axis_name="i" if s.collective else None)
    if group is not None:
        opts.update(group=group, timeout=SKIP_TIMEOUT)
    if s.kind == "skip" and rank == s.rank:
        return "skipped"
    try:
        if s.kind == "fault":
            with inject_fault(s.phase, [s.rank]):
                out = _forward_backward(s, given, w, opts)
        else:
            out = _forward_backward(s, given, w, opts)
    except cm.CmapError as err:
        return _failed(s, err, rank, size)
    assert s.kind in ("ok", "fault") and not (s.kind == "fault" and _fires(s, size)), f"{s}: no error"
    _check(s, x, w0, xs, given, w, out, rank)
    return "ok"


def _forward_backward(s: Scenario, given: Any, w: torch.Tensor, opts: Dict[str, Any]) -> Any:
    out = cm.cmap(_func(s, w), **opts)(given)
    if s.grad:
        out.sum().backward()
    return out


def _failed(s: Scenario, err: cm.CmapError, rank: int, size: int) -> str:
    named = sorted({f.group_rank for f in err.failures})
    text = str(err)
    if s.kind == "skip":
        return "skip-error"
    if s.kind == "shape":
        return "shape-error:" + text.splitlines()[0]
    if s.kind == "forward":
        assert named == [s.rank] and isinstance(err, ValueError), (s, text)
    elif s.kind == "backward":
        assert named == [s.rank] and isinstance(err, ValueError) and "(backward)" in text, (s, text)
        assert (type(err.__cause__) is ValueError) == (rank == s.rank), (s, repr(err.__cause__))
    elif s.kind == "fault":
        faulty = [f.group_rank for f in err.failures if f.exc_type == InjectedFault.__qualname__]
        assert faulty == [s.rank], (s, text)
    else:
        raise AssertionError(f"{s}: unexpected {text}")
    return f"{s.kind}-error:{named}"


def _check(s: Scenario, x, w0, xs, given, w, out, rank: int) -> None:
    want_x = x.clone().requires_grad_(s.grad)
    want_w = w0.clone().requires_grad_(s.grad)
    want = _oracle(s, want_x, want_w)
    if s.dst == 0 and rank != 0:
        assert out is None, s
    elif s.dst == "local":
        torch.testing.assert_close(out, want.tensor_split(len(xs))[rank], rtol=1e-10, atol=1e-10)
    else:
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    if s.grad:
        want.sum().backward()
        torch.testing.assert_close(w.grad, want_w.grad, rtol=1e-9, atol=1e-9)
        wx = want_x.grad if s.src is None else want_x.grad.tensor_split(len(xs))[rank]
        torch.testing.assert_close(given.grad, wx, rtol=1e-9, atol=1e-9)


def _after(size: int) -> None:
    """A raw collective, then a small cmap call, work on every rank."""
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == size, t
    x = torch.arange(6.0).view(3, 2)
    torch.testing.assert_close(cm.cmap(torch.sin)(x), x.sin())


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(seed: int, calls: int, skip_rate: float = 0.05) -> Dict[str, Any]:
    """``calls`` scenarios from ``seed`` on this rank (a share ``skip_rate`` of them skips, each costing the short
    timeout); returns the outcomes and the figures."""
    size = dist.get_world_size()
    rng = random.Random(seed)
    outcomes: List[str] = []
    kinds: Counter = Counter()
    warm = max(calls // 10, 5)
    rss0 = fds0 = 0.0
    start = time.perf_counter()
    for n in range(calls):
        if n == warm:
            rss0, fds0 = _rss_mib(), _fds()
        s = scenario(rng, size, skip_rate)
        group = dist.new_group(timeout=timedelta(seconds=4 * SKIP_TIMEOUT)) if s.kind == "skip" else None
        outcomes.append(one_call(s, seed * 100_003 + n, group))
        kinds[s.kind + (f":{s.phase}" if s.phase else "")] += 1
        _after(size)
    return dict(
        outcomes=outcomes,
        kinds=dict(kinds),
        seconds=time.perf_counter() - start,
        rss_growth_mib=_rss_mib() - rss0,
        fd_growth=_fds() - fds0,
        skips=kinds["skip"],
    )
