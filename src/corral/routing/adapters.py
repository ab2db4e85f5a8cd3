"""LoRA adapters as routing sees them: which model id is an adapter of which base, and which replica holds
which adapter.

An adapter is served by its base model's replicas. Those of llama.cpp hold every adapter they were started
with (`Replica.adapters`, selected per request); those of vLLM (and the simulator) load adapters at run
time into `Replica.adapter_slots` slots, which the gateway fills and empties (`AdapterPlacement`):

- a request goes to a replica that holds its adapter (the routing policy picks among them);
- it is loaded on another replica when its demand calls for it: when its requests in flight fill more
  replicas than hold it (a replica's worth: the model's mean requests in flight per replica plus the
  spread margin), or its holder is full, and the least busy holder has more in flight than some other
  replica by that margin; one more replica at a time, at most every `spread_interval_s`, so a burst of
  one adapter spreads by measured demand instead of landing on every replica at once;
- the replica that loads it is the least costly: a free slot; else, among the replicas at most one request
  busier than the least busy, the one whose least recently used adapter (idle, and loaded at least
  `min_resident_s` ago: it is unloaded) is the least wanted, by its recent requests per copy held. Where
  every slot is busy, the least busy replica takes one adapter past its slots, given back once idle;
- it goes to a replica that can start it now, where one can (`Replica.max_loras`, vLLM's `--max-loras`:
  distinct adapters per batch): one running its adapter already, or fewer than `max_loras` distinct
  adapters (in flight from this gateway), and (`max_loras` > 1) where its tenant runs fewer than
  `max_loras` − 1 of them (joining its adapter already running there always can), so one tenant's long
  requests on many adapters spread rather than fill a batch. Where none can, it is placed as before and
  the engine queues it: a tenant holding every replica's batch places still delays others' new adapters
  (the gateway does not hold requests back for a batch place);
- a replica that refused to load a revision (its files missing or broken where it runs) is not chosen to
  load that revision for `_REFUSED_S`; one that refused what another replica loaded (its node is the
  trouble, not the adapter) is not chosen to load any adapter that long, unless no other replica can. (Each
  failed load frees its slot: else the refusing replica looks the cheapest loader for every new adapter.)
  Where every replica refused, a request is still placed, but a replica that refused in the last
  `ASK_AGAIN_S` is not asked again (the gateway's loader asks `refused_lately`): the request fails over at
  once, and the client's 503 says to come back then. This is the one memory of refusals.

Why the least wanted, and why only the least recently used: the engine keeps the adapters it holds in an
LRU cache of that many (vLLM's `max_cpu_loras`) whose unload endpoint only forgets the name (in the vLLM
the simulator follows), so loading one evicts the engine's least recently used whatever the gateway gives
up; the gateway gives up that one (else the engine reads the other again, unseen). What the gateway
chooses is the replica: one whose LRU adapter is rarely asked for, so that rare adapters churn among
themselves and the steadily asked ones stay. Copies take slots too, so an adapter is spread for
throughput, not for its share of the requests alone (docs/benchmarks/lora_routing.md: what each saves).

`min_resident_s` protects only the adapters within a replica's slots: past them, the least recently used
idle one is given back as soon as it is idle, so the gateway's account holds no more than the slots but
for requests in flight, as the engine's LRU does, and every load the engine makes is one the gateway
counts (`corral_adapter_loads_total`). Loads into the slots are bounded by the slots per
`min_resident_s`; a request for an adapter no replica holds, where every slot is busy or young, is loaded
past the slots rather than made to wait (an adapter asked for more often than that is best given more
slots: `lora.max_cpu_loras`). With `lora.placement: anywhere` the routing policy alone picks and the
replica loads what it lacks; neither `max_loras` nor that bound holds (no adapter-aware routing; for
comparison).

A request placed after a live apply replaced its adapter (it waited in the admission queue meanwhile) is
placed under the current revision (`catalogue`, the gateway's); the gateway's loader serves it so, or
refuses it where the adapter is gone (gateway/adapters.py).

Each gateway process keeps its own view; with several gateway workers two may load one adapter on
different replicas, and an adapter one unloaded that another still routes to is loaded again when its
engine answers that it does not know it (gateway/adapters.py); each counts only its own requests against
`max_loras`.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from corral.routing.replicas import Replica

__all__ = ["Adapter", "AdapterCatalogue", "AdapterPlacement", "Residence"]

_SPREAD_MARGIN = 4  # requests in flight a holder must carry beyond the least busy replica to spread
_LOADER_SLACK = 1  # a replica that loads may carry this many requests more than the least busy
_WANTED_HALF_LIFE_S = 60.0  # an adapter's requests, decayed: how much its copy is wanted
_LOAD_HISTORY_S = 60.0  # loads are shown per minute
_SHARE_HALF_LIFE_S = 7.0  # an adapter's share of the model's requests in flight, smoothed (τ ≈ 10 s)
_SHARE_SLACK = 0.2  # replicas an adapter needs: ceil(smoothed share − slack), so 1.1 replicas' worth is 1
_REFUSED_S = 30.0  # a replica that refused a load is passed by as a loader this long (see the module's text)
# ...and is not asked to load that revision again at all this long (a request placed there anyway, every
# replica having refused, fails over at once: the client's 503 says to come back then)
ASK_AGAIN_S = 5.0


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter as served now: its model id, its base, who may use it, and its engine name (the
    revision's: `name@digest`, so a replaced adapter never answers under the old one's name)."""

    name: str
    base: str
    engine_name: str
    path: str  # what the engines load (vLLM's lora_path): a local folder
    tenants: frozenset[str] = frozenset()
    rpm: int | None = None
    tpm: int | None = None
    placement: str = "affinity"  # or "anywhere" (lora.placement)

    def allows(self, tenant: str | None) -> bool:
        return not self.tenants or (tenant is not None and tenant in self.tenants)


class AdapterCatalogue:
    """The adapters the cluster serves, by model id (a live apply replaces a base's set)."""

    def __init__(self, adapters: Iterable[Adapter] = ()) -> None:
        self._by_name: dict[str, Adapter] = {a.name: a for a in adapters}
        self._bases = {a.base for a in self._by_name.values()}
        self.on_change: Callable[[], None] = lambda: None  # told after `replace` (the gateway's loader)

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def of(self, base: str) -> list[Adapter]:
        return [a for a in self._by_name.values() if a.base == base]

    def replace(self, base: str, adapters: Iterable[Adapter]) -> list[Adapter]:
        """`base`'s adapters are now `adapters`; the ones dropped or replaced (old revisions) are returned."""
        old = {a.name: a for a in self.of(base)}
        for name in old:
            del self._by_name[name]
        new = {a.name: a for a in adapters}
        self._by_name.update(new)
        self._bases = {a.base for a in self._by_name.values()}
        self.on_change()
        return [a for name, a in old.items() if new.get(name) != a]

    def has_adapters(self, base: str) -> bool:
        return base in self._bases

    def all(self) -> list[Adapter]:
        return list(self._by_name.values())

    def engine_names(self) -> set[str]:
        return {a.engine_name for a in self._by_name.values()}


@dataclass(slots=True)
class Residence:
    """One adapter revision loaded (or loading) on one replica."""

    engine_name: str
    adapter: str
    loaded_at: float
    last_used: float
    in_flight: int = 0
    loaded: bool = False  # the engine said it loaded it (not only asked to)
    tenants: dict[str, int] = field(default_factory=dict)  # its requests in flight by tenant


@dataclass(slots=True)
class _Holdings:
    """What one runtime-loading replica holds, least recently used first."""

    slots: int
    model: str
    started_at: float | None  # the engine process's start: a restarted one holds nothing
    resident: OrderedDict[str, Residence] = field(default_factory=OrderedDict)
    loads: list[float] = field(default_factory=list)  # when it loaded, over the last minute

    def loaded(self, now: float) -> int:
        self.loads = [t for t in self.loads if now - t < _LOAD_HISTORY_S]
        return len(self.loads)


class AdapterPlacement:
    """Which replica holds which adapter, and where an adapter's request goes (see the module's text)."""

    def __init__(
        self,
        min_resident_s: float = 10.0,
        spread_interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_resident_s = min_resident_s
        self.spread_interval_s = spread_interval_s
        self._holdings: dict[str, _Holdings] = {}  # replica id → its runtime-loaded adapters
        self._spread_at: dict[str, float] = {}  # adapter → when it last gained a replica
        self._share: dict[str, tuple[float, float]] = {}  # adapter → (when, smoothed share in replicas)
        self._in_flight: dict[str, int] = {}  # base model → adapter requests in flight
        self._adapter_in_flight: dict[str, int] = {}
        self._retired: set[str] = set()  # revisions no longer served, unloaded once their requests end
        self._asked: dict[str, tuple[float, float]] = {}  # adapter → (when, its requests decayed to then)
        # revision → {replica id: when it refused to load it}; replica id → when it refused what another
        # replica loaded (see `refused`)
        self._refusals: dict[str, dict[str, float]] = {}
        self._troubled: dict[str, float] = {}
        self._clock = clock
        # the adapters served now (set by the gateway's loader): a request's adapter replaced since it was
        # read is placed under its current revision
        self.catalogue: AdapterCatalogue | None = None

    # what a replica holds ----------------------------------------------------------------------------

    def _holding(self, replica: Replica) -> _Holdings:
        found = self._holdings.get(replica.id)
        if found is None or found.started_at != replica.started_at:
            found = self._holdings[replica.id] = _Holdings(
                replica.adapter_slots, replica.model, replica.started_at
            )
        found.slots = replica.adapter_slots
        return found

    def holds(self, replica: Replica, adapter: Adapter) -> bool:
        if adapter.name in replica.adapters:  # started with it (llama.cpp), whichever revision
            return True
        return replica.adapter_slots > 0 and adapter.engine_name in self._holding(replica).resident

    def can_serve(self, replica: Replica, adapter: Adapter) -> bool:
        return replica.adapter_slots > 0 or adapter.name in replica.adapters

    def resident(self, replica: Replica) -> list[str]:
        """The adapters (model ids) `replica` holds: those it started with, and those loaded."""
        holding = self._holding(replica) if replica.adapter_slots > 0 else None
        loaded = [r.adapter for r in holding.resident.values()] if holding else []
        return [*replica.adapters, *loaded]

    def loads_last_minute(self, replica: Replica) -> int:
        holding = self._holdings.get(replica.id)
        return holding.loaded(self._clock()) if holding else 0

    def keep(self, model: str, replica_ids: set[str]) -> None:
        """`model`'s replicas are now `replica_ids`: the holdings of those gone are forgotten."""
        for rid in [r for r, h in self._holdings.items() if h.model == model and r not in replica_ids]:
            del self._holdings[rid]

    # routing -----------------------------------------------------------------------------------------

    def candidates(self, adapter: Adapter, replicas: Sequence[Replica], tenant: str = "") -> list[Replica]:
        """The replicas the routing policy may pick from for a request of `adapter` (by `tenant`): of those
        that can start it now, its holders, one more where its demand calls for it, or (none holds it) the
        one that loads it at least cost (of them all, where none can start it now). Empty when no replica can
        serve it."""
        adapter = self._served(adapter)
        able = [r for r in replicas if self.can_serve(r, adapter)]
        if adapter.placement == "anywhere" or not able:
            return able
        every = len(able)
        able = [r for r in able if self._can_start(r, adapter, tenant)] or able
        holders = [r for r in able if self.holds(r, adapter)]
        if not holders:
            loaders = self._willing(adapter.engine_name, [r for r in able if r.adapter_slots > 0])
            if not loaders:  # every one refused it lately: placed anyway (the loader fails it over at once)
                return able
            loader = self._loader(adapter, loaders)
            return [loader] if loader is not None else able
        fixed = [r for r in holders if adapter.name in r.adapters]
        if fixed:  # llama.cpp's: every replica started with it is a holder; prefer the current revision
            return fixed
        need = self._needed(adapter, every)
        if len(holders) > need:  # more copies than its demand: the youngest go idle, LRU takes them back
            holders.sort(key=lambda r: self._holding(r).resident[adapter.engine_name].loaded_at)
            kept = holders[:need]
            if all(r.capacity is None or r.outstanding < r.capacity for r in kept):
                return kept
        if len(holders) < len(able) and self._wants_more(adapter, holders, able, need):
            others = self._willing(adapter.engine_name, [r for r in able if r not in holders])
            loader = self._loader(adapter, [r for r in others if r.adapter_slots > 0])
            if loader is not None:
                self._spread_at[adapter.name] = self._clock()
                return [*holders, loader]
        return holders

    def _needed(self, adapter: Adapter, able: int) -> int:
        """The replicas the adapter's demand needs: its requests in flight (this one counted) over a
        replica's worth (the model's requests in flight per replica, plus the spread margin a holder may
        carry beyond the least busy), smoothed over ~10 s so one moment's burst neither spreads it for
        good nor a lull takes its copies away. (Its share of the requests alone would copy a busy adapter
        that one replica carries well, and each copy takes a slot from another adapter.)"""
        now = self._clock()
        mine = self._adapter_in_flight.get(adapter.name, 0) + 1
        share = mine * able / (self._in_flight.get(adapter.base, 0) + 1 + _SPREAD_MARGIN * able)
        then, smoothed = self._share.get(adapter.name, (now, share))
        smoothed += (share - smoothed) * (1 - 0.5 ** ((now - then) / _SHARE_HALF_LIFE_S))
        self._share[adapter.name] = (now, smoothed)
        needed: int = math.ceil(float(smoothed) - _SHARE_SLACK)
        return max(1, needed)

    def _wants_more(self, adapter: Adapter, holders: list[Replica], able: list[Replica], need: int) -> bool:
        """The adapter's holders are too few: the least busy of them is busier than another replica by a
        margin, and either they are fewer than its demand needs, or it is full (others' demand: one
        adapter's burst does not hold another's requests on its replica); and it has not gained a replica
        in the last `spread_interval_s`."""
        now = self._clock()
        if now - self._spread_at.get(adapter.name, -math.inf) < self.spread_interval_s:
            return False
        calmest = min(holders, key=lambda r: r.outstanding)
        if calmest.outstanding < min(r.outstanding for r in able) + _SPREAD_MARGIN:
            return False
        if calmest.capacity is not None and calmest.outstanding >= calmest.capacity:
            return True
        return len(holders) < need

    def _can_start(self, replica: Replica, adapter: Adapter, tenant: str) -> bool:
        """Whether `replica`'s engine can run a request of `adapter` (by `tenant`) now: it runs that adapter
        already, or fewer than its `max_loras` distinct ones, of which (`max_loras` > 1) the tenant's are
        fewer than `max_loras` − 1 (see the module's text). Unknown `max_loras` (0): always."""
        limit = replica.max_loras
        if limit <= 0 or replica.adapter_slots <= 0 or adapter.name in replica.adapters:
            return True
        holding = self._holding(replica)
        own = holding.resident.get(adapter.engine_name)
        if own is not None and own.in_flight > 0:
            return True
        running = [r for r in holding.resident.values() if r.in_flight > 0]
        if len(running) >= limit:
            return False
        return not tenant or limit == 1 or sum(1 for r in running if r.tenants.get(tenant)) < limit - 1

    def _loader(self, adapter: Adapter, loaders: list[Replica]) -> Replica | None:
        """The replica of `loaders` (runtime-loading, willing) that loads the adapter at least cost: a free
        slot; else, of those at most `_LOADER_SLACK` requests busier than the least busy, the one giving up
        the least wanted idle old adapter; then the fewest requests in flight (one past its slots). None
        where `loaders` is empty."""
        if not loaders:
            return None
        now = self._clock()
        calmest = min(r.outstanding for r in loaders)
        copies = self._copies(loaders)
        best: tuple[int, bool, float, int, int] | None = None
        chosen = None
        for replica in loaders:
            holding = self._holding(replica)
            wanted = 0.0
            if len(holding.resident) < holding.slots:
                rank = 0
            elif (victim := self._evictable(holding, now, self.min_resident_s)) is not None:
                rank, wanted = 1, self._wanted(victim.adapter, now) / copies[victim.adapter]
            elif all(r.in_flight > 0 for r in holding.resident.values()):
                rank = 2  # every adapter in flight: it takes one past its slots
            else:
                rank = 3  # its idle adapters are all young: past its slots too, given back once idle
            busy = replica.outstanding > calmest + _LOADER_SLACK
            key = (rank, busy, wanted, replica.outstanding, len(holding.resident))
            if best is None or key < best:
                best, chosen = key, replica
        return chosen

    def _willing(self, revision: str, loaders: list[Replica]) -> list[Replica]:
        """`loaders` less those that refused to load `revision` in the last `_REFUSED_S`, and (while others
        remain) less those that refused what another replica loaded in that time."""
        if not self._refusals and not self._troubled:
            return loaders
        since = self._clock() - _REFUSED_S
        refusers = self._refusals.get(revision, {})
        willing = [r for r in loaders if refusers.get(r.id, since) <= since]
        return [r for r in willing if self._troubled.get(r.id, since) <= since] or willing

    def _forget_refusals(self, now: float) -> None:
        """Forget refusals older than `_REFUSED_S` (so that `_loader` reads none once they are all old)."""
        since = now - _REFUSED_S
        self._refusals = {
            revision: recent
            for revision, by in self._refusals.items()
            if (recent := {rid: t for rid, t in by.items() if t > since})
        }
        self._troubled = {rid: t for rid, t in self._troubled.items() if t > since}

    def _copies(self, replicas: list[Replica]) -> Counter[str]:
        """How many of `replicas` hold each adapter."""
        return Counter(r.adapter for replica in replicas for r in self._holding(replica).resident.values())

    def _wanted(self, adapter: str, now: float) -> float:
        """The adapter's requests, each counting half after `_WANTED_HALF_LIFE_S`."""
        then, asked = self._asked.get(adapter, (now, 0.0))
        return float(asked * 0.5 ** ((now - then) / _WANTED_HALF_LIFE_S))

    @staticmethod
    def _evictable(holding: _Holdings, now: float, min_resident_s: float | None = None) -> Residence | None:
        for residence in holding.resident.values():  # least recently used first
            if residence.in_flight == 0 and now - residence.loaded_at >= (min_resident_s or 0.0):
                return residence
        return None

    # a request's life --------------------------------------------------------------------------------

    def use(
        self, replica: Replica, adapter: Adapter, tenant: str = ""
    ) -> tuple[Residence | None, bool, list[Residence]]:
        """A request of `adapter` (by `tenant`) goes to `replica`: (its residence there, counted in flight
        until `done` (None: held from the replica's start); whether the replica must load it first; the
        adapters it must unload to make room)."""
        adapter = self._served(adapter)
        self._in_flight[adapter.base] = self._in_flight.get(adapter.base, 0) + 1
        self._adapter_in_flight[adapter.name] = self._adapter_in_flight.get(adapter.name, 0) + 1
        if adapter.name in replica.adapters or replica.adapter_slots <= 0:
            return None, False, []
        now = self._clock()
        self._asked[adapter.name] = (now, self._wanted(adapter.name, now) + 1.0)
        return self._reside(replica, adapter, now, tenant)

    def _reside(
        self, replica: Replica, adapter: Adapter, now: float, tenant: str
    ) -> tuple[Residence, bool, list[Residence]]:
        """The adapter's residence on `replica`, counted in flight (as `use`)."""
        holding = self._holding(replica)
        residence = holding.resident.get(adapter.engine_name)
        load = residence is None
        unload = []
        if residence is None:
            unload = self._make_room(holding, now, extra=1)
            residence = holding.resident[adapter.engine_name] = Residence(
                adapter.engine_name, adapter.name, now, now
            )
            holding.loads.append(now)
        else:
            holding.resident.move_to_end(adapter.engine_name)
            residence.last_used = now
        residence.in_flight += 1
        if tenant:
            residence.tenants[tenant] = residence.tenants.get(tenant, 0) + 1
        return residence, load, unload

    def _served(self, adapter: Adapter) -> Adapter:
        """The adapter's revision served now: a request read before a live apply replaced it is placed
        under the new one (on the same base; one removed, or moved, keeps its own: the loader refuses it)."""
        current = self.catalogue.get(adapter.name) if self.catalogue is not None else None
        if current is None or current is adapter or current.base != adapter.base:
            return adapter
        return current

    def revise(
        self,
        replica: Replica,
        residence: Residence | None,
        loading: bool,
        adapter: Adapter | None,
        tenant: str = "",
    ) -> tuple[Residence | None, bool, list[Residence]]:
        """A request placed under a revision no longer served (a live apply replaced or removed its adapter
        since) gives up its `residence` (`loading`: it was to load it, so the engine holds nothing) and, given
        `adapter` (its current revision), takes that one's on `replica`: (the residence, whether the replica
        must load it, what it must unload). Its counts in flight stay, for `done`."""
        unload = []
        holding = self._holdings.get(replica.id)
        if residence is not None:
            self._leave(residence, tenant)
            if holding is not None and holding.resident.get(residence.engine_name) is residence:
                if loading:
                    del holding.resident[residence.engine_name]
                elif residence.in_flight == 0 and residence.engine_name in self._retired:
                    del holding.resident[residence.engine_name]
                    unload.append(residence)
        if adapter is None or adapter.name in replica.adapters or replica.adapter_slots <= 0:
            return None, False, unload
        taken, load, room = self._reside(replica, adapter, self._clock(), tenant)
        return taken, load, [*unload, *room]

    def _make_room(self, holding: _Holdings, now: float, extra: int = 0) -> list[Residence]:
        """Unload idle adapters, least recently used first, while the replica holds more than its slots
        (counting `extra` about to be loaded). To make room for a load only those loaded at least
        `min_resident_s` ago go; past the slots (`extra` 0), any idle one goes."""
        gone = []
        while len(holding.resident) + extra > holding.slots:
            victim = self._evictable(holding, now, self.min_resident_s if extra else 0.0)
            if victim is None:
                break
            del holding.resident[victim.engine_name]
            gone.append(victim)
        return gone

    @staticmethod
    def _leave(residence: Residence, tenant: str) -> None:  # one request of `tenant` ended (or moved)
        residence.in_flight = max(0, residence.in_flight - 1)
        left = residence.tenants.pop(tenant, 0) - 1
        if left > 0:
            residence.tenants[tenant] = left

    def done(
        self, replica: Replica, adapter: Adapter, residence: Residence | None, tenant: str = ""
    ) -> list[Residence]:
        """The request (by `tenant`) ended (its residence from `use`): what the replica should now unload (a
        retired revision gone idle, or one past its slots gone idle)."""
        self._in_flight[adapter.base] = max(0, self._in_flight.get(adapter.base, 0) - 1)
        self._adapter_in_flight[adapter.name] = max(0, self._adapter_in_flight.get(adapter.name, 0) - 1)
        if residence is None:
            return []
        self._leave(residence, tenant)
        holding = self._holdings.get(replica.id)
        if holding is None or holding.resident.get(residence.engine_name) is not residence:
            return []  # (forgotten since: a failed load, a lost adapter, a restart)
        if residence.in_flight == 0 and residence.engine_name in self._retired:
            del holding.resident[residence.engine_name]
            return [residence]
        return self._make_room(holding, self._clock()) if len(holding.resident) > holding.slots else []

    def failed_load(self, replica: Replica, residence: Residence | None) -> None:
        """Loading failed, or the engine no longer knows it (restarted, or another gateway unloaded it):
        this residence is forgotten (not a newer one of the same revision)."""
        holding = self._holdings.get(replica.id)
        if residence is not None and holding is not None:
            if holding.resident.get(residence.engine_name) is residence:
                del holding.resident[residence.engine_name]

    def loaded(self, replica: Replica, revision: str, residence: Residence | None) -> None:
        """`replica` loaded `revision` (its `residence`): replicas that refused it lately are troubled."""
        if residence is not None:
            residence.loaded = True
        if not self._refusals and not self._troubled:
            return
        now = self._clock()
        self._forget_refusals(now)
        for rid in self._refusals.get(revision, {}):
            if rid != replica.id:
                self._troubled[rid] = now

    def refused_lately(self, replica: Replica, revision: str) -> bool:
        """Whether `replica` refused to load `revision` in the last `ASK_AGAIN_S`."""
        at = self._refusals.get(revision, {}).get(replica.id)
        return at is not None and self._clock() - at < ASK_AGAIN_S

    def refused(self, replica: Replica, revision: str) -> None:
        """`replica` refused to load `revision`: it is not chosen to load it for `_REFUSED_S`, nor any
        adapter where another replica holds that revision loaded (the replica's node is the trouble)."""
        now = self._clock()
        self._forget_refusals(now)
        self._refusals.setdefault(revision, {})[replica.id] = now
        for rid, holding in self._holdings.items():
            elsewhere = holding.resident.get(revision) if rid != replica.id else None
            if elsewhere is not None and elsewhere.loaded:
                self._troubled[replica.id] = now
                return

    def stale(self, current: set[str]) -> list[tuple[str, Residence]]:
        """Idle residences of revisions no longer served (a replaced or removed adapter), to unload; those
        still answering a request are unloaded when it ends (`done`)."""
        gone = []
        for rid, holding in self._holdings.items():
            for name, residence in list(holding.resident.items()):
                if name in current:
                    continue
                if residence.in_flight == 0:
                    del holding.resident[name]
                    gone.append((rid, residence))
                else:
                    self._retired.add(name)
        self._retired -= current  # (a revision served again)
        self._retired &= {n for h in self._holdings.values() for n in h.resident}  # (those gone: forgotten)
        return gone

    def snapshot(self, replica: Replica) -> dict[str, object]:
        holding = self._holding(replica) if replica.adapter_slots > 0 else None
        return {
            "adapters": self.resident(replica),
            "adapter_slots": replica.adapter_slots or None,
            "max_loras": replica.max_loras or None,
            "adapter_loads_last_minute": holding.loaded(self._clock()) if holding else 0,
        }
