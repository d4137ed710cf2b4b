"""A call's exit: one status round that also carries small outputs, the gather for ``dst``, and in-place updates.

Batched outputs join as rows (every rank's, in group-rank order); ``out_dims=None`` outputs are the same on every
rank and stay where they are, and their cotangent counts once (one rank's; with ``dst="local"``, the ranks' mean);
outputs that view the caller's inputs are those views (:mod:`views`), with no data. With ``dst="local"`` nothing
moves, but the round still runs: a failure anywhere must reach every rank.
"""

import functools
from typing import Any, Sequence, Tuple

import torch

from ..digests import digest
from ..engine.exit import agreed
from ..errors import CmapError
from ..torch_internals import tree_flatten
from ..wire import comm
from ..wire.exchange import Exit, JoinSpec, Learned, join, join_values
from ..wire.link import Link
from ..wire.roles import KEEP, ONCE, SAME, Rows
from ..wire.rounds import Kind, Status
from ..wire.traced import traced_join
from .checks import agreed_fields, explain
from .dims import flatten, flatten_out_dims, normalise_out_dim, unflatten
from .entry import needs_grad_traced
from .layout import BATCHED, replicated_checksums, seen_outputs
from .options import Options
from .records import Inputs, Outputs, Shares
from .views import place, signature


def conclude(opts: Options, shares: Shares, out: Outputs, inputs: Inputs, link: Link) -> Any:
    """The exit on this rank, after this rank's part returned ``out``; returns the call's result (None off ``dst``),
    or raises what every rank raises. (A failed part's exit is the engine's :func:`~colossalai_cmap.engine.exit.raise_failed`.)
    """
    if not link.wired:  # alone: nothing to agree on, move or write back, and this rank is every dst
        return unflatten(out.flat, out.spec)
    tensors, roles = out.layout.tensors, _roles(opts, shares, out, out.layout.tensors)
    if out.views:  # views of the caller's inputs: every rank holds them already
        viewed = {v.leaf for v in out.views}
        roles = tuple(r for i, r in zip(tensors, roles) if i not in viewed)
        tensors = tuple(i for i in tensors if i not in viewed)
    learned = Learned()
    exit_ = _exit(opts, shares, out, inputs)
    spec = JoinSpec(link, roles, "the outputs", Kind.STATUS, _dst(opts), exit_, learned=learned)
    details = {"values": lambda: _checksums(out), "digest": lambda: seen_outputs(out.flat, out.layout)}
    got = agreed(lambda: join(spec, [out.flat[i] for i in tensors]), link, details, functools.partial(explain, opts))
    mask = 0
    for h in learned.table:
        mask |= h.flags
    if mask:
        _write_back(opts, shares, inputs, mask, link)
    if opts.dst not in (-1, "local", link.group.rank):
        return None
    flat = list(out.flat)
    for i, value in zip(tensors, got):
        flat[i] = value
    place(out.views, inputs.leaves, flat)  # after the write-back, which they show
    return unflatten(flat, out.spec)


def _roles(opts: Options, shares: Shares, out: Outputs, tensors: Sequence[int]) -> tuple:
    """Batched outputs: rows, gathered (or kept, with ``dst="local"``). ``out_dims=None`` outputs: one value, equal
    on every rank, whose cotangent counts once: on rank 0 only (``SAME``), or with ``dst="local"``, where every rank
    backpropagates its own, each rank's over P (``ONCE``)."""
    local = opts.dst == "local"
    cache = out.layout.__dict__.setdefault("_exit_roles", {})  # a repeated call's roles, kept with its layout
    key = "local" if local else shares.sizes
    found = cache.get(key)
    if found is None:
        leaves = out.layout.leaves
        batched = [leaves[i].kind == BATCHED for i in tensors]
        if local:
            found = tuple(KEEP if b else ONCE for b in batched)
        else:
            found = tuple(Rows(leaves[i].out_dim, shares.sizes) if b else SAME for i, b in zip(tensors, batched))
        cache[key] = found
    return found


def _dst(opts: Options) -> int:
    return opts.dst if isinstance(opts.dst, int) else -1


def _checksums(out: Outputs) -> Any:
    """This rank's out_dims=None checksums, which every rank sends on the error path of check_inputs."""
    return () if out.empty else replicated_checksums(out.flat, out.layout)


def _exit(opts: Options, shares: Shares, out: Outputs, inputs: Inputs) -> Exit:
    input_sig, values = shares.input_sig, 0
    if opts.check_inputs:  # value checks: the inputs' bytes, and the out_dims=None outputs' bytes
        leaves = inputs.leaves if opts.src is None else [v for v, d in zip(inputs.leaves, shares.dims) if d is None]
        input_sig = comm.checksum(leaves + tree_flatten(inputs.kwargs)[0], input_sig) or 1
        if not out.empty:
            values = digest(replicated_checksums(out.flat, out.layout))
    status = Status.EMPTY if out.empty else Status.OK
    agree, agree_nonempty = agreed_fields(opts)
    return Exit(
        status=status,
        input_sig=input_sig,
        layout_sig=signature(out.layout.digest, out.views),
        batch=shares.batch,
        graph_sig=out.graph_sig,
        flags=out.mutated,
        values=values,
        agree=agree,
        agree_nonempty=agree_nonempty,
    )


def _write_back(opts: Options, shares: Shares, inputs: Inputs, mask: int, link: Link) -> None:
    """func changed mapped inputs in place: every rank's copy gets every rank's rows, as vmap's would."""
    if opts.src is not None:
        raise CmapError(
            f"{opts.call}: func changed a mapped input in place, but with src={opts.src!r} the inputs it saw were "
            f"scattered copies, so the caller's tensor was not changed. Use src=None to change it in place, or "
            f"return the new values."
        )
    picked = [i for k, i in enumerate(shares.mapped) if mask >> k & 1]
    roles = tuple(Rows(shares.dims[i], shares.sizes) for i in picked)
    rows = [inputs.leaves[i].narrow(shares.dims[i], shares.offset, shares.rows) for i in picked]
    with torch.no_grad():
        full = join_values(JoinSpec(link, roles, "the in-place changes of mapped inputs"), rows)
        for i, value in zip(picked, full):
            inputs.leaves[i].copy_(value)


# ---- traced: the exit inside torch.compile


def conclude_traced(opts: Options, out: Any, sizes: Tuple[int, ...], pg: Any, rank: int) -> Any:
    """:func:`conclude` inside ``torch.compile``, with no round. The result on this rank: batched outputs cut to this
    rank's rows (a stand-in's cut off), then all-gathered along their out-dim (``dst=-1``) or kept (``dst="local"``);
    an ``out_dims=None`` output passes a ``SAME`` Join (``dst=-1``: its backward gives its gradient to one rank only)
    or a ``ONCE`` Join (``dst="local"``: each rank its cotangent over P), so that the sum over ranks counts it once."""
    flat, spec = flatten(out)
    dims = flatten_out_dims(opts.call, opts.out_dims, spec, len(flat))
    mine = sizes[rank]
    result = []
    for i, (v, d) in enumerate(zip(flat, dims)):
        if not isinstance(v, torch.Tensor):
            result.append(v)
            continue
        if d is not None:
            d = normalise_out_dim(opts.call, d, v.dim() - 1, i)
            v = v.narrow(d, 0, mine) if v.shape[d] != mine else v
        if pg is None or (opts.dst == "local" and d is not None):  # nothing moves: every rank keeps its own
            result.append(v)
        elif d is not None:
            result.append(traced_join(v, Rows(d, sizes), pg, rank))
        elif torch.is_grad_enabled() and needs_grad_traced(v):
            result.append(traced_join(v, ONCE if opts.dst == "local" else SAME, pg, rank))
        else:
            result.append(v)
    return unflatten(result, spec)
