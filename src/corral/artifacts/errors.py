"""The artifacts package's errors: what `corral prepare` and a replica's start tell the user.

- `ArtifactError`: a model file or engine binary could not be obtained.
  - `ArtifactTimeout`: a step (a pip install, the llama.cpp build, a download) ran past its time limit and
    was stopped.
"""

from __future__ import annotations

__all__ = ["ArtifactError", "ArtifactTimeout"]


class ArtifactError(RuntimeError):
    """A model file or engine binary could not be obtained; the message says why and what to do."""


class ArtifactTimeout(ArtifactError):
    """A step ran past its time limit and was stopped; the message names the step, the limit and its last
    output."""
