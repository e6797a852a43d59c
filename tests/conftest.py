"""Fixtures shared by every test directory.

``pagekeeper_server`` is one real server (subprocess, ephemeral loopback ports) shared by the
whole session: tests that use it register their own clients and request ids and never assume
global counts. Tests that need their own settings or kill the server use
``server_factory``, whose servers are stopped at the end of the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests.helpers.props import SCALE, examples
from tests.helpers.server import RunningServer, launch

if SCALE != 1:
    # Property tests that name no example count draw Hypothesis's 100, scaled like the rest.
    settings.register_profile("scaled", max_examples=examples(100))
    settings.load_profile("scaled")

SHARED_TOKEN = "test-token"
SHARED_ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="session")
def pagekeeper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server with a token and an admin token, a 512-page pool, stream-only publication,
    hour-long leases."""
    server = launch(
        tmp_path_factory.mktemp("pagekeeper-shared"),
        "--num-pages",
        "512",
        "--max-model-len",
        "4096",
        # Long leases and many clients: nothing expires or fills up in the background while
        # tests compare state before and after a call.
        "--lease-ttl-s",
        "3600",
        "--max-lease-ttl-s",
        "3600",
        "--max-clients",
        "10000",
        token=SHARED_TOKEN,
        admin_token=SHARED_ADMIN_TOKEN,
    )
    yield server
    server.stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """``start(*flags, **launch_kwargs)`` → a running server, stopped after the test."""
    servers: list[RunningServer] = []
    counter = iter(range(1_000_000))

    def start(*args: str, **kwargs: Any) -> RunningServer:
        server = launch(tmp_path / f"server-{next(counter)}", *args, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        if server.is_running():
            server.stop()
