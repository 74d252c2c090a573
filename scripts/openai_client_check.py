"""Checks `rmlx serve` with OpenAI's official Python client (`pip install openai`): whole and streamed
chat completions, a text completion, usage, a stop string, the model list and the error types the
client raises; tool calls (forced, whole and streamed, arguments checked against the schema; a tool
result in the history) and the Responses API (text, a forced call, streamed events, a follow-up by
previous_response_id). With --thinking-base-url (a server whose template has Qwen 3's thinking
markup), reasoning is split from the answer. Exits non-zero on the first mismatch.

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
    ap.add_argument("--thinking-base-url", help="a server with a thinking chat template (Qwen 3's)")
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
    check_tools(client, model)
    check_responses(client, model)
    if a.thinking_base_url:
        thinking = openai.OpenAI(base_url=a.thinking_base_url, api_key=a.api_key, max_retries=0)
        check_reasoning(thinking, thinking.models.list().data[0].id)
    print("all checks passed")


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}


def valid_weather(arguments):
    """Whether `arguments` (JSON text) satisfy WEATHER."""
    args = json.loads(arguments)
    return (set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 20
            and args["unit"] in ("celsius", "fahrenheit"))


def check_tools(client, model):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(model=model, messages=messages, tools=tools, max_tokens=60, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    whole = client.chat.completions.create(**forced)
    calls = whole.choices[0].message.tool_calls
    check(whole.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather",
          f"forced tool call: {calls[0].function.name if calls else None}({calls[0].function.arguments if calls else ''})")
    check(valid_weather(calls[0].function.arguments), "the call's arguments satisfy the schema")
    pieces, heads, reasons = [], [], []
    for chunk in client.chat.completions.create(**forced, stream=True):
        for c in chunk.choices:
            for t in c.delta.tool_calls or []:
                if t.id:
                    heads.append((t.index, t.id, t.function.name))
                pieces.append(t.function.arguments or "")
            if c.finish_reason:
                reasons.append(c.finish_reason)
    check(len(heads) == 1 and heads[0][0] == 0 and heads[0][2] == "get_weather" and len(pieces) > 2,
          f"streamed call: id and name first, then {len(pieces) - 1} argument pieces")
    check("".join(pieces) == calls[0].function.arguments and reasons == ["tool_calls"],
          "streamed arguments add up to the whole call's")
    required = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=60, temperature=0)
    check(valid_weather(required.choices[0].message.tool_calls[0].function.arguments), "tool_choice required")
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees and light rain"}]
    after = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=24, temperature=0)
    before = client.chat.completions.create(model=model, messages=history[:2], tools=tools, max_tokens=1)
    check(after.usage.prompt_tokens > before.usage.prompt_tokens + 5 and after.choices[0].message.role == "assistant",
          f"a tool result in the history is rendered ({before.usage.prompt_tokens} -> {after.usage.prompt_tokens} prompt tokens)")


def check_responses(client, model):
    text = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=16,
                                   temperature=0)
    check(text.object == "response" and text.status in ("completed", "incomplete") and len(text.output_text) > 0,
          f"responses.create: {text.output_text!r}")
    check(text.usage.output_tokens > 0 and text.usage.total_tokens == text.usage.input_tokens + text.usage.output_tokens,
          "responses usage")
    events, deltas = [], []
    with client.responses.stream(model=model, input="What is the capital of France?", max_output_tokens=16,
                                 temperature=0) as stream:
        for e in stream:
            events.append(e.type)
            if e.type == "response.output_text.delta":
                deltas.append(e.delta)
        final = stream.get_final_response()
    check(events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
          and "".join(deltas) == text.output_text == final.output_text, f"streamed response: {len(events)} events")
    flat = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
    call = client.responses.create(model=model, input="What is the weather in Paris?", tools=flat, temperature=0,
                                   tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                                   max_output_tokens=60)
    calls = [o for o in call.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather" and valid_weather(calls[0].arguments),
          f"responses forced call: {calls[0].arguments if calls else None}")
    follow = client.responses.create(model=model, previous_response_id=call.id, tools=flat, max_output_tokens=16,
                                     temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                            "output": "18 degrees and light rain"}])
    check(follow.status in ("completed", "incomplete") and follow.usage.input_tokens > call.usage.input_tokens,
          f"previous_response_id with a function_call_output ({follow.usage.input_tokens} input tokens)")
    check(client.responses.retrieve(follow.id).id == follow.id, "responses.retrieve")


def check_reasoning(client, model):
    rx = "<think>\nThe user wants a greeting\\.\n</think>\n\nHello!"
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=40, temperature=0,
                  extra_body={"response_format": {"type": "regex", "regex": rx}})
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    check(getattr(message, "reasoning_content", None) == "The user wants a greeting." and message.content == "Hello!",
          f"reasoning split: {getattr(message, 'reasoning_content', None)!r} / {message.content!r}")
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            content.append(c.delta.content or "")
    check("".join(reasoning) == "The user wants a greeting." and "".join(content) == "Hello!", "streamed reasoning split")
    on = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    off = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    check(off.usage.prompt_tokens > on.usage.prompt_tokens, "chat_template_kwargs enable_thinking reaches the template")


if __name__ == "__main__":
    main()
