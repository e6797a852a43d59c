"""Prometheus view of the durable log: read from :class:`Durability` at scrape time (the
hot path pays for two counters and one timing per record, nothing else)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagekeeper.durability.recovery import Durability


class DurabilityCollector(Collector):
    def __init__(self, durability: Durability) -> None:
        self.durability = durability

    def collect(self) -> Iterator[Metric]:
        d = self.durability
        stats = d.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"pagekeeper_durability_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"pagekeeper_durability_{name}", doc, value=value)

        level = GaugeMetricFamily(
            "pagekeeper_durability_level",
            "Durability level in effect (1 for it).",
            labels=["level"],
        )
        level.add_metric([d.level.value], 1)
        yield level
        yield counter("records", "Commands committed to the log.", stats.num_records)
        yield counter("record_bytes", "Bytes of committed record bodies.", stats.num_bytes)
        yield counter("write_failures", "Log writes that failed.", stats.num_write_failures)
        yield counter("snapshots", "Snapshots written.", stats.num_snapshots)
        yield gauge("last_seq", "Sequence number of the last committed record.", d.last_seq)
        yield gauge(
            "records_since_snapshot",
            "Records a restart would replay.",
            d.num_records_since_snapshot,
        )
        yield gauge("last_snapshot_bytes", "Size of the last snapshot.", stats.last_snapshot_bytes)
        yield gauge(
            "last_snapshot_seconds", "Time the last snapshot took.", stats.last_snapshot_seconds
        )
        yield gauge(
            "last_snapshot_loop_seconds",
            "Of which the event loop was held (the rest, encoding and writing its file, ran in "
            "a worker thread).",
            stats.last_snapshot_loop_seconds,
        )
        usage = d.journal_usage
        if usage is not None:
            yield gauge(
                "journal_segments",
                "Journal segment files on disk (the one appended to, those a snapshot does "
                "not cover whole yet, and covered ones waiting for a checkpoint).",
                usage[0],
            )
            yield gauge("journal_bytes", "Bytes of the journal's segment files.", usage[1])
        checkpoints = d.checkpoint_stats
        if checkpoints is not None:
            yield counter(
                "checkpoints",
                "Background WAL checkpoints that copied every frame into the database file.",
                checkpoints.num_checkpoints,
            )
            yield counter(
                "checkpoints_incomplete",
                "Background checkpoints that left frames for the next one (a reader or "
                "commits in the way).",
                checkpoints.num_incomplete,
            )
            yield counter(
                "checkpoint_failures",
                "Background checkpoints that failed.",
                checkpoints.num_failures,
            )
            yield counter(
                "records_pruned",
                "Rows of a format-2 data dir a registered snapshot covered, deleted in "
                "batches by the checkpoint thread (off the event loop).",
                checkpoints.num_pruned,
            )
            yield gauge(
                "last_checkpoint_seconds",
                "Time the last background checkpoint took (off the event loop).",
                checkpoints.last_seconds,
            )
        append = GaugeMetricFamily(
            "pagekeeper_durability_append_seconds",
            "Commit time of the last 4,096 records: their median (stat=p50), 99th "
            "percentile (p99) and maximum (max). A gauge of recent values, not a summary.",
            labels=["stat"],
        )
        for name, value in stats.append_percentiles().items():
            append.add_metric([name], value)
        yield append
        report = d.report
        if report is not None:
            yield gauge(
                "recovery_replayed_records",
                "Records replayed at start-up.",
                report.num_replayed,
            )
            yield gauge(
                "recovery_dropped_records",
                "Records dropped at start-up after a damaged one (log tail corruption).",
                report.num_dropped,
            )
            yield gauge(
                "recovery_damaged",
                "1 when start-up found a damaged log tail.",
                1 if report.damage else 0,
            )
            yield gauge("recovery_seconds", "Start-up recovery time.", report.seconds)
            yield gauge(
                "stale_ring_files_removed",
                "Ring files of a crashed predecessor removed at start-up.",
                len(report.stale_ring_files),
            )
