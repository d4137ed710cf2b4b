"""The ``shard_map`` checks on a ``DeviceMesh`` from ``init_device_mesh``, and ``shard_model`` on a small
transformers Llama built from a config, against the global (unsharded) computation in one process.

Every comparison is in float64, so a row-parallel sum in another order stays far inside the tolerance.
"""

from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

import colossalai_cmap as cm
from benchmarks import paths
from checks.gpu.core import F64, Ctx
from checks.gpu.report import compare
from colossalai_cmap import P, shard_map

K, M = 2, 3  # rows of each rank's block, and columns


def mesh(ctx: Ctx, shape: Tuple[int, ...], names: Tuple[str, ...]) -> Any:
    """A named DeviceMesh on this rank's device type (it makes its own process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)


def _values_and_grads(fn: Callable, inputs: List[torch.Tensor], seed: int) -> Tuple[Any, List[torch.Tensor]]:
    """``fn(*inputs)`` and the inputs' gradients of ``(out.sin() * W).sum()`` with a fixed W."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    W = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(out.device)
    (out.sin() * W).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _against(what: str, sharded: Callable, reference: Callable, inputs: List[torch.Tensor]) -> str:
    return compare(what, _values_and_grads(sharded, inputs, 0), _values_and_grads(reference, inputs, 0), **F64)


def matmul(ctx: Ctx, mesh1: Any) -> str:
    """``psum(a_block @ b_block, "i")`` over a contraction dim split over the mesh: values and gradients."""
    n = ctx.size
    a, b = ctx.data(6, 4 * n + 1, seed=1), ctx.data(4 * n + 1, 3, seed=2)
    f = shard_map(lambda x, y: cm.psum(x @ y, "i"), mesh1, (P(None, "i"), P("i", None)), P())
    out = f(a, b)
    if out.device != ctx.device:
        raise AssertionError(f"the output is on {out.device}, not on {ctx.device}")
    note = _against("matmul", f, torch.matmul, [a, b])
    return f"a (6, {4 * n + 1}) @ b over {n} ranks (uneven blocks) equals a @ b, gradients too ({note})"


def collectives(ctx: Ctx, mesh1: Any) -> str:
    """psum, all_gather, psum_scatter, all_to_all and ppermute over the mesh axis, against global references."""
    n = ctx.size
    x = ctx.data(n * K, M, seed=3)
    wide = ctx.data(n * K, n * M, seed=4)
    ring = [(i, (i + 1) % n) for i in range(n)]
    cases = [
        ("psum", lambda b: cm.psum(b, "i"), P("i"), P(), lambda t: t.reshape(n, K, M).sum(0), x),
        ("all_gather", lambda b: cm.all_gather(b, "i", tiled=True, to="invarying"), P("i"), P(), lambda t: t * 1, x),
        ("psum_scatter", lambda b: cm.psum_scatter(b, "i", tiled=True), P(), P("i"), lambda t: t * n, x),
        ("all_to_all", lambda b: cm.all_to_all(b, "i", 1, 0, tiled=True), P("i"), P(None, "i"), lambda t: t * 1, wide),
        ("ppermute", lambda b: cm.ppermute(b, "i", ring), P("i"), P("i"), lambda t: torch.roll(t, K, 0), x),
    ]
    notes = []
    for name, f, spec_in, spec_out, reference, value in cases:
        notes.append(f"{name} {_against(name, shard_map(f, mesh1, spec_in, spec_out), reference, [value])}")
    return "values and gradients equal the global references: " + ", ".join(notes)


def two_d(ctx: Ctx) -> str:
    """jax's first shard_map example on a (2, P/2) mesh: ``psum(a_block @ b_block, "y")``."""
    mesh2 = mesh(ctx, (2, ctx.size // 2), ("x", "y"))
    a, b = ctx.data(8, 16, seed=5), ctx.data(16, 4, seed=6)
    f = shard_map(lambda x, y: cm.psum(x @ y, "y"), mesh2, (P("x", "y"), P("y", None)), P("x", None))
    note = _against("matmul_basic", f, torch.matmul, [a, b])
    return f"matmul_basic on a (2, {ctx.size // 2}) mesh equals a @ b, gradients too ({note})"


def local_io(ctx: Ctx, mesh1: Any) -> str:
    """``local=True``: this rank's block in, its block out, no cutting or assembly."""
    mine = torch.full((2,), float(ctx.rank), device=ctx.device)
    out = shard_map(lambda b: cm.psum(b, "i"), mesh1, P("i"), P("i"), local=True)(mine)
    compare("local psum", out, torch.full((2,), float(sum(range(ctx.size))), device=ctx.device), exact=True)
    return "psum of per-rank blocks stays a block"


def failure(ctx: Ctx, mesh1: Any) -> str:
    """A ValueError in f on the last rank, while the others wait in a psum: CmapError on every rank."""
    last = ctx.size - 1

    def fails_on_last(block: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == last:
            raise ValueError("injected failure")
        return cm.psum(block, "i")

    try:
        shard_map(fails_on_last, mesh1, P("i"), P())(torch.ones(ctx.size, device=ctx.device))
    except cm.CmapError as exc:
        if not isinstance(exc, ValueError) or "raised ValueError: injected failure" not in str(exc):
            raise AssertionError(f"the CmapError does not carry rank {last}'s ValueError: {exc}") from exc
    else:
        raise AssertionError(f"no CmapError on rank {ctx.rank}")
    local_io(ctx, mesh1)  # the mesh's groups are in step after the failure
    return f"rank {last}'s ValueError arrives as CmapError on every rank; the mesh still works"


# ------------------------------------------------------------------------------------------------ shard_model
def llama(ctx: Ctx, seed: int = 0) -> nn.Module:
    """A small float64 Llama with 2 heads per rank (whole heads per rank at any world size); no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 2 * ctx.size
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=16 * heads,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)  # the same weights on every rank
    return LlamaForCausalLM(config).to(torch.float64).to(ctx.device)


def shard_model(ctx: Ctx) -> str:
    """Logits, loss, every gradient, an AdamW step and ``full_state_dict`` against the unsharded model."""
    example = paths.load_example("tensor_parallel_llama")  # its PLAN, and its gradient check by slices
    full, sharded = llama(ctx), cm.shard_model(llama(ctx), plan=example.PLAN)
    ids = example.token_ids(1).to(ctx.device)
    out_full, out_sharded = full(input_ids=ids, labels=ids), sharded(input_ids=ids, labels=ids)
    compare("logits", out_sharded.logits, out_full.logits, **F64)
    with cm.record_collectives() as backward:
        out_sharded.loss.backward()
    out_full.loss.backward()
    example.check_gradients(sharded, full)
    for model in (full, sharded):
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    ids = example.token_ids(2).to(ctx.device)
    compare("loss after a step", sharded(input_ids=ids, labels=ids).loss, full(input_ids=ids, labels=ids).loss, **F64)
    state, want = cm.full_state_dict(sharded), full.state_dict()
    compare("full_state_dict", dict(state), dict(want), **F64)
    heads = 2 * ctx.size
    return (
        f"a Llama ({heads} heads) at TP {ctx.size}: logits, loss, gradients, an AdamW step and full_state_dict equal "
        f"the unsharded model's; backward made {backward.count} collectives"
    )


def run(ctx: Ctx) -> None:
    """Every shard_map and shard_model check, in order."""
    rep = ctx.rep
    mesh1 = mesh(ctx, (ctx.size,), ("i",))
    rep.check("shard_map", "matmul with psum", lambda: matmul(ctx, mesh1))
    rep.check("shard_map", "collectives over the mesh axis", lambda: collectives(ctx, mesh1))
    rep.check("shard_map", "local=True", lambda: local_io(ctx, mesh1))
    rep.check("shard_map", "one rank fails -> CmapError on every rank", lambda: failure(ctx, mesh1))
    if ctx.size >= 4 and ctx.size % 2 == 0:
        rep.check("shard_map", "2-D mesh (x, y)", lambda: two_d(ctx))
    else:
        rep.skip("shard_map", "2-D mesh (x, y)", f"needs an even world of 4+ ranks; this world has {ctx.size}")
    rep.check("shard_model", "tensor-parallel Llama", lambda: shard_model(ctx))
