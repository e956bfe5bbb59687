"""A bad link for the test programs: live state whose bytes are flipped on their way to a receiver."""

from __future__ import annotations


def flip_in_flight(segment: int) -> None:
    """From now on, the data of the ``segment``-th segment (0-based) of live state this rank receives
    arrives with its first byte flipped, as the receiver's checks see it (``transfer._recv`` is
    wrapped; the caller restores it where it must)."""
    from fault_tolerant_handlers.recover import transfer

    original, calls = transfer._recv, []

    class Flipped:  # the bytes arrive, then one of them is flipped, before they are checked
        def __init__(self, work, buffer):
            self.work, self.buffer = work, buffer

        def wait(self):
            self.work.wait()
            self.buffer[0] ^= 0xFF

    def corrupting(buffer, source, group):
        work = original(buffer, source, group)
        calls.append(buffer.numel())
        # after the header, the lengths and the structure, each segment has one message of more
        # than a check's bytes (its data): corrupt the one of segment ``segment``
        if len(calls) > 3 and buffer.numel() > transfer.TAIL_BYTES:
            if sum(n > transfer.TAIL_BYTES for n in calls[3:]) == segment + 1:
                return Flipped(work, buffer)
        return work

    transfer._recv = corrupting
