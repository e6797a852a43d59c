"""Read a Dockerfile (and its .dockerignore) well enough to run its images' commands locally.

No engine builds the image here, so the tests take what an image *does* from the Dockerfile
itself: each stage's ENV, USER, WORKDIR, ENTRYPOINT, CMD, HEALTHCHECK and STOPSIGNAL (a stage
built ``FROM`` an earlier stage inherits them, as Docker does), its COPY sources and RUN
commands, and which files of the repository reach the build context.

Covered syntax: comments and parser directives, ``\\`` line continuations, global ARGs in
FROM, ``FROM image [AS name]``, ENV (``k=v`` pairs, quoted, or the legacy ``ENV k v``), the
exec (JSON) and shell forms of ENTRYPOINT / CMD / HEALTHCHECK CMD, ``HEALTHCHECK NONE``,
COPY / RUN flags (``--from``, ``--mount`` ...). Heredocs and ONBUILD are refused.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from tests.compose.compose import HealthCheck, parse_duration


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    """Upper case (``RUN``, ``COPY``...)."""
    text: str
    """Everything after the keyword, continuation lines joined."""
    line: int


@dataclass(frozen=True)
class ImageConfig:
    """What a built image would carry into a container."""

    env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    workdir: str = "/"
    entrypoint: tuple[str, ...] | None = None
    cmd: tuple[str, ...] | None = None
    healthcheck: HealthCheck | None = None
    is_healthcheck_none: bool = False
    stop_signal: str | None = None
    exposed_ports: tuple[str, ...] = ()

    def argv(
        self,
        entrypoint: tuple[str, ...] | None = None,
        command: tuple[str, ...] | None = None,
    ) -> tuple[str, ...]:
        """The container's process: Docker's rule for combining a (possibly overridden)
        ENTRYPOINT with a (possibly overridden) CMD. Overriding the entrypoint drops the
        image's CMD."""
        ep = self.entrypoint if entrypoint is None else entrypoint
        if command is not None:
            cmd: tuple[str, ...] = command
        elif entrypoint is not None:
            cmd = ()
        else:
            cmd = self.cmd or ()
        argv = (ep or ()) + cmd
        if not argv:
            raise DockerfileError("no ENTRYPOINT and no CMD: the container has no process")
        return argv


@dataclass(frozen=True)
class Stage:
    index: int
    name: str | None
    base: str
    """The FROM reference with global ARGs expanded."""
    parent: Stage | None
    """The earlier stage this one is built FROM, if any."""
    instructions: tuple[Instruction, ...]
    config: ImageConfig

    def copies(self) -> list[tuple[dict[str, str], list[str], str]]:
        """COPY/ADD instructions as (flags, sources, destination)."""
        out = []
        for ins in self.instructions:
            if ins.keyword in ("COPY", "ADD"):
                flags, words = _split_flags(ins.text)
                if len(words) < 2:
                    raise DockerfileError(f"line {ins.line}: {ins.keyword} needs SRC... DEST")
                out.append((flags, words[:-1], words[-1]))
        return out

    def runs(self) -> list[str]:
        """The shell commands of its RUN instructions (flags such as --mount removed)."""
        runs = []
        for ins in self.instructions:
            if ins.keyword == "RUN":
                text = ins.text
                while text.startswith("--"):
                    _, _, text = text.partition(" ")
                    text = text.lstrip()
                runs.append(text)
        return runs


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    global_args: Mapping[str, str]
    stages: tuple[Stage, ...]

    def stage(self, target: str | None = None) -> Stage:
        """The stage ``--target`` names, or the last one (Docker's default target)."""
        if target is None:
            return self.stages[-1]
        for stage in self.stages:
            if stage.name == target:
                return stage
        raise DockerfileError(f"no stage named {target!r} in {self.path}")


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, instruction text): comments dropped, continuations joined."""
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buffer):
            continue  # comment lines vanish even inside a continuation
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1].strip())
            continue
        buffer.append(stripped)
        line = " ".join(part for part in buffer if part)
        buffer = []
        if line:
            yield start, line
    if buffer:
        yield start, " ".join(buffer)


def _split_flags(text: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(text)
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


def _exec_or_shell(text: str, where: str) -> tuple[str, ...]:
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DockerfileError(f"{where}: bad JSON exec form: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise DockerfileError(f"{where}: exec form must be a JSON list of strings")
        return tuple(value)
    return ("/bin/sh", "-c", text)


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Dockerfile ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` substitution."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        value = variables.get(name)
        if value:
            return value
        return default if default is not None else ""

    return _VAR.sub(sub, text)


def _parse_env(text: str, variables: Mapping[str, str]) -> dict[str, str]:
    words = shlex.split(text, posix=True)
    if words and "=" not in words[0]:  # legacy form: ENV key value with spaces
        key, _, value = text.strip().partition(" ")
        return {key: expand(value.strip(), variables)}
    env = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise DockerfileError(f"ENV {text!r}: expected key=value pairs")
        env[key] = expand(value, {**variables, **env})
    return env


def _parse_healthcheck(text: str, where: str) -> tuple[HealthCheck | None, bool]:
    if text.strip().upper() == "NONE":
        return None, True
    options: dict[str, str] = {}
    rest = text.strip()
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        key, _, value = word[2:].partition("=")
        options[key] = value
        rest = rest.lstrip()
    keyword, _, command = rest.partition(" ")
    if keyword.upper() != "CMD":
        raise DockerfileError(f"{where}: HEALTHCHECK needs NONE or [OPTIONS] CMD command")
    known = {"interval", "timeout", "start-period", "start-interval", "retries"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise DockerfileError(f"{where}: unknown HEALTHCHECK options {unknown}")
    return (
        HealthCheck(
            argv=_exec_or_shell(command, where),
            interval_s=parse_duration(options.get("interval", "30s")),
            timeout_s=parse_duration(options.get("timeout", "30s")),
            retries=int(options.get("retries", "3")),
            start_period_s=parse_duration(options.get("start-period", "0s")),
            start_interval_s=parse_duration(options.get("start-interval", "5s")),
        ),
        False,
    )


@dataclass
class _StageBuilder:
    name: str | None
    base: str
    parent: Stage | None
    config: ImageConfig
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)

    def build(self, index: int) -> Stage:
        return Stage(
            index, self.name, self.base, self.parent, tuple(self.instructions), self.config
        )


def _apply(config: ImageConfig, ins: Instruction, args: dict[str, str], where: str) -> ImageConfig:
    """The image config after one instruction (ARG updates ``args`` in place)."""
    variables = {**args, **config.env}
    keyword, rest = ins.keyword, ins.text
    if keyword == "ARG":
        name, _, default = rest.partition("=")
        args[name.strip()] = default.strip().strip('"')
    elif keyword == "ENV":
        config = replace(config, env={**config.env, **_parse_env(rest, variables)})
    elif keyword == "USER":
        config = replace(config, user=expand(rest, variables))
    elif keyword == "WORKDIR":
        config = replace(config, workdir=os.path.join(config.workdir, expand(rest, variables)))
    elif keyword == "ENTRYPOINT":
        # Setting ENTRYPOINT resets a CMD inherited from the base image.
        config = replace(config, entrypoint=_exec_or_shell(rest, where), cmd=None)
    elif keyword == "CMD":
        config = replace(config, cmd=_exec_or_shell(rest, where))
    elif keyword == "HEALTHCHECK":
        check, is_none = _parse_healthcheck(rest, where)
        config = replace(config, healthcheck=check, is_healthcheck_none=is_none)
    elif keyword == "STOPSIGNAL":
        config = replace(config, stop_signal=rest)
    elif keyword == "EXPOSE":
        config = replace(config, exposed_ports=config.exposed_ports + tuple(rest.split()))
    return config


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    current: _StageBuilder | None = None
    for number, line in logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        where = f"{path.name}:{number}"
        if "<<" in rest and keyword in ("RUN", "COPY"):
            raise DockerfileError(f"{where}: heredocs are not supported here")
        if keyword == "ONBUILD":
            raise DockerfileError(f"{where}: ONBUILD is not supported here")
        if keyword == "ARG" and current is None:
            name, _, default = rest.partition("=")
            global_args[name.strip()] = default.strip().strip('"')
            continue
        if keyword == "FROM":
            if current is not None:
                stages.append(current.build(len(stages)))
            _, words = _split_flags(rest)
            if len(words) == 3 and words[1].upper() == "AS":
                base, name = expand(words[0], global_args), words[2]
            elif len(words) == 1:
                base, name = expand(words[0], global_args), None
            else:
                raise DockerfileError(f"{where}: FROM image [AS name]")
            parent = next((s for s in stages if s.name == base), None)
            config = parent.config if parent else ImageConfig()
            current = _StageBuilder(name, base, parent, config)
            continue
        if current is None:
            raise DockerfileError(f"{where}: {keyword} before the first FROM")
        instruction = Instruction(keyword, rest, number)
        current.instructions.append(instruction)
        current.config = _apply(current.config, instruction, current.args, where)
    if current is None:
        raise DockerfileError(f"{path}: no FROM")
    stages.append(current.build(len(stages)))
    return Dockerfile(path, global_args, tuple(stages))


# -- .dockerignore --------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A moby patternmatcher pattern (Go filepath.Match plus ``**``) as a regex."""
    out = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise DockerfileError(f"bad .dockerignore pattern {pattern!r}")
            body = pattern[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = end
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class DockerIgnore:
    """The patterns of a .dockerignore, in order; the last matching pattern decides, and a
    pattern that matches a parent directory matches everything under it (moby's rule)."""

    rules: tuple[tuple[bool, re.Pattern[str], str], ...]

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        rules = []
        if path.exists():
            for raw in path.read_text().splitlines():
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                is_exception = line.startswith("!")
                pattern = line[1:].strip() if is_exception else line
                pattern = os.path.normpath(pattern.lstrip("/")).replace(os.sep, "/")
                rules.append((is_exception, _pattern_regex(pattern), line))
        return cls(tuple(rules))

    def is_excluded(self, rel_path: str) -> bool:
        parts = rel_path.split("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        excluded = False
        for is_exception, regex, _ in self.rules:
            if any(regex.match(c) for c in candidates):
                excluded = not is_exception
        return excluded


def build_context(root: Path, ignore: DockerIgnore) -> list[str]:
    """Files of the build context (relative, sorted), after .dockerignore. Skips .git and
    virtualenv internals early for speed only when the ignore file excludes them."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        # A directory excluded by a pattern with no later exception under it can be skipped.
        kept = []
        for d in dirnames:
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if ignore.is_excluded(rel) and not _has_exception_under(ignore, rel):
                continue
            kept.append(d)
        dirnames[:] = kept
        for name in filenames:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not ignore.is_excluded(rel):
                files.append(rel)
    return sorted(files)


def _has_exception_under(ignore: DockerIgnore, rel_dir: str) -> bool:
    for is_exception, _, line in ignore.rules:
        if is_exception:
            pattern = line[1:].strip().lstrip("/")
            if pattern.startswith(rel_dir + "/") or fnmatch.fnmatch(rel_dir, pattern.rstrip("/")):
                return True
            if "*" in pattern.split("/")[0]:
                return True
    return False
