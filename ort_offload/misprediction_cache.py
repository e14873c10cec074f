"""The misprediction cache of the block-wise runtime (DyNN-Offload §IV-E): corrections for
predictor outputs that were wrong before.

DyNN-Offload reuses a mispredicted sample's true execution blocks when a later sample's pilot
output *exactly* equals the mispredicted one. The pilot's raw output is continuous, so exact
repeats are rare across different samples (over 1,000 samples of each dynamic zoo family there
were none); this cache is keyed by the pilot's *mapped* output instead, the predicted path,
which repeats whenever the pilot makes the same call. A key enters the cache with its first
misprediction; from then on every outcome seen under it is counted, and a later prediction
with that key is replaced by the most frequent true path only if that path was seen more often
than the prediction itself was right. A systematic confusion (the pilot says P where the truth
is T) is corrected; a prediction that is usually right stays as it is.
"""

from __future__ import annotations

from collections import Counter

from pilot.prediction import PathPrediction, even_groups

__all__ = ["MispredictionCache"]


class MispredictionCache:
    """Outcomes per predicted path, for the keys that were mispredicted at least once."""

    def __init__(self) -> None:
        self._outcomes: dict[tuple[int, ...], Counter] = {}
        self._corrections: dict[tuple[int, ...], PathPrediction] = {}

    def __len__(self) -> int:
        return len(self._outcomes)

    def lookup(self, prediction: PathPrediction) -> PathPrediction | None:
        """The correction for ``prediction``, or None to keep it."""
        outcomes = self._outcomes.get(prediction.path)
        if not outcomes:
            return None
        best, count = outcomes.most_common(1)[0]
        if best == prediction.path or count <= outcomes.get(prediction.path, 0):
            return None
        return self._corrections[best]

    def record(self, prediction: PathPrediction, true_path: tuple[int, ...]) -> None:
        """Count the outcome of ``prediction`` (the predictor's own, before any correction)."""
        outcomes = self._outcomes.get(prediction.path)
        if outcomes is None:
            if true_path == prediction.path:
                return  # right, and never wrong before: nothing to remember
            outcomes = self._outcomes[prediction.path] = Counter()
        outcomes[true_path] += 1
        if true_path not in self._corrections:
            sizes = [end - start for start, end in prediction.execution_blocks]
            group = max(1, round(sum(sizes) / len(sizes))) if sizes else 1
            self._corrections[true_path] = PathPrediction(
                path=true_path, execution_blocks=even_groups(true_path, group) if true_path else (),
                key=("corrected", true_path))
