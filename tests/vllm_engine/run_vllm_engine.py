"""Proof that vLLM's scheduler runs on pagekeeper: the same prompts through a real vLLM engine
with (a) vLLM's own KV-cache manager and (b) pagekeeper's, per configuration, compared on

- the generated tokens,
- each request's cached-token count (``RequestOutput.num_cached_tokens``),
- the engine's prefix-cache statistics (queries and hits, new and preempted requests),
- the page ids every manager call returned to the scheduler (lookups, allocations, tables),

plus the number of scheduling steps and preemptions, which must match too. Every
configuration gets a fresh ``pagekeeper serve`` (the project's own, from ``.venv``) on
loopback ephemeral ports, with a pool matching the engine's (pages = the engine's blocks,
page size = its block size, prefix caching alike). Configurations: pages of 32, 64 and 128
tokens, and pages of 128 with kernel blocks of 32 (the engine runs ``block_size=32`` while
pagekeeper allocates 128-token pages; compared with vLLM at ``block_size=128``); each with
prefix caching on and off; a small pool so requests are preempted. The engines hash with the
service's algorithm (sha256_cbor), except in ``page32-sha256`` and ``page128-k32-sha256``:
vLLM's default pickle-based "sha256", which the service cannot reproduce, so pages that
generated tokens fill are named by the hashes growths carry; those two also send one more
chat follow-up, whose previous answer filled a page (of 128 tokens, and of 32).

Run it with the vLLM side virtualenv's interpreter (``make test-vllm`` does)::

    /opt/vllm-engine/bin/python tests/vllm_engine/run_vllm_engine.py [--configs page32,...]
        [--json results.json] [--markdown table.md]

Exit status 0 when every configuration matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from _engine import EngineConfig, RunResult, run_engine  # noqa: E402
from _model import VOCAB_SIZE, build_tiny_llama  # noqa: E402

CAPACITY_TOKENS = 1024
"""KV cache of every configuration, in tokens: small enough that the first wave preempts."""
SERVICE_START_S = 60.0


@dataclass(frozen=True)
class Case:
    name: str
    page_size: int
    """pagekeeper's page size (and vLLM's block size in run a)."""
    kernel_block_size: int
    """The engine's block size in run b (its attention kernel's block)."""
    enable_prefix_caching: bool
    hash_algo: str = "sha256_cbor"
    """The engine's ``prefix_caching_hash_algo`` (both runs)."""

    @property
    def is_engine_hash(self) -> bool:
        """Whether the engine hashes unlike the service (vLLM's pickle-based "sha256")."""
        return self.hash_algo != "sha256_cbor"

    @property
    def local_socket(self) -> bool:
        """Whether the service also listens on its same-node socket (the scheduler then
        steps over it): the caching-on cases do, the others stay on gRPC."""
        return self.enable_prefix_caching

    @property
    def ratio(self) -> int:
        return self.page_size // self.kernel_block_size

    @property
    def num_pages(self) -> int:
        return CAPACITY_TOKENS // self.page_size + 1  # + the null page


CASES = [
    Case(f"page{p}{'-k' + str(k) if k != p else ''}{'' if on else '-nocache'}", p, k, on)
    for on in (True, False)
    for p, k in ((32, 32), (64, 64), (128, 128), (128, 32))
] + [
    Case(f"page{p}{'-k' + str(k) if k != p else ''}-sha256", p, k, True, "sha256")
    for p, k in ((32, 32), (128, 32))
]


# -- prompts ---------------------------------------------------------------------------------


def _waves(chat: bool = False) -> list[Any]:
    """Shared prefixes, a page-aligned prompt equal to a prefix, a prompt shorter than a
    page, duplicates; then multi-turn follow-ups (prompt + answer + more) and resubmissions;
    then, after a prefix-cache reset, a resubmission that must miss. ``chat``: one more
    follow-up, first in its wave, of r5 (250 tokens: its answer fills the rest of a
    128-token page, and of a 32-token one)."""
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB_SIZE) for _ in range(n)]

    system = rand(100)
    aligned = rand(64)
    first = [
        ("r0", system + rand(30)),
        ("r1", system + rand(20)),  # 120 tokens: its decode crosses 128
        ("r2", list(aligned)),
        ("r3", aligned + rand(180)),  # 244 tokens: its decode crosses 256
        ("r4", rand(20)),
        ("r5", rand(250)),  # its decode crosses 256 (page 1 of 128, page 7 of 32)
        ("r6", system + rand(200)),
    ]
    first.append(("r7", list(first[0][1])))
    tail8, tail9, tail10 = rand(20), rand(10), rand(40)

    def second(prompts: dict[str, list[int]], outputs: dict[str, list[int]]) -> list[Any]:
        wave = [
            ("r8", prompts["r0"] + outputs["r0"] + tail8),
            ("r9", list(prompts["r5"])),
            ("r10", system + tail9),
            ("r11", prompts["r4"] + outputs["r4"] + tail10),
        ]
        if chat:
            wave.insert(0, ("r14", prompts["r5"] + outputs["r5"] + tail14))
        return wave

    third = [("r12", list(first[0][1])), ("r13", system + rand(5))]
    tail14 = rand(30)  # drawn last: every other prompt is the same with or without it
    return [first, second, third]


# -- the service -----------------------------------------------------------------------------


def _pagekeeper_bin() -> str:
    return os.environ.get("PAGEKEEPER_BIN") or str(ROOT / ".venv" / "bin" / "pagekeeper")


@contextmanager
def pagekeeper_service(case: Case, workdir: Path) -> Iterator[str]:
    """A fresh ``pagekeeper serve`` with a pool matching ``case``; yields its gRPC address."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "ready.json"
    command = [
        _pagekeeper_bin(),
        "serve",
        "--grpc-address",
        "127.0.0.1:0",
        "--http-address",
        "127.0.0.1:0",
        "--ready-file",
        str(ready),
        "--num-pages",
        str(case.num_pages),
        "--page-size",
        str(case.page_size),
        "--max-model-len",
        "512",
        "--enable-prefix-caching",
        "true" if case.enable_prefix_caching else "false",
        "--publish-transport",
        "none",
        "--log-level",
        "warning",
    ]
    sockdir = None
    if case.local_socket:
        # A short directory: a unix socket path holds at most 107 bytes.
        sockdir = tempfile.mkdtemp(prefix="pk-vllm-")
        command += ["--local-socket", os.path.join(sockdir, "step.sock")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEKEEPER_")}
    env["PAGEKEEPER_DATA_DIR"] = str(workdir / "data")
    log_path = workdir / "service.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + SERVICE_START_S
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"pagekeeper serve did not start ({' '.join(command)}):\n"
                    + log_path.read_text(errors="replace")
                )
            time.sleep(0.02)
        yield json.loads(ready.read_text())["grpc_address"]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if sockdir is not None:
            shutil.rmtree(sockdir, ignore_errors=True)


# -- comparison ------------------------------------------------------------------------------


def compare(a: RunResult, b: RunResult) -> list[str]:
    """Every difference between run a (vLLM) and run b (pagekeeper), as messages."""
    problems = []
    if a.tokens != b.tokens:
        bad = [k for k in a.tokens if a.tokens[k] != b.tokens.get(k)]
        problems.append(f"generated tokens differ for {bad}")
    if a.num_cached_tokens != b.num_cached_tokens:
        problems.append(
            f"cached tokens: vLLM {a.num_cached_tokens} pagekeeper {b.num_cached_tokens}"
        )
    if a.prefix_stats != b.prefix_stats:
        problems.append(f"prefix-cache stats: vLLM {a.prefix_stats} pagekeeper {b.prefix_stats}")
    if (a.num_steps, a.num_preemptions) != (b.num_steps, b.num_preemptions):
        problems.append(
            f"steps/preemptions: vLLM {a.num_steps}/{a.num_preemptions} "
            f"pagekeeper {b.num_steps}/{b.num_preemptions}"
        )
    for i, (x, y) in enumerate(zip(a.calls, b.calls, strict=False)):
        if x != y:
            problems.append(f"call {i}: vLLM {x} pagekeeper {y}")
            break
    else:
        if len(a.calls) != len(b.calls):
            problems.append(f"{len(a.calls)} manager calls under vLLM, {len(b.calls)} pagekeeper")
    mispredicted = b.manager_stats.get("num_mispredicted", 0)
    if mispredicted:
        problems.append(f"{mispredicted} admissions mispredicted by the prefix mirror")
    return problems


def run_case(case: Case, model_dir: str, workdir: Path) -> dict[str, Any]:
    waves = _waves(chat=case.is_engine_hash)
    vllm_config = EngineConfig(
        case.page_size, case.num_pages, case.enable_prefix_caching, case.hash_algo
    )
    a = run_engine(model_dir, vllm_config, waves, manager="vllm")
    engine_config = EngineConfig(
        case.kernel_block_size,
        case.num_pages * case.ratio,
        case.enable_prefix_caching,
        case.hash_algo,
    )
    with pagekeeper_service(case, workdir / case.name) as address:
        b = run_engine(
            model_dir,
            engine_config,
            waves,
            manager="pagekeeper",
            page_ratio=case.ratio,
            address=address,
        )
    problems = compare(a, b)
    transport = b.manager_stats.get("transport")
    expected = "local" if case.local_socket else "grpc"
    if transport != expected:
        problems.append(f"the scheduler stepped over {transport}, not {expected}")
    return {
        "case": asdict(case),
        "problems": problems,
        "vllm": _summary(a),
        "pagekeeper": _summary(b),
        "tokens": a.tokens if not problems else {"vllm": a.tokens, "pagekeeper": b.tokens},
    }


OWNERSHIP = "page32-pool-ownership"


def run_pool_ownership(model_dir: str, workdir: Path, reference: RunResult) -> dict[str, Any]:
    """A vLLM engine's pages hold KV only in its own memory, so its pool must be its own.

    - Restart: a second engine on the same service (the first one's cached pages are still
      in the prefix cache, their KV gone with it) must drop them at start-up and generate
      exactly what a fresh vLLM does: tokens, cached-token counts, prefix-cache statistics.
    - Another client holding a request in the pool: the engine refuses to start.
    """
    from pagekeeper_client.client import PagekeeperClient

    case = next(c for c in CASES if c.name == "page32")
    config = EngineConfig(case.page_size, case.num_pages, case.enable_prefix_caching)
    problems = []
    with pagekeeper_service(case, workdir / OWNERSHIP) as address:
        run_engine(model_dir, config, _waves(), manager="pagekeeper", address=address)
        again = run_engine(model_dir, config, _waves(), manager="pagekeeper", address=address)
        for what in ("tokens", "num_cached_tokens", "prefix_stats"):
            if getattr(again, what) != getattr(reference, what):
                problems.append(f"restarted engine: {what} differ from vLLM's")
        other = PagekeeperClient(address)
        try:
            other.register("scheduler", name="another-scheduler", renew=False)
            other.admit("other", list(range(1, 100)))
            try:
                run_engine(model_dir, config, _waves(), manager="pagekeeper", address=address)
                problems.append("the engine started on a pool another client uses")
            except RuntimeError as exc:
                if "a pool of its own" not in str(exc):
                    problems.append(f"unexpected start-up error: {exc}")
        finally:
            other.close()
    return {
        "case": {"name": OWNERSHIP},
        "problems": problems,
        "vllm": _summary(reference),
        "pagekeeper": _summary(again),
        "tokens": again.tokens,
    }


def _summary(r: RunResult) -> dict[str, Any]:
    return {
        "wall_s": round(r.wall_s, 3),
        "start_s": round(r.start_s, 3),
        "num_steps": r.num_steps,
        "num_preemptions": r.num_preemptions,
        "num_calls": len(r.calls),
        "prefix_stats": r.prefix_stats,
        "num_cached_tokens": r.num_cached_tokens,
        "num_rpcs": r.num_rpcs,
        "rpcs_per_step": round(r.num_rpcs / r.num_steps, 3) if r.num_steps else 0.0,
        "manager_s": round(r.manager_s, 4),
        "manager_stats": r.manager_stats,
    }


def time_case(
    case: Case, model_dir: str, workdir: Path, rounds: int, replays: int
) -> dict[str, Any]:
    """Wall time of a whole pass over the waves, vLLM's manager vs pagekeeper's: ``rounds``
    engine instances per side in ABBA order, ``replays`` timed passes each (after a prefix
    cache reset); medians. A fresh service for every pagekeeper engine."""
    waves = _waves(chat=case.is_engine_hash)
    samples: dict[str, list[dict[str, float]]] = {"vllm": [], "pagekeeper": []}
    for index in range(rounds):
        order = ("vllm", "pagekeeper") if index % 2 == 0 else ("pagekeeper", "vllm")
        for side in order:
            if side == "vllm":
                config = EngineConfig(
                    case.page_size, case.num_pages, case.enable_prefix_caching, case.hash_algo
                )
                run = run_engine(model_dir, config, waves, manager="vllm", replays=replays)
            else:
                config = EngineConfig(
                    case.kernel_block_size,
                    case.num_pages * case.ratio,
                    case.enable_prefix_caching,
                    case.hash_algo,
                )
                with pagekeeper_service(case, workdir / f"{case.name}-timing-{index}") as address:
                    run = run_engine(
                        model_dir,
                        config,
                        waves,
                        manager="pagekeeper",
                        page_ratio=case.ratio,
                        address=address,
                        replays=replays,
                    )
            samples[side].extend(run.replays)

    def median(side: str, key: str, per_step: bool = False, best: bool = False) -> float:
        values = [
            r[key] / r["num_steps"] if per_step else r[key] for r in samples[side] if r["num_steps"]
        ]
        if not values:
            return 0.0
        return min(values) if best else statistics.median(values)

    return {
        "case": case.name,
        "num_samples": len(samples["vllm"]),
        "vllm_pass_s": median("vllm", "wall_s"),
        "pagekeeper_pass_s": median("pagekeeper", "wall_s"),
        "vllm_best_pass_s": median("vllm", "wall_s", best=True),
        "pagekeeper_best_pass_s": median("pagekeeper", "wall_s", best=True),
        "vllm_step_ms": 1000 * median("vllm", "wall_s", per_step=True),
        "pagekeeper_step_ms": 1000 * median("pagekeeper", "wall_s", per_step=True),
        "manager_step_ms": 1000 * median("pagekeeper", "manager_s", per_step=True),
        "rpcs_per_step": median("pagekeeper", "num_rpcs", per_step=True),
        "samples": samples,
    }


def timing_markdown(timings: list[dict[str, Any]]) -> str:
    lines = [
        "| configuration | passes per side | vLLM s/pass, median (best) "
        "| pagekeeper s/pass, median (best) | ratio of medians (pk / vLLM) | vLLM ms/step "
        "| pagekeeper ms/step | in pagekeeper's manager, ms/step | RPCs/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in timings:
        ratio = t["pagekeeper_pass_s"] / t["vllm_pass_s"] if t["vllm_pass_s"] else 0.0
        lines.append(
            f"| {t['case']} | {t['num_samples']} "
            f"| {t['vllm_pass_s']:.2f} ({t.get('vllm_best_pass_s', 0.0):.2f}) "
            f"| {t['pagekeeper_pass_s']:.2f} ({t.get('pagekeeper_best_pass_s', 0.0):.2f}) "
            f"| {ratio:.2f} | {t['vllm_step_ms']:.1f} | {t['pagekeeper_step_ms']:.1f} "
            f"| {t['manager_step_ms']:.2f} | {t['rpcs_per_step']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| configuration | match | steps | preempt. | hits / queries | manager calls "
        "| vLLM s | pagekeeper s | ratio | RPCs | RPCs/step | pagekeeper ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, b = r["vllm"], r["pagekeeper"]
        stats = a["prefix_stats"]
        hits = f"{stats.get('hits', 0)} / {stats.get('queries', 0)}"
        ratio = b["wall_s"] / a["wall_s"] if a["wall_s"] else 0.0
        ms = 1000 * b["manager_s"] / b["num_steps"] if b["num_steps"] else 0.0
        lines.append(
            f"| {r['case']['name']} | {'yes' if not r['problems'] else 'NO'} "
            f"| {a['num_steps']} | {a['num_preemptions']} | {hits} | {a['num_calls']} "
            f"| {a['wall_s']:.2f} | {b['wall_s']:.2f} | {ratio:.2f} | {b['num_rpcs']} "
            f"| {b['rpcs_per_step']:.2f} | {ms:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--markdown", type=Path, help="write the summary table here")
    parser.add_argument("--model-dir", type=Path, help="tiny model folder (default: a temp one)")
    parser.add_argument(
        "--timing",
        default="",
        help="comma-separated cases to time (ABBA engine instances, timed replays)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="engine instances per side")
    parser.add_argument("--replays", type=int, default=3, help="timed passes per instance")
    parser.add_argument(
        "--no-compare", action="store_true", help="skip the comparison (with --timing)"
    )
    args = parser.parse_args(argv)
    wanted = {c for c in args.configs.split(",") if c}
    timed = {c for c in args.timing.split(",") if c}
    known = [c.name for c in CASES] + [OWNERSHIP]
    unknown = (wanted | timed) - set(known)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {known}")
    cases = [c for c in CASES if not wanted or c.name in wanted]
    if args.no_compare:
        cases = []
    timings: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pk-vllm-") as tmp:
        model_dir = str(build_tiny_llama(args.model_dir or Path(tmp) / "model"))
        for case in CASES:
            if case.name in timed:
                timings.append(time_case(case, model_dir, Path(tmp), args.rounds, args.replays))
                print(f"== timed {case.name}", flush=True)
        results = []
        for case in cases:
            t0 = time.perf_counter()
            result = run_case(case, model_dir, Path(tmp))
            results.append(result)
            verdict = "OK" if not result["problems"] else "MISMATCH"
            print(f"== {case.name}: {verdict} ({time.perf_counter() - t0:.1f} s)", flush=True)
            for problem in result["problems"]:
                print(f"   {problem}", flush=True)
        # Every configuration generates the same tokens (pages of 128 with kernel blocks of
        # 32 included): greedy decoding over correct KV does not depend on the page layout
        # (compared on the requests both sent: the chat configurations send one more).
        first_ok = next((r for r in results if not r["problems"]), None)
        for r in results:
            if first_ok is None or r["problems"]:
                continue
            common = r["tokens"].keys() & first_ok["tokens"].keys()
            if any(r["tokens"][k] != first_ok["tokens"][k] for k in common):
                r["problems"].append(f"tokens differ from {first_ok['case']['name']}'s")
        if not args.no_compare and (not wanted or OWNERSHIP in wanted):
            page32 = next(c for c in CASES if c.name == "page32")
            t0 = time.perf_counter()
            reference = run_engine(
                model_dir,
                EngineConfig(page32.page_size, page32.num_pages, True),
                _waves(),
                manager="vllm",
            )
            result = run_pool_ownership(model_dir, Path(tmp), reference)
            results.append(result)
            verdict = "OK" if not result["problems"] else "MISMATCH"
            print(f"== {OWNERSHIP}: {verdict} ({time.perf_counter() - t0:.1f} s)", flush=True)
            for problem in result["problems"]:
                print(f"   {problem}", flush=True)
    table = markdown(results) if results else ""
    if timings:
        table += "\n" + timing_markdown(timings)
    print(table)
    if args.json:
        args.json.write_text(
            json.dumps({"results": results, "timings": timings}, indent=1, default=str)
        )
    if args.markdown:
        args.markdown.write_text(table)
    failed = [r["case"]["name"] for r in results if r["problems"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
