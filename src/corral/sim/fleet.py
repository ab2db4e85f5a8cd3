"""Several simulated replicas in one process and event loop, each on its own port."""

from __future__ import annotations

from aiohttp import web

from corral.sim.server import SimServer

__all__ = ["SimFleet"]


class SimFleet:
    """Several simulated replicas in one process, each on its own port."""

    def __init__(self, servers: list[SimServer], host: str = "127.0.0.1") -> None:
        self._servers = servers
        self._host = host
        self._runners: list[web.AppRunner] = []
        self.urls: list[str] = []

    async def start(self, ports: list[int]) -> None:
        for server, port in zip(self._servers, ports, strict=True):
            runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
            await runner.setup()
            self._runners.append(runner)
            try:
                await web.TCPSite(runner, self._host, port).start()
            except OSError as exc:
                await self.stop()
                raise OSError(exc.errno, f"cannot listen on {self._host}:{port}: {exc.strerror}") from None
            self.urls.append(f"http://{self._host}:{runner.addresses[0][1]}")

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()

    async def stop_one(self, index: int) -> None:
        """One replica goes away (its port closes), the others serve on."""
        await self._runners[index].cleanup()
