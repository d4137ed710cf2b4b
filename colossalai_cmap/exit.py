"""A call's exit: one status round that also carries small outputs, the gather for ``dst``, and in-place updates.

Batched outputs join as rows (every rank's, in group-rank order); ``out_dims=None`` outputs are the same on every
rank and stay where they are (their gradient goes back through one rank only). With ``dst="local"`` nothing moves,
but the round still runs: a failure anywhere must reach every rank.
"""

import zlib
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten

from . import comm
from .checks import check_table
from .entry import Inputs
from .errors import CmapError
from .exchange import Exit, JoinSpec, join, join_failed
from .layout import BATCHED, replicated_checksums
from .options import Options
from .plan import CallPlan
from .primitives import joined
from .protocol import Header, Kind, Link, Round, Status
from .rank import Failed, Outputs
from .roles import KEEP, SAME, Rows
from .specs import unflatten


class ExitCheck:
    """Runs :func:`check_table` on every rank once the round is in, and keeps the table for what follows."""

    def __init__(self, opts: Options, out: Outputs, link: Link) -> None:
        self.opts, self.out, self.link = opts, out, link
        self.table: Sequence[Header] = ()

    def __call__(self, rnd: Round) -> None:
        self.table = rnd.table
        check_table(self.opts, rnd.table, self._explain)

    def _explain(self) -> Any:
        out, link = self.out, self.link
        mine = () if out.empty else replicated_checksums(out.flat, out.layout)
        return comm.all_gather_object(mine, link.group, link.call, link.timeout, link.device)


def finish(opts: Options, plan: CallPlan, result: Any, inputs: Inputs, link: Link) -> Any:
    """The exit on this rank; returns the call's result (None off ``dst``), or raises what every rank raises."""
    if isinstance(result, Failed):
        join_failed(JoinSpec(link, (), kind=Kind.STATUS), result.failure, result.cause)
    out: Outputs = result
    tensors = out.layout.tensors
    check = ExitCheck(opts, out, link)
    spec = JoinSpec(
        link,
        _roles(opts, plan, out, tensors),
        "the outputs",
        Kind.STATUS,
        _dst(opts),
        _exit(opts, plan, out, inputs, check),
    )
    values = [out.flat[i] for i in tensors]
    got = join(spec, values) if isinstance(opts.dst, int) and opts.dst != -1 else joined(spec, values)
    mask = 0
    for h in check.table:
        mask |= h.flags
    if mask:
        _write_back(opts, plan, inputs, mask, link)
    if opts.dst not in (-1, "local", link.group.rank):
        return None
    flat = list(out.flat)
    for i, value in zip(tensors, got):
        flat[i] = value
    return unflatten(flat, out.spec)


def _roles(opts: Options, plan: CallPlan, out: Outputs, tensors: Sequence[int]) -> tuple:
    if opts.dst == "local":
        return (KEEP,) * len(tensors)
    cache = out.layout.__dict__.setdefault("_exit_roles", {})  # a repeated call's roles, kept with its layout
    found = cache.get(plan.sizes)
    if found is None:
        leaves = out.layout.leaves
        found = cache[plan.sizes] = tuple(
            Rows(leaves[i].out_dim, plan.sizes) if leaves[i].kind == BATCHED else SAME for i in tensors
        )
    return found


def _dst(opts: Options) -> int:
    return opts.dst if isinstance(opts.dst, int) else -1


def _exit(opts: Options, plan: CallPlan, out: Outputs, inputs: Inputs, check: ExitCheck) -> Exit:
    input_sig, values = plan.input_sig, 0
    if opts.check_inputs:  # value checks: the inputs' bytes, and the out_dims=None outputs' bytes
        leaves = inputs.leaves if opts.src is None else [v for v, d in zip(inputs.leaves, plan.dims) if d is None]
        input_sig = zlib.crc32(_content(leaves + tree_flatten(inputs.kwargs)[0]), input_sig) or 1
        if not out.empty:
            values = zlib.crc32(repr(replicated_checksums(out.flat, out.layout)).encode()) or 1
    status = Status.EMPTY if out.empty else Status.OK
    early = opts.axis_name is None  # no collective inside func that a peer could still be waiting in
    return Exit(status, input_sig, out.layout.digest, plan.batch, out.graph_sig, out.mutated, values, early, check)


def _content(leaves: Sequence[Any]) -> bytes:
    chunks = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().contiguous().cpu().reshape(-1)
            chunks.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return b"".join(chunks)


def _write_back(opts: Options, plan: CallPlan, inputs: Inputs, mask: int, link: Link) -> None:
    """func changed mapped inputs in place: every rank's copy gets every rank's rows, as vmap's would."""
    if opts.src is not None:
        raise CmapError(
            f"{opts.call}: func changed a mapped input in place, but with src={opts.src!r} the inputs it saw were "
            f"scattered copies, so the caller's tensor was not changed. Use src=None to change it in place, or "
            f"return the new values."
        )
    picked = [i for k, i in enumerate(plan.mapped) if mask >> k & 1]
    roles = tuple(Rows(plan.dims[i], plan.sizes) for i in picked)
    rows = [inputs.leaves[i].narrow(plan.dims[i], plan.offset, plan.rows) for i in picked]
    with torch.no_grad():
        full = join(JoinSpec(link, roles, "the in-place changes of mapped inputs"), rows)
        for i, value in zip(picked, full):
            inputs.leaves[i].copy_(value)
