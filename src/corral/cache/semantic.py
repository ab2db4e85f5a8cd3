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
  exp(-γ (s - t))) per entry (MAP, with weak priors on t at the fixed threshold and on log γ). With the
  user's accepted false-hit rate δ, the request explores with probability τ = the least, over confidence
  levels 1 - ε, of [(1 - δ) - (1 - ε)·L'] / [1 - (1 - ε)·L'] (L' the curve at the band's pessimistic
  edge of t), else it is
  answered from the cache. An entry with no evidence always explores, and so does a request below the
  entry's fitted threshold (a deviation from the paper, which would serve those at rate δ), so a learned
  cache starts as safe as no cache and hits where its answers proved to be stable. An explored answer
  equal to its neighbour's is not indexed itself (the neighbour answers that question; its evidence stays
  in one place); a different one is, as a new entry.

The index is per group: a flat matrix (numpy) while small, an HNSW graph (usearch, built in a thread)
once a group passes `_HNSW_FROM` vectors. Measured on this machine (benchmarks/cache_quality.py, 384
dimensions): a flat search of 10,000 vectors takes 0.32 ms against 0.49 ms for usearch, of 100,000 9.5 ms
against 1.3 ms; building the graph of 100,000 takes 97 s.
Vectors are kept in the stored entries themselves, so the index is rebuilt from the store on start
(`ExactCache.rebuild`); a purge removes them at once, and a sweep every minute those of entries that
expired or were evicted (`ExactCache.sweep`); a group half of whose vectors are gone is compacted.
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
_NO_FIT = (math.nan, math.nan, math.nan)  # a fit that did not converge: always explore
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
    """The vectors of one exact context: rows of a matrix that doubles when full (written in place, so a
    lookup after an addition does not restack the group), and an HNSW graph once the group is large."""

    hnsw_from: int
    keys: list[str] = field(default_factory=list)
    matrix: Vector | None = None  # rows [0, len(keys)) are the vectors
    hnsw: Any = None  # usearch.Index once the group is large
    ids: dict[str, int] = field(default_factory=dict)  # key → row (and HNSW label)
    building: bool = False  # an HNSW graph is being built in a thread

    async def add(self, key: str, vector: Vector) -> None:
        if key in self.ids:
            return
        if self.matrix is None:  # (one row: most groups hold one entry; a tenant can make many groups)
            self.matrix = np.zeros((1, len(vector)), dtype=np.float32)
        if len(vector) != self.matrix.shape[1]:
            return  # another embedding model's vector (the context's digest names the model; defensive)
        row = len(self.keys)
        if row == len(self.matrix):
            self.matrix = np.concatenate([self.matrix, np.zeros_like(self.matrix)])
        self.matrix[row] = vector
        self.ids[key] = row
        self.keys.append(key)
        if self.hnsw is not None:
            self.hnsw.add(row, vector)
        elif len(self.keys) >= self.hnsw_from and not self.building:
            await self._to_hnsw()

    async def _to_hnsw(self) -> None:
        """Build the graph off the event loop (seconds for tens of thousands of vectors); the flat matrix
        answers meanwhile, and vectors added during the build join the graph after it."""
        assert self.matrix is not None
        self.building = True
        try:
            built = len(self.keys)
            index = await asyncio.to_thread(_hnsw, self.matrix[:built].copy())
            for row in range(built, len(self.keys)):
                index.add(row, self.matrix[row])
            self.hnsw = index
        finally:
            self.building = False

    def nearest(self, vector: Vector, removed: set[str]) -> Neighbour | None:
        if self.matrix is None or len(vector) != self.matrix.shape[1] or not np.isfinite(vector).all():
            return None
        if self.hnsw is not None:
            matches = self.hnsw.search(vector, 8)
            for label, distance in zip(matches.keys, matches.distances, strict=True):
                key = self.keys[int(label)]
                if key not in removed:
                    return Neighbour(key, 1.0 - float(distance))  # inner-product distance is 1 - cos
            return None
        scores = self.matrix[: len(self.keys)] @ vector
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
        """Forget entries (expired, evicted, purged). A group is compacted once half of it is gone (and
        dropped when all is), so removed vectors do not pile up."""
        touched: set[str] = set()
        for key in keys:
            group = self._group_of.get(key)
            if group is not None:
                self._removed.add(key)
                touched.add(group)
        for group in touched:
            members = self._groups[group]
            gone = [k for k in members.keys if k in self._removed]
            if members.building or len(gone) * 2 < len(members.keys):
                continue
            live = [members.ids[k] for k in members.keys if k not in self._removed]
            for key in gone:
                self._group_of.pop(key, None)
                self._removed.discard(key)
            if not live:
                del self._groups[group]
                continue
            assert members.matrix is not None
            compact = _Group(
                self._hnsw_from, keys=[members.keys[i] for i in live], matrix=members.matrix[live]
            )
            compact.ids = {k: i for i, k in enumerate(compact.keys)}
            self._groups[group] = compact  # (a large one gets its HNSW graph again at its next addition)

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
        if not math.isfinite(similarity):
            return
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
            evidence.fit = _fit(evidence.similarities, evidence.correct, prior_t) or _NO_FIT
        if evidence.fit is _NO_FIT or not math.isfinite(similarity):
            return 1.0  # no trustworthy curve: the engine answers
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
    if not similarity >= t:  # (NaN fails closed)
        return 1.0
    best = 1.0
    for epsilon in _EPSILONS:
        t_pessimistic = t + _Z[epsilon] * t_error
        likely = (1 - epsilon) * _sigmoid(gamma * (similarity - t_pessimistic))
        if likely >= 1.0:
            return 0.0
        best = min(best, ((1 - delta) - likely) / (1 - likely))
    return min(1.0, max(0.0, best))


def _fit(similarities: list[float], correct: list[int], prior_t: float) -> tuple[float, float, float] | None:
    """MAP logistic fit of P(correct | s) = σ(γ (s - t)) with Gaussian priors on t (at prior_t) and on
    log γ (at log _PRIOR_GAMMA), by Newton's method with backtracking in (t, log γ); the standard error of
    t from the posterior's curvature (Laplace). None when it does not converge (the caller explores)."""
    s = np.asarray(similarities, dtype=np.float64)
    c = np.asarray(correct, dtype=np.float64)
    prior = np.array([prior_t, math.log(_PRIOR_GAMMA)])
    precision = _PRIOR_WEIGHT / np.array([0.1, 0.5]) ** 2  # prior sd: 0.1 of cosine for t, ×1.6 for γ

    def loss(theta: np.ndarray[Any, Any]) -> float:
        z = np.exp(theta[1]) * (s - theta[0])
        # -log σ(z) for correct, -log(1 - σ(z)) for wrong, written to stay finite
        nll = np.sum(np.logaddexp(0.0, -z) * c + np.logaddexp(0.0, z) * (1 - c))
        return float(nll + 0.5 * np.sum(precision * (theta - prior) ** 2))

    theta = prior.copy()
    current = loss(theta)
    for _ in range(50):
        gamma = math.exp(theta[1])
        z = gamma * (s - theta[0])
        p = 0.5 * (1 + np.tanh(0.5 * z))  # σ(z) without overflow
        w = p * (1 - p)
        d_t, d_lg = -gamma * np.ones_like(s), z  # ∂z/∂t, ∂z/∂log γ
        jac = np.stack([d_t, d_lg])
        grad = jac @ (p - c) + precision * (theta - prior)
        hessian = (jac * w) @ jac.T + np.diag(precision)
        step = np.linalg.solve(hessian, grad)
        scale = 1.0
        while scale > 1e-4 and loss(theta - scale * step) > current:
            scale /= 2
        theta = theta - scale * step
        current = loss(theta)
        if float(np.abs(scale * step).max()) < 1e-7:
            break
    else:
        return None
    if not np.isfinite(theta).all():
        return None
    gamma = math.exp(theta[1])
    z = gamma * (s - theta[0])
    w = 0.25 * (1 - np.tanh(0.5 * z) ** 2)
    jac = np.stack([-gamma * np.ones_like(s), z])
    covariance = np.linalg.inv((jac * w) @ jac.T + np.diag(precision))
    return float(theta[0]), gamma, math.sqrt(max(float(covariance[0, 0]), 0.0))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x > -60 else 0.0
