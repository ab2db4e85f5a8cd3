from ..gateway.conftest import upstream  # noqa: F401  (the scripted upstream fixture)
