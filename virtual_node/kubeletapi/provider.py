"""The seam between the generic kubelet API and the cluster that really runs the pods,
in the shape of virtual-kubelet's node/api handler functions: the server validates,
authenticates and speaks the protocols; a provider reaches the containers."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

JSON = dict[str, Any]


class ProviderError(Exception):
    """What the provider could not do, as an HTTP status with a message for the user."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class LogOptions:
    follow: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None
    previous: bool = False
    since_seconds: int | None = None
    since_time: str | None = None
    timestamps: bool = False

    def query(self) -> dict[str, str]:
        """The pods/log query of the apiserver for these options."""
        values = {
            "follow": "true" if self.follow else None,
            "tailLines": self.tail_lines,
            "limitBytes": self.limit_bytes,
            "previous": "true" if self.previous else None,
            "sinceSeconds": self.since_seconds,
            "sinceTime": self.since_time,
            "timestamps": "true" if self.timestamps else None,
        }
        return {k: str(v) for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class ExecOptions:
    command: tuple[str, ...]
    stdin: bool
    stdout: bool
    stderr: bool
    tty: bool


class RemoteProcess(Protocol):
    """A running exec or attach session in the lower cluster."""

    async def send_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def resize(self, payload: bytes) -> None: ...

    def output(self) -> AsyncIterator[tuple[int, bytes]]:
        """(channel, data) from stdout (1) and stderr (2) until the process ends."""
        ...

    def status(self) -> bytes:
        """The error-channel Status (v4 JSON) once ``output()`` has ended."""
        ...

    async def close(self) -> None: ...


class PortConnection(Protocol):
    """One TCP connection to a port of a lower pod."""

    async def send(self, data: bytes) -> None: ...

    async def receive(self) -> bytes:
        """The next bytes from the pod; b"" at the end."""
        ...

    def error(self) -> str:
        """What went wrong, once ``receive()`` returned b"" ("" when nothing did)."""
        ...

    async def close(self) -> None: ...


class KubeletProvider(Protocol):
    def pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The upper pod if it runs on this node."""
        ...

    def pods(self) -> list[JSON]: ...

    def container_logs(
        self, pod: Mapping[str, Any], container: str, options: LogOptions
    ) -> AsyncGenerator[bytes, None]: ...

    async def exec(
        self, pod: Mapping[str, Any], container: str, options: ExecOptions, *, attach: bool
    ) -> RemoteProcess: ...

    async def port_forward(self, pod: Mapping[str, Any], port: int) -> PortConnection: ...

    async def stats_summary(self) -> JSON: ...

    async def resource_metrics(self) -> str: ...

    async def cadvisor_metrics(self) -> str: ...
