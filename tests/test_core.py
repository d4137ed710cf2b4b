"""cmap == torch.vmap for every group size, batch size and argument shape of the core matrix."""

import torch
import torch.distributed as dist
from cases import assert_same, equivalence_cases, linear_scale, sum_tolerance

import colossalai_cmap as cm

PLACEMENTS = [(src, dst) for src in (None, 0, "local") for dst in (-1, 0, "local")]


def check_equivalence(batch_sizes):
    """Every case of the matrix, for each batch size, with dst=-1 and src=None."""
    done = 0
    for B in batch_sizes:
        for name, func, args, kwargs, opts, exact in equivalence_cases(B):
            try:
                expected = torch.vmap(func, **opts)(*args, **kwargs)
            except Exception as exc:  # vmap itself refuses (e.g. its fallback on B=0): cmap must raise too
                assert_raises_like(exc, lambda: cm.cmap(func, **opts)(*args, **kwargs), f"{name} B={B}")
            else:
                actual = cm.cmap(func, **opts)(*args, **kwargs)
                assert_same(actual, expected, exact, f"{name} B={B}")
            done += 1
    return done


def assert_raises_like(expected, thunk, what):
    try:
        thunk()
    except cm.CmapError as exc:
        assert type(expected).__name__ in str(exc), f"{what}: {exc}"
    except Exception as exc:
        assert type(exc) is type(expected), f"{what}: raised {type(exc)} instead of {type(expected)}"
    else:
        raise AssertionError(f"{what}: vmap raised {expected!r} but cmap returned")


def _my_rows(B, size, rank):
    q, r = divmod(B, size)
    start = rank * q + min(rank, r)
    return start, q + (1 if rank < r else 0)


def check_placements(batch_sizes):
    """Every dst x src combination against vmap: full result on receivers, own rows for 'local'."""
    rank, size = dist.get_rank(), dist.get_world_size()
    done = 0
    for B in batch_sizes:
        for name, func, args, kwargs, opts, exact in equivalence_cases(B)[:8]:
            in_dims = opts.get("in_dims", 0)
            expected = torch.vmap(func, **opts)(*args, **kwargs)
            for src, dst in PLACEMENTS:
                start, rows = _my_rows(B, size, rank)
                if src == "local":
                    call_args = _local_shard(args, in_dims, start, rows)
                elif src == 0 and rank != 0:
                    call_args = tuple(None if _all_mapped(a, d) else a for a, d in zip(args, _per_arg(in_dims, args)))
                else:
                    call_args = args
                actual = cm.cmap(func, src=src, dst=dst, **opts)(*call_args, **kwargs)
                what = f"{name} B={B} src={src} dst={dst}"
                if dst == "local":
                    expected_local = torch.vmap(func, **opts)(*_local_shard(args, in_dims, start, rows), **kwargs)
                    assert_same(actual, expected_local, exact, what)
                elif dst == -1 or dst == rank:
                    assert_same(actual, expected, exact, what)
                else:
                    assert actual is None, what
                done += 1
    return done


def _per_arg(in_dims, args):
    return in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)


def _all_mapped(arg, dim):
    return isinstance(arg, torch.Tensor) and dim is not None


def _local_shard(args, in_dims, start, rows):
    from torch.utils._pytree import _broadcast_to_and_flatten, tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(args)
    dims = _broadcast_to_and_flatten(in_dims, spec)
    return tree_unflatten([l if d is None else l.narrow(d, start, rows) for l, d in zip(leaves, dims)], spec)


def check_modes(batch_sizes):
    """mode='batched' and mode='loop' give vmap's results, with and without chunk_size."""
    done = 0
    module = torch.nn.Linear(5, 3)
    with torch.no_grad():  # the same bias on every rank, whatever their global RNG states
        module.weight.fill_(0.25)
        module.bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
    for B in batch_sizes:
        x = torch.arange(B * 5, dtype=torch.float32).view(B, 5) / 7
        expected = torch.vmap(module)(x)
        # Each mode hands the Linear another number of rows (a shard, a chunk, one), which BLAS may block otherwise:
        # each output is a sum of 6 terms (5 products and the bias) added in some order.
        tol = sum_tolerance(6, linear_scale(x, module.weight.detach(), module.bias.detach()))
        for chunk in (None, 1, 3):
            assert_same(cm.cmap(module, mode="batched", chunk_size=chunk)(x), expected, tol, f"batched B={B}")
            xt = x.T.contiguous()
            got = cm.cmap(lambda a: module(a.T).T, in_dims=1, out_dims=1, mode="batched", chunk_size=chunk)(xt)
            assert_same(got, expected.T, tol, f"batched in_dims=1 B={B} chunk={chunk}")
            if B:
                assert_same(cm.cmap(module, mode="loop", chunk_size=chunk)(x), expected, tol, f"loop B={B}")
            assert_same(cm.cmap(module, chunk_size=chunk)(x), expected, tol, f"vmap chunk B={B}")
            done += 4
        # loop mode takes what vmap cannot: data-dependent Python control flow
        f = lambda a: a * 2 if a.sum().item() > 3 else -a  # noqa: E731
        exp = torch.stack([f(r) for r in x]) if B else None
        if B:
            assert_same(cm.cmap(f, mode="loop")(x), exp, True, f"loop item B={B}")
    return done


def check_randomness(B):
    """'different': distinct draws across examples and ranks, reproducible; 'same': torch.vmap's draws."""
    f = lambda a: a + torch.rand(3)  # noqa: E731
    x = torch.zeros(B, 3)
    torch.manual_seed(123)
    d1 = cm.cmap(f, randomness="different")(x)
    torch.manual_seed(123)
    d2 = cm.cmap(f, randomness="different")(x)
    assert torch.equal(d1, d2), "randomness='different' is not reproducible for a fixed seed"
    assert len({tuple(r.tolist()) for r in d1}) == B, "two examples got the same draws"
    torch.manual_seed(7)  # 'same' draws from each rank's generator, in step as colossalai's launch seeds them
    expected = torch.vmap(f, randomness="same")(x)
    torch.manual_seed(7)
    s = cm.cmap(f, randomness="same")(x)
    assert torch.equal(s, expected), "randomness='same' did not draw what torch.vmap draws with the same seed"
    try:
        cm.cmap(f)(x)
    except cm.CmapError as exc:
        assert "randomness" in str(exc) and "RuntimeError" in str(exc)
    else:
        raise AssertionError("randomness='error' did not raise")
    return d1, s


def check_nested_mesh(B):
    """cmap over mesh axis 0 of a 2x2 mesh around cmap over axis 1 == vmap(vmap(f)) == cmap over both axes."""
    from colossalai.cluster import ProcessGroupMesh

    mesh = ProcessGroupMesh(2, 2)
    x = torch.arange(B * 3 * 4, dtype=torch.float32).view(B, 3, 4)
    f = lambda r: r.sin() * r.sum()  # noqa: E731
    expected = torch.vmap(torch.vmap(f))(x)
    inner = cm.cmap(f, group=(mesh, 1))
    outer = cm.cmap(lambda rows: torch.stack([inner(r) for r in rows]), group=(mesh, 0), mode="batched")
    assert_same(outer(x), expected, False, "batched outer cmap over (0) calling cmap over (1)")
    # jax-style nesting: the inner cmap runs under the outer cmap's torch.vmap
    assert_same(cm.cmap(inner, group=(mesh, 0))(x), expected, False, "cmap(cmap(f, axis 1), axis 0)")
    g = lambda r: (r * 2, r.sum())  # noqa: E731
    nested = cm.cmap(cm.cmap(g, group=(mesh, 1), out_dims=(1, 0)), group=(mesh, 0), out_dims=(2, 0))
    assert_same(nested(x), torch.vmap(torch.vmap(g, out_dims=(1, 0)), out_dims=(2, 0))(x), True, "nested out_dims")
    both = cm.cmap(lambda r: torch.vmap(f)(r), group=(mesh, (0, 1)))
    assert_same(both(x), expected, False, "cmap over mesh axes (0, 1)")
    flat = x.reshape(B * 3, 4)
    assert_same(cm.cmap(f, group=(mesh, (0, 1)))(flat), torch.vmap(f)(flat), False, "flat over both axes")
    return True


# ---------------------------------------------------------------------------------------------- pytest entries
import pytest  # noqa: E402


def _sizes(P):
    return sorted({0, 1, max(P - 1, 0), P, 7, 64})


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_equivalence_matrix(worlds, P):
    counts = worlds(P).run(check_equivalence, _sizes(P))
    assert counts == [len(_sizes(P)) * len(equivalence_cases(0))] * P


@pytest.mark.parametrize("P", [2, 3])
def test_every_src_dst_combination(worlds, P):
    counts = worlds(P).run(check_placements, [0, 1, P + 1, 7])
    assert all(c == 4 * 8 * 9 for c in counts)


@pytest.mark.parametrize("P", [1, 3])
def test_modes_and_chunk_size(worlds, P):
    counts = worlds(P).run(check_modes, [0, 1, 5, 8])
    assert all(c > 0 for c in counts)


@pytest.mark.parametrize("P", [2, 3])
def test_randomness(worlds, P):
    results = worlds(P).run(check_randomness, 5)
    different = [d for d, _ in results]
    same = [s for _, s in results]
    assert all(torch.equal(d, different[0]) for d in different), "ranks disagree on the gathered draws"
    assert all(torch.equal(s, same[0]) for s in same)


@pytest.mark.parametrize("B", [5, 1])
def test_nested_cmap_on_2x2_mesh(worlds, B):
    assert worlds(4).run(check_nested_mesh, B) == [True] * 4


def test_no_distributed_fallback():
    """Without torch.distributed initialised, cmap runs in this process and is exactly torch.vmap."""
    assert not dist.is_initialized()
    for name, func, args, kwargs, opts, exact in equivalence_cases(5):
        assert_same(cm.cmap(func, **opts)(*args, **kwargs), torch.vmap(func, **opts)(*args, **kwargs), exact, name)
    x = torch.randn(4, 3)
    assert torch.equal(cm.cmap(torch.sum, dst=0, src=0)(x), torch.vmap(torch.sum)(x))
