"""The Ray runtime: each replica is a Ray actor, placed with a placement group that reserves its GPUs (and
CPUs) on the nodes of a Ray cluster; the actor starts and watches the engine process on its node.

What a replica reserves comes with its launch plan (`LaunchPlan.resources`, from its own deployment:
`ray_gpus`, `threads`; engines.Resources), so a model added or changed by `corral apply`, or a model's second
deployment, reserves what its spec says. Placement comes in two shapes:

- An engine that runs all its processes itself (llama.cpp, vLLM's default multiprocessing executor) gets
  one bundle with all its GPUs and CPUs, on one node (`STRICT_PACK`); the actor holds those GPUs, so Ray
  sets `CUDA_VISIBLE_DEVICES` to the devices it assigned and the engine inherits it (a per-replica device
  list from the spec would collide with other replicas Ray put on the same node, so it is dropped).
- An engine that starts its own Ray workers (vLLM's `--distributed-executor-backend ray`) gets one bundle
  per GPU, the form vLLM requires, plus the actor's CPUs in the first; `STRICT_PACK` keeps tensor
  parallel ranks on one node, `span_nodes` (`PACK`) lets pipeline stages use several. The engine gets the
  group's id in `CORRAL_RAY_PLACEMENT_GROUP` and the cluster in `RAY_ADDRESS`; vLLM's entry point
  (`engines/vllm_ray_entry.py`) hands the group to vLLM, which puts one worker in each GPU bundle.

When a node dies, its actors die with it: the supervisor sees the replica exit, stops routing to it at once,
and starts it again, on another node if the cluster has room.

An actor draws a free port on its node; the runtime books it (runtime.PortBook, by node address) until the
replica has stopped, and has the actor draw again where a live replica on that node holds it already.

The supervisor talks to this class only through the `ReplicaRuntime` interface; the gateway sees the same
replica set as with local processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import secrets
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.cluster.runtime import (
    AttachedReplica,
    NoRoom,
    PortBook,
    RunningReplica,
    die_with_parent,
    free_port,
    log_name,
    rotate_log,
)
from corral.engines import LaunchPlan, Resources
from corral.engines.devices import CPU_BIND

__all__ = ["RayRuntime", "bundles", "strategy"]

logger = logging.getLogger(__name__)

_THIS_MACHINES = ("CUDA_VISIBLE_DEVICES", CPU_BIND)

_LOG_CHECK_S = 2.0  # how often a replica's actor looks at its engine's log's size
_KILLED_WAIT_S = 10.0  # how long a stop waits for an engine it has killed before leaving it behind
_PORT_DRAWS = 64  # ports an actor draws before giving up on one that no live replica on its node holds


def bundles(resources: Resources) -> list[dict[str, float]]:
    """The placement group's bundles for a replica that reserves `resources` (the module's docstring)."""
    if not resources.engine_workers:
        return [{"CPU": resources.cpus, **({"GPU": float(resources.gpus)} if resources.gpus else {})}]
    out: list[dict[str, float]] = [{"GPU": 1.0} for _ in range(resources.gpus)] or [{}]
    out[0] = {**out[0], "CPU": resources.cpus}
    return out


def strategy(resources: Resources) -> str:
    return "PACK" if resources.engine_workers and resources.span_nodes else "STRICT_PACK"


class _EngineHost:
    """Runs inside the Ray actor, on the chosen node: starts the engine where the runtime says (`place`
    draws a port there) and watches and stops it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._log: tuple[Path, int, int] | None = None  # the engine's log, its largest size, copies kept

    def place(self) -> tuple[str, int, str]:
        """This node's address, a port nothing listens on there now (the runtime books it) and its Ray id."""
        import ray

        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return host, free_port(host), ray.get_runtime_context().get_node_id()

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        log_path: str,
        death_signal: int,
        log_limits: tuple[int, int],
        address: tuple[str, int],
    ) -> None:
        """Start the engine listening on `address` (host, port), its output appended to its log (rotated
        first where it is over the limit: an engine that crashes soon after each start)."""
        host, port = address
        command = [arg.format(host=host, port=port) for arg in argv]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log = (Path(log_path), *log_limits)
        rotate_log(*self._log)
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=die_with_parent(signal.Signals(death_signal)),  # as a local replica's (runtime.py)
            )

    def wait(self) -> int:
        """The engine's exit status, when it ends; meanwhile its log is rotated as a local replica's is (the
        log is on this node, out of the supervisor's reach)."""
        assert self._process is not None and self._log is not None
        while True:
            try:
                return self._process.wait(timeout=_LOG_CHECK_S)
            except subprocess.TimeoutExpired:
                rotate_log(*self._log)

    def stop(self, grace: float) -> None:
        """As a local replica's stop (runtime.LocalProcess): SIGTERM to the engine's process group, SIGKILL
        after `grace`, and SIGKILL to the group in the end, also where the engine had exited on its own, so
        nothing it started (vLLM's engine core and workers, holding GPU memory) outlives it."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                try:  # a process in an uninterruptible sleep (a GPU driver's hang) outlives even SIGKILL
                    process.wait(timeout=_KILLED_WAIT_S)
                except subprocess.TimeoutExpired:
                    logger.error(
                        "engine process %s did not exit %.0f s after SIGKILL; left behind, its GPUs may "
                        "still be held",
                        process.pid,
                        _KILLED_WAIT_S,
                    )
                    return
        self._signal_group(signal.SIGKILL)  # what the engine left in its group

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._process is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, sig)


def _seen(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: not logged as an exception nobody read


class RayReplica:
    """A replica running as an actor in a placement group; `on_stopped` is called once, when a stop has
    ended (its port may go to another replica on its node then)."""

    def __init__(
        self,
        actor: Any,
        group: Any,
        url: str,
        node_id: str,
        api_key: str | None = None,
        on_stopped: Callable[[], None] | None = None,
    ) -> None:
        self._actor = actor
        self._group = group
        self._on_stopped = on_stopped
        self.url = url
        self.api_key = api_key  # the engine's key for this run (the runtime's own where the plan has none)
        self.pid: int | None = None
        self.node_id = node_id
        self.log_path: Path | None = None  # on the actor's node, which may be another machine
        self._exit: concurrent.futures.Future[Any] = actor.wait.remote().future()

    async def wait(self) -> int:
        import ray

        try:
            return int(await asyncio.wrap_future(self._exit))
        except (ray.exceptions.RayError, ConnectionError) as exc:  # the actor or its node died, or Ray left
            logger.warning("replica actor at %s is gone: %s", self.url, type(exc).__name__)
            return -1

    async def stop(self, grace: float) -> None:
        try:
            await self._stop(grace)
        finally:
            stopped, self._on_stopped = self._on_stopped, None
            if stopped is not None:
                stopped()

    async def _stop(self, grace: float) -> None:
        import ray

        try:
            await asyncio.wait_for(self._actor.stop.remote(grace), grace + _KILLED_WAIT_S + 5)
        except (ray.exceptions.RayError, TimeoutError, ConnectionError) as exc:
            logger.info("replica actor at %s did not stop cleanly: %s", self.url, type(exc).__name__)
        else:  # the engine has exited: let its exit status leave the actor before the actor is killed
            status = asyncio.wrap_future(self._exit)
            status.add_done_callback(_seen)  # (`wait` reports it; a status that never came is no error here)
            await asyncio.wait([status], timeout=5)
        with contextlib.suppress(ray.exceptions.RayError, ValueError, ConnectionError):  # already gone
            ray.kill(self._actor)
        with contextlib.suppress(ray.exceptions.RayError, ValueError, ConnectionError):
            ray.util.remove_placement_group(self._group)  # frees the GPUs for the next placement


class RayRuntime:
    """Starts replicas on a Ray cluster (joined by address, or a local one started here)."""

    assigns_gpus = True  # its placement groups do; the plan's CUDA_VISIBLE_DEVICES is dropped

    def __init__(
        self,
        logs: Path,
        address: str | None = None,
        placement_timeout: float = 60.0,
        log_limits: tuple[int, int] = (100 * 1024 * 1024, 3),
    ) -> None:
        """`log_limits`: a replica log's largest size in bytes and the rotated copies kept (rotate_log)."""
        import ray

        self._address = address
        self._connect()
        self._logs = logs
        self._log_limits = log_limits
        self._timeout = placement_timeout
        self._host_class = ray.remote(num_cpus=0)(_EngineHost)
        self._ports = PortBook()  # by node address

    def _connect(self) -> None:
        """Join the Ray cluster, or join it again where the connection was lost (a head that restarted)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self._address, log_to_driver=False, include_dashboard=False)

    def cordon(self, node_id: str) -> None:
        """Ask Ray to place nothing new on a node (its running work goes on): GCS's drain-node request
        with the preemption reason, which `ray drain-node` and autoscaler v2 use. Ray then stops the node's
        raylet once it is idle: the node leaves the cluster (take the machine out, or start Ray on it
        again). Refused (ValueError) for the node this process runs on. The call is not part of Ray's stable
        API: where it is missing or refused, say so and go on (replicas are drained anyway)."""
        import ray

        if node_id == ray.get_runtime_context().get_node_id():
            raise ValueError(f"node {node_id} runs corral itself (the Ray driver): drain replicas instead")
        try:
            from ray.core.generated import autoscaler_pb2

            client = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)  # type: ignore[attr-defined]
            reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
            accepted, why = client.drain_node(node_id, reason, "corral drain", 0)
        except Exception as exc:  # an internal API: any failure only loses the cordon
            logger.warning("could not cordon Ray node %s (%s): new replicas may land on it", node_id, exc)
            return
        if not accepted:
            logger.warning("Ray refused to cordon node %s: %s", node_id, why)

    async def start(self, replica_id: str, plan: LaunchPlan) -> RunningReplica:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if plan.url is not None:
            return AttachedReplica(plan.url)
        self._connect()
        placement = plan.resources  # its deployment's (engines.Resources), as prepared with its plan
        wanted, packing = bundles(placement), strategy(placement)
        group = placement_group(wanted, strategy=packing)
        try:
            await asyncio.wait_for(group.ready(), self._timeout)
        except TimeoutError as exc:
            ray.util.remove_placement_group(group)
            raise NoRoom(f"no Ray node has room for {wanted} ({packing}) within {self._timeout:g}s") from exc
        except asyncio.CancelledError:  # drained (or stopped) while waiting for room: reserve nothing
            ray.util.remove_placement_group(group)
            raise
        actor: Any = self._host_class.options(
            # two threads: `wait` blocks one for the engine's life, so `stop` needs the other (with one, a
            # stop queued behind the wait until its timeout and the engine never got its grace period)
            max_concurrency=2,
            num_gpus=0 if placement.engine_workers else placement.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=0
            ),
        ).remote()
        # (the devices this machine's plan names: a node's are its own; vLLM's CPU build binds its own cores)
        env = {key: value for key, value in plan.env.items() if key not in _THIS_MACHINES}
        # An engine on a Ray node listens on the node's network address: one with no key of the spec's
        # (`engine_api_key`) gets one for this run, so only the gateway is served past corral's keys
        api_key = plan.api_key
        if api_key is None and plan.key_env is not None:
            api_key = env[plan.key_env] = secrets.token_urlsafe(32)
        if placement.engine_workers:
            env["CORRAL_RAY_PLACEMENT_GROUP"] = group.id.hex()
            env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        host, port, node_id = await self._launch(actor, group, replica_id, plan, env)
        release = functools.partial(self._ports.release, host, port)
        return RayReplica(actor, group, f"http://{host}:{port}", node_id, api_key, on_stopped=release)

    async def _launch(
        self, actor: Any, group: Any, replica_id: str, plan: LaunchPlan, env: dict[str, str]
    ) -> tuple[str, int, str]:
        """Start the engine in its actor, on a port booked for it on the actor's node: (host, port, node
        id). Where it does not start (or the start is cancelled: drained meanwhile), nothing is kept: the
        port, the actor and its placement group are let go."""
        import ray

        booked: tuple[str, int] | None = None
        try:
            for _ in range(_PORT_DRAWS):
                host, port, node_id = await actor.place.remote()
                if self._ports.book(host, port):
                    booked = (host, port)
                    break
            else:
                raise OSError(f"no free port that no replica holds came in {_PORT_DRAWS} draws on {host}")
            log = str(self._logs / log_name(replica_id))
            await actor.start.remote(
                list(plan.argv), env, log, int(plan.death_signal), self._log_limits, booked
            )
        except BaseException as exc:
            if booked is not None:
                self._ports.release(*booked)
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(actor)
            ray.util.remove_placement_group(group)
            if isinstance(exc, ray.exceptions.RayError):
                raise OSError(f"the replica actor failed to start: {exc}") from exc
            raise
        return host, port, node_id
