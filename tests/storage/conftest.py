"""The storage tier's servers: a real S3-compatible server (moto in server mode) on 127.0.0.1, reached
through s3fs exactly as a user's ``s3://`` URL is.

The server runs in its own process for the whole tier, with one bucket; ``s3_url`` gives each test a fresh
prefix in it. The endpoint and (fake) credentials are environment variables, which the ranks
``flatshard.testing.spawn`` starts inherit, so they reach the server too. s3fs caches filesystem instances
(and their endpoint), so the cache is cleared whenever the environment changes. ``local_cwd`` runs a test in
an empty working directory and checks afterwards that nothing was written there: a URL that went through
``pathlib`` would have become a local ``s3:`` directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import s3fs
import torch

import flatshard
from flatshard.testing import find_free_port
from flatshard.testing.models import Block, TinyGPT, make_batch

BUCKET = "flatshard-test"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    def fs(self) -> s3fs.S3FileSystem:
        return s3fs.S3FileSystem()  # endpoint and credentials from the environment, like a user's


def _wait_until_up(endpoint: str, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the moto server exited with status {process.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the moto server did not answer at {endpoint} in {timeout}s") from None
            time.sleep(0.1)


def set_endpoint(mp: pytest.MonkeyPatch, endpoint: str) -> None:
    """Point s3fs (in this process and in ranks spawned from it) at ``endpoint``."""
    mp.setenv("AWS_ENDPOINT_URL", endpoint)
    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def other_endpoint(endpoint: str, **env: str) -> Iterator[None]:
    """Within the block s3fs talks to ``endpoint`` (with more environment ``env``); the server's after it."""
    with pytest.MonkeyPatch.context() as mp:
        set_endpoint(mp, endpoint)
        for name, value in env.items():
            mp.setenv(name, value)
        yield
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="package")
def s3_server() -> Iterator[S3Server]:
    port = find_free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_up(endpoint, process)
        with pytest.MonkeyPatch.context() as mp:
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL"):
                mp.delenv(name, raising=False)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
            mp.setenv("AWS_CONFIG_FILE", os.devnull)
            mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
            set_endpoint(mp, endpoint)
            S3Server(endpoint, BUCKET).fs().mkdir(BUCKET)
            yield S3Server(endpoint, BUCKET)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def s3_url(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh prefix for this test: ``s3://<bucket>/<test name>-<random>``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def local_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty working directory (give it to spawned ranks too); nothing may be written into it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield cwd
    assert sorted(p.name for p in cwd.iterdir()) == [], "a URL was written as a local path"


def trained_tinygpt(seed: int = 0, steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A sharded TinyGPT (Block units) and its AdamW after ``steps`` steps: every rank alike."""
    torch.manual_seed(seed)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        model.loss(*make_batch(step, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer
