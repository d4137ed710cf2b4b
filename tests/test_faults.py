"""The all-ranks failure guarantee at every step: a fault injected at each phase of a call, on one rank, for every
``src``/``dst`` placement, becomes the same ``CmapError`` on every rank, and the group stays usable.

Faults come from the public testing aid ``colossalai_cmap.faults.inject_fault``; nothing is mocked.
"""

import contextlib
import math
import time
from typing import Any, Callable, Tuple

import pytest
import torch
import torch.distributed as dist
from soak import FailsInBackward

import colossalai_cmap as cm
from colossalai_cmap.faults import InjectedFault, inject_fault

PLACEMENTS = [(src, dst) for src in (None, 0, "local") for dst in (-1, 0, "local")]


def _call(src, dst, width=3, grad=False):
    """One call of a small (or, with a large width, data-phase) cmap; with grad, its backward too."""
    rank, size = dist.get_rank(), dist.get_world_size()
    B = 2 * size + 1
    x = torch.arange(B * width, dtype=torch.float64).view(B, width) / 100
    if src == "local":
        x = x.tensor_split(size)[rank]
    elif src is not None and rank != src:
        x = None
    w = torch.linspace(0, 1, width, dtype=torch.float64, requires_grad=grad)
    out = cm.cmap(lambda v: (v * w).sin(), src=src, dst=dst)(x)
    if grad:
        out.sum().backward()
    return out


def _fires(phase, src, dst, rank, grad, large):
    """Whether ``phase`` exists in this call on ``rank`` (the rank the fault is injected on)."""
    if phase == "args":
        return not isinstance(src, int) or rank == src
    if phase == "scatter":
        return isinstance(src, int)
    if phase in ("record", "backward"):
        return grad
    if phase == "gather":
        return large and dst != "local" and src != "local"
    return True


def cases(size):
    victim = size - 1
    found = []
    for src, dst in PLACEMENTS:
        for phase in ("args", "scatter", "func", "layout", "pack"):
            found.append((phase, src, dst, False, False))
        found.append(("gather", src, dst, False, True))
    for src in (None, "local"):  # gradients cross ranks with dst=-1
        found += [("record", src, -1, True, False), ("backward", src, -1, True, False)]
    return [(victim,) + c for c in found if _fires(c[0], c[1], c[2], victim, c[3], c[4])]


def check_fault_matrix():
    """Every case on this world; returns the number of faults every rank saw raised."""
    size = dist.get_world_size()
    raised = 0
    for victim, phase, src, dst, grad, large in cases(size):
        what = f"{phase} src={src} dst={dst} grad={grad} large={large}"
        with inject_fault(phase, [victim]), pytest.raises(cm.CmapError) as info:
            _call(src, dst, width=40_000 if large else 3, grad=grad)
        failing = [f for f in info.value.failures if f.exc_type == InjectedFault.__qualname__]
        assert [f.group_rank for f in failing] == [victim], (what, str(info.value))
        assert f"injected fault at phase {phase!r}" in str(info.value), what
        raised += 1
        _call(src, dst)  # the group is still usable, on every rank
    return raised


@pytest.mark.parametrize("P", [2, 3, 4])
def test_fault_at_every_phase_reaches_every_rank(worlds, P):
    counts = worlds(P).run(check_fault_matrix, deadline=240)
    assert counts == [len(cases(P))] * P


PAST_THE_ROUNDS = 110_000  # float64 per row: 5 rows at P = 2 are 4.4 MB, past the largest round (4 MiB in all)


def check_faults_in_steady_large_calls(dst):
    """A large call (past the largest round), repeated until every rank sends its data right behind the exit round
    (the gather to ``dst``, or the all-gather): a fault at each phase on one rank, then a rank whose output has
    another shape, are the same CmapError on every rank, whichever rank it is; the calls after each are right."""
    import wire_tap

    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.randn(2 * size + 1, PAST_THE_ROUNDS, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    narrow = []  # the ranks whose output is one column short

    def f(v):
        y = v.sin()
        return y[:-1] if rank in narrow else y

    mapped = cm.cmap(f, dst=dst)

    def call(k):
        y = mapped(x + k)
        assert torch.equal(y, (x + k).sin()) if dst in (-1, rank) else y is None, k
        return y

    data = "all_gather_into_tensor" if dst == -1 else "gather"
    for k in range(3):
        with wire_tap.counting() as log:
            call(k)
    assert log.events[:2] == [("issue", "all_gather_into_tensor"), ("issue", data)], log.events  # sent early
    seen = []
    for victim in sorted({0, size - 1}):
        seen += _faults_then_steady(call, victim, ("func", "layout", "pack", "gather"))
        narrow[:] = [victim]
        with pytest.raises(cm.CmapError, match="shape"):
            mapped(x)
        narrow.clear()
        seen.append((victim, "shape"))
        call(1)
        call(2)
    return seen


@pytest.mark.parametrize("dst", [-1, 0, 1])
def test_faults_in_steady_large_calls_reach_every_rank(worlds, dst):
    got = worlds(2).run(check_faults_in_steady_large_calls, dst, deadline=120)
    phases = ["func", "layout", "pack", "gather", "shape"]
    assert got == [[(v, p) for v in (0, 1) for p in phases]] * 2


def check_faults_in_steady_large_backward():
    """Training steps whose x-gradient gather is past the largest round, repeated until every rank sends that data
    right behind the backward's round: a fault in backward on one rank (and in the step's forward) is the same
    CmapError on every rank, whichever rank it is; the steps after each give vmap's gradient."""
    import wire_tap

    size = dist.get_world_size()
    x = torch.randn(2 * size + 1, PAST_THE_ROUNDS, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mapped = cm.cmap(torch.sin)

    def step(k):
        given = (x + k).requires_grad_()
        mapped(given).pow(2).sum().backward()
        want = (x + k).requires_grad_()
        torch.sin(want).pow(2).sum().backward()
        assert torch.equal(given.grad, want.grad), k

    for k in range(3):
        with wire_tap.counting() as log:
            step(k)
    backward = log.events[len(log.events) // 2 :]
    assert backward[:2] == [("issue", "all_gather_into_tensor")] * 2, log.events  # sent early
    return [found for victim in sorted({0, size - 1}) for found in _faults_then_steady(step, victim, PHASES_IN_STEP)]


PHASES_IN_STEP = ("backward", "func", "gather")


def _faults_then_steady(call, victim, phases):
    """``call(0)`` with a fault at each phase on ``victim``: the same CmapError on every rank, naming it; then
    ``call(1)`` and ``call(2)``, which check their own values. The (victim, phase) pairs seen."""
    seen = []
    for phase in phases:
        with inject_fault(phase, [victim]), pytest.raises(cm.CmapError) as info:
            call(0)
        failing = [f.group_rank for f in info.value.failures if f.exc_type == InjectedFault.__qualname__]
        assert failing == [victim], (victim, phase, str(info.value))
        seen.append((victim, phase))
        call(1)
        call(2)
    return seen


def test_faults_in_steady_large_backward_reach_every_rank(worlds):
    got = worlds(2).run(check_faults_in_steady_large_backward, deadline=120)
    assert got == [[(v, p) for v in (0, 1) for p in PHASES_IN_STEP]] * 2


def check_faults_in_steady_summed_backward():
    """Training steps of ``cmap(lambda r: tanh(r @ w))`` with a 256 x 256 weight shared by every example: at P = 3 its
    gradient (256 KiB) takes its own all-reduce, which goes right behind the backward's round once the steps repeat.
    A fault in backward on one rank (in the step's forward, or in packing the gradient) is the same CmapError on every
    rank, whichever rank it is, and the steps after each give vmap's gradient: the rank that fails sends a stand-in
    all-reduce for its peers' early one."""
    import wire_tap

    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(256, 256, generator=gen).requires_grad_(), torch.randn(6, 256, generator=gen)
    mapped = cm.cmap(lambda r: torch.tanh(r @ w))
    want = torch.autograd.grad(torch.vmap(lambda r: torch.tanh(r @ w))(x).sum(), w)[0]

    def step(k):
        w.grad = None
        mapped(x).sum().backward()
        # each entry sums 6 rows' terms x * tanh' (|x| < 4.5 for these draws, tanh' <= 1), here 2 per rank and then
        # the 3 ranks' sums, in vmap one order: each order within 5 eps of the terms' |sum| <= 27, so within 270 eps
        assert (w.grad - want).abs().max() <= 6 * 20 * torch.finfo(torch.float32).eps * 4, k

    for k in range(6):
        step(k)
    w.grad = None
    loss = mapped(x).sum()
    with wire_tap.counting() as log:
        loss.backward()
    assert log.events == [
        ("issue", "all_gather_into_tensor"),
        ("issue", "all_reduce"),
        ("wait", "all_gather_into_tensor"),
        ("wait", "all_reduce"),
    ], log.events  # sent early
    size = dist.get_world_size()
    return [found for victim in sorted({0, size - 1}) for found in _faults_then_steady(step, victim, PHASES_IN_STEP)]


def test_faults_in_steady_summed_backward_reach_every_rank(worlds):
    got = worlds(3).run(check_faults_in_steady_summed_backward, deadline=120)
    assert got == [[(v, p) for v in (0, 2) for p in PHASES_IN_STEP]] * 3


def _large_op(op: str, size: int) -> Tuple[Callable, Callable, str]:
    """f applying ``op`` to its block's sine on a line of ``size`` ranks, blocks of (2 size, 4096) float64 (too large
    to ride in a round at P = 3); the unsharded function of x of (2 size^2, 4096); and the collective that carries
    the op's data."""
    blocks = lambda v: v.sin().view(size, size, 2, 4096)  # noqa: E731  [rank, chunk, rows, D]
    if op == "psum":
        f = lambda b: cm.psum(b.sin(), "x") * b  # noqa: E731
        want = lambda v: blocks(v).sum(0).reshape(-1, 4096).repeat(size, 1) * v  # noqa: E731
        return f, want, "all_reduce"
    if op == "psum_scatter":
        f = lambda b: cm.psum_scatter(b.sin(), "x", tiled=True)  # noqa: E731
        return f, (lambda v: blocks(v).sum(0).reshape(-1, 4096)), "reduce_scatter_tensor"
    if op == "all_to_all":
        f = lambda b: cm.all_to_all(b.sin(), "x", 0, 0, tiled=True)  # noqa: E731
        return f, (lambda v: blocks(v).transpose(0, 1).reshape(-1, 4096)), "all_to_all_single"
    f = lambda b: cm.ppermute(b.sin(), "x", [(i, (i + 1) % size) for i in range(size)])  # noqa: E731
    return f, (lambda v: blocks(v).roll(1, 0).reshape(-1, 4096)), "all_to_all_single"


LARGE_OPS = ("psum", "psum_scatter", "all_to_all", "ppermute")
# f raising before or after the op; a fault injected as the op packs (its round), or as a Join prepares its data
# phase (psum's); a node before or after the op whose backward raises (after or before the op's transpose)
HOWS = ("before", "after", "pack", "gather", "node before", "node after")


def check_failures_around_a_large_op_sent_behind_its_round(op: str) -> list:
    """Training steps of ``shard_map(f)`` on a line of the world, f a psum, psum_scatter, all_to_all or ring ppermute
    of its block's sine (at P = 3 too large to ride in its round: its collective goes right behind the round once the
    steps repeat, in forward and its transpose's in backward), with a failure on each rank in turn (:data:`HOWS`):
    a peer's early data meets this rank's stand-in. Each step's outcome on this rank and its seconds."""
    import wire_tap
    from shard_cases import mesh

    size = dist.get_world_size()
    x = torch.rand(2 * size * size, 4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.1
    apply, want, native = _large_op(op, size)
    ref = x.clone().requires_grad_()
    want(ref).pow(2).sum().backward()
    seen = []
    for failing, how in [(-1, None)] * 5 + [(r, how) for r in range(size) for how in HOWS]:
        me = dist.get_rank() == failing

        def f(b):
            if how == "before" and me:
                raise ValueError("f failed before its op")
            b = FailsInBackward.apply(b, failing) if how == "node before" else b
            out = apply(b)
            if how == "after" and me:
                raise ValueError("f failed after its op")
            return FailsInBackward.apply(out, failing) if how == "node after" else out

        g = cm.shard_map(f, mesh=mesh((size,), ("x",)), in_specs=cm.P("x"), out_specs=cm.P("x"), timeout=10)
        given = x.clone().requires_grad_()
        start = time.perf_counter()
        try:
            with inject_fault(how, [failing]) if how in ("pack", "gather") else contextlib.nullcontext():
                with wire_tap.counting() as forward:
                    got = g(given)
                with wire_tap.counting() as backward:
                    got.pow(2).sum().backward()
            # sums of 3 positive sines (2 eps relative each), a square and its derivative: within 8 eps relative
            tolerance = 8 * torch.finfo(x.dtype).eps
            assert ((got - want(x)).abs() <= tolerance * want(x).abs()).all()
            assert ((given.grad - ref.grad).abs() <= 2 * tolerance * ref.grad.abs()).all()
            outcome = "ok"
            if len(seen) == 4:  # steady: the op's collective went right behind its round, and its transpose's
                issued = [("issue", "all_gather_into_tensor"), ("issue", native)]
                assert forward.events[:2] == issued, forward.events
                transpose = "all_gather_into_tensor" if op == "psum_scatter" else native  # its rows ride in its round
                assert ("issue", transpose) in backward.events[1:3], backward.events
        except cm.CmapError as exc:
            outcome = "CmapError naming it" if f"group rank {failing} " in str(exc) else str(exc)
        seen.append((failing, how, outcome, time.perf_counter() - start))
    return seen


@pytest.mark.parametrize("op", LARGE_OPS)
def test_a_failure_around_a_large_op_sent_behind_its_round_is_every_rank_s_error(worlds, op):
    seen_by_rank = worlds(3).run(check_failures_around_a_large_op_sent_behind_its_round, op, deadline=180)
    for rank, seen in enumerate(seen_by_rank):
        for failing, how, outcome, seconds in seen:
            assert seconds < 10 / 3, (op, rank, failing, how, seconds)
            assert outcome == ("ok" if failing < 0 else "CmapError naming it"), (op, rank, failing, how, outcome)


CHAIN_OPS = ("psum", "psum_scatter", "all_to_all", "ppermute", "all_gather")


def _chain_step(op: str, h: torch.Tensor, axis: Any, size: int) -> torch.Tensor:
    """One op of a chain on this rank's block ``h`` (rows, D), over ``axis`` (a name or a tuple) of ``size`` ranks."""
    if op == "psum":
        return cm.psum(h, axis)
    if op == "psum_scatter":
        return cm.psum_scatter(h, axis, tiled=True)
    if op == "all_to_all":
        return cm.all_to_all(h, axis, 0, 0, tiled=True)
    if op == "ppermute":
        return cm.ppermute(h, axis, [(i, (i + 1) % size) for i in range(size)])
    return cm.all_gather(h, axis, tiled=True).view(size, *h.shape).sum(0)  # every block, summed: psum by a gather


def _chain_step_unsharded(op: str, blocks: torch.Tensor) -> torch.Tensor:
    """The same op on every block at once: ``blocks`` of (n, m, rows, D), the op over the n ranks of each of m
    groups (the axis's ranks along dim 0, in axis-index order): what the mesh computes."""
    n, m, rows, width = blocks.shape
    if op in ("psum", "all_gather"):
        return blocks.sum(0, keepdim=True).expand(n, m, rows, width)
    if op == "psum_scatter":  # axis index r: chunk r of the sum
        return blocks.sum(0).view(m, n, rows // n, width).transpose(0, 1)
    if op == "all_to_all":  # axis index r: chunk r of every block of its group, in axis-index order
        return blocks.view(n, m, n, rows // n, width).transpose(0, 2).reshape(n, m, rows, width)
    return blocks.roll(1, 0)  # the ring: index r gets index r - 1's


def _over(blocks: torch.Tensor, axis: Any, names: Tuple[str, ...], op: str) -> torch.Tensor:
    """``op`` over ``axis`` of a mesh whose blocks are ``blocks`` (one dim per mesh axis, then rows and D)."""
    axes = [names.index(a) for a in ((axis,) if isinstance(axis, str) else axis)]
    rest = [d for d in range(len(names)) if d not in axes]
    order = axes + rest + [len(names), len(names) + 1]
    moved = blocks.permute(order)
    shape = moved.shape
    n = math.prod(shape[: len(axes)])
    done = _chain_step_unsharded(op, moved.reshape(n, -1, *shape[-2:]))
    back = done.reshape(*shape[: len(names)], *done.shape[-2:])
    return back.permute([order.index(d) for d in range(len(order))])


def check_random_chains_of_large_ops_with_failures(shape: Tuple[int, ...], steps: int, seed: int) -> list:
    """Training steps of ``shard_map(f)`` on a mesh of the world (a line of 3, or 2 x 2 with its rows over both axes),
    f a chain of one to three collectives drawn from :data:`CHAIN_OPS`, each over a random axis (or on 2 x 2 both), on
    blocks of (2 P^2, 512) float64 (4 KiB rows: past what rides in a round, so each takes its own collective, right
    behind its round once a chain repeats; a chain is kept for 6 steps), typed or not, and in most steps a failure on
    a random rank: f raising before an op, a node before an op whose backward raises, or a fault injected in forward's
    rounds ("pack") or backward's ("backward"). Each step's outcome on this rank, its seconds, and for a clean step
    whether the output and the gradient are the unsharded chain's."""
    import random

    from shard_cases import mesh

    size, me = dist.get_world_size(), dist.get_rank()
    names = ("x", "y")[: len(shape)]
    grid = mesh(shape, names)
    axes = list(names) + ([names] if len(names) > 1 else [])
    rng = random.Random(seed)
    x = torch.rand(2 * size**3, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) + 0.1
    seen = []
    for step in range(steps):
        if step % 6 == 0:
            ops = [(rng.choice(CHAIN_OPS), rng.choice(axes)) for _ in range(rng.randint(1, 3))]
            typed = rng.random() < 0.5
        how = rng.choice((None, None, "raise", "node", "pack", "backward"))
        failing, at = (rng.randrange(size) if how else -1), rng.randrange(len(ops))

        def f(b: torch.Tensor) -> torch.Tensor:
            h = b.sin()
            for k, (op, axis) in enumerate(ops):
                if k == at and how == "raise" and me == failing:
                    raise ValueError("f failed before an op")
                h = FailsInBackward.apply(h, failing) if k == at and how == "node" else h
                h = _chain_step(op, h, axis, math.prod(grid.size(names.index(a)) for a in cm_names(axis)))
            return h

        g = cm.shard_map(f, mesh=grid, in_specs=cm.P(names), out_specs=cm.P(names), check_vma=typed, timeout=10)
        given = x.clone().requires_grad_()
        start = time.perf_counter()
        try:
            injected = how in ("pack", "backward") and me == failing  # in every group this rank is in
            with inject_fault(how, range(size)) if injected else contextlib.nullcontext():
                out = g(given)
                out.pow(2).sum().backward()
            outcome = "ok"
        except cm.CmapError as exc:
            outcome = "CmapError naming it" if f"(global rank {failing})" in str(exc) else str(exc)
        seconds = time.perf_counter() - start
        right = None
        if outcome == "ok":
            ref = x.clone().requires_grad_()
            blocks = ref.sin().view(*shape, -1, 512)
            for op, axis in ops:
                blocks = _over(blocks, axis, names, op)
            want = blocks.reshape(-1, 512)
            want.pow(2).sum().backward()
            # up to three sums of up to 4 positive terms (3 eps relative each), a square, its derivative and cos > 0:
            # every value and gradient positive, within about 24 eps relative; 48 allowed
            close = lambda a, b: bool(((a - b).abs() <= 48 * torch.finfo(b.dtype).eps * b.abs()).all())  # noqa: E731
            right = close(out.detach(), want.detach()) and close(given.grad, ref.grad)
        seen.append((step, tuple(ops), how, failing, outcome, seconds, right))
    return seen


def cm_names(axis: Any) -> Tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


@pytest.mark.parametrize("shape", [(3,), (2, 2)], ids=["line of 3", "2 x 2"])
def test_random_chains_of_large_ops_with_failures_are_every_rank_s_error(worlds, shape):
    """Failures among chains of collectives that send their data behind their rounds: every rank's outcome is the
    same, a failure is every rank's CmapError naming the failing rank within a third of the timeout, and every clean
    step gives the unsharded chain's values and gradients."""
    seen_by_rank = worlds(math.prod(shape)).run(
        check_random_chains_of_large_ops_with_failures, shape, 48, 7, deadline=240
    )
    for steps in zip(*seen_by_rank):
        step, ops, how, failing, _, _, _ = steps[0]
        for _, _, _, _, outcome, seconds, right in steps:
            assert outcome == ("ok" if how is None else "CmapError naming it"), (step, ops, how, failing, outcome)
            assert seconds < 10 / 3, (step, ops, how, failing, seconds)
            assert right in (None, True), (step, ops)
    assert sum(1 for steps in zip(*seen_by_rank) if steps[0][2] is None) >= 8  # enough clean steps to check values


def check_failure_before_a_large_op_over_both_axes(op: str) -> list:
    """Steps of ``shard_map(f)`` on a 2 x 2 mesh, f a ``psum`` over "x" (small: it rides in its round) and then
    ``op`` over ("x", "y") of 128 KiB blocks (its own collective on the group of both axes, right behind its round
    once the steps repeat), with f raising between the two on each rank in turn. The raising rank's exit posts the
    failure on the whole mesh's group, on x's and on both axes' group, and waits on x's first; its partner on x waits
    in the op's collective for the raising rank's data, so the post on both axes' group must carry a stand-in of it.
    Each step's outcome on this rank and its seconds."""
    from shard_cases import mesh

    grid, me = mesh((2, 2), ("x", "y")), dist.get_rank()
    x = torch.rand(32, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.1
    seen = []
    for failing in (-1, -1, -1, 0, -1, -1, 1, -1, -1, 2, -1, -1, 3):

        def f(b: torch.Tensor) -> torch.Tensor:
            h = cm.psum(b.sin(), "x")
            if me == failing:
                raise ValueError("f failed between its ops")
            return _chain_step(op, h, ("x", "y"), 4)

        g = cm.shard_map(f, mesh=grid, in_specs=cm.P(("x", "y")), out_specs=cm.P(("x", "y")), timeout=10)
        start = time.perf_counter()
        try:
            g(x.clone().requires_grad_()).pow(2).sum().backward()
            outcome = "ok"
        except cm.CmapError as exc:
            outcome = "CmapError naming it" if f"(global rank {failing})" in str(exc) else str(exc)
        seen.append((failing, outcome, time.perf_counter() - start))
    return seen


@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_to_all", "ppermute"])
def test_a_failure_before_a_large_op_over_both_axes_is_every_rank_s_error_at_once(worlds, op):
    """Before, every rank raised the CmapError only after the timeout (10 s), and the mesh's groups were out of step
    after it."""
    for rank, seen in enumerate(worlds(4).run(check_failure_before_a_large_op_over_both_axes, op, deadline=180)):
        for failing, outcome, seconds in seen:
            assert outcome == ("ok" if failing < 0 else "CmapError naming it"), (rank, failing, outcome)
            assert seconds < 10 / 3, (rank, failing, seconds)


def check_group_of_one():
    """P = 1: the phases before any exchange still raise CmapError, and the next call works."""
    for phase in ("args", "func"):
        with inject_fault(phase, [0]), pytest.raises(cm.CmapError, match=f"phase {phase!r}"):
            _call(None, -1)
        _call(None, -1)
    return True


def test_group_of_one(worlds):
    assert worlds(1).run(check_group_of_one) == [True]


def check_user_backward_failure(axis):
    """func's own backward raises on one rank: every rank raises the same CmapError naming it, a ValueError as the
    original was, with the original as ``__cause__`` on that rank; the user's own collective and the next call work."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.randn(2 * size, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.ones(3, requires_grad=True)
    f = (
        (lambda v: cm.pmean(FailsInBackward.apply(v, size - 1) * w, "i"))
        if axis
        else (lambda v: FailsInBackward.apply(v, size - 1) * w)
    )
    out = cm.cmap(f, axis_name="i" if axis else None)(x)
    with pytest.raises(ValueError) as info:
        out.sum().backward()
    err = info.value
    assert isinstance(err, cm.CmapError) and [f.group_rank for f in err.failures] == [size - 1], str(err)
    assert "(backward) failed on 1 rank(s)" in str(err) and "the user's backward failed" in str(err)
    assert (type(err.__cause__).__name__ == "ValueError") == (rank == size - 1)
    total = torch.ones(1)
    dist.all_reduce(total)  # the user's own collective pairs with the peers' own
    assert total.item() == size
    assert torch.equal(cm.cmap(torch.sin)(x.detach()), x.detach().sin())
    return True


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("axis", [False, True])
def test_failure_in_user_backward(worlds, P, axis):
    assert worlds(P).run(check_user_backward_failure, axis, deadline=60) == [True] * P


# ------------------------------------------------------------------------------------------- the native collectives
def _native_ops(size):
    """Each op that takes its native collective inside func, over the axis of B = 2 size + 1 examples."""
    B = 2 * size + 1
    ring = [(i, (i + 1) % B) for i in range(B)]
    return {
        "psum_scatter": lambda v: cm.psum_scatter(v.expand(B, 3), "i"),
        "all_gather": lambda v: cm.all_gather(v, "i").sum(0) * v,
        "all_to_all": lambda v: cm.all_to_all(v.expand(B, 3), "i", 0, 0),
        "ppermute": lambda v: cm.ppermute(v, "i", ring) * v,
    }


def check_native_op_faults():
    """A fault on one rank as it enters a native collective inside func (phase "pack"), or its transpose in backward
    (phase "backward"), is the same CmapError on every rank, naming that rank, with its traceback there; the group
    stays usable."""
    rank, size = dist.get_rank(), dist.get_world_size()
    victim = size - 1
    x = torch.arange((2 * size + 1) * 3, dtype=torch.float64).view(-1, 3).tensor_split(size)[rank] / 10
    seen = []
    for name, f in _native_ops(size).items():
        mapped = cm.cmap(f, axis_name="i", src="local", dst="local")  # no other exchange in backward
        for phase in ("pack", "backward"):
            xs = x.clone().requires_grad_(phase == "backward")
            with inject_fault(phase, [victim]), pytest.raises(cm.CmapError) as info:
                out = mapped(xs)
                if phase == "backward":
                    out.sum().backward()
            failing = [f.group_rank for f in info.value.failures if f.exc_type == InjectedFault.__qualname__]
            assert failing == [victim], (name, phase, str(info.value))
            # raised entering the native op: its status round, here (small data) the Join whose round carries it
            assert "in join_values" in info.value.failures[0].traceback, (name, phase)
            seen.append((name, phase))
            mapped(x)  # the group is still usable, on every rank
    return seen


@pytest.mark.parametrize("P", [2, 3])
def test_fault_in_each_native_collective_reaches_every_rank(worlds, P):
    got = worlds(P).run(check_native_op_faults, deadline=120)
    assert got == [[(op, phase) for op in _native_ops(P) for phase in ("pack", "backward")]] * P


def check_user_backward_failure_in_shard_map(check_vma):
    """The same in shard_map on a mesh of one axis, with a psum, a closure and a replicated input inside f: every
    rank raises the same CmapError; without the failure, every gradient is the unsharded program's."""
    from shard_cases import mesh

    rank, size = dist.get_rank(), dist.get_world_size()
    m = mesh((size,), ("i",))
    x = torch.randn(2 * size, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    r = torch.randn(3, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w = torch.randn(3, generator=torch.Generator().manual_seed(2)).requires_grad_()

    def run(failing):
        f = cm.shard_map(
            lambda b, s: cm.psum(FailsInBackward.apply(b, failing).sin() * w, "i") * s,
            m,
            (cm.P("i"), cm.P()),
            cm.P(),
            check_vma=check_vma,
        )
        return f(x, r).sum()

    with pytest.raises(ValueError) as info:
        run(size - 1).backward()
    err = info.value
    assert isinstance(err, cm.CmapError) and [f.group_rank for f in err.failures] == [size - 1], str(err)
    assert (type(err.__cause__).__name__ == "ValueError") == (rank == size - 1)
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == size
    got = torch.autograd.grad(run(-1), (x, r, w))
    xs, rs, ws = (t.detach().clone().requires_grad_() for t in (x, r, w))
    want = torch.autograd.grad((xs.sin().view(size, 2, 3).sum(0) * ws * rs).sum(), (xs, rs, ws))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    return True


@pytest.mark.parametrize("check_vma", [True, False])
def test_failure_in_user_backward_in_shard_map(worlds, check_vma):
    assert worlds(2).run(check_user_backward_failure_in_shard_map, check_vma, deadline=60) == [True] * 2


# a 2 x 2 mesh's specs, typed or not, and where f's psum over y sits from the failing node: its transpose runs before
# that node's backward raises, or after (a peer of the failing rank then waits in it); or f takes no collective
MESH_SPECS = {
    "P('x')": cm.P("x"),
    "P(None, 'y')": cm.P(None, "y"),
    "P('x', 'y')": cm.P("x", "y"),
    "P(('x', 'y'))": cm.P(("x", "y")),
}
ORDERS = ("psum, then the failing node", "the failing node, then psum", "no collective")
MESH_BACKWARD_CASES = [(spec, typed, order) for spec in MESH_SPECS for typed in (True, False) for order in ORDERS]


def check_user_backward_failure_on_a_2d_mesh(
    spec: str,
    typed: bool,
    order: str,
    shape: tuple = (2, 2),
    names: tuple = ("x", "y"),
    over: Any = "y",
    width: int = 4,
) -> list:
    """Training steps of shard_map(f) on a 2 x 2 mesh (or ``shape``) on an (8, ``width``) input, f a psum over y (or
    ``over``) and a node whose backward raises on one rank, after a step that marks the mesh (f communicates over part
    of it): each step's outcome on this rank, and its seconds."""
    from shard_cases import mesh

    m = mesh(shape, names)
    specs = {**MESH_SPECS, "P(names)": cm.P(names)}
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(0)).requires_grad_()
    seen = []
    for failing in (-1, 3, -1, -1, 1, -1, -1):

        def f(b):
            if order == ORDERS[0]:
                return FailsInBackward.apply(cm.psum(b, over), failing) * 2
            if order == ORDERS[1]:
                return cm.psum(FailsInBackward.apply(b, failing), over) * 2
            return FailsInBackward.apply(b, failing) * 2

        g = cm.shard_map(f, mesh=m, in_specs=specs[spec], out_specs=specs[spec], check_vma=typed, timeout=10)
        seen.append((failing, *timed_training_step(g, x, failing)))
    return seen


def timed_training_step(g: Callable, x: torch.Tensor, failing: int) -> Tuple[str, float]:
    """A training step of ``g`` on ``x``: "ok", "CmapError naming it" (the failing rank), another CmapError, or
    "own" (the failing rank's own error); and its seconds."""
    start = time.perf_counter()
    try:
        g(x).pow(2).sum().backward()
        outcome = "ok"
    except cm.CmapError as exc:
        outcome = "CmapError" if f"group rank {failing} " not in str(exc) else "CmapError naming it"
    except ValueError as exc:
        outcome = "own" if dist.get_rank() == failing and "the user's backward failed" in str(exc) else repr(exc)
    return outcome, time.perf_counter() - start


@pytest.mark.parametrize("spec, typed, order", MESH_BACKWARD_CASES)
def test_a_failure_in_user_backward_on_a_2d_mesh_is_every_rank_s_error_in_that_step(worlds, spec, typed, order):
    """A shard_map's backward on a mesh of several axes is guarded whatever the blocks' groups: every rank raises a
    CmapError naming the failing rank in the failing step, promptly, and every other step runs. The failure is
    posted on each axis's group and the whole mesh's, so a peer waiting in f's psum over y, or in its blocks' Join
    over x, is told; where every block entered over an axis, the guarded backward ends with a round over the whole
    mesh, where a rank whose rounds met no failure meets it. (Before, such a backward was unguarded: the failing
    rank raised its own error and went on, and a peer waiting for it on an axis waited for the timeout where the
    failing rank's next call made its first round elsewhere, the group broken after.)"""
    for rank, seen in enumerate(worlds(4).run(check_user_backward_failure_on_a_2d_mesh, spec, typed, order)):
        for failing, outcome, seconds in seen:
            assert seconds < 10 / 3, (rank, seen)
            assert outcome == ("ok" if failing < 0 else "CmapError naming it"), (rank, seen)


def check_user_backward_failure_with_a_replicated_weight(shape: tuple, names: tuple, spec: str, typed: bool) -> list:
    """jax's data-parallel step: ``shard_map(f, in_specs=(spec, P()))`` on a batch that does not require grad and a
    weight replicated on every rank, f a node whose backward raises on one rank applied to ``tanh(b @ w)``; each
    step's outcome on this rank, and its seconds."""
    from shard_cases import mesh

    m = mesh(shape, names)
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 4, generator=gen).requires_grad_(), torch.randn(8, 4, generator=gen)
    seen = []
    for failing in (-1, 3, -1, 1, -1, 0, -1, 2, -1):

        def f(b, v):
            return FailsInBackward.apply(torch.tanh(b @ v), failing)

        g = cm.shard_map(
            f, mesh=m, in_specs=(MESH_SPECS[spec], cm.P()), out_specs=MESH_SPECS[spec], check_vma=typed, timeout=10
        )
        seen.append((failing, *timed_training_step(lambda given: g(given, w), x, failing)))
    return seen


@pytest.mark.parametrize(
    "shape, names, spec, typed",
    [
        ((2, 2), ("x", "y"), "P('x')", True),
        ((2, 2), ("x", "y"), "P('x')", False),
        ((2, 2), ("x", "y"), "P(('x', 'y'))", True),
        ((4,), ("x",), "P('x')", True),
    ],
    ids=["2x2 P(x) typed", "2x2 P(x) untyped", "2x2 P((x, y)) typed", "4 P(x) typed"],
)
def test_a_failure_in_user_backward_with_only_a_replicated_weight_requiring_grad(worlds, shape, names, spec, typed):
    """Only the replicated weight requires grad. With types it enters f as it is, and its gradient's sum runs inside
    f's graph (the transpose of its ``pcast``), over x alone where the output is replicated over y. Every rank raises
    the CmapError naming the failing rank in the failing step, promptly, and every other step runs: the guarded
    backward ends with a round on the whole mesh. (Before, such a backward was unguarded: on 2 x 2 with ``P('x')``,
    ranks that shared no group with the failing one returned, its partner waited for the timeout, and the group was
    broken after; elsewhere the failing rank raised its own error and its peers a CmapError that did not name it.)"""
    for rank, seen in enumerate(
        worlds(4).run(check_user_backward_failure_with_a_replicated_weight, shape, names, spec, typed)
    ):
        for failing, outcome, seconds in seen:
            assert seconds < 10 / 3, (rank, seen)
            assert outcome == ("ok" if failing < 0 else "CmapError naming it"), (rank, seen)


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize("spec", ["P(('x', 'y'))", "P('x', 'y')"])
def test_a_failure_in_user_backward_reaches_peers_whose_gradient_went_right_behind_their_round(worlds, spec, typed):
    """Blocks of 16 KiB: their gradient's gather does not ride in its round, and has the shape of the exit's data
    phase, so the peers send it right behind the round and wait for the failing rank's stand-in before they post the
    failure on the mesh's axes. The failing rank's posts send that stand-in right behind their rounds, so it is never
    waiting in an axis's round while its peers wait for it: every rank raises the CmapError naming it, promptly, and
    every other step runs. (Before, every rank waited for the timeout, and the group was broken after.)"""
    case = (spec, typed, ORDERS[2], (2, 2), ("x", "y"), "y", 2048)
    for rank, seen in enumerate(worlds(4).run(check_user_backward_failure_on_a_2d_mesh, *case)):
        for failing, outcome, seconds in seen:
            assert seconds < 10 / 3, (rank, seen)
            assert outcome == ("ok" if failing < 0 else "CmapError naming it"), (rank, seen)


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
def test_a_failure_in_user_backward_reaches_a_peer_in_a_psum_over_an_axis_and_one_of_length_one(worlds, typed):
    """On a 2 x 1 x 2 mesh, blocks over the whole mesh (guarded), a psum over ('x', 'y') inside f: y has length one,
    so the psum runs on x's group, where the failure's round on each axis reaches a peer waiting in its transpose.
    Every rank raises the same CmapError in the failing step, and every other step runs."""
    case = ("P(names)", typed, ORDERS[0], (2, 1, 2), ("x", "y", "z"), ("x", "y"))
    for rank, seen in enumerate(worlds(4).run(check_user_backward_failure_on_a_2d_mesh, *case)):
        for failing, outcome, seconds in seen:
            assert seconds < 10 / 3, (rank, seen)
            assert outcome == ("ok" if failing < 0 else "CmapError naming it"), (rank, seen)


THREE_AXES_CASES = {  # the input's spec, the psum's axes
    "P((x, y, z)), psum over (x, y)": (cm.P(("x", "y", "z")), ("x", "y")),
    "P(x), psum over (x, y, z)": (cm.P("x"), ("x", "y", "z")),
}


def check_failure_before_a_psum_on_a_3d_mesh(case: str, typed: bool) -> list:
    """Steps of shard_map(f) on a 2 x 2 x 2 mesh, f a psum over two axes, which runs on a group of its own (the ranks
    that share z), or with types a psum over every axis of a block invariant along y and z (whose transpose sums
    over (y, z), a group of its own, in backward alone); after steps that use it, rank 5 raises in f before the psum,
    then its backward raises before the psum's transpose. Each step's outcome on this rank, and its seconds."""
    from shard_cases import mesh

    spec, over = THREE_AXES_CASES[case]
    m, rank = mesh((2, 2, 2), ("x", "y", "z")), dist.get_rank()
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    seen = []
    for failing, where in ((-1, ""), (-1, ""), (5, "forward"), (-1, ""), (5, "backward"), (-1, "")):

        def f(b):
            if where == "forward" and rank == failing:
                raise ValueError("f failed on purpose")
            return FailsInBackward.apply(cm.psum(b.sin(), over), failing if where else -1) * b

        g = cm.shard_map(f, m, spec, spec, check_vma=typed, timeout=10)
        seen.append((where, *timed_training_step(g, x, failing)))
    return seen


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize("case", THREE_AXES_CASES)
def test_a_failure_reaches_a_peer_in_a_psum_over_two_axes_of_a_3d_mesh(worlds, case, typed):
    """On a 2 x 2 x 2 mesh a psum over two axes runs on a group of its own. A rank that raises before it, in f or in
    its backward, posts its failure there too (the exit's and the guarded backward's rounds take each group of
    several axes that f took a round on, or that a Split inside f will take one on in backward), so a peer waiting in
    it is told: every rank raises the same CmapError naming the failing rank, promptly, and every other step runs.
    (Before, the peers waited for the timeout, and the group was broken after.)"""
    for rank, seen in enumerate(worlds(8).run(check_failure_before_a_psum_on_a_3d_mesh, case, typed)):
        for where, outcome, seconds in seen:
            assert seconds < 10 / 3, (rank, seen)
            assert outcome == ("CmapError naming it" if where else "ok"), (rank, seen)


LARGE_BLOCKS = {"P('x')": cm.P("x"), "P(None, 'y')": cm.P(None, "y")}  # (8, 4096) float32: 64 KiB blocks on 2 x 2
LARGE_BLOCK_FAILURES = ("the user's backward", "injected in the gradient's gather")


def check_failure_with_large_typed_blocks(spec: str, kind: str) -> list:
    """Typed training steps of shard_map(f) on a 2 x 2 mesh whose 64 KiB blocks are split over one axis and invariant
    along the other: their gradient is gathered along the split axis, and the round over the whole mesh that ends the
    guarded backward goes with that gather. One rank's backward fails in func's graph, or in that gather (an injected
    fault, before its round); each step's outcome on this rank, and its seconds."""
    from shard_cases import mesh

    m, rank = mesh((2, 2), ("x", "y")), dist.get_rank()
    x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)).requires_grad_()
    seen = []
    for failing in (-1, 3, -1, 0, -1, 2, -1):
        in_graph = failing if kind == LARGE_BLOCK_FAILURES[0] else -1
        g = cm.shard_map(
            lambda b: FailsInBackward.apply(b.sin(), in_graph) * b,
            m,
            LARGE_BLOCKS[spec],
            LARGE_BLOCKS[spec],
            timeout=10,
        )
        start = time.perf_counter()
        try:
            y = g(x)
            with inject_fault("backward", range(4)) if rank == failing and in_graph < 0 else contextlib.nullcontext():
                y.pow(2).sum().backward()
            outcome = "ok"
        except cm.CmapError as exc:
            outcome = "CmapError naming it" if f"(global rank {failing})" in str(exc) else str(exc)
        seen.append((failing, outcome, time.perf_counter() - start))
    return seen


@pytest.mark.parametrize("kind", LARGE_BLOCK_FAILURES)
@pytest.mark.parametrize("spec", LARGE_BLOCKS)
def test_a_failure_in_the_backward_of_large_typed_blocks_is_every_rank_s_error(worlds, spec, kind):
    """With types, blocks too large to be cut over the whole mesh as copies take their gradient in a gather along the
    split axis, with the round over the whole mesh in flight beside it (it ends the guarded backward, so that a rank
    whose gather met no failure meets it there). A failure in one rank's backward, in func's graph or in that gather
    before its round, is every rank's CmapError naming that rank, promptly, and every other step runs."""
    for rank, seen in enumerate(worlds(4).run(check_failure_with_large_typed_blocks, spec, kind)):
        for failing, outcome, seconds in seen:
            assert seconds < 10 / 3, (rank, seen)
            assert outcome == ("ok" if failing < 0 else "CmapError naming it"), (rank, seen)


def check_guarded_shard_map_gradients():
    """Through the guard, with and without types: an argument cut and closed over too, a replicated one given twice
    and returned as it is, a non-leaf closure read through attribute views; every gradient is the unsharded one's."""
    from shard_cases import mesh

    size = dist.get_world_size()
    m = mesh((size,), ("i",))
    x = torch.randn(2 * size, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    r = torch.randn(3, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w0 = torch.randn(3, generator=torch.Generator().manual_seed(2)).requires_grad_()
    for check_vma in (True, False):
        w = (w0 * 2).view(1, 3)
        f = cm.shard_map(
            lambda b, s, s2: (cm.psum(b.sin() * x.sum(0) * w, "i") * s + s2 * r + w.mT.mT, s),
            m,
            (cm.P("i"), cm.P(), cm.P()),
            (cm.P(), cm.P()),
            check_vma=check_vma,
        )
        y, same = f(x, r, r)
        got = torch.autograd.grad((y * y).sum() + (same * 3).sum(), (x, r, w0))
        xs, rs, ws = (t.detach().clone().requires_grad_() for t in (x, r, w0))
        wv = (ws * 2).view(1, 3)
        y = xs.sin().view(size, 2, 3).sum(0) * xs.sum(0) * wv * rs + rs * rs + wv
        want = torch.autograd.grad((y * y).sum() + (rs * 3).sum(), (xs, rs, ws))
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e)
    return True


def test_guarded_shard_map_gradients(worlds):
    assert worlds(2).run(check_guarded_shard_map_gradients, deadline=60) == [True] * 2


def check_failure_under_function_transforms():
    """f raising on one rank inside ``torch.func.grad`` and under ``torch.vmap``: the error path's object rounds make
    plain tensors, so every rank gets rank 0's error (not a wrapped tensor's "doesn't have storage"), and the group
    stays usable."""
    rank, size = dist.get_rank(), dist.get_world_size()

    def f(x):
        if rank == 0:
            raise ValueError("boom in f")
        return (x * 2).sum()

    x = torch.randn(2 * size, 3)
    transforms = {
        "grad": lambda: torch.func.grad(lambda v: cm.cmap(f)(v).sum())(x),
        "vmap": lambda: torch.vmap(cm.cmap(f), in_dims=1)(x),
        "jacrev": lambda: torch.func.jacrev(cm.cmap(f))(x),
    }
    for name, run in transforms.items():
        with pytest.raises(cm.CmapError, match="boom in f") as info:
            run()
        assert isinstance(info.value, ValueError) and "group rank 0" in str(info.value), name
    return cm.cmap(lambda v: v * 2)(x).equal(x * 2)


@pytest.mark.parametrize("P", [2, 3])
def test_failure_under_function_transforms(worlds, P):
    assert worlds(P).run(check_failure_under_function_transforms, deadline=60) == [True] * P
