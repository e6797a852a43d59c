"""Clients that a test kills with ``SIGKILL``.

    python -m tests.reliability.fault_clients scheduler ADDRESS
    python -m tests.reliability.fault_clients worker ADDRESS

``scheduler`` registers (printing ``registered <client_id>``), then steps forever: admits
requests, grows them, frees some, printing ``step <id>`` after each acknowledged step.
``worker`` registers with a shared-memory ring (printing ``registered <client_id> <ring
path>``) and reads every published step from it, printing ``read <step>``; it never
heartbeats, as a worker stuck in a kernel would not.
"""

from __future__ import annotations

import sys

import grpc
import numpy as np

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc
from pagekeeper_client.client import ring_from_pb
from pagekeeper_client.transports import open_table_view


def _i32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def scheduler(address: str) -> None:
    stub = pb_grpc.PagekeeperServiceStub(grpc.insecure_channel(address))
    reply = stub.RegisterClient(pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER))
    client_id, generation = reply.client_id, reply.generation
    print(f"registered {client_id}", flush=True)
    step_id = reply.last_published_step_seq
    running: list[str] = []
    n = 0
    while True:
        step_id += 1
        frees = running[:1] if len(running) > 6 else []
        running = running[len(frees) :]
        rid = f"{client_id}-r{n}"
        n += 1
        request = pb.StepRequest(
            client_id=client_id,
            generation=generation,
            step_id=step_id,
            free_request_ids=frees,
            growths=[
                pb.Growth(request_id=r, num_new_tokens=1, new_token_ids=_i32([n % 500]))
                for r in running
            ],
            admissions=[pb.Admission(request_id=rid, token_ids=_i32(list(range(n, n + 40))))],
            batch=pb.Batch(request_ids=[*running, rid]),
        )
        answer = stub.Step(request)
        statuses = {r.request_id: r.status for r in answer.results}
        ok = pb.ALLOCATION_STATUS_OK
        running = [r for r in running if statuses.get(r, ok) == ok]
        if statuses[rid] == pb.ALLOCATION_STATUS_OK:
            running.append(rid)
        print(f"step {step_id}", flush=True)


def worker(address: str) -> None:
    stub = pb_grpc.PagekeeperServiceStub(grpc.insecure_channel(address))
    reply = stub.RegisterClient(
        pb.RegisterClientRequest(role=pb.CLIENT_ROLE_WORKER, device="cpu", lease_ttl_ms=0)
    )
    view = open_table_view(ring_from_pb(reply.ring))
    print(f"registered {reply.client_id} {reply.ring.path}", flush=True)
    step = 0
    while True:
        step = view.latest_step() if step == 0 else step
        try:
            tables = view.wait(step + 1, timeout=0.5)
        except Exception:  # the ring moved on or a slot was overwritten: catch up
            step = view.latest_step()
            continue
        step = tables.step_seq
        print(f"read {step}", flush=True)


if __name__ == "__main__":
    role, address = sys.argv[1], sys.argv[2]
    {"scheduler": scheduler, "worker": worker}[role](address)
