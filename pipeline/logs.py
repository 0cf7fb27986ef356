"""Console versus log file: what an operator sees during `harvest run`.

Left alone, a default run prints ~135 lines, 116 of them vLLM's, Ray's and torch's, among them
a 15-line "Chat template warmup failed" traceback per actor that looks like an error and is not,
while the minute of engine start shows nothing but "waiting for 2 of 2 actors". Quiet mode
(the default; `--verbose` turns it off) sends all of that to files in one folder per run,
`<cache>/logs/<name>-<time>/` (driver.log, actor-<i>.log), and keeps the console for harvest's
own lines, the engines' start phases read from those files, progress, and real errors.

How: the CLI's `quiet_run` points file descriptors 1 and 2 at driver.log for the length of the
run, so third-party output of any kind (Python logging, print, C++ warnings, Ray's own handlers
bound to the old stderr) lands there, and gives harvest's logger a dup of the terminal. The
folder travels to the actors as `HARVEST_LOG_DIR` (forwarded like the other variables); each
actor points its own descriptors at actor-<i>.log before loading the engine (`redirect_actor`)
and marks its phases there (`mark_phase`), which `StartWatch` in the driver turns into console
lines. Ray is started with `log_to_driver=False` then, so worker output is not copied back.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("harvest.pipeline")

LOG_DIR_ENV = "HARVEST_LOG_DIR"
PHASE_MARK = "harvest-phase:"
CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# (text in an actor's log, phase shown). Order is progress: an actor's phase is the last one seen.
# vLLM 0.32's CPU and GPU runners both log the first three; the marks are the actor's own.
PHASES = (
    (f"{PHASE_MARK} engine", "importing the engine (vLLM, torch)"),
    ("Starting to load model", "loading weights"),
    ("Warming up model for the compilation", "compiling (later starts reuse the compile cache)"),
    ("Warming up done", "sizing the KV cache"),
    ("init engine", "engine up"),
    (f"{PHASE_MARK} model check", "checking the model against Hugging Face fp32"),
    (f"{PHASE_MARK} ready", "ready"),
)


# Log folders and files are private to the user running harvest (0700, 0600): they hold
# vLLM's, Ray's and datasets' own output, which no redaction reaches (a library may print a URL
# it was given), and the host may be shared.
LOG_DIR_MODE = 0o700
LOG_FILE_MODE = 0o600


def new_log_dir(cache: Path, name: str) -> Path:
    """A fresh folder `<cache>/logs/<name>-<time>/`, mode 0700 (`<cache>/logs` too when this
    creates it)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(cache) / "logs"
    if not root.is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=LOG_DIR_MODE, exist_ok=True)
    d = root / f"{name}-{stamp}"
    n = 1
    while True:
        try:
            d.mkdir(mode=LOG_DIR_MODE)   # never an existing folder: two runs in one second
            break
        except FileExistsError:
            n += 1
            d = root / f"{name}-{stamp}-{n}"
    os.chmod(d, LOG_DIR_MODE)  # the umask cannot widen it, but may narrow it below 0700
    return d


def open_log(path: Path) -> int:
    """A log file opened for appending, mode 0600 whoever created it, never through a
    symlink (a link planted at the name is refused: OSError)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, LOG_FILE_MODE)
    try:
        os.fchmod(fd, LOG_FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


class Redact(logging.Filter):
    """Masks URL credentials (userinfo, presigned or SAS query credentials) and the AWS
    credentials of the environment in every record a harvest handler writes, the console's and
    the log files' (store/storage/credentials.py: `scrub`), traceback text included. The store
    package is imported on the first record that could hold one (a `://`, `@` or `=`), not
    before: a command that logs nothing of the kind does not pay for zarr."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        exc = record.exc_text or (logging.Formatter().formatException(record.exc_info)
                                  if record.exc_info else None)
        if not any(c in text for text in (msg, exc or "") for c in ("://", "@", "=")):
            return True
        from ..store import scrub

        record.msg, record.args = scrub(msg), None
        if exc is not None:
            record.exc_text = scrub(exc)
        return True


class ConsoleHandler(logging.StreamHandler):
    """Log lines above a tqdm bar instead of through it, on the terminal we were started on."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.stream.flush()
        except Exception:
            self.handleError(record)


def setup_console(verbose: bool, stream=None) -> None:
    """harvest's loggers on the console: INFO (DEBUG with --verbose); `pipeline.*` warnings.
    The loggers themselves pass DEBUG, so a run's log file gets every unit's commit line."""
    h = ConsoleHandler(stream or sys.stderr)
    h.setFormatter(logging.Formatter(CONSOLE_FORMAT, "%H:%M:%S"))
    h.addFilter(_ConsoleLevels(verbose))
    h.addFilter(Redact())
    for name in ("harvest", "pipeline"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [h]
        lg.setLevel(logging.DEBUG)
        lg.propagate = False


class _ConsoleLevels(logging.Filter):
    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def filter(self, record) -> bool:
        if self.verbose:
            return True
        floor = logging.INFO if record.name.startswith("harvest") else logging.WARNING
        return record.levelno >= floor


def console_stream():
    """The stream harvest's console handler writes to (the terminal, also in quiet mode)."""
    for h in logging.getLogger("harvest").handlers:
        if isinstance(h, ConsoleHandler):
            return h.stream
    return sys.stderr


@contextmanager
def quiet_run(log_dir: Path):
    """Descriptors 1 and 2 -> log_dir/driver.log while the block runs; harvest's lines still
    reach the terminal, and also the file (DEBUG: every unit's commit line)."""
    path = Path(log_dir) / "driver.log"
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    fd = open_log(path)
    loggers = [logging.getLogger(n) for n in ("harvest", "pipeline")]
    consoles = list({id(h): h for lg in loggers for h in lg.handlers
                     if isinstance(h, ConsoleHandler)}.values())
    streams = [h.stream for h in consoles]
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    file_handler.addFilter(Redact())
    root = logging.getLogger()
    os.environ[LOG_DIR_ENV] = str(log_dir)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        for h in consoles:
            h.setStream(console)
        for lg in loggers:
            lg.addHandler(file_handler)
        # third-party loggers without handlers: the file, not logging's lastResort (stderr)
        root.addHandler(file_handler)
        yield path
    finally:
        root.removeHandler(file_handler)
        for lg in loggers:
            lg.removeHandler(file_handler)
        for h, st in zip(consoles, streams):
            h.setStream(st)
        file_handler.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for f in (saved_out, saved_err, fd):
            os.close(f)
        console.close()
        os.environ.pop(LOG_DIR_ENV, None)


@contextmanager
def json_stdout():
    """For `--json`: yields the stream the JSON goes to; anything else written to stdout while
    the block runs goes to stderr. `check-model --json` once printed 32 vLLM lines before its
    JSON (vLLM's log handler writes to stdout): descriptor 1 points at stderr meanwhile, which
    catches C++ output and child processes too, and `sys.stdout` is stderr for Python code that
    looks it up (a logger set up inside the block). Where sys.stdout is not descriptor 1 (pytest's
    capsys) the JSON goes to that object instead."""
    sys.stdout.flush()
    orig = sys.stdout
    try:
        on_fd1 = orig.fileno() == 1
    except (AttributeError, OSError, ValueError):
        on_fd1 = False
    saved = os.dup(1)
    out = os.fdopen(os.dup(saved), "w") if on_fd1 else orig
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield out
    finally:
        for f in (sys.stdout, orig, out):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        sys.stdout = orig
        os.dup2(saved, 1)
        os.close(saved)
        if out is not orig:
            out.close()


def quiet() -> bool:
    """True inside `quiet_run` (and in actors it started): Ray must not copy worker output back."""
    return bool(os.environ.get(LOG_DIR_ENV))


def redirect_actor(index: int) -> "Path | None":
    """In an actor: descriptors 1 and 2 -> $HARVEST_LOG_DIR/actor-<index>.log (appended, so a
    restarted actor continues the same file). No-op when not quiet or the folder is unusable
    (another node without that path and no right to create it)."""
    d = os.environ.get(LOG_DIR_ENV)
    if not d:
        return None
    try:
        Path(d).mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
        path = Path(d) / f"actor-{index}.log"
        fd = open_log(path)
    except OSError:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def mark_phase(name: str) -> None:
    """A line `StartWatch` reads: the actor reached `name` (see PHASES)."""
    print(f"{PHASE_MARK} {name} pid {os.getpid()} at {time.time():.3f}", flush=True)


class StartWatch:
    """Console lines while actors start: each actor's phase from its log, a line when the
    slowest actor reaches a new phase and every `every` seconds otherwise; without a log folder
    (verbose) only the periodic line, since vLLM's own lines are on the console then. A cold
    compile of a large model takes minutes: one heartbeat a minute keeps the console short."""

    def __init__(self, n_actors: int, t0: float, every: float = 60.0):
        d = os.environ.get(LOG_DIR_ENV)
        self.dir = Path(d) if d else None
        self.n, self.t0, self.every = n_actors, t0, every
        self.offsets = [0] * n_actors
        self.phase = [-1] * n_actors
        self.shown = -2
        self.last = t0

    def _read(self) -> None:
        for i in range(self.n):
            p = self.dir / f"actor-{i}.log"
            try:
                with open(p, "rb") as f:
                    f.seek(self.offsets[i])
                    text = f.read().decode("utf-8", "replace")
                    self.offsets[i] = f.tell()
            except OSError:
                continue
            for k, (needle, _) in enumerate(PHASES):
                if needle in text:
                    self.phase[i] = max(self.phase[i], k)

    def line(self, pending: int, now: float | None = None) -> str | None:
        """The line to show now, or None."""
        now = time.time() if now is None else now
        if self.dir is not None:
            self._read()
        slowest = min(self.phase)
        changed = self.dir is not None and slowest != self.shown
        if not changed and now - self.last < self.every:
            return None
        self.shown, self.last = slowest, now
        elapsed = f"{now - self.t0:.0f} s"
        if self.dir is None or max(self.phase) < 0:
            # names the cluster's resources: a start may be waiting for them
            return waiting_line(pending, self.n, self.t0)
        counts: dict[int, int] = {}
        for k in self.phase:
            counts[k] = counts.get(k, 0) + 1
        parts = [(PHASES[k][1] if k >= 0 else "starting")
                 + (f" ({c} of {self.n})" if self.n > 1 else "")
                 for k, c in sorted(counts.items())]
        return f"engines starting, {elapsed}: " + "; ".join(parts)

    def tick(self, pending: int) -> None:
        text = self.line(pending)
        if text:
            log.info(text)


def waiting_line(pending: int, total: int, t0: float) -> str:
    """The start line before any actor has logged a phase. It lives here, with the StartWatch
    that shows it, not in cluster.py: cluster.py imports this module (quiet runs) and the
    actor module (which imports this one), so this line's import of cluster.py, hidden inside
    StartWatch.line, closed the cycles logs -> cluster -> logs and logs -> cluster -> actor ->
    logs (tests/house/test_import_graph.py fails on such cycles, function-level imports included)."""
    import ray

    return (f"waiting for {pending} of {total} actors to start ({time.time() - t0:.0f} s; the "
            f"cluster has {({k: v for k, v in ray.cluster_resources().items() if k in ('CPU', 'GPU')})})")


class LineProgress:
    """tqdm's interface for a console that is not a terminal (a `ray job` log, a pipe): one line
    every `every` seconds instead of a bar redrawn into the file (15 lines per short job)."""

    def __init__(self, total: int | None, name: str, every: float = 30.0):
        self.total, self.name, self.every = total, name, every
        self.n = 0
        self.t0 = self.last = time.time()

    def update(self, k: int) -> None:
        now = time.time()
        if self.n == 0:  # the clock starts at the first commit, not during engine start
            self.t0 = self.last = now
        self.n += int(k)
        if now - self.last >= self.every:
            self.last = now
            of = f" of {self.total} ({100 * self.n / self.total:.0f}%)" if self.total else ""
            log.info("%s: %d tokens%s, %.0f tok/s", self.name, self.n, of,
                     self.n / max(now - self.t0, 1e-9))

    def close(self) -> None:
        pass


def progress_bar(enabled: bool, total: int | None, name: str):
    """A tqdm bar on a terminal, periodic lines elsewhere, nothing when `progress: false`."""
    from tqdm import tqdm

    stream = console_stream()
    if not enabled:
        return tqdm(total=total, disable=True)
    isatty = getattr(stream, "isatty", lambda: False)
    if not isatty():
        return LineProgress(total, name)
    return tqdm(total=total, unit="tok", unit_scale=True, dynamic_ncols=True, smoothing=0.1,
                file=stream, desc=name, mininterval=0.5)
