"""A ``shard_map`` call's exit: an exception on one rank is a ``CmapError`` on every rank of the mesh.

While ``f`` runs, a rank may wait in a collective over one mesh axis, so its peers along that axis are the ones
who must tell it. The exit is therefore a status round on each axis's group, in mesh order, then one on the whole
mesh's group (an axis whose group is the whole mesh's has only that one). A rank that failed posts its failure in
every round; a peer waiting in a collective on that axis sees it, gives the collective up, and comes to the exit
too. Every rank goes through the same rounds in the same order, and the last one, over the whole mesh, tells every
rank every failure; it also carries every rank's output block lengths, which assembling the outputs needs (they
may be uneven), so they cost no round of their own. With ``check_rep`` the axis rounds also compare the checksums
of the outputs declared replicated over that axis.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CmapError
from ..wire import protocol
from ..wire.exchange import Exit, JoinSpec, join_values, report_failure
from ..wire.protocol import Disagreement, Header, Kind, Link, Status
from ..wire.roles import Rows
from .mesh import MeshView


@dataclass
class Outcome:
    """What this rank brings to the exit: its failure (or None), a digest of its outputs' structure and of the
    closure edges its graph holds, per axis the checksum of the outputs declared replicated over it (and their
    paths), and its outputs' block lengths (:func:`~colossalai_cmap.shard.blocks.block_lengths`)."""

    failure: Optional[Tuple[object, BaseException]]
    layout_sig: int = 0
    graph_sig: int = 0
    checksums: Dict[str, int] = field(default_factory=dict)
    replicated: Dict[str, Sequence[str]] = field(default_factory=dict)
    lengths: Optional[torch.Tensor] = None


def conclude(call: str, view: MeshView, links: Dict[str, Link], whole: Link, outcome: Outcome) -> List[List[int]]:
    """Every round of the exit; returns every rank's block lengths (rows in the whole mesh's group-rank order; empty
    when nothing is split) on every rank, or raises the same ``CmapError`` on every rank."""
    failure = outcome.failure
    for name in view.names:
        link = links[name]
        if link.group.pg is whole.group.pg:
            continue
        status = Status.FAILED if failure is not None else Status.OK
        rnd = protocol.status_round(link, Header(Kind.STATUS, status, inline=1, values=outcome.checksums.get(name, 0)))
        if failure is None and not rnd.failed and name in outcome.checksums and _differ(rnd.table):
            exc = ValueError(_not_replicated(call, name, outcome.replicated[name]))
            failure = (whole.group.failure(exc), exc)
    if failure is not None:
        report_failure(JoinSpec(whole, (), kind=Kind.STATUS), *failure)
    last = next((n for n in view.names if links[n].group.pg is whole.group.pg), None)
    values = outcome.checksums.get(last, 0) if last is not None else 0
    agree = ("digest", "graph_sig") + (("values",) if values else ())
    exit_ = Exit(Status.OK, 0, outcome.layout_sig, 0, outcome.graph_sig, 0, values, False, agree)
    lengths = [] if outcome.lengths is None else [outcome.lengths]
    roles = (Rows(0, (1,) * whole.group.size),) * len(lengths)
    try:
        with torch._C._DisableFuncTorch():  # the lengths are plain ints, whatever transform is around the call
            got = join_values(JoinSpec(whole, roles, "the outputs", Kind.STATUS, exit=exit_, host=True), lengths)
            return got[0].tolist() if got else []
    except Disagreement as found:
        raise CmapError(_explain(call, found, last, outcome)) from None


def _differ(table: Sequence[Header]) -> bool:
    return len({h.values for h in table}) > 1


def _not_replicated(call: str, axis: str, paths: Sequence[str]) -> str:
    return (
        f"{call}: out_specs{', out_specs'.join(paths)} imply that the corresponding output values are replicated "
        f"across mesh axis {axis!r}, but they differ across it (check_rep=True compared them). Check if these output "
        f"values are meant to be replicated over that mesh axis; if not, revise the corresponding out_specs entries."
    )


def _explain(call: str, found: Disagreement, last: Optional[str], outcome: Outcome) -> str:
    if found.field == "values" and last is not None:
        return _not_replicated(call, last, outcome.replicated[last])
    if found.field == "graph_sig":
        return (
            f"{call}: the ranks' autograd graphs reach tensors made outside f in different ways; every rank must "
            f"run the same program on its blocks."
        )
    return (
        f"{call}: f returned outputs of different structures, dtypes or ranks on different ranks (digests "
        f"{[h.digest for h in found.table]}); every rank must return the same structure."
    )
