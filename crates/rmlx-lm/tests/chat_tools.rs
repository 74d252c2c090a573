//! Replies taken apart (`rmlx_lm::chat::ReplyParser`): reasoning, answer and tool calls of every
//! format, whole and fed in pieces of every size (the pieces must give the same message, and a
//! call's id and name must come before its arguments); tool choices and the grammar that forces a
//! call; templates without tools.

mod common;

use rmlx_lm::chat::{
    messages_without_tool_support, ChatRequest, Reply, ReplyEvent, ReplyFormat, ReplyParser, Think, ToolCall,
    ToolChoice, ToolFormat,
};
use serde_json::json;

fn call(i: usize, name: &str, arguments: &str) -> ToolCall {
    ToolCall { id: format!("call_{i}"), name: name.into(), arguments: arguments.into() }
}

/// The reply of `text` whole, checked against the same text fed in pieces of 1 to 9 bytes (on
/// character boundaries).
fn parse(format: &ReplyFormat, text: &str) -> Reply {
    let whole = Reply::parse(format, text, "call_");
    for size in 1..10 {
        let mut p = ReplyParser::new(format.clone(), "call_");
        let mut events = Vec::new();
        let mut piece = String::new();
        for ch in text.chars() {
            piece.push(ch);
            if piece.len() >= size {
                events.extend(p.push(&std::mem::take(&mut piece)));
            }
        }
        events.extend(p.push(&piece));
        events.extend(p.finish());
        let mut begun = std::collections::HashSet::new();
        for e in &events {
            match e {
                ReplyEvent::ToolCall { index, .. } => assert!(begun.insert(*index), "call {index} begun twice"),
                ReplyEvent::Arguments { index, .. } => assert!(begun.contains(index), "arguments before call {index}"),
                _ => {}
            }
        }
        assert_eq!(Reply::collect(events), whole, "pieces of {size} bytes of {text:?}");
    }
    whole
}

fn hermes() -> ReplyFormat {
    ReplyFormat { think: Some(Think::default()), tools: Some(ToolFormat::Hermes), harmony: false }
}

#[test]
fn hermes_calls_with_thinking() {
    let text = "<think>\nI should look.\nTwice.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
    let r = parse(&hermes(), text);
    assert_eq!(r.reasoning.as_deref(), Some("I should look.\nTwice."));
    assert_eq!(r.content, "Let me check.\n");
    assert_eq!(r.tool_calls, vec![call(0, "weather", r#"{"city": "Oslo", "days": [1, 2]}"#), call(1, "time", "{}")]);
}

#[test]
fn plain_answers_and_lookalikes_stay_content() {
    let r = parse(&hermes(), "No tools needed: 2 < 3 and <tool is not a tag.");
    assert_eq!(
        (r.reasoning, r.content.as_str(), r.tool_calls.len()),
        (None, "No tools needed: 2 < 3 and <tool is not a tag.", 0)
    );
    // a call block that is not JSON is text, as written
    let r = parse(&hermes(), "A<tool_call>oops</tool_call>B");
    assert_eq!(r.content, "A<tool_call>oops</tool_call>B");
    assert!(r.tool_calls.is_empty());
    // thinking only at the start; a closing tag alone is text
    let r = parse(&hermes(), "Answer </think> <think>x</think>");
    assert_eq!((r.reasoning, r.content.as_str()), (None, "Answer </think> <think>x</think>"));
    // without a tool format, call blocks are text
    let f = ReplyFormat { tools: None, ..hermes() };
    let r = parse(&f, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>");
    assert!(r.tool_calls.is_empty() && r.content.starts_with("<tool_call>"));
}

#[test]
fn thinking_opened_by_the_prompt_and_cut_short() {
    let f = ReplyFormat { think: Some(Think { open: true, ..Think::default() }), tools: None, harmony: false };
    let r = parse(&f, "\nStep one.\n</think>\n\nParis.");
    assert_eq!((r.reasoning.as_deref(), r.content.as_str()), (Some("Step one."), "Paris."));
    // max_tokens inside the thinking: all of it is reasoning
    let r = parse(&f, "Step one, step");
    assert_eq!((r.reasoning.as_deref(), r.content.as_str()), (Some("Step one, step"), ""));
}

#[test]
fn arguments_written_as_a_string_are_decoded() {
    let r = parse(&hermes(), "<tool_call>{\"arguments\": \"{\\\"a\\\": 1}\", \"name\": \"f\"}</tool_call>");
    assert_eq!(r.tool_calls, vec![call(0, "f", r#"{"a": 1}"#)]);
}

#[test]
fn llama3_json_calls() {
    let f = ReplyFormat { think: None, tools: Some(ToolFormat::Llama3), harmony: false };
    let r = parse(&f, "  {\"name\": \"weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"time\", \"parameters\": {\"tz\": \"UTC\"}}");
    assert_eq!(r.tool_calls, vec![call(0, "weather", r#"{"city": "Oslo"}"#), call(1, "time", r#"{"tz": "UTC"}"#)]);
    assert_eq!(r.content, "");
    let r = parse(&f, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}");
    assert_eq!(r.tool_calls, vec![call(0, "f", "{}")]);
    // JSON that is not a call is the answer
    let r = parse(&f, "{\"answer\": 4}");
    assert_eq!((r.content.as_str(), r.tool_calls.len()), ("{\"answer\": 4}", 0));
    let r = parse(&f, "The answer is {4}.");
    assert_eq!(r.content, "The answer is {4}.");
}

#[test]
fn mistral_calls_both_forms() {
    let f = ReplyFormat { think: None, tools: Some(ToolFormat::Mistral), harmony: false };
    let r =
        parse(&f, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]");
    assert_eq!(r.tool_calls, vec![call(0, "a", r#"{"x": 1}"#), call(1, "b", "{}")]);
    let r = parse(&f, "Sure.[TOOL_CALLS]a[ARGS]{\"x\": 1}[TOOL_CALLS]b[CALL_ID]abc123def[ARGS]{\"y\": \"[ARGS]\"}");
    assert_eq!(r.content, "Sure.");
    assert_eq!(r.tool_calls, vec![call(0, "a", r#"{"x": 1}"#), call(1, "b", r#"{"y": "[ARGS]"}"#)]);
}

#[test]
fn function_gemma_calls() {
    let f = ReplyFormat { think: None, tools: Some(ToolFormat::FunctionGemma), harmony: false };
    let r = parse(&f, "<start_function_call>call:weather{city:<escape>Oslo, NO<escape>,days:3}<end_function_call>");
    assert_eq!(r.tool_calls, vec![call(0, "weather", r#"{"city":"Oslo, NO","days":3}"#)]);
}

#[test]
fn harmony_channels() {
    let f = ReplyFormat { think: None, tools: Some(ToolFormat::Harmony), harmony: true };
    let text = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}";
    let r = parse(&f, text);
    assert_eq!(r.reasoning.as_deref(), Some("Need weather."));
    assert_eq!(r.tool_calls, vec![call(0, "weather", r#"{"city": "Oslo"}"#)]);
    let r = parse(&f, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.");
    assert_eq!((r.reasoning.as_deref(), r.content.as_str()), (Some("Easy."), "Four."));
}

#[test]
fn tool_choices() {
    assert_eq!(ToolChoice::from_json(&json!("required")).unwrap(), ToolChoice::Required);
    assert_eq!(
        ToolChoice::from_json(&json!({"type": "function", "function": {"name": "f"}})).unwrap(),
        ToolChoice::Function("f".into())
    );
    assert_eq!(
        ToolChoice::from_json(&json!({"type": "function", "name": "g"})).unwrap(),
        ToolChoice::Function("g".into())
    );
    assert!(ToolChoice::from_json(&json!("sometimes")).unwrap_err().to_string().contains("sometimes"));
    assert_eq!(ToolFormat::from_name("qwen").unwrap(), ToolFormat::Hermes);
    assert!(ToolFormat::from_name("xml").is_err());
}

#[test]
fn history_for_templates_without_tools() {
    let tools = vec![json!({"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}})];
    let messages = vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Weather in Oslo and Rome?"}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}}]}),
        json!({"role": "tool", "tool_call_id": "c0", "content": "rain"}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "sun"}),
    ];
    let out = messages_without_tool_support(&messages, &tools);
    assert_eq!(out.len(), 4);
    let system = out[0]["content"].as_str().unwrap();
    assert!(
        system.starts_with("Be brief.\n\n# Tools")
            && system.contains(r#"{"type":"function","function":{"name":"weather""#)
    );
    assert_eq!(
        out[2]["content"],
        "<tool_call>\n{\"name\":\"weather\",\"arguments\":{\"city\":\"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"weather\",\"arguments\":{\"city\":\"Rome\"}}\n</tool_call>"
    );
    assert_eq!(
        out[3],
        json!({"role": "user", "content": "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response>"})
    );
}

/// The default model (ChatML without tools) through `prepare_chat`: the instructions reach the
/// prompt, a forced choice's grammar admits exactly a call of the named function whose arguments
/// satisfy its schema, and a template with tools (Qwen 3's) gets them itself.
#[test]
fn prepared_requests_and_forced_calls() {
    use rmlx_lm::grammar::GrammarCompiler;
    let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model().unwrap(), &Default::default()).unwrap();
    let weather = json!({"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": false}}});
    let time =
        json!({"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}});
    let user = vec![json!({"role": "user", "content": "Weather in Oslo?"})];
    let plain = lm.prepare_chat(&ChatRequest::new(user.clone())).unwrap();
    assert!(plain.grammar.is_none() && plain.reply.tools.is_none());
    let auto = lm
        .prepare_chat(&ChatRequest { tools: vec![weather.clone(), time.clone()], ..ChatRequest::new(user.clone()) })
        .unwrap();
    let text = lm.tokenizer.decode(&auto.prompt, false).unwrap();
    assert!(text.contains("<tools>") && text.contains("\"name\":\"time\""), "{text}");
    assert_eq!(auto.reply.tools, Some(ToolFormat::Hermes));
    let none = lm
        .prepare_chat(&ChatRequest {
            tools: vec![weather.clone()],
            tool_choice: ToolChoice::None,
            ..ChatRequest::new(user.clone())
        })
        .unwrap();
    assert_eq!(none.prompt, plain.prompt);
    let forced = lm
        .prepare_chat(&ChatRequest {
            tools: vec![weather.clone(), time.clone()],
            tool_choice: ToolChoice::Function("weather".into()),
            parallel_tool_calls: false,
            ..ChatRequest::new(user.clone())
        })
        .unwrap();
    let compiler = GrammarCompiler::new(&lm).unwrap();
    let admits = |text: &str| {
        let mut c = compiler.compile(forced.grammar.as_ref().unwrap()).unwrap();
        for id in lm.tokenizer.encode(text, false).unwrap() {
            if !c.allowed().unwrap().contains(&id) {
                return false;
            }
            c.accept(id).unwrap();
        }
        c.is_finished() || c.allowed().unwrap().iter().any(|t| lm.eos_ids.contains(t))
    };
    assert!(admits(
        "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>"
    ));
    assert!(!admits("<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>"));
    assert!(!admits("<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"));
    assert!(!admits("Sure!"));
    let err = lm
        .prepare_chat(&ChatRequest { tool_choice: ToolChoice::Required, ..ChatRequest::new(user.clone()) })
        .unwrap_err();
    assert!(matches!(err, rmlx_lm::Error::InvalidParameter(_)), "{err}");
    let err = lm
        .prepare_chat(&ChatRequest {
            tools: vec![weather.clone()],
            tool_choice: ToolChoice::Function("time".into()),
            ..ChatRequest::new(user.clone())
        })
        .unwrap_err();
    assert!(err.to_string().contains("`time`"), "{err}");
}

/// A conversation with a call and its result through Qwen 3's own template (the goldens' copy), as
/// transformers renders it (the expected text is Jinja2's rendering with transformers' settings):
/// the call's arguments, given as JSON text, reach the template as an object.
#[test]
fn tool_history_through_qwen3_template() {
    let goldens = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/goldens.json");
    let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(goldens).unwrap()).unwrap();
    let mut lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model().unwrap(), &Default::default()).unwrap();
    lm.chat_template = lm.chat_template.with_source(g["templates"]["qwen3"].as_str().unwrap()).unwrap();
    let tools =
        vec![json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})];
    let messages = vec![
        json!({"role": "user", "content": "Weather in Paris?"}),
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "18 degrees"}),
    ];
    let ready = lm.prepare_chat(&ChatRequest { tools, ..ChatRequest::new(messages) }).unwrap();
    let text = lm.tokenizer.decode(&ready.prompt, false).unwrap();
    let want = "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"The weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(text, want);
    // Qwen 3's template writes thinking markup: replies are read for it, and for Hermes calls.
    assert_eq!(ready.reply.think, Some(rmlx_lm::chat::Think::default()));
    assert_eq!(ready.reply.tools, Some(ToolFormat::Hermes));
}

/// A byte-level tokenizer (a token a byte, GPT-2's byte-to-character map) with FunctionGemma's
/// call markers as special tokens 256–258.
fn byte_tokenizer_with_gemma_markers() -> String {
    // GPT-2's map: the bytes not printable take the characters from 256 on, in byte order.
    let mut next = 256;
    let mut map = serde_json::Map::new();
    for b in 0..256u32 {
        let c = if (b'!' as u32..=b'~' as u32).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        {
            b
        } else {
            next += 1;
            next - 1
        };
        map.insert(char::from_u32(c).unwrap().to_string(), json!(b));
    }
    let special = |id: u32, s: &str| json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null, "post_processor": null,
        "added_tokens": [special(256, "<start_function_call>"), special(257, "<end_function_call>"), special(258, "<escape>")],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": map, "merges": []}
    })
    .to_string()
}

/// A forced call in FunctionGemma's format: the grammar takes exactly the calls of the named
/// function whose arguments satisfy its schema (strings between `<escape>` tokens, an enum's
/// values only, an integer as JSON, optional properties after the required ones), and the reply
/// parser reads them back as the JSON arguments.
#[test]
fn function_gemma_forced_calls() {
    use rmlx_lm::grammar::GrammarCompiler;
    let dir = common::fixture_with_tokenizer("llama_gqa");
    std::fs::write(dir.path().join("tokenizer.json"), byte_tokenizer_with_gemma_markers()).unwrap();
    let lm = rmlx_lm::loader::load(dir.path(), &Default::default()).unwrap();
    let weather = json!({"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "days"]}}});
    let time = json!({"type": "function", "function": {"name": "time", "parameters": {"type": "object",
        "properties": {"zone": {"type": "string"}}}}});
    let special = |m: &str| lm.tokenizer.inner().token_to_id(m);
    let compiler = GrammarCompiler::new(&lm).unwrap();
    let admits = |grammar: &rmlx_lm::grammar::Grammar, text: &str| {
        let mut c = compiler.compile(grammar).unwrap();
        for id in lm.tokenizer.encode(text, false).unwrap() {
            if !c.allowed().unwrap().contains(&id) {
                return false;
            }
            c.accept(id).unwrap();
        }
        c.is_finished() || c.allowed().unwrap().iter().any(|t| lm.eos_ids.contains(t))
    };
    let named = ToolFormat::FunctionGemma
        .forced_grammar(&[weather.clone(), time.clone()], &ToolChoice::Function("weather".into()), false, &special)
        .unwrap();
    let call = |args: &str| format!("<start_function_call>call:weather{{{args}}}<end_function_call>");
    assert!(admits(&named, &call("city:<escape>Oslo, Norway<escape>,days:3")));
    assert!(admits(&named, &call("city:<escape>Oslo<escape>,days:3,unit:<escape>C<escape>")));
    assert!(!admits(&named, &call("city:<escape>Oslo<escape>,days:3,unit:<escape>K<escape>")), "not in the enum");
    assert!(!admits(&named, &call("city:<escape>Oslo<escape>")), "days is required");
    assert!(!admits(&named, &call("city:<escape>Oslo<escape>,days:three")), "days is an integer");
    assert!(!admits(&named, "<start_function_call>call:time{}<end_function_call>"), "another function");
    assert!(!admits(&named, "Sure!"));
    // `required`, several calls allowed: either function, one after the other; `time`'s only
    // property is optional.
    let any = ToolFormat::FunctionGemma
        .forced_grammar(&[weather.clone(), time.clone()], &ToolChoice::Required, true, &special)
        .unwrap();
    let two =
        format!("{}<start_function_call>call:time{{}}<end_function_call>", call("city:<escape>Rome<escape>,days:1"));
    assert!(admits(&any, &two));
    assert!(admits(&any, "<start_function_call>call:time{zone:<escape>UTC<escape>}<end_function_call>"));
    // What the parser reads back from an admitted call.
    let format = ReplyFormat { think: None, tools: Some(ToolFormat::FunctionGemma), harmony: false };
    let reply = parse(&format, &call("city:<escape>Oslo, Norway<escape>,days:3,unit:<escape>C<escape>"));
    assert_eq!(reply.tool_calls.len(), 1, "{reply:?}");
    let args: serde_json::Value = serde_json::from_str(&reply.tool_calls[0].arguments).unwrap();
    assert_eq!(args, json!({"city": "Oslo, Norway", "days": 3, "unit": "C"}));
    // A tokenizer without the markers: a clear error.
    let words = common::fixture_with_tokenizer("llama_gqa");
    let plain = rmlx_lm::loader::load(words.path(), &Default::default()).unwrap();
    let none = |m: &str| plain.tokenizer.inner().token_to_id(m);
    let err = ToolFormat::FunctionGemma.forced_grammar(&[weather], &ToolChoice::Required, false, &none).unwrap_err();
    assert!(err.to_string().contains("<start_function_call>"), "{err}");
}
