"""What both adapters share inside one process: the state, the publication hub, metrics,
wake-ups for streams, and the process's life cycle flags. Built once by :func:`build_runtime`
(from settings) and handed to the gRPC servicer and the FastAPI app factory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagekeeper.metrics import Metrics
from pagekeeper.notify import ChangeNotifier
from pagekeeper.publication import PublicationHub, PublisherFactory, resolve_publisher_factory
from pagekeeper.settings import Settings
from pagekeeper.state import Limits, ServiceState


@dataclass(eq=False)
class Runtime:
    settings: Settings
    state: ServiceState
    hub: PublicationHub
    metrics: Metrics
    clock: Callable[[], float]
    events: ChangeNotifier = field(default_factory=ChangeNotifier)
    """Woken after every mutation (KV events may have arrived)."""
    is_ready: bool = False
    """True once both servers listen; False again when shutdown starts."""
    is_stopping: bool = False

    def now(self) -> float:
        return self.clock()

    def begin_shutdown(self) -> None:
        """Refuse readiness and end streams so the servers can drain."""
        self.is_ready = False
        self.is_stopping = True
        self.events.notify()
        self.hub.notifier.notify()


def limits_from_settings(settings: Settings) -> Limits:
    return Limits(
        max_requests_per_step=settings.max_requests_per_step,
        max_tokens_per_step=settings.max_tokens_per_step,
        max_clients=settings.max_clients,
        lease_ttl_s=settings.lease_ttl_s,
        max_lease_ttl_s=settings.max_lease_ttl_s,
        lease_grace_s=settings.lease_grace_s,
        event_buffer_size=settings.event_buffer_size,
    )


def build_runtime(
    settings: Settings,
    *,
    clock: Callable[[], float] = time.time,
    publisher_factory: PublisherFactory | str | None = "auto",
) -> Runtime:
    """Create the pool and everything around it. ``publisher_factory="auto"`` resolves the
    configured transport (raises ConfigError when it is unavailable)."""
    if publisher_factory == "auto":
        factory = resolve_publisher_factory(settings.publish_transport, settings.publish_device)
    else:
        factory = publisher_factory  # type: ignore[assignment]
    hub = PublicationHub(
        settings.pool,
        transport=settings.publish_transport,
        depth=settings.ring_depth,
        max_num_reqs=settings.max_requests_per_step,
        max_num_tokens=settings.max_tokens_per_step,
        factory=factory,
    )
    state = ServiceState(
        settings.pool,
        limits_from_settings(settings),
        sink=hub,
        debug_invariants=settings.debug_invariants,
        clock=clock,
    )
    runtime = Runtime(settings=settings, state=state, hub=hub, metrics=Metrics(state), clock=clock)
    state.add_listener(runtime.events.notify)
    return runtime
