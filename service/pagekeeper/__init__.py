"""pagekeeper: a KV-cache block-manager service for LLM serving.

``pagekeeper.core`` is the pure page manager; the rest of the package serves it (gRPC control
plane, REST introspection) in one asyncio process: ``pagekeeper serve``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagekeeper")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
