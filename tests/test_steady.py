"""Repeated calls take the steady path (cached plan, reusable round buffers): same results as torch.vmap, no
aliasing between calls, and failures or layout changes during steady calls still reach every rank."""

import pytest
import torch
import torch.distributed as dist
from cases import assert_same

import colossalai_cmap as cm


def _count_steady(f, method="_steady_finish"):
    """Count the calls that finish through a steady-path method (test instrumentation on the runner instance)."""
    runner = f.cmap_runner
    inner = getattr(runner, method)
    hits = [0]

    def counted(*args):
        hits[0] += 1
        return inner(*args)

    setattr(runner, method, counted)
    return hits


def _multi(x, w):
    return {"a": x * w, "b": (x.sum(), w.sum() * 2), "tag": "steady"}


def check_steady_matches_vmap():
    """Several output kinds, batch sizes and dst choices, each called repeatedly with fresh values."""
    rank, size = dist.get_rank(), dist.get_world_size()
    w = torch.randn(3, generator=torch.Generator().manual_seed(7))  # the same on every rank, as src=None needs
    cases = [
        ("multi", _multi, dict(in_dims=(0, None), out_dims={"a": 1, "b": (0, None), "tag": None})),
        ("dot", torch.dot, dict()),
        ("dst0", lambda x, w: x * w, dict(in_dims=(0, None), dst=0)),
    ]
    steady = 0
    for name, func, opts in cases:
        for B in (7, 1, size, 0):
            f = cm.cmap(func, **opts)
            hits = _count_steady(f)
            vmap_opts = {k: v for k, v in opts.items() if k != "dst"}
            first = None
            for call in range(4):
                x = torch.randn(B, 3, generator=torch.Generator().manual_seed(100 * B + call))
                args = (x, w) if func is not torch.dot else (x, x)
                expected = torch.vmap(func, **vmap_opts)(*args)
                actual = f(*args)
                if opts.get("dst", -1) not in (-1, rank):
                    assert actual is None, (name, B)
                    continue
                assert_same(actual, expected, True, f"{name} B={B}")
                if call == 0:
                    first = (
                        actual,
                        torch.utils._pytree.tree_map(lambda v: v.clone() if torch.is_tensor(v) else v, expected),
                    )
            if first is not None:  # later calls reuse the round buffers: the first result must be untouched
                assert_same(first[0], first[1], True, f"{name} B={B}, first call")
            if B:
                assert hits[0] >= 2, (name, B, hits[0])
            steady += hits[0]
    return steady


def check_steady_failure_and_layout_change():
    """A steady call where one rank raises, or returns another dtype: every rank raises; the next call works."""
    rank = dist.get_rank()
    state = {"call": 0}

    def func(x):
        state["call"] += 1
        if state["call"] == 3 and rank == 1:
            raise RuntimeError("fails in a steady call")
        if state["call"] == 5 and rank == 1:
            return x.double()
        return x + 1

    f = cm.cmap(func, mode="batched")
    hits = _count_steady(f)
    x = torch.arange(10.0).view(5, 2)
    outcomes = []
    for _ in range(7):
        try:
            out = f(x)
        except cm.CmapError as err:
            outcomes.append("fails in a steady call" in str(err) or "different per-example" in str(err))
        else:
            assert torch.equal(out, x + 1)
            outcomes.append("ok")
    assert outcomes == ["ok", "ok", True, "ok", True, "ok", "ok"], outcomes
    assert hits[0] >= 3, hits[0]
    return True


def check_steady_round_sizes_and_grad():
    """Two argument shapes whose outputs need different round sizes, alternating; then a differentiable call."""
    f = cm.cmap(lambda x: x * 3)
    gen = torch.Generator().manual_seed(3)  # the same inputs on every rank
    small, big = torch.randn(6, 2, generator=gen), torch.randn(6, 4000, generator=gen)
    for _ in range(4):
        for x in (small, big):
            assert torch.equal(f(x), x * 3), (tuple(x.shape), f.cmap_runner._round)
    x = torch.randn(6, 2, generator=gen).requires_grad_()
    f(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    return True


def check_steady_buffer_budget():
    """Many argument shapes, each with outputs near the largest status round: the reusable buffers stay bounded."""
    from colossalai_cmap.steady import BUFFER_BUDGET

    f = cm.cmap(lambda x: x + 1)
    plans = f.cmap_runner._plans
    for _ in range(3):
        for d in range(40000, 40016):  # about 480 KB per rank each: 512 KiB rounds, 24 MiB of buffers untrimmed
            x = torch.ones(6, d)
            assert torch.equal(f(x), x + 1)
    return plans.buffer_bytes(), BUFFER_BUDGET


@pytest.mark.parametrize("size", [2, 3])
def test_steady_matches_vmap(worlds, size):
    hits = worlds(size).run(check_steady_matches_vmap)
    assert all(h > 0 for h in hits), hits


def test_steady_failure_and_layout_change(worlds):
    assert worlds(2).run(check_steady_failure_and_layout_change) == [True, True]


def test_steady_round_sizes_and_grad(worlds):
    assert worlds(2).run(check_steady_round_sizes_and_grad) == [True, True]


def check_steady_speculated():
    """Large single outputs (data sent with the status round): uneven B, out_dims=1, a failure, then recovery."""
    rank = dist.get_rank()
    state = {"fail": False}

    def func(r):
        if state["fail"] and rank == 1:
            raise RuntimeError("fails in a speculated call")
        return (r * 2 + 1).unsqueeze(0).expand(2, -1)

    f = cm.cmap(func, out_dims=1)
    hits = _count_steady(f, "_steady_speculated")
    for B in (1201, 1201, 1201, 1201):  # over 1 MiB per rank
        x = torch.arange(B * 300, dtype=torch.float32).view(B, 300)
        assert torch.equal(f(x), torch.vmap(func, out_dims=1)(x)), B
    assert hits[0] >= 1, hits[0]
    state["fail"] = True
    with pytest.raises(cm.CmapError, match="fails in a speculated call"):
        f(x)
    state["fail"] = False
    assert torch.equal(f(x), torch.vmap(func, out_dims=1)(x))
    return hits[0]


def test_steady_speculated(worlds):
    hits = worlds(2).run(check_steady_speculated)
    assert all(h >= 1 for h in hits), hits


def test_steady_buffer_budget(worlds):
    for used, budget in worlds(2).run(check_steady_buffer_budget):
        assert 0 < used <= budget, (used, budget)
