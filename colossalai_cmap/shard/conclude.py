"""A ``shard_map`` call's exit: an exception on one rank is a ``CmapError`` on every rank of the mesh.

While ``f`` runs, a rank may wait in a collective over one mesh axis, so its peers along that axis are the ones
who must tell it. The exit is therefore a status round on each axis's group, in mesh order, then one on the whole
mesh's group (an axis whose group is the whole mesh's has only that one). A rank that failed posts its failure in
every round; a peer waiting in a collective on that axis sees it, gives the collective up, and comes to the exit
too. Every rank goes through the same rounds in the same order, and the last one, over the whole mesh, tells every
rank every failure; it also carries every rank's output block lengths, which assembling the outputs needs (they
may be uneven), so they cost no round of their own.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..call.records import Failed
from ..errors import CmapError, by_rank, output_name
from ..torch_internals import outside_transforms
from ..wire import rounds
from ..wire.exchange import Exit, JoinSpec, join_values, report_failure
from ..wire.link import Link
from ..wire.roles import Rows
from ..wire.rounds import Disagreement, Header, Kind, Status
from .mesh import MeshView


@dataclass
class Outcome:
    """What this rank brings to the exit: its :class:`~colossalai_cmap.call.records.Failed` (or None), a digest of its outputs' structure and of the
    closure edges its graph holds, and its outputs' block lengths (:func:`~colossalai_cmap.shard.blocks.block_lengths`).
    """

    failed: Optional[Failed]
    layout_sig: int = 0
    graph_sig: int = 0
    lengths: Optional[torch.Tensor] = None
    layout: Tuple[Any, ...] = ()  # what layout_sig digests: each output leaf's path, spec, and dtype and dims or type


def conclude(call: str, view: MeshView, links: Dict[str, Link], whole: Link, outcome: Outcome) -> List[List[int]]:
    """Every round of the exit; returns every rank's block lengths (rows in the whole mesh's group-rank order; empty
    when nothing is split) on every rank, or raises the same ``CmapError`` on every rank."""
    failed = outcome.failed
    for name in view.names:
        link = links[name]
        if link.group.pg is whole.group.pg:
            continue
        status = Status.FAILED if failed is not None else Status.OK
        rounds.status_round(link, Header(kind=Kind.STATUS, status=status, inline=1))
    if failed is not None:
        report_failure(JoinSpec(whole, (), kind=Kind.STATUS), failed.failure, failed.cause)
    exit_ = Exit(Status.OK, 0, outcome.layout_sig, 0, outcome.graph_sig, 0, 0, False, ("digest", "graph_sig"))
    lengths = [] if outcome.lengths is None else [outcome.lengths]
    roles = (Rows(0, (1,) * whole.group.size),) * len(lengths)
    try:
        with outside_transforms():  # the lengths are plain ints, whatever transform is around the call
            got = join_values(JoinSpec(whole, roles, "the outputs", Kind.STATUS, exit=exit_, host=True), lengths)
            return got[0].tolist() if got else []
    except Disagreement as found:
        # every rank read the same table: on this error path, every rank sends its outputs' layout (one collective)
        layouts = rounds.gather_objects(whole, outcome.layout) if found.field == "digest" else None
        raise CmapError(_explain(call, found, layouts)) from None


def _explain(call: str, found: Disagreement, layouts: Optional[List[Tuple[Any, ...]]]) -> str:
    if found.field == "graph_sig":
        return (
            f"{call}: the ranks' autograd graphs reach tensors made outside f in different ways; every rank must "
            f"run the same program on its blocks."
        )
    detail = _differ(layouts) if layouts else f"digests {[h.digest for h in found.table]}"
    return (
        f"{call}: f returned outputs of different structures, dtypes or ranks on different ranks ({detail}); every "
        f"rank must return the same structure."
    )


def _differ(layouts: List[Tuple[Any, ...]]) -> str:
    """Each output leaf whose ranks disagree, with what each returned; every rank's outputs where the paths differ."""
    if len({tuple(leaf[0] for leaf in mine) for mine in layouts}) > 1:
        return by_rank(
            [", ".join(f"{output_name(path)} {_leaf(*rest)}" for path, *rest in mine) for mine in layouts], "; "
        )
    differ = [i for i in range(len(layouts[0])) if len({mine[i] for mine in layouts}) > 1]
    return "; ".join(
        f"{output_name(layouts[0][i][0])}: " + by_rank([_leaf(*m[i][1:]) for m in layouts]) for i in differ
    )


def _leaf(spec: Tuple[Any, ...], kind: Any) -> str:
    what = f"{str(kind[0]).replace('torch.', '')} {kind[1]}-d" if isinstance(kind, tuple) else kind
    return f"{what}, out_specs P({', '.join(map(repr, spec))})"
