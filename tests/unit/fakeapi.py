"""A KubeClient whose requests never leave the process, for controller unit tests: every
request is recorded, answered from a table of scripted answers (an object or an
ApiError, first match wins, used once), else as an apiserver would for a write that
succeeds (the body back, with a UID) or a read of something absent (404)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubekit.client import ApiError, KubeClient
from kubekit.ratelimit import TokenBucket

JSON = dict[str, Any]


def not_found(kind: str, name: str) -> ApiError:
    body = {"reason": "NotFound", "message": f'{kind} "{name}" not found'}
    return ApiError(404, {**body, "details": {"kind": kind, "name": name}})


def status_error(status: int, reason: str, message: str, **details: Any) -> ApiError:
    return ApiError(status, {"reason": reason, "message": message, "details": details})


@dataclass
class Request:
    method: str
    path: str
    body: Any
    timeout: float = 60.0


@dataclass
class FakeClient(KubeClient):
    # (method, path) -> answers given in turn: a JSON object, or an exception raised.
    answers: dict[tuple[str, str], list[JSON | BaseException]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(None, TokenBucket(qps=1e9, burst=10**9), None)  # type: ignore[arg-type]
        self._uids = itertools.count(1)

    def answer(self, method: str, path: str, *answers: JSON | BaseException) -> None:
        self.answers.setdefault((method, path), []).extend(answers)

    def writes(self, method: str | None = None) -> list[tuple[str, str]]:
        return [
            (r.method, r.path)
            for r in self.requests
            if r.method != "GET" and (method is None or r.method == method)
        ]

    async def get_text(
        self, path: str, *, timeout: float = 60.0, retry_when_told: bool = True
    ) -> str:
        self.requests.append(Request("GET", path, None))
        scripted = self.answers.get(("GET", path))
        if scripted:
            answer = scripted.pop(0)
            if isinstance(answer, BaseException):
                raise answer
        return "ok"

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 60.0,
        retry_when_told: bool = True,
    ) -> JSON:
        self.requests.append(Request(method, path, body, timeout))
        scripted = self.answers.get((method, path))
        if scripted:
            answer = scripted.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        if method == "GET":
            raise not_found(path.rsplit("/", 2)[-2], path.rsplit("/", 1)[-1])
        if method in ("POST", "PUT") and isinstance(body, dict):
            metadata = {"uid": f"uid-{next(self._uids)}", **body.get("metadata", {})}
            return {**body, "metadata": {**metadata, "resourceVersion": "1"}}
        return {}
