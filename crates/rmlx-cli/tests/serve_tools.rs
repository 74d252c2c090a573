//! `rmlx serve` for agents: tools through the chat template, tool choices that force a call
//! (whose arguments then satisfy the function's schema), calls streamed as OpenAI streams them,
//! tool results in the history, and reasoning split from the answer. The default model runs with
//! Qwen 3's own chat template (`--chat-template`), whose tool and thinking markup it then follows
//! where a grammar makes it.

mod support;

use serde_json::{json, Value};
use support::{request, Server};

fn qwen3_template() -> std::path::PathBuf {
    let goldens =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../rmlx-lm/tests/fixtures/tokenizers/goldens.json");
    let g: Value = serde_json::from_str(&std::fs::read_to_string(goldens).unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("rmlx-serve-tools-{}.jinja", std::process::id()));
    std::fs::write(&path, g["templates"]["qwen3"].as_str().unwrap()).unwrap();
    path
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false}}})
}

fn clock() -> Value {
    json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"], "additionalProperties": false}}})
}

/// The arguments satisfy `weather()`'s schema.
fn weather_arguments(text: &str) {
    let args: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = args.as_object().unwrap();
    assert_eq!(o.len(), 2, "{args}");
    assert!(o["city"].as_str().is_some_and(|c| c.chars().count() <= 20), "{args}");
    assert!(["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap()), "{args}");
}

/// The data lines of a streamed response, parsed (without `[DONE]`).
fn stream(server: &Server, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) = request(&server.addr, "POST", "/v1/chat/completions", Some(&body), &[]);
    assert_eq!(status, 200, "{text}");
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[test]
fn forced_tool_calls_whole_and_streamed() {
    let template = qwen3_template();
    let server = Server::start(&["--chat-template", template.to_str().unwrap()]);
    let user = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let body = json!({"messages": user, "tools": [weather(), clock()], "max_tokens": 80, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": false});
    let (status, v) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let message = &choice["message"];
    assert!(message["content"].is_null(), "{v}");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"), "{v}");
    let arguments = calls[0]["function"]["arguments"].as_str().unwrap();
    weather_arguments(arguments);

    // Streamed: the call's index, id, type and name first, then its arguments in pieces that add
    // up to the whole response's.
    let chunks = stream(&server, &body);
    let mut pieces = String::new();
    let mut heads = Vec::new();
    let mut reasons = Vec::new();
    for c in &chunks {
        let choice = &c["choices"][0];
        if let Some(r) = choice["finish_reason"].as_str() {
            reasons.push(r.to_string());
        }
        assert!(choice["delta"]["content"].as_str().is_none_or(str::is_empty), "{c}");
        for call in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(call["index"], 0, "{c}");
            if call.get("id").is_some() {
                assert!(pieces.is_empty(), "the call's head after its arguments: {c}");
                heads.push((call["id"].clone(), call["function"]["name"].clone(), call["type"].clone()));
            }
            pieces.push_str(call["function"]["arguments"].as_str().unwrap());
        }
    }
    assert_eq!(heads.len(), 1, "{chunks:?}");
    assert_eq!((heads[0].1.as_str(), heads[0].2.as_str()), (Some("get_weather"), Some("function")));
    assert_eq!(pieces, arguments);
    assert!(chunks.iter().filter(|c| c["choices"][0]["delta"].get("tool_calls").is_some()).count() > 2, "{chunks:?}");
    assert_eq!(reasons, ["tool_calls"]);

    // `required` over two tools, one call: a call of one of them, whose arguments fit its schema.
    let required = json!({"messages": [{"role": "user", "content": "What time is it in Tokyo?"}], "tools": [weather(), clock()],
        "tool_choice": "required", "parallel_tool_calls": false, "max_tokens": 80, "temperature": 0});
    let (status, v) = server.post("/v1/chat/completions", &required);
    assert_eq!(status, 200, "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    match calls[0]["function"]["name"].as_str().unwrap() {
        "get_weather" => weather_arguments(&args.to_string()),
        "get_time" => assert!(args["zone"].is_string() && args.as_object().unwrap().len() == 1, "{args}"),
        other => panic!("{other}"),
    }

    // `auto` shows the tools to the model (the prompt grows by their description); `none` does not.
    let tokens = |extra: Value| {
        let mut b = json!({"messages": user, "max_tokens": 1});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, v) = server.post("/v1/chat/completions", &b);
        assert_eq!(status, 200, "{v}");
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let plain = tokens(json!({}));
    assert!(tokens(json!({"tools": [weather()]})) > plain + 50);
    assert_eq!(tokens(json!({"tools": [weather()], "tool_choice": "none"})), plain);

    // A tool result in the history: the call (arguments as JSON text) and its result are rendered.
    let history = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, light rain"}]);
    let with_result = tokens(json!({"messages": history, "tools": [weather()]}));
    let without = tokens(json!({"messages": history.as_array().unwrap()[..2], "tools": [weather()]}));
    assert!(with_result > without + 8, "{with_result} vs {without}");

    // Refusals: a forced choice with a response_format, or naming a function that is not a tool.
    for (extra, says) in [
        (json!({"tool_choice": "required", "response_format": {"type": "json_object"}}), "cannot be combined"),
        (json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}), "`nope`"),
    ] {
        let mut b = json!({"messages": user, "tools": [weather()], "max_tokens": 5});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, v) = server.post("/v1/chat/completions", &b);
        assert_eq!(status, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{v}");
    }
    let _ = std::fs::remove_file(template);
}

#[test]
fn reasoning_is_split_from_the_answer() {
    let template = qwen3_template();
    let server = Server::start(&["--chat-template", template.to_str().unwrap()]);
    // The regex makes the model think first, as Qwen 3 does.
    let body = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "regex", "regex": "<think>\nThe user wants a greeting\\.\n</think>\n\nHello[!.]"}});
    let (status, v) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "The user wants a greeting.", "{v}");
    let content = message["content"].as_str().unwrap();
    assert!(content == "Hello!" || content == "Hello.", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let chunks = stream(&server, &body);
    let (mut reasoning, mut answer) = (String::new(), String::new());
    for c in &chunks {
        let d = &c["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        answer.push_str(d["content"].as_str().unwrap_or(""));
        assert!(d.get("reasoning_content").is_none() || d.get("content").is_none(), "{c}");
    }
    assert_eq!((reasoning.as_str(), answer.as_str()), ("The user wants a greeting.", content));

    // Template variables: Qwen 3 without thinking closes an empty thinking block in the prompt.
    let tokens = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, v) = server.post("/v1/chat/completions", &b);
        assert_eq!(status, 200, "{v}");
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let thinking = tokens(json!({}));
    let off = tokens(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    assert!(off > thinking, "{off} vs {thinking}");
    assert_eq!(tokens(json!({"enable_thinking": false})), off);
    let (status, v) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}),
    );
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("chat_template_kwargs")), "{v}");
    let _ = std::fs::remove_file(template);
}

/// The Responses API: text, a forced call (its arguments fit the schema), the streamed events in
/// order and numbered, a follow-up by `previous_response_id` carrying the call's output, a kept
/// response read back, and refusals.
#[test]
fn responses_api() {
    let server = Server::start(&[]);
    let (status, v) = server.post(
        "/v1/responses",
        &json!({"input": "What is the capital of France?", "max_output_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "response");
    let out = &v["output"][0];
    assert_eq!((out["type"].as_str(), out["role"].as_str()), (Some("message"), Some("assistant")), "{v}");
    let text = out["content"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(out["content"][0]["type"], "output_text");
    assert!(!text.is_empty());
    let usage = &v["usage"];
    assert_eq!(
        usage["total_tokens"],
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()
    );
    // The same streamed: created, in progress, the item and its part, the text in deltas, the
    // part and item done, then the response completed (or incomplete at max_output_tokens).
    let body =
        json!({"input": "What is the capital of France?", "max_output_tokens": 12, "temperature": 0, "stream": true});
    let (status, raw) = request(&server.addr, "POST", "/v1/responses", Some(&body), &[]);
    assert_eq!(status, 200, "{raw}");
    let events: Vec<Value> =
        raw.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let names: Vec<&str> = raw.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(kinds, names);
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, text);
    let mut order: Vec<&str> = kinds.iter().copied().filter(|k| *k != "response.output_text.delta").collect();
    let last = order.pop().unwrap();
    assert!(last == "response.completed" || last == "response.incomplete", "{kinds:?}");
    assert_eq!(
        order,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done"
        ]
    );
    assert!(events.iter().enumerate().all(|(i, e)| e["sequence_number"] == i as u64), "{kinds:?}");
    assert_eq!(events.last().unwrap()["response"]["output"][0]["content"][0]["text"], text.as_str());

    // A forced call, then its output by previous_response_id.
    let flat = json!([{"type": "function", "name": "get_weather", "parameters": weather()["function"]["parameters"]}]);
    let (status, call) = server.post("/v1/responses", &json!({"input": "Weather in Paris?", "tools": flat, "temperature": 0,
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": false, "max_output_tokens": 60}));
    assert_eq!(status, 200, "{call}");
    let item = &call["output"][0];
    assert_eq!((item["type"].as_str(), item["name"].as_str()), (Some("function_call"), Some("get_weather")), "{call}");
    weather_arguments(item["arguments"].as_str().unwrap());
    let follow = json!({"previous_response_id": call["id"], "tools": flat, "max_output_tokens": 4,
        "input": [{"type": "function_call_output", "call_id": item["call_id"], "output": "18 degrees"}]});
    let (status, next) = server.post("/v1/responses", &follow);
    assert_eq!(status, 200, "{next}");
    // The follow-up's prompt holds the first request's, its call and the output.
    assert!(
        next["usage"]["input_tokens"].as_u64().unwrap() > call["usage"]["input_tokens"].as_u64().unwrap() + 20,
        "{next}"
    );
    let (status, kept) =
        request(&server.addr, "GET", &format!("/v1/responses/{}", next["id"].as_str().unwrap()), None, &[]);
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&kept).unwrap()["output"], next["output"]);

    for (body, code, param) in [
        (json!({"input": "hi", "previous_response_id": "resp_nope"}), 404, "previous_response_id"),
        (json!({"input": 7}), 400, "input"),
        (json!({"input": [{"type": "image_generation_call"}]}), 400, "input"),
        (json!({"input": "hi", "tools": [{"type": "web_search"}]}), 400, "tools"),
    ] {
        let (status, v) = server.post("/v1/responses", &body);
        assert_eq!((status, v["error"]["param"].as_str()), (code, Some(param)), "{body}: {v}");
    }
    let (status, _) = request(&server.addr, "GET", "/v1/responses/resp_nope", None, &[]);
    assert_eq!(status, 404);
}
