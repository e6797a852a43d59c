"""An example scheduler: a realistic load driven through the pagekeeper client.

Requests share a few system prompts (so admissions hit the prefix cache), decode one token
per step until their output length, and finish; when pages run out the scheduler preempts
(frees the request and re-admits it later with everything it generated so far, hitting its
own cached pages). Every step publishes its batch, so registered workers can follow it.

Two modes show the client's two shapes:

- ``batched`` (default): ``allocate_slots`` queues growths that need a page, admissions
  are queued too, and ``step(batch=...)`` is the only call of the step. NO_CAPACITY comes
  back in the step's results; those requests are preempted (left out of the batch).
- ``sync``: what vLLM's scheduler needs -- a decode that crosses into a new page asks at
  once (``sync=True``), an admission is answered at once; on NO_CAPACITY the newest running
  request is preempted and the allocation retried. With ``--defer-page-ids`` a crossing the
  pool surely has room for is answered at once without a call (its ids come with the step).

Workers learn which request each row is over the step feed (``--feed-address``; see
:mod:`pagekeeper_client.examples.feed`); with ``--wait-workers N`` the scheduler waits for N
workers and for their acknowledgement of every step, like an engine waiting for outputs.

    python -m pagekeeper_client.examples.scheduler --address 127.0.0.1:50051 --steps 200

Environment: PAGEKEEPER_GRPC_ADDRESS, PAGEKEEPER_TOKEN, PAGEKEEPER_FEED_ADDRESS.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagekeeper_client.client import PagekeeperClient
from pagekeeper_client.errors import FailedPreconditionError, PagekeeperError
from pagekeeper_client.examples._cli import base_parser
from pagekeeper_client.examples.feed import FeedServer
from pagekeeper_client.types import AllocationStatus

log = logging.getLogger("pagekeeper.example.scheduler")

VOCAB = 32_000


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    max_output: int
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    """Output tokens the service has not seen yet (sent with the next growth)."""
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_done(self) -> bool:
        return len(self.output) >= self.max_output


@dataclass
class Summary:
    steps: int = 0
    admitted: int = 0
    readmitted: int = 0
    finished: int = 0
    preemptions: int = 0
    no_capacity_admissions: int = 0
    decoded_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    rpcs: int = 0
    local_answers: int = 0
    sync_steps: int = 0
    deferred_answers: int = 0
    ordering_flushes: int = 0
    published: int = 0
    worker_joins: int = 0
    """Workers that joined mid-run (each preempting the running requests)."""
    worker_failures: list[dict[str, Any]] = field(default_factory=list)
    prefix_hit_rate: float = 0.0
    transport: str = "grpc"

    def as_dict(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        times = sorted(self.step_seconds) or [0.0]
        return {
            "steps": self.steps,
            "admitted": self.admitted,
            "readmitted": self.readmitted,
            "finished": self.finished,
            "preemptions": self.preemptions,
            "worker_joins": self.worker_joins,
            "no_capacity_admissions": self.no_capacity_admissions,
            "decoded_tokens": self.decoded_tokens,
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "mean_batch": statistics.fmean(self.batch_sizes) if self.batch_sizes else 0.0,
            "rpcs_per_step": self.rpcs / steps,
            "local_answers": self.local_answers,
            "sync_steps": self.sync_steps,
            "deferred_answers": self.deferred_answers,
            "ordering_flushes": self.ordering_flushes,
            "published": self.published,
            "step_ms_p50": 1e3 * times[len(times) // 2],
            "step_ms_p99": 1e3 * times[min(len(times) - 1, int(len(times) * 0.99))],
            "prefix_hit_rate": self.prefix_hit_rate,
            "transport": self.transport,
            "worker_failures": self.worker_failures,
        }


class ExampleScheduler:
    def __init__(
        self, client: PagekeeperClient, args: argparse.Namespace, stop: threading.Event
    ) -> None:
        self.client = client
        self.args = args
        self.rng = random.Random(args.seed)
        self.system_prompts = [
            [
                self.rng.randrange(1, VOCAB)
                for _ in range(self.rng.randint(args.system_len_min, args.system_len_max))
            ]
            for _ in range(args.num_system_prompts)
        ]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_created = 0
        # Request ids are unique per pool, not per client: prefix them with ours.
        self.id_prefix = f"{client.client_id}/"
        self.summary = Summary()
        self.stop = stop
        self.feed: FeedServer | None = None
        self._finished_since_feed: list[str] = []
        self.step_rpcs = 0
        self._freed_now: list[str] = []

    # -- workload ---------------------------------------------------------------------
    def new_request(self) -> Request | None:
        if self.args.num_requests and self.num_created >= self.args.num_requests:
            return None
        rng = self.rng
        system = self.system_prompts[rng.randrange(len(self.system_prompts))]
        user = [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, self.args.user_len_max))]
        self.num_created += 1
        return Request(
            f"{self.id_prefix}req-{self.num_created}",
            system + user,
            max_output=rng.randint(self.args.output_len_min, self.args.output_len_max),
        )

    def sample(self, request: Request) -> None:
        """The "model output" of a scheduled request: one new token."""
        token = self.rng.randrange(1, VOCAB)
        request.output.append(token)
        request.unsent.append(token)

    # -- one step ---------------------------------------------------------------------
    def preempt(self, request: Request) -> None:
        self.client.free_later(request.request_id)
        self._freed_now.append(request.request_id)
        request.num_preemptions += 1
        request.unsent.clear()
        self.summary.preemptions += 1
        self.waiting.appendleft(request)

    def schedule_decodes(self) -> list[Request]:
        """One token for every running request, in order. In sync mode a decode that needs
        a page the pool cannot give preempts the newest running request (vLLM's rule) and
        retries; in batched mode NO_CAPACITY only shows in the step's results."""
        sync = self.args.mode == "sync"
        scheduled: list[Request] = []
        queue = deque(self.running)
        while queue:
            request = queue.popleft()
            is_preempted = False
            while True:
                got = self.client.allocate_slots(
                    request.request_id, 1, new_token_ids=request.unsent, sync=sync
                )
                if got.status is not AllocationStatus.NO_CAPACITY:
                    break
                victim = queue.pop() if queue else request
                self.preempt(victim)
                if victim is request:
                    is_preempted = True
                    break
            if is_preempted:
                continue
            if got.status is AllocationStatus.REJECTED:
                raise RuntimeError(f"growth of {request.request_id} rejected: {got.reason}")
            request.unsent = []
            scheduled.append(request)
        return scheduled

    def schedule_admissions(self) -> list[tuple[Request, bool]]:
        sync = self.args.mode == "sync"
        admitted: list[tuple[Request, bool]] = []
        budget = self.args.admit_per_step
        while budget and len(self.running) + len(admitted) < self.args.max_running:
            request = self.waiting.popleft() if self.waiting else self.new_request()
            if request is None:
                break
            resumed = request.num_preemptions > 0
            if request.request_id in self._freed_now:
                # Freed this very step for lack of pages: not before the next one.
                self.waiting.appendleft(request)
                break
            got = self.client.admit(request.request_id, request.tokens, sync=sync)
            if got.status is AllocationStatus.NO_CAPACITY:
                self.summary.no_capacity_admissions += 1
                self.waiting.appendleft(request)
                break
            if got.status is AllocationStatus.REJECTED:
                raise RuntimeError(f"admission of {request.request_id} rejected: {got.reason}")
            request.num_cached_tokens = got.num_cached_tokens
            admitted.append((request, resumed))
            budget -= 1
        return admitted

    def take_joined_workers(self) -> None:
        """Workers that connected since the last step get steps from this one. One that
        joins mid-run (a replacement for one that died) lacks every running request's KV
        and the prefix cache's: every running request is preempted (computed again from
        its next admission) and the prefix cache reset, so its checks hold from here."""
        assert self.feed is not None
        joined = self.feed.take_joined()
        if not joined or not self.summary.steps:
            return
        running, self.running = self.running, []
        for request in running:
            self.preempt(request)
        self.client.flush()
        try:
            dropped = self.client.reset_prefix_cache()
        except FailedPreconditionError as exc:
            log.warning("worker(s) %s joined; the prefix cache stays: %s", joined, exc.reason)
            dropped = 0
        self.summary.worker_joins += len(joined)
        log.info(
            "worker(s) %s joined mid-run: %d running request(s) preempted, %d cached page(s) "
            "dropped",
            ", ".join(joined),
            len(running),
            dropped,
        )

    def run_step(self) -> None:
        started = time.perf_counter()
        self._freed_now = []
        finished = [r for r in self.running if r.is_done]
        if finished:
            self.running = [r for r in self.running if not r.is_done]
            self.client.free_later(*(r.request_id for r in finished))
            self._freed_now.extend(r.request_id for r in finished)
            self.summary.finished += len(finished)
        if self.feed is not None:
            self.take_joined_workers()  # after the finished ones: those are not preempted
        decodes = self.schedule_decodes()
        self.running = list(decodes)  # admissions count against --max-running
        admissions = self.schedule_admissions()
        batch = [r.request_id for r in decodes] + [r.request_id for r, _ in admissions]
        result = self.client.step(batch=batch)
        left_out = set(result.unscheduled_request_ids)
        if self.args.mode == "batched":
            for rid in result.no_capacity:
                left_out.add(rid)
        rows: list[list[Any]] = []
        new: dict[str, list[int]] = {}
        append: dict[str, list[int]] = {}
        self.running = []
        for request in decodes:
            if request.request_id in left_out:
                self.preempt(request)
                continue
            self.running.append(request)
            rows.append([request.request_id, request.num_tokens, 1])
            append[request.request_id] = request.tokens[-1:]
            self.summary.decoded_tokens += 1
        by_id = result.by_request()
        for request, resumed in admissions:
            if request.request_id in left_out:
                self.summary.no_capacity_admissions += 1
                request.unsent.clear()
                self.waiting.appendleft(request)
                continue
            if request.request_id in by_id:
                request.num_cached_tokens = by_id[request.request_id].num_cached_tokens
            self.running.append(request)
            query_len = request.num_tokens - request.num_cached_tokens
            rows.append([request.request_id, request.num_tokens, query_len])
            new[request.request_id] = request.tokens
            self.summary.admitted += 1
            self.summary.readmitted += resumed
            self.summary.prefill_tokens += query_len
            self.summary.cached_tokens += request.num_cached_tokens
        elapsed = time.perf_counter() - started
        self.summary.step_seconds.append(elapsed)
        self.summary.steps += 1
        self.summary.batch_sizes.append(len(rows))
        self.summary.published += result.is_published
        if result.publish_error:
            log.warning("step %d not published: %s", result.step_id, result.publish_error)
        self._finished_since_feed.extend(self._freed_now)
        if self.feed is not None and result.is_published:
            self.feed.broadcast(
                {
                    "type": "step",
                    "step_seq": result.step_id,
                    "sent_at": time.time(),
                    "rows": rows,
                    "new": new,
                    "append": append,
                    "finished": self._finished_since_feed,
                }
            )
            self._finished_since_feed = []
            if self.args.wait_workers and not self.feed.wait_acks(
                result.step_id, self.args.ack_timeout
            ):
                raise RuntimeError(f"workers did not acknowledge step {result.step_id}")
        for request in self.running:
            self.sample(request)

    def run(self) -> Summary:
        args = self.args
        rpcs_before = self.client.stats.by_method.get("Step", 0)
        deadline = time.monotonic() + args.duration if args.duration else None
        while not self.stop.is_set():
            if args.steps and self.summary.steps >= args.steps:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            if (
                args.num_requests
                and self.num_created >= args.num_requests
                and not self.running
                and not self.waiting
            ):
                break
            self.run_step()
        self.step_rpcs = self.client.stats.by_method.get("Step", 0) - rpcs_before
        self.drain()
        return self.summary

    def drain(self) -> None:
        """Free everything still running (one step)."""
        ids = [r.request_id for r in self.running]
        self.running = []
        if ids:
            self.client.free_later(*ids)
        self.client.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = base_parser("pagekeeper_client.examples.scheduler", __doc__)
    p.add_argument(
        "--mode",
        choices=("batched", "sync"),
        default="batched",
        help="batched: one Step call a step; sync: a page-crossing decode or an admission "
        "is answered at once (as vLLM needs)",
    )
    p.add_argument(
        "--defer-page-ids",
        action="store_true",
        help="sync mode: answer crossings from the pool's free-page bound (sole scheduler)",
    )
    p.add_argument("--steps", type=int, default=200, help="stop after N steps (0: no limit)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0: none)")
    p.add_argument(
        "--num-requests", type=int, default=0, help="stop after N requests (0: no limit)"
    )
    p.add_argument("--max-running", type=int, default=64, help="requests running at once")
    p.add_argument("--admit-per-step", type=int, default=4, help="admissions per step at most")
    p.add_argument(
        "--num-system-prompts", type=int, default=3, help="shared prefixes the prompts start with"
    )
    p.add_argument("--system-len-min", type=int, default=64, help="shortest system prompt")
    p.add_argument("--system-len-max", type=int, default=256, help="longest system prompt")
    p.add_argument("--user-len-max", type=int, default=96, help="longest user part of a prompt")
    p.add_argument("--output-len-min", type=int, default=4, help="fewest tokens decoded")
    p.add_argument("--output-len-max", type=int, default=64, help="most tokens decoded")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument(
        "--feed-address",
        default=env.get("PAGEKEEPER_FEED_ADDRESS", "127.0.0.1:0"),
        help="where workers connect for request metadata ('' to disable; port 0: any)",
    )
    p.add_argument("--feed-file", help="write the feed's bound address here")
    p.add_argument("--wait-workers", type=int, default=0, help="wait for N workers, lockstep")
    p.add_argument(
        "--worker-timeout", type=float, default=60.0, help="seconds to wait for the workers"
    )
    p.add_argument(
        "--ack-timeout", type=float, default=60.0, help="seconds to wait for a step's acks"
    )
    p.add_argument("--summary-json", help="also write the summary here")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    client = PagekeeperClient(args.address, token=args.token, defer_page_ids=args.defer_page_ids)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    feed = None
    try:
        registration = client.register("scheduler", name=f"example-scheduler:{os.getpid()}")
        scheduler = ExampleScheduler(client, args, stop)
        log.info(
            "registered %s; pool of %d pages, page sizes %s; steps over %s",
            registration.client_id,
            registration.pool.num_pages,
            list(registration.pool.page_sizes),
            f"the same-node socket {registration.local_socket}"
            if client.transport == "local"
            else "gRPC",
        )
        if args.feed_address:
            feed = FeedServer(args.feed_address)
            scheduler.feed = feed
            log.info("step feed on %s", feed.address)
            if args.feed_file:
                tmp = args.feed_file + ".tmp"
                with open(tmp, "w") as f:
                    f.write(feed.address)
                os.replace(tmp, args.feed_file)
            if args.wait_workers and not feed.wait_for_workers(
                args.wait_workers, args.worker_timeout, stop
            ):
                if stop.is_set():
                    return 0
                log.error("only %d of %d workers connected", feed.num_workers, args.wait_workers)
                return 2
        summary = scheduler.run()
        # Calls made by the steps (the lease's heartbeats and the final drain excluded).
        summary.rpcs = scheduler.step_rpcs
        summary.local_answers = client.stats.num_local_answers
        summary.sync_steps = client.stats.num_sync_steps
        summary.deferred_answers = client.stats.num_deferred_answers
        summary.ordering_flushes = client.stats.num_ordering_flushes
        summary.transport = client.transport
        counters = client.pool_info().counters
        summary.prefix_hit_rate = counters.prefix_hit_rate
        if feed is not None:
            summary.worker_failures = feed.failures
    except PagekeeperError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if feed is not None:
            feed.close()
        client.close()
    report = summary.as_dict()
    print(json.dumps(report, indent=2))
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if report["worker_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
