"""Batch jobs: OpenAI's Files and Batch API over a durable queue in the store (store/batch.py), run on
spare capacity by the runner (runner.py) through the gateway's own pipeline."""

from corral.batch.files import ENDPOINTS, BatchInput, check_upload, read_batch_input
from corral.batch.runner import BatchRunner, LineExecutor

__all__ = ["ENDPOINTS", "BatchInput", "BatchRunner", "LineExecutor", "check_upload", "read_batch_input"]
