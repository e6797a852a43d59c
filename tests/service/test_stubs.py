"""The committed stubs are exactly what scripts/gen_stubs.py generates from proto/."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "client" / "pagekeeper_client" / "_proto"


def test_regenerating_the_stubs_changes_nothing(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_stubs.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = tmp_path / "pagekeeper_client" / "_proto"
    fresh_files = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(COMMITTED)
        for p in COMMITTED.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh_files == committed, "stub files differ: run `make stubs`"
    changed = [
        str(p) for p in fresh_files if not filecmp.cmp(fresh / p, COMMITTED / p, shallow=False)
    ]
    assert not changed, f"stale stubs {changed}: run `make stubs`"


def test_stubs_import_package_qualified():
    grpc_module = (COMMITTED / "pagekeeper" / "v1" / "pagekeeper_pb2_grpc.py").read_text()
    assert "from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2" in grpc_module
