"""The grpo-rs Python reward worker (embedded in grpo-rewards, run as `python -c <this file>`).

It imports reward functions once and calls them with TRL's signature. The protocol is one JSON
object per line: requests on stdin, one answer per request on stdout, in order; the worker's
first line says it is ready. User code's `print` (sys.stdout, even file descriptor 1) goes to
stderr, and stdin is /dev/null for it, so nothing it does can reach the protocol.

    ready:   {"ready": true, "pid": 123, "python": "3.11.7"}
    load:    {"op": "load", "path": "/abs/rewards.py", "file": true, "function": "accuracy"}
             (with "init": {...}, `function(**init)` is the reward: a factory such as TRL's
             get_cosine_scaled_reward; calls carry the same "init")
             -> {"ok": true}
             |  {"ok": false, "field": "path" | "function", "error": "..."}
    call:    {"op": "call", "path": ..., "file": ..., "function": ...,
              "prompts": [...], "completions": [...], "completion_ids": [[...], ...],
              "kwargs": {"answer": [...], ...}, "global_step": 3,
              "environment_ids": ["3", null, ...]}       (optional: TRL's `environments`)
             -> {"ok": true, "scores": [0.5, null, ...]}
             |  {"ok": false, "error": "raised ValueError: ... at /abs/rewards.py:12"}

Tools and environments (grpo-rollout's `tools` and `python_env`) use the same worker:

    load:    {"op": "load", ..., "kind": "tool"}   -> {"ok": true, "result": <JSON schema>}
             {"op": "load", ..., "kind": "environment", "init": {...}}
                                                    -> {"ok": true, "result": null}
                 (the class is instantiated once, `cls(**init)`, and kept)
    tool:    {"op": "tool", ..., "arguments": {...}} -> {"ok": true, "result": "text"}
    step:    {"op": "env_step", ..., "message_logs": [[...]], "metadata": [...]}
             -> {"ok": true, "result": {"observations": [...], "metadata": [...],
                 "next_stop_strings": [...], "rewards": [...], "terminateds": [...]}}
    post:    {"op": "env_post", ..., "episodes": [...]}
             -> {"ok": true, "result": {"metrics": {...}, "rewards": [[...]] | null}}

TRL's `environment_factory` classes (grpo-rollout's `python_env::PythonFactoryEnvironment`):

    load:    {"op": "load", ..., "kind": "factory", "init": {...}}
             -> {"ok": true, "result": {"tools": [<JSON schema>, ...], "reward": true|false}}
                 (one instance is made to read the tools: its public methods but `reset` and
                 `get_reward`; instances are made as needed, `cls(**init)`, and reused)
    reset:   {"op": "factory_reset", ..., "rows": [{...}, ...]}   (one row per episode)
             -> {"ok": true, "result": {"ids": ["3", ...], "observations": ["text" | null, ...]}}
    call:    {"op": "factory_call", ..., "calls": [["3", "name", {...}], ...]}
             -> {"ok": true, "result": [[true, "text"] | [false, "error"], ...]}
    reward:  {"op": "factory_reward", ..., "ids": [...]} -> {"ok": true, "result": [0.5 | null, ...]}
    release: {"op": "factory_release", ..., "ids": [...]} -> {"ok": true, "result": null}

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


class VerlInputError(Exception):
    """A batch or an answer that verl's convention cannot take (the message is the error)."""


def as_object(v):
    """A struct column's value: the dict its JSON text holds (the data loader passes nested
    columns as JSON), else the value itself."""
    if isinstance(v, str) and v[:1] in "{[":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


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
        key = (req["path"], req["function"], req.get("kind", "reward"), json.dumps(req.get("init")))
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
        kind = req.get("kind")
        if kind in ("environment", "factory"):
            # A class: NeMo RL's `step`, or TRL's environment_factory interface.
            method, signature = {
                "environment": ("step", "`step(self, message_logs, metadata)` method"),
                "factory": ("reset", "`reset(self, **kwargs)` method (TRL's environment_factory interface)"),
            }[kind]
            if not isinstance(f, type):
                raise LoadError(
                    "function", "`%s` in %s is a %s, not a class" % (name, req["path"], type(f).__name__)
                )
            if not callable(getattr(f, method, None)):
                raise LoadError("function", "class `%s` in %s has no %s" % (name, req["path"], signature))
            init = req.get("init") or {}
            try:
                instance = f(**init)
            except Exception as e:
                traceback_of("creating `%s` from %s" % (name, req["path"]))
                raise LoadError("function", "`%s(**init)` raised %s" % (name, describe(e, files)))
            if kind == "factory":
                # As TRL: the class's public functions but reset and get_reward are the tools.
                methods = [
                    m
                    for m, _ in inspect.getmembers(f, predicate=inspect.isfunction)
                    if m not in ("reset", "get_reward") and not m.startswith("_")
                ]
                f = Factory(f, init, methods, callable(getattr(f, "get_reward", None)))
                f.pool.append(instance)
            else:
                f = instance
        elif req.get("init") is not None:
            # A reward factory (TRL's get_cosine_scaled_reward(max_len=...)): made once.
            try:
                made = f(**req["init"])
            except Exception as e:
                traceback_of("calling `%s(**init)` from %s" % (name, req["path"]))
                raise LoadError("init", "`%s(**init)` raised %s" % (name, describe(e, files)))
            if not callable(made):
                raise LoadError(
                    "init",
                    "`%s(**init)` returned a %s, not a reward function" % (name, type(made).__name__),
                )
            f = made
        self.functions[key] = (f, files)
        return self.functions[key]

    def run(self, req, what, call):
        """`call()`, awaited if it returns an awaitable; exceptions as one-line answers."""
        f, files = self.function(req)
        try:
            return self.awaited(call(f)), None
        except (Exception, SystemExit) as e:
            traceback_of("`%s` in %s (%s)" % (req["function"], req["path"], what))
            return None, {"ok": False, "error": "raised " + describe(e, files)}

    def tool(self, req):
        out, fail = self.run(req, "tool", lambda f: f(**(req.get("arguments") or {})))
        if fail:
            return fail
        return {"ok": True, "result": tool_text(out)}

    def env_step(self, req):
        logs = req["message_logs"]
        out, fail = self.run(req, "step", lambda env: env.step(logs, req["metadata"]))
        if fail:
            return fail
        try:
            return {"ok": True, "result": environment_return(out, len(logs), req["metadata"])}
        except ValueError as e:
            return {"ok": False, "error": "step returned %s" % one_line(e)}

    def env_post(self, req):
        episodes = req["episodes"]
        f, _ = self.function(req)
        hook = getattr(f, "global_post_process_and_metrics", None)
        if not callable(hook):
            return {"ok": True, "result": {"metrics": {}, "rewards": None}}
        out, fail = self.run(req, "global_post_process_and_metrics", lambda env: hook(episodes))
        if fail:
            return fail
        # NeMo RL returns (batch, metrics); a dict alone is the metrics.
        batch, metrics = (out if isinstance(out, tuple) and len(out) == 2 else (None, out))
        if metrics is None:
            metrics = {}
        if not isinstance(metrics, dict):
            return {"ok": False, "error": "global_post_process_and_metrics returned metrics of type %s; expected a dict" % type(metrics).__name__}
        clean = {}
        for k, v in metrics.items():
            v = as_list(v)
            try:
                clean[str(k)] = float(v[0] if isinstance(v, list) and len(v) == 1 else v)
            except (TypeError, ValueError):
                return {"ok": False, "error": "global_post_process_and_metrics: metric %r is not a number" % (k,)}
        rewards = None
        if isinstance(batch, list) and len(batch) == len(episodes):
            rewards = []
            for b in batch:
                r = b.get("rewards") if isinstance(b, dict) else None
                rewards.append([float(x) for x in as_list(r)] if r is not None else None)
        return {"ok": True, "result": {"metrics": clean, "rewards": rewards}}

    def call(self, req):
        f, files = self.function(req)
        state = types.SimpleNamespace(global_step=req["global_step"])
        kwargs = dict(req["kwargs"])
        n = len(req["completions"])
        if req.get("environment_ids") is not None:
            # TRL's `environments`: each completion's environment_factory instance (a stand-in
            # that says where it is when the instance lives in another interpreter's worker).
            kwargs["environments"] = [
                Factory.find(i) or (Elsewhere(i) if i is not None else None)
                for i in req["environment_ids"]
            ]
        # TRL's `log_extra(column, values)` (columns of the completions log) and
        # `log_metric(name, value)` (a metric, averaged over the step's calls).
        extra, metrics = {}, {}

        def log_extra(column, values):
            extra.setdefault(str(column), []).extend(as_list(values))

        def log_metric(name, value):
            metrics.setdefault(str(name), []).append(float(value))

        kwargs["log_extra"] = log_extra
        kwargs["log_metric"] = log_metric
        verl = req.get("signature") == "verl"
        try:
            if verl:
                out = self.verl_call(f, req, kwargs, log_extra)
            else:
                out = self.awaited(
                    f(
                        prompts=req["prompts"],
                        completions=req["completions"],
                        completion_ids=req["completion_ids"],
                        trainer_state=state,
                        **kwargs,
                    )
                )
        except VerlInputError as e:
            return {"ok": False, "error": str(e)}
        except (Exception, SystemExit) as e:
            traceback_of("`%s` in %s" % (req["function"], req["path"]))
            text = "raised " + describe(e, files)
            if verl and isinstance(e, TypeError) and where(e, files) is None:
                text += (
                    " (signature = \"verl\" calls f(data_source=..., solution_str=..., "
                    "ground_truth=..., extra_info=...) once per completion)"
                )
            elif isinstance(e, TypeError) and where(e, files) is None:
                text += (
                    " (reward functions are called as f(prompts=..., completions=..., "
                    "completion_ids=..., trainer_state=..., **columns): add **kwargs)"
                )
            return {"ok": False, "error": text}
        answer = scores(out, n)
        if answer["ok"]:
            answer["extra"] = {k: [jsonable(v) for v in vs[:n]] for k, vs in extra.items()}
            answer["metrics"] = {k: sum(vs) / len(vs) for k, vs in metrics.items()}
        return answer

    def verl_call(self, f, req, kwargs, log_extra):
        """verl's reward-function convention (its reward managers' `compute_score`): one call per
        completion, f(data_source=row["data_source"], solution_str=the completion's text,
        ground_truth=row["reward_model"]["ground_truth"], extra_info=row["extra_info"]); a dict
        answer gives its "score" and logs every key as a column."""
        n = len(req["completions"])
        rm = kwargs.get("reward_model")
        gts = kwargs.get("ground_truth")
        sources = kwargs.get("data_source")
        infos = kwargs.get("extra_info")
        out, columns = [], {}
        for i in range(n):
            c = req["completions"][i]
            if isinstance(c, str):
                text = c
            else:  # conversational: the completion's messages' text, in order
                text = "\n".join(str(m.get("content") or "") for m in c if isinstance(m, dict))
            gt = None
            row_rm = as_object(rm[i]) if rm is not None else None
            if isinstance(row_rm, dict):
                gt = row_rm.get("ground_truth")
            elif gts is not None:
                gt = gts[i]
            if gt is None:
                raise VerlInputError(
                    "signature = \"verl\" passes the row's reward_model.ground_truth as ground_truth: "
                    "completion %d's row has no `reward_model` column with a `ground_truth` (nor a "
                    "`ground_truth` column)" % i
                )
            info = as_object(infos[i]) if infos is not None else None
            info = info if isinstance(info, dict) else {}
            r = self.awaited(
                f(
                    data_source=sources[i] if sources is not None else None,
                    solution_str=text,
                    ground_truth=gt,
                    extra_info=info,
                )
            )
            if isinstance(r, dict):
                if "score" not in r:
                    raise VerlInputError(
                        "returned a dict without \"score\" at sample %d (keys: %s); verl reads "
                        "the reward from its \"score\"" % (i, ", ".join(map(str, r)))
                    )
                for k, v in r.items():
                    columns.setdefault(str(k), [None] * n)[i] = v
                r = r["score"]
            out.append(r)
        for k, column in columns.items():
            log_extra(k, column)
        return out

    def awaited(self, out):
        """`out`, run to its end on the worker's event loop when it is awaitable."""
        if inspect.isawaitable(out):
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            out = self.loop.run_until_complete(_awaited(out))
        return out

    def factory_reset(self, req):
        fac, files = self.function(req)
        ids, observations = [], []
        for row in req["rows"]:
            inst = fac.take()
            ids.append(fac.put(inst))
            try:
                out = self.awaited(inst.reset(**row))
            except (Exception, SystemExit) as e:
                traceback_of("`%s.reset` in %s" % (req["function"], req["path"]))
                for i in ids:
                    fac.release(i)
                text = "reset raised " + describe(e, files)
                if isinstance(e, TypeError) and where(e, files) is None:
                    text += " (reset is called with the row's columns as keyword arguments: add **kwargs)"
                return {"ok": False, "error": text}
            if out is not None and not isinstance(out, str):
                for i in ids:
                    fac.release(i)
                return {
                    "ok": False,
                    "error": "reset returned a %s; return a string (appended to the prompt) or None"
                    % type(out).__name__,
                }
            observations.append(out)
        return {"ok": True, "result": {"ids": ids, "observations": observations}}

    def factory_call(self, req):
        fac, files = self.function(req)
        results = []
        for id_, name, arguments in req["calls"]:
            inst = fac.instances.get(id_)
            if inst is None:
                return {"ok": False, "error": "no environment instance %s (was the worker restarted?)" % id_}
            if name not in fac.methods:
                results.append([False, "unknown tool `%s`; the tools are: %s" % (name, ", ".join(fac.methods))])
                continue
            try:
                out = self.awaited(getattr(inst, name)(**(arguments or {})))
            except (Exception, SystemExit) as e:
                traceback_of("`%s.%s` in %s" % (req["function"], name, req["path"]))
                results.append([False, "raised " + describe(e, files)])
                continue
            results.append([True, tool_text(out)])
        return {"ok": True, "result": results}

    def factory_reward(self, req):
        fac, files = self.function(req)
        rewards = []
        for id_ in req["ids"]:
            inst = fac.instances.get(id_)
            if inst is None:
                return {"ok": False, "error": "no environment instance %s (was the worker restarted?)" % id_}
            try:
                r = self.awaited(inst.get_reward())
            except (Exception, SystemExit) as e:
                traceback_of("`%s.get_reward` in %s" % (req["function"], req["path"]))
                return {"ok": False, "error": "get_reward raised " + describe(e, files)}
            if r is None:
                rewards.append(None)
                continue
            v = as_list(r)  # a one-element tensor or array is its number
            try:
                r = float(v[0] if isinstance(v, list) else v)
            except (TypeError, ValueError, IndexError):
                return {"ok": False, "error": "get_reward returned %r, not a number" % (r,)}
            rewards.append(r if math.isfinite(r) else None)
        return {"ok": True, "result": rewards}

    def factory_release(self, req):
        fac, _ = self.function(req)
        for id_ in req["ids"]:
            fac.release(id_)
        return {"ok": True, "result": None}

    def handle(self, req):
        op = req.get("op")
        try:
            if op == "load" and req.get("kind") == "tool":
                f, _ = self.function(req)
                return {"ok": True, "result": tool_schema(f, req["function"])}
            if op == "load" and req.get("kind") == "factory":
                fac, _ = self.function(req)
                probe = fac.pool[0] if fac.pool else fac.take()
                tools = [tool_schema(getattr(probe, m), m) for m in fac.methods]
                return {"ok": True, "result": {"tools": tools, "reward": fac.has_reward}}
            if op in ("factory_reset", "factory_call", "factory_reward", "factory_release"):
                return getattr(self, op)(req)
            if op == "load":
                self.function(req)
                return {"ok": True}
            if op == "call":
                return self.call(req)
            if op == "tool":
                return self.tool(req)
            if op == "env_step":
                return self.env_step(req)
            if op == "env_post":
                return self.env_post(req)
            return {"ok": False, "error": "unknown request %r" % (op,)}
        except LoadError as e:
            return {"ok": False, "field": e.field, "error": one_line(e, 1000)}


async def _awaited(x):
    return await x


class Elsewhere:
    """An environment instance this worker does not hold: any use says why, in one line."""

    def __init__(self, id_):
        self._id = id_

    def __getattr__(self, name):
        raise RuntimeError(
            "environment instance %s is not in this Python worker: a reward reading "
            "`environments` must run with the environment's `python` interpreter" % self._id
        )


class Factory:
    """A TRL `environment_factory` class: its instances by episode id, and a pool of free ones
    (made once, reset often, as TRL's trainer does). Ids are unique in the worker, so a reward
    call finds an instance by id alone."""

    all = []  # every Factory of the worker
    counter = 0

    @classmethod
    def find(cls, id_):
        if id_ is None:
            return None
        for f in cls.all:
            if id_ in f.instances:
                return f.instances[id_]
        return None

    def __init__(self, cls, init, methods, has_reward):
        Factory.all.append(self)
        self.cls = cls
        self.init = init
        self.methods = methods
        self.has_reward = has_reward
        self.pool = []
        self.instances = {}

    def take(self):
        return self.pool.pop() if self.pool else self.cls(**self.init)

    def put(self, inst):
        Factory.counter += 1
        id_ = str(Factory.counter)
        self.instances[id_] = inst
        return id_

    def release(self, id_):
        inst = self.instances.pop(id_, None)
        if inst is not None:
            self.pool.append(inst)


def as_list(v):
    """Tensors and arrays as lists; other values as they are."""
    return v.tolist() if hasattr(v, "tolist") else v


def field(out, name):
    if isinstance(out, dict):
        return out.get(name)
    return getattr(out, name, None)


def environment_return(out, n, metadata):
    """A `step` result (NeMo RL's EnvironmentReturn named tuple, an object with its fields, or
    a dict) as JSON: one entry per episode in every list."""
    if out is None:
        raise ValueError("None; expected an EnvironmentReturn (observations, metadata, "
                         "next_stop_strings, rewards, terminateds)")
    result = {}
    for name in ("observations", "metadata", "next_stop_strings", "rewards", "terminateds"):
        v = as_list(field(out, name))
        if v is None:
            if name in ("observations", "rewards", "terminateds"):
                raise ValueError("no `%s`" % name)
            v = list(metadata) if name == "metadata" else [None] * n
        v = list(v)
        if len(v) != n:
            raise ValueError("%d %s for %d episodes" % (len(v), name, n))
        result[name] = v
    obs = []
    for i, o in enumerate(result["observations"]):
        if o is None or (isinstance(o, dict) and o.get("content") is None):
            obs.append(None)
        elif isinstance(o, str):
            obs.append({"role": "environment", "content": o})
        elif isinstance(o, dict):
            obs.append({"role": str(o.get("role", "environment")), "content": str(o["content"])})
        else:
            raise ValueError("an observation of type %s for episode %d; expected a dict "
                             "{\"role\", \"content\"}, a string or None" % (type(o).__name__, i))
    result["observations"] = obs
    try:
        result["rewards"] = [float(r) for r in result["rewards"]]
    except (TypeError, ValueError):
        raise ValueError("rewards that are not numbers: %s" % one_line(repr(result["rewards"]), 80))
    result["terminateds"] = [bool(t) for t in result["terminateds"]]
    result["next_stop_strings"] = [None if s is None else [str(x) for x in s]
                                   for s in result["next_stop_strings"]]
    return result


JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
              list: "array", dict: "object"}


def tool_schema(f, name):
    """The tool's JSON schema, as transformers' `get_json_schema` makes it (used when
    transformers is installed): name, the docstring's first paragraph as description,
    parameters from the signature's type hints and the docstring's `Args:` section."""
    try:
        from transformers.utils import get_json_schema

        return get_json_schema(f)
    except Exception:
        pass
    import typing

    doc = inspect.getdoc(f) or ""
    parts = doc.split("\n\n")
    description = " ".join(parts[0].split()) if parts and not parts[0].lstrip().startswith("Args:") else ""
    arg_docs = {}
    in_args = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            if not stripped or (not line.startswith(" ") and stripped.endswith(":")):
                if stripped.endswith(":"):
                    in_args = False
                continue
            head, sep, text = stripped.partition(":")
            if sep:
                arg_docs[head.split("(")[0].strip()] = text.strip()
    try:
        hints = typing.get_type_hints(f)
    except Exception:
        hints = {}
    props, required = {}, []
    for p in inspect.signature(f).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        t = hints.get(p.name)
        origin = getattr(t, "__origin__", None) or t
        prop = {"type": JSON_TYPES.get(origin, "string")}
        if p.name in arg_docs:
            prop["description"] = arg_docs[p.name]
        props[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": props}
    if required:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": parameters}}


def tool_text(out):
    """A tool's return as the text the model sees: a string as it is, else its JSON (or str)."""
    if isinstance(out, str):
        return out
    try:
        return json.dumps(out, default=str)
    except Exception:
        return str(out)


def jsonable(v):
    """`v` if JSON can hold it, else its text (a logged column's value)."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    try:
        json.dumps(v, allow_nan=False)
        return v
    except (TypeError, ValueError):
        return str(v)


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
