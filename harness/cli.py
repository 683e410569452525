"""The ``kubestrata`` commands of the local federation: up, down, kubeconfig, status;
the components' are listed for --help (kubekit.cli runs them)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from harness.process import ProcessError
from harness.state import STATE_FILE, UPPER, ClusterError, default_state_dir, kubeconfig_path
from harness.toolchain import Toolchain, ToolchainError
from kubekit.cli import COMPONENTS
from kubekit.quantity import QuantityError, parse_quantity


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir(),
        help="where the federation keeps certificates, kubeconfigs, logs and PIDs "
        "(default: %(default)s)",
    )


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {number}")
    return number


def _amount(value: str) -> str:
    """A node's cpu or memory: told at once rather than by the apiserver refusing the
    Node once every control plane has started."""
    try:
        amount = parse_quantity(value)
    except QuantityError as error:
        raise argparse.ArgumentTypeError(f"{value!r} is not a Kubernetes quantity") from error
    if amount <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubestrata", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, package in COMPONENTS.items():
        # Listed for --help; their own parsers take over in main().
        commands.add_parser(name, help=f"run the {package} component (see `{name} --help`)")

    up = commands.add_parser(
        "up", help="start a local federation: 1 upper (or more tenants) + N lower clusters"
    )
    _add_state_dir(up)
    up.add_argument("--lower", type=_positive, default=2, help="lower clusters (default 2)")
    up.add_argument(
        "--tenants",
        type=_positive,
        default=1,
        help="upper (tenant) clusters sharing the lower ones: upper, tenant-2, ... each with "
        "its own virtual nodes, webhook and multischeduler, its namespaces prefixed below "
        "t1-, t2-, ... (default 1: one upper cluster, namespaces unprefixed)",
    )
    up.add_argument(
        "--nodes",
        type=_non_negative,
        default=3,
        help="simulated nodes per lower cluster (default 3)",
    )
    up.add_argument(
        "--node-cpu", type=_amount, default="16", help="cpu of each simulated node (default 16)"
    )
    up.add_argument(
        "--node-memory",
        type=_amount,
        default="64Gi",
        help="memory of each simulated node (default 64Gi)",
    )
    up.add_argument(
        "--node-pods",
        type=_positive,
        default=110,
        help="pod capacity of each simulated node (default 110)",
    )
    up.add_argument(
        "--k3s",
        action="store_true",
        help="lower clusters as K3s containers (needs Docker and pip install -e '.[k3s]')",
    )
    up.add_argument(
        "--no-multischeduler",
        dest="multischeduler",
        action="store_false",
        help="leave the upper kube-scheduler without the multischeduler extender: pods go "
        "to any virtual node whose summed free capacity takes them (the blind behaviour)",
    )
    up.add_argument(
        "--no-descheduler",
        dest="descheduler",
        action="store_false",
        help="leave pods stuck in a lower cluster where they are",
    )
    up.add_argument(
        "--metrics-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a metrics-server in every local cluster, for kubectl top (default: on)",
    )
    up.add_argument(
        "--detach",
        action="store_true",
        help="return once ready and leave the federation running (stop: kubestrata down)",
    )

    down = commands.add_parser("down", help="stop the local federation and remove its state")
    _add_state_dir(down)

    kubeconfig = commands.add_parser("kubeconfig", help="print the path of a cluster's kubeconfig")
    _add_state_dir(kubeconfig)
    kubeconfig.add_argument(
        "--cluster",
        default=UPPER,
        help="cluster name: upper, tenant-2, ..., lower-1, ... (default: upper)",
    )

    status_command = commands.add_parser(
        "status", help="the virtual nodes of the federation, or of any upper cluster"
    )
    _add_state_dir(status_command)
    status_command.add_argument(
        "--kubeconfig", help="an upper cluster's kubeconfig (default: the local federation's)"
    )
    status_command.add_argument("-o", "--output", choices=["table", "json"], default="table")
    return parser


def _up(args: argparse.Namespace) -> int:
    # The control planes' machinery is loaded by the commands that run them only, so the
    # ones that read (kubeconfig, status) start fast.
    from harness.federation import Federation, FederationSpec, supervising_process

    spec = FederationSpec(
        tenants=args.tenants,
        lower=args.lower,
        nodes_per_lower=args.nodes,
        node_cpu=args.node_cpu,
        node_memory=args.node_memory,
        node_pods=args.node_pods,
        k3s=args.k3s,
        metrics_server=args.metrics_server,
    )
    federation = Federation(
        args.state_dir, spec.clusters(), Toolchain.locate(), die_with_parent=not args.detach
    )
    if not args.detach:
        federation.supervisor = supervising_process("kubestrata up")
    stop_requested = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        stop_requested.set()
        raise KeyboardInterrupt

    # SIGINT too: a shell starts a background job with it ignored, and Python then leaves
    # it so, but Ctrl-C (or kill -INT) must stop a federation started in the foreground.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    print(f"starting {len(federation.clusters)} clusters in {args.state_dir} ...", flush=True)
    federation.start()
    try:
        federation.start_virtual_nodes()
        for tenant in federation.tenants:
            federation.start_webhook(tenant=tenant)
            if args.multischeduler:
                federation.start_multischeduler(tenant=tenant)
            if args.descheduler:
                federation.start_descheduler(tenant=tenant)
    except BaseException:
        federation.stop()
        raise
    print("ready. Point kubectl at a cluster with:")
    for name, cluster in federation.clusters.items():
        print(f"  {name:>10}:  export KUBECONFIG={cluster.kubeconfig}")
    if shutil.which("kubectl") is None:
        print(
            "kubectl is not on PATH; the one built with the clusters: "
            f"{federation.toolchain.kubectl}"
        )
    if args.detach:
        print(
            "stop it with: kubestrata down"
            + ("" if args.state_dir == default_state_dir() else f" --state-dir {args.state_dir}")
        )
        return 0
    print("running; press Ctrl-C to stop.", flush=True)
    try:
        federation.supervise(stop_requested, lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        federation.stop()
    return 0


def _down(args: argparse.Namespace) -> int:
    from harness.federation import stop_state_dir

    if not args.state_dir.exists():
        print(f"nothing to stop: {args.state_dir} does not exist")
        return 0
    if any(args.state_dir.iterdir()) and not (args.state_dir / STATE_FILE).exists():
        # Removed below: never a directory `up` did not make (a mistyped path, `.`).
        raise ClusterError(
            f"{args.state_dir} is not a kubestrata state directory (no {STATE_FILE}); "
            "nothing stopped or removed"
        )
    stopped = stop_state_dir(args.state_dir)
    shutil.rmtree(args.state_dir)
    print(f"stopped {stopped} processes and removed {args.state_dir}")
    return 0


def _kubeconfig(args: argparse.Namespace) -> int:
    print(kubeconfig_path(args.state_dir, args.cluster))
    return 0


def _status(args: argparse.Namespace) -> int:
    # The API client is loaded for this command only, as the components are for theirs.
    from kubekit import status

    kubeconfig = args.kubeconfig or str(kubeconfig_path(args.state_dir))
    if not Path(kubeconfig).is_file():
        # Else the client's own words: a stray "Config not found" and "Invalid kube-config
        # file. Expected key current-context".
        raise ClusterError(f"no kubeconfig at {kubeconfig}")
    try:
        rows = asyncio.run(status.collect(kubeconfig))
    except status.READ_ERRORS as error:
        raise ClusterError(f"cannot read the virtual nodes with {kubeconfig}: {error}") from error
    print(status.as_json(rows) if args.output == "json" else status.table(rows))
    return 0


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": _up,
    "down": _down,
    "kubeconfig": _kubeconfig,
    "status": _status,
}


def main(argv: Sequence[str]) -> int:
    """The local federation's commands (kubekit.cli hands the components' own over)."""
    args = build_parser().parse_args(argv)
    try:
        return _HANDLERS[args.command](args)
    # A command of the toolchain timing out, a file that cannot be removed: one line too.
    except (
        ClusterError,
        ProcessError,
        ToolchainError,
        ValueError,
        OSError,
        subprocess.TimeoutExpired,
    ) as error:
        print(f"kubestrata {args.command}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
