"""Build step for the optional C accelerators (everything else is in pyproject.toml): page
hashing (`_native`, links OpenSSL's libcrypto), the page pool's per-page loops
(`_poolops`) and the client mirror's decode loop (`_clientops`). `optional=True`: without a C compiler (or OpenSSL's headers) the build skips
them and pagekeeper runs its pure-Python code, with identical results."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pagekeeper.core._native",
            sources=["service/pagekeeper/core/_native.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"],
            optional=True,
        ),
        Extension(
            "pagekeeper.core._poolops",
            sources=["service/pagekeeper/core/_poolops.c"],
            extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"],
            optional=True,
        ),
        Extension(
            "pagekeeper_client._clientops",
            sources=["client/pagekeeper_client/_clientops.c"],
            extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"],
            optional=True,
        ),
    ]
)
