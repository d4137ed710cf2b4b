"""Repeated calls read the plan of an earlier call with the same argument key (the fast path), and give vmap's
results; a failure, a layout change or another batch size in a repeated call still reaches every rank.

What a call did is read through the public ``cmap(...).stats`` and ``colossalai_cmap.record_collectives()``.
"""

import pytest
import torch
import torch.distributed as dist
from cases import assert_same

import colossalai_cmap as cm


def _multi(x, w):
    return {"a": x * w, "b": (x.sum(), w.sum() * 2), "tag": "steady"}


def check_repeated_calls_match_vmap():
    """Several output kinds, batch sizes and dst choices, each called repeatedly with fresh values."""
    rank, size = dist.get_rank(), dist.get_world_size()
    w = torch.randn(3, generator=torch.Generator().manual_seed(7))  # the same on every rank, as src=None needs
    cases = [
        ("multi", _multi, dict(in_dims=(0, None), out_dims={"a": 1, "b": (0, None), "tag": None})),
        ("dot", torch.dot, dict()),
        ("dst0", lambda x, w: x * w, dict(in_dims=(0, None), dst=0)),
    ]
    fast = 0
    for name, func, opts in cases:
        for B in (7, 1, size, 0):
            f = cm.cmap(func, **opts)
            vmap_opts = {k: v for k, v in opts.items() if k != "dst"}
            first = None
            for call in range(4):
                x = torch.randn(B, 3, generator=torch.Generator().manual_seed(100 * B + call))
                args = (x, w) if func is not torch.dot else (x, x)
                expected = torch.vmap(func, **vmap_opts)(*args)
                actual = f(*args)
                assert f.stats.fast_path == (call > 0), (name, B, call, f.stats)
                assert f.stats.sizes is not None and sum(f.stats.sizes) == B
                fast += f.stats.fast_path
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
    return fast


def check_failure_and_layout_change():
    """A repeated call where one rank raises, or returns another dtype: every rank raises; the next call works."""
    rank = dist.get_rank()
    state = {"call": 0}

    def func(x):
        state["call"] += 1
        if state["call"] == 3 and rank == 1:
            raise RuntimeError("fails in a repeated call")
        if state["call"] == 5 and rank == 1:
            return x.double()
        return x + 1

    f = cm.cmap(func, mode="batched")
    x = torch.arange(10.0).view(5, 2)
    outcomes = []
    for _ in range(7):
        try:
            out = f(x)
        except cm.CmapError as err:
            outcomes.append("fails in a repeated call" in str(err) or "different per-example" in str(err))
        else:
            assert torch.equal(out, x + 1)
            outcomes.append("ok")
        assert f.stats.fast_path == (state["call"] > 1)
    assert outcomes == ["ok", "ok", True, "ok", True, "ok", "ok"], outcomes
    return True


def check_sizes_and_collectives():
    """Small outputs travel in the status round (one collective). One up to the round's 1 KiB cap takes a second
    collective once; then the group's rounds grow to carry it, on every rank alike, so repeated calls make one;
    after a run of small calls the rounds shrink back. A larger output always takes its own collective: the rounds
    never grow past the cap, so a tiny call after a large one costs one small round."""
    f = cm.cmap(lambda x: x * 3)
    gen = torch.Generator().manual_seed(3)  # the same inputs on every rank
    small, mid = torch.randn(6, 2, generator=gen), torch.randn(6, 60, generator=gen)  # 720 B per rank: fits
    big = torch.randn(6, 4000, generator=gen)
    seen = []
    for x in (small, mid, mid, small, mid, big, big, small):
        with cm.record_collectives() as log:
            assert torch.equal(f(x), x * 3)
        assert log.count == f.stats.collectives
        seen.append((x.shape[1], log.count))
    assert seen == [(2, 1), (60, 2), (60, 1), (2, 1), (60, 1), (4000, 2), (4000, 2), (2, 1)], seen
    assert f.stats.bytes <= 48 + 1024, f.stats  # the tiny call right after the large ones: one small round
    grown = f.stats.bytes
    for _ in range(80):
        f(small)
    assert f.stats.collectives == 1 and f.stats.bytes < grown and f.stats.bytes == 48 + 256, (grown, f.stats)
    x = torch.randn(6, 2, generator=gen).requires_grad_()
    f(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    return seen


def check_large_outputs():
    """Outputs past the largest round (a data phase, sent together with the round once the group agreed on its shape):
    uneven B, out_dims=1, a failure in a repeated call, ranks with different batch sizes, then recovery."""
    rank = dist.get_rank()
    state = {"fail": False}

    def func(r):
        if state["fail"] and rank == 1:
            raise RuntimeError("fails in a large call")
        return (r * 2 + 1).unsqueeze(0).expand(2, -1)

    f = cm.cmap(func, out_dims=1)
    for B in (2401, 2401, 7, 2401, 2401):  # 1.4 MiB per rank and output row block: past the rounds' 1 KiB
        x = torch.arange(B * 300, dtype=torch.float32).view(B, 300)
        with cm.record_collectives() as log:
            assert torch.equal(f(x), torch.vmap(func, out_dims=1)(x)), B
        assert log.count == 2, (B, log.entries)  # the round, and the data (sent with it when repeated)
    state["fail"] = True
    with pytest.raises(cm.CmapError, match="fails in a large call"):
        f(x)
    state["fail"] = False
    assert torch.equal(f(x), torch.vmap(func, out_dims=1)(x))
    for mine in (2400 - rank, 2398 - 2 * rank):  # the same and another padded shape than the agreed one
        with pytest.raises(cm.CmapError, match="different inputs"):
            f(torch.ones(mine, 300))
    assert torch.equal(f(x), torch.vmap(func, out_dims=1)(x))
    return f.stats.fast_path


def check_plan_cache_bounded():
    """Many argument shapes: the plans kept stay bounded (least recently used first out)."""
    f = cm.cmap(lambda x: x + 1)
    for d in range(1, 100):
        assert torch.equal(f(torch.ones(3, d)), torch.ones(3, d) + 1)
    return f.cached_plans


@pytest.mark.parametrize("size", [2, 3])
def test_repeated_calls_match_vmap(worlds, size):
    fast = worlds(size).run(check_repeated_calls_match_vmap)
    assert all(n == 3 * 4 * 3 for n in fast), fast


def test_failure_and_layout_change_in_repeated_calls(worlds):
    assert worlds(2).run(check_failure_and_layout_change) == [True, True]


def test_collectives_by_size(worlds):
    counts = worlds(2).run(check_sizes_and_collectives)
    assert counts[0] == counts[1]


def test_large_outputs(worlds):
    assert worlds(2).run(check_large_outputs) == [True, True]


def test_plan_cache_is_bounded(worlds):
    assert worlds(2).run(check_plan_cache_bounded) == [64, 64]


def check_skipped_backward_then_large_call():
    """Rank 1 skips a backward and makes its next call, whose large output (past the largest round) it sends right
    behind its exit round; rank 0, in that backward's round, meets it. Rank 0 raises, naming rank 1; both ranks' next
    calls return vmap's values, so the data sent early was met and the group is in step."""
    rank = dist.get_rank()
    f = cm.cmap(torch.sin, timeout=15)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 384, generator=gen)  # 6 MiB out, past the rounds: its own all_gather
    for _ in range(2):  # the group agrees on the data's shape, so the next exit sends it early
        assert torch.equal(f(x), torch.sin(x))
    given = x.clone().requires_grad_()
    y = f(given)
    said = "backward skipped"
    if rank == 0:
        with pytest.raises(cm.CmapError, match="did not take part") as info:
            y.sum().backward()
        said = str(info.value)
    for k in range(3):
        z = x + k
        with cm.record_collectives() as log:
            assert torch.equal(f(z), torch.sin(z)), k
        # the first: the round and data sent early that met rank 0's backward round, the round again, a stand-in
        # for rank 0's data sent early, then the data; after it, every rank in step sends its data early
        assert log.count <= 5 if k == 0 else log.count == 2, (k, log.entries)
    return said


def test_a_skipped_backward_meets_data_sent_early(worlds):
    said, skipped = worlds(2).run(check_skipped_backward_then_large_call, deadline=120)
    assert skipped == "backward skipped"
    assert "group rank(s) [1] did not take part in" in said, said
