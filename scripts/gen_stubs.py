#!/usr/bin/env python3
"""Generate the gRPC/protobuf Python stubs from ``proto/`` into the client package.

The one generator of ``client/pagekeeper_client/_proto/`` (``make stubs`` runs it; a test
regenerates into a temporary directory and diffs against the committed files).

protoc is given a *virtual* include path: ``proto/pagekeeper/v1`` is mounted at
``pagekeeper_client/_proto/pagekeeper/v1``, so the generated modules import each other as
``pagekeeper_client._proto.pagekeeper.v1.pagekeeper_pb2`` with no post-processing (no sed).

Usage::

    python scripts/gen_stubs.py               # rewrite client/pagekeeper_client/_proto/
    python scripts/gen_stubs.py --out DIR     # write DIR/pagekeeper_client/_proto/ instead
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "pagekeeper" / "v1"
VIRTUAL_DIR = "pagekeeper_client/_proto/pagekeeper/v1"
PROTO_FILES = ("pagekeeper.proto",)

# Package markers written beside the generated modules, so the stubs import as a package.
INIT_FILES = {
    "pagekeeper_client/_proto/__init__.py": (
        '"""Generated gRPC/protobuf stubs (scripts/gen_stubs.py). Do not edit."""\n'
    ),
    "pagekeeper_client/_proto/pagekeeper/__init__.py": "",
    "pagekeeper_client/_proto/pagekeeper/v1/__init__.py": "",
}


def generate(out_root: Path) -> list[Path]:
    """Run protoc into ``out_root`` (which holds ``pagekeeper_client/``); return the files."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency: only the generator needs it

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / VIRTUAL_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_DIR}={PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *(f"{VIRTUAL_DIR}/{name}" for name in PROTO_FILES),
    ]
    status = protoc.main(args)
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    for rel, text in INIT_FILES.items():
        (out_root / rel).write_text(text)
    return sorted(p for p in (out_root / "pagekeeper_client" / "_proto").rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "client",
        help="directory that receives pagekeeper_client/_proto/ (default: client/)",
    )
    ns = parser.parse_args(argv)
    for path in generate(ns.out.resolve()):
        print(path.relative_to(ns.out.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
