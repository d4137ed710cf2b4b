"""``python -m benchmarks.wire_bytes``: the table of bytes per rank against the native bound, P = 2 and 4, for each
workload of the tests (one axis in cmap and shard_map; shard_map over a tuple of mesh axes and with uneven chunks).

The counter and the measured workload are the tests' own (``tests/wire_tap.py``), so the table and
``tests/test_wire_bytes.py`` count the same thing.
"""

from benchmarks.paths import test_support
from benchmarks.world import spawn

wire_tap = test_support("wire_tap")


def main() -> None:
    """``python -m benchmarks.wire_bytes``: the table of bytes per rank against the native bound, P = 2 and 4, for each
    workload of the tests (one axis in cmap and shard_map; shard_map over a tuple of mesh axes and with uneven chunks).
    """
    sizes = (4096, 64 * 1024, 1 << 20, 16 << 20)
    print("| call | P | op | bytes per rank | forward sent / native | backward sent / native | collectives fwd + bwd |")
    print("|---|---|---|---|---|---|---|")
    for kind in wire_tap.KINDS:
        for size in (2, 4):
            for op, n, fwd, bwd, nf, nb in spawn(wire_tap.measure, size, (kind, sizes))[0]:
                native_fwd, native_bwd = wire_tap.native_bound(op, n, size)
                print(
                    f"| {kind} | {size} | {op} | {_human(n)} | {fwd:,.0f} / {native_fwd:,.0f} = {fwd / native_fwd:.2f}x "
                    f"| {bwd:,.0f} / {native_bwd:,.0f} = {bwd / native_bwd:.2f}x | {nf} + {nb} |"
                )


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


if __name__ == "__main__":
    main()
