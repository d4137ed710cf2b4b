"""A ``shard_map`` call's exit: an exception on one rank is a ``CmapError`` on every rank of the mesh.

While ``f`` runs, a rank may wait in a collective over one mesh axis, so its peers along that axis are the ones
who must tell it. The exit is therefore a status round on each axis's group, in mesh order, then one on the whole
mesh's group (an axis whose group is the whole mesh's has only that one). A rank that failed posts its failure in
every round; a peer waiting in a collective on that axis sees it, gives the collective up, and comes to the exit
too. Every rank goes through the same rounds in the same order, and the last one, over the whole mesh, tells every
rank every failure; it also carries every rank's output block lengths, which assembling the outputs needs (they
may be uneven), so they cost no round of their own. Where the whole assembly is one gather over the whole mesh's
group (one output, split over a one-axis mesh, with rounds on the data's own group), the exit carries that output
itself: its rows are the lengths, and a repeated call costs the exit round alone (:class:`Carried`).
"""

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..engine.exit import agreed, differing, graphs_differ, outputs_differ, raise_failed
from ..engine.records import Failed
from ..errors import CmapError
from ..torch_internals import outside_transforms
from ..wire import rounds
from ..wire.exchange import Exit, JoinSpec, Learned, join, join_values
from ..wire.link import Link
from ..wire.roles import Rows
from ..wire.rounds import Disagreement, Header, Kind, Status
from .mesh import MeshView


@dataclass
class Outcome:
    """What this rank brings to the exit: its :class:`~colossalai_cmap.engine.records.Failed` (or None), a digest of its outputs' structure and of the
    closure edges its graph holds, and its outputs' block lengths (:func:`~colossalai_cmap.shard.blocks.block_lengths`).
    """

    failed: Optional[Failed]
    layout_sig: int = 0
    graph_sig: int = 0
    lengths: Optional[torch.Tensor] = None
    layout: Tuple[Any, ...] = ()  # what layout_sig digests: each output leaf's path, spec, and dtype and dims or type


class Carried(NamedTuple):
    """The one output the exit gathers itself, and the dim its blocks are split along."""

    value: torch.Tensor
    dim: int


class Concluded(NamedTuple):
    """What the exit gives every rank: every rank's block lengths (rows in the whole mesh's group-rank order; empty
    when nothing is split), and the carried output gathered (None: nothing carried)."""

    table: List[List[int]]
    gathered: Optional[torch.Tensor] = None


def conclude(
    call: str,
    view: MeshView,
    links: Dict[str, Link],
    whole: Link,
    outcome: Outcome,
    carried: Optional[Carried] = None,
) -> Concluded:
    """Every round of the exit, or the same ``CmapError`` on every rank. With ``carried``, the exit's round gathers
    that output too (differentiably: its backward is the cut of each rank's rows)."""
    failed = outcome.failed
    for name in view.names:
        link = links[name]
        if link.group.pg is whole.group.pg:
            continue
        status = Status.FAILED if failed is not None else Status.OK
        rounds.status_round(link, Header(kind=Kind.STATUS, status=status, inline=1))
    if failed is not None:
        raise_failed(whole, failed)
    exit_ = Exit(
        status=Status.OK,
        input_sig=0,
        layout_sig=outcome.layout_sig,
        batch=0,
        graph_sig=outcome.graph_sig,
        flags=0,
        values=0,
        agree=("digest", "graph_sig"),
    )
    lengths = [] if outcome.lengths is None else [outcome.lengths]
    roles = (Rows(0, (1,) * whole.group.size),) * len(lengths)
    spec = JoinSpec(whole, roles, "the outputs", Kind.STATUS, exit=exit_, host_metadata=True)

    def lengths_of_every_rank() -> Concluded:
        with outside_transforms():  # the lengths are plain ints, whatever transform is around the call
            got = join_values(spec, lengths)
            return Concluded(got[0].tolist() if got else [])

    def gathered_output() -> Concluded:  # the rows each rank sends are its block's length along the split dim
        learned = Learned()
        rows = Rows(carried.dim, None)
        got = join(JoinSpec(whole, (rows,), "the outputs", Kind.STATUS, exit=exit_, learned=learned), [carried.value])
        return Concluded([[h.rows] for h in learned.table], got[0])

    # on the error path every rank sends its outputs' layout (one collective): every rank read the same table
    run = lengths_of_every_rank if carried is None else gathered_output
    return agreed(run, whole, {"digest": lambda: outcome.layout}, functools.partial(_explain, call))


class Shown(NamedTuple):
    """One output leaf as a rank returned it, for the error that says how ranks' outputs differ: its path, the words
    for it, and what every rank's must equal (its spec, and a tensor's dtype and dims, or another leaf's type)."""

    path: str
    shown: str
    key: Tuple[Any, ...]


def _explain(call: str, found: Disagreement, layouts: Optional[List[Tuple[Any, ...]]]) -> CmapError:
    if found.field == "graph_sig":
        return graphs_differ(call, found.table, "f")
    if layouts:
        seen = [[Shown(path, _leaf(*rest), tuple(rest)) for path, *rest in mine] for mine in layouts]
        detail = outputs_differ(seen, differing(seen))
    else:
        detail = f"digests {[h.digest for h in found.table]}"
    return CmapError(
        f"{call}: f returned outputs of different structures, dtypes or ranks on different ranks ({detail}); every "
        f"rank must return the same structure."
    )


def _leaf(spec: Tuple[Any, ...], kind: Any) -> str:
    what = f"{str(kind[0]).replace('torch.', '')} {kind[1]}-d" if isinstance(kind, tuple) else kind
    return f"{what}, out_specs P({', '.join(map(repr, spec))})"
