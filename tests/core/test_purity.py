"""The core is pure: importing it pulls in no transport, web or tensor library."""

import subprocess
import sys


def test_core_imports_no_grpc_fastapi_torch():
    code = (
        "import sys, pagekeeper.core.manager, pagekeeper.core.tables, pagekeeper.core.hashing;"
        "bad = [m for m in ('grpc', 'fastapi', 'torch', 'uvicorn', 'pydantic', 'starlette')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
