"""Collectives per steady call: a cmap call repeated with the same argument signature makes ONE collective, an
all-gather, at every output size up to the fuse threshold (the status round carries the output rows), and a
training step's backward makes one more (the gather of the mapped input's gradient rows). Above the threshold the
data takes its own collective (two per call). Bytes stay within 1.1x a hand-written ``all_gather_into_tensor`` of
the same output, measured side by side on the same group, plus 16 KiB. At P = 1 nothing crosses the wire. A
shard_map call's exit round carries every output it assembles with one gather over the whole mesh (several outputs,
replicated ones too); on a mesh of several axes, each axis's status round comes first. With ``dst=r``, rows ride in
the round while that costs no more bytes than a gather; larger ones take a gather issued right behind the round.

Counted by wrapping ``torch.distributed`` (tests/wire_tap.py) in real gloo worlds: 3 calls warm up (a call is steady
once the same call has run twice before), the next 3 are counted, each on its own. Every case runs on a group of
its own, so that what earlier calls left in a group's rounds does not change the count.
"""

import time
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import pytest
import torch
import torch.distributed as dist
import wire_tap
from torch.utils._pytree import tree_leaves

import colossalai_cmap as cm

DEADLINE = 120
WARM, COUNTED = 3, 3
ALLOWANCE = 16 * 1024
GATHERS = ("all_gather_into_tensor", "all_gather")
# a call's issues and waits: one all_gather; or two, the second issued before the first is waited for
ONE_ROUND = [("issue", "all_gather_into_tensor"), ("wait", "all_gather_into_tensor")]
TOGETHER = [("issue", "all_gather_into_tensor")] * 2 + [("wait", "all_gather_into_tensor")] * 2
# a backward whose summed gradient takes its own all_reduce, issued right behind the round
SUM_BEHIND_ROUND = [
    ("issue", "all_gather_into_tensor"),
    ("issue", "all_reduce"),
    ("wait", "all_gather_into_tensor"),
    ("wait", "all_reduce"),
]
# (B, D) of float32 outputs below the threshold: 32 B, 256 KiB and 1 MiB in all; each also runs with B - 1
SIZES = {"32 B": (8, 1), "256 KiB": (256, 256), "1 MiB": (1024, 256)}
BIG_D = 256  # the row width of the case above the threshold, whose B is sized from it


def fuse_bytes() -> int:
    """The gathered bytes (in all) up to which a steady call's output rides in its status round."""
    from colossalai_cmap.wire import link

    return getattr(link, "FUSE_BYTES", 4 << 20)


def elementwise(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) + x


class Calls(NamedTuple):
    """The counted calls, one entry each: the collectives' names, the bytes this rank sent, and the order in which
    the collectives were issued and waited for."""

    names: List[Tuple[str, ...]]
    sent: List[float]
    events: List[List[Tuple[str, str]]]


class Seen(NamedTuple):
    """One (B, D) case on one rank: the counted forward calls, the counted backward passes (training only), the bytes
    one native ``all_gather_into_tensor`` of the output sends, and whether the output (training: x.grad) equals
    vmap's, bit for bit."""

    B: int
    forward: Calls
    backward: Calls
    native: float
    exact: bool


def count(fn: Callable[[], Any], backward: bool = False) -> Tuple[Calls, Calls]:
    """``fn`` WARM times, then COUNTED times each counted on its own; with ``backward``, ``fn`` returns a loss whose
    ``backward()`` is counted apart."""
    for _ in range(WARM):
        out = fn()
        if backward:
            out.backward()
    fwd, bwd = Calls([], [], []), Calls([], [], [])
    for _ in range(COUNTED):
        with wire_tap.counting() as log:
            out = fn()
        fwd.names.append(tuple(log.names()))
        fwd.sent.append(log.sent)
        fwd.events.append(log.events)
        if backward:
            with wire_tap.counting() as log:
                out.backward()
            bwd.names.append(tuple(log.names()))
            bwd.sent.append(log.sent)
            bwd.events.append(log.events)
    return fwd, bwd


def native_gather(group: Any, B: int, D: int) -> float:
    """The bytes this rank sends in a hand-written gather of a (B, D) float32 output: ceil(B / P) rows per rank
    (padded), one ``all_gather_into_tensor``."""
    size = dist.get_world_size(group)
    rows = -(-B // size)
    with wire_tap.counting() as log:
        out = torch.empty(rows * size, D)
        dist.all_gather_into_tensor(out, torch.zeros(rows, D), group=group)
    return log.sent


def check_cmap(B: int, D: int, train: bool, func: Callable[[torch.Tensor], torch.Tensor] = elementwise) -> Seen:
    """``cmap(func)`` (``sin(x) + x``) on a (B, D) batch, repeated on a group of its own; with ``train``, a training
    step ``cmap(func)(x).pow(2).sum().backward()`` whose x.grad is compared with single-process vmap's, bit for bit."""
    group = dist.new_group(list(range(dist.get_world_size())))
    f = cm.cmap(func, group=group)
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(B))  # the same on every rank
    native = native_gather(group, B, func(x[0]).numel())
    if not train:
        fwd, bwd = count(lambda: f(x))
        return Seen(B, fwd, bwd, native, torch.equal(f(x), torch.vmap(func)(x)))
    x.requires_grad_()

    def step() -> torch.Tensor:
        x.grad = None
        return f(x).pow(2).sum()

    fwd, bwd = count(step, backward=True)
    ref = x.detach().clone().requires_grad_()
    torch.vmap(func)(ref).pow(2).sum().backward()
    return Seen(B, fwd, bwd, native, torch.equal(x.grad, ref.grad))


def check_cases(cases: List[Tuple[int, int]], train: bool) -> List[Seen]:
    return [check_cmap(B, D, train) for B, D in cases]


def big_case() -> Tuple[int, int]:
    """(B, D) of an output of twice the threshold's bytes."""
    return 2 * fuse_bytes() // (4 * BIG_D), BIG_D


def assert_calls(calls: Calls, native: float, collectives: int, where: str) -> None:
    """Each counted call made ``collectives`` all-gathers and sent at most 1.1x the native bytes + 16 KiB."""
    for names, sent in zip(calls.names, calls.sent):
        assert len(names) == collectives and set(names) <= set(GATHERS), f"{where}: {names}, {sent:.0f} B"
        assert sent <= 1.1 * native + ALLOWANCE, f"{where}: {sent:.0f} B sent, native {native:.0f} B"
    assert len(calls.names) == COUNTED, where


def run_cases(worlds: Any, P: int, cases: List[Tuple[int, int]], train: bool) -> List[Seen]:
    """Every rank's cases (rank 0's returned): the same counts on every rank."""
    got = worlds(P).run(check_cases, cases, train, deadline=DEADLINE)
    assert all([s.forward.names for s in r] == [s.forward.names for s in got[0]] for r in got), got
    return got[0]


def both_batches(label: str) -> List[Tuple[int, int]]:
    B, D = SIZES[label]
    return [(B, D), (B - 1, D)]  # one divided by P = 2 and 4, one not


# -------------------------------------------------------------------------------------------- forward, training
@pytest.mark.parametrize("train", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("label", list(SIZES))
@pytest.mark.parametrize("P", [2, 3, 4])
def test_one_all_gather_each_way_per_steady_call(worlds, P, label, train):
    """Forward: one all_gather, the exit round with the rows. A training step's backward: one more, the round of the
    x-gradient's gather carrying its rows. The value (training: x.grad) is vmap's, bit for bit."""
    for seen in run_cases(worlds, P, both_batches(label), train=train):
        where = f"{label} P={P} B={seen.B}"
        assert seen.exact, f"{where}: not vmap's {'x.grad' if train else 'value'}"
        assert_calls(seen.forward, seen.native, 1, f"{where} forward")
        if train:
            assert_calls(seen.backward, seen.native, 1, f"{where} backward (the x-gradient gather)")


# -------------------------------------------------------------------------------------------- a shared weight
def check_weight_gradient(D: int) -> Tuple[Calls, Calls, float, Tuple[str, ...], float]:
    """``cmap(lambda r: tanh(r @ w))`` with a (D, D) float32 weight that requires grad, a closure every example
    shares: backward sums its gradient over the group. Returns the counted calls, the bytes of a hand-written
    ``all_reduce`` of the gradient and its collectives, and the largest difference from vmap's gradient."""
    group = dist.new_group(list(range(dist.get_world_size())))
    gen = torch.Generator().manual_seed(D)
    w = torch.randn(D, D, generator=gen).requires_grad_()
    x = torch.randn(8, D, generator=gen)
    f = cm.cmap(lambda r: torch.tanh(r @ w), group=group)

    def step() -> torch.Tensor:
        w.grad = None
        return f(x).sum()

    fwd, bwd = count(step, backward=True)
    with wire_tap.counting() as log:
        dist.all_reduce(torch.zeros(D, D), group=group)
    ref = torch.autograd.grad(torch.vmap(lambda r: torch.tanh(r @ w))(x).sum(), w)[0]
    return fwd, bwd, log.sent, tuple(log.names()), (w.grad - ref).abs().max().item()


@pytest.mark.parametrize("P", [2, 3, 4])
def test_a_shared_weight_gradient_rides_in_the_round_where_it_costs_no_more(worlds, P):
    """A 1 KiB gradient rides in its backward round at every P. A 256 KiB one rides at P = 2, where an all_gather
    sends what an all_reduce does; at P = 3 and 4 the all_gather would send more, so the gradient takes its own
    all_reduce, issued right behind the round, before either is waited for. Either way within 1.1x the all_reduce's
    bytes + 16 KiB."""
    for D in (16, 256):
        fwd, bwd, native, native_names, diff = worlds(P).run(check_weight_gradient, D, deadline=DEADLINE)[0]
        expected = 1 if D == 16 or P == 2 else 2
        # the sum over ranks reorders float32 sums of 8 per-row terms (entries up to ~20): a few ulp of 20 each
        assert diff <= 8 * 20 * torch.finfo(torch.float32).eps * 8, (D, P, diff)
        for names, sent in zip(bwd.names, bwd.sent):
            assert len(names) == expected and names[0] in GATHERS, (D, P, names)
            assert names[1:] == native_names[: len(names) - 1], (D, P, names)
            assert sent <= 1.1 * native + ALLOWANCE, (D, P, sent, native)
        if expected == 2:
            assert bwd.events == [SUM_BEHIND_ROUND] * COUNTED, (D, P, bwd.events)
        assert all(len(names) == 1 for names in fwd.names), (D, P, fwd.names)


# -------------------------------------------------------------------------------------------- above the threshold
@pytest.mark.parametrize("P", [2, 3, 4])
def test_above_the_threshold_the_data_takes_its_own_collective(worlds, P):
    """Two collectives each way, in flight together: the data's all_gather is issued right behind its round (the
    exit's in forward, the x-gradient gather's in backward), before either is waited for."""
    B, D = big_case()
    for seen in run_cases(worlds, P, [(B, D)], train=True):
        assert seen.exact, f"P={P} B={B}: x.grad is not vmap's"
        assert_calls(seen.forward, seen.native, 2, f"{B * D * 4} B out, P={P}, forward")
        assert_calls(seen.backward, seen.native, 2, f"{B * D * 4} B out, P={P}, backward")
        for calls in (seen.forward, seen.backward):
            assert calls.events == [TOGETHER] * COUNTED, (P, calls.events)


# -------------------------------------------------------------------------------------------- to one rank
def check_to_one_rank(cases: List[Tuple[int, int]]) -> List[Dict[str, Any]]:
    """``cmap(sin(x) + x, dst=P - 1)`` repeated on a group of its own, per (B, D): the counted calls' issues and
    waits in order, the bytes they sent and those of a hand-written ``gather`` of the output, and whether the last
    rank got vmap's value bit for bit (every other rank None)."""
    group = dist.new_group(list(range(dist.get_world_size())))
    size, rank = dist.get_world_size(), dist.get_rank()
    seen = []
    for B, D in cases:
        f = cm.cmap(elementwise, group=group, dst=size - 1)
        x = torch.randn(B, D, generator=torch.Generator().manual_seed(B))
        for _ in range(WARM):
            f(x)
        events, sent, exact = [], [], []
        for k in range(COUNTED):
            with wire_tap.counting() as log:
                y = f(x + k)
            events.append(log.events)
            sent.append(log.sent)
            exact.append(torch.equal(y, torch.vmap(elementwise)(x + k)) if rank == size - 1 else y is None)
        rows = -(-B // size)
        with wire_tap.counting() as log:
            outs = [torch.empty(rows, D) for _ in range(size)] if rank == size - 1 else None
            dist.gather(torch.zeros(rows, D), outs, dst=size - 1, group=group)
        seen.append({"events": events, "sent": sent, "native": log.sent, "exact": exact})
    return seen


ROUND = "all_gather_into_tensor"
TO_ONE_RANK = {  # (B, D) of float32: what a steady call does with it
    2: [((256, 256), "overlaps"), ((255, 256), "overlaps"), ((16, 256), "rides"), (big_case(), "overlaps")],
    3: [((256, 256), "overlaps"), ((255, 256), "overlaps"), (SIZES["32 B"], "rides")],
}


@pytest.mark.parametrize("P", sorted(TO_ONE_RANK))
def test_a_steady_call_to_one_rank_sends_its_data_with_the_round(worlds, P):
    """With ``dst=r``, rows ride in the round while small: r sends none in a gather, so what it sends in the round's
    all-gather stays within 16 KiB. Larger ones take a gather to r, issued right behind the round, so the two are in
    flight together: a steady call costs what the gather costs, and the round's latency hides behind it. Every rank
    sends within 1.1x what it sends in a hand-written gather + 16 KiB; the value on r is vmap's, bit for bit."""
    cases = [case for case, _ in TO_ONE_RANK[P]]
    expected = {
        "rides": [("issue", ROUND), ("wait", ROUND)],
        "overlaps": [("issue", ROUND), ("issue", "gather"), ("wait", ROUND), ("wait", "gather")],
    }
    for rank, seen in enumerate(worlds(P).run(check_to_one_rank, cases, deadline=DEADLINE)):
        for ((B, D), how), got in zip(TO_ONE_RANK[P], seen):
            where = f"P={P} rank {rank} B={B} D={D}"
            assert got["exact"] == [True] * COUNTED, where
            assert got["events"] == [expected[how]] * COUNTED, f"{where}: {got['events']}"
            assert max(got["sent"]) <= 1.1 * got["native"] + ALLOWANCE, (where, got["sent"], got["native"])


def widened(r: torch.Tensor) -> torch.Tensor:
    """An example of D values to one of 1.5 D: the output's rows and the input gradient's have other shapes."""
    return torch.cat([torch.sin(r), r[: r.shape[0] // 2]])


def test_a_backward_of_another_shape_leaves_the_forward_data_early(worlds):
    """Only an exit sets the data shape that may be sent early; a backward exchange sends early only data of that
    shape. So where the input gradient's rows differ from the output's, each step's forward still sends its data
    right behind its round."""
    # (4096, 384) float32: 9 MiB out, a 6 MiB input gradient, both past the threshold
    for seen in worlds(2).run(check_cmap, 4096, 384, True, widened, deadline=DEADLINE):
        assert seen.exact
        assert seen.forward.events == [TOGETHER] * COUNTED, seen.forward.events
        assert all(len(names) == 2 for names in seen.backward.names), seen.backward.names


# -------------------------------------------------------------------------------------------- one process
def test_nothing_crosses_the_wire_at_one_process(worlds):
    cases = [SIZES["32 B"], SIZES["1 MiB"]]
    for seen in run_cases(worlds, 1, cases, train=True):
        assert seen.exact
        assert seen.forward.names == seen.backward.names == [()] * COUNTED, seen
        assert seen.native == 0  # the side-by-side gather sends nothing either


# -------------------------------------------------------------------------------------------- shard_map
def check_shard_map(rows: List[int], D: int) -> List[Seen]:
    """``shard_map(sin, mesh, P('i'), P('i'))`` over a 1-D mesh of the world, repeated on blocks of ``rows`` rows of
    D float32 per rank: forward alone, then training steps (``f(x).pow(2).sum().backward()``, x.grad against the
    unsharded function's)."""
    from torch.distributed.device_mesh import init_device_mesh

    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("i",))
    f = cm.shard_map(torch.sin, mesh=mesh, in_specs=cm.P("i"), out_specs=cm.P("i"))
    seen = []
    for r in rows:
        x = torch.randn(r * size, D, generator=torch.Generator().manual_seed(r))
        native = native_gather(mesh.get_group(), r * size, D)
        fwd, _ = count(lambda: f(x))
        seen.append(Seen(r * size, fwd, Calls([], [], []), native, torch.equal(f(x), x.sin())))
        given = x.clone().requires_grad_()

        def step() -> torch.Tensor:
            given.grad = None
            return f(given).pow(2).sum()

        fwd, bwd = count(step, backward=True)
        ref = x.clone().requires_grad_()
        ref.sin().pow(2).sum().backward()
        seen.append(Seen(r * size, fwd, bwd, native, torch.equal(given.grad, ref.grad)))
    return seen


SHARD_BLOCKS = {"small": ([4], 1), "medium": ([64], 256)}  # rows per rank, D: 16 B and 64 KiB per rank


@pytest.mark.parametrize("label", list(SHARD_BLOCKS))
@pytest.mark.parametrize("P", [2, 3])
def test_one_all_gather_each_way_per_steady_shard_map_call(worlds, P, label):
    """The exit's round gathers the output (its rows are the block lengths the assembly needs); in backward, the
    gather of the input's gradient blocks rides in its round."""
    rows, D = SHARD_BLOCKS[label]
    forward, training = worlds(P).run(check_shard_map, rows, D, deadline=DEADLINE)[0]
    assert forward.exact, f"shard_map {label} P={P}: not sin's value"
    assert training.exact, f"shard_map {label} P={P}: x.grad is not the unsharded function's"
    assert_calls(forward.forward, forward.native, 1, f"shard_map {label} P={P} forward")
    assert_calls(training.forward, training.native, 1, f"shard_map {label} P={P} training forward")
    assert_calls(training.backward, training.native, 1, f"shard_map {label} P={P} backward")


def shard_map_case(case: str, size: int) -> Tuple[Callable[..., Any], Tuple[Any, ...], Callable[..., Any], Any]:
    """``case``'s shard_map call on a mesh of the world, its arguments, the unsharded function (the reference on the
    same arguments), and the loss a training step takes of its outputs (None: forward only)."""
    from torch.distributed.device_mesh import init_device_mesh

    gen = torch.Generator().manual_seed(size)
    x, w = torch.randn(4 * size, 3, generator=gen), torch.randn(3, generator=gen)
    line = init_device_mesh("cpu", (size,), mesh_dim_names=("i",))
    i = cm.P("i")
    if case == "two outputs":  # both split along the batch: one row count per rank carries both

        def g(v: torch.Tensor) -> Any:
            return v.sin(), 2 * v.cos()

        return (
            cm.shard_map(g, mesh=line, in_specs=i, out_specs=(i, i)),
            (x,),
            g,
            lambda y: y[0].pow(2).sum() + y[1].sum(),
        )
    if case == "a split and a replicated output, untyped":  # the replicated one: rank 0's, from the same round

        def g(v: torch.Tensor, u: torch.Tensor) -> Any:
            return {"y": v.sin(), "u": u * 2}

        specs = dict(in_specs=(i, cm.P()), out_specs={"y": i, "u": cm.P()}, check_vma=False)
        return cm.shard_map(g, mesh=line, **specs), (x, w), g, lambda y: y["y"].sum() + y["u"].pow(2).sum()
    if case == "blocks of different lengths":  # 4 rows and 1 per rank: one round cannot carry both
        f = cm.shard_map(lambda v: (v.sin(), v[:1]), mesh=line, in_specs=i, out_specs=(i, i))
        return f, (x,), lambda v: (v.sin(), v[::4]), lambda y: y[0].sum() + y[1].pow(2).sum()
    if case == "different lengths on rank 0 only":  # 5 rows and 4 on rank 0, 4 and 4 elsewhere
        f = cm.shard_map(lambda v: (v.cos(), v[:4]), mesh=line, in_specs=i, out_specs=(i, i))
        return f, (torch.cat([x, x[:1]]),), lambda v: (v.cos(), torch.cat([b[:4] for b in v.tensor_split(size)])), None
    square = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("x", "y"))
    spec = {
        "2-D mesh, rows over (x, y)": cm.P(("x", "y")),
        "2-D mesh, rows over (y, x)": cm.P(("y", "x")),
        "2-D mesh, tiles P(x, y)": cm.P("x", "y"),
        "2-D mesh, tiles P(y, x)": cm.P("y", "x"),
    }[case]
    x = torch.randn(4 * size, 6, 3, generator=gen)
    f = cm.shard_map(torch.sin, mesh=square, in_specs=spec, out_specs=spec)
    return f, (x,), torch.sin, lambda y: y.pow(2).sum()


class CaseSeen(NamedTuple):
    """One shard_map case on one rank: the counted forward calls and backward passes (none without a loss), whether
    the outputs equal the unsharded function's bit for bit, and the largest relative difference of a gradient."""

    forward: Calls
    backward: Calls
    exact: bool
    grad_error: float


def check_shard_map_case(case: str) -> CaseSeen:
    f, args, g, loss = shard_map_case(case, dist.get_world_size())
    fwd, _ = count(lambda: f(*args))
    exact = all(torch.equal(a, b) for a, b in zip(tree_leaves(f(*args)), tree_leaves(g(*args))))
    if loss is None:
        return CaseSeen(fwd, Calls([], [], []), exact, 0.0)
    given = [a.clone().requires_grad_() for a in args]

    def step() -> torch.Tensor:
        for a in given:
            a.grad = None
        return loss(f(*given))

    _, bwd = count(step, backward=True)
    refs = [a.clone().requires_grad_() for a in args]
    loss(g(*refs)).backward()
    error = max(((a.grad - r.grad).abs() / r.grad.abs().clamp_min(1e-30)).max().item() for a, r in zip(given, refs))
    return CaseSeen(fwd, bwd, exact, error)


SHARD_CASES = {  # case: (forward collectives, backward collectives)
    "two outputs": (1, 1),
    "a split and a replicated output, untyped": (1, 1),
    # the carrying round finds the lengths differ: a round of lengths, then a gather per distinct block lengths
    "blocks of different lengths": (4, 1),
    "different lengths on rank 0 only": (4, 0),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
@pytest.mark.parametrize("P", [2, 3])
def test_the_exit_round_carries_every_output_it_can(worlds, P, case):
    """Every output the assembly gathers rides in the exit's round, replicated ones too, while one row count per
    rank says every carried block's length; where a rank's blocks differ in length, every rank falls back to the
    round of lengths and the gathers, with the same values."""
    seen = worlds(P).run(check_shard_map_case, case, deadline=DEADLINE)[0]
    forward, backward = SHARD_CASES[case]
    assert seen.exact, f"{case} P={P}: not the unsharded function's outputs"
    # untyped replicated output: each rank's cotangent over P, summed over P ranks (P roundings of eps / 2 each)
    assert seen.grad_error <= P * torch.finfo(torch.float32).eps, f"{case} P={P}: gradient off by {seen.grad_error}"
    assert all(len(names) == forward and set(names) <= set(GATHERS) for names in seen.forward.names), seen.forward
    assert all(len(names) == backward for names in seen.backward.names), seen.backward


def count_training(
    g: Callable[[torch.Tensor], torch.Tensor], unsharded: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> Tuple[Calls, Calls, torch.Tensor, torch.Tensor]:
    """Training steps of ``g`` on ``x`` (the loss: its output's squares summed), counted as :func:`count` does; the
    last step's gradient, and the unsharded function's on the same ``x``."""
    given = x.clone().requires_grad_()

    def step() -> torch.Tensor:
        given.grad = None
        return g(given).pow(2).sum()

    fwd, bwd = count(step, backward=True)
    ref = x.clone().requires_grad_()
    unsharded(ref).pow(2).sum().backward()
    return fwd, bwd, given.grad, ref.grad


def check_gathers_inside_f(op: str, D: int, typed: bool) -> Tuple[CaseSeen, float]:
    """Training steps of ``shard_map(f)`` on a mesh of the world, f an ``all_gather`` (tiled) or a ``psum_scatter``
    of its block's sine, on (4 P, D) float32: the counted steady steps, whether the output and x.grad are the
    unsharded function's, and the bytes one native all_gather of the block sends."""
    from shard_cases import mesh

    size = dist.get_world_size()
    line = mesh((size,), ("i",))
    x = torch.rand(4 * size, D, generator=torch.Generator().manual_seed(D)) + 0.1  # sines > 0: sums cancel nothing
    if op == "all_gather":
        f, want = (lambda b: cm.all_gather(b.sin(), "i", tiled=True)), (lambda v: v.sin().repeat(size, 1))
    else:
        f = lambda b: cm.psum_scatter(b.sin().repeat(size, 1), "i", tiled=True)  # noqa: E731
        want = lambda v: v.sin().view(size, 4, D).sum(0).repeat(size, 1)  # noqa: E731
    g = cm.shard_map(f, mesh=line, in_specs=cm.P("i"), out_specs=cm.P("i"), check_vma=typed)
    fwd, bwd, grad, ref_grad = count_training(g, want, x)
    error = ((grad - ref_grad).abs() / ref_grad.abs()).max().item()
    # sums over P ranks of positive terms, in another order: P roundings of eps / 2 each
    exact = bool(((g(x) - want(x)).abs() <= size * torch.finfo(x.dtype).eps * want(x)).all())
    return CaseSeen(fwd, bwd, exact, error), (size - 1) * 4 * D * 4.0


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize("D", [8, 4096], ids=["rides the first round", "rides a learned round"])
@pytest.mark.parametrize("P", [2, 3])
def test_an_all_gather_inside_f_sends_its_rows_with_its_round(worlds, P, D, typed):
    """An ``all_gather`` inside f is a Join of its rows: its round carries them (the round's payload learns their
    size), so a steady step's forward is that round and the exit's, with no gather after either; ``psum_scatter``'s
    transpose in backward, an all_gather too, is one collective as well (its forward is a round and the native
    reduce-scatter). Values and gradients are the unsharded function's."""
    gathered, native = worlds(P).run(check_gathers_inside_f, "all_gather", D, typed, deadline=DEADLINE)[0]
    tolerance = 4 * P * torch.finfo(torch.float32).eps  # the sums' roundings, then a few elementwise ops
    assert gathered.exact and gathered.grad_error <= tolerance, gathered
    # the all_gather's round, the exit's round (carrying the P-times-longer output: its own bytes)
    assert all(names == ("all_gather_into_tensor",) * 2 for names in gathered.forward.names), gathered.forward
    scattered, _ = worlds(P).run(check_gathers_inside_f, "psum_scatter", D, typed, deadline=DEADLINE)[0]
    assert scattered.exact and scattered.grad_error <= tolerance, scattered
    # psum_scatter's transpose (the all_gather, its rows in its round), then the input's gradient gathered
    assert all(names == ("all_gather_into_tensor",) * 2 for names in scattered.backward.names), scattered.backward
    for names, sent in zip(scattered.backward.names, scattered.backward.sent):
        assert sent <= 2 * (1.1 * native + ALLOWANCE), (names, sent, native)


def check_data_ops_inside_f(op: str, D: int, typed: bool) -> Tuple[CaseSeen, float]:
    """Training steps of ``shard_map(f)`` on a mesh of the world, f a tiled ``psum_scatter``, ``all_to_all`` or a
    ring ``ppermute`` of its block's sine, on (2 P^2, D) float64: the counted steady steps, whether the output and
    x.grad are the unsharded function's (to the sums' rounding), and the largest relative difference."""
    from shard_cases import mesh

    size = dist.get_world_size()
    line = mesh((size,), ("i",))
    x = torch.rand(2 * size * size, D, dtype=torch.float64, generator=torch.Generator().manual_seed(D)) + 0.1
    blocks = lambda v: v.sin().view(size, size, 2, D)  # noqa: E731  [rank, chunk, rows, D]: sines > 0
    if op == "psum_scatter":
        f = lambda b: cm.psum_scatter(b.sin(), "i", tiled=True)  # noqa: E731
        want = lambda v: blocks(v).sum(0).reshape(-1, D)  # noqa: E731
    elif op == "psum":
        f = lambda b: cm.psum(b.sin(), "i") * b  # noqa: E731
        want = lambda v: blocks(v).sum(0).reshape(-1, D).repeat(size, 1) * v  # noqa: E731
    elif op == "all_to_all":
        f = lambda b: cm.all_to_all(b.sin(), "i", 0, 0, tiled=True)  # noqa: E731
        want = lambda v: blocks(v).transpose(0, 1).reshape(-1, D)  # noqa: E731
    else:
        f = lambda b: cm.ppermute(b.sin(), "i", [(i, (i + 1) % size) for i in range(size)])  # noqa: E731
        want = lambda v: blocks(v).roll(1, 0).reshape(-1, D)  # noqa: E731
    g = cm.shard_map(f, mesh=line, in_specs=cm.P("i"), out_specs=cm.P("i"), check_vma=typed)
    fwd, bwd, grad, ref_grad = count_training(g, want, x)
    error = max(
        ((g(x) - want(x)).abs() / want(x).abs()).max().item(), ((grad - ref_grad).abs() / ref_grad.abs()).max().item()
    )
    return CaseSeen(fwd, bwd, True, error), 0.0


DATA_OPS = ("psum_scatter", "all_to_all", "ppermute")


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize("op", DATA_OPS)
@pytest.mark.parametrize("P", [2, 3])
def test_a_small_data_op_inside_f_sends_its_data_with_its_round(worlds, P, op, typed):
    """A small ``psum_scatter``, ``all_to_all`` or ``ppermute`` inside f sends its data in its status round (every
    rank's, where that costs little more bytes than its own collective): a steady step's forward is that round and
    the exit's, its backward the op's transpose and the input's gradient, one collective each. Values and gradients
    are the unsharded function's, to the rounding of sums over P ranks."""
    seen, _ = worlds(P).run(check_data_ops_inside_f, op, 4, typed, deadline=DEADLINE)[0]
    assert seen.grad_error <= 4 * P * torch.finfo(torch.float64).eps, seen.grad_error
    assert all(names == ("all_gather_into_tensor",) * 2 for names in seen.forward.names), seen.forward
    assert all(names == ("all_gather_into_tensor",) * 2 for names in seen.backward.names), seen.backward


NATIVE = {"psum_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single", "ppermute": "all_to_all_single"}


def behind_round(native: str) -> List[Tuple[str, str]]:
    """A round and the native collective issued right behind it, then both waited for."""
    return [
        ("issue", "all_gather_into_tensor"),
        ("issue", native),
        ("wait", "all_gather_into_tensor"),
        ("wait", native),
    ]


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize("op", DATA_OPS)
def test_a_large_data_op_inside_f_sends_its_data_right_behind_its_round(worlds, op, typed):
    """Past that (at P = 3, blocks of 192 KiB), the op takes its status round and its native collective, whose bytes
    are the native algorithm's; once the steps repeat, the collective is issued right behind the round, before either
    is waited for, and the exit's round follows. In backward, the transpose of an all_to_all or a ppermute (an
    all_to_all) goes behind its round too; psum_scatter's (an all_gather) rides in its round. (At P = 2 a ppermute's
    round sends what its own collective would: it rides.) Values and gradients are the unsharded function's."""
    seen, _ = worlds(3).run(check_data_ops_inside_f, op, 4096, typed, deadline=DEADLINE)[0]
    assert seen.grad_error <= 12 * torch.finfo(torch.float64).eps, seen.grad_error
    assert seen.forward.events == [behind_round(NATIVE[op]) + ONE_ROUND] * COUNTED, seen.forward.events
    transpose = ONE_ROUND if op == "psum_scatter" else behind_round(NATIVE[op])
    assert seen.backward.events == [transpose + ONE_ROUND] * COUNTED, seen.backward.events


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
def test_a_large_psum_inside_f_sends_its_sum_right_behind_its_round(worlds, typed):
    """At P = 3 a psum of 192 KiB does not ride in its round (an all_gather would send more bytes than its
    all_reduce): it takes its own all_reduce, issued right behind the round once the steps repeat, before either is
    waited for; the exit's round follows. Untyped, the psum's
    transpose in backward (a psum) goes behind its round too. Values and gradients are the unsharded function's, to
    the rounding of sums over 3 ranks."""
    seen, _ = worlds(3).run(check_data_ops_inside_f, "psum", 4096, typed, deadline=DEADLINE)[0]
    # sums of 3 positive terms (2 eps relative each: the psum, its transpose) and a few products and squares (eps
    # each) on the way to the gradient: about 10 eps relative; 24 allowed
    assert seen.grad_error <= 24 * torch.finfo(torch.float64).eps, seen.grad_error
    assert seen.forward.events == [SUM_BEHIND_ROUND + ONE_ROUND] * COUNTED, seen.forward.events
    if not typed:
        assert all(events[:4] == SUM_BEHIND_ROUND for events in seen.backward.events), seen.backward.events


MESH_CASES = (
    "2-D mesh, rows over (x, y)",
    "2-D mesh, rows over (y, x)",
    "2-D mesh, tiles P(x, y)",
    "2-D mesh, tiles P(y, x)",
)


@pytest.mark.parametrize("case", MESH_CASES)
def test_a_2d_mesh_exit_is_one_round_over_the_whole_where_f_communicates_on_no_axis(worlds, case):
    """An output split over both axes of a 2 x 2 mesh, along one dim or two, in either order, by an f that takes no
    collective over one axis: no rank can be waiting in a round on an axis, so the exit is the whole mesh's round
    alone, carrying each rank's block as one run, rearranged after. In backward, the input's gradient blocks are one
    gather over the whole mesh too: the input was cut from a copy in tile order where its rows are not split in mesh
    order."""
    seen = worlds(4).run(check_shard_map_case, case, deadline=DEADLINE)[0]
    assert seen.exact and seen.grad_error == 0, seen
    assert all(events == ONE_ROUND for events in seen.forward.events), seen.forward.events
    assert all(events == ONE_ROUND for events in seen.backward.events), seen.backward.events


def check_copies_on_a_2d_mesh(axis: str, check_vma: bool) -> Dict[str, Any]:
    """``shard_map(f, mesh, P(axis), P(axis))`` on a 2 x 2 mesh, ``f`` a psum over the other axis times the block:
    the forward collectives of steady calls and of their backward; whether the gradient and a forward-mode tangent
    (``torch.autograd.forward_ad``) equal the same call's under a ``torch.func`` transform (which assembles axis by
    axis) bit for bit, and a double backward's to its rounding; and whether the values are the unsharded
    function's."""
    import torch.autograd.forward_ad as fwAD
    from torch.distributed.device_mesh import init_device_mesh

    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    other = "y" if axis == "x" else "x"
    spec = cm.P(axis) if axis == "x" else cm.P(None, axis)
    g = cm.shard_map(
        lambda b: cm.psum(b.sin(), other) * b, mesh=square, in_specs=spec, out_specs=spec, check_vma=check_vma
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    fwd, bwd = count(lambda: g(x.clone().requires_grad_()).pow(2).sum(), backward=True)

    def loss(t: torch.Tensor) -> torch.Tensor:
        return g(t).pow(2).sum()

    v = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(g(fwAD.make_dual(x, v))).tangent
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(loss(xg), xg, create_graph=True)
    (second,) = torch.autograd.grad(grad.pow(2).sum(), xg)
    # the same call under a function transform: assembled axis by axis, as before the exit carried it
    by_axis = torch.func.grad(loss)(x)
    second_by_axis = torch.func.grad(lambda t: torch.func.grad(loss)(t).pow(2).sum())(x)
    _, tangent_by_axis = torch.func.jvp(g, (x,), (v,))
    return {
        "forward": fwd.names,
        "backward": bwd.names,
        "grad": torch.equal(grad, by_axis),
        # the guard (ordinary autograd) sums a double backward's terms in another order than the transform: a few
        # roundings of eps / 2 of the largest term
        "second": torch.allclose(
            second, second_by_axis, rtol=0, atol=4 * torch.finfo(x.dtype).eps * second_by_axis.abs().max().item()
        ),
        "tangent": tangent is not None and torch.equal(tangent, tangent_by_axis),
        "unsharded": torch.allclose(g(x), 2 * x.sin() * x, rtol=0, atol=4 * torch.finfo(x.dtype).eps),
    }


@pytest.mark.parametrize("check_vma", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize("axis", ["x", "y"])
def test_an_output_equal_along_one_axis_rides_in_the_whole_mesh_s_round(worlds, axis, check_vma):
    """P('x') (or P(None, 'y')) on a 2 x 2 mesh, equal along the other axis: the ranks at coordinate 0 of that axis
    send their blocks in the exit's round over the whole mesh, the others no rows: no gather follows the exit (nor,
    untyped, a broadcast along the other axis). Backward and forward-mode tangents are those of the assembly axis by
    axis, bit for bit; a double backward too, to the order its terms are summed in."""
    for seen in worlds(4).run(check_copies_on_a_2d_mesh, axis, check_vma, deadline=DEADLINE):
        # psum's round; the exit: a round on the psum's axis, where a peer may wait in it (none on the axis no round
        # in f took), and the whole mesh's, which carries the output
        assert all(len(names) == 3 for names in seen["forward"]), seen["forward"]
        assert seen["grad"] and seen["second"] and seen["tangent"] and seen["unsharded"], seen
        # backward: psum's transpose, then the input's gradient; untyped summed over the other axis and gathered over
        # the axis, typed (invariant along the other axis: no sum) gathered over the whole mesh from the ranks at
        # coordinate 0 of the other axis, in one round that reaches every rank
        want = 2 if check_vma else 3
        assert all(len(names) == want for names in seen["backward"]), seen["backward"]


INVARIANT_CASES = {  # label: mesh shape, axis names, the input's spec, its shape
    "P(x) on 2 x 2": ((2, 2), ("x", "y"), cm.P("x"), (8, 6)),
    "P(None, y) on 2 x 2": ((2, 2), ("x", "y"), cm.P(None, "y"), (6, 6)),
    "P(x) on 2 x 2, uneven rows": ((2, 2), ("x", "y"), cm.P("x"), (5, 6)),
    "P(z) on 2 x 1 x 2": ((2, 1, 2), ("x", "y", "z"), cm.P("z"), (8, 6)),
    "P(x) on 2 x 2, 64 KiB blocks": ((2, 2), ("x", "y"), cm.P("x"), (8, 4096)),
    "P(None, y) on 2 x 2, 48 KiB blocks": ((2, 2), ("x", "y"), cm.P(None, "y"), (6, 4096)),
    "P(z) on 2 x 1 x 2, 64 KiB blocks": ((2, 1, 2), ("x", "y", "z"), cm.P("z"), (8, 4096)),
}


def check_an_input_invariant_along_an_axis(case: str) -> Tuple[CaseSeen, Any]:
    """Training steps of a typed ``shard_map(lambda b: b.sin() * b)`` on a float32 input whose spec splits it over
    one axis, invariant along the others: the counted steady steps, whether the output and x.grad are the unsharded
    function's bit for bit; a step where one rank's backward raised, each rank's error; and the bytes a rank sends
    in a native gather of the blocks along the split axis."""
    from shard_cases import mesh

    shape, names, spec, size = INVARIANT_CASES[case]
    failing: List[int] = []

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(t: torch.Tensor) -> torch.Tensor:
            return t.view_as(t)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if dist.get_rank() in failing:
                raise ValueError("backward failed on purpose")
            return grad

    g = cm.shard_map(lambda b: Fails.apply(b.sin() * b), mesh=mesh(shape, names), in_specs=spec, out_specs=spec)
    x = torch.randn(size, generator=torch.Generator().manual_seed(size[0]))
    fwd, bwd, grad, ref_grad = count_training(g, lambda v: v.sin() * v, x)
    exact = torch.equal(g(x), x.sin() * x) and torch.equal(grad, ref_grad)
    failing.append(dist.get_world_size() - 1)
    try:
        g(x.clone().requires_grad_()).pow(2).sum().backward()
        error = None
    except cm.CmapError as exc:
        error = str(exc)
    return CaseSeen(fwd, bwd, exact, 0.0), error, x.numel() * 4 / 2


@pytest.mark.parametrize("case", INVARIANT_CASES)
def test_an_input_invariant_along_an_axis_takes_its_gradient_in_one_round(worlds, case):
    """With types, an input split over some axes of a mesh and invariant along the others has one gradient, whose
    blocks every rank along those axes holds alike: its transpose is one gather over the whole mesh, the ranks at
    coordinate 0 of the other axes sending their rows and the others none. Backward is that one round (it reaches
    every rank, so a failure in one rank's backward is every rank's CmapError in it); values and gradients are the
    unsharded function's bit for bit. Where the empty slots of that gather would cost more than the byte budget
    (blocks of 48 KiB and up), the gradient is gathered along the split axis, and a round over the whole mesh ends
    the backward, issued before that gather is waited for: the two are in flight together."""
    for seen, error, native in worlds(4).run(check_an_input_invariant_along_an_axis, case, deadline=DEADLINE):
        assert seen.exact, seen
        want = ("all_gather_into_tensor",) * (2 if "KiB" in case else 1)
        assert all(names == want for names in seen.backward.names), seen.backward
        if "KiB" in case:
            assert all(events == TOGETHER for events in seen.backward.events), seen.backward.events
        assert all(sent <= 1.1 * native + ALLOWANCE for sent in seen.backward.sent), (seen.backward.sent, native)
        assert error is not None and "backward failed on purpose" in error and "group rank 3" in error, error


def check_tiles_in_a_loop() -> Dict[str, Any]:
    """``shard_map(f, mesh, P('x', 'y'), P('x', 'y'))`` on a 2 x 2 mesh, training steps on (8, 6), then (5, 6), whose
    tiles are uneven (``tensor_split`` blocks of 3 and 2 rows), twice, (8, 6) again, a step where f raises on the
    last rank, and one more: each step's forward collectives, whether its output and x.grad are the unsharded
    function's bit for bit, and the error."""
    from torch.distributed.device_mesh import init_device_mesh

    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    failing = []

    def f(block: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() in failing:
            raise ValueError("f failed on purpose")
        return block.sin() * block

    g = cm.shard_map(f, mesh=square, in_specs=cm.P("x", "y"), out_specs=cm.P("x", "y"))
    gen = torch.Generator().manual_seed(0)
    batches = {"even": torch.randn(8, 6, generator=gen), "uneven": torch.randn(5, 6, generator=gen)}
    seen: Dict[str, Any] = {"counts": [], "exact": [], "error": ""}
    for step in ("even",) * 3 + ("uneven",) * 2 + ("even", "fault", "even"):
        failing[:] = [3] if step == "fault" else []
        x = batches["even" if step == "fault" else step].clone().requires_grad_()
        ref = x.detach().clone().requires_grad_()
        (ref.sin() * ref).pow(2).sum().backward()
        try:
            with wire_tap.counting() as log:
                y = g(x)
            seen["counts"].append(len(log.names()))
            y.pow(2).sum().backward()
            seen["exact"].append(torch.equal(y, ref.detach().sin() * ref.detach()) and torch.equal(x.grad, ref.grad))
        except cm.CmapError as exc:
            seen["error"] = str(exc)
    return seen


def test_tiles_assemble_from_one_gather_and_fall_back_where_uneven(worlds):
    """Tiles of one shape on every rank come back in the whole mesh's round, alone (the first step is left out, as
    the whole mesh's group may be one an earlier check used). Uneven tiles fall back to the lengths round and the
    per-axis gathers, with the same values; after them, a step sends its lengths first until they show even tiles.
    A fault in f is every rank's CmapError, and the next step is right."""
    for seen in worlds(4).run(check_tiles_in_a_loop, deadline=DEADLINE):
        assert seen["exact"] == [True] * 7, seen
        counts = seen["counts"]
        assert [counts[k] for k in (1, 2, 6)] == [1] * 3, counts  # the faulty step (7th) counted nothing
        # the first uneven step's runs went in vain; the next steps send their lengths first, until they are even
        assert counts[3] > counts[4] == counts[5] > 1, counts
        assert "f failed on purpose" in seen["error"] and "group rank 3" in seen["error"], seen["error"]


AXIS_STEPS = (  # step: (which of two meshes, f's collective over mesh axes or None, whether the last rank raises
    # before it)
    ("plain", 0, None, False),
    ("plain", 0, None, False),
    ("raises before psum over y", 0, "y", True),
    ("plain", 0, None, False),
    ("psum over y", 0, "y", False),
    ("psum over y", 0, "y", False),
    ("raises before psum over y", 0, "y", True),
    ("plain", 0, None, False),
    ("raises before psum over x", 0, "x", True),
    ("psum over x", 0, "x", False),
    ("raises before psum over the mesh", 0, ("x", "y"), True),
    ("psum over the mesh", 0, ("x", "y"), False),
    ("raises before psum over the mesh", 1, ("x", "y"), True),
)


def check_collectives_on_an_axis(timeout: float) -> Dict[str, Any]:
    """``shard_map(f, mesh, P('x'), P('x'))`` on 2 x 2 meshes of their own, ``f`` as :data:`AXIS_STEPS` says, step by
    step: each step's collectives, whether its output is right, its error and how long it took."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, last = dist.get_rank(), dist.get_world_size() - 1
    step: Dict[str, Any] = {}

    def f(block: torch.Tensor) -> torch.Tensor:
        if step["raises"] and rank == last:
            raise ValueError("f failed on purpose")
        return (block if step["axes"] is None else cm.psum(block, step["axes"])).sin()

    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    halves = torch.cat([x[:4] + x[4:]] * 2)  # a sum of two terms: exact in either order
    per_y = {None: x, "y": x * 2, "x": halves, ("x", "y"): halves * 2}  # blocks are equal along y
    # a sum of 4 terms in another order: within 3 eps of 4 max|x|, and sin's own rounding (eps / 2); a + a is exact
    tolerance = 3 * torch.finfo(x.dtype).eps * 4 * float(x.abs().max()) + torch.finfo(x.dtype).eps
    seen: Dict[str, Any] = {"counts": [], "exact": [], "errors": [], "seconds": [], "events": []}
    meshes = [init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y")) for _ in range(2)]
    for label, which, axes, raises in AXIS_STEPS:
        step.update(axes=axes, raises=raises)
        g = cm.shard_map(f, mesh=meshes[which], in_specs=cm.P("x"), out_specs=cm.P("x"), timeout=timeout)
        began = time.perf_counter()
        with wire_tap.counting() as log:
            try:
                error = (g(x) - per_y[axes].sin()).abs().max().item()
                seen["exact"].append(error == 0 or axes == ("x", "y") and error <= tolerance)
            except cm.CmapError as exc:
                seen["errors"].append((label, str(exc)))
        seen["seconds"].append(time.perf_counter() - began)
        seen["counts"].append(len(log.names()))
        seen["events"].append(log.events)
    return seen


def test_an_exit_takes_a_round_on_an_axis_once_f_has_taken_one_there(worlds):
    """On a 2 x 2 mesh, an exit is the whole mesh's round alone until f takes a collective over one axis; that
    first collective is announced in a round over the whole mesh, and from then on every exit of that mesh takes a
    round on that axis's group too (a rank waiting in a psum over y is told only by a round over y), the two in
    flight together, and none on the other axis, where no rank can be waiting. A rank that raises before the psum,
    before or after the axis is noted, and before a psum over the whole mesh, on a mesh with a noted axis or not, is
    every rank's CmapError at once, not at the timeout, and the next step is right."""
    timeout = 30.0
    for seen in worlds(4).run(check_collectives_on_an_axis, timeout, deadline=DEADLINE):
        assert seen["exact"] == [True] * sum(not s[3] for s in AXIS_STEPS), seen
        counts = seen["counts"]
        # the whole mesh's round carries the P('x') output (from the ranks at y = 0); a plain step is that round;
        # psum over y: announced, its round (the data rides), y's round and the whole's; then the same without the
        # announcement; a plain step on that mesh keeps y's round; the first psum over x that runs (the one before
        # it failed in its announcement) is announced, and the exits take x's round too
        assert [counts[k] for k in (1, 3, 4, 5, 7, 9)] == [1, 1, 4, 3, 2, 5], counts
        # the exit: y's round and the whole mesh's, both issued before either is waited for
        exit_rounds = [("issue", "all_gather_into_tensor")] * 2 + [("wait", "all_gather_into_tensor")] * 2
        assert seen["events"][5][2:6] == exit_rounds and seen["events"][7][:4] == exit_rounds, seen["events"]
        assert [label for label, _ in seen["errors"]] == [s[0] for s in AXIS_STEPS if s[3]], seen["errors"]
        for label, error in seen["errors"]:
            assert "f failed on purpose" in error and "group rank 3" in error, (label, error)
        assert max(seen["seconds"]) < timeout / 3, seen["seconds"]


def check_tiles_with_a_psum_over_one_axis(typed: bool) -> Tuple[CaseSeen, float]:
    """Training steps of ``shard_map(lambda b: psum(sin(b), 'y') * b, P('x', 'y'), P('x', 'y'))`` on a 2 x 2 mesh,
    on (8, 6) float32 (tiles of 4 x 3): the counted steady steps, whether the output and x.grad are the unsharded
    function's bit for bit, and the tile's bytes."""
    from shard_cases import mesh

    square = mesh((2, 2), ("x", "y"))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    f = lambda b: cm.psum(b.sin(), "y") * b  # noqa: E731
    g = cm.shard_map(f, mesh=square, in_specs=cm.P("x", "y"), out_specs=cm.P("x", "y"), check_vma=typed)

    def unsharded(v: torch.Tensor) -> torch.Tensor:
        tiles = v.view(2, 4, 2, 3)  # x, rows, y, columns: the sum over y of two tiles is exact in either order
        return (tiles.sin().sum(2, keepdim=True) * tiles).reshape(8, 6)

    fwd, bwd, grad, ref_grad = count_training(g, unsharded, x)
    exact = torch.equal(g(x), unsharded(x)) and torch.equal(grad, ref_grad)
    return CaseSeen(fwd, bwd, exact, 0.0), 4 * 3 * 4.0


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
def test_tiles_enter_through_one_gather_where_f_communicates_over_one_axis(worlds, typed):
    """Tiles of one shape whose gradient is wanted are copied into tile order and cut by one Split over the whole
    mesh, also on a mesh where f takes a psum over one axis: their gradient is one gather, not one per axis (the
    rank's backward is guarded, and a failure there is posted on each axis's group too). Backward: the psum's
    transpose over y and that gather; values and gradients are the unsharded function's."""
    for seen, _ in worlds(4).run(check_tiles_with_a_psum_over_one_axis, typed, deadline=DEADLINE):
        assert seen.exact, seen
        assert all(names == ("all_gather_into_tensor",) * 2 for names in seen.backward.names), seen.backward


# -------------------------------------------------------------------------------------------- shard_map's steady exit
def check_shard_map_steady_exit(D: int) -> Dict[str, Any]:
    """``shard_map(sin, mesh, P('i'), P('i'))`` over a 1-D mesh of the world, repeated on (4 P, D) float32; then
    (4 P + 1, D), whose blocks have other (and uneven) lengths, three times; a call where f raises on the last rank;
    and one more. Each call's issues and waits in order, whether every value is sin's bit for bit, and the error."""
    from torch.distributed.device_mesh import DeviceMesh

    size, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh.from_group(dist.new_group(list(range(size))), "cpu", mesh_dim_names=("i",))  # a group of its own
    failing = []

    def f(block: torch.Tensor) -> torch.Tensor:
        if rank in failing:
            raise ValueError("f failed on purpose")
        return torch.sin(block)

    g = cm.shard_map(f, mesh=mesh, in_specs=cm.P("i"), out_specs=cm.P("i"))
    gen = torch.Generator().manual_seed(D)
    batches = {"even": torch.randn(4 * size, D, generator=gen), "uneven": torch.randn(4 * size + 1, D, generator=gen)}
    seen: Dict[str, Any] = {"events": [], "exact": [], "error": ""}
    for step in ("even",) * 4 + ("uneven",) * 3 + ("fault", "uneven"):
        failing[:] = [size - 1] if step == "fault" else []
        x = batches["uneven" if step == "fault" else step]
        with wire_tap.counting() as log:
            try:
                seen["exact"].append(torch.equal(g(x), torch.sin(x)))
            except cm.CmapError as exc:
                seen["error"] = str(exc)
        seen["events"].append(log.events)
    return seen


def assert_steady_exit(seen: Dict[str, Any], steady: List[Tuple[str, str]]) -> None:
    """The steady calls (the third and fourth, and the third of the other batch: each after two of the same) made
    ``steady``; every value is sin's; the fault is every rank's CmapError naming the last rank, and the call after it
    is right."""
    events = seen["events"]
    assert [events[k] for k in (2, 3, 6)] == [steady] * 3, events
    assert seen["exact"] == [True] * 8, seen["exact"]
    assert "f failed on purpose" in seen["error"], seen["error"]


@pytest.mark.parametrize("D", [4, 1 << 18], ids=["rides", "past the threshold"])
def test_a_steady_shard_map_exit_sends_its_data_with_its_round(worlds, D):
    """The exit's round carries the output while it fits; past the threshold, a call whose gather has the shape the
    exchange after the same round sent the last time (here the last call's exit's) sends it right behind the round.
    Blocks of other lengths fall back (each rank sends none, every rank then learns the lengths), and the call after
    the next with those lengths is steady again."""
    for seen in worlds(2).run(check_shard_map_steady_exit, D, deadline=DEADLINE):
        assert_steady_exit(seen, ONE_ROUND if D == 4 else TOGETHER)


def check_exits_of_differently_named_functions() -> List[bool]:
    """Rank 0 maps ``sine``, the others ``sin_of``: the same values under two names. Batches of changing sizes, a few
    calls each; whether every value is sin's."""
    from torch.distributed.device_mesh import DeviceMesh

    size = dist.get_world_size()
    mesh = DeviceMesh.from_group(dist.new_group(list(range(size))), "cpu", mesh_dim_names=("i",))

    def sine(block: torch.Tensor) -> torch.Tensor:
        return torch.sin(block)

    def sin_of(block: torch.Tensor) -> torch.Tensor:
        return torch.sin(block)

    g = cm.shard_map(sine if dist.get_rank() == 0 else sin_of, mesh=mesh, in_specs=cm.P("i"), out_specs=cm.P("i"))
    gen = torch.Generator().manual_seed(5)
    exact = []
    for rows in (4 * size, 4 * size, 4 * size, 4 * size + 1, 4 * size + 1, 4 * size + 1, 4 * size):
        for D in (3, 1 << 18):  # in the round; past the threshold, the gather sent right behind it
            x = torch.randn(rows, D, generator=gen)
            exact.append(torch.equal(g(x), torch.sin(x)))
    return exact


def test_functions_of_other_names_on_other_ranks_take_the_same_lengths_as_known(worlds):
    """The lengths an exit keeps are kept by the outputs' layout, not the call's name, so ranks that map functions
    of other names take the same ones as known; a batch of another size is carried again, and every value is right
    (no rank assembles axis by axis, whose collectives carry the call's name)."""
    for exact in worlds(2).run(check_exits_of_differently_named_functions, deadline=DEADLINE):
        assert exact == [True] * 14, exact


# -------------------------------------------------------------------------------------------- src=r
def check_src_steady() -> Dict[str, Any]:
    """``cmap(torch.mul, in_dims=(0, None), src=0)``, only rank 0 passing the batch, repeated; then a batch of
    another size, the same again, a mistake on the source (a string for the mapped argument), and the second
    batch once more. Each call's collectives, and whether every value is vmap's, bit for bit."""
    group = dist.new_group(list(range(dist.get_world_size())))
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, generator=gen)
    batches = {"8": torch.randn(8, 16, generator=gen), "5": torch.randn(5, 16, generator=gen)}
    f = cm.cmap(torch.mul, in_dims=(0, None), src=0, group=group)  # elementwise: vmap's bits at any share
    source = dist.get_rank() == 0
    seen: Dict[str, Any] = {"calls": [], "exact": [], "error": ""}
    for step in ("8", "8", "8", "8", "5", "5", "mistake", "5"):
        with wire_tap.counting() as log:
            try:
                given = batches.get(step, "not a tensor") if source else None
                out = f(given, w)
                seen["exact"].append(torch.equal(out, torch.vmap(torch.mul, (0, None))(batches[step], w)))
            except cm.CmapError as exc:
                seen["error"] = str(exc)
        seen["calls"].append(tuple(log.names()))
    return seen


@pytest.mark.parametrize("P", [2, 3])
def test_a_steady_src_call_sends_its_word_ahead_of_the_shares(worlds, P):
    """The first call (and one whose batch changed) broadcasts the source's metadata before the scatter; a steady
    call's scatter carries the source's word (same, changed, failed) ahead of the shares, so it costs the scatter
    and the exit's round, what a hand-written scatter and gather cost. A mistake on the source is every rank's
    CmapError, and the next call is steady again."""
    for seen in worlds(P).run(check_src_steady, deadline=DEADLINE):
        first = ("broadcast", "broadcast", "scatter", "all_gather_into_tensor")
        steady = ("scatter", "all_gather_into_tensor")
        changed = ("scatter",) + first
        assert seen["calls"][:6] == [first, steady, steady, steady, changed, steady], seen["calls"]
        # the word says the source failed: no metadata broadcast (the error path's object gather of details follows)
        assert seen["calls"][6][:2] == steady and "broadcast" not in seen["calls"][6], seen["calls"]
        assert seen["calls"][7] == steady, seen["calls"]
        assert seen["exact"] == [True] * 7, seen["exact"]
        assert "group rank 0 (global rank 0) raised" in seen["error"], seen["error"]
