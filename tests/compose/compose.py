"""Read a docker-compose file the way Compose does, for running it without a Docker engine.

Covers what ``docker-compose.yml`` uses, and refuses what it does not emulate (so the file
cannot drift into something the local runner silently ignores):

- variable interpolation (``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
  ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``, ``$$``), nested
  defaults included, over every string value (not keys), as Compose does;
- YAML merge keys (``<<: *anchor``) and top-level ``x-*`` extension fields;
- profiles, ``depends_on`` (short and long form, ``condition``, ``required``),
  ``environment`` (mapping or list), ``entrypoint`` / ``command`` (list or string),
  ``healthcheck`` (``test``, ``interval``, ``timeout``, ``retries``, ``start_period``,
  ``start_interval``, ``disable``), ``volumes`` (short syntax), ``stop_signal``,
  ``stop_grace_period``, ``build.target`` (to find the image's ENTRYPOINT/CMD/ENV/HEALTHCHECK
  in the Dockerfile);
- ``x-local.ports``: the container ports a service listens on (see runner.py).

Fields that only matter to a container engine (``image``, ``ports``, ``ipc``, ``shm_size``,
``deploy``, ``restart``...) are accepted and listed, with the reason, in
:data:`ENGINE_ONLY_KEYS`; any other key makes loading fail.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = frozenset(
    {
        "build",
        "command",
        "depends_on",
        "entrypoint",
        "environment",
        "healthcheck",
        "profiles",
        "stop_grace_period",
        "stop_signal",
        "volumes",
        "x-local",
    }
)
"""Service keys the runner honours."""

ENGINE_ONLY_KEYS = frozenset(
    {
        "deploy",  # GPU reservations: the local runner has whatever devices the host has
        "image",  # the runner uses the local install, not an image
        "init",
        "ipc",  # every local process shares the host's /dev/shm already
        "ports",  # host publishing; the runner allocates loopback ports from x-local
        "restart",  # a test wants to see failures, not have them restarted away
        "shm_size",
    }
)
"""Service keys that only configure the container engine; accepted, not emulated."""

DEPENDENCY_CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")


class ComposeError(ValueError):
    """The compose file is invalid or uses something the local runner does not emulate."""


# -- interpolation ---------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Compose's ``${...}`` substitution of one string value.

    >>> interpolate("${A:-x}-$B-$${C}", {"B": "b"})
    'x-b-${C}'
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$":
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            end = _closing_brace(text, i + 2)
            out.append(_expand(text[i + 2 : end], variables, text))
            i = end + 1
        else:
            match = _NAME.match(text, i + 1)
            if match is None:
                raise ComposeError(f"invalid interpolation format in {text!r}: lone '$'")
            out.append(variables.get(match.group(), ""))
            i = match.end()
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    i = start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ComposeError(f"invalid interpolation format in {text!r}: unclosed '${{'")


def _expand(body: str, variables: Mapping[str, str], whole: str) -> str:
    match = _NAME.match(body)
    if match is None:
        raise ComposeError(f"invalid interpolation format in {whole!r}: ${{{body}}}")
    name = match.group()
    rest = body[match.end() :]
    value = variables.get(name)
    if not rest:
        return value or ""
    for op in (":-", "-", ":?", "?", ":+", "+"):
        if rest.startswith(op):
            arg = rest[len(op) :]
            break
    else:
        raise ComposeError(f"invalid interpolation format in {whole!r}: ${{{body}}}")
    is_set = value is not None
    is_nonempty = bool(value)
    present = is_nonempty if op.startswith(":") else is_set
    if op in (":-", "-"):
        return value if present and value is not None else interpolate(arg, variables)
    if op in (":?", "?"):
        if not present:
            raise ComposeError(f"required variable {name} is missing a value: {arg}")
        return value or ""
    return interpolate(arg, variables) if present else ""


def _interpolate_tree(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [_interpolate_tree(v, variables) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, variables) for k, v in node.items()}
    return node


# -- durations -------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|ns)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_duration(value: str | int | float) -> float:
    """Compose durations (``"1m30s"``, ``"500ms"``, ``"10s"``) in seconds; a bare number is
    seconds."""
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    total = 0.0
    pos = 0
    for match in _DURATION.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ComposeError(f"invalid duration {value!r}")
    return total


# -- the model -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """A normalized health check: ``argv`` exec'd (``CMD``) or run by ``/bin/sh -c``."""

    argv: tuple[str, ...]
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0
    start_interval_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Dependency:
    service: str
    condition: str = "service_started"
    is_required: bool = True


@dataclass(frozen=True, slots=True)
class Mount:
    source: str
    """A named volume, or a host path (bind mount)."""
    target: str
    is_named_volume: bool
    is_read_only: bool = False


@dataclass(frozen=True)
class ServiceSpec:
    """One service, interpolated and normalized."""

    name: str
    raw: Mapping[str, Any]
    entrypoint: tuple[str, ...] | None
    command: tuple[str, ...] | None
    environment: Mapping[str, str | None]
    depends_on: tuple[Dependency, ...]
    healthcheck: HealthCheck | None
    is_healthcheck_disabled: bool
    mounts: tuple[Mount, ...]
    profiles: tuple[str, ...]
    build_target: str | None
    dockerfile: str | None
    stop_signal: str | None
    stop_grace_period_s: float
    local_ports: tuple[int, ...]
    engine_only: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ComposeFile:
    path: Path
    name: str | None
    services: Mapping[str, ServiceSpec]
    volumes: Mapping[str, Any]
    raw: Mapping[str, Any]

    def active_services(self, profiles: Sequence[str] = ()) -> list[str]:
        """Services enabled under ``profiles`` (no ``profiles`` key: always enabled)."""
        return [
            name
            for name, spec in self.services.items()
            if not spec.profiles or set(spec.profiles) & set(profiles)
        ]

    def start_order(self, names: Sequence[str]) -> list[str]:
        """``names`` in dependency order (dependencies first); missing required
        dependencies and cycles raise ComposeError."""
        enabled = set(names)
        order: list[str] = []
        state: dict[str, str] = {}

        def visit(name: str, chain: tuple[str, ...]) -> None:
            if state.get(name) == "done":
                return
            if state.get(name) == "visiting":
                raise ComposeError("dependency cycle: " + " -> ".join((*chain, name)))
            state[name] = "visiting"
            for dep in self.services[name].depends_on:
                if dep.service not in enabled:
                    if dep.is_required:
                        raise ComposeError(
                            f"service {name} depends on {dep.service}, which is not enabled"
                        )
                    continue
                visit(dep.service, (*chain, name))
            state[name] = "done"
            order.append(name)

        for name in names:
            visit(name, ())
        return order


def _as_argv(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return tuple(str(v) for v in value)
    raise ComposeError(f"{where}: expected a string or a list of strings")


def _environment(value: Any, where: str) -> dict[str, str | None]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): None if v is None else _scalar(v) for k, v in value.items()}
    if isinstance(value, list):
        env: dict[str, str | None] = {}
        for item in value:
            key, sep, val = str(item).partition("=")
            env[key] = val if sep else None
        return env
    raise ComposeError(f"{where}: expected a mapping or a list")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _healthcheck(value: Any, where: str) -> tuple[HealthCheck | None, bool]:
    if value is None:
        return None, False
    if not isinstance(value, dict):
        raise ComposeError(f"{where}: expected a mapping")
    if value.get("disable") in (True, "true"):
        return None, True
    test = value.get("test")
    if isinstance(test, str):
        argv: tuple[str, ...] = ("/bin/sh", "-c", test)
    elif isinstance(test, list) and test:
        kind, args = test[0], [str(a) for a in test[1:]]
        if kind == "NONE":
            return None, True
        if kind == "CMD":
            argv = tuple(args)
        elif kind == "CMD-SHELL":
            argv = ("/bin/sh", "-c", " ".join(args))
        else:
            raise ComposeError(f"{where}.test: first item must be NONE, CMD or CMD-SHELL")
    else:
        raise ComposeError(f"{where}.test: missing")
    if not argv:
        raise ComposeError(f"{where}.test: empty command")
    interval = parse_duration(value.get("interval", "30s"))
    return (
        HealthCheck(
            argv=argv,
            interval_s=interval,
            timeout_s=parse_duration(value.get("timeout", "30s")),
            retries=int(value.get("retries", 3)),
            start_period_s=parse_duration(value.get("start_period", "0s")),
            start_interval_s=parse_duration(value.get("start_interval", "5s")),
        ),
        False,
    )


def _depends_on(value: Any, where: str) -> tuple[Dependency, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(Dependency(str(name)) for name in value)
    if isinstance(value, dict):
        deps = []
        for name, spec in value.items():
            spec = spec or {}
            condition = spec.get("condition", "service_started")
            if condition not in DEPENDENCY_CONDITIONS:
                raise ComposeError(f"{where}.{name}: unknown condition {condition!r}")
            required = spec.get("required", True)
            deps.append(Dependency(str(name), condition, required in (True, "true")))
        return tuple(deps)
    raise ComposeError(f"{where}: expected a list or a mapping")


def _mounts(value: Any, where: str, named_volumes: Mapping[str, Any]) -> tuple[Mount, ...]:
    mounts = []
    for item in value or ():
        if not isinstance(item, str):
            raise ComposeError(f"{where}: only the short syntax SOURCE:TARGET[:ro] is emulated")
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ComposeError(f"{where}: {item!r} is not SOURCE:TARGET[:MODE]")
        source, target = parts[0], parts[1]
        is_named = not source.startswith((".", "/", "~"))
        if is_named and source not in named_volumes:
            raise ComposeError(f"{where}: volume {source!r} is not declared under volumes:")
        mounts.append(Mount(source, target, is_named, len(parts) == 3 and parts[2] == "ro"))
    return tuple(mounts)


def _service(name: str, raw: Mapping[str, Any], named_volumes: Mapping[str, Any]) -> ServiceSpec:
    where = f"services.{name}"
    unknown = set(raw) - SUPPORTED_KEYS - ENGINE_ONLY_KEYS
    if unknown:
        raise ComposeError(
            f"{where}: {sorted(unknown)} not emulated by the local runner (teach "
            "tests/compose/compose.py, or list the key in ENGINE_ONLY_KEYS with a reason)"
        )
    build = raw.get("build")
    build_target = dockerfile = None
    if isinstance(build, dict):
        build_target = build.get("target")
        dockerfile = build.get("dockerfile", "Dockerfile")
    elif isinstance(build, str):
        dockerfile = "Dockerfile"
    local = raw.get("x-local") or {}
    if not isinstance(local, dict) or set(local) - {"ports"}:
        raise ComposeError(f"{where}.x-local: only 'ports' is understood")
    ports = tuple(int(p) for p in local.get("ports", ()))
    healthcheck, disabled = _healthcheck(raw.get("healthcheck"), f"{where}.healthcheck")
    return ServiceSpec(
        name=name,
        raw=raw,
        entrypoint=_as_argv(raw.get("entrypoint"), f"{where}.entrypoint"),
        command=_as_argv(raw.get("command"), f"{where}.command"),
        environment=_environment(raw.get("environment"), f"{where}.environment"),
        depends_on=_depends_on(raw.get("depends_on"), f"{where}.depends_on"),
        healthcheck=healthcheck,
        is_healthcheck_disabled=disabled,
        mounts=_mounts(raw.get("volumes"), f"{where}.volumes", named_volumes),
        profiles=tuple(raw.get("profiles") or ()),
        build_target=build_target,
        dockerfile=dockerfile,
        stop_signal=raw.get("stop_signal"),
        stop_grace_period_s=parse_duration(raw.get("stop_grace_period", "10s")),
        local_ports=ports,
        engine_only={k: v for k, v in raw.items() if k in ENGINE_ONLY_KEYS},
    )


def load_yaml(path: Path) -> dict[str, Any]:
    """The file's YAML (merge keys resolved), not yet interpolated."""
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise ComposeError(f"{path}: no services mapping")
    return data


def load_compose(path: Path, variables: Mapping[str, str] | None = None) -> ComposeFile:
    """Load, interpolate (with ``variables``, as if they were the shell's environment) and
    normalize a compose file."""
    data = _interpolate_tree(load_yaml(path), variables or {})
    named_volumes = data.get("volumes") or {}
    services = {
        str(name): _service(str(name), raw or {}, named_volumes)
        for name, raw in data["services"].items()
    }
    for spec in services.values():
        for dep in spec.depends_on:
            if dep.service not in services:
                raise ComposeError(f"services.{spec.name}: depends on unknown {dep.service!r}")
    return ComposeFile(path, data.get("name"), services, named_volumes, data)
