"""Who may call the kubelet API: x509 client certificates or bearer tokens (TokenReview),
then a SubjectAccessReview on the node, with decisions cached briefly as the kubelet does
(2 min for tokens, 5 min for allows, 30 s for denials)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubekit.client import API_ERRORS, KubeClient
from kubekit.loops import on_loop
from kubekit.serving import certificate_subject

TOKEN_TTL = 120.0
ALLOW_TTL = 300.0
DENY_TTL = 30.0
_CACHE_LIMIT = 4096
# Reviews waiting for the upper apiserver at once; past these a caller is told to come
# back. A denied token is not cached, so whoever reaches the kubelet port could send
# tokens by the thousand, each a TokenReview held in the queue for the review budget.
# The review of a token, or of an access, that passed before its cached answer lapsed
# has as many places again of its own: such a flood would otherwise refuse the callers
# that were let in (the multischeduler's estimator calls, kubectl through the apiserver)
# each time their answer lapsed, and only a valid token gets a place there.
MAX_PENDING_REVIEWS = 64

_VERBS = {
    "GET": "get",
    "HEAD": "get",
    "POST": "create",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}


@dataclass(frozen=True)
class User:
    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()


class AuthError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# Paths a kubelet with KubeletFineGrainedAuthz (on by default since 1.33) checks against
# a narrower subresource first, falling back to the next list's answer for the path.
_FINE_GRAINED = (
    ("/pods", "pods"),
    ("/healthz", "healthz"),
    ("/configz", "configz"),
    ("/runningpods", "pods"),
)
_COARSE = (
    ("/stats", "stats"),
    ("/metrics", "metrics"),
    ("/logs", "log"),
    ("/checkpoint", "checkpoint"),
    ("/statusz", "statusz"),
    ("/flagz", "configz"),
)


# Paths that open a stream into a pod are "create" whatever the method. A kubelet takes
# a GET (a WebSocket) as "get", so a read-only-looking `get nodes/proxy`, which
# monitoring agents are often granted, opens a shell in every pod of the node: here, in
# every pod the virtual node mirrors. The apiserver calls them with POST.
_STREAMS = ("/exec", "/attach", "/run", "/portForward")


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def node_attributes(method: str, path: str) -> tuple[str, tuple[str, ...]]:
    """(verb, subresources) of a kubelet request, as the kubelet's authorizer sees it:
    the request is let through if the user may ``verb`` any of them on this node."""
    streams = any(_under(path, prefix) for prefix in _STREAMS)
    verb = "create" if streams else _VERBS.get(method.upper(), method.lower())
    fine = [subresource for prefix, subresource in _FINE_GRAINED if _under(path, prefix)][:1]
    coarse = next((subresource for prefix, subresource in _COARSE if _under(path, prefix)), "proxy")
    return verb, (*fine, coarse)


def _forbidden(user: User, verb: str, subresources: tuple[str, ...]) -> AuthError:
    """A kubelet's words for a refusal, every subresource it checked named."""
    return AuthError(
        403,
        f"Forbidden (user={user.name}, verb={verb}, resource=nodes, "
        f"subresource(s)=[{' '.join(subresources)}])",
    )


def user_from_certificate(peercert: dict[str, Any] | None) -> User | None:
    """The user a verified client certificate names: CN the name, O the groups."""
    name, groups = certificate_subject(peercert)
    return User(name, groups=groups) if name else None


class _TtlCache:
    """Shared by the kubelet API's thread and the estimator's."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def lapsed(self, key: Any) -> Any:
        """The answer kept for ``key``, lapsed or not, while it is still held."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def put(self, key: Any, value: Any, ttl: float) -> None:
        with self._lock:
            if len(self._entries) >= _CACHE_LIMIT:
                now = time.monotonic()
                self._entries = {k: v for k, v in self._entries.items() if v[0] >= now}
                if len(self._entries) >= _CACHE_LIMIT:
                    self._entries.clear()
            self._entries[key] = (time.monotonic() + ttl, value)


class Authorizer:
    """Authenticates and authorizes requests against the upper apiserver."""

    def __init__(
        self, upper: KubeClient, node_name: str, home: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """``home``: the loop ``upper`` belongs to, when some callers run on another
        thread's (the estimator's); their cached decisions are answered where they are."""
        self.upper = upper
        self.node_name = node_name
        self.home = home
        self._tokens = _TtlCache()
        self._decisions = _TtlCache()
        # Reviews waiting, by whether the answer was yes before (on the ``home`` loop only).
        self._pending_reviews = {False: 0, True: 0}

    async def authenticate(
        self, peercert: dict[str, Any] | None, authorization: str, audience: str | None = None
    ) -> User:
        """``audience``: the one a bearer token must be for; none, the upper apiserver's
        own (as a kubelet's tokens are)."""
        user = user_from_certificate(peercert)
        if user is not None:
            return user
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return await self._review_token(token.strip(), audience)
        raise AuthError(401, "Unauthorized: no client certificate or bearer token")

    async def _review_token(self, token: str, audience: str | None) -> User:
        key = (token, audience)
        cached: User | None = self._tokens.get(key)
        if cached is not None:
            return cached
        spec: dict[str, Any] = {"token": token}
        if audience is not None:
            spec["audiences"] = [audience]
        review = await self._post(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec},
            passed_before=self._tokens.lapsed(key) is not None,
        )
        status = review.get("status") or {}
        if not status.get("authenticated"):
            raise AuthError(401, "Unauthorized: " + (status.get("error") or "invalid token"))
        # An authenticator that does not know audiences answers without them: such a
        # token could be one for the apiserver itself.
        if audience is not None and audience not in (status.get("audiences") or ()):
            raise AuthError(401, f"Unauthorized: the token is not for audience {audience}")
        info = status.get("user") or {}
        user = User(
            info.get("username", ""),
            info.get("uid", ""),
            tuple(info.get("groups") or ()),
            tuple(sorted((k, tuple(v)) for k, v in (info.get("extra") or {}).items())),
        )
        self._tokens.put(key, user, TOKEN_TTL)
        return user

    async def authorize(self, user: User, method: str, path: str) -> None:
        verb, subresources = node_attributes(method, path)
        for subresource in subresources:
            if await self._allowed(user, verb, subresource):
                return
        raise _forbidden(user, verb, subresources)

    async def authorize_node_access(self, user: User, verb: str, subresource: str) -> None:
        """Whether ``user`` may ``verb`` this node's ``subresource`` (the estimator asks
        for ``get nodes/estimator``)."""
        if not await self._allowed(user, verb, subresource):
            raise _forbidden(user, verb, (subresource,))

    async def _allowed(self, user: User, verb: str, subresource: str) -> bool:
        key = (user, verb, subresource)
        allowed: bool | None = self._decisions.get(key)
        if allowed is None:
            review = await self._post(
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {
                        "user": user.name,
                        "uid": user.uid,
                        "groups": list(user.groups),
                        "extra": {k: list(v) for k, v in user.extra},
                        "resourceAttributes": {
                            "verb": verb,
                            "resource": "nodes",
                            "subresource": subresource,
                            "name": self.node_name,
                        },
                    },
                },
                passed_before=self._decisions.lapsed(key) is True,
            )
            allowed = bool((review.get("status") or {}).get("allowed"))
            self._decisions.put(key, allowed, ALLOW_TTL if allowed else DENY_TTL)
        return allowed

    async def _post(
        self, path: str, body: dict[str, Any], *, passed_before: bool
    ) -> dict[str, Any]:
        return await on_loop(self.home, self._review(path, body, passed_before))

    async def _review(self, path: str, body: dict[str, Any], passed_before: bool) -> dict[str, Any]:
        if self._pending_reviews[passed_before] >= MAX_PENDING_REVIEWS:
            raise AuthError(429, "Too many requests: access checks waiting; try again later")
        self._pending_reviews[passed_before] += 1
        try:
            review: dict[str, Any] = await self.upper.request("POST", path, body=body)
            return review
        except API_ERRORS as error:
            raise AuthError(
                503, f"cannot check access with the upper apiserver: {error}"
            ) from error
        finally:
            self._pending_reviews[passed_before] -= 1
