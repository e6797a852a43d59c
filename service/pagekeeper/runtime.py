"""What both adapters share inside one process: the state, the publication hub, metrics,
wake-ups for streams, durability, and the process's life cycle flags. Built once by
:func:`build_runtime` (from settings) and handed to the gRPC servicer and the FastAPI app
factory."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagekeeper.auth import ServerTokens, load_server_tokens
from pagekeeper.core.errors import PagekeeperError
from pagekeeper.durability import Durability, RecoveryReport
from pagekeeper.kvevents import KvEventPublisher
from pagekeeper.metrics import Metrics
from pagekeeper.notify import ChangeNotifier
from pagekeeper.publication import PublicationHub, PublisherFactory, resolve_publisher_factory
from pagekeeper.publish.api import RingGeometry, TablePublisher
from pagekeeper.settings import Settings
from pagekeeper.state import ConfigureLimitsCommand, Limits, ResumeLeasesCommand, ServiceState
from pagekeeper.tls import ServerTLS

log = logging.getLogger("pagekeeper")

CLOCK_STEP_S = 1.0
"""The wall clock moving this much more or less than the monotonic one between two reads
(the lease reaper reads it at least every second) is a step: every lease moves with it."""


@dataclass(eq=False)
class Runtime:
    settings: Settings
    state: ServiceState
    hub: PublicationHub
    metrics: Metrics
    clock: Callable[[], float]
    events: ChangeNotifier = field(default_factory=ChangeNotifier)
    """Woken after every mutation (KV events may have arrived)."""
    durability: Durability | None = None
    """The durable command log (None: ``durability = "none"``, or built in-process)."""
    recovery: RecoveryReport | None = None
    """What start-up recovered from the data directory."""
    tls: ServerTLS | None = None
    """The listeners' TLS material (set by the server; None: plaintext)."""
    kv_events: KvEventPublisher | None = None
    """The ZeroMQ KV-event publisher (set by the server when configured)."""
    tokens: ServerTokens = field(default_factory=lambda: ServerTokens(None, None))
    """The bearer tokens calls and admin endpoints must present (none: no check)."""
    is_ready: bool = False
    """True once both servers listen; False again when shutdown starts."""
    is_stopping: bool = False
    fatal: str = ""
    """Set when the process must stop because its state can no longer be made durable."""
    on_fatal: list[Callable[[str], None]] = field(default_factory=list)
    monotonic: Callable[[], float] = time.monotonic
    _last_read: tuple[float, float] | None = None

    def now(self) -> float:
        """The wall clock, for leases (they are journaled, so they survive restarts). A step
        of it (an NTP step, a resumed VM) since the last read is found here, before
        anything is stamped with the new time: every lease moves by the step first
        (journaled), keeping the real time it had left; a heartbeat served after the step
        is then not moved again, as it would be if the reaper's next tick moved them all."""
        before = self.monotonic()
        wall = self.clock()
        mono = self.monotonic()
        last = self._last_read
        self._last_read = (wall, mono)
        # Held between the two reads (stopped, starved): the pair says nothing, and is
        # only the reference for the next read.
        if last is not None and mono - before < CLOCK_STEP_S / 2:
            step = (wall - last[0]) - (mono - last[1])
            if abs(step) > CLOCK_STEP_S:
                self._clock_stepped(wall, step)
        return wall

    def _clock_stepped(self, wall: float, step: float) -> None:
        self.metrics.lease_resumes.labels("clock_jump" if step > 0 else "clock_back").inc()
        try:
            count = self.state.resume_leases(ResumeLeasesCommand(wall, "shift", step))
        except PagekeeperError as exc:  # a fenced state (its log failed: stopping)
            log.error("wall clock stepped %+.1fs; leases not moved: %s", step, exc.message)
            return
        log.warning(
            "the wall clock stepped %+.1fs: every lease moved with it (%d client(s))",
            step,
            count,
        )

    def begin_shutdown(self) -> None:
        """Refuse readiness and end streams so the servers can drain."""
        self.is_ready = False
        self.is_stopping = True
        self.events.notify()
        self.hub.notifier.notify()

    def fail(self, reason: str) -> None:
        """The durable log failed: stop serving (the supervisor restarts us, and recovery
        gives back the last durable state)."""
        if self.fatal:
            return
        self.fatal = reason
        self.is_ready = False
        for callback in self.on_fatal:
            callback(reason)

    def close(self) -> None:
        """Release the ring and, with durability, snapshot and close the data directory."""
        self.hub.close()
        if self.durability is not None:
            self.durability.close(self.state if not self.fatal else None)


def limits_from_settings(settings: Settings) -> Limits:
    return Limits(
        max_requests_per_step=settings.max_requests_per_step,
        max_tokens_per_step=settings.max_tokens_per_step,
        max_clients=settings.max_clients,
        lease_ttl_s=settings.lease_ttl_s,
        max_lease_ttl_s=settings.max_lease_ttl_s,
        lease_grace_s=settings.lease_grace_s,
        event_buffer_size=settings.event_buffer_size,
        event_buffer_bytes=settings.event_buffer_bytes,
    )


def _tracking_rings(factory: PublisherFactory, durability: Durability) -> PublisherFactory:
    """Record every ring file the service creates in the data dir, so that a successor can
    remove the ones a killed process leaves in /dev/shm."""

    def create(kind: str, geometry: RingGeometry) -> TablePublisher:
        publisher = factory(kind, geometry)
        durability.track_ring(publisher.descriptor().path)
        return publisher

    return create


def build_runtime(
    settings: Settings,
    *,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] | None = None,
    publisher_factory: PublisherFactory | str | None = "auto",
    durability: Durability | None = None,
    tokens: ServerTokens | None = None,
) -> Runtime:
    """Create the pool and everything around it. ``publisher_factory="auto"`` resolves the
    configured transport (raises ConfigError when it is unavailable).

    With ``durability`` (an opened data directory) the state is first recovered from it
    (raises :class:`pagekeeper.durability.DurabilityError` when it cannot be), then every
    later mutation is journaled there; changed limits and the restart's lease extension
    are logged as commands of their own. ``tokens``: the checked bearer tokens (default:
    read from ``settings``; a token file that does not load raises ConfigError)."""
    if tokens is None:
        tokens = load_server_tokens(settings)
    if publisher_factory == "auto":
        factory = resolve_publisher_factory(settings.publish_transport, settings.publish_device)
    else:
        factory = publisher_factory  # type: ignore[assignment]
    if durability is not None and factory is not None:
        factory = _tracking_rings(factory, durability)
    hub = PublicationHub(
        settings.pool,
        transport=settings.publish_transport,
        depth=settings.ring_depth,
        max_num_reqs=settings.max_requests_per_step,
        max_num_tokens=settings.max_tokens_per_step,
        factory=factory,
    )
    limits = limits_from_settings(settings)
    state = ServiceState(
        settings.pool,
        limits,
        # Recovery replays without publishing; the hub is attached once it is done.
        sink=hub if durability is None else None,
        debug_invariants=settings.debug_invariants,
        clock=clock,
    )
    report = None
    if durability is not None:
        report = durability.recover(state)
        durability.attach(state)
        if state.limits != limits:
            log.info("limits changed since the state was written: logging the new ones")
            state.configure_limits(ConfigureLimitsCommand(clock(), limits))
        # Exactly one full lease when one ran past that (the clock went back while the
        # service was down), else at least one.
        resumed = state.resume_leases(state.resume_command(clock()))
        if resumed:
            log.info("%d recovered client(s) get a fresh lease", resumed)
        state.attach_sink(hub)
    runtime = Runtime(
        settings=settings,
        state=state,
        hub=hub,
        metrics=Metrics(state),
        clock=clock,
        durability=durability,
        recovery=report,
        tokens=tokens,
        # A clock of the caller's without a monotonic one: steps are the caller's business
        # (the clock against itself never steps).
        monotonic=monotonic or (time.monotonic if clock is time.time else clock),
    )
    runtime.now()  # the reference for the first step
    if durability is not None:
        from pagekeeper.durability.metrics import DurabilityCollector

        runtime.metrics.registry.register(DurabilityCollector(durability))
        durability.on_failure = runtime.fail
    state.add_listener(runtime.events.notify)
    return runtime
