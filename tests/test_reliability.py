"""No hangs, clear errors, nothing lost (issue 6): failure propagation, consistency checks, rank death, leaks."""

import os
import signal
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from harness import DIED, World

import colossalai_cmap as cm
from colossalai_cmap import comm


def _fails_on(ranks, exc=ValueError):
    def f(x):
        if dist.get_rank() in ranks:
            raise exc(f"bad row sum in a shard of shape {tuple(x.shape)}")
        return x * 2

    return f


def check_failure_propagation(failing, dst, mode):
    """func raises on ``failing`` ranks: every rank raises CmapError naming them; the next call works."""
    rank = dist.get_rank()
    x = torch.arange(16.0).view(8, 2)  # every rank of a world of up to 4 gets rows
    try:
        cm.cmap(_fails_on(failing), dst=dst, mode=mode)(x)
    except cm.CmapError as err:
        text = str(err)
        for r in failing:
            assert f"group rank {r} (global rank {r}) raised ValueError: bad row sum" in text, text
        assert [f.group_rank for f in err.failures] == sorted(failing)
        if rank in failing:
            assert isinstance(err.__cause__, ValueError)
        elif err.failures:
            assert "Remote traceback" in text and "Traceback" in text
    else:
        raise AssertionError("no CmapError")
    out = cm.cmap(torch.sin)(x)  # the group stays usable
    assert torch.equal(out, torch.sin(x))
    return True


def _dot(x, y):
    return torch.dot(x, y)


def check_bad_arguments():
    """Argument errors: same type and message on every rank, raised before any collective."""
    x, y = torch.ones(6, 3), torch.ones(5, 3)
    size = dist.get_world_size()
    bad = [
        (lambda: cm.cmap(_dot, in_dims=(0, 5))(x, x), ValueError, "cmap(_dot, in_dims=(0, 5)): argument 1 ('y')"),
        (lambda: cm.cmap(torch.dot, in_dims=(0,))(x, x), ValueError, "in_dims is not compatible"),
        (lambda: cm.cmap(torch.dot, in_dims=[0, 0])(x, x), ValueError, "expected `in_dims` to be int or a"),
        (lambda: cm.cmap(lambda a, n: a * n, in_dims=(0, 0))(x, 3), ValueError, "argument 1 ('n')"),
        (lambda: cm.cmap(torch.dot)(x, y), ValueError, "different sizes"),
        (lambda: cm.cmap(lambda t: t["a"], in_dims=({"a": 2},))({"a": x}), ValueError, "argument 0 ('t')['a']"),
        (lambda: cm.cmap(torch.sin, dst=size)(x), ValueError, f"dst={size} is not valid"),
        (lambda: cm.cmap(torch.sin, src=size + 1)(x), ValueError, f"src={size + 1} is not valid"),
        (lambda: cm.cmap(torch.sin, dst="all"), ValueError, "dst='all' is not valid"),
        (lambda: cm.cmap(torch.sin, mode="pmap"), ValueError, "unknown mode='pmap'"),
        (lambda: cm.cmap(torch.sin, randomness="x"), ValueError, "unknown randomness"),
        (lambda: cm.cmap(torch.sin, chunk_size=0), ValueError, "chunk_size"),
        (lambda: cm.cmap(torch.sin, group="world")(x), TypeError, "group='world' is not supported"),
        (lambda: cm.cmap(torch.sin, in_dims=None)(x), ValueError, "at least one Tensor"),
    ]
    messages = []
    for thunk, exc_type, needle in bad:
        before = comm.COUNTS["collectives"]
        with pytest.raises(exc_type) as info:
            thunk()
        assert needle in str(info.value), f"{needle!r} not in {info.value}"
        assert str(info.value).startswith("cmap("), str(info.value)
        assert comm.COUNTS["collectives"] == before, f"communicated before raising: {info.value}"
        messages.append(str(info.value))
    assert torch.equal(cm.cmap(torch.sin)(x), torch.sin(x))
    return messages


def check_divergent_inputs(kind):
    """src=None with different batch sizes, shapes or dtypes per rank: CmapError everywhere, no gloo abort."""
    rank = dist.get_rank()
    x = torch.ones(6, 3)
    if rank == 1:
        x = {
            "batch": torch.ones(7, 3),
            "shape": torch.ones(6, 4),
            "dtype": torch.ones(6, 3, dtype=torch.float64),
            "values": torch.full((6, 3), 2.0),
        }[kind]
    with pytest.raises(cm.CmapError, match="different inputs"):
        cm.cmap(torch.sum, check_inputs=(kind == "values"))(x)
    assert torch.equal(cm.cmap(torch.sum)(torch.ones(6, 3)), torch.full((6,), 3.0))
    return True


def check_rank_death(victim, timeout, how="exit"):
    """The victim exits (os._exit) or is SIGKILLed inside func; survivors raise CmapError within the bound."""

    def f(x):
        if dist.get_rank() == victim:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        return x + 1

    start = time.monotonic()
    try:
        cm.cmap(f, mode="batched", timeout=timeout)(torch.ones(8, 2))
    except cm.CmapError as err:
        return time.monotonic() - start, str(err)
    return time.monotonic() - start, "returned"


def check_straggler_timeout(timeout):
    """A rank that never arrives: the others raise within ``timeout``; later calls refuse the broken group."""
    if dist.get_rank() == 1:
        return 0.0, "straggler"
    start = time.monotonic()
    with pytest.raises(cm.CmapError, match="failed on group rank"):
        cm.cmap(torch.sin, timeout=timeout)(torch.ones(4, 2))
    elapsed = time.monotonic() - start
    with pytest.raises(cm.CmapError, match="unusable"):
        cm.cmap(torch.sin)(torch.ones(4, 2))
    return elapsed, "raised"


def check_leaks(calls):
    """Many calls: RSS, open fds, process groups and cached plans stay bounded."""
    proc = psutil.Process()
    f = cm.cmap(lambda a, b: (a * b, a.sum()), in_dims=(0, None))
    w = torch.randn(16)
    for i in range(200):  # warm up allocator and caches
        f(torch.randn(9 + i % 5, 16), w)
    rss0, fds0 = proc.memory_info().rss, proc.num_fds()
    groups0 = len(dist.distributed_c10d._world.pg_map)
    for i in range(calls):
        f(torch.randn(9 + i % 5, 16), w)
        cm.cmap(torch.sin, dst=0)(torch.randn(7, 3))
    rss1, fds1 = proc.memory_info().rss, proc.num_fds()
    cached = len(f.cmap_runner._layouts)
    groups1 = len(dist.distributed_c10d._world.pg_map)
    return {
        "rss_growth_mib": (rss1 - rss0) / 2**20,
        "fd_growth": fds1 - fds0,
        "groups": (groups0, groups1),
        "cached_layouts": cached,
    }


@pytest.mark.parametrize(
    "P,failing,dst,mode",
    [
        (2, [1], -1, "vmap"),
        (3, [0, 1, 2], -1, "loop"),
        (3, [2], 2, "vmap"),
        (3, [2], "local", "batched"),
        (4, [0, 3], 0, "vmap"),
    ],
)
def test_failure_propagates_to_every_rank(worlds, P, failing, dst, mode):
    assert worlds(P).run(check_failure_propagation, failing, dst, mode) == [True] * P


@pytest.mark.parametrize("P", [2, 3])
def test_bad_arguments_raise_everywhere_before_communication(worlds, P):
    messages = worlds(P).run(check_bad_arguments)
    assert all(m == messages[0] for m in messages), "ranks disagree on the error messages"


@pytest.mark.parametrize("kind", ["batch", "shape", "dtype", "values"])
def test_divergent_inputs_are_reported(worlds, kind):
    assert worlds(2).run(check_divergent_inputs, kind) == [True] * 2


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_rank_death_is_detected_within_bound(how):
    world = World(3)
    try:
        results = world.run(check_rank_death, 1, 20.0, how, deadline=60, may_die=True)
    finally:
        world.kill()
    assert results[1] == DIED
    for rank in (0, 2):
        elapsed, text = results[rank]
        assert "failed on group rank" in text, text
        assert elapsed < 20.0, f"rank {rank} took {elapsed:.1f}s to notice"
    assert not any(p.is_alive() for p in world.procs)


def test_straggler_times_out_and_group_is_refused_afterwards():
    world = World(2)
    try:
        results = world.run(check_straggler_timeout, 2.0, deadline=60)
    finally:
        world.kill()
    elapsed, status = results[0]
    assert status == "raised" and 1.5 < elapsed < 10, elapsed


@pytest.mark.slow
def test_no_leaks_over_2000_calls(worlds):
    stats = worlds(2).run(check_leaks, 1000, deadline=240)
    for s in stats:
        assert s["rss_growth_mib"] < 20, s
        assert s["fd_growth"] <= 2, s
        assert s["groups"][0] == s["groups"][1], s
        assert s["cached_layouts"] <= 64, s


def check_speculation():
    """Repeated large single-output calls send their data together with the status round; a change of batch size,
    a failure, or inputs that differ across ranks must still give the right answer or a CmapError, never an abort."""
    rank = dist.get_rank()
    f = cm.cmap(lambda r: r * 2 + 1)
    runner = f.cmap_runner
    speculated, previous = 0, None
    for B in (1200, 1200, 1200, 1201, 1201, 7, 1200, 1200):  # over 1 MiB per rank: the two-collective path
        x = torch.arange(B * 600, dtype=torch.float32).view(B, 600)
        was = runner._speculate is not None
        before = comm.COUNTS["collectives"]
        assert torch.equal(f(x), x * 2 + 1), B
        speculated += was
        # a steady call: status + data together; a changed batch size: its speculative data is discarded (+1)
        assert comm.COUNTS["collectives"] - before == (2 if B == previous or not was else 3), B
        previous = B
    assert speculated >= 3, speculated
    assert runner._speculate is not None, "steady large calls should speculate"
    with pytest.raises(cm.CmapError, match="different inputs"):  # sizes from shared history: no gloo abort
        f(torch.ones(1200 if rank == 0 else 1199, 600))

    def g(r):
        if dist.get_rank() == 1 and r.shape[0] == 600:
            raise ValueError("fails on the third call")
        return r + 1

    h = cm.cmap(g, mode="batched")
    for i in range(3):  # rank 1's shard has 600 rows only on the third call, while speculating
        if i == 2:
            with pytest.raises(cm.CmapError, match="fails on the third call"):
                h(torch.ones(1200, 600))
        else:
            assert torch.equal(h(torch.ones(1198, 600)), torch.full((1198, 600), 2.0))
    assert torch.equal(f(torch.ones(1200, 600)), torch.full((1200, 600), 3.0))
    return True


def test_speculative_data_gather_falls_back_safely(worlds):
    assert worlds(2).run(check_speculation) == [True] * 2
