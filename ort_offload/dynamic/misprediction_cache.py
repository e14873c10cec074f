"""The misprediction cache of the block-wise runtime (DyNN-Offload §IV-E): corrections for
predictor outputs that were wrong before.

DyNN-Offload reuses a mispredicted sample's true execution blocks when a later sample's pilot
output *exactly* equals the mispredicted one. The pilot's raw output is continuous, so exact
repeats are rare across different samples (over 1,000 samples of each dynamic zoo family there
were none). This cache is keyed by the predicted path together with the predictor's ``key``:
for the pilot, its raw output rounded to whole block units (:func:`pilot.mapping.block_unit_key`),
the unit its outputs are stated in. Two samples share a key when the pilot called the same path
and said so in the same way, to the block; a sample the pilot cannot place (a var-BERT sample
without markers looks like a fixed-depth BERT sample, see ``pilot/train.py``) lands between the
candidates and gets a key of its own, even where the path it is mapped to is also the right
answer for other samples. (Keyed by the predicted path alone, var-BERT's mispredictions over
1,000 samples went 279 -> 284 with the cache; with the block-unit key 279 -> 152, and 259 -> 161
on another 1,000 seeds; finer keys repeat too rarely, coarser ones merge what the pilot told
apart.)

A key enters the cache with its first misprediction; from then on every outcome seen under it is
counted, and a later prediction with that key is replaced by the most frequent true path only if
that path was seen more often than the prediction itself was right. A systematic confusion (the
pilot says P where the truth is T) is corrected; a prediction that is usually right stays as it
is.
"""

from __future__ import annotations

from collections import Counter

from pilot.prediction import PathPrediction, even_groups

__all__ = ["MispredictionCache"]


class MispredictionCache:
    """Outcomes per (predicted path, predictor key), for the keys mispredicted at least once."""

    def __init__(self) -> None:
        self._outcomes: dict[tuple, Counter] = {}
        self._corrections: dict[tuple[int, ...], PathPrediction] = {}

    def __len__(self) -> int:
        return len(self._outcomes)

    def lookup(self, prediction: PathPrediction) -> PathPrediction | None:
        """The correction for ``prediction``, or None to keep it."""
        outcomes = self._outcomes.get(_key(prediction))
        if not outcomes:
            return None
        best, count = outcomes.most_common(1)[0]
        if best == prediction.path or count <= outcomes.get(prediction.path, 0):
            return None
        return self._corrections[best]

    def record(self, prediction: PathPrediction, true_path: tuple[int, ...]) -> None:
        """Count the outcome of ``prediction`` (the predictor's own, before any correction)."""
        outcomes = self._outcomes.get(_key(prediction))
        if outcomes is None:
            if true_path == prediction.path:
                return  # right, and never wrong before: nothing to remember
            outcomes = self._outcomes[_key(prediction)] = Counter()
        outcomes[true_path] += 1
        if true_path not in self._corrections:
            sizes = [end - start for start, end in prediction.execution_blocks]
            group = max(1, round(sum(sizes) / len(sizes))) if sizes else 1
            self._corrections[true_path] = PathPrediction(
                path=true_path, execution_blocks=even_groups(true_path, group) if true_path else (),
                key=("corrected", true_path))


def _key(prediction: PathPrediction) -> tuple:
    return prediction.path, prediction.key
