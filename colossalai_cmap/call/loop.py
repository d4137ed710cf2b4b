"""Loop mode's example threads: one per example, taking turns, meeting at each collective."""

import threading
from typing import Any, Callable, List, Optional

import torch


class LoopBarrier:
    """Loop mode with collectives: one thread per example, taking turns in example order.

    Each example runs until it reaches a collective (or ends), then hands the turn to the next one; when every example
    has reached the collective, it runs once on their stacked values and the examples go on, in order again. So the
    examples' random draws happen in a fixed order, and an error in one example reaches all of them. With ``rng``
    (an object with ``restore(i)`` and ``save(i)``), each example keeps its own generator state, swapped in at its
    turns (``randomness="same"``: all starting alike; ``"per_example"``: each from its own seed).
    """

    def __init__(self, count: int, rng: Any = None) -> None:
        self.count = count
        self._local = threading.local()
        self._slots: List[Any] = [None] * count
        self._cond = threading.Condition()
        self._turn, self._arrived, self._done, self._round = 0, 0, 0, 0
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._rng = rng

    def index(self) -> torch.Tensor:
        return self._local.index

    def start_example(self, i: int, index: torch.Tensor) -> None:
        """Example ``i``'s thread starts: wait for its first turn."""
        self._local.i, self._local.index = i, index
        with self._cond:
            self._wait_for_turn(i, self._round)

    def end_example(self) -> None:
        """Example ``i`` ended (returned or raised): the next one takes the turn."""
        i = self._local.i
        with self._cond:
            self._done += 1
            if self._arrived and self._error is None:  # peers wait in a collective this example never made
                self._error = RuntimeError(
                    "mode='loop': the examples made different collective calls (one returned while others waited in "
                    "a collective); every example must make the same collective calls, as under vmap."
                )
            self._pass_turn(i)

    def abort(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def run(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A collective: every example's ``x`` stacked, ``fn`` once on the stack, each example gets the result."""
        if self.count == 1:
            return fn(x.unsqueeze(0))
        i = self._local.i
        with self._cond:
            self._slots[i] = x
            self._arrived += 1
            round_ = self._round
            if self._arrived + self._done == self.count:
                self._act(fn)
                self._arrived, self._round, self._turn = 0, self._round + 1, 0
                self._save_rng(i)
                self._cond.notify_all()
            else:
                self._pass_turn(i)
            self._wait_for_turn(i, round_ + 1)
            return self._result

    def _act(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self._error is not None or self._done:
            self._error = self._error or RuntimeError(
                "mode='loop': the examples made different collective calls; every example must make the same "
                "collective calls, as under vmap."
            )
            return
        try:
            if any(s.requires_grad for s in self._slots) and torch.is_grad_enabled():
                raise RuntimeError(
                    "collectives in mode='loop' are not differentiable; use mode='vmap' or "
                    "'batched', or run under torch.no_grad()."
                )
            with torch.no_grad():
                self._result = fn(torch.stack(self._slots))
        except BaseException as exc:  # re-raised in every example thread
            self._result, self._error = None, exc

    def _pass_turn(self, i: int) -> None:
        self._save_rng(i)
        self._turn = i + 1
        self._cond.notify_all()

    def _wait_for_turn(self, i: int, round_: int) -> None:
        self._cond.wait_for(lambda: self._error is not None or (self._round >= round_ and self._turn == i))
        if self._error is not None:
            raise self._error
        if self._rng is not None:
            self._rng.restore(i)

    def _save_rng(self, i: int) -> None:
        if self._rng is not None:
            self._rng.save(i)
