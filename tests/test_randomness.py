"""Randomness across ranks: "same" draws what single-process ``torch.vmap(randomness="same")`` draws, and
"per_example" draws the same numbers at every P, for every src, dst, mode and chunk_size."""

import itertools

import pytest
import torch
import torch.distributed as dist

import colossalai_cmap as cm

SEED = 1234


def noisy(v):
    """One example: uniform and normal draws, and dropout (its mask is a draw too)."""
    return torch.tanh(v) + torch.rand(3) + torch.randn(3) + torch.nn.functional.dropout(torch.ones(3), 0.5)


def noisy_batch(b):
    """``noisy`` for mode="batched": func gets its rows at once and draws for all of them."""
    n = b.shape[0]
    return torch.tanh(b) + torch.rand(n, 3) + torch.randn(n, 3) + torch.nn.functional.dropout(torch.ones(n, 3), 0.5)


def noisy_psum(v):
    """With a collective inside func: the examples meet in it (and axis_index is the global index)."""
    return noisy(v) + cm.psum(torch.ones(()), "i") + cm.axis_index("i")


def _x(B):
    return torch.arange(B * 3, dtype=torch.float32).view(B, 3) / 10


def _rows(B, P, rank):
    """An uneven split for src="local" (not cmap's own), so the global index is not the local one re-based."""
    cuts = [0] + [round(B * (r / P) ** 2) for r in range(1, P)] + [B]
    return cuts[rank], cuts[rank + 1] - cuts[rank]


# ---------------------------------------------------------------------------------------------------- "same"
def check_same(batch_sizes):
    """On every rank, each call's draws and the generator's state afterwards equal torch.vmap's with the same seed."""
    done = 0
    for B, chunk, mode in itertools.product(batch_sizes, (None, 1, 2), ("vmap", "loop")):
        x = _x(B)
        torch.manual_seed(SEED + B)
        expected = torch.vmap(noisy, randomness="same", chunk_size=chunk)(x)
        after_vmap = torch.rand(4)
        torch.manual_seed(SEED + B)
        out = cm.cmap(noisy, randomness="same", chunk_size=chunk, mode=mode)(x)
        assert torch.equal(out, expected), (B, chunk, mode, out, expected)
        assert torch.equal(torch.rand(4), after_vmap), f"the generator is not left as vmap leaves it ({B}, {chunk})"
        done += 1
    return done


@pytest.mark.parametrize("P", [1, 2, 3])
def test_same_equals_vmap_with_the_same_seed(worlds, P):
    assert worlds(P).run(check_same, [1, P + 2]) == [2 * 3 * 2] * P


def test_same_equals_vmap_in_one_process():
    assert check_same([1, 5]) == 2 * 3 * 2


# ------------------------------------------------------------------------------------------------ "per_example"
CASES = [
    (src, dst, mode, chunk)
    for src in (None, 0, "local")
    for dst in (-1, 0, "local")
    for mode in ("vmap", "batched", "loop")
    for chunk in ((None, 2) if mode != "loop" else (None,))
] + [("psum", dst, mode, None) for dst in (-1, "local") for mode in ("vmap", "loop")]


def _per_example_call(B, case, P, rank):
    """One call of CASES[case] on this rank; returns the whole result (gathered by hand for dst="local") or None."""
    src, dst, mode, chunk = case
    x = _x(B)
    start, rows = _rows(B, P, rank) if src == "local" else (0, B)
    func = noisy_batch if mode == "batched" else noisy
    opts = dict(randomness="per_example", dst=dst, mode=mode, chunk_size=chunk)
    if src == "psum":
        func, src = noisy_psum, None
        opts.update(axis_name="i")
    arg = x.narrow(0, start, rows) if src == "local" else (None if src == 0 and rank != 0 else x)
    torch.manual_seed(SEED)
    out = cm.cmap(func, src=src, **opts)(arg)
    after = torch.rand(2)
    if dst == "local" and P > 1:
        parts = [None] * P
        dist.all_gather_object(parts, out)
        out = torch.cat(parts)
    return out, after


def check_per_example(B, cases):
    P, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    return [_per_example_call(B, case, P, rank) for case in cases]


def _alone(B):
    """The oracle: a world of one (no torch.distributed), vmap mode, src=None, dst=-1."""
    torch.manual_seed(SEED)
    out = cm.cmap(noisy, randomness="per_example")(_x(B))
    return out, torch.rand(2)


def _with_psum(expected):
    """What ``noisy_psum`` adds to ``noisy``'s rows: B, then the row's global index."""
    B = expected.shape[0]
    return expected + float(B) + torch.arange(B).view(B, 1)


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_per_example_draws_do_not_depend_on_p(worlds, P):
    B = 7
    expected, after = _alone(B)
    assert torch.unique(expected, dim=0).shape[0] == B, "two examples drew alike"
    for rank, results in enumerate(worlds(P).run(check_per_example, B, CASES)):
        for case, (out, got_after) in zip(CASES, results):
            if out is None:
                assert case[1] == 0 and rank != 0, (case, rank)
                continue
            assert torch.equal(out, _with_psum(expected) if case[0] == "psum" else expected), (case, rank)
            assert torch.equal(got_after, after), f"the generator moved differently: {case}"


def test_per_example_in_a_world_of_one():
    """Every case in this process equals the oracle, and the draws depend on the generator's state at the call."""
    B = 5
    expected, _ = _alone(B)
    for case, (out, _) in zip(CASES, check_per_example(B, CASES)):
        assert torch.equal(out, _with_psum(expected) if case[0] == "psum" else expected), case
    torch.manual_seed(SEED + 1)
    assert not torch.equal(cm.cmap(noisy, randomness="per_example")(_x(B)), expected)
    # an example's draws depend on its global index only: a prefix of the batch draws the prefix's numbers
    torch.manual_seed(SEED)
    assert torch.equal(cm.cmap(noisy, randomness="per_example")(_x(B)[:3]), expected[:3])


def test_per_example_is_an_option():
    with pytest.raises(ValueError, match="'per_example'"):
        cm.cmap(noisy, randomness="per-example")
