"""Checks `rmlx serve` with OpenAI's official Python client (`pip install openai`): whole and streamed
chat completions, a text completion, usage, a stop string, the model list and the error types the
client raises. Exits non-zero on the first mismatch.

Usage:
    rmlx serve --model M --port 8080 &
    python3 scripts/openai_client_check.py --base-url http://127.0.0.1:8080/v1
"""
import argparse
import json
import sys

import openai


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0)

    models = client.models.list().data
    check(len(models) == 1, f"one model listed ({models[0].id})")
    model = models[0].id

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    check(whole.object == "chat.completion" and whole.choices[0].message.role == "assistant", "chat completion shape")
    check(whole.usage.completion_tokens > 0 and whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens,
          f"usage {whole.usage.prompt_tokens} + {whole.usage.completion_tokens}")
    check(whole.choices[0].finish_reason in ("stop", "length"), f"finish_reason {whole.choices[0].finish_reason}")

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    check("".join(pieces) == text, "streamed deltas add up to the whole completion")
    check(usage is not None and usage.completion_tokens == whole.usage.completion_tokens, "usage chunk")
    check(reasons == [whole.choices[0].finish_reason], "one finish reason, the same")

    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    check(done.object == "text_completion" and len(done.choices[0].text) > 0, f"text completion {done.choices[0].text!r}")
    words = done.choices[0].text.split()
    if len(words) > 1:
        cut = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stop=[words[1]])
        check(cut.choices[0].finish_reason == "stop" and words[1] not in cut.choices[0].text, f"stop string {words[1]!r}")

    again = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    details = again.usage.prompt_tokens_details
    check(details is not None and details.cached_tokens == again.usage.prompt_tokens - 1,
          f"prompt cache: {details.cached_tokens if details else None} of {again.usage.prompt_tokens} prompt tokens reused")
    lp = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    check(len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
                                                           for t in content), "logprobs with top_logprobs")
    several = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.9, seed=1, n=3)
    check([c.index for c in several.choices] == [0, 1, 2], "n=3: three choices")
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    structured = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 2+2? Answer in JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}})
    reply = json.loads(structured.choices[0].message.content)
    check(set(reply) == {"answer"} and isinstance(reply["answer"], int), f"response_format json_schema: {reply}")
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        check(False, "unknown model refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "unknown model: NotFoundError 404")
    try:
        client.chat.completions.create(model=model, messages=messages, temperature=-1)
        check(False, "negative temperature refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"bad value: BadRequestError 400 ({e.message[:60]})")
    print("all checks passed")


if __name__ == "__main__":
    main()
