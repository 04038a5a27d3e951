#!/usr/bin/env python3
"""Renders conversations (chat, generation prompt, system + turns, tool calls and schemas,
string arguments, reasoning content; with and without `enable_thinking=False`) with chat
templates through `grpo-cli chat-template` and through jinja2 set up as transformers'
`apply_chat_template` sets it up (trim_blocks, lstrip_blocks, loop controls, a
`{% generation %}` tag, `tojson` without ASCII escapes, `raise_exception`, `strftime_now` fixed
at 2026-01-01), and compares the texts and the generation spans.

    pip install jinja2
    python3 scripts/check_chat_templates.py [--bin target/release/grpo-cli] TEMPLATE.jinja|DIR ...

Prints one line per template (ok, or where the two renderings part) and exits 1 on a mismatch.
A template that raises for a conversation (e.g. "System role not supported") must raise in both.
"""
import argparse
import datetime
import json
import pathlib
import subprocess
import sys
import tempfile

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

START, END = "\ue000", "\ue001"


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: the block's output, bracketed by markers."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_bracket"), [], [], body).set_lineno(lineno)

    def _bracket(self, caller):
        return START + caller() + END


def environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime(2026, 1, 1).strftime(fmt)
    return env


def spans_of(marked):
    """The text without markers and the byte spans the markers enclosed."""
    out, spans, start = [], [], None
    for ch in marked:
        if ch == START:
            start = len("".join(out).encode())
        elif ch == END:
            if start is not None:
                spans.append([start, len("".join(out).encode())])
                start = None
        else:
            out.append(ch)
    return "".join(out), spans


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CASES = [
    ("chat", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], None, False),
    ("prompt", [{"role": "user", "content": "What is 2 + 2?"}], None, True),
    (
        "system, two turns",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye — à bientôt"},
            {"role": "assistant", "content": "see you"},
        ],
        None,
        False,
    ),
    (
        "tools",
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny", "name": "get_weather"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        [WEATHER],
        False,
    ),
    (
        "tool prompt",
        [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris and Rome?"}],
        [WEATHER],
        True,
    ),
    (
        "two calls, string arguments",
        [
            {"role": "user", "content": "Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    CALL,
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "a"},
            {"role": "tool", "content": "rain", "tool_call_id": "b"},
            {"role": "assistant", "content": "Paris sunny, Rome rain."},
        ],
        [WEATHER],
        False,
    ),
    (
        "reasoning",
        [
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
            {"role": "user", "content": "3 + 3?"},
        ],
        None,
        True,
    ),
]
KWARGS = [None, {"enable_thinking": False}]


def ours(binary, template, messages, tools, generation_prompt, kwargs=None):
    with tempfile.TemporaryDirectory() as d:
        m = pathlib.Path(d, "m.json")
        m.write_text(json.dumps(messages))
        cmd = [binary, "chat-template", "--template", str(template), "--messages", f"@{m}", "--json",
               "--bos-token", "<s>", "--eos-token", "</s>"]
        if tools:
            t = pathlib.Path(d, "t.json")
            t.write_text(json.dumps(tools))
            cmd += ["--tools", f"@{t}"]
        if generation_prompt:
            cmd.append("--add-generation-prompt")
        if kwargs:
            cmd += ["--kwargs", json.dumps(kwargs)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            return None, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed"
        out = json.loads(p.stdout)
        return (out["text"], out["generation_spans"]), None


def theirs(env, template, messages, tools, generation_prompt, kwargs=None):
    try:
        t = env.from_string(pathlib.Path(template).read_text())
        marked = t.render(messages=messages, tools=tools, add_generation_prompt=generation_prompt,
                          bos_token="<s>", eos_token="</s>", **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 — a template error is an outcome to compare
        return None, f"{type(e).__name__}: {e}"
    return spans_of(marked), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/grpo-cli")
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args()
    files = []
    for p in map(pathlib.Path, args.paths):
        files += sorted(p.glob("*.jinja")) if p.is_dir() else [p]
    env, bad = environment(), 0
    for f in files:
        verdicts = []
        for (name, messages, tools, gp), kw in ((c, k) for c in CASES for k in KWARGS):
            name = name + (f" {kw}" if kw else "")
            (a, ea) = ours(args.bin, f, messages, tools, gp, kw)
            (b, eb) = theirs(env, f, messages, tools, gp, kw)
            if ea and eb:
                continue
            if ea or eb:
                verdicts.append(f"{name}: ours {'fails: ' + ea if ea else 'renders'}, jinja2 {'fails: ' + eb if eb else 'renders'}")
            elif a != b:
                (ta, sa), (tb, sb) = a, b
                k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                what = f"text parts at {k}: ours {ta[k:k + 40]!r}, jinja2 {tb[k:k + 40]!r}" if ta != tb else f"spans {sa} vs {sb}"
                verdicts.append(f"{name}: {what}")
        bad += bool(verdicts)
        print(f"{f.name}: " + ("ok" if not verdicts else "; ".join(verdicts)))
    print(f"{len(files) - bad} of {len(files)} templates render as jinja2 renders them")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
