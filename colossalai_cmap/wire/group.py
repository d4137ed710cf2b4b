"""Where collectives run: a process group as a :class:`Group` record, and the one :class:`GroupState` this process
keeps for it (its round channels, its count of collectives, and whether they fell out of step)."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import RankFailure
from . import presence


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


@dataclass(eq=False)
class GroupState:
    """Everything this process keeps per process group, in one place.

    Attributes:
        group: the group's record.
        channels: the round buffers and agreed state per device (:mod:`~colossalai_cmap.wire.channel`).
        broken: why the group is unusable (a wait failed, so its collective sequence may be out of step), or None.
        failure: the error of the wait that failed on it, raised again by any later collective on it.
        track: this process's count of cmap collectives on the group, and the latest (:mod:`.presence`).
    """

    group: Group
    track: presence.Track
    channels: Dict[torch.device, Any] = field(default_factory=dict)
    broken: Optional[str] = None
    failure: str = ""


_STATES: Dict[int, Tuple[Any, GroupState]] = {}  # id(pg) -> (pg, state): the pg kept alive, so ids are not reused


def state_of(pg: dist.ProcessGroup) -> GroupState:
    """This process's state for ``pg``, made on first use."""
    found = _STATES.get(id(pg))
    if found is None or found[0] is not pg:
        group = Group(pg, dist.get_rank(pg), dist.get_world_size(pg), tuple(dist.get_process_group_ranks(pg)))
        track = presence.track(str(getattr(pg, "group_name", group.ranks)), group.ranks)
        found = _STATES[id(pg)] = (pg, GroupState(group, track))
    return found[1]


def group_of(pg: dist.ProcessGroup) -> Group:
    return state_of(pg).group


def first_device(values: Sequence[Any]) -> Optional[torch.device]:
    """The device of the first tensor among ``values`` (None when there is none)."""
    return next((v.device for v in values if isinstance(v, torch.Tensor)), None)


def group_device(group: Group, fallback: Optional[torch.device] = None) -> torch.device:
    """The device collectives on this group need: the inputs' own device, else the backend's device."""
    if fallback is not None:
        return fallback
    if group.pg is not None and "nccl" in group.backend():
        from colossalai.accelerator import get_accelerator

        return get_accelerator().get_current_device()
    return torch.device("cpu")
