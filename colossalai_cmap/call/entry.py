"""A call's entry: this rank's share of the arguments, and the one ``Split`` that tensors needing a gradient pass.

Mapped inputs are cut with ``narrow`` (views, no copy). With ``dst=-1``, every tensor that requires grad enters
through one ``Split`` tagged with the call, whose backward is one ``Join`` for all of them: the rows of mapped
inputs are gathered, the gradients of unmapped inputs, keyword tensors and the parameters of the modules func uses
(``engine.module_params``) are summed over the group. The tag is where the closure walk (``engine.closures``) stops.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ..engine import module_params
from ..nesting import gradients_tracked
from ..torch_internals import tree_flatten, tree_unflatten
from ..wire.exchange import SplitSpec, requires_grad, split
from ..wire.link import Link
from ..wire.roles import COPY, KEEP, Role, Rows, first_row
from ..wire.traced import traced_split
from .dims import flatten, unflatten
from .options import Options
from .records import Inputs, Shares


class Entered(NamedTuple):
    """This rank's leaves and kwargs, and the modules to run with their parameters replaced by ``aliases``."""

    leaves: List[Any]
    kwargs: Dict[str, Any]
    modules: List[nn.Module]
    aliases: Dict[int, torch.Tensor]  # id of a parameter -> its value through the entry


def enter(
    opts: Options, refs: module_params.References, shares: Shares, inputs: Inputs, link: Link, tag: object
) -> Entered:
    leaves, kwargs, modules, aliases = list(inputs.leaves), inputs.kwargs, [], {}
    if (
        link.wired and opts.differentiable and gradients_tracked()
    ):  # alone, gradients cross no rank: func's graph is vmap's
        kw_leaves, kw_spec = tree_flatten(kwargs) if kwargs else ([], None)
        modules = module_params.modules_of(refs) if refs else []
        params = module_params.trainable(modules) if modules else []
        picked = [(leaves, i, _role(opts, shares, i)) for i, v in enumerate(leaves) if requires_grad(v)]
        picked += [(kw_leaves, j, COPY) for j, v in enumerate(kw_leaves) if requires_grad(v)]
        if picked or params:
            spec = SplitSpec(link, tuple(role for _, _, role in picked) + (COPY,) * len(params), tag)
            entered = split(spec, [where[i] for where, i, _ in picked] + params)
            for (where, i, _), t in zip(picked, entered):
                where[i] = t
            aliases = {id(p): t for p, t in zip(params, entered[len(picked) :])}
            if kw_spec is not None:
                kwargs = tree_unflatten(kw_leaves, kw_spec)
    if opts.src is None and link.wired:  # alone, this rank's rows are the caller's tensors
        for i in shares.mapped:
            if leaves[i] is inputs.leaves[i]:  # not cut by the entry
                leaves[i] = leaves[i].narrow(shares.dims[i], shares.offset, shares.rows)
    return Entered(leaves, kwargs, modules if aliases else [], aliases)


def _role(opts: Options, shares: Shares, i: int) -> Role:
    d = shares.dims[i]
    if d is None:
        return COPY
    return Rows(d, shares.sizes) if opts.src is None else KEEP


def first_example(leaf: torch.Tensor, dim: int) -> torch.Tensor:
    """The global first example, detached: the stand-in of an empty share (eagerly and traced)."""
    return leaf.narrow(dim, 0, 1).detach().clone()


# ---- traced: the entry inside torch.compile


def needs_grad_traced(v: Any) -> bool:
    # a compiled call sees plain tensors: no functorch wrapper to look under (dynamo traces no such look)
    return isinstance(v, torch.Tensor) and v.requires_grad


def enter_traced(
    leaves: Sequence[Any], dims: Sequence[Optional[int]], sizes: Tuple[int, ...], pg: Any, rank: int
) -> List[Any]:
    """:func:`enter` inside ``torch.compile``: this rank's share of the flat arguments. With ``pg`` (gradients
    crossing ranks), tensors that require grad pass a traced Split: mapped rows (their gradient rows all-gathered in
    backward), others whole (summed)."""
    out = []
    for v, d in zip(leaves, dims):
        if d is not None and pg is not None and needs_grad_traced(v):
            out.append(traced_split(v, Rows(d, sizes), pg, rank))
        elif d is not None:
            out.append(v.narrow(d, first_row(sizes, rank), sizes[rank]))
        elif pg is not None and needs_grad_traced(v):
            out.append(traced_split(v, COPY, pg, rank))
        else:
            out.append(v)
    return out


def enter_kwargs_traced(kwargs: Dict[str, Any], pg: Any, rank: int) -> Dict[str, Any]:
    """Keyword tensors are not mapped: those that require grad get their gradient summed over the ranks."""
    if not kwargs or pg is None:
        return kwargs
    leaves, spec = flatten(kwargs)
    return unflatten([traced_split(v, COPY, pg, rank) if needs_grad_traced(v) else v for v in leaves], spec)
