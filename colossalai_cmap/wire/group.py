"""Where collectives run: a process group as a :class:`Group` record, and the one :class:`GroupState` this process
keeps for it (its round channels, its count of collectives, whether they fell out of step, and its host group).

A group whose backend is not gloo (nccl, on GPUs) gets a **host group**: a gloo group on the same ranks, its own,
made once, collectively, when the group is first resolved. Status rounds go over it in host memory, so they never wait on the
device, and CPU tensors in an nccl world travel over it (nccl refuses them). ``COLOSSALAI_CMAP_STATUS_PLANE=host``
gives every group one, so that the layout GPUs take runs on CPU too.
"""

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..errors import RankFailure


@dataclass(frozen=True)
class Group:
    """A process group as cmap sees it: ``pg`` is None when running in this one process."""

    pg: Optional[dist.ProcessGroup]
    rank: int
    size: int
    ranks: Tuple[int, ...]  # global rank of each group rank

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def backend(self) -> str:
        return "none" if self.pg is None else str(dist.get_backend(self.pg))

    def failure(self, exc: BaseException) -> RankFailure:
        """``exc``, raised on this rank, as the record every rank of the group receives."""
        return RankFailure.from_exception(exc, self.rank, self.global_rank)


SINGLE = Group(None, 0, 1, (0,))
STATUS_PLANE_ENV = "COLOSSALAI_CMAP_STATUS_PLANE"  # "auto" (the default) or "host"


@dataclass(eq=False)
class GroupState:
    """Everything this process keeps per process group, in one place.

    Attributes:
        group: the group's record.
        channels: the round buffers and agreed state per device (:class:`~colossalai_cmap.wire.link.Channel`).
        broken: why the group is unusable (a wait failed, so its collective sequence may be out of step), or None.
        failure: the error of the wait that failed on it, raised again by any later collective on it.
        track: this process's count of cmap collectives on the group (:mod:`.presence`), made by its first one.
        host: the gloo group on the same ranks that status rounds (and CPU tensors in an nccl world) take, or None.
        sources: what ``src=r`` calls' last starts told every rank (the call layer's records, by call name and
            source), kept alike on every rank so that a steady start needs no metadata broadcast.
        exits: what ``shard_map`` exits' last rounds told every rank (every rank's block length of the outputs the
            exit carried, by the outputs' layout digest), kept alike on every rank so that a steady exit knows the
            lengths before its round and can send its data right behind it.
        parts_in_func: the meshes over this group (each by its axes' groups) where a map call has taken a round on
            part of the mesh (an axis's group, several axes', a nested call's) while its ``f`` ran, each with the
            links of those parts (this rank's group of each, in the order first met). A part is added by a round on
            this group that every rank passes (:func:`~colossalai_cmap.wire.rounds.within_mesh`), so alike on every
            rank; from then on, the mesh's exits take a round on each part with the whole mesh's.
    """

    group: Group
    track: Any = None  # a presence.Track, made by :mod:`.comm` on the first collective
    channels: Dict[torch.device, Any] = field(default_factory=dict)
    broken: Optional[str] = None
    failure: str = ""
    host: Optional[Group] = None
    sources: Dict[Any, Any] = field(default_factory=dict)
    exits: Dict[Any, Tuple[int, ...]] = field(default_factory=dict)
    parts_in_func: Dict[Tuple[Any, ...], List[Any]] = field(default_factory=dict)


_STATES: Dict[int, Tuple[Any, GroupState]] = {}  # id(pg) -> (pg, state): the pg kept alive, so ids are not reused
_HOSTS: Set[int] = set()  # ids of the host groups made here (each is its own host; kept alive in _STATES)


def state_of(pg: dist.ProcessGroup) -> GroupState:
    """This process's state for ``pg``, made on first use (with its host group, where it needs one)."""
    found = _STATES.get(id(pg))
    if found is None or found[0] is not pg:
        group = Group(pg, dist.get_rank(pg), dist.get_world_size(pg), tuple(dist.get_process_group_ranks(pg)))
        found = _STATES[id(pg)] = (pg, GroupState(group))
        if id(pg) not in _HOSTS and (host_plane_forced() or "gloo" not in group.backend()):
            host_of(group)
    return found[1]


def host_plane_forced() -> bool:
    """``COLOSSALAI_CMAP_STATUS_PLANE=host``: status rounds take a host group even on CPU, as they do on GPUs."""
    return os.environ.get(STATUS_PLANE_ENV, "auto") == "host"


def host_of(group: Group) -> Group:
    """The group's host group: gloo, same ranks, made on first need (collectively: every rank of ``group`` resolves
    it at the same call). Each group has its own, so that a wait that fails on one (which leaves its collective
    sequence out of step) leaves the others usable, and a new group is a fresh start, as on gloo."""
    state = state_of(group.pg)
    if state.host is None:
        pg = dist.new_group(list(group.ranks), backend="gloo", use_local_synchronization=True)
        _HOSTS.add(id(pg))
        host = group_of(pg)
        state_of(pg).host = host  # its own rounds run on itself
        if host.ranks != group.ranks:  # rounds index their table by group rank: the orders must agree
            raise RuntimeError(f"the host group's ranks {host.ranks} are not in the order of its group's {group.ranks}")
        state.host = host
    return state.host


def kept_groups() -> Dict[int, Tuple[Any, GroupState]]:
    """Every process group this process keeps state for (and so keeps alive), with that state."""
    return _STATES


def group_of(pg: dist.ProcessGroup) -> Group:
    return state_of(pg).group


_MADE: Dict[Tuple[int, ...], dist.ProcessGroup] = {}  # the groups made here for a set of global ranks


def group_for(ranks: Sequence[int]) -> Group:
    """The group of these global ranks, made on first need by its members alone
    (``new_group(..., use_local_synchronization=True)``: every member resolves it at the same call) and kept, one per
    set of ranks for every layer that asks (a mesh's whole group, a collective over several of its axes, a grouped
    collective's bucket)."""
    key = tuple(sorted(ranks))
    pg = _MADE.get(key)
    if pg is None:
        pg = _MADE[key] = dist.new_group(list(key), use_local_synchronization=True)
    return group_of(pg)
