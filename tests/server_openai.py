"""Drives `dflash2 serve` with the official `openai` client, for tests/server.rs.

Each scenario prints one JSON object on stdout; the Rust test makes the assertions.

    server_openai.py basic BASE MODEL
    server_openai.py load BASE PLAIN_BASE MODEL REQUESTS.json CLIENTS
    server_openai.py auth BASE MODEL KEY
    server_openai.py tools BASE MODEL
    server_openai.py responses BASE MODEL
"""
import json
import re
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
from openai import OpenAI

TIMEOUT = 120.0


def client(base, key="unused"):
    return OpenAI(base_url=base + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


def collect_stream(stream):
    """Text, finish reason, usage and chunk count of a streamed chat or text completion."""
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            if delta:
                pieces.append(delta)
            if choice.finish_reason:
                finish = choice.finish_reason
    return {"text": "".join(pieces), "finish": finish, "usage": usage, "chunks": chunks}


def chat(c, model, messages, stream, **kw):
    if stream:
        s = c.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **kw
        )
        return collect_stream(s)
    r = c.chat.completions.create(model=model, messages=messages, **kw)
    d = r.model_dump()
    return {
        "text": r.choices[0].message.content,
        "finish": r.choices[0].finish_reason,
        "usage": r.usage.model_dump(),
        "timings": d.get("timings"),
        "object": r.object,
        "role": r.choices[0].message.role,
    }


def complete(c, model, prompt, stream, **kw):
    if stream:
        s = c.completions.create(
            model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        )
        return collect_stream(s)
    r = c.completions.create(model=model, prompt=prompt, **kw)
    d = r.model_dump()
    return {
        "text": r.choices[0].text,
        "finish": r.choices[0].finish_reason,
        "usage": r.usage.model_dump(),
        "timings": d.get("timings"),
        "object": r.object,
    }


def basic(base, model):
    c = client(base)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about the sea."},
    ]
    kw = {"max_tokens": 24, "temperature": 0, "seed": 1}
    out = {
        "models": [m.id for m in c.models.list().data],
        "chat": chat(c, model, messages, False, **kw),
        "chat_stream": chat(c, model, messages, True, **kw),
        "completion": complete(c, model, "The quick brown fox", False, max_tokens=32, temperature=0),
        "completion_stream": complete(c, model, "The quick brown fox", True, max_tokens=32, temperature=0),
    }
    # A stop string taken from the middle of the text: both ways must end just before it.
    stop = out["completion"]["text"][12:15]
    out["stop"] = stop
    out["stopped"] = complete(c, model, "The quick brown fox", False, max_tokens=32, temperature=0, stop=[stop])
    out["stopped_stream"] = complete(
        c, model, "The quick brown fox", True, max_tokens=32, temperature=0, stop=[stop]
    )
    # What chat clients send: fractional sampling values. The same seed must give the same text,
    # streamed or not; other seeds must give other texts (the values reached the sampler).
    sampled = {"max_tokens": 24, "temperature": 0.7, "top_p": 0.95}
    out["sampled"] = {
        "chat": [chat(c, model, messages, False, seed=s, **sampled)["text"] for s in (11, 11, 12, 13, 14)],
        "chat_stream": chat(c, model, messages, True, seed=11, **sampled)["text"],
        "completion": [
            complete(c, model, "The quick brown fox", False, seed=s, extra_body={"min_p": 1e-3}, **sampled)["text"]
            for s in (21, 21, 22, 23, 24)
        ],
        "completion_stream": complete(
            c, model, "The quick brown fox", True, seed=21, extra_body={"min_p": 1e-3}, **sampled
        )["text"],
    }
    try:
        c.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=2.5)
        out["temperature_too_high"] = None
    except openai.BadRequestError as e:
        out["temperature_too_high"] = {"status": e.status_code, "param": e.param}
    # OpenAI's penalties and logit_bias (its dict of token-id strings) reach the target law: banning
    # the greedy answer's first token changes how it starts.
    req = urllib.request.Request(
        base + "/tokenize", data=json.dumps({"content": out["chat"]["text"]}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        first = json.load(r)["tokens"][0]
    out["banned_first"] = first
    out["biased"] = chat(c, model, messages, False, logit_bias={str(first): -100}, **kw)["text"]
    out["penalised"] = chat(c, model, messages, True, presence_penalty=0.5, frequency_penalty=1.5, **kw)["text"]
    # Structured output: a JSON schema constrains the answer (OpenAI's response_format shape).
    schema = {"type": "string", "enum": ["yes", "no"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=16, response_format=fmt, temperature=0)
    out["structured"] = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason}
    try:
        c.chat.completions.create(model=model, messages=messages, max_tokens=4, response_format={"type": "xml"})
        out["bad_format"] = None
    except openai.BadRequestError as e:
        out["bad_format"] = {"status": e.status_code, "param": e.param}
    # Log-probabilities as the SDK parses them, whole and streamed.
    r = c.chat.completions.create(model=model, messages=messages, logprobs=True, top_logprobs=2, **kw)
    out["logprobs"] = [(t.token, t.logprob, len(t.top_logprobs)) for t in r.choices[0].logprobs.content]
    s = c.chat.completions.create(model=model, messages=messages, logprobs=True, top_logprobs=2, stream=True, **kw)
    out["logprobs_stream"] = [
        (t.token, t.logprob, len(t.top_logprobs))
        for chunk in s
        for choice in chunk.choices
        if choice.logprobs is not None
        for t in choice.logprobs.content or []
    ]
    # A client configured for another server names its model: one model is served, so it answers.
    r = c.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=4, temperature=0)
    out["other_model"] = {"model": r.model, "tokens": r.usage.completion_tokens}
    print(json.dumps(out))


def metric(text, name):
    m = re.search(r"^dflash2_%s (\S+)$" % name, text, re.M)
    return float(m.group(1)) if m else 0.0


def load(base, plain_base, model, requests_path, clients):
    with open(requests_path) as f:
        requests = json.load(f)
    spec_client, plain_client = client(base), client(plain_base)
    peak = {"in_flight": 0.0, "queued": 0.0}
    stop = threading.Event()

    def watch():
        # Bounded by `stop`; each poll has its own timeout.
        while not stop.wait(0.01):
            try:
                with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            for k in peak:
                peak[k] = max(peak[k], metric(text, "requests_" + k))

    def run(c, r, stream):
        kw = {"max_tokens": r["max_tokens"], "temperature": 0}
        if r["stop"]:
            kw["stop"] = r["stop"]
        try:
            if r["kind"] == "chat":
                return chat(c, model, [{"role": "user", "content": r["prompt"]}], stream, **kw)
            return complete(c, model, r["prompt"], stream, **kw)
        except Exception as e:  # reported, and failed by the Rust side
            return {"error": repr(e)}

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(clients) as pool:
            spec = list(pool.map(lambda r: run(spec_client, r, True), requests))
    finally:
        stop.set()
        watcher.join()
    # The reference: each request alone, on the server that decodes plainly.
    plain = [run(plain_client, r, False) for r in requests]
    print(json.dumps({"spec": spec, "plain": plain, "peak": peak}))


def auth(base, model, key):
    out = {}
    r = client(base, key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    out["with_key"] = r.choices[0].finish_reason
    try:
        client(base, "wrong-" + key).models.list()
        out["wrong_key"] = None
    except openai.AuthenticationError as e:
        out["wrong_key"] = {"status": e.status_code, "code": e.code}
    print(json.dumps(out))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments), c.id, c.type) for c in message.tool_calls or []]


def tools(base, model):
    """Tool calls as the SDK reads them: whole, accumulated from a stream by the SDK's own
    helper and by hand, and a conversation continued with the SDK's assistant message and a result."""
    c = client(base)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=48, temperature=0)
    out = {}
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    out["whole"] = {"content": m.content, "calls": calls_of(m), "finish": r.choices[0].finish_reason}
    with c.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    fm = final.choices[0].message
    out["sdk_stream"] = {"content": fm.content, "calls": calls_of(fm), "finish": final.choices[0].finish_reason}
    by_index, finish, text = {}, None, []
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                text.append(ch.delta.content)
            for d in ch.delta.tool_calls or []:
                entry = by_index.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    out["stream"] = {
        "content": "".join(text),
        "calls": [(e["name"], json.loads(e["arguments"])) for _, e in sorted(by_index.items())],
        "finish": finish,
    }
    follow = messages + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "18 C and sunny"}]
    r = c.chat.completions.create(model=model, messages=follow, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0)
    out["answer"] = {"content": r.choices[0].message.content, "calls": calls_of(r.choices[0].message), "finish": r.choices[0].finish_reason}
    flat = [{"type": "function", **WEATHER["function"]}]
    r = c.responses.create(model=model, input=messages[0]["content"], tools=flat, tool_choice="required", max_output_tokens=48, temperature=0)
    out["responses"] = [(o.type, o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    try:
        c.chat.completions.create(model=model, messages=messages, tools=[{"type": "function", "function": {"description": "x"}}])
        out["malformed"] = None
    except openai.BadRequestError as e:
        out["malformed"] = {"status": e.status_code, "param": e.param}
    print(json.dumps(out))


def responses(base, model):
    """The Responses API through the SDK: whole, streamed (raw events and the SDK's helper), with
    message items, and the chat completion of the same conversation to compare with."""
    c = client(base)
    kw = dict(model=model, instructions="Be brief.", max_output_tokens=16, temperature=0)
    story = "Tell me a story."
    out = {}
    r = c.responses.create(input=story, **kw)
    reason = r.incomplete_details.reason if r.incomplete_details else None
    out["whole"] = {"text": r.output_text, "status": r.status, "object": r.object, "incomplete": reason,
                    "output_tokens": r.usage.output_tokens, "input_tokens": r.usage.input_tokens}
    types, deltas = [], []
    for e in c.responses.create(input=story, stream=True, **kw):
        types.append(e.type)
        if e.type == "response.output_text.delta":
            deltas.append(e.delta)
    out["events"], out["stream_text"] = types, "".join(deltas)
    with c.responses.stream(input=story, **kw) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    out["helper"] = {"text": final.output_text, "status": final.status}
    items = [{"role": "user", "content": [{"type": "input_text", "text": story}]}]
    out["items_text"] = c.responses.create(input=items, **kw).output_text
    chat = c.chat.completions.create(
        model=model, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": story}],
    )
    out["chat"] = {"text": chat.choices[0].message.content, "finish": chat.choices[0].finish_reason,
                   "completion_tokens": chat.usage.completion_tokens, "prompt_tokens": chat.usage.prompt_tokens}
    try:
        c.responses.create(input=story, previous_response_id="resp_1", **kw)
        out["previous"] = None
    except openai.BadRequestError as e:
        out["previous"] = {"status": e.status_code, "param": e.param}
    print(json.dumps(out))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "basic":
        basic(*args)
    elif cmd == "load":
        load(*args[:4], int(args[4]))
    elif cmd == "auth":
        auth(*args)
    elif cmd == "tools":
        tools(*args)
    elif cmd == "responses":
        responses(*args)
    else:
        sys.exit("unknown scenario " + cmd)
