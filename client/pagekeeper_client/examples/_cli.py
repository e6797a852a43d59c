"""The command-line options the example scheduler and worker share."""

from __future__ import annotations

import argparse
import os


def base_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A parser for ``python -m <module>`` (described by the first paragraph of ``doc``)
    with the service's address and token, each defaulting to its environment variable;
    every option's help shows its default."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("PAGEKEEPER_GRPC_ADDRESS"),
        help="the service's gRPC address, HOST:PORT or unix:PATH (None: 127.0.0.1:50051)",
    )
    parser.add_argument("--token", default=os.environ.get("PAGEKEEPER_TOKEN"), help="bearer token")
    return parser
