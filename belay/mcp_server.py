"""An MCP server for agents: read belay's jobs, steps, events, queues and
workflows, and — when the operator allows it — retry, cancel, signal and steer.

Built on the ``mcp`` package (extra ``mcp``). ``belay mcp --url URL`` serves it
over stdio (what desktop and IDE agents spawn); ``--transport http`` serves
streamable HTTP at ``http://HOST:PORT/mcp``. Every mutating tool is listed but
refused unless the server was started with ``--allow-mutations`` or an
``--authorizer``; a refusal reaches the agent as a tool error.

Every argument goes through :mod:`belay.ops`'s checks before any SQL (the
integers before pydantic's lax coercion, which would take ``True`` for 1 and
``"1_0"`` for 10); a bad one is a tool error naming it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Annotated, Any, Final, TypeVar

import psycopg
import psycopg.errors

from belay import ops
from belay.client import Belay
from belay.errors import INVALID, UNAVAILABLE, BelayError, ConfigurationError, database_failure
from belay.job import STATES
from belay.origin import BrowserGuard

try:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import ToolAnnotations
    from pydantic import BeforeValidator, Field
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"belay mcp needs the 'mcp' package ({exc}): pip install 'belay[mcp]'"
    ) from None

__all__ = ["TRANSPORTS", "build_server", "serve"]

#: The transports :func:`serve` knows.
TRANSPORTS: Final = ("stdio", "http")

#: The path of the streamable HTTP endpoint.
HTTP_PATH: Final = "/mcp"

_MUTATION_NOTE = (
    "Disabled unless the server was started with --allow-mutations or --authorizer: "
    "otherwise the call is refused with a tool error and nothing is written."
)

_T = TypeVar("_T")


def _integer(what: str, low: int = 1, high: int = ops.MAX_ID) -> BeforeValidator:
    """The raw argument through ops.int_arg (None passes: the parameter's default)."""
    return BeforeValidator(
        lambda value: None if value is None else ops.int_arg(value, what, low=low, high=high))


JobId = Annotated[int, BeforeValidator(lambda value: ops.id_arg(value, "job_id")),
                  Field(description="a job id (belay_jobs.id)")]


def instructions(guard: ops.Guard) -> str:
    """The text an agent reads when it connects: what belay is, what the tools
    show, and whether mutations are on."""
    if guard.authorizer is not None:
        mode = "Mutations are decided call by call by the operator's authorizer."
    elif guard.allow:
        mode = "Mutations are allowed (the server was started with --allow-mutations)."
    else:
        mode = ("Mutations are disabled: this server is read-only (start it with "
                "--allow-mutations or --authorizer to allow them).")
    return (
        "belay is a durable job engine on PostgreSQL. A job has a kind, a queue and a state "
        f"({', '.join(STATES)}); failed attempts are retried up to max_attempts. Its code "
        "journals steps (each step's value and cost in USD and tokens, kept so a retry "
        "resumes instead of redoing work), emits events (a progress stream), may spawn "
        "child jobs and may park awaiting a signal. Workflows are named jobs with "
        "dependencies.\n"
        "Read tools: stats (per-queue counts, spend, throughput), list_jobs (newest "
        "first, filter and page with before_id), get_job (one job with its steps, "
        "costs, events, children and workflow), job_events (events after a seq), "
        "workflow_status (a workflow's members and edges).\n"
        "Mutating tools: retry_job (a failed or cancelled job), cancel_job, signal "
        "(deliver a named signal to a job), steer_job (guidance the job's code reads with "
        "ctx.steering()), top_up (raise a job's budget; a job paused over it resumes). "
        f"{mode}"
    )


def build_server(client: Belay, guard: ops.Guard) -> MCPServer[Any]:
    """The MCP server over ``client``: the read tools and the mutations of
    :data:`belay.ops.MUTATIONS`, each checked by ``guard``. Tool functions are
    sync; the SDK runs them in worker threads, off the event loop."""
    server: MCPServer[Any] = MCPServer(
        "belay", title="belay jobs", version=_version(),
        instructions=instructions(guard), log_level="WARNING",
    )
    read = ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)

    def writes(*, destructive: bool, idempotent: bool) -> ToolAnnotations:
        return ToolAnnotations(read_only_hint=False, destructive_hint=destructive,
                               idempotent_hint=idempotent, open_world_hint=False)

    def tool(annotations: ToolAnnotations, name: str | None = None,
             note: str = "") -> Callable[[Callable[..., _T]], Callable[..., _T]]:
        def register(fn: Callable[..., _T]) -> Callable[..., _T]:
            text = " ".join((fn.__doc__ or "").split())
            server.add_tool(fn, name=name, annotations=annotations,
                            description=f"{text} {note}".strip())
            return fn
        return register

    @tool(read)
    def stats() -> dict[str, Any]:
        """Per-queue overview: job counts by state, spend (USD, tokens), jobs
        finished in the last minute by outcome, the queue's options and whether
        it is paused."""
        return _call(lambda: {"now": ops.jsonable(client.now()),
                              "queues": ops.queue_overview(client)})

    @tool(read)
    def list_jobs(
        queue: str | None = None,
        state: Annotated[str | None, Field(description=f"one of {', '.join(STATES)}")] = None,
        kind: str | None = None,
        workflow_id: str | None = None,
        parent_id: Annotated[int | None, _integer("parent_id"),
                             Field(description="only children of this job")] = None,
        before_id: Annotated[int | None, _integer("before_id"), Field(
            description="page: only jobs with a smaller id (pass next_before_id)")] = None,
        limit: Annotated[int, _integer("limit", 1, 10_000),
                         Field(description="1 to 10000")] = 50,
    ) -> dict[str, Any]:
        """Jobs newest first, filtered by queue, state, kind, workflow or parent.
        When a page is full, next_before_id is the before_id of the next page."""
        def run() -> dict[str, Any]:
            jobs = client.list_jobs(
                queue=_name(queue, "queue"),
                state=None if state is None else ops.state_arg(state),
                kind=_name(kind, "kind"), workflow_id=_name(workflow_id, "workflow_id"),
                parent_id=parent_id, before_id=before_id, limit=limit)
            return {"jobs": [ops.job_line(job) for job in jobs], "count": len(jobs),
                    "next_before_id": jobs[-1].id if len(jobs) == limit else None}
        return _call(run)

    @tool(read)
    def get_job(job_id: JobId) -> dict[str, Any]:
        """One job: every field, its step journal with each step's cost (and the
        journal's total), its events, its children and its workflow."""
        detail = _call(lambda: ops.job_detail(client, job_id))
        if detail is None:
            raise ToolError(_no_job(job_id))
        return detail

    @tool(read)
    def job_events(
        job_id: JobId,
        after: Annotated[int, _integer("after", 0),
                         Field(description="only events with a larger seq; 0: all")] = 0,
        limit: Annotated[int, _integer("limit", 1, 1000),
                         Field(description="at most this many events (1-1000)")] = 200,
    ) -> dict[str, Any]:
        """A job's events after sequence number ``after``, in order, at most
        ``limit``; call again with ``after=last_seq`` for more (``more`` says
        whether there are), or to follow a running job."""

        def run() -> dict[str, Any] | None:
            with client.connection() as conn:
                job = client.get_job(job_id, conn=conn)
                if job is None:
                    return None
                events = client.events(job_id, after, limit=limit + 1, conn=conn)
            more = len(events) > limit
            events = events[:limit]
            return {"job_id": job_id, "state": job.state,
                    "events": [ops.event_view(e) for e in events],
                    "last_seq": events[-1].seq if events else after, "more": more}
        found = _call(run)
        if found is None:
            raise ToolError(_no_job(job_id))
        return found

    @tool(read)
    def workflow_status(workflow_id: str) -> dict[str, Any]:
        """A workflow's members (name, id, kind, state, deps), its dependency
        edges, counts by state, and whether every member is terminal."""
        status = _call(lambda: client.workflow_status(ops.name_arg(workflow_id, "workflow_id")))
        if not status.jobs:
            raise ToolError(f"no workflow {workflow_id!r} (no job has that workflow_id)")
        return ops.workflow_view(status)

    @tool(read)
    def spend(
        by: Annotated[list[str] | str, Field(description=(
            "one or two of kind, queue, day, hour, workflow, parent, tree, meta:KEY"))] = "kind",
        since: Annotated[str, Field(description=(
            "a span back from until (30m, 24h, 7d, 2w) or an ISO 8601 time"))] = "7d",
        until: Annotated[str | None, Field(description="ISO 8601 time; default now")] = None,
        kind: str | None = None,
        queue: str | None = None,
        meta: Annotated[dict[str, Any] | None, Field(
            description="only jobs whose meta contains these keys and values")] = None,
        limit: Annotated[int, _integer("limit", 1, 10_000),
                         Field(description="at most this many groups (1-10000)")] = 100,
        tree: Annotated[int | None, _integer("tree"), Field(
            description="instead: this job and all its descendants, per kind")] = None,
    ) -> dict[str, Any]:
        """What jobs spent (USD, tokens) over a time range, grouped by kind,
        queue, day or hour (UTC), workflow, parent, tree (root job) or a meta
        key such as a customer id: the largest groups first (day/hour in time
        order) and the total of all. A job's spend is its own; a shared child
        budget's charge-back to its parent is counted once."""
        return _call(lambda: ops.spend_view(client, {
            "by": by, "since": since, "until": until, "kind": kind, "queue": queue,
            "meta": meta, "limit": limit, "tree": tree}))

    def mutation(tool: str, args: dict[str, Any]) -> dict[str, Any]:
        return _call(lambda: ops.mutate(client, guard, tool, args))

    @tool(writes(destructive=False, idempotent=False), note=_MUTATION_NOTE)
    def retry_job(job_id: JobId) -> dict[str, Any]:
        """Run a failed or cancelled job again (one more attempt if it had used
        them all); returns the job as it is now."""
        return mutation("retry_job", {"job_id": job_id})

    @tool(writes(destructive=True, idempotent=True), note=_MUTATION_NOTE)
    def cancel_job(job_id: JobId) -> dict[str, Any]:
        """Cancel a job. status is 'cancelled' when it was waiting (ready, held,
        awaiting), 'requested' when it is running (it stops at its next step),
        'noop' when it had already finished."""
        return mutation("cancel_job", {"job_id": job_id})

    @tool(writes(destructive=False, idempotent=False), name="signal", note=_MUTATION_NOTE)
    def signal_job(
        job_id: JobId,
        name: Annotated[str, Field(description="the signal name the job awaits")],
        payload: Annotated[dict[str, Any] | None, Field(
            description="a JSON object handed to the job")] = None,
    ) -> dict[str, Any]:
        """Deliver the signal ``name`` with a JSON-object payload to a job (scope
        job:<id>). A job awaiting it wakes (woken lists the ids); otherwise it is
        kept for the job's next await of that name."""
        return mutation("signal", {"job_id": job_id, "name": name, "payload": payload or {}})

    @tool(writes(destructive=False, idempotent=False), note=_MUTATION_NOTE)
    def steer_job(
        job_id: JobId,
        payload: Annotated[dict[str, Any], Field(description="the guidance, a JSON object")],
    ) -> dict[str, Any]:
        """Leave steering guidance for a job, a JSON object like
        {"instruction": "…"}; the job's code reads the latest with
        ctx.steering()."""
        return mutation("steer_job", {"job_id": job_id, "payload": payload})

    @tool(writes(destructive=False, idempotent=False), note=_MUTATION_NOTE)
    def top_up(
        job_id: JobId,
        usd: Annotated[float | None, Field(description="dollars added to the USD cap")] = None,
        tokens: Annotated[int | None, Field(description="tokens added to the token cap")
                          ] = None,
        idempotency_key: Annotated[str | None, Field(
            description="makes a retry safe: the same key again on this job changes "
                        "nothing (duplicate: true); with other amounts it is an error")
        ] = None,
    ) -> dict[str, Any]:
        """Raise a job's budget caps. A job paused over its budget (awaiting
        $top_up) resumes from its journal once the caps cover its spend (resumed
        says whether it did); its paid steps are not paid again. Send an
        idempotency_key when the call may be retried (a timeout, a lost answer)."""
        return mutation("top_up", {"job_id": job_id, "usd": usd, "tokens": tokens,
                                   "idempotency_key": idempotency_key})

    @tool(read)
    def schedules() -> dict[str, Any]:
        """Every schedule (a cron with an overlap policy and a catch-up mode):
        its definition, revision, last and next occurrence, active job, and
        whether it is cancelled."""
        return _call(lambda: {"schedules": [s.to_dict() for s in client.schedules()]})

    @tool(read)
    def schedule_status(name: str) -> dict[str, Any]:
        """One schedule's definition and state."""
        found = _call(lambda: client.schedule_status(ops.name_arg(name, "name")))
        if found is None:
            raise ToolError(f"no schedule {name!r}")
        return found.to_dict()

    @tool(writes(destructive=False, idempotent=True), note=_MUTATION_NOTE)
    def schedule(
        name: str,
        expression: Annotated[str, Field(description='five UTC cron fields like "0 3 * * *"')],
        worker: Annotated[str, Field(description="the kind its jobs get")],
        input: Annotated[dict[str, Any] | None, Field(description="the jobs' input")] = None,
        overlap: Annotated[str, Field(description="skip (default), queue or allow: what an "
                                      "occurrence does while the previous one runs")] = "skip",
        catch_up: Annotated[str, Field(description="latest (default) or all: several due "
                                       "at once run as one, or each in turn")] = "latest",
        options: Annotated[dict[str, Any] | None, Field(
            description="enqueue options: queue, priority, max_attempts, meta, budget, "
                        "partition_key")] = None,
    ) -> dict[str, Any]:
        """Create or redeclare a schedule (idempotent: the same definition
        changes nothing; a cancelled one comes back)."""
        return mutation("schedule", {"name": name, "expression": expression, "worker": worker,
                                     "input": input, "overlap": overlap,
                                     "catch_up": catch_up, "options": options})

    @tool(writes(destructive=True, idempotent=False), note=_MUTATION_NOTE)
    def cancel_schedule(name: str) -> dict[str, Any]:
        """Stop a schedule firing; its status stays readable (a job it already
        fired runs on)."""
        return mutation("cancel_schedule", {"name": name})

    return server


def serve(
    url: str,
    *,
    guard: ops.Guard | None = None,
    transport: str = "stdio",
    host: str = "127.0.0.1",
    port: int = 8765,
) -> None:
    """Serve the MCP server on one :class:`~belay.client.Belay` for its whole
    life, until stdin closes (stdio) or SIGTERM/SIGINT (both). The database is
    checked first, so a wrong URL or schema fails before any client connects."""
    if transport not in TRANSPORTS:
        raise ConfigurationError(
            f"unknown MCP transport {transport!r}; transports are {', '.join(TRANSPORTS)}")
    guard = guard if guard is not None else ops.Guard()
    with Belay(url) as client:
        with client.connection():
            pass  # opens the pool and checks the schema
        server = build_server(client, guard)
        if transport == "stdio":
            with _exit_on_signal(client):
                server.run("stdio")
            return
        _serve_http(server, host, port, guard)


# -- Helpers ------------------------------------------------------------------------


def _call(fn: Callable[[], _T]) -> _T:
    """Run ``fn``, turning what a caller can cause (bad arguments, refusals, an
    unknown id, a database that went away) into a ToolError with its message."""
    try:
        return fn()
    except BelayError as exc:
        raise ToolError(str(exc)) from exc
    except psycopg.Error as exc:
        said = str(exc).strip()
        kind = database_failure(exc)
        if kind == UNAVAILABLE:
            raise ToolError(f"the database is unreachable: {said}") from exc
        if kind == INVALID:  # a value PostgreSQL can't take, like a NUL
            raise ToolError(f"the database refused a value of this call: {said}") from exc
        hint = (" (grant the server's database role the privilege, or connect as another "
                "role)" if isinstance(exc, psycopg.errors.InsufficientPrivilege) else "")
        raise ToolError(f"the database refused: {said}{hint}") from exc


def _name(value: str | None, what: str) -> str | None:
    """An optional name argument, checked as belay checks stored names."""
    return None if value is None else ops.name_arg(value, what)


def _no_job(job_id: int) -> str:
    return f"no job {job_id} (never inserted, or pruned by retention)"


def _version() -> str:
    try:
        return metadata.version("belay")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree not installed
        return ""


@contextlib.contextmanager
def _exit_on_signal(client: Belay) -> Iterator[None]:
    """SIGTERM and SIGINT end a stdio server at once with exit status 0.

    The SDK reads stdin in a thread that no cancellation reaches, so an orderly
    shutdown would wait for the client to close stdin; instead the pool is
    closed and the process exits (PostgreSQL rolls back a call cut short; each
    mutation is one transaction). Outside the main thread signals are left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        with contextlib.suppress(Exception):
            client.close()
        sys.stderr.flush()
        os._exit(0)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def http_app(server: MCPServer[Any], host: str) -> Any:
    """The streamable HTTP transport as an ASGI app, behind belay's browser rule
    (:class:`belay.origin.BrowserGuard`): a POST or DELETE sent by a page of
    another origin is 403, a POST that is not ``application/json`` 415. The
    SDK's own guard lets any loopback origin through on a loopback ``host``,
    and checks no origin at all elsewhere."""
    return BrowserGuard(server.streamable_http_app(streamable_http_path=HTTP_PATH, host=host))


def _serve_http(server: MCPServer[Any], host: str, port: int, guard: ops.Guard) -> None:
    import uvicorn

    config = uvicorn.Config(http_app(server, host), host=host, port=port, log_level="warning")
    if guard.allow and guard.authorizer is None and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"belay mcp: warning: --allow-mutations on {host}: anyone who reaches this port "
              "can retry, cancel, signal and steer jobs (prefer --authorizer)", file=sys.stderr)
    with _listen(host, port) as sock:
        print(f"belay mcp: serving streamable HTTP at http://{_netloc(host, port)}{HTTP_PATH}",
              file=sys.stderr, flush=True)
        # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal
        # again under the handlers it found: these make that a clean return.
        handlers: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, _ignore)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def _listen(host: str, port: int) -> Iterator[socket.socket]:
    """A socket bound to ``host:port``, or a ConfigurationError saying why not."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigurationError(f"--host {host!r}: {exc}") from None
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigurationError(
                f"cannot listen on {_netloc(host, port)}: {exc.strerror or exc}; "
                "choose another --port (or --host)") from None
        yield sock


def _ignore(signum: int, frame: object) -> None:
    """Swallow the signal uvicorn re-raises after its graceful shutdown."""


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

