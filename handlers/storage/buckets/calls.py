"""The RGW client behind its own executor: each blocking call on an ``s3`` thread, with a
deadline, and RGW's refusals translated into ``BucketError``.

Apart from the commands because this is the asyncio discipline of a blocking client, the same
for every command: a semaphore of the pool's size (the deadline starts when a thread takes the
call, not while it queues), a cancelled or timed-out call waited for until its thread has
ended (its effect is real, and a rollback that follows must see it), and no call once the API
is closing. What an RGW status means to a caller (NOT_FOUND, FAILED_PRECONDITION for bad
control-plane keys, ...) is decided in one place here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from handlers.settings.buckets import BucketsConfig
from handlers.storage.buckets.model import BucketError
from handlers.storage.buckets.rgw import RgwClient, RgwError

log = logging.getLogger("persys.buckets")

T = TypeVar("T")


def _log_failure(future: Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("building the S3 client failed (retried on first use): %s", exc)


async def _until_done(call: Future[Any]) -> None:
    """Wait until a call that already runs in its thread has ended, whatever its outcome
    (bounded: every RGW call has a client timeout); a call still queued is cancelled."""
    if call.cancel() or call.done():
        return
    with contextlib.suppress(Exception):  # its own error was answered already
        await asyncio.shield(asyncio.wrap_future(call))


class RgwCalls:
    """Runs ``RgwClient`` methods (``client``) on the ``s3`` thread pool it owns."""

    def __init__(self, config: BucketsConfig) -> None:
        self.config = config
        self.client = RgwClient(config)
        self._executor = ThreadPoolExecutor(max_workers=config.s3_workers,
                                            thread_name_prefix="s3")
        self._slots = asyncio.Semaphore(config.s3_workers)
        self._closed = False
        # build the boto3 client (~0.3 s of model loading) now, on an s3 thread, instead of in
        # the first RPC; a failure here is logged and happens again, answered, on first use
        self._executor.submit(self.client.s3).add_done_callback(_log_failure)

    async def aclose(self) -> None:
        """Refuse new calls, then stop the executor (calls are bounded) and the client."""
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._executor.shutdown(wait=True, cancel_futures=True))
        self.client.close()

    async def call(self, what: str, fn: Callable[..., T], *args: Any,
                   read_timeout: float | None = None, calls: int = 1) -> T:
        """Run ``fn(*args)`` on an s3 thread; RGW failures become ``BucketError``."""
        if self._closed:
            raise BucketError("UNAVAILABLE", "the bucket API is shutting down")
        read = read_timeout if read_timeout is not None else self.config.read_timeout_s
        deadline = (self.config.connect_timeout_s + read) * calls + 5.0
        # the deadline starts with the call, not while it waits for a thread: a listing of
        # thousands of buckets queues its calls on the pool's few threads
        async with self._slots:
            started = self._executor.submit(fn, *args)
            try:
                async with asyncio.timeout(deadline):
                    return await asyncio.wrap_future(started)
            except TimeoutError:
                await _until_done(started)
                raise BucketError("UNAVAILABLE",
                                  f"rgw {what}: no answer within {deadline:.0f}s") from None
            except RgwError as exc:
                raise self._translate(exc, what) from None
            except asyncio.CancelledError:
                # RPC cancelled (client deadline, shutdown): the thread's call still takes
                # effect; a rollback that follows must see what it made
                await _until_done(started)
                raise

    def _translate(self, exc: RgwError, what: str) -> BucketError:
        code = exc.code
        if exc.status == 0 or exc.status >= 500:
            return BucketError("UNAVAILABLE", f"rgw {what}: {exc} ({self.config.endpoint})",
                               rgw_code=code)
        if exc.status in (401, 403):
            return BucketError(
                "FAILED_PRECONDITION",
                f"rgw {what}: RGW refused the control-plane user ({code}); check "
                "PERSYS_RGW_ACCESS_KEY/PERSYS_RGW_SECRET_KEY and that the user has the caps "
                "'users=*;buckets=*' and owns the bucket", rgw_code=code)
        if exc.status == 404:
            return BucketError("NOT_FOUND", f"rgw {what}: {code}", rgw_code=code)
        if code in ("BucketAlreadyExists", "UserAlreadyExists"):
            return BucketError("ALREADY_EXISTS", f"rgw {what}: {code}", rgw_code=code)
        if code == "InvalidBucketName":
            return BucketError("INVALID_ARGUMENT", f"name: RGW rejected it ({code})",
                               rgw_code=code)
        if code == "BucketNotEmpty":
            return BucketError("FAILED_PRECONDITION", f"rgw {what}: {code}", rgw_code=code)
        return BucketError("INTERNAL", f"rgw {what}: {exc}", rgw_code=code)
