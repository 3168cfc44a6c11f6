"""The grammar registration API's body and answers (the routes are `Ingress` methods)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.answers import ApiError
from deployments.protocol import ResponseFormat, StructuredOutputs


class GrammarRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    fidelity: str = Field(default="warn", pattern="^(warn|strict)$")


def raise_for(out: Any) -> None:
    """The grammar service's error answer as an HTTP error; a busy compile service is worth a
    retry, a full registrations cap is not until the tenant deletes some."""
    if not (isinstance(out, dict) and "error" in out):
        return
    status, reason = int(out["status"]), out.get("reason")
    if status == 429 and reason == "registration":
        raise ApiError(429, out["error"], reason="registrations_cap")
    if status == 429:
        raise ApiError(429, out["error"], retry_after=2, reason="grammar_busy")
    raise ApiError(status, out["error"])


def grammar_view(reg: dict[str, Any], spec: bool = False) -> dict[str, Any]:
    view = {
        "id": reg["grammar_id"],
        "object": "grammar",
        "name": reg["name"],
        "kind": reg["spec"]["kind"],
        "created": int(reg["created"]),
        "bytes": reg["bytes"],
        "compile_seconds": reg["compile_s"],
        "fidelity": {"loosened": reg["warnings"]},
    }
    if spec:
        view["spec"] = reg["spec"]
    return view
