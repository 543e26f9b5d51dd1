"""A private, throw-away S3-API server (moto's standalone server) for the tests and benches.

moto (``pip install 'moto[server]'``, in the ``dev`` extra) implements the S3 REST API,
multipart uploads included, in one Python process; it runs here on a free loopback port
with memory storage. It is started with request signing *enforced*: the first few
requests (unauthenticated) create an IAM user and its access key, and every request after
them must be signed with that key, so a wrong secret gets the same 403 as on AWS
(docs/decisions.md, "issue 14").
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from twophase.testing.servers import LocalServer, ServerUnavailable

__all__ = ["LocalS3", "S3Unavailable"]

_BOOTSTRAP_ACTIONS = 3  # create user, put its policy, create its access key
_ADMIN_POLICY = ('{"Version":"2012-10-17","Statement":'
                 '[{"Effect":"Allow","Action":"*","Resource":"*"}]}')


class S3Unavailable(ServerUnavailable):
    """moto is not installed or its server would not start."""


class LocalS3(LocalServer):
    """Start with :meth:`start` (or ``with``); :attr:`storage_options` are the boto3 client
    arguments a participant needs (endpoint, the created key, region)."""

    stop_timeout = 5.0
    region = "us-east-1"

    def __init__(self, *, port: int | None = None, base_dir: str | None = None) -> None:
        super().__init__(port=port, base_dir=base_dir)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key = ""
        self.secret_key = ""

    @property
    def storage_options(self) -> dict[str, str]:
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }

    def client(self, **override: Any) -> Any:
        """A boto3 S3 client signed with the server's key (``override`` replaces options)."""
        import boto3

        return boto3.client("s3", **(self.storage_options | override))

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def open_uploads(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        """Every multipart upload not completed nor aborted under ``prefix``."""
        found: list[dict[str, Any]] = []
        pages = self.client().get_paginator("list_multipart_uploads")
        for page in pages.paginate(Bucket=bucket, Prefix=prefix):
            found.extend(page.get("Uploads", []))
        return found

    def _log_tail(self) -> str:
        if self.dir is None:
            return ""
        log = self.dir / "moto.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def start(self, timeout: float = 60.0) -> LocalS3:
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
            raise S3Unavailable("moto's S3 server is not installed: pip install 'twophase[dev]' "
                                "(or pip install 'moto[server]' boto3)")
        self.dir = Path(tempfile.mkdtemp(prefix="twophase-s3-", dir=self._base_dir))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_BOOTSTRAP_ACTIONS)
        with open(self.dir / "moto.log", "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        self._wait_listening(timeout)
        self._create_key()
        return self

    def _wait_listening(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.stop()
                raise S3Unavailable(f"moto server exited at start:\n{tail}")
            try:
                # moto's own control API: answers without counting as an S3/IAM action
                if httpx.get(f"{self.endpoint}/moto-api/data.json", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise S3Unavailable(f"moto server not listening within {timeout}s:\n{tail}")
            time.sleep(0.1)

    def _create_key(self) -> None:
        """Spend the unauthenticated requests on a user with an access key; from now on
        the server checks every signature."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name=self.region,
                           aws_access_key_id="bootstrap",
                           aws_secret_access_key="bootstrap")  # noqa: S106 - not checked yet
        iam.create_user(UserName="twophase")
        iam.put_user_policy(UserName="twophase", PolicyName="all",
                            PolicyDocument=_ADMIN_POLICY)
        key = iam.create_access_key(UserName="twophase")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
