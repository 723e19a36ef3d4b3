"""``psctl dashboard``'s web server: the page, its script, the charting library (uPlot,
vendored under ``psctl/dashboard_static`` with its licence, so the page needs no network) and
the series as JSON, over the standard library's HTTP server."""

from __future__ import annotations

import argparse
import html
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from psctl import admin
from psctl.dashboard import DEFAULT_INTERVAL_S, DashboardSources, Sampler
from pswire import cli

STATIC = Path(__file__).resolve().parent / "dashboard_static"
# The files the page may load, and their types; nothing else under STATIC is served.
FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}


class DashboardServer:
    """Serves the dashboard of ``sampler`` on ``host:port`` (0: a free port) in a thread.

    Raises (constructor):
        OSError: the address cannot be bound.
    """

    def __init__(self, sampler: Sampler, host: str, port: int) -> None:
        self.sampler = sampler
        handler = _handler(sampler)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="dashboard-http", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5.0)


def render_page(sampler: Sampler) -> str:
    """The page with the current step counter filled in (the script keeps it current)."""
    template = (STATIC / "index.html").read_text(encoding="utf-8")
    series = sampler.series()
    shards = ", ".join(sampler.sources.shards)
    return (
        template.replace("{{steps}}", str(series["steps"]))
        .replace("{{step_unit}}", series["step_unit"])
        .replace("{{shards}}", html.escape(shards))
        .replace("{{interval_ms}}", str(int(sampler.interval * 1000)))
    )


def _handler(sampler: Sampler) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server calls it by this name
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", render_page(sampler).encode())
            elif path == "/api/series":
                body = json.dumps(sampler.series(), allow_nan=False).encode()
                self._send(200, "application/json", body)
            elif path.startswith("/static/") and path[len("/static/") :] in FILES:
                name = path[len("/static/") :]
                self._send(200, FILES[name], (STATIC / name).read_bytes())
            else:
                self._send(404, "text/plain; charset=utf-8", f"no page {path}\n".encode())

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a request a second is noise on the operator's terminal

    return Handler


# -- psctl dashboard --------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``dashboard`` to ``psctl``'s subcommands."""
    parser = commands.add_parser(
        "dashboard",
        help="serve a live web view of a running job (steps/s, loss, waits, bytes, memory)",
        description=(
            "Reads every shard's Status (and, with --metrics, its /metrics) and the workers' "
            "reports each --interval, and serves a page plotting them: steps/s, loss, "
            "staleness, RSS and bytes sent and received per worker; sync round wait, bytes "
            "in and out, refused requests and RSS per shard; membership changes marked on "
            "the time axis; a table of the workers. In a DiLoCo job the steps are outer "
            "steps. The page loads nothing from the network. Prints the page's address."
        ),
        epilog=admin.SECURITY_EPILOG,
    )
    admin.add_target_flags(parser, timeout=5.0)
    cli.add(
        parser,
        "--metrics",
        env="PS_DASHBOARD_METRICS",
        default="",
        help="each shard's /metrics as host:port, comma-separated, in the shards' order "
        "(psserver --metrics-port); unset: Status only",
    )
    cli.add(
        parser,
        "--reports",
        env="PS_REPORT_DIR",
        help="the folder the workers report to (the job's $PS_REPORT_DIR)",
    )
    cli.add(
        parser, "--host", env="PS_DASHBOARD_HOST", default="127.0.0.1", help="address to serve on"
    )
    cli.add(
        parser,
        "--port",
        env="PS_DASHBOARD_PORT",
        type=int,
        default=8765,
        help="port to serve on (0: any free port)",
    )
    cli.add(
        parser,
        "--port-file",
        env="PS_DASHBOARD_PORT_FILE",
        help="write the bound port here once serving",
    )
    cli.add(
        parser,
        "--interval",
        env="PS_DASHBOARD_INTERVAL",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between reads of the sources",
    )
    return parser


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Runs ``psctl dashboard`` until SIGINT or SIGTERM; returns the exit code."""
    addresses = admin.shard_addresses(parser, args)
    metrics = tuple(a.strip() for a in args.metrics.split(",") if a.strip())
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    try:
        sources = DashboardSources(
            tuple(addresses),
            metrics,
            Path(args.reports) if args.reports else None,
            args.timeout,
        )
        sampler = Sampler(sources, args.interval)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        server = DashboardServer(sampler, args.host, args.port)
    except OSError as exc:
        print(f"psctl dashboard: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sampler.start()
    server.start()
    if args.port_file:
        # Whole or not at all: a reader polling for the file never sees it empty.
        cli.write_port_file(Path(args.port_file), server.httpd.server_address[1])
    print(f"dashboard at {server.url} (shards {', '.join(addresses)})", flush=True)
    try:
        cli.wait_for_stop(stop)
    finally:
        server.stop()
        sampler.stop()
    return 0
