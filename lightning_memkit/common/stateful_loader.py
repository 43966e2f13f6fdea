"""A training loader whose position Lightning saves with every checkpoint and restores on resume.

torchdata's ``StatefulDataLoader`` has the ``state_dict`` / ``load_state_dict`` that Lightning's fit loop saves and
restores for a training loader, so a run resumed mid-epoch continues with that epoch's next batch.
:class:`EpochStatefulLoader` adds one rule: the end of an epoch is saved as no position. Lightning resumes a
checkpoint taken at an epoch's last batch at the next epoch, which must be a fresh pass (a restored end would make it
an empty epoch, and the epoch count one too high).

Example::

    >>> loader = EpochStatefulLoader(list(range(6)), batch_size=2)
    >>> it = iter(loader); _ = next(it)
    >>> resumed = EpochStatefulLoader(list(range(6)), batch_size=2)
    >>> resumed.load_state_dict(loader.state_dict())
    >>> [b.tolist() for b in resumed]          # the rest of the epoch
    [[2, 3], [4, 5]]
    >>> _ = list(it); loader.state_dict()      # at the epoch's end: no position, the next epoch starts afresh
    {}
"""

from __future__ import annotations

from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = ["EpochStatefulLoader"]


class EpochStatefulLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` whose state at an epoch's end is ``{}`` (see the module)."""

    def state_dict(self) -> dict:
        state = super().state_dict()
        return {} if self._iterator is not None and self._iterator._num_yielded >= len(self) else state
