"""The grpo-rs Python reward worker (embedded in grpo-rewards, run as `python -c <this file>`).

It imports reward functions once and calls them with TRL's signature. The protocol is one JSON
object per line: requests on stdin, one answer per request on stdout, in order; the worker's
first line says it is ready. User code's `print` (sys.stdout, even file descriptor 1) goes to
stderr, and stdin is /dev/null for it, so nothing it does can reach the protocol.

    ready:   {"ready": true, "pid": 123, "python": "3.11.7"}
    load:    {"op": "load", "path": "/abs/rewards.py", "file": true, "function": "accuracy"}
             -> {"ok": true}
             |  {"ok": false, "field": "path" | "function", "error": "..."}
    call:    {"op": "call", "path": ..., "file": ..., "function": ...,
              "prompts": [...], "completions": [...], "completion_ids": [[...], ...],
              "kwargs": {"answer": [...], ...}, "global_step": 3}
             -> {"ok": true, "scores": [0.5, null, ...]}
             |  {"ok": false, "error": "raised ValueError: ... at /abs/rewards.py:12"}

Errors are one line; the full traceback goes to stderr.
"""

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import signal
import sys
import traceback
import types


class LoadError(Exception):
    """A module or function that cannot be loaded; `field` is the config key to fix."""

    def __init__(self, field, message):
        super().__init__(message)
        self.field = field


def one_line(text, limit=400):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def traceback_of(what):
    """The current exception's full traceback, on stderr."""
    sys.stderr.write("grpo-rs python reward worker: %s failed:\n" % what)
    traceback.print_exc()
    sys.stderr.flush()


def where(exc, files):
    """`file:line` of the innermost traceback frame in one of `files` (else the innermost
    frame outside this worker), or None."""
    frames = traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        if os.path.abspath(f.filename) in files:
            return "%s:%d" % (f.filename, f.lineno)
    for f in reversed(frames):
        if f.filename != "<string>":
            return "%s:%d" % (f.filename, f.lineno)
    return None


def describe(exc, files):
    """`ValueError: message at file:line`."""
    name = type(exc).__name__
    message = one_line(exc.msg if isinstance(exc, SyntaxError) and exc.msg else exc)
    text = "%s: %s" % (name, message) if message else name
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return "%s at %s:%d" % (text, exc.filename, exc.lineno)
    at = where(exc, files)
    return "%s at %s" % (text, at) if at else text


class Worker:
    def __init__(self):
        self.modules = {}  # path or module name -> module
        self.functions = {}  # (path, function) -> (callable, user files)
        self.loop = None

    def module(self, path, is_file):
        if path in self.modules:
            return self.modules[path]
        if is_file:
            name = "_grpo_reward_%d" % len(self.modules)
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise LoadError("path", "%s is not a Python file Python can import" % path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            # As `python rewards.py` would: its folder is importable (helper modules).
            folder = os.path.dirname(path)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            try:
                spec.loader.exec_module(module)
            except BaseException as e:  # noqa: B036 (SystemExit at import is an error too)
                del sys.modules[name]
                traceback_of("importing " + path)
                raise LoadError("path", "importing %s raised %s" % (path, describe(e, {path})))
        else:
            try:
                module = importlib.import_module(path)
            except ModuleNotFoundError as e:
                if e.name == path or (e.name and path.startswith(e.name + ".")):
                    raise LoadError(
                        "path",
                        "no module named `%s` on the Python path (the working directory and "
                        "PYTHONPATH); give a file path ending in .py, or set PYTHONPATH" % path,
                    )
                traceback_of("importing " + path)
                raise LoadError("path", "importing %s raised %s" % (path, describe(e, set())))
            except BaseException as e:  # noqa: B036
                traceback_of("importing " + path)
                raise LoadError("path", "importing %s raised %s" % (path, describe(e, set())))
        self.modules[path] = module
        return module

    def function(self, req):
        key = (req["path"], req["function"])
        if key in self.functions:
            return self.functions[key]
        module = self.module(req["path"], req["file"])
        name = req["function"]
        f = getattr(module, name, None)
        if f is None:
            defined = sorted(
                k
                for k, v in vars(module).items()
                if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
            )
            hint = "; it defines: %s" % ", ".join(defined) if defined else ""
            raise LoadError("function", "%s has no function `%s`%s" % (req["path"], name, hint))
        if not callable(f):
            raise LoadError(
                "function", "`%s` in %s is a %s, not a function" % (name, req["path"], type(f).__name__)
            )
        files = set()
        for source in (getattr(module, "__file__", None), getattr(inspect.unwrap(f), "__code__", None)):
            if isinstance(source, types.CodeType):
                source = source.co_filename
            if source:
                files.add(os.path.abspath(source))
        self.functions[key] = (f, files)
        return self.functions[key]

    def call(self, req):
        f, files = self.function(req)
        state = types.SimpleNamespace(global_step=req["global_step"])
        kwargs = req["kwargs"]
        n = len(req["completions"])
        try:
            out = f(
                prompts=req["prompts"],
                completions=req["completions"],
                completion_ids=req["completion_ids"],
                trainer_state=state,
                **kwargs,
            )
            if inspect.isawaitable(out):
                if self.loop is None:
                    self.loop = asyncio.new_event_loop()
                out = self.loop.run_until_complete(_awaited(out))
        except (Exception, SystemExit) as e:
            traceback_of("`%s` in %s" % (req["function"], req["path"]))
            text = "raised " + describe(e, files)
            if isinstance(e, TypeError) and where(e, files) is None:
                text += (
                    " (reward functions are called as f(prompts=..., completions=..., "
                    "completion_ids=..., trainer_state=..., **columns): add **kwargs)"
                )
            return {"ok": False, "error": text}
        return scores(out, n)

    def handle(self, req):
        op = req.get("op")
        try:
            if op == "load":
                self.function(req)
                return {"ok": True}
            if op == "call":
                return self.call(req)
            return {"ok": False, "error": "unknown request %r" % (op,)}
        except LoadError as e:
            return {"ok": False, "field": e.field, "error": one_line(e, 1000)}


async def _awaited(x):
    return await x


def scores(out, n):
    """The function's return value as one float (or None) per completion."""
    if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        return {
            "ok": False,
            "error": "returned a %s; expected a list of %d floats (or None)" % (type(out).__name__, n),
        }
    if hasattr(out, "tolist"):  # numpy arrays, tensors
        out = out.tolist()
    out = list(out)
    if len(out) != n:
        return {"ok": False, "error": "returned %d scores for %d completions" % (len(out), n)}
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        if isinstance(v, (str, bytes)) or not (
            isinstance(v, numbers.Real) or hasattr(type(v), "__float__")
        ):
            return {
                "ok": False,
                "error": "returned a %s at sample %d (%s); expected a float or None"
                % (type(v).__name__, i, one_line(repr(v), 60)),
            }
        try:
            x = float(v)
        except Exception as e:  # a tensor of several values, say
            return {
                "ok": False,
                "error": "returned a %s at sample %d that is not a number (%s)"
                % (type(v).__name__, i, one_line(e, 120)),
            }
        if math.isnan(x):
            values.append(None)
        elif math.isinf(x):
            return {"ok": False, "error": "returned %s at sample %d; scores must be finite" % (x, i)}
        else:
            values.append(x)
    return {"ok": True, "scores": values}


def main():
    # The protocol keeps private copies of the original stdin and stdout; user code gets
    # stderr as its stdout (file descriptor 1 too, for C libraries and subprocesses) and
    # /dev/null as its stdin.
    # Ctrl-C reaches the whole process group: the trainer stops gracefully, and may still
    # score; the worker ends when its stdin closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)
    sys.stdout = sys.stderr

    def send(obj):
        answers.write(json.dumps(obj).encode("utf-8") + b"\n")
        answers.flush()

    worker = Worker()
    send({"ready": True, "pid": os.getpid(), "python": sys.version.split()[0]})
    for line in requests:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            send({"ok": False, "error": "unreadable request: %s" % one_line(e)})
            continue
        send(worker.handle(req))


if __name__ == "__main__":
    main()
