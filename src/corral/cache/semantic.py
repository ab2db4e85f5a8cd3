"""The semantic cache: a chat request may be answered with the stored answer of an earlier one whose last
user turn says the same thing in other words.

Safe by construction: a hit needs an *exact* match of everything but the last user turn (tenant, model and
its deployed revision, endpoint, system prompt, earlier turns, sampling parameters, tools, response
format), which is the `group` digest; only the last user turns are compared, by the cosine of their
embeddings from the cluster's embedding model. So two tenants never share an answer, and two conversations
that end in the same question but differ before it never hit each other.

Whether a neighbour is close enough is decided one of two ways (`models[].cache`):
- a fixed `similarity` threshold;
- `learn_thresholds` (vCache, arXiv 2502.03771, implemented from the paper): each cached entry learns its
  own threshold from evidence. When a request's nearest neighbour is that entry, the engine sometimes
  answers anyway (exploration) and the two answers are compared (equal text: the neighbour's answer was
  right); those (similarity, correct) observations fit a logistic curve P(correct | s) = 1 / (1 +
  exp(-γ (s - t))) per entry (MAP, with a weak prior at the fixed threshold). With the user's accepted
  false-hit rate δ, the request explores with probability τ = max over a (1 - ε) confidence band of
  [(1 - δ) - (1 - ε)·L'] / [1 - (1 - ε)·L'] (L' the pessimistic estimate at the band's edge), else it is
  answered from the cache. An entry with no evidence always explores, and so does a request below the
  entry's fitted threshold (a deviation from the paper, which would serve those at rate δ), so a learned
  cache starts as safe as no cache and hits where its answers proved to be stable. An explored answer
  equal to its neighbour's is not indexed itself (the neighbour answers that question; its evidence stays
  in one place); a different one is, as a new entry.

The index is per group: a flat matrix (numpy) while small, an HNSW graph (usearch, built in a thread)
once a group passes `_HNSW_FROM` vectors. Measured on this machine (bench/cache_quality.py, 384
dimensions): a flat search of 10,000 vectors takes 0.32 ms against 0.49 ms for usearch, of 100,000 9.5 ms
against 1.3 ms; building the graph of 100,000 takes 97 s.
Vectors are kept in the stored entries themselves, so the index is rebuilt from the store on start
(`rebuild`) and a purge or expiry removes them with their answers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["Embedder", "Neighbour", "SemanticIndex", "ThresholdLearner", "exploration_probability"]

logger = logging.getLogger(__name__)

_HNSW_FROM = 20_000  # vectors in a group before it moves from a flat matrix to an HNSW graph
_PRIOR_GAMMA = 30.0  # the prior curve's steepness: P(correct) goes 0.05 → 0.95 over about ±0.1 of cosine
_PRIOR_WEIGHT = 1.0  # strength of the prior, in observations
_EPSILONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # the confidence bands τ is minimised over
_Z = {0.01: 2.326, 0.02: 2.054, 0.05: 1.645, 0.1: 1.282, 0.2: 0.842, 0.3: 0.524, 0.5: 0.0}  # one-sided

Vector = np.ndarray[Any, np.dtype[np.float32]]


class Embedder(Protocol):
    """Turns texts into unit vectors with one of the cluster's embedding models."""

    async def embed(self, model: str, text: str) -> Vector: ...


@dataclass(frozen=True, slots=True)
class Neighbour:
    key: str  # the cached entry's store key
    similarity: float


@dataclass(slots=True)
class _Group:
    hnsw_from: int
    keys: list[str] = field(default_factory=list)
    vectors: list[Vector] = field(default_factory=list)
    matrix: Vector | None = None  # the flat index, rebuilt lazily after additions
    hnsw: Any = None  # usearch.Index once the group is large
    ids: dict[str, int] = field(default_factory=dict)  # key → position (HNSW label)

    building: bool = False  # an HNSW graph is being built in a thread

    async def add(self, key: str, vector: Vector) -> None:
        if key in self.ids:
            return
        self.ids[key] = len(self.keys)
        self.keys.append(key)
        self.vectors.append(vector)
        self.matrix = None
        if self.hnsw is not None:
            self.hnsw.add(self.ids[key], vector)
        elif len(self.keys) >= self.hnsw_from and not self.building:
            await self._to_hnsw()

    async def _to_hnsw(self) -> None:
        """Build the graph off the event loop (seconds for tens of thousands of vectors); the flat matrix
        answers meanwhile, and vectors added during the build join the graph after it."""
        self.building = True
        try:
            built = len(self.vectors)
            index = await asyncio.to_thread(_hnsw, np.stack(self.vectors[:built]))
            for position in range(built, len(self.vectors)):
                index.add(position, self.vectors[position])
            self.hnsw = index
        finally:
            self.building = False

    def nearest(self, vector: Vector, removed: set[str]) -> Neighbour | None:
        if self.hnsw is not None:
            matches = self.hnsw.search(vector, 8)
            for label, distance in zip(matches.keys, matches.distances, strict=True):
                key = self.keys[int(label)]
                if key not in removed:
                    return Neighbour(key, 1.0 - float(distance))  # inner-product distance is 1 - cos
            return None
        if self.matrix is None:
            self.matrix = np.stack(self.vectors) if self.vectors else np.zeros((0, len(vector)), np.float32)
        scores = self.matrix @ vector
        for i in np.argsort(-scores)[:8]:
            if self.keys[int(i)] not in removed:
                return Neighbour(self.keys[int(i)], float(scores[int(i)]))
        return None


class SemanticIndex:
    """Unit vectors of cached last user turns, per group (see the module docstring)."""

    def __init__(self, hnsw_from: int = _HNSW_FROM) -> None:
        self._hnsw_from = hnsw_from
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}  # entry key → group
        self._removed: set[str] = set()  # keys whose entries are gone (skipped; HNSW keeps its nodes)

    def __len__(self) -> int:
        return len(self._group_of) - len(self._removed)

    async def add(self, group: str, key: str, vector: Vector) -> None:
        self._removed.discard(key)
        self._group_of[key] = group
        members = self._groups.get(group)
        if members is None:
            members = self._groups[group] = _Group(self._hnsw_from)
        await members.add(key, vector)

    def nearest(self, group: str, vector: Vector) -> Neighbour | None:
        found = self._groups.get(group)
        return found.nearest(vector, self._removed) if found is not None else None

    def remove(self, keys: Iterable[str]) -> None:
        """Forget entries (expired, purged); a group left empty is dropped."""
        for key in keys:
            group = self._group_of.get(key)
            if group is None:
                continue
            self._removed.add(key)
            members = self._groups.get(group)
            if members is not None and all(k in self._removed for k in members.keys):
                for k in members.keys:
                    self._group_of.pop(k, None)
                    self._removed.discard(k)
                del self._groups[group]

    def keys(self) -> list[str]:
        return [k for k in self._group_of if k not in self._removed]


@dataclass(slots=True)
class _Evidence:
    similarities: list[float] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    fit: tuple[float, float, float] | None = None  # t, γ and the standard error of t, when fitted


class ThresholdLearner:
    """vCache's per-entry thresholds: evidence per cached entry, and the exploration decision."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._evidence: dict[str, _Evidence] = {}
        self._rng = rng or random.Random()

    def observe(self, key: str, similarity: float, correct: bool) -> None:
        evidence = self._evidence.setdefault(key, _Evidence())
        evidence.similarities.append(similarity)
        evidence.correct.append(int(correct))
        evidence.fit = None

    def observations(self, key: str) -> int:
        found = self._evidence.get(key)
        return len(found.correct) if found is not None else 0

    def explore(self, key: str, similarity: float, prior_t: float, delta: float) -> bool:
        """Whether the engine should answer (and the neighbour be checked) rather than the cache."""
        tau = self.tau(key, similarity, prior_t, delta)
        return tau >= 1.0 or self._rng.random() < tau

    def tau(self, key: str, similarity: float, prior_t: float, delta: float) -> float:
        evidence = self._evidence.get(key)
        if evidence is None or not evidence.correct:
            return 1.0  # no evidence for this entry yet: the engine answers and the entry learns
        if evidence.fit is None:
            evidence.fit = _fit(evidence.similarities, evidence.correct, prior_t)
        t, gamma, t_error = evidence.fit
        return exploration_probability(similarity, t, gamma, t_error, delta)

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._evidence.pop(key, None)


def _hnsw(vectors: Vector) -> Any:
    from usearch.index import Index  # only for large groups

    index = Index(ndim=vectors.shape[1], metric="ip", dtype="f32")
    index.add(np.arange(len(vectors)), vectors)
    return index


def exploration_probability(similarity: float, t: float, gamma: float, t_error: float, delta: float) -> float:
    """τ: the least exploration that keeps P(wrong answer) ≤ δ, over confidence bands of the threshold.
    Below the fitted threshold (the curve says a wrong answer is likelier) it is 1: the paper's rule would
    still serve such answers at rate δ, spending the error budget on answers known to be doubtful."""
    if similarity < t:
        return 1.0
    best = 1.0
    for epsilon in _EPSILONS:
        t_pessimistic = t + _Z[epsilon] * t_error
        likely = (1 - epsilon) * _sigmoid(gamma * (similarity - t_pessimistic))
        if likely >= 1.0:
            return 0.0
        best = min(best, ((1 - delta) - likely) / (1 - likely))
    return min(1.0, max(0.0, best))


def _fit(similarities: list[float], correct: list[int], prior_t: float) -> tuple[float, float, float]:
    """MAP logistic fit of P(correct | s) (parameters t, γ; Gaussian prior at (prior_t, _PRIOR_GAMMA)) by
    Newton's method; the standard error of t from the posterior's curvature (Laplace)."""
    s = np.asarray(similarities, dtype=np.float64)
    c = np.asarray(correct, dtype=np.float64)
    prior = np.array([prior_t, _PRIOR_GAMMA])
    scale = np.array([0.1, 15.0])  # prior standard deviations of t and γ (× 1/√_PRIOR_WEIGHT)
    precision = _PRIOR_WEIGHT / scale**2
    theta = prior.copy()
    hessian = np.diag(precision)
    for _ in range(25):
        t, gamma = theta
        p = 1 / (1 + np.exp(-gamma * (s - t)))
        w = p * (1 - p)
        # gradients of the negative log posterior with respect to (t, γ)
        d_t, d_g = -gamma * np.ones_like(s), s - t
        residual = p - c
        grad = np.array([np.sum(residual * d_t), np.sum(residual * d_g)]) + precision * (theta - prior)
        jac = np.stack([d_t, d_g])
        hessian = (jac * w) @ jac.T + np.diag(precision)
        step = np.linalg.solve(hessian, grad)
        theta = theta - step
        theta[1] = max(theta[1], 1.0)  # the curve rises with similarity
        if float(np.abs(step).max()) < 1e-6:
            break
    covariance = np.linalg.inv(hessian)
    return float(theta[0]), float(theta[1]), math.sqrt(max(float(covariance[0, 0]), 0.0))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x > -60 else 0.0
