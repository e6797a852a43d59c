"""Property-based fuzzing of every REST operation in the OpenAPI document (schemathesis):
whatever the input, the server never answers 5xx, and its answers match the documented
status codes, content types and schemas.

The document is built in-process from the app factory (so operations are known at collection
and each gets its own test id); the requests go to the real shared server. Bounded: a few
dozen examples per operation, with the admin token, so admin operations run their real code
rather than stopping at 401. (schemathesis' own pytest plugin is not used: its lazy-fixture
loader does not work with pytest 9.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pagekeeper.rest.app import create_app
from pagekeeper.runtime import build_runtime
from pagekeeper.settings import Settings

MAX_EXAMPLES = 30
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

_document = create_app(build_runtime(Settings(publish_transport="none"))).openapi()
SCHEMA = schemathesis.openapi.from_dict(_document)
OPERATIONS = {op.ok().label: op.ok() for op in SCHEMA.get_all_operations()}


def test_every_route_is_fuzzed():
    """Adding a route adds a fuzz target (nothing is skipped)."""
    paths = {
        f"{method.upper()} {path}" for path, ops in _document["paths"].items() for method in ops
    }
    assert paths == set(OPERATIONS)
    assert len(paths) >= 13


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_operation(label, pagekeeper_server):
    operation = OPERATIONS[label]
    headers = dict(pagekeeper_server.admin_headers)

    @given(case=operation.as_strategy())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def fuzz(case):
        case.call_and_validate(base_url=pagekeeper_server.http_url, headers=headers, checks=CHECKS)

    fuzz()
