"""Registered clients."""

from __future__ import annotations

from fastapi import APIRouter

from pagekeeper.rest.deps import RuntimeDep
from pagekeeper.rest.schemas import ClientModel

router = APIRouter(tags=["clients"])


@router.get("/v1/clients", response_model=list[ClientModel], summary="Registrations and leases.")
async def list_clients(runtime: RuntimeDep) -> list[ClientModel]:
    now = runtime.now()
    return [
        ClientModel(
            client_id=c.client_id,
            role=c.role,
            name=c.name,
            device=c.device,
            generation=c.generation,
            lease_ttl_s=c.lease_ttl_s,
            lease_remaining_s=c.expires_at - now,
            kernel_block_sizes=list(c.kernel_block_sizes),
            num_requests=len(c.request_ids),
            revoked_request_ids=sorted(c.revoked),
            last_step_id=c.last_step_id,
            num_steps=c.num_steps,
            identity=c.identity,
        )
        for c in runtime.state.clients()
    ]
