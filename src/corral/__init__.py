"""corral: a private, OpenAI-compatible inference cluster."""

__version__ = "0.1.0"
