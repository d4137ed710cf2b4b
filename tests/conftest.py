"""Session-wide pool of gloo worlds (one per size), shared by every distributed test in this pytest process."""

from typing import Callable, Dict

import pytest
from harness import World


@pytest.fixture(scope="session")
def worlds() -> Callable[[int], World]:
    pool: Dict[int, World] = {}

    def get(size: int) -> World:
        world = pool.get(size)
        if world is None or not world.alive:
            world = pool[size] = World(size)
        return world

    yield get
    for world in pool.values():
        world.close()
