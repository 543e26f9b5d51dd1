"""A multipart upload fed as a file: the S3 participant's encoder writes the branch's
bytes here and every ``part_size`` bytes go up as one part, a few at once, so a branch of
any size streams with bounded memory and each byte crosses the network once."""

from __future__ import annotations

import io
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Final

__all__ = ["PART_SIZE", "PartWriter"]

PART_SIZE: Final = 8 * 1024 * 1024
"""S3 wants parts of at least 5 MiB but for the last."""
_IN_FLIGHT: Final = 4  # parts uploading at once while the encoder goes on


class PartWriter(io.RawIOBase):
    """A file the encoder writes to; every ``part_size`` bytes become one part, uploaded
    by a few threads while encoding goes on (at most ``_IN_FLIGHT`` parts held), so memory
    stays bounded and each byte is sent once."""

    def __init__(self, client: Any, bucket: str, key: str, upload_id: str,
                 part_size: int) -> None:
        super().__init__()
        self._client, self._bucket, self._key, self._upload = client, bucket, key, upload_id
        self._part_size = part_size
        self._buf = bytearray()
        self._pos = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[str]] = []
        self.parts = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        self._buf += data
        self._pos += len(data)
        if len(self._buf) >= self._part_size:
            self._send()
        return len(data)

    def tell(self) -> int:
        return self._pos

    def _upload_part(self, number: int, body: bytes) -> str:
        out = self._client.upload_part(Bucket=self._bucket, Key=self._key,
                                       UploadId=self._upload, PartNumber=number, Body=body)
        return str(out["ETag"])

    def _send(self) -> None:
        self.parts += 1
        body = bytes(self._buf)
        self._buf.clear()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="twophase-s3")
        in_flight = [f for f in self._pending if not f.done()]
        if len(in_flight) >= _IN_FLIGHT:
            wait(in_flight, return_when=FIRST_COMPLETED)
        for f in self._pending:
            if f.done():
                f.result()  # a failed part fails the prepare now
        self._pending.append(self._pool.submit(self._upload_part, self.parts, body))

    def finish(self) -> list[str]:
        """Send what is left (an empty object is one empty part); the parts' ETags."""
        if self._buf or self.parts == 0:
            self._send()
        try:
            return [f.result() for f in self._pending]
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
