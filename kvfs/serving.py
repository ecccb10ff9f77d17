"""Small pieces every kvfs server's main() shares."""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import logging
import os
import pathlib
import resource
import signal
import sys
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from kvfs import tls
from kvfs.auth import Authorizer
from kvfs.config import add_flags, load
from kvfs.logs import setup_logging
from kvfs.rpc import CHANNEL_OPTIONS, ParsesRequests

log = logging.getLogger("kvfs.serving")

INSECURE_WARNING = ("%s runs with --insecure: plaintext gRPC, NO caller authentication, NO access rules; anyone "
                    "who reaches %s can read, forge and delete every tenant's cache. Use it in a trusted lab only.")


def credentials(cfg, name: str) -> tls.Credentials | None:
    """The server's TLS credentials from its config; None (and a loud warning) with
    `insecure`. Exits with the reason when the files are missing or are not a
    server's certificate."""
    try:
        creds = tls.from_config(cfg)
    except (ValueError, OSError) as err:
        raise SystemExit(f"{name}: {err}") from None
    if creds is None:
        log.warning(INSECURE_WARNING, name, cfg.listen)
        return None
    if tls.SERVER not in creds.identity.roles:
        raise SystemExit(f"{name}: {cfg.tls_cert} is not a server certificate ({creds.identity})")
    log.info("%s: mutual TLS as %s", name, creds.identity)
    return creds


def cluster_key(cfg, name: str) -> bytes | None:
    """The cluster key a config's `cluster_key` file holds; None with `insecure` (no
    seals are made or checked). Exits with the reason when it is missing."""
    if cfg.insecure:
        return None
    if not cfg.cluster_key:
        raise SystemExit(f"{name}: no --cluster-key: the secret the servers share (kvfs tls ca makes one)")
    try:
        return tls.load_cluster_key(cfg.cluster_key)
    except (ValueError, OSError) as err:
        raise SystemExit(f"{name}: cluster key: {err}") from None


def grpc_server(name: str, creds: tls.Credentials | None, max_receive: int | None = None,
                last: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> grpc.aio.Server:
    """A gRPC server whose every call is checked against kvfs.auth.RULES (none over
    plaintext: an --insecure server has no identities to check), then parsed
    (kvfs.rpc.ParsesRequests: a malformed body is INVALID_ARGUMENT). With
    `max_receive`, gRPC refuses larger requests (RESOURCE_EXHAUSTED) before
    reading them, in place of the limit CHANNEL_OPTIONS sets for chunk data.
    `last` are interceptors whose handlers run after those checks passed."""
    options = dict(CHANNEL_OPTIONS)
    if max_receive is not None:
        options["grpc.max_receive_message_length"] = max_receive
    checks = [Authorizer(name)] if creds else []
    return grpc.aio.server(options=list(options.items()), interceptors=[*checks, ParsesRequests(), *last])


def add_introspection(server: grpc.aio.Server, *services: str) -> health.aio.HealthServicer:
    """Adds the gRPC health service (returned: the caller says when it serves) and
    server reflection, which lists `services`, health and reflection itself and
    describes their messages, so grpcurl and grpcui work without the .proto files
    (access: kvfs.auth.RULES)."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return servicer


def bound_address(listen: str, port: int) -> str:
    """host:port actually bound (port 0 in `listen` means the kernel chose)."""
    if port == 0:
        raise SystemExit(f"cannot listen on {listen}")
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def write_ready_file(path: str, address: str, metrics: str = "") -> None:
    """Atomically writes the bound address where a launcher waits for it, and on a
    second line `metrics HOST:PORT` when the server serves metrics."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(address + (f"\nmetrics {metrics}" if metrics else ""))
    os.replace(tmp, path)


def freeze_startup_heap() -> int:
    """Takes every object alive now (modules, classes, the server's own set-up) out
    of the garbage collector's sight for good (gc.freeze); returns how many. A full
    collection walks every tracked object, on whichever thread allocated last, the
    event loop's nearly always; a server's are nearly all made at start-up and live
    as long as it does. Call it once set up, before serving."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class MetricsServer:
    """prometheus_client's HTTP server for one registry, in a thread of its own,
    bound to `listen` (host:port; port 0 picks a free one) and nowhere else."""

    def __init__(self, listen: str, registry: CollectorRegistry):
        host, _, port = listen.rpartition(":")
        try:
            self._httpd, self._thread = start_http_server(int(port), host.strip("[]"), registry=registry)
        except OSError as err:
            raise SystemExit(f"cannot serve metrics on {listen}: {err}") from None
        self.address = f"{host}:{self._httpd.server_port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


async def until_signalled() -> None:
    """Returns when the process gets SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


STALL_REPORT_EVERY = 10.0  # seconds: at most one stall line per this, with a count
STALL_BOUNDS = (0.025, 0.05, 0.1, 0.25, 1.0)  # seconds: LoopStats counts the stalls longer than each


class LoopStats:
    """What watch_event_loop saw since the server started: per bound of
    STALL_BOUNDS, how many stalls were longer, all of them (`over`), those
    during which the loop's thread was on the CPU at least 80% of the time
    (`over_busy`: our own code held the loop, not other processes taking the
    cores), and of the others those during which it spent at least half the
    time runnable, waiting for a core (`over_waiting`: the machine's cores were
    taken; the rest were blocked: on the disk, a lock, another thread holding the
    GIL, or a stopped process); and the longest stall."""

    def __init__(self) -> None:
        self.over = [0] * len(STALL_BOUNDS)
        self.over_busy = [0] * len(STALL_BOUNDS)
        self.over_waiting = [0] * len(STALL_BOUNDS)
        self.longest = 0.0
        self.tick = 0.0  # the watcher's timer
        self.stalled_s = 0.0  # every stall over STALL_BOUNDS[0], summed
        self.last_tick: float | None = None  # monotonic: when the watcher last woke (None: no watcher)

    def stalled_now(self) -> float:
        """stalled_s, with the stall going on now: a caller running right after the
        process was stopped (SIGSTOP, a paused VM) or its loop held runs before the
        watcher wakes to count it."""
        if self.last_tick is None:
            return self.stalled_s
        pending = time.monotonic() - self.last_tick - self.tick
        return self.stalled_s + (pending if pending > STALL_BOUNDS[0] else 0.0)

    def woke(self, now: float, held: float, thread_cpu: float, waited: float = 0.0) -> None:
        """The watcher's timer fired at `now` (monotonic), `held` seconds late; the
        loop's thread was on the CPU `thread_cpu` of them and waited for a core
        `waited` of them."""
        self.last_tick = now
        if held > STALL_BOUNDS[0]:
            self.stalled_s += held
            self.record(held, thread_cpu, waited)

    def record(self, held: float, thread_cpu: float, waited: float = 0.0) -> None:
        self.longest = max(self.longest, held)
        busy = thread_cpu >= 0.8 * held
        waiting = not busy and waited >= 0.5 * held
        for i, bound in enumerate(STALL_BOUNDS):
            if held > bound:
                self.over[i] += 1
                self.over_busy[i] += busy
                self.over_waiting[i] += waiting


# where our code lies: kvfs/ and, from a checkout, the packages beside it (pyproject.toml maps them)
_SOURCE_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
_OURS = {"kvfs", "metaserver", "chunkserver", "client", "engine", "cli", "bench", "integrations", "tests"}


class StallSampler:
    """Where the event loop's thread is while the loop is held. A thread of its own
    wakes every `every` seconds and, once the watcher (watch_event_loop, which
    keeps `stats.last_tick`) has not woken for `after` seconds, takes the loop
    thread's Python stack (sys._current_frames) and notes the innermost frames of
    ours in it. When the stall ends, its samples are kept if it lasted over
    `keep_over` (the stalls worth a log line) and dropped otherwise, so that a
    stall's log line says where the loop was, not only how long. It needs the GIL
    to look: a stall inside one long C call is seen at the Python frame that made
    it, once the call lets go. Each sample also notes the thread's state as the
    kernel sees it (/proc): "[R]" running or runnable, "[D: fn]" or "[S: fn]" waiting in
    the kernel function `fn` (its wchan: the disk, a page fault, a lock), so that a
    stall in a C call that let go of the GIL says what the call waited for. A sample of
    the thread asleep in the loop's own poll (epoll) is dropped: nothing of the
    thread's held the loop then (seen: one such sample as a stall ended, under load).
    Start it on the loop's thread."""

    FRAMES = 3  # of our code, innermost first, per site

    def __init__(self, stats: LoopStats, after: float = STALL_BOUNDS[0], every: float = 0.01,
                 keep_over: float = STALL_BOUNDS[1]):
        self.stats, self.after, self.every, self.keep_over = stats, after, every, keep_over
        self.loop_thread = threading.get_ident()
        self._proc = f"/proc/self/task/{threading.get_native_id()}/"
        self._sites: collections.Counter[str] = collections.Counter()
        self._held_since: float | None = None  # stats.last_tick of the stall being sampled
        self._held: list[str] = []  # its samples
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-sampler", daemon=True)

    def start(self) -> StallSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            last = self.stats.last_tick
            if last is None:
                continue
            with self._lock:
                self._settle(last)
                if time.monotonic() - last - self.stats.tick < self.after:
                    continue
            state = self.kernel_state()
            if "epoll" in state:  # in the loop's poll: not held by the thread (the stall is over, or it waits a wakeup)
                continue
            frame = sys._current_frames().get(self.loop_thread)
            if frame is not None:
                site = self.site(frame) + state
                with self._lock:  # kept only if the loop is still held: reading /proc let go of the GIL
                    if self._held_since in (None, last) and self.stats.last_tick == last:
                        self._held_since = last
                        self._held.append(site)

    def _settle(self, last: float) -> None:
        """Once the watcher has woken since the stall being sampled (`last` moved),
        keeps its samples if it lasted over keep_over. Under the lock."""
        if self._held_since is None or last == self._held_since:
            return
        if last - self._held_since - self.stats.tick > self.keep_over:
            self._sites.update(self._held)
        self._held_since, self._held = None, []

    def kernel_state(self) -> str:
        """The loop thread's state now, as a suffix to its site: " [R]", " [D: fn]"
        (waiting in the kernel function fn), "" where /proc does not say."""
        try:
            with open(self._proc + "stat", "rb") as fh:
                state = fh.read().rpartition(b")")[2].split()[0].decode()
            if state == "R":
                return " [R]"
            with open(self._proc + "wchan", "rb") as fh:
                wchan = fh.read().decode(errors="replace").strip()
        except (OSError, IndexError):
            return ""
        return f" [{state}: {wchan}]" if wchan and wchan != "0" else f" [{state}]"

    @classmethod
    def site(cls, frame) -> str:
        """The innermost FRAMES frames of our code on a stack, innermost first."""
        ours = []
        while frame is not None and len(ours) < cls.FRAMES:
            path = frame.f_code.co_filename
            rel = os.path.relpath(path, _SOURCE_ROOT) if path.startswith(_SOURCE_ROOT + os.sep) else ""
            if rel.split(os.sep, 1)[0] in _OURS:
                ours.append(f"{rel}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        return " < ".join(ours) or "outside kvfs (the event loop or a library)"

    def take(self, n: int = 3) -> list[tuple[str, int]]:
        """The `n` sites seen most in the stalls kept since the last take (the one
        that just ended included), with their samples; forgets them."""
        with self._lock:
            if self.stats.last_tick is not None:
                self._settle(self.stats.last_tick)
            top, self._sites = self._sites.most_common(n), collections.Counter()
        return top


def schedstat_times(raw: bytes | str) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable waiting for one) from a schedstat file's
    text (/proc/.../schedstat: both in ns, then the count of timeslices)."""
    on_cpu, waiting = raw.split()[:2]
    return int(on_cpu) / 1e9, int(waiting) / 1e9


class RunQueueWait:
    """How long the thread that made it has spent runnable but waiting for a core,
    from Linux's /proc/thread-self/schedstat (its second field, in ns). None where
    the kernel keeps no schedstat; then stalls are not told apart by it."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float | None:
        if self._fd is None:
            return None
        try:
            return schedstat_times(os.pread(self._fd, 128, 0))[1]
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def thread_kernel_time() -> float:
    """Seconds the calling thread has spent on a CPU in the kernel (system time:
    page faults, reclaim, syscalls' own work), as Linux accounts it."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_stime


class GcTime:
    """Seconds the garbage collector has run on one thread (a gc.callbacks entry):
    a collection runs on whichever thread allocated when a generation filled, and a
    full one walks every tracked object not frozen (freeze_startup_heap)."""

    def __init__(self, thread: int):
        self.thread = thread  # threading.get_ident() of the thread counted
        self.seconds = 0.0
        self._began: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self.thread:
            return
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None


async def watch_event_loop(log: logging.Logger, stats: LoopStats | None = None, threshold: float = 0.1,
                           tick: float = 0.01, sampler: StallSampler | None = None) -> None:
    """Logs a warning when the event loop could not run a `tick`-second timer for
    over `threshold` seconds: every RPC waited that long. The line says how much of
    that time the loop's thread was on the CPU (and of that, in the kernel: page
    faults and reclaim show here, not in our code), how much of it the garbage
    collector ran on it, how much it waited for a core
    (runnable, the cores taken by other threads or processes), and how much the
    whole process was on the CPU: the thread most of it, our own code held the
    loop; waiting most of it, the machine's cores were oversubscribed; the process
    but not the thread, another thread held the GIL; none of them, the thread was
    blocked (the disk, a lock) or the process stopped. At most one line every
    STALL_REPORT_EVERY seconds. Every stall longer than STALL_BOUNDS[0] is counted
    in `stats`. With a `sampler` (on `stats`), the line also says where the loop's
    thread was seen while held: the sites sampled most, with their samples."""
    worst, count, reported = 0.0, 0, time.monotonic()
    if stats is not None:
        stats.tick, stats.last_tick = tick, reported
    collecting = GcTime(threading.get_ident())
    gc.callbacks.append(collecting)
    run_queue = RunQueueWait()  # opened on the loop's thread: it reads that thread's
    if run_queue() is None:
        log.info("no /proc/thread-self/schedstat: event-loop stalls are not told apart by time waiting for a core")
    try:
        while True:
            t0, thread0, process0, wait0 = time.monotonic(), time.thread_time(), time.process_time(), run_queue()
            kernel0, gc0 = thread_kernel_time(), collecting.seconds
            await asyncio.sleep(tick)
            now = time.monotonic()
            held = now - t0 - tick
            wait1 = run_queue()
            waited = wait1 - wait0 if wait0 is not None and wait1 is not None else 0.0
            if stats is not None:
                stats.woke(now, held, time.thread_time() - thread0, waited)
            if held > threshold:
                count += 1
                if held > worst:
                    worst, thread, process, worst_wait = (held, time.thread_time() - thread0,
                                                          time.process_time() - process0, waited)
                    kernel, collected = thread_kernel_time() - kernel0, collecting.seconds - gc0
            if count and now - reported >= STALL_REPORT_EVERY:
                sites = sampler.take() if sampler is not None else []
                where = "; held at " + ", ".join(f"{site} ({n} samples)" for site, n in sites) if sites else ""
                log.warning("event loop held up to %.0f ms (meanwhile: %.0f ms this thread on the CPU, %.0f ms of "
                            "it in the kernel, %.0f ms collecting garbage, %.0f ms waiting for a core, %.0f ms the "
                            "process on the CPU); %d times over %.0f ms in the last %.0f s%s", 1e3 * worst,
                            1e3 * thread, 1e3 * kernel, 1e3 * collected, 1e3 * worst_wait, 1e3 * process, count,
                            1e3 * threshold, now - reported, where)
                worst, count, reported = 0.0, 0, now
    finally:
        gc.callbacks.remove(collecting)
        run_queue.close()


def flag_parser(prog: str, description: str, cfg_cls: type) -> argparse.ArgumentParser:
    """A server's command line: --config and a flag per setting of `cfg_cls` (the
    deploy/ manifests' flags are checked against it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser, cfg_cls)
    return parser


def run_server(prog: str, description: str, cfg_cls: type, section: str, serve, argv: list[str] | None) -> int:
    """Parses flags into `cfg_cls` (flags > env > TOML > defaults), sets up
    logging and runs `serve(cfg)` until it returns."""
    parser = flag_parser(prog, description, cfg_cls)
    args = parser.parse_args(argv)
    try:
        cfg = load(cfg_cls, section, vars(args))
    except (ValueError, OSError) as err:
        parser.error(str(err))
    setup_logging(cfg.log_level, cfg.log_format)
    asyncio.run(serve(cfg))
    return 0
