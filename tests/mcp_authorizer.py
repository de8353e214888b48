"""An authorizer for the MCP server's tests (``--authorizer tests.mcp_authorizer:authorize``).

Lets agents send signals and nothing else, refusing each other mutation in
one of the ways the contract allows (a message, ``False``, an exception).
Every call is appended as a JSON line ``[tool, args]`` to the file named by
``BELAY_TEST_AUTHZ_LOG`` (when set), so a test in another process sees what
the authorizer was asked.
"""

from __future__ import annotations

import json
import os
from typing import Any

RETRY_REFUSAL = "agents may not retry jobs; ask an operator"
CANCEL_REFUSAL = "cancelling is for humans"


def authorize(tool: str, args: dict[str, Any]) -> object:
    log = os.environ.get("BELAY_TEST_AUTHZ_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps([tool, args]) + "\n")
    if tool == "signal":
        return None
    if tool == "retry_job":
        return RETRY_REFUSAL
    if tool == "cancel_job":
        raise PermissionError(CANCEL_REFUSAL)
    return False
