"""Who is calling: the controller's bearer-token checks, as FastAPI dependencies.

Rule: authentication runs before anything reads the request body (each check is a
dependency or the endpoint's first call), and the principal (and the node, when the
path names one) go on ``request.state`` for the access log.
"""

from __future__ import annotations

from fastapi import HTTPException, Request

from controller.auth import Principal, Tokens, bearer_token


class Auth:
    """Who is calling, as FastAPI dependencies: ``Depends(auth.admin)`` and friends.

    A missing or unknown token is a 401 with ``WWW-Authenticate: Bearer``; a
    node token outside its node, or on a write, is a 403. The principal (and
    the node, when the path names one) go on ``request.state`` for the access log.
    """

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def authenticate(self, request: Request) -> Principal:
        """Return the caller's principal; 401 when the token is missing or unknown.

        Once per request: a route's dependency and its handler's own check (a pull's
        node check) share the principal found first.
        """
        known: Principal | None = getattr(request.state, "principal", None)
        if known is not None:
            return known
        token = bearer_token(request.headers.get("authorization"))
        principal = self.tokens.authenticate(token)
        if principal is None:
            detail = "missing bearer token" if token is None else "invalid bearer token"
            challenge = "Bearer" if token is None else 'Bearer error="invalid_token"'
            raise HTTPException(401, detail, headers={"WWW-Authenticate": challenge})
        request.state.principal = principal
        return principal

    def require_admin(self, request: Request) -> Principal:
        """Return the admin principal; 403 for a node token."""
        principal = self.authenticate(request)
        if not principal.is_admin:
            raise HTTPException(403, "this endpoint needs the admin token")
        return principal

    def require_admin_on_node(self, request: Request, node: str) -> Principal:
        """Return the admin principal of a write to node's schedules (node logged either way)."""
        request.state.node = node
        return self.require_admin(request)

    # The same checks as FastAPI dependencies. Coroutines, so FastAPI runs them on the event
    # loop (a dictionary lookup) rather than handing every request to a worker thread and back.

    async def caller(self, request: Request) -> Principal:
        """:meth:`authenticate`, as a dependency."""
        return self.authenticate(request)

    async def admin(self, request: Request) -> Principal:
        """:meth:`require_admin`, as a dependency."""
        return self.require_admin(request)

    async def admin_on_node(self, request: Request, node: str) -> Principal:
        """:meth:`require_admin_on_node`, as a dependency."""
        return self.require_admin_on_node(request, node)

    async def node_reader(self, request: Request, node: str) -> Principal:
        """:meth:`require_node`, as a dependency."""
        return self.require_node(request, node)

    def is_own(self, principal: Principal, node: str) -> bool:
        """Return whether principal is node itself: its own token (or any caller when
        serving without tokens, where nobody can be told apart)."""
        return principal.node == node or self.tokens.insecure

    def require_node(self, request: Request, node: str) -> Principal:
        """Return a principal that may read node's schedules (the admin, or node itself)."""
        request.state.node = node
        principal = self.authenticate(request)
        if not principal.may_read_node(node):
            raise HTTPException(403, f"this token may not read the schedules of node {node!r}")
        return principal
