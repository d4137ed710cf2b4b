"""shard_map on DTensors side by side with torch's ``local_map`` and with plain DTensor ops, on the same regions.

    python -m benchmarks.shard_local_map            # 4 ranks on gloo (CPU), 127.0.0.1
    python -m benchmarks.shard_local_map --ranks 2

Each region is one function of DTensors on a 1-D mesh "tp", written four or five ways:

* ``shard_map DTensor``: ``cm.shard_map(f, mesh, out_specs=...)`` on the DTensors (in_specs from their placements,
  DTensor outputs), ``f`` with ``cm.psum``;
* ``shard_map plain``: the same ``f`` on the global plain tensors, with explicit ``in_specs``;
* ``local_map Partial``: torch's ``local_map`` with ``out_placements=[Partial()]``, the sum left to DTensor (its
  ``redistribute`` to ``Replicate()``), as torch's docs recommend where a region ends in a sum;
* ``local_map all_reduce``: ``local_map`` with ``torch.distributed.nn.functional.all_reduce`` inside (the
  differentiable all-reduce torch has), ``out_placements=[Replicate()]`` or ``[Shard(d)]``;
* ``DTensor ops``: no region: the same math on DTensors, placed by DTensor's sharding propagation.

Per variant: the largest difference from the single-process reference in float64 (values; each input's gradient,
the DTensor gradients taken whole), over every rank; whether every rank's ``.grad`` of a replicated input holds the
same values; and the collectives of the forward and of the backward of ``(sin(y) * W).sum()``, counted by torch's
``CommDebugMode`` (it sees the c10d ops of ``torch.distributed`` and DTensor's functional collectives alike; cmap's
count includes its status rounds, small host-side all-gathers, one at the exit of each call).
"""

import argparse
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks import world

B, D, H = 8, 64, 128  # the psum'd values are 4 KiB per rank: real all-reduces, not riding in a status round


# ------------------------------------------------------------------------------------------------ the regions
def _mlp_inputs() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in ((B, D), (D, H), (H, D))]


def _norm_inputs() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, D, generator=g, dtype=torch.float64), 1 + torch.rand(D, generator=g, dtype=torch.float64)]


def _mlp_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


def _norm_reference(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) / D + 1e-6) * g  # a sum: gloo has no AVG for DTensor's mean


def regions() -> Dict[str, Any]:
    """name: (inputs, their placements on "tp", the output's, the reference, the region's local body given a sum
    over "tp" (or None: the body ends in a sum left to the caller), cmap's specs)."""
    from torch.distributed.tensor import Replicate, Shard

    from colossalai_cmap import P

    def mlp(total: Callable) -> Callable:
        return lambda x, w1, w2: total(torch.relu(x @ w1) @ w2)

    def norm(total: Callable) -> Callable:
        return lambda x, g: x * torch.rsqrt(total((x * x).sum(-1, keepdim=True)) / D + 1e-6) * g

    return {
        "Megatron MLP psum(relu(x @ w1) @ w2)": dict(
            inputs=_mlp_inputs,
            placements=[[Replicate()], [Shard(1)], [Shard(0)]],
            out=[Replicate()],
            reference=_mlp_reference,
            body=mlp,
            ends_in_sum=True,
            specs=((P(), P(None, "tp"), P("tp")), P()),
        ),
        "RMS norm over sharded features": dict(
            inputs=_norm_inputs,
            placements=[[Shard(1)], [Shard(0)]],
            out=[Shard(1)],
            reference=_norm_reference,
            body=norm,
            ends_in_sum=False,
            specs=((P(None, "tp"), P("tp")), P(None, "tp")),
        ),
    }


# ------------------------------------------------------------------------------------------------ the variants
def variants(region: Dict[str, Any], mesh: Any) -> Dict[str, Tuple[bool, Callable]]:
    """name: (whether it takes DTensors, the function of the region's inputs)."""
    import torch.distributed.nn.functional as dist_nn
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.experimental import local_map

    import colossalai_cmap as cm

    body, ins, outs = region["body"], tuple(region["specs"][0]), region["specs"][1]
    psum = body(lambda v: cm.psum(v, "tp"))
    out: Dict[str, Tuple[bool, Callable]] = {
        "shard_map DTensor": (True, cm.shard_map(psum, mesh, out_specs=outs)),
        "shard_map plain": (False, cm.shard_map(psum, mesh, in_specs=ins, out_specs=outs)),
    }
    placed = dict(in_placements=tuple(region["placements"]), device_mesh=mesh)
    if region["ends_in_sum"]:
        partial = local_map(body(lambda v: v), out_placements=[Partial()], **placed)
        out["local_map Partial"] = (True, lambda *a: partial(*a).redistribute(mesh, region["out"]))
    reduced = body(lambda v: dist_nn.all_reduce(v, group=mesh.get_group("tp")))
    out["local_map all_reduce"] = (True, local_map(reduced, out_placements=region["out"], **placed))
    out["DTensor ops"] = (True, lambda *a: region["reference"](*a).redistribute(mesh, region["out"]))
    return out


# ------------------------------------------------------------------------------------------------ one rank
def _count(mode: Any) -> str:
    counts = {str(op).split(".")[-1].strip("_'>)"): n for op, n in mode.get_comm_counts().items() if n}
    return " ".join(f"{op} {n}" for op, n in sorted(counts.items())) or "-"


def _placements(t: Any) -> str:
    return ", ".join(type(p).__name__ for p in t.placements) if hasattr(t, "placements") else "plain"


def _whole(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def measure(ranks: int) -> List[Dict[str, Any]]:
    """On this rank: one row per region and variant."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
    rows = []
    for rname, region in regions().items():
        inputs = region["inputs"]()
        leaves = [t.clone().requires_grad_() for t in inputs]
        want = region["reference"](*leaves)
        w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        want_grads = torch.autograd.grad((torch.sin(want) * w).sum(), leaves)
        for vname, (takes_dtensor, fn) in variants(region, mesh).items():
            if takes_dtensor:
                args = [distribute_tensor(t, mesh, p).requires_grad_() for t, p in zip(inputs, region["placements"])]
            else:
                args = [t.clone().requires_grad_() for t in inputs]
            row: Dict[str, Any] = dict(region=rname, variant=vname)
            try:
                fwd, bwd = CommDebugMode(), CommDebugMode()
                with fwd:
                    y = fn(*args)
                weight = DTensor.from_local(w, mesh, [Replicate()]) if isinstance(y, DTensor) else w
                loss = (torch.sin(y) * weight).sum()
                with bwd:
                    loss.backward()
                grads = [_whole(a.grad) for a in args]
                locals_ = [a.grad.to_local() if isinstance(a.grad, DTensor) else a.grad for a in args]
                row.update(
                    value=(_whole(y) - want).abs().max().item(),
                    grads=[(g - e).abs().max().item() for g, e in zip(grads, want_grads)],
                    local_grads=[g.detach().tolist() for g in locals_],
                    out_type=type(y).__name__,
                    grad_placements=[_placements(a.grad) for a in args],
                    fwd=_count(fwd),
                    bwd=_count(bwd),
                )
            except Exception as exc:  # a variant that cannot run says why
                row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ the table
def report(ranks: int, per_rank: Sequence[List[Dict[str, Any]]]) -> None:
    print(f"\nshard_map on DTensors and local_map, {ranks} ranks on gloo, float64, B={B}, D={D}, H={H}")
    print("(errors: the largest over every rank, DTensor gradients taken whole; the replicated input's .grad: its")
    print("placements, and whether the ranks' local gradients are equal, as a Replicate() gradient's must be)\n")
    head = ("region", "variant", "value err", "grad err (per input)", "replicated input's .grad", "fwd", "bwd")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for k, row in enumerate(per_rank[0]):
        rows = [r[k] for r in per_rank]
        if "error" in row:
            print(f"| {row['region']} | {row['variant']} | {row['error']} | | | | |")
            continue
        value = max(r["value"] for r in rows)
        grads = [max(r["grads"][i] for r in rows) for i in range(len(row["grads"]))]
        region = regions()[row["region"]]
        repl = [i for i, p in enumerate(region["placements"]) if p[0].is_replicate()]
        agrees = all(r["local_grads"][i] == row["local_grads"][i] for r in rows for i in repl)
        fmt = ", ".join(f"{g:.1e}" for g in grads)
        placed = ", ".join(row["grad_placements"][i] for i in repl)
        grad = f"{placed}: {'equal' if agrees else 'differ'}" if repl else "(none)"
        print(f"| {row['region']} | {row['variant']} | {value:.1e} | {fmt} | {grad} | {row['fwd']} | {row['bwd']} |")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shard_local_map", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args(argv)
    report(args.ranks, world.spawn(measure, args.ranks, (args.ranks,)))


if __name__ == "__main__":
    main()
