"""How long a step computes, learnt from the worker's reports, and the prefill tokens a step
may add and stay within the TBT SLO (`SchedulerConfig.slo_chunking`).

A step's compute time is close to linear in the tokens it runs: a fixed part (every weight
is read once per step, whatever the batch) plus a part per token (the matmuls' rows, the
prefill attention). The model fits

    compute_s ≈ a + b · num_tokens

by least squares over the latest `window` steps, so it follows the machine, the model and
the context lengths of the moment.
"""

from __future__ import annotations

from collections import deque

MIN_SAMPLES = 8  # steps seen before the fit is trusted
MIN_TOKEN_SPREAD = 16  # and their token counts must differ by this much, or b is noise
SLO_SHARE = 0.9  # of the SLO a step may take: the rest is the step's planning and messages
MIN_PREFILL_CHUNK = 32  # tokens a capped step still gives prefills, so every prompt advances


class StepTimeModel:
    def __init__(self, window: int = 256) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._sx = self._sy = self._sxx = self._sxy = 0.0  # Σx, Σy, Σx², Σxy over the window

    def observe(self, num_tokens: int, compute_s: float) -> None:
        if len(self._samples) == self._samples.maxlen:
            self._add(*self._samples[0], sign=-1.0)
        self._samples.append((num_tokens, compute_s))
        self._add(num_tokens, compute_s, sign=1.0)

    def _add(self, x: float, y: float, sign: float) -> None:
        self._sx += sign * x
        self._sy += sign * y
        self._sxx += sign * x * x
        self._sxy += sign * x * y

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token, or None until the samples allow a fit."""
        n = len(self._samples)
        if n < MIN_SAMPLES:
            return None
        var = self._sxx - self._sx * self._sx / n  # n · variance of the token counts
        if var < n * MIN_TOKEN_SPREAD**2 / 4:
            return None
        b = (self._sxy - self._sx * self._sy / n) / var
        if b <= 0:
            return None
        return (self._sy - b * self._sx) / n, b

    def prefill_cap(self, num_decodes: int, tbt_slo: float) -> int | None:
        """Prefill tokens a step with `num_decodes` decodes may add and stay within SLO_SHARE
        of `tbt_slo`; at least MIN_PREFILL_CHUNK, so a prompt always advances. None while the
        model has no fit."""
        fitted = self.fit()
        if fitted is None:
            return None
        a, b = fitted
        return max(MIN_PREFILL_CHUNK, int((SLO_SHARE * tbt_slo - a) / b) - num_decodes)
