"""How a map runs func over its named axis, as the axis's collectives read it: one object per mode.

The call layer's run modes (``"vmap"``, ``"batched"``, ``"loop"``: ``call/execute.py``) extend :class:`AxisMode`
with how func runs on a share; ``shard_map``'s mesh axes run in :data:`RANK` mode. A frame holds its map's mode
(``AxisFrame.mode``), and the collectives ask it what they need, never its name.
"""


class AxisMode:
    """A map's mode, as the named-axis ops see it.

    Attributes:
        name: the mode's name, as users write it (``mode="batched"``); ``"rank"`` for a ``shard_map`` mesh axis.
        holds_rows: func holds its share's rows at once, batch dim kept (dim 0): a collective's input carries them.
        in_turns: func runs on one example at a time (in a thread per example where there are collectives), and the
            examples meet at a collective in turns, at one stacked value.
        per_rank: each rank is one member of the axis, and func holds its own value (a ``shard_map`` mesh axis).
    """

    name: str = ""
    holds_rows: bool = False
    in_turns: bool = False
    per_rank: bool = False

    @property
    def native(self) -> bool:
        """Whether each run of func holds its rows (every mode but loop's), so that the per-example ops can take
        their native collective."""
        return not self.in_turns

    def __repr__(self) -> str:
        return f"<mode {self.name!r}>"


class RankMode(AxisMode):
    """``shard_map``: each rank runs ``f`` once, on its own block, as one member of each manual mesh axis."""

    name = "rank"
    per_rank = True


RANK = RankMode()
