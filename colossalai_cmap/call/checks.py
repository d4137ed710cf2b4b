"""The checks every rank runs on a call's status table, and the multi-rank errors they raise.

They read only the table, which every rank holds whole, so every rank reaches the same verdict and raises the same
error, before any data moves.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

from ..engine.exit import differing, graphs_differ, outputs_differ
from ..errors import CmapError
from ..wire.rounds import Disagreement, Header
from .layout import LeafSeen
from .options import Options


def agreed_fields(opts: Options) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """The header fields every rank's exit must agree on, in the order they are checked, and those compared across
    the ranks that ran real examples only (an empty share has no out_dims=None values of its own)."""
    inputs = ("input_sig", "batch") if opts.src is None or opts.src == "local" else ()
    return inputs + ("digest", "graph_sig"), ("values",) if opts.check_inputs else ()


def explain(opts: Options, found: Disagreement, every: Any = None) -> CmapError:
    """The error every rank raises for a disagreement found in the exit round. ``every``: what the caller fetched
    from every rank on this error path, to name what differs: for out_dims=None outputs that differ (``check_inputs``,
    ``found.field == "values"``) their checksums, for outputs of different layouts (``"digest"``) the outputs'
    descriptions (:func:`~.layout.seen_outputs`)."""
    if found.field in ("input_sig", "batch"):
        return _inputs_error(opts, found.table)
    if found.field == "digest":
        return _layout_error(opts, found.table, every)
    if found.field == "values":
        return _replicated_error(opts, every)
    return graphs_differ(opts.call, found.table, "func")


def _inputs_error(opts: Options, table: Sequence[Header]) -> CmapError:
    detail = ", ".join(
        f"group rank {r}: batch {h.batch if h.batch >= 0 else h.rows} (signature {h.input_sig:#x})"
        for r, h in enumerate(table)
    )
    what = "shard shapes, dtypes or structure, or in_dims=None inputs" if opts.src == "local" else "inputs"
    values = " (or values: check_inputs=True compares their bytes)" if opts.check_inputs else ""
    return CmapError(
        f"{opts.call}: ranks passed different {what}{values} ({detail}). With src=None every rank must pass the same "
        f"full inputs; use src=<rank> to scatter from one rank, or src='local' to pass per-rank shards."
    )


def _layout_error(opts: Options, table: Sequence[Header], seen: Optional[Sequence[Tuple[LeafSeen, ...]]]) -> CmapError:
    detail, differ = "", None
    if seen:
        differ = differing(seen, LeafSeen.agrees)
        detail = outputs_differ(seen, differ)  # with different structures, every rank's outputs
    if not detail:  # the same outputs, different views of the inputs (or nothing fetched): the digests
        detail = "layout digests " + ", ".join(f"group rank {r}: {h.digest:#x}" for r, h in enumerate(table))
    fix = "Make every rank's output the same shape, dtype and structure (apart from its rows, whose count may differ)."
    if differ and all(m[i].agrees(seen[0][i], but="shape") for m in seen for i in differ):
        fix = (
            "Make every rank's output the same shape apart from its rows: pad it to a fixed length. model.generate, "
            "for one, stops when every row of its batch has met eos_token_id, so each rank's output ends at its own "
            "length: pad it to the prompt's length + max_new_tokens with the pad token "
            "(torch.nn.functional.pad(out, (0, length - out.shape[-1]), value=pad_token_id)), or pass "
            "min_new_tokens=max_new_tokens (no row stops at eos)."
        )
    return CmapError(
        f"{opts.call}: ranks returned outputs of different per-example shapes, dtypes or structures ({detail}). "
        f"cmap joins every rank's rows into one result, so every example's output needs one shape, dtype and "
        f"structure, as in one process. {fix}"
    )


def _replicated_error(opts: Options, seen: Sequence[Any]) -> CmapError:
    """An out_dims=None output differs across ranks (found by check_inputs): name it and each rank's checksum."""
    sums = [(r, dict(checksums)) for r, checksums in enumerate(seen) if checksums]
    bad = [i for i in sums[0][1] if len({s.get(i) for _, s in sums}) > 1]
    detail = "; ".join(f"output leaf {i}: " + ", ".join(f"rank {r} crc32 {s[i]:#010x}" for r, s in sums) for i in bad)
    return CmapError(
        f"{opts.call}: an output declared replicated (out_dims=None) is not the same on every rank ({detail}). "
        f"out_dims=None promises one value shared by every example, such as the result of a psum; give the output an "
        f"int out_dim if it varies per example or per rank. (Found by check_inputs=True.)"
    )
