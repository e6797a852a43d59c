"""A small pool put into a known state over gRPC, for the endpoint and browser tests.

Page size 16, prefix caching on, vLLM free-queue order (pages 1, 2, 3, ... handed out first):

    a: 100 tokens            -> pages 1-7   (1-6 full and cached, 7 partial)
    b: the same 100 tokens   -> hits 1-6 (now shared by a and b), new page 8
    c: 64 other tokens       -> pages 9-12, then freed: free but still cached
    d: 40 other tokens       -> pages 13-15

A worker registers with a backend that only takes 8-token kernel blocks, so its chosen kernel
block size is 8 (ratio 2: page p -> kernel blocks 2p, 2p+1).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.helpers.grpc_util import Scheduler, from_i32
from tests.helpers.server import RunningServer

NUM_PAGES = 256
SERVER_FLAGS = (
    "--num-pages",
    str(NUM_PAGES),
    "--page-size",
    "16",
    "--max-model-len",
    "2048",
    "--lease-ttl-s",
    "3600",
    "--max-lease-ttl-s",
    "3600",
)
SHARED_PAGES = [1, 2, 3, 4, 5, 6]
USED_PAGES = [7, 8, 13, 14, 15]
CACHED_PAGES = [9, 10, 11, 12]
EXPECTED_TOTALS = {
    "free": NUM_PAGES - 1 - len(SHARED_PAGES) - len(USED_PAGES) - len(CACHED_PAGES),
    "cached": len(CACHED_PAGES),
    "used": len(USED_PAGES),
    "shared": len(SHARED_PAGES),
    "null": 1,
}
KERNEL_BLOCK_SIZE = 8


@dataclass
class KnownState:
    scheduler: Scheduler
    worker_id: str
    request_ids: dict[str, str]
    """Short name (a, b, c, d) -> the request id used (unique per call)."""


def make_known_state(server: RunningServer, prefix: str = "req") -> KnownState:
    """Drive a fresh server (nothing allocated yet) into the state of the module docstring."""
    stub = server.stub()
    worker = stub.RegisterClient(
        pb.RegisterClientRequest(
            role=pb.CLIENT_ROLE_WORKER,
            name="worker-0",
            device="cpu",
            kernel_support=[
                pb.GroupKernelSupport(
                    group_id=0, backends=[pb.KernelBackend(name="FLASH", block_sizes=[8])]
                )
            ],
        ),
        metadata=server.metadata,
    )
    assert [k.kernel_block_size for k in worker.kernel_block_sizes] == [KERNEL_BLOCK_SIZE]
    scheduler = Scheduler(server, name="scheduler-0")
    ids = {name: f"{prefix}-{name}" for name in "abcd"}
    prompt = list(range(100))

    def pages(result: pb.AllocationResult) -> list[int]:
        assert result.status == pb.ALLOCATION_STATUS_OK, result
        return [p for group in result.hit_page_ids for p in from_i32(group)] + [
            p for group in result.new_page_ids for p in from_i32(group)
        ]

    assert pages(scheduler.admit(ids["a"], prompt)) == [1, 2, 3, 4, 5, 6, 7]
    b = scheduler.admit(ids["b"], prompt)
    assert b.num_cached_tokens == 96
    assert pages(b) == [1, 2, 3, 4, 5, 6, 8]
    assert pages(scheduler.admit(ids["c"], list(range(1000, 1064)))) == [9, 10, 11, 12]
    scheduler.free(ids["c"])
    assert pages(scheduler.admit(ids["d"], list(range(2000, 2040)))) == [13, 14, 15]
    return KnownState(scheduler=scheduler, worker_id=worker.client_id, request_ids=ids)
