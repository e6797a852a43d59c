"""``pagekeeper_client.vllm`` without vLLM (always run), and the proof with a real vLLM
engine (only under ``make test-vllm``, which sets ``PAGEKEEPER_VLLM_ENGINE=1``).

The engine proof runs ``run_vllm_engine.py`` with the vLLM side virtualenv's interpreter
(``$PAGEKEEPER_VLLM_VENV``, default ``/opt/vllm-engine``, built by
``scripts/vllm_engine_venv.sh``): the same prompts through vLLM's own KV-cache manager and
through pagekeeper's, compared token for token, cached-token count for cached-token count,
prefix-cache statistic for statistic and page id for page id.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekeeper.core.pool import PagePool
from pagekeeper_client.vllm import PrefixMirror, unsupported

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 1800


# -- without vLLM ----------------------------------------------------------------------------


def test_module_imports_without_vllm() -> None:
    # The client package never depends on vLLM: importing the adapter pulls none of it.
    code = (
        "import sys, pagekeeper_client.vllm as v; "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
        "print(v.make_scheduler_class.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "make_scheduler_class"


def test_scheduler_class_needs_vllm() -> None:
    import importlib.util

    import pagekeeper_client.vllm as adapter

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter")
    with pytest.raises(ImportError):
        adapter.PagekeeperScheduler  # noqa: B018 - the lazy attribute imports vLLM
    with pytest.raises(AttributeError):
        adapter.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018


def test_unsupported_names_the_feature() -> None:
    err = unsupported("speculative decoding")
    assert isinstance(err, NotImplementedError)
    assert "speculative decoding" in str(err)


def test_mirror_keeps_duplicates_in_insertion_order() -> None:
    mirror = PrefixMirror()
    mirror.insert(5, b"a")
    mirror.insert(6, b"b")
    mirror.insert(7, b"a")  # a duplicate waits behind page 5
    mirror.insert(8, b"a")
    assert mirror.lookup([b"a", b"b"], 2) == [5, 6]
    assert mirror.lookup([b"a", b"b"], 1) == [5]
    assert mirror.lookup([b"b", b"a"], 5) == [6, 5]
    assert mirror.evict(5)
    assert mirror.lookup([b"a"], 1) == [7]  # the oldest duplicate takes over
    assert mirror.evict(8) and not mirror.evict(8)
    assert mirror.lookup([b"a"], 1) == [7]
    mirror.forget_key(b"a")
    assert mirror.lookup([b"a"], 1) == [] and len(mirror) == 1
    mirror.clear()
    assert len(mirror) == 0 and mirror.key_of(6) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_mirror_matches_the_service_pool(seed: int) -> None:
    """The mirror sees what the engine sees (pages handed out, pages it fills) and must
    answer every lookup as the service's own index does, duplicates and evictions included."""
    rng = random.Random(seed)
    pool = PagePool(24, enable_caching=True)
    pool.ensure_groups(1)
    mirror = PrefixMirror()
    held: list[list[int]] = []
    hashes = [bytes([i]) * 8 for i in range(6)]
    for _ in range(120):
        op = rng.random()
        if op < 0.45 and pool.num_free_pages:
            pages = pool.allocate(rng.randint(1, min(3, pool.num_free_pages)))
            for page in pages:
                mirror.evict(page)  # what the engine does with every new page id
            held.append(pages)
        elif op < 0.75 and held:
            pages = rng.choice(held)
            uncached = [p for p in pages if not pool.is_cached(p)]
            if uncached:
                page = uncached[0]
                key = rng.choice(hashes)
                pool.cache(
                    0, [page], [key], parent_hash=None, token_ids=[1], page_size=1, lora_name=None
                )
                mirror.insert(page, key)
        elif held:
            pages = held.pop(rng.randrange(len(held)))
            pool.free(pages[::-1])
        for key in hashes:
            assert mirror.lookup([key], 1) == (
                [] if pool.lookup(0, key) is None else [pool.lookup(0, key)]
            )


# -- with a real vLLM engine -----------------------------------------------------------------


def _vllm_python() -> Path:
    return Path(os.environ.get("PAGEKEEPER_VLLM_VENV", "/opt/vllm-engine")) / "bin" / "python"


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 60)
@pytest.mark.skipif(
    os.environ.get("PAGEKEEPER_VLLM_ENGINE") != "1",
    reason="the real-vLLM proof runs under `make test-vllm` (PAGEKEEPER_VLLM_ENGINE=1)",
)
def test_vllm_engine_runs_on_pagekeeper(tmp_path: Path) -> None:
    python = _vllm_python()
    if not python.exists():
        pytest.skip(
            f"no vLLM side virtualenv at {python.parent.parent} "
            "(scripts/vllm_engine_venv.sh builds it)"
        )
    results = tmp_path / "results.json"
    command = [str(python), str(HERE / "run_vllm_engine.py"), "--json", str(results)]
    if os.environ.get("PAGEKEEPER_VLLM_CONFIGS"):
        command += ["--configs", os.environ["PAGEKEEPER_VLLM_CONFIGS"]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    report = "\n".join(
        line for line in out.stdout.splitlines() if not line.startswith("(") and line.strip()
    )
    print(report)
    assert out.returncode == 0, f"{report}\n--- stderr (tail) ---\n{out.stderr[-4000:]}"
