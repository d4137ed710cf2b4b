"""A ``shard_map`` call's exit: an exception on one rank is a ``CmapError`` on every rank of the mesh.

While ``f`` runs, a rank may wait in a collective over one mesh axis, so its peers along that axis are the ones who must
tell it. Once a call on the mesh has taken a round on part of it inside ``f`` (announced on the whole mesh,
:func:`~colossalai_cmap.wire.rounds.within_mesh`, so every rank knows), the exit is therefore a status round on each
axis's group (and on each group of several axes ``f`` took a round on, on a mesh of three or more) and one on the
whole mesh's group, all in flight together; until then, and on a mesh of one axis, it is the
whole mesh's round alone. A rank that failed posts its failure in every round; a peer waiting in a collective on that
axis sees it, gives the collective up, and comes to the exit too. Every rank goes through the same rounds in the same
order, and the last one, over the whole mesh, tells every rank every failure; it also carries every rank's output block
lengths, which assembling the outputs needs (they may be uneven), so they cost no round of their own. Where every
output's assembly is one gather over the whole mesh's group (each split along one dim over every mesh axis, in the
group's rank order; split over every axis otherwise, as tiles sent as one flat run per rank; replicated over them all;
or, on a mesh of two axes, split over one and equal along the other, sent by the ranks at coordinate 0 of the other),
the exit carries those outputs itself: their rows are the lengths, and a repeated call on a one-axis mesh costs the exit
round alone (:class:`Carried`); on a host plane, the round and the gather of the data, sent right behind the round once
a call repeats the lengths the group's last such exit agreed (kept alike on every rank in
:attr:`~colossalai_cmap.wire.group.GroupState.exits`). A round carries one row count per rank, so a rank whose carried
outputs have blocks of different lengths sends none and says so in its header; every rank then sends its lengths in a
second round and assembles as it would have. A rank whose blocks have another length than the one kept sends none
either, and says so: every rank then carries the outputs again, the round telling the lengths. Tiles of other shapes on
some rank (the header's ``values`` digests them) fall back as blocks of different lengths do.
"""

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..digests import digest
from ..engine.exit import agreed, differing, graphs_differ, outputs_differ, raise_failed
from ..engine.records import Failed
from ..errors import CmapError
from ..torch_internals import outside_transforms
from ..wire import rounds
from ..wire.exchange import Exit, JoinSpec, Learned, join, join_values
from ..wire.group import state_of
from ..wire.link import Link
from ..wire.roles import Role, Rows, is_rows
from ..wire.rounds import Disagreement, Kind, Status
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
    """The outputs the exit gathers itself: their positions among the flat outputs, their roles in the exit's Join
    over the whole mesh (``Rows`` with the row counts left to the round, or ``EVEN``), and their values."""

    leaves: Tuple[int, ...]
    roles: Tuple[Role, ...]
    values: Tuple[torch.Tensor, ...]
    tiles: Tuple[Any, ...]  # per output, its :class:`~.blocks.Tiles` (sent as one flat run), or None
    copies: Tuple[Any, ...] = ()  # per output, its :class:`~.blocks.Copies` (rows from coordinate 0 of one axis only)
    copied_rows: Tuple[int, ...] = ()  # per output with copies, this rank's block length along its split dim

    def shapes(self) -> int:
        """A digest of this rank's tiled blocks' shapes, or of its copied blocks' lengths (0: none): what must match
        across ranks (every rank's, or the copies' along their axis) for the round's rows to assemble the outputs."""
        shapes = tuple(t.block for t in self.tiles if t is not None) or self.copied_rows
        return digest(shapes) if shapes else 0

    def shapes_differ(self, shapes: List[int], view: MeshView) -> bool:
        """Whether every rank's :meth:`shapes` (in the whole mesh's group-rank order) fail to match: a tile of
        another shape, or a copy of another length than the one at coordinate 0 of its axis (which alone is sent)."""
        copies = next((c for c in self.copies if c is not None), None)
        return len(set(shapes)) > 1 if copies is None else copies.differ(shapes, view)

    def lengths(self) -> List[int]:
        """This rank's block length of each carried output split into rows."""
        return [v.shape[r.dim] for r, v in zip(self.roles, self.values) if is_rows(r)]


# A shard_map exit header's flags, when this rank sent no rows of its carried outputs: their blocks have different
# lengths (every rank then sends its lengths in a round, and assembles axis by axis), or another length than the one
# every rank kept (every rank then carries them again, the round telling the lengths).
UNEVEN_CARRIED, LENGTHS_CHANGED = 1, 2
# not sent: every rank reads it off the table, where tiles have other shapes or copies other lengths (the lengths
# round then tells every rank, and the assembly's check raises the same error on every rank)
SHAPES_DIFFER = 4
_UNEVEN_TILES: Tuple[int, ...] = ()  # kept for a layout whose tiles were uneven: its exits send lengths, until even


_KNOWN = ("batch",)  # checked first: ranks that took different lengths as known fall back, whatever else differs


class Concluded(NamedTuple):
    """What the exit gives every rank: every rank's block lengths (rows in the whole mesh's group-rank order; empty
    when nothing is split, or when the outputs were carried), and the carried outputs gathered (None: nothing
    carried)."""

    table: List[List[int]]
    gathered: Optional[Tuple[torch.Tensor, ...]] = None
    rows: Tuple[int, ...] = ()  # with ``gathered``: the rows each rank sent of its carried outputs, in group-rank order


def conclude(
    call: str,
    view: MeshView,
    links: Dict[str, Link],
    whole: Link,
    outcome: Outcome,
    carried: Optional[Carried] = None,
) -> Concluded:
    """Every round of the exit, or the same ``CmapError`` on every rank. With ``carried``, the exit's round gathers
    those outputs too (differentiably: the backward of each is the cut of each rank's rows), unless a rank's carried
    blocks differ in length: then a second round sends every rank's block lengths, and nothing comes back gathered."""
    # a peer may wait in a round on a part of the mesh f took one on (an axis's group, several axes', a nested call's);
    # on no other: the whole mesh's round tells every rank there
    along = rounds.parts_in_func(whole, [links[n] for n in view.names])
    if outcome.failed is not None:
        raise_failed(whole, outcome.failed, along=along)
    exit_ = Exit(
        status=Status.OK,
        input_sig=0,
        layout_sig=outcome.layout_sig,
        batch=0,
        graph_sig=outcome.graph_sig,
        flags=0,
        values=0,
        agree=("digest", "graph_sig"),
        along=along,  # with the whole mesh's round
    )
    # on the error path every rank sends its outputs' layout (one collective): every rank read the same table
    if carried is None:
        run = functools.partial(_lengths_of_every_rank, whole, exit_, outcome)
    else:
        run = functools.partial(_gathered_outputs, whole, view, exit_, outcome, carried)
    return agreed(run, whole, {"digest": lambda: outcome.layout}, functools.partial(_explain, call))


def _lengths_of_every_rank(whole: Link, exit_: Exit, outcome: Outcome) -> Concluded:
    """The exit's round over the whole mesh, carrying this rank's output block lengths: every rank's come back."""
    lengths = [] if outcome.lengths is None else [outcome.lengths]
    roles = (Rows(0, (1,) * whole.group.size),) * len(lengths)
    spec = JoinSpec(whole, roles, "the outputs", Kind.STATUS, exit=exit_, host_metadata=True)
    with outside_transforms():  # the lengths are plain ints, whatever transform is around the call
        got = join_values(spec, lengths)
        return Concluded(got[0].tolist() if got else [])


def _gathered_outputs(whole: Link, view: MeshView, exit_: Exit, outcome: Outcome, carried: Carried) -> Concluded:
    """The exit's round gathering the carried outputs, their row counts the ones the last such exit agreed where
    every rank kept them; once more with the round's own where a rank's changed; or, where a rank's carried blocks
    differ in length or its tiles have another shape than a peer's, every rank's lengths in a round of their own
    (nothing gathered). After uneven tiles the next exits of that layout send their lengths first, until the lengths
    show the tiles even again."""
    kept, key = state_of(whole.group.pg).exits, outcome.layout_sig  # not the call's name: ranks may differ there
    if kept.get(key) == _UNEVEN_TILES:  # the runs would be sent in vain: the lengths first, until the tiles are even
        concluded = _lengths_of_every_rank(whole, exit_, outcome)
        if len({tuple(lengths) for lengths in concluded.table}) == 1:  # the carried tile is the only split output
            kept.pop(key)
        return concluded
    got, mask, learned = _carry(whole, view, exit_, carried, kept.get(key))  # known lengths: the data need not wait
    exit_ = exit_._replace(along=())  # the axes' rounds went with the first
    if mask & LENGTHS_CHANGED and not mask & (UNEVEN_CARRIED | SHAPES_DIFFER):  # every rank read the table: again
        kept.pop(key, None)
        got, mask, learned = _carry(whole, view, exit_, carried, None)
    if mask:  # every rank read the same table: each sends its lengths, and assembles
        kept.pop(key, None)
        if mask & SHAPES_DIFFER and any(t is not None for t in carried.tiles):
            kept[key] = _UNEVEN_TILES
        return _lengths_of_every_rank(whole, exit_, outcome)
    rows = tuple(h.rows for h in learned.table)
    if carried.lengths():
        kept[key] = rows
    return Concluded([], got, rows)


def _carry(
    whole: Link, view: MeshView, exit_: Exit, carried: Carried, known: Optional[Tuple[int, ...]]
) -> Tuple[Optional[Tuple[torch.Tensor, ...]], int, Learned]:
    """One round carrying the outputs, their row counts ``known`` beforehand (None: the round tells them); the
    outputs gathered, or None where a rank sent no rows; every rank's flags together; and what the round told. The
    rows each rank sends are its blocks' length along their split dims."""
    learned, values, flags, roles, mine = Learned(), carried.values, 0, carried.roles, set(carried.lengths())
    if known is not None:
        roles = tuple(Rows(r.dim, known) if is_rows(r) else r for r in roles)
    if len(mine) > 1:
        flags = UNEVEN_CARRIED
    elif known is not None and mine and mine != {known[whole.group.rank]}:
        flags = LENGTHS_CHANGED
    if flags:  # one row count per rank, or not the one known: this rank sends none, and says why
        values = tuple(_no_rows(v, r) for v, r in zip(values, roles))
    # the exit's batch says which lengths this rank took as known: ranks that kept different ones find out after the
    # round, before any data moves, and carry again (not in the round's name, so the rounds learn its size)
    assumed = exit_._replace(flags=flags, batch=0 if known is None else digest(known), values=carried.shapes())
    spec = JoinSpec(whole, roles, "the outputs", Kind.STATUS, exit=assumed._replace(agree=_KNOWN + exit_.agree))
    try:
        got = join(spec._replace(learned=learned), values)
    except Disagreement as found:
        if found.field != "batch":
            raise
        return None, LENGTHS_CHANGED, learned
    mask = functools.reduce(lambda m, h: m | h.flags, learned.table, 0)
    if carried.shapes_differ([h.values for h in learned.table], view):  # the rows cannot be assembled as sent
        mask |= SHAPES_DIFFER
    return (None if mask else tuple(got)), mask, learned


def _no_rows(value: torch.Tensor, role: Role) -> torch.Tensor:
    """``value`` with no rows along its role's dim (the others as they are): what a rank sends when its carried
    outputs' rows cannot share one count."""
    return value.detach().narrow(role.dim, 0, 0) if is_rows(role) else value.detach()


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
        f"{call}: f returned outputs of different structures, dtypes or shapes on different ranks ({detail}); every "
        f"rank must return the same structure, with blocks of one dtype and one shape apart from their split dims (* "
        f"above): the outputs are assembled from them."
    )


def _leaf(spec: Tuple[Any, ...], kind: Any) -> str:
    """One output leaf as a rank returned it: a tensor's dtype and dims (its block's sizes, ``*`` along its split
    dims, where the blocks are assembled), or another leaf's type."""
    if not isinstance(kind, tuple):
        what = kind
    else:
        dtype, dims = str(kind[0]).replace("torch.", ""), kind[1]
        what = f"{dtype} {dims}-d" if isinstance(dims, int) else f"{dtype} {_sizes(dims)}"
    return f"{what}, out_specs P({', '.join(map(repr, spec))})"


def _sizes(dims: Tuple[Optional[int], ...]) -> str:
    shown = ["*" if n is None else str(n) for n in dims]
    return f"({shown[0]},)" if len(shown) == 1 else f"({', '.join(shown)})"
