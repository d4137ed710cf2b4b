"""The exit's shared parts, for every kind of map call: a failure on one rank raised on every rank, the ranks'
agreement on the exit's table, and the words for outputs that differ across ranks."""

import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar

from ..errors import CmapError, by_rank, output_name
from ..wire.exchange import JoinSpec, report_failure
from ..wire.link import Link
from ..wire.rounds import Disagreement, Header, Kind, gather_objects
from .records import Failed

T = TypeVar("T")


def raise_failed(link: Link, failed: Failed, along: Sequence[Link] = ()) -> None:
    """This rank's failure, posted in a status round over ``link``'s group and raised there on every rank (alone, the
    one-rank ``CmapError`` at once); ``along``: the groups whose status rounds go with it, all issued together."""
    report_failure(JoinSpec(link, (), kind=Kind.STATUS), failed.failure, failed.cause, along)


def agreed(
    run: Callable[[], T],
    link: Link,
    details: Dict[str, Callable[[], Any]],
    explain: Callable[[Disagreement, Any], BaseException],
) -> T:
    """``run()``, the exit's round, whose table every rank reads whole. Where the ranks disagree on a field, every
    rank reached the same verdict: each sends what names the difference, where ``details`` has a function for that
    field (one object collective over ``link``'s group, on this error path only), and raises ``explain``'s error
    (given None where nothing was fetched)."""
    try:
        return run()
    except Disagreement as found:
        mine = details.get(found.field)
        every = gather_objects(link, mine()) if mine is not None else None
        raise explain(found, every) from None


def differing(seen: Sequence[Sequence[Any]], agrees: Callable[[Any, Any], bool] = operator.eq) -> Optional[List[int]]:
    """The output leaves whose ranks disagree (each rank's outputs ``seen``, leaves with a ``path``), or None where
    the ranks' output structures (their leaves' paths) differ."""
    if len({tuple(leaf.path for leaf in mine) for mine in seen}) > 1:
        return None
    return [i for i in range(len(seen[0])) if not all(agrees(mine[i], seen[0][i]) for mine in seen)]


def outputs_differ(seen: Sequence[Sequence[Any]], differ: Optional[Sequence[int]]) -> str:
    """How the ranks' outputs differ (leaves with a ``path`` and what the rank returned, ``shown``): every rank's
    outputs where the structures differ (``differ`` None), else each leaf in ``differ`` with what each rank returned."""
    if differ is None:
        return by_rank([", ".join(f"{output_name(leaf.path)} {leaf.shown}" for leaf in mine) for mine in seen], "; ")
    return "; ".join(f"{output_name(seen[0][i].path)}: " + by_rank([mine[i].shown for mine in seen]) for i in differ)


def graphs_differ(call: str, table: Sequence[Header], body: str) -> CmapError:
    """The ranks' local autograd graphs reach tensors made before the call through different edges (their
    ``graph_sig`` in the exit's table): their backward collectives would not meet. ``body`` names the function the
    map ran (``func``, ``f``)."""
    sigs = ", ".join(f"group rank {r}: {h.graph_sig:#x}" for r, h in enumerate(table))
    return CmapError(
        f"{call}: ranks built different autograd graphs around tensors made before the call ({sigs}): {body} "
        f"reached tensors that require grad in different ways on different ranks (different tensors, or a gradient "
        f"of one taken inside {body} on some ranks only), so their backward collectives would not meet. Make {body} "
        f"reach the same tensors the same way on every rank (no rank-dependent choice of parameters or gradients)."
    )
