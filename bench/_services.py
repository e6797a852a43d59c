"""Real service subprocesses and one interleaved decode-step loop, for the benchmarks that
compare services started side by side (``bench_durability.py``: durability levels;
``bench_tls.py``: plaintext, TLS, mutual TLS)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
for _sub in ("client", "service"):
    if str(REPO_ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / _sub))


def tokens(start: int, n: int) -> np.ndarray:
    return (np.arange(start, start + n) % 30000).astype(np.int32)


def order(i: int, n: int) -> list[int]:
    """Lanes in order on even samples, reversed on odd ones: drift hits every lane alike."""
    lanes = list(range(n))
    return lanes if i % 2 == 0 else lanes[::-1]


@contextmanager
def services(workdir: Path, per_service_args: Sequence[Sequence[str]]) -> Iterator[list[dict]]:
    """Start one ``pagekeeper serve`` per argument list (131,072 pages, ephemeral loopback
    ports, no publication, long leases, warnings only), all at once; yield each one's ready
    information (``grpc_address``, ...) once all are ready; stop them at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEKEEPER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "service"), str(REPO_ROOT / "client")])
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for k, args in enumerate(per_service_args):
            command = [
                sys.executable, "-m", "pagekeeper", "serve",
                "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
                "--ready-file", str(workdir / f"ready-{k}.json"), "--publish-transport", "none",
                "--num-pages", "131072", "--max-model-len", "8192",
                "--lease-ttl-s", "600", "--max-lease-ttl-s", "600",
                "--log-level", "warning", *args,
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        infos = []
        for k, proc in enumerate(procs):
            ready = workdir / f"ready-{k}.json"
            deadline = time.monotonic() + 60
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"service {k} ({per_service_args[k]}) did not start")
                time.sleep(0.02)
            infos.append(json.loads(ready.read_text()))
        yield infos
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def decode_step_medians(stubs: Sequence[Any], samples: int, batch: int = 64) -> list[float]:
    """Register a scheduler on each stub, admit ``batch`` 200-token requests, then time
    ``samples`` decode steps (one token per row, in columns, published as a batch) on every
    stub, interleaved; returns each stub's median Step round trip in seconds."""
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

    ids = [
        stub.RegisterClient(
            pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, lease_ttl_ms=600_000)
        ).client_id
        for stub in stubs
    ]
    rids = [f"r{i}" for i in range(batch)]
    admissions = [
        pb.Admission(request_id=r, token_ids=tokens(i * 1000, 200).tobytes())
        for i, r in enumerate(rids)
    ]
    times: list[list[float]] = [[] for _ in stubs]
    for step_id in range(1, samples + 2):
        if step_id == 1:
            fields: dict[str, Any] = {"admissions": admissions}
        else:
            fields = {
                "growth_columns": pb.GrowthColumns(
                    request_ids=rids, new_token_ids=tokens(step_id, len(rids)).tobytes()
                ),
                "batch": pb.Batch(request_ids=rids),
            }
        for k in order(step_id, len(stubs)):
            request = pb.StepRequest(client_id=ids[k], generation=1, step_id=step_id, **fields)
            started = time.perf_counter()
            stubs[k].Step(request)
            if step_id > 1:
                times[k].append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]
