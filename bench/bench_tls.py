#!/usr/bin/env python3
"""What TLS costs a Step: plaintext (the baseline), TLS, and mutual TLS (client certificates,
registrations bound to them), three services started side by side.

Certificates come from the ``openssl`` command line (a CA, a server certificate for
127.0.0.1, a client certificate). Each service gets the same scheduler load: 64 requests
admitted, then ``--samples`` decode steps (one token per row, in columns, published as a
batch), timed from one client per service and interleaved (plain, tls, mtls, mtls, tls,
plain, ...) so that machine drift hits all alike. Printed: each median Step round trip and
its ratio to plaintext, per round, and the median over rounds.

    .venv/bin/python bench/bench_tls.py [--samples 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from _services import decode_step_medians, services

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc

LANES = ("plain", "tls", "mtls")


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    _openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=bench-ca")  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        _openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", "-subj", f"/CN=bench-{name}")  # fmt: skip
        (d / f"{name}.ext").write_text(f"{ext or 'basicConstraints=CA:FALSE'}\n")
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem",
                 "-extfile", f"{name}.ext")  # fmt: skip


def one_round(samples: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        make_pki(d)
        server = ["--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key")]
        args = [
            ["--durability", "none"],
            ["--durability", "none", *server],
            ["--durability", "none", *server, "--tls-client-ca-file", str(d / "ca.pem")],
        ]
        ca = (d / "ca.pem").read_bytes()
        with services(d, args) as infos:
            channels = [
                grpc.insecure_channel(infos[0]["grpc_address"]),
                grpc.secure_channel(infos[1]["grpc_address"], grpc.ssl_channel_credentials(ca)),
                grpc.secure_channel(
                    infos[2]["grpc_address"],
                    grpc.ssl_channel_credentials(
                        ca, (d / "client.key").read_bytes(), (d / "client.pem").read_bytes()
                    ),
                ),
            ]
            try:
                stubs = [pb_grpc.PagekeeperServiceStub(c) for c in channels]
                return decode_step_medians(stubs, samples)
            finally:
                for channel in channels:
                    channel.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    if shutil.which("openssl") is None:
        print("bench_tls: needs the openssl command line", file=sys.stderr)
        return 1
    started = time.monotonic()
    rounds = [one_round(ns.samples) for _ in range(ns.rounds)]
    print(
        f"Machine: {platform.machine()}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; {ns.samples} decode steps of 64 requests "
        f"per lane per round, interleaved ({time.monotonic() - started:.0f} s)\n"
    )
    print("| round | plain p50 | TLS p50 | mutual TLS p50 | TLS / plain | mutual / plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, (plain, tls, mtls) in enumerate(rounds, 1):
        print(
            f"| {k} | {plain * 1e3:.3f} ms | {tls * 1e3:.3f} ms | {mtls * 1e3:.3f} ms | "
            f"{tls / plain:.2f}x | {mtls / plain:.2f}x |"
        )
    med = [statistics.median(r[i] for r in rounds) for i in range(len(LANES))]
    print(
        f"| median | {med[0] * 1e3:.3f} ms | {med[1] * 1e3:.3f} ms | {med[2] * 1e3:.3f} ms | "
        f"{med[1] / med[0]:.2f}x | {med[2] / med[0]:.2f}x |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
