"""Build step for the optional C accelerator of page hashing (everything else is in
pyproject.toml). `optional=True`: without a C compiler or OpenSSL's headers the build
skips it and pagekeeper runs its pure-Python hashing, with identical results."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pagekeeper.core._native",
            sources=["service/pagekeeper/core/_native.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"],
            optional=True,
        )
    ]
)
