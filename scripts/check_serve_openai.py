#!/usr/bin/env python3
"""Checks `grpo-cli serve` with the official `openai` Python client (not part of CI).

    grpo-cli serve --model models/tiny --port 8000 &
    python scripts/check_serve_openai.py [BASE_URL]    # default http://127.0.0.1:8000/v1

Streams chat and completions answers and checks that each choice's deltas add up to the answer
not streamed (same seed), that chat opens each choice with the assistant role, that the usage
chunk (`stream_options.include_usage`) equals the usage not streamed, that `logit_bias` bans a
token, and that an unsupported field is a 400 naming it. Prints one line per check.
"""
import sys

import openai
from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base, api_key="unused")
model = client.models.list().data[0].id
print(f"openai {openai.__version__}; {base}; model {model}")

# Chat: streamed deltas add up to the answer.
chat = dict(
    model=model,
    messages=[{"role": "user", "content": "Tell me about the sea"}],
    n=2,
    max_tokens=32,
    temperature=0.9,
    seed=7,
    logprobs=True,
    top_logprobs=2,
)
whole = client.chat.completions.create(**chat)
texts, roles, reasons, tokens, usage, ids = {}, {}, {}, {}, None, set()
for chunk in client.chat.completions.create(
    **chat, stream=True, stream_options={"include_usage": True}
):
    ids.add(chunk.id)
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.role is not None:
            roles.setdefault(c.index, c.delta.role)
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        if c.logprobs is not None and c.logprobs.content:
            tokens.setdefault(c.index, []).extend(t.token for t in c.logprobs.content)
        if c.finish_reason is not None:
            reasons[c.index] = c.finish_reason
assert len(ids) == 1, ids
for c in whole.choices:
    assert roles[c.index] == "assistant", roles
    assert texts[c.index] == c.message.content, (texts[c.index], c.message.content)
    assert reasons[c.index] == c.finish_reason
    assert tokens[c.index] == [t.token for t in c.logprobs.content]
assert usage == whole.usage, (usage, whole.usage)
print(
    f"chat: {len(whole.choices)} streamed choices add up to the answer "
    f"({[len(c.message.content) for c in whole.choices]} chars), role first, usage {usage.completion_tokens} tokens: ok"
)

# Completions: the same, with several prompts.
comp = dict(
    model=model,
    prompt=["What is 2 + 3?", "alpha beta"],
    n=2,
    max_tokens=24,
    temperature=1.0,
    seed=3,
    logprobs=1,
)
whole = client.completions.create(**comp)
texts, reasons, usage = {}, {}, None
for chunk in client.completions.create(
    **comp, stream=True, stream_options={"include_usage": True}
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            reasons[c.index] = c.finish_reason
for c in whole.choices:
    assert texts[c.index] == c.text, (texts[c.index], c.text)
    assert reasons[c.index] == c.finish_reason
assert usage == whole.usage, (usage, whole.usage)
print(f"completions: {len(whole.choices)} streamed choices add up to the answer, usage equal: ok")

# logit_bias: -100 bans the greedy first token.
greedy = dict(model=model, prompt="Hello", max_tokens=4, temperature=0)
first = client.completions.create(**greedy, extra_body={"return_token_ids": True})
t0 = first.choices[0].model_extra["token_ids"][0]
banned = client.completions.create(
    **greedy, logit_bias={str(t0): -100}, extra_body={"return_token_ids": True}
)
assert t0 not in banned.choices[0].model_extra["token_ids"]
print(f"logit_bias: token {t0} banned: ok")

# An unsupported field is refused by name.
try:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_object"},
    )
    raise AssertionError("response_format was accepted")
except openai.BadRequestError as e:
    assert e.param == "response_format", e.body
    print(f"response_format: 400 ({e.message!r}): ok")
