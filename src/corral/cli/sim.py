"""`corral sim`: simulated vLLM replicas timed by the performance model.

LoRA flags are vLLM's: `--enable-lora`, `--max-loras`, `--max-lora-rank`, `--max-cpu-loras` and
`--lora-modules name=path [name=path ...]` (or vLLM's JSON form); the load/unload endpoints exist when
VLLM_ALLOW_RUNTIME_LORA_UPDATING is `1` or `true`, as in vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from typing import Annotated

import typer

from corral.cli.app import FlagsCommand, LogLevel, app, console, fail, run_async, setup_logging

__all__ = ["sim_command"]


@app.command("sim", cls=FlagsCommand, context_settings={"allow_extra_args": True})
def sim_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="model from the perf catalog")],
    gpu: Annotated[str, typer.Option(help="GPU type from the perf catalog")],
    served_name: Annotated[
        str | None, typer.Option(help="model name clients use (default: the catalog name)")
    ] = None,
    quant: Annotated[str | None, typer.Option(help="weight format")] = None,
    tp: Annotated[int, typer.Option(help="tensor parallel size")] = 1,
    pp: Annotated[int, typer.Option(help="pipeline parallel size")] = 1,
    replicas: Annotated[int, typer.Option(help="replicas to run in this process, on consecutive ports")] = 1,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="first port (0: any free port)")] = 9000,
    time_scale: Annotated[float, typer.Option(help="simulated seconds per wall-clock second")] = 1.0,
    max_model_len: Annotated[
        int | None, typer.Option(help="tokens of context per sequence (default: the model's)")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="sequences batched at once, as vLLM's flag")] = 256,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="tokens per engine step, as vLLM's flag")
    ] = 2048,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="share of GPU memory for weights and KV, as vLLM's flag")
    ] = 0.9,
    kv_cache_gib: Annotated[
        float | None, typer.Option(help="fix the KV cache size instead of deriving it")
    ] = None,
    no_prefix_caching: Annotated[
        bool, typer.Option("--no-prefix-caching", help="simulate vLLM without its prefix cache")
    ] = False,
    embed_dim: Annotated[
        int | None, typer.Option(help="serve /v1/embeddings with vectors of this size (an embedding model)")
    ] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(
            help="publish KV-cache events there as vLLM does (tcp://*:5557 and ipc:// paths bind, another "
            "address connects); replica i publishes on the port + i (ipc://: the path + _dp<i>)"
        ),
    ] = None,
    eos: Annotated[
        bool,
        typer.Option(
            "--eos",
            help="end answers at a drawn end of sequence (16-256 tokens) even with max_tokens, as a model "
            "does (by default max_tokens is generated exactly, as vLLM's ignore_eos); a request's own "
            "ignore_eos decides for it",
        ),
    ] = False,
    enable_lora: Annotated[
        bool, typer.Option("--enable-lora", help="serve LoRA adapters, as vLLM's flag")
    ] = False,
    max_loras: Annotated[int, typer.Option(help="distinct adapters in one batch (GPU slots)")] = 1,
    max_lora_rank: Annotated[int, typer.Option(help="the largest adapter rank (a GPU slot's size)")] = 16,
    max_cpu_loras: Annotated[
        int | None, typer.Option(help="adapters held in host memory (default: --max-loras)")
    ] = None,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME=PATH",
            help='adapters to load at start: name=path or {"name": .., "path": .., "base_model_name": ..}; '
            "several may follow one flag, as vLLM's",
        ),
    ] = None,
    runtime_lora_updating: Annotated[
        str,
        typer.Option(
            "--allow-runtime-lora-updating",
            envvar="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
            help="1 or true: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's variable)",
            hidden=True,
        ),
    ] = "0",
    log_level: Annotated[LogLevel, typer.Option(help="how much the simulator logs")] = LogLevel.warning,
) -> None:
    """Serve simulated vLLM replicas (OpenAI API, /health, /metrics) until Ctrl-C."""
    from corral.perf import CatalogError, load_catalog
    from corral.perf.calibration import calibrated_efficiency
    from corral.sim import LoraOptions, SimFleet, SimOptions, build_server, offset_endpoint, parse_lora_module

    setup_logging(log_level)
    if ctx.args and not lora_modules:
        fail(f"unexpected arguments: {' '.join(ctx.args)}", 2)
    try:
        modules = tuple(parse_lora_module(item) for item in [*(lora_modules or []), *ctx.args])
        lora = LoraOptions(max_loras, max_lora_rank, max_cpu_loras, modules) if enable_lora else None
    except ValueError as exc:
        fail(str(exc), 2)
    if modules and lora is None:  # vLLM does not start: its worker refuses the adapters
        fail("LoRA is not enabled. Use --enable-lora to enable LoRA.", 2)
    options = SimOptions(
        model=model,
        gpu=gpu,
        served_name=served_name,
        quant=quant,
        tp=tp,
        pp=pp,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_gib=kv_cache_gib,
        enable_prefix_caching=not no_prefix_caching,
        time_scale=time_scale,
        embed_dim=embed_dim,
        eos=eos,
        lora=lora,
        runtime_lora_updating=runtime_lora_updating.strip().lower() in ("1", "true"),
    )
    try:
        catalog, efficiency = load_catalog(), calibrated_efficiency()
        catalog.models.get(model), catalog.gpus.get(gpu)
    except CatalogError as exc:
        fail(str(exc), 2)

    async def serve() -> None:
        servers = [
            build_server(
                dataclasses.replace(
                    options, kv_events_endpoint=kv_events_endpoint and offset_endpoint(kv_events_endpoint, i)
                ),
                catalog,
                efficiency,
            )
            for i in range(replicas)
        ]
        fleet = SimFleet(servers, host=host)
        ports = [0] * replicas if port == 0 else [port + i for i in range(replicas)]
        await fleet.start(ports)
        console.print(
            f"simulating {options.served_name or model} on {gpu} (TP={tp}, PP={pp}) at "
            + ", ".join(fleet.urls)
        )
        # One URL per line on stdout, for scripts that start a fleet on --port 0.
        sys.stdout.write("".join(url + "\n" for url in fleet.urls))
        sys.stdout.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await fleet.stop()

    try:
        run_async(serve())
    except (ValueError, OSError) as exc:
        fail(str(exc), 2)
