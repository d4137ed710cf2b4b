"""Session-wide pools of gloo worlds (one per size), shared by every distributed test in this pytest process."""

from typing import Callable, Dict, Iterator, Optional

import pytest
from harness import World


def _pool(env: Optional[Dict[str, str]] = None) -> Iterator[Callable[[int], World]]:
    pool: Dict[int, World] = {}

    def get(size: int) -> World:
        world = pool.get(size)
        if world is None or not world.alive:
            world = pool[size] = World(size, env=env)
        return world

    yield get
    for world in pool.values():
        world.close()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Callable[[int], World]]:
    yield from _pool()


@pytest.fixture(scope="session")
def host_worlds() -> Iterator[Callable[[int], World]]:
    """Worlds whose status rounds take a host group on CPU too (``COLOSSALAI_CMAP_STATUS_PLANE=host``): the layout
    every group takes on GPUs, where data moves over nccl and rounds over a gloo group on the same ranks."""
    yield from _pool({"COLOSSALAI_CMAP_STATUS_PLANE": "host"})
