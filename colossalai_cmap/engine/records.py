"""The records both kinds of map call hand the engine: a rank's failure, the alternative to its outputs."""

from typing import NamedTuple, Optional

from ..errors import RankFailure


class Failed(NamedTuple):
    """This rank's outcome when its part failed (the alternative to :class:`Outputs`): its ``failure``, the
    :class:`~colossalai_cmap.errors.RankFailure` report every rank receives (None on a rank that only learned of a
    peer's failure, as with ``src=r``), and its ``cause``, the exception here."""

    failure: Optional[RankFailure]
    cause: Optional[BaseException]
