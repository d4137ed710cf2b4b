"""The records a cmap call's steps hand each other: its shares and what this rank was given for it, this rank's
outputs, what a finished call leaves for the next one, and what the last call did (a failure is the engine's
:class:`~colossalai_cmap.engine.records.Failed`)."""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..stats import CollectiveLog
from ..torch_internals import TreeSpec
from ..wire.link import Link


class Shares(NamedTuple):
    """One argument signature's shares on one group: how the batch splits over the group's ranks (``sizes``, this
    rank's ``rows`` from ``offset``), and the structure of the arguments they were made for."""

    spec: TreeSpec
    dims: Tuple[Optional[int], ...]  # each leaf's in-dim, non-negative; None for unmapped leaves
    batch: int  # the global batch; -1 with src="local", where only the round knows it
    sizes: Optional[Tuple[int, ...]]  # rows per group rank; None with src="local"
    rows: int  # this rank's rows
    offset: int  # where they start in the global batch (0 with src="local")
    input_sig: int  # what ranks compare to catch different inputs

    mapped: Tuple[int, ...]  # the positions of the mapped leaves


class Inputs(NamedTuple):
    """The shares and what this rank was given for them: the flat positional leaves (whole; with ``src=r``, this rank's
    share under the source's structure), the kwargs, and with ``src=r`` the example an empty share runs instead and
    whether an input required grad on the source (the receiving rank's output then refuses backward too)."""

    shares: Shares
    leaves: List[Any]
    kwargs: Dict[str, Any]
    stand_in: Any = None
    source_needs_grad: bool = False


class FastPath(NamedTuple):
    """What a finished call leaves for the next one with the same key: its shares, where it communicates, and the
    outputs' layout."""

    shares: Shares
    link: Link
    layout: Any  # the outputs' layout.OutLayout, or None


class Outputs(NamedTuple):
    """func's outputs on this rank: batch dims at ``out_dims``, zero rows on an empty share."""

    flat: List[Any]
    spec: TreeSpec
    layout: Any  # the outputs' layout.OutLayout
    empty: bool  # ran a stand-in example
    graph_sig: int  # the closure edges of its autograd graph (0: none)
    mutated: int  # bit k: func changed the k-th mapped input in place
    captures: Optional[bool] = None  # closure-captured tensors met (None: not looked for)
    # views.View records: the outputs that view the caller's mapped inputs, returned as such, not gathered
    views: Tuple[Any, ...] = ()


class LastCall(NamedTuple):
    """What the last call did on this rank, kept raw (``Cmapped.stats`` describes it; it is rarely read)."""

    log: CollectiveLog
    group_size: int
    local: bool
    fast_path: bool
    shares: Optional[Shares]
