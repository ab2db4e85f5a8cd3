"""The `corral` command: the one place that wires configuration into objects for each command.

Each command module registers itself on the shared typer app; nothing else imports this package.
"""

from corral.cli import batch as _batch
from corral.cli import bench as _bench
from corral.cli import control as _control
from corral.cli import deploy as _deploy
from corral.cli import keys as _keys
from corral.cli import observe as _observe
from corral.cli import plan as _plan
from corral.cli import reference as _reference
from corral.cli import sim as _sim
from corral.cli import spec as _spec
from corral.cli import up as _up
from corral.cli import worker as _worker
from corral.cli.app import app, main

__all__ = ["app", "main"]

_COMMANDS = (_up, _control, _keys, _plan, _sim, _bench, _batch, _deploy, _observe, _spec, _reference, _worker)
