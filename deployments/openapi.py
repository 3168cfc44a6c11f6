"""The ingress's OpenAPI document, with the request bodies it reads.

The routes read their bodies themselves (size-capped, then validated by pydantic), so FastAPI
cannot see them; this adds each body's JSON Schema from the same pydantic models, so that
`/openapi.json` describes what the service accepts (clients generate from it, and the HTTP fuzz
test draws its bodies from it).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


def install(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """`bodies`: the POST path -> the model its body must validate against."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                operation = doc.get("paths", {}).get(path, {}).get("post")
                if operation is None:
                    continue
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref}},
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
