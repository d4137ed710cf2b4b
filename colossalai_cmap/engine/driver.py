"""The two drivers of a map call, from its arguments to its result: :func:`run_eager` and, inside
``torch.compile``, :func:`run_compiled`. Each is a template; a kind of map (cmap's, shard_map's) implements its steps
(:class:`EagerKind`, :class:`TracedKind`), and ``site`` is the map itself, what it keeps between calls."""

from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..axis import frame as frames
from ..axis.frame import AxisFrame
from ..nesting import start_splitting, stop_splitting
from ..wire.traced import out_of_graph
from .part import run_part
from .records import Failed

Driver = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]


class EagerKind:
    """The steps of one kind of map call, as :func:`run_eager` runs them, in this order."""

    def communicate(self, site: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Any]:
        """Where the call communicates, or None where this rank takes no part (it returns None)."""
        raise NotImplementedError

    def inputs(self, site: Any, where: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """The arguments as this rank's inputs, or a :class:`Failed` outcome, which goes on to the exit."""
        raise NotImplementedError

    def enter(self, site: Any, where: Any, inputs: Any) -> Any:
        """What this rank's part starts from, made before the call's autograd sequence starts (its nodes are outside
        the call); inside the part, so an exception is a :class:`Failed` outcome."""
        return inputs

    def run(self, site: Any, where: Any, entered: Any, tag: Any, start: int) -> Any:
        """This rank's part: the body on its inputs, and its outputs read (the walk and guard of :mod:`.part`)."""
        raise NotImplementedError

    def failed(self, site: Any, where: Any, exc: BaseException) -> Failed:
        """This rank's exception as the :class:`Failed` outcome the exit reports."""
        raise NotImplementedError

    def conclude(self, site: Any, where: Any, inputs: Any, result: Any) -> Any:
        """The exit: the result on this rank, or what every rank raises (a :class:`Failed` result on every rank)."""
        raise NotImplementedError

    def finish(self, site: Any, where: Any) -> None:
        """After the call, returned or raised."""


def run_eager(kind: EagerKind, site: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """One eager call of the map ``site`` of ``kind``; returns its result on this rank, or raises what every rank
    raises. This rank's part never raises (:func:`~.part.run_part`), so every rank reaches the exit."""
    where = kind.communicate(site, args, kwargs)
    if where is None:
        return None
    try:
        inputs = kind.inputs(site, where, args, kwargs)
        result = inputs if isinstance(inputs, Failed) else run_part(kind, site, where, inputs)
        return kind.conclude(site, where, inputs, result)
    finally:
        kind.finish(site, where)


class TracedEntry(NamedTuple):
    """A compiled call's inputs on this rank, the axis frames its body runs in (name, frame), and the ranks it marks
    as splitting their batch while it runs (a map nested in the body, run eagerly, maps this rank's examples)."""

    inputs: Any
    frames: Tuple[Tuple[str, AxisFrame], ...]
    splitting: Sequence[int]


class TracedKind:
    """The steps of one kind of map call inside ``torch.compile``, as :func:`run_compiled` runs them, in this order.

    Attributes:
        eager: the eager call out of the graph, per reason of :meth:`unsupported` (:func:`eager_fallbacks`).
    """

    def __init__(self, eager: Mapping[str, Driver]) -> None:
        self.eager = eager

    def communicate(self, site: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Any]:
        """Where the call communicates, or None where this rank takes no part (it returns None)."""
        raise NotImplementedError

    def unsupported(self, site: Any, where: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
        """What of this call only the eager orchestration does (a key of :attr:`eager`), or None."""
        raise NotImplementedError

    def enter(self, site: Any, where: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> TracedEntry:
        """This rank's inputs as traceable ops, and the frames its body runs in."""
        raise NotImplementedError

    def run(self, site: Any, where: Any, entered: TracedEntry) -> Any:
        """The body, with the frames open."""
        raise NotImplementedError

    def conclude(self, site: Any, where: Any, entered: TracedEntry, out: Any) -> Any:
        """The exit as traceable ops, with no round: the result on this rank."""
        raise NotImplementedError


def run_compiled(kind: TracedKind, site: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """One call of the map ``site`` of ``kind`` as traceable ops; returns what the eager call returns on this rank.
    What only the eager orchestration does runs the eager call out of the graph. The frames are pushed and popped
    in a ``try``/``finally`` (dynamo traces those, not a generator context manager)."""
    where = kind.communicate(site, args, kwargs)
    if where is None:
        return None
    reason = kind.unsupported(site, where, args, kwargs)
    if reason is not None:
        return kind.eager[reason](site, args, kwargs)
    entered = kind.enter(site, where, args, kwargs)
    for name, frame in entered.frames:
        frames.push(name, frame)
    start_splitting(entered.splitting)
    try:
        out = kind.run(site, where, entered)
    finally:
        stop_splitting()
        for name, _ in reversed(entered.frames):
            frames.pop(name, finished=False)
    return kind.conclude(site, where, entered, out)


def eager_fallbacks(driver: Driver, who: str, reasons: Mapping[str, str]) -> Dict[str, Driver]:
    """The eager ``driver`` out of the graph, once per reason: a graph break, or with ``fullgraph=True`` dynamo's
    error, which shows the function's name, so it is named by its reason (``who`` is the map's name). Made once,
    outside any graph: dynamo only calls them."""
    return {
        reason: out_of_graph(driver, f"{who} runs eagerly, not inside torch.compile: {text}")
        for reason, text in reasons.items()
    }
