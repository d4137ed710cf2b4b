"""Bytes on the wire: each collective inside func, forward and backward, sends at most 1.1x its native algorithm's
bytes plus 16 KiB per call, counted by wrapping ``torch.distributed`` (tests/wire_tap.py) in real gloo worlds.

The workload is jax.pmap's shape: one example of n bytes per rank, as ``cmap(f, axis_name="i", src="local",
dst="local")`` and as ``shard_map(f, mesh, P("i"), P("i"), local=True)``; and in shard_map, over a tuple of two mesh
axes (in both orders: the group's rank order is not the index order in the second) and with tiled chunks the axis
size does not divide (psum_scatter, all_to_all), each one native collective on the axes' group. Steady state: the
third call is counted.

Small data rides in its status round (one collective instead of a round and the native one) where that stays
within the budget: a sum, a reduce-scatter or an all-to-all sends every rank's whole value in the round's
all-gather. Values up to a round's largest payload (1 KiB per rank) may also take the other bound, by design: a
small sum's round costs (P - 1) times the round, and once a group's rounds have grown to carry one, every round on
the group carries that payload until a run of smaller ones shrinks it. There the bound is the data's native bytes
plus the rounds at their largest.
"""

import pytest
from wire_tap import KINDS, ROUND_CAP, measure, native_bound

SIZES = (1024, 4096, 64 * 1024, 1 << 20)
ALLOWANCE = 16 * 1024


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [2, 4])
def test_native_bytes(worlds, kind, size):
    for rank_rows in worlds(size).run(measure, kind, SIZES):
        for op, n, fwd, bwd, nf_calls, nb_calls in rank_rows:
            native_fwd, native_bwd = native_bound(op, n, size)
            where = f"{kind} {op} n={n} P={size}: forward {fwd:.0f} B in {nf_calls}, backward {bwd:.0f} B in {nb_calls}"
            bound_fwd, bound_bwd = 1.1 * native_fwd + ALLOWANCE, 1.1 * native_bwd + ALLOWANCE
            if n <= ROUND_CAP - 48:  # or: rounds at their largest, each (P - 1) payloads, plus the native bytes
                bound_fwd = max(bound_fwd, native_fwd + nf_calls * (size - 1) * ROUND_CAP)
                bound_bwd = max(bound_bwd, native_bwd + nb_calls * (size - 1) * ROUND_CAP)
            assert fwd <= bound_fwd, where
            assert bwd <= bound_bwd, where
