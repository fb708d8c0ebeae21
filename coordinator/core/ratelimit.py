"""Token-bucket rate limits (pure: the caller passes ``now``), keyed per identity and per address.

A bucket holds up to ``burst`` tokens and refills at ``rate`` tokens per second; a request takes one.
:class:`Limiter` keeps one bucket per key in a bounded LRU so that a flood of distinct keys (random client
ids) cannot grow memory without bound: the least recently used key is forgotten, which at worst grants it
a fresh burst — an attacker rotating keys is then bounded by the per-address limit instead.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    tokens: float
    updated: float


@dataclass(frozen=True)
class Rate:
    """``rate`` tokens per second, at most ``burst`` at once. rate 0 means unlimited."""

    rate: float
    burst: float


def take(bucket: Bucket | None, rate: Rate, now: float, cost: float = 1.0) -> tuple[Bucket, float]:
    """Try to take ``cost`` tokens. Returns (new bucket, 0.0) if allowed, else (bucket, seconds to wait)."""
    if bucket is None:
        bucket = Bucket(rate.burst, now)
    elapsed = max(0.0, now - bucket.updated)
    tokens = min(rate.burst, bucket.tokens + elapsed * rate.rate)
    if tokens >= cost:
        return Bucket(tokens - cost, now), 0.0
    wait = (cost - tokens) / rate.rate if rate.rate > 0 else math.inf
    return Bucket(tokens, now), wait


class Limiter:
    """Buckets for many keys under one rate, bounded to ``max_keys`` (LRU)."""

    def __init__(self, rate: Rate, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate.rate > 0

    def check(self, key: str, now: float) -> float:
        """0.0 if the request may proceed (and is counted), else the seconds after which it would be allowed."""
        if not self.enabled:
            return 0.0
        bucket, wait = take(self._buckets.get(key), self.rate, now)
        self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait

    def __len__(self) -> int:
        return len(self._buckets)


class BurstLog:
    """At most one log record per ``window_s`` for each key; what is held back is counted and reported with the
    next record, so a flood of one failure costs one line (and one traceback) a window, not one per request.

    ``allow`` returns None when the record is to be held back, else how many were held back since the last one.
    Keys are bounded (LRU) like :class:`Limiter`'s: a forgotten key at worst logs once more."""

    def __init__(self, window_s: float, max_keys: int = 1024) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # key → (last logged at, held back since)

    def allow(self, key: str, now: float) -> int | None:
        last = self._last.get(key)
        if last is not None and now - last[0] < self.window_s:
            self._last[key] = (last[0], last[1] + 1)
            self._last.move_to_end(key)
            return None
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return 0 if last is None else last[1]
