"""Memory inside the ranks: each ``dst`` choice's peak per rank, replicated inputs passed as views, and
``chunk_size`` bounding the activations."""

from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import colossalai_cmap
from benchmarks.baselines import Baseline, shard_sizes
from benchmarks.cases import Case
from benchmarks.measure import allgather_obj, peak_rss, peak_torch


def outer_activation(x: torch.Tensor) -> torch.Tensor:
    """A function with a large per-example intermediate (D x D) and a small output (D): for ``chunk_size``."""
    return torch.tanh(x[:, None] * x[None, :]).sum(0)


def bench_memory(case: Case) -> List[Dict[str, Any]]:
    """Peak memory per rank of one call for each ``dst`` choice (and the hand-written baseline)."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    args = case.inputs()
    fns: Dict[str, Callable[[], Any]] = {}
    for dst in (-1, 0, "local"):
        fns[f"cmap dst={dst}"] = (lambda c: lambda: c(*args))(cmap(case.func, in_dims=case.in_dims, dst=dst))
    fns["baseline (all_gather)"] = (lambda b: lambda: b(*args))(Baseline(case.func, case.in_dims, case.batch))
    fns["vmap_shard (no comm)"] = (lambda b: lambda: b.compute(args))(Baseline(case.func, case.in_dims, case.batch))
    sizes = shard_sizes(case.batch, world)
    one = torch.vmap(case.func, case.in_dims)(*Baseline(case.func, case.in_dims, case.batch).shard(args))
    full = one.element_size() * (one[0].numel() if one.dim() else 1) * case.batch
    rows = []
    for name, fn in fns.items():
        fn()  # warm: the plan of this argument shape is cached, as in any repeated call
        with colossalai_cmap.record_collectives() as log:
            rss_peak, rss_kept = peak_rss(fn)
        collectives = log.count
        t_peak, t_kept, ops = peak_torch(fn)
        mine = {"rss_peak": rss_peak, "rss_kept": rss_kept, "torch_peak": t_peak, "torch_kept": t_kept, "ops": ops}
        mine["collectives"] = collectives if name.startswith("cmap") else None
        everyone = allgather_obj(mine)  # every rank takes part in every collective, in the same order
        rows.append(
            {
                "case": case.name,
                "P": world,
                "variant": name,
                "full_out_bytes": full,
                "shard_out_bytes": [full // case.batch * n for n in sizes],
                "per_rank": everyone,
            }
        )
    return rows if rank == 0 else []


def bench_zero_copy() -> Dict[str, Any]:
    """Show that the shards of replicated inputs are views: the pointers ``func`` sees lie in the inputs' storage."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    x, w = torch.randn(4097, 64), torch.randn(64, 64)
    seen: Dict[str, Any] = {}
    unwrap = getattr(torch._C._functorch, "get_unwrapped", None)  # inspection only (private API)

    def batched(xs: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        seen["batched"] = (xs.data_ptr(), xs.untyped_storage().data_ptr(), w_.data_ptr(), xs.shape[0])
        return xs @ w_

    def per_example(xi: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        inner = xi
        while unwrap is not None and torch._C._functorch.is_batchedtensor(inner):
            inner = unwrap(inner)
        seen["vmap"] = (inner.data_ptr(), inner.untyped_storage().data_ptr(), w_.data_ptr(), inner.shape[0])
        return xi @ w_

    cmap(batched, in_dims=(0, None), mode="batched", dst="local")(x, w)
    cmap(per_example, in_dims=(0, None), dst="local")(x, w)
    sizes = shard_sizes(x.shape[0], world)
    offset = sum(sizes[:rank])
    expect = x.data_ptr() + offset * x.stride(0) * x.element_size()
    mine = {}
    for mode in ("batched", "vmap"):
        ptr, storage, wptr, rows = seen[mode]
        mine[mode] = {
            "shard_ptr_is_view": ptr == expect,
            "same_storage": storage == x.untyped_storage().data_ptr(),
            "replicated_arg_same_ptr": wptr == w.data_ptr(),
            "rows": rows,
        }
    everyone = allgather_obj(mine)
    return {"P": world, "per_rank": everyone} if rank == 0 else {}


def bench_chunk() -> List[Dict[str, Any]]:
    """Per-rank peak memory of a function with a large intermediate, for several ``chunk_size`` values."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(1024, 128, generator=torch.Generator().manual_seed(7))
    rows = []
    for chunk in (None, 128, 32, 8):
        fn = (lambda c: lambda: c(x))(cmap(outer_activation, dst="local", chunk_size=chunk))
        fn()
        rss_peak, _ = peak_rss(fn)
        t_peak, _, _ = peak_torch(fn)
        everyone = allgather_obj({"rss_peak": rss_peak, "torch_peak": t_peak})
        if rank == 0:
            shard_rows = shard_sizes(x.shape[0], world)[0]
            per_example = 128 * 128 * 4
            rows.append(
                {
                    "P": world,
                    "chunk_size": chunk,
                    "rows_per_rank": shard_rows,
                    "intermediate_bytes": per_example * (min(chunk, shard_rows) if chunk else shard_rows),
                    "per_rank": everyone,
                }
            )
    return rows
