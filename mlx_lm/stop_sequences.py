"""Stop sequences of token ids (upstream's `generate.StopSequences`): a sequence stops
once its generated tokens end with any of them. One `StopSequences` is shared by many
sequences; each keeps its own `Matcher`."""

from typing import Iterable, Optional, Sequence, Set, Tuple, Union


class StopSequences:
    """The stop sequences (each a non-empty sequence of token ids; a bare int is a
    one-token sequence). `matcher()` gives one sequence's place in them."""

    def __init__(self, stop_sequences: Optional[Iterable[Union[int, Sequence[int]]]] = None):
        sequences: Set[Tuple[int, ...]] = set()
        for s in stop_sequences or ():
            sequence = (int(s),) if isinstance(s, int) else tuple(int(t) for t in s)
            if not sequence:
                raise ValueError("a stop sequence must hold at least one token id")
            sequences.add(sequence)
        self.sequences = sequences
        self.longest = max(map(len, sequences), default=0)

    def __bool__(self) -> bool:
        return bool(self.sequences)

    def matcher(self) -> "StopSequences.Matcher":
        return StopSequences.Matcher(self)

    class Matcher:
        """The last tokens a sequence generated, as many as the longest stop sequence."""

        def __init__(self, stops: "StopSequences"):
            self.stops, self.tail = stops, ()

        def advance(self, token: int) -> bool:
            """Take the next generated token; True if a stop sequence ends with it."""
            if not self.stops.longest:
                return False
            self.tail = (self.tail + (token,))[-self.stops.longest :]
            return any(self.tail[-len(s) :] == s for s in self.stops.sequences if len(s) <= len(self.tail))
