"""GIE's decode-token sampler (requestdataproducer/predictedlatency/decode_token_sampler.go):
which output tokens of a streamed response get a TPOT prediction.

The first sample is token 2 + a Poisson draw (token 1 is the TTFT); after each prediction
the next sample is a further Poisson draw away, until ``max_samples`` predictions are
made (0: none). The draws are seeded with the FNV-64a hash of the request id, as GIE
seeds them — reproducible per request, though not the same numbers as Go's generator.
"""

from __future__ import annotations

import math
import random
import time

_FNV64_OFFSET = 0xCBF29CE484222325
_FNV64_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fnv64a(data: bytes) -> int:
    h = _FNV64_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV64_PRIME) & _MASK64
    return h


class DecodeTokenSampler:
    def __init__(self, request_id: str, sampling_mean: float, max_samples: int) -> None:
        seed = fnv64a(request_id.encode()) if request_id else 0
        if seed == 0:
            seed = time.time_ns()
        self._rng = random.Random(seed)
        self.sampling_mean = sampling_mean
        self.max_samples = max_samples
        self.sample_count = 0
        self.next_sample_token = 2 + self._poisson_next()

    def _poisson_next(self) -> int:
        lam = self.sampling_mean
        if lam <= 0:
            return 1
        if lam < 30:  # Knuth
            limit = math.exp(-lam)
            k, p = 0, 1.0
            while p > limit:
                k += 1
                p *= self._rng.random()
            return k - 1
        interval = round(lam + math.sqrt(lam) * self._rng.gauss(0.0, 1.0))
        return max(1, interval)

    def should_predict(self, token: int) -> bool:
        return token == self.next_sample_token and self.sample_count < self.max_samples

    def record_prediction(self, token: int) -> None:
        if self.sample_count >= self.max_samples:
            return
        self.sample_count += 1
        if self.sample_count < self.max_samples:
            self.next_sample_token = token + self._poisson_next()

    def sampled_tokens(self, generated: int) -> list[int]:
        """The tokens among 2..``generated`` that get a prediction, in order (each
        recorded). A zero draw puts the next sample on a token already passed: as in GIE,
        no further sample comes then."""
        out: list[int] = []
        while self.sample_count < self.max_samples and self.next_sample_token <= generated:
            token = self.next_sample_token
            out.append(token)
            self.record_prediction(token)
            if self.next_sample_token <= token:
                break
        return out
