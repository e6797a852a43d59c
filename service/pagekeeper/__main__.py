"""``pagekeeper serve`` / ``pagekeeper config`` (also ``python -m pagekeeper``).

Configuration precedence, weakest first: embedded defaults < ``--config FILE.toml`` (or
``$PAGEKEEPER_CONFIG``) < ``PAGEKEEPER_*`` environment variables < flags. A bad value exits
with status 2 and one line naming the field.

Exit statuses of ``serve``: 0 after a graceful stop, 1 when a server cannot bind, 2 for a bad
configuration, 3 when the data directory cannot be used (locked by another instance,
another pool's state, an unreadable snapshot: one line says which), 4 when a durable write
failed while serving (the state kept is the last durable one).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from pagekeeper import __version__
from pagekeeper.core.errors import ConfigError
from pagekeeper.logs import configure_logging
from pagekeeper.settings import (
    OPTIONS,
    Settings,
    load_settings,
    misspelled_env,
    to_json,
    to_toml,
)

log = logging.getLogger("pagekeeper")

EXIT_CONFIG = 2
EXIT_START = 1
EXIT_DATA = 3
EXIT_DURABILITY = 4


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    group = parser.add_argument_group("settings (override the file and PAGEKEEPER_* env vars)")
    for option in OPTIONS:
        kwargs: dict[str, object] = {"dest": option.path, "default": None, "help": option.help}
        if option.is_switch:
            # `--debug-invariants` alone means true; `--debug-invariants=false` also works.
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        else:
            kwargs["metavar"] = option.path.rsplit(".", 1)[1].upper()
        group.add_argument(option.flag, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagekeeper", description="KV-cache block-manager service for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"pagekeeper {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the service (gRPC + HTTP)")
    _add_config_flags(serve)
    serve.add_argument(
        "--ready-file",
        metavar="PATH",
        help="write {pid, grpc_address, http_address, grpc_port, http_port} as JSON here once "
        "ready (removed on exit)",
    )
    config = sub.add_parser("config", help="print the effective configuration")
    _add_config_flags(config)
    config.add_argument("--format", choices=("toml", "json"), default="toml")
    return parser


def _settings(ns: argparse.Namespace) -> Settings:
    flags = {option.path: getattr(ns, option.path) for option in OPTIONS}
    return load_settings(config_path=ns.config, environ=os.environ, flags=flags)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        settings = _settings(ns)
    except ConfigError as exc:
        print(f"pagekeeper: bad configuration: {exc.field}: {exc.reason}", file=sys.stderr)
        return EXIT_CONFIG
    typos = misspelled_env(os.environ)
    if ns.command == "config":
        for name, meant in typos:
            print(f"pagekeeper: {name} is not a setting ({meant}?): ignored", file=sys.stderr)
        sys.stdout.write(to_toml(settings) if ns.format == "toml" else to_json(settings) + "\n")
        return 0

    configure_logging(settings.log_level, settings.log_format)
    for name, meant in typos:
        log.warning("%s is not a setting (%s?): ignored", name, meant)
    from pagekeeper.auth import load_server_tokens
    from pagekeeper.durability import Durability, DurabilityError
    from pagekeeper.runtime import build_runtime
    from pagekeeper.server import serve
    from pagekeeper.tls import load_server_tls

    durability = None
    try:
        tls = load_server_tls(settings)  # before the data directory is touched
        tokens = load_server_tokens(settings)
        if settings.durability != "none":
            durability = Durability.open(
                settings.data_dir, settings.durability, snapshot_every=settings.snapshot_every
            )
        runtime = build_runtime(settings, durability=durability, tokens=tokens)
    except ConfigError as exc:
        if durability is not None:
            durability.close()
        print(f"pagekeeper: bad configuration: {exc.field}: {exc.reason}", file=sys.stderr)
        return EXIT_CONFIG
    except DurabilityError as exc:
        if durability is not None:
            durability.close()
        print(f"pagekeeper: cannot recover the durable state: {exc}", file=sys.stderr)
        return EXIT_DATA
    try:
        asyncio.run(serve(settings, ready_file=ns.ready_file, runtime=runtime, tls=tls))
    except OSError as exc:
        runtime.close()
        print(f"pagekeeper: cannot start: {exc}", file=sys.stderr)
        return EXIT_START
    if runtime.fatal:
        return EXIT_DURABILITY
    return 0


if __name__ == "__main__":
    sys.exit(main())
