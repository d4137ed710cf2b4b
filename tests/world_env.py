"""Test support: one gloo world on 127.0.0.1, as a launcher sets it up: a free port and each rank's environment.

Only the standard library: the benchmarks' launcher (``benchmarks/world.py``) uses it too.
"""

import socket
from typing import Dict

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int, host: str = LOCALHOST) -> Dict[str, str]:
    """The variables a launcher such as torchrun sets for one rank of a world of ``size`` on one machine."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_WORLD_SIZE": str(size),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
    }
