"""Work a tenant's input steers, in worker processes that a deadline kills: grammar compiles,
JSON validation against a tenant's schema, and chat-template rendering.

`WorkerPool(role, setup, workers)` keeps long-lived workers of one role (`worker.ROLES`);
`SchemaValidator` and `TemplateRenderer` are the callers' side of the last two roles.
"""

from services.sandbox.pool import WorkerPool

__all__ = ["WorkerPool"]
