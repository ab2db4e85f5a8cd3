"""Batch jobs: OpenAI's Files and Batch API over a durable line queue (jobs.py: the batches; queue.py: the
line queue's contract, kept in SQL rows by queue_sql.py or in Redis Streams by queue_redis.py; the tables
in store/), run on spare capacity by the runner (runner.py) through the gateway's own pipeline; results.py
writes a finished batch's files, retries.py backs off a batch whose check or finalising raised."""

from corral.batch.files import ENDPOINTS, BatchInput, check_upload, read_batch_input
from corral.batch.jobs import BatchRecord, BatchStore, NewBatch, TooManyBatches
from corral.batch.queue import BatchLine, LineQueue, LineResult
from corral.batch.runner import BatchRunner, LineExecutor

__all__ = [
    "ENDPOINTS",
    "BatchInput",
    "BatchLine",
    "BatchRecord",
    "BatchRunner",
    "BatchStore",
    "LineExecutor",
    "LineQueue",
    "LineResult",
    "NewBatch",
    "TooManyBatches",
    "check_upload",
    "read_batch_input",
]
