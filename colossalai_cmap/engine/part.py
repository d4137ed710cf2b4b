"""This rank's part of a map call, up to its exit, as every kind runs it: the skeleton around the kind's body, and
the step that reads the body's outputs' graph (the closure walk) and guards this rank's backward through it."""

from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

from ..nesting import CONTROL_FLOW
from ..torch_internals import next_sequence_nr
from ..wire.exchange import CallTag
from ..wire.guard import guard
from ..wire.link import Link
from . import closures


def run_part(kind: Any, site: Any, where: Any, inputs: Any) -> Any:
    """This rank's part of the call on ``inputs``: the kind's ``enter`` (before the call's autograd sequence starts:
    nodes made there are outside the call), then its ``run``, with the call's :class:`CallTag` and the sequence's
    start. Never raises but for torch's own control flow (checkpoint's early stop, raised alike on every rank, passes
    as it passes through vmap): any other exception becomes the kind's ``Failed`` outcome, which the exit
    reports, so every rank reaches the exit."""
    tag = CallTag()
    try:
        entered = kind.enter(site, where, inputs)
        start = next_sequence_nr()
        return kind.run(site, where, entered, tag, start)
    except Exception as exc:  # every rank learns of it at the exit
        tag.running = False
        if isinstance(exc, CONTROL_FLOW):
            raise
        return kind.failed(site, where, exc)


def walk_and_guard(
    flat: List[Any],
    tag: CallTag,
    start: int,
    link: Link,
    *,
    replay: Optional[Callable[[], ContextManager[Any]]],
    walk: bool = True,
    hooks: bool = True,
    axes: Sequence[Link] = (),
) -> Tuple[List[Any], int]:
    """The outputs ``flat`` of a call that started at ``start``, and the signature of the closure edges their graph
    holds (0: none; the ranks must agree on it). With ``walk``, the graph is walked for edges into tensors made
    before the call (:mod:`.closures`): hooked, their gradient summed over ``link``'s group, or with ``hooks``
    False only found. Where there are none, the graph leaves the body only through the call's entry, and this rank's
    backward through it is guarded (:mod:`~colossalai_cmap.wire.guard`; ``replay`` is the context a recomputation
    in that backward runs in; ``axes``: a mesh's axes' links, ``link`` its whole group's)."""
    graph_sig = 0
    if walk:
        graph_sig = closures.watch(flat, tag, start, link) if hooks else int(closures.reaches_outside(flat, tag, start))
    if graph_sig:
        tag.take_entries()
        return flat, graph_sig
    return guard(flat, tag, link, replay, axes), graph_sig
