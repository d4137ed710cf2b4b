"""Bytes on the wire: each collective inside func, forward and backward, sends at most 1.1x its native algorithm's
bytes plus 16 KiB per call, counted by wrapping ``torch.distributed`` (benchmarks.wire_bytes) in real gloo worlds.

The workload is jax.pmap's shape: one example of n bytes per rank, as ``cmap(f, axis_name="i", src="local",
dst="local")`` and as ``shard_map(f, mesh, P("i"), P("i"), local=True)``. Steady state: the third call is counted.

Values up to a round's largest payload (4 KiB per rank at most) are the exception, by design: a small sum rides in its
status round (one collective instead of a round and an all-reduce), which costs (P - 1) times the round, and once
a group's rounds have grown to carry one, every round on the group carries that payload until a run of smaller
ones shrinks it. There the bound is the data's native bytes plus the rounds at their largest.
"""

from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import colossalai_cmap as cm
from benchmarks.wire_bytes import counting, native_bound
from colossalai_cmap import P

OPS = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")
SIZES = (4096, 64 * 1024, 1 << 20)
ALLOWANCE = 16 * 1024
ROUND_CAP = 96 + 1024  # a round's header and its largest payload, per rank


def body(op: str, size: int):
    if op == "psum":
        return lambda v: cm.psum(v, "i")
    if op == "all_gather":
        return lambda v: cm.all_gather(v, "i", tiled=True)
    if op == "psum_scatter":
        return lambda v: cm.psum_scatter(v, "i", tiled=True)
    if op == "all_to_all":
        return lambda v: cm.all_to_all(v, "i", 0, 0, tiled=True)
    return lambda v: cm.ppermute(v, "i", [(j, (j + 1) % size) for j in range(size)])


_MESH: Dict[int, object] = {}


def measure(kind: str) -> List[Tuple[str, int, float, float, int, int]]:
    """(op, n, forward bytes, backward bytes, forward collectives, backward collectives) on this rank."""
    size = dist.get_world_size()
    if kind == "shard_map" and size not in _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH[size] = init_device_mesh("cpu", (size,), mesh_dim_names=("i",))
    rows = []
    for op in OPS:
        for n in SIZES:
            if kind == "cmap":
                f = cm.cmap(body(op, size), axis_name="i", src="local", dst="local")
                shape = (1, n // 4)
            else:
                f = cm.shard_map(body(op, size), _MESH[size], P("i"), P("i"), local=True)
                shape = (n // 4,)
            for _ in range(3):
                x = torch.randn(shape).requires_grad_()
                with counting() as fwd:
                    y = f(x)
                with counting() as bwd:
                    y.sum().backward()
                expect = y.detach()
            assert expect.shape[-1] > 0
            rows.append((op, n, fwd.sent, bwd.sent, fwd.count, bwd.count))
    return rows


@pytest.mark.parametrize("kind", ["cmap", "shard_map"])
@pytest.mark.parametrize("size", [2, 4])
def test_native_bytes(worlds, kind, size):
    for rank_rows in worlds(size).run(measure, kind):
        for op, n, fwd, bwd, nf_calls, nb_calls in rank_rows:
            native_fwd, native_bwd = native_bound(op, n, size)
            where = f"{kind} {op} n={n} P={size}: forward {fwd:.0f} B in {nf_calls}, backward {bwd:.0f} B in {nb_calls}"
            if n <= ROUND_CAP - 96:  # rounds at their largest, each (P - 1) payloads, plus the data's native bytes
                assert fwd <= native_fwd + nf_calls * (size - 1) * ROUND_CAP, where
                assert bwd <= native_bwd + nb_calls * (size - 1) * ROUND_CAP, where
                continue
            assert fwd <= 1.1 * native_fwd + ALLOWANCE, where
            assert bwd <= 1.1 * native_bwd + ALLOWANCE, where
