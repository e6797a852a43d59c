#!/usr/bin/env bash
# Install what the dashboard's browser test needs: Debian's chromium and chromium-driver.
#
# Idempotent and quiet: does nothing when both binaries are already on PATH. Needs root (or
# passwordless sudo) and the Debian archive; when either is missing it says why on stderr and
# exits 0, so `make test` still runs and the browser test skips with that reason.
set -uo pipefail

have_browser() {
    { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; } &&
        command -v chromedriver >/dev/null 2>&1
}

if have_browser; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; the dashboard browser test will be skipped" >&2
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "install_browser: not root and no passwordless sudo; the dashboard browser test" \
        "will be skipped (install chromium and chromium-driver to run it)" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
install() {
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium chromium-driver \
        >>"$log" 2>&1
}
# `update` first only when the package lists do not know chromium yet (a fresh container),
# and again if the install fails on lists gone stale.
updated=0
if ! apt-cache show chromium-driver >/dev/null 2>&1; then
    "${SUDO[@]}" apt-get update -qq >>"$log" 2>&1 || true
    updated=1
fi
if ! install && { [ "$updated" -eq 1 ] || ! "${SUDO[@]}" apt-get update -qq >>"$log" 2>&1 ||
    ! install; }; then
    echo "install_browser: apt-get install chromium chromium-driver failed; the dashboard" \
        "browser test will be skipped. Last lines:" >&2
    tail -n 5 "$log" >&2
    exit 0
fi
have_browser || echo "install_browser: installed, but chromium/chromedriver are not on PATH" >&2
exit 0
