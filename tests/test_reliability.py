"""No hangs, clear errors, nothing lost: failure propagation, consistency checks, rank death, leaks."""

import os
import signal
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from harness import DIED, World

import colossalai_cmap as cm


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
    """Argument errors: the same type and message on every rank, with no data moved: a rank whose arguments fail
    its checks reports in the status round, so a rank-specific bad argument cannot leave its peers waiting."""
    x, y = torch.ones(6, 3), torch.ones(5, 3)
    size = dist.get_world_size()
    at_call = [
        (lambda: cm.cmap(_dot, in_dims=(0, 5))(x, x), ValueError, "cmap(_dot, in_dims=(0, 5)): argument 1 ('y')"),
        (lambda: cm.cmap(torch.dot, in_dims=(0,))(x, x), ValueError, "in_dims is not compatible"),
        (lambda: cm.cmap(lambda a, n: a * n, in_dims=(0, 0))(x, 3), ValueError, "argument 1 ('n')"),
        (
            lambda: cm.cmap(torch.dot)(x, y),
            ValueError,
            "Expected all tensors to have the same size in the mapped dimension",
        ),
        (lambda: cm.cmap(lambda t: t["a"], in_dims=({"a": 2},))({"a": x}), ValueError, "argument 0 ('t')['a']"),
        (lambda: cm.cmap(torch.sin, dst=size)(x), ValueError, f"dst={size} is not valid"),
        (lambda: cm.cmap(torch.sin, src=size + 1)(x), ValueError, f"src={size + 1} is not valid"),
        (lambda: cm.cmap(torch.sin, in_dims=None)(x), ValueError, "at least one Tensor"),
    ]
    at_creation = [  # no call, no group: raised where the cmap is made
        (lambda: cm.cmap(torch.dot, in_dims=[0, 0]), ValueError, "expected `in_dims` to be int or a"),
        (lambda: cm.cmap(torch.sin, dst="all"), ValueError, "dst='all' is not valid"),
        (lambda: cm.cmap(torch.sin, mode="pmap"), ValueError, "unknown mode='pmap'"),
        (lambda: cm.cmap(torch.sin, randomness="x"), ValueError, "unknown randomness"),
        (lambda: cm.cmap(torch.sin, chunk_size=0), ValueError, "chunk_size"),
        (lambda: cm.cmap(torch.sin, group="world")(x), TypeError, "group='world' is not supported"),
    ]
    messages = []
    for thunk, exc_type, needle in at_call + at_creation:
        with cm.record_collectives() as log, pytest.raises(exc_type) as info:
            thunk()
        assert needle in str(info.value), f"{needle!r} not in {info.value}"
        assert str(info.value).startswith("cmap("), str(info.value)
        if (thunk, exc_type, needle) in at_call:
            assert isinstance(info.value, cm.CmapError), info.value
            # the status round (its size is the group's adaptive payload), then the failure details (their lengths
            # and their bytes): nothing else
            assert log.count == 3 and sum(n for _, n in log.entries[1:]) < 10_000, log.entries
        else:
            assert log.count == 0, log.entries
        messages.append(str(info.value).split("Remote traceback")[0])
    assert torch.equal(cm.cmap(torch.sin)(x), torch.sin(x))
    return messages


def check_argument_error_on_one_rank():
    """A bad argument on one rank only (its inputs differ): every rank raises, naming that rank; no hang."""
    rank = dist.get_rank()
    x = torch.ones(6, 3) if rank != 1 else torch.ones(6)
    with pytest.raises(cm.CmapError, match=r"group rank 1 \(global rank 1\) raised ValueError"):
        cm.cmap(torch.sum, in_dims=1)(x)
    assert torch.equal(cm.cmap(torch.sum)(torch.ones(6, 3)), torch.full((6,), 3.0))
    return True


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


def check_graphs_differ(kind):
    """func takes a gradient of a closure-captured tensor on rank 0 only: the ranks' graphs reach it differently,
    so their backward collectives would not meet. Every rank raises the same CmapError at the exit, which names
    each rank's graph signature, and the group stays usable."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3)

    def f(v):
        if dist.get_rank() == 0:
            return v * torch.func.grad(lambda p: (p * v).sum() ** 2)(w)
        return w * v

    if kind == "cmap":
        call = cm.cmap(f)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("i",))
        call = cm.shard_map(f, mesh=mesh, in_specs=cm.P("i"), out_specs=cm.P("i"), check_vma=False)
    with pytest.raises(cm.CmapError, match="ranks built different autograd graphs around tensors made before") as err:
        call(x)
    assert "group rank 0: 0x" in str(err.value) and "group rank 1: 0x0" in str(err.value)
    assert torch.equal(cm.cmap(torch.sum)(torch.ones(6, 3)), torch.full((6,), 3.0))
    return str(err.value)


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
    with pytest.raises(cm.CmapError, match="failed on group rank") as info:
        cm.cmap(torch.sin, timeout=timeout)(torch.ones(4, 2))
    elapsed = time.monotonic() - start
    # The error names the rank that never arrived; it made no cmap collective, so it has no record to show.
    assert "group rank 1 (global rank 1) did not arrive; it has published no record" in str(info.value)
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
    cached = f.cached_plans
    groups1 = len(dist.distributed_c10d._world.pg_map)
    return {
        "rss_growth_mib": (rss1 - rss0) / 2**20,
        "fd_growth": fds1 - fds0,
        "groups": (groups0, groups1),
        "cached_plans": cached,
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


def check_batched_rows(B):
    """mode='batched' with func returning the wrong number of rows (on some ranks or all, small outputs or large,
    after good calls of the same shapes): CmapError on every rank naming the rows; nothing is returned."""
    size = dist.get_world_size()
    x = torch.arange(B * 40 * 9, dtype=torch.float32).view(B, 40, 9)
    shares = []
    good = cm.cmap(lambda v: shares.append(v.shape[0]) or v * 2, mode="batched")
    assert torch.equal(good(x), x * 2)  # the same shapes first, so the repeated-call path sees the bad ones
    rows = shares[0]
    wrong = {
        "doubled": lambda v: torch.cat([v, v]),
        "first row": lambda v: v[:1] * 2,
        "the whole batch": lambda v: torch.zeros(B, 40, 9),
        "one rank": lambda v: v[:-1] if dist.get_rank() == 0 else v,
    }
    for name, f in wrong.items():
        with pytest.raises(cm.CmapError) as info:
            cm.cmap(f, mode="batched")(x)
        text = str(info.value)
        assert "mode='batched'" in text and "one row per example" in text, (name, text)
        if name == "one rank":
            assert "failed on 1 rank(s)" in text and "group rank 0 (global rank 0)" in text, text
        elif name == "doubled":  # every rank failed, each named with its own share
            assert f"has {2 * rows} rows along its out_dim 0" in text and f"given {rows} examples" in text, text
            assert all(f"group rank {r} (global rank {r})" in text for r in range(size)), text
    assert torch.equal(good(x), x * 2)  # the group stays usable
    return True


@pytest.mark.parametrize("P, B", [(2, 3), (2, 300), (3, 7)])
def test_batched_rows_must_match_the_share(worlds, P, B):
    assert worlds(P).run(check_batched_rows, B) == [True] * P


@pytest.mark.parametrize("P", [2, 3])
def test_bad_arguments_raise_the_same_error_everywhere(worlds, P):
    messages = worlds(P).run(check_bad_arguments)
    assert all(m == messages[0] for m in messages), "ranks disagree on the error messages"


def test_argument_error_on_one_rank(worlds):
    assert worlds(3).run(check_argument_error_on_one_rank) == [True] * 3


@pytest.mark.parametrize("kind", ["batch", "shape", "dtype", "values"])
def test_divergent_inputs_are_reported(worlds, kind):
    assert worlds(2).run(check_divergent_inputs, kind) == [True] * 2


@pytest.mark.parametrize("kind", ["cmap", "shard_map"])
def test_graphs_that_differ_are_reported(worlds, kind):
    messages = worlds(2).run(check_graphs_differ, kind)
    assert messages[0] == messages[1], messages


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
        assert s["cached_plans"] <= 64, s
