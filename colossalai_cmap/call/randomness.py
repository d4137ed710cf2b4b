"""A cmap's ``randomness``: one object per choice, owning the generators func draws from.

``"error"`` draws nothing (loop mode checks the generator's state, as vmap raises on a draw); ``"same"`` draws from
the caller's generator as ``torch.vmap`` does, every example alike; ``"different"`` forks it, seeded from one draw
plus the group rank; ``"per_example"`` forks it, and seeds each example from one draw and its global index
(:class:`ExampleSeeds`), so that its draws do not depend on P, the shares or the mode. Loop mode's example threads
keep each example's generator states (:class:`ExampleGenerators`), swapped in at its turns.
"""

import contextlib
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch

# torch.vmap's own sentence, for a random draw under randomness="error" (loop mode checks the generator's state)
RANDOM_IN_ERROR_MODE = (
    "vmap: called random operation while in randomness error mode. Please either use the 'same' or 'different' "
    "randomness flags on vmap or perform the randomness operation out of vmap"
)

_MASK64 = (1 << 64) - 1


class ExampleSeeds(NamedTuple):
    """``randomness="per_example"``: one draw from the caller's generator, and the global index of the share's first
    row; each example runs under a generator seeded from the two, so its draws do not depend on P or on the shares."""

    base: int
    first: int

    def seed(self, i: int) -> int:
        """The seed of the share's row ``i``: splitmix64 of the base and the global index (distinct per index)."""
        z = (self.base + 0x9E3779B97F4A7C15 * (self.first + i + 1)) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return (z ^ (z >> 31)) >> 1


class ExampleGenerators:
    """Loop-mode example threads' own generator states (the CPU's and the device's), swapped in at each turn: all
    starting from the call's state (``"same"``), or each from its own seed (``"per_example"``)."""

    def __init__(self, count: int, device: torch.device, seeds: Optional[ExampleSeeds] = None) -> None:
        self._device = None if device.type == "cpu" else device
        if seeds is None:
            self._states = [self._get()] * count
            return
        self._states = []
        for i in range(count):
            seed_generators(seeds.seed(i), device)
            self._states.append(self._get())

    def _get(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        device = self._device
        return torch.random.get_rng_state(), None if device is None else _device_rng(device).get_rng_state(device)

    def restore(self, i: int) -> None:
        cpu, dev = self._states[i]
        torch.random.set_rng_state(cpu)
        if dev is not None:
            _device_rng(self._device).set_rng_state(dev, self._device)

    def save(self, i: int) -> None:
        self._states[i] = self._get()


def _device_rng(device: torch.device) -> Any:
    return torch.get_device_module(device)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the CPU's generator and ``device``'s: what ``torch.manual_seed`` does for these two, in microseconds
    (it costs about 0.2 ms, looking up every device type), since per_example seeds once per example."""
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        module = _device_rng(device)
        generators = getattr(module, "default_generators", None)
        if generators:
            generators[device.index if device.index is not None else module.current_device()].manual_seed(seed)
        else:
            module.manual_seed(seed)


def per_example_seeds(first: int) -> ExampleSeeds:
    """``"per_example"``'s seeds for a share whose first row has global index ``first``: one draw from the caller's
    generator (the same on every rank whose generator is in step), so the call advances it by one draw at every P."""
    return ExampleSeeds(int(torch.randint(0, 2**62, (), dtype=torch.int64).item()), first)


@contextlib.contextmanager
def rng_scope(seed: Optional[int], devices: Sequence[torch.device]) -> Iterator[None]:
    """Run under a forked RNG seeded with ``seed`` (``None``: leave the generators alone)."""
    if seed is None:
        yield
        return
    indices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=indices):
        torch.default_generator.manual_seed(seed)
        for device in {d for d in devices if d.type == "cuda"}:
            seed_generators(seed, device)
        yield


class Randomness:
    """One choice of ``randomness``: what func's random draws come from.

    Attributes:
        name: the choice as users write it, and as ``torch.vmap`` takes it (per_example's is not torch.vmap's).
        compiles: a compiled call can run it: it sets up no generator.
        seeded_per_rank: the call runs under a fork of the caller's generator, seeded from one draw plus the group
            rank (``"different"``).
        per_example: each example runs alone, under generators seeded from one draw and its global index.
    """

    name: str = ""
    compiles: bool = False
    seeded_per_rank: bool = False
    per_example: bool = False

    @property
    def forks(self) -> bool:
        """Whether the call runs under a fork of the caller's generator (with a seed of its own)."""
        return self.seeded_per_rank or self.per_example

    def checked(self) -> Any:
        """The context a loop-mode run goes in: ``"error"`` raises vmap's error if func drew random numbers."""
        return contextlib.nullcontext()

    def example_generators(
        self, count: int, device: torch.device, seeds: Optional[ExampleSeeds] = None
    ) -> Optional[ExampleGenerators]:
        """Each of ``count`` examples' own generator states in a loop, where they have their own (``"same"``, and
        ``"per_example"`` with its ``seeds``); None where the examples draw in turn from one generator."""
        return None

    def __repr__(self) -> str:
        return f"<randomness {self.name!r}>"


class _Error(Randomness):
    name, compiles = "error", True

    @contextlib.contextmanager
    def checked(self) -> Iterator[None]:
        before = torch.random.get_rng_state()
        yield
        if not torch.equal(before, torch.random.get_rng_state()):
            raise RuntimeError(RANDOM_IN_ERROR_MODE)


class _Different(Randomness):
    name, seeded_per_rank = "different", True


class _Same(Randomness):
    name = "same"

    def example_generators(
        self, count: int, device: torch.device, seeds: Optional[ExampleSeeds] = None
    ) -> Optional[ExampleGenerators]:
        return ExampleGenerators(count, device)  # every example starts from the call's state: vmap's one draw


class _PerExample(Randomness):
    name, per_example = "per_example", True

    def example_generators(
        self, count: int, device: torch.device, seeds: Optional[ExampleSeeds] = None
    ) -> Optional[ExampleGenerators]:
        return ExampleGenerators(count, device, seeds)


ERROR, DIFFERENT, SAME, PER_EXAMPLE = _Error(), _Different(), _Same(), _PerExample()
CHOICES = (ERROR, DIFFERENT, SAME, PER_EXAMPLE)
