//! `rmlx serve` under `rmlx launch`: the default model split over three ranks (MLX's ring on this
//! machine), rank 0 serving HTTP and deciding each step, the others following. Its answers are a
//! single process's, greedy and sampled with a seed, one request at a time and several at once.

mod support;

use serde_json::{json, Value};
use support::Server;

fn chat(server: &Server, body: &Value) -> String {
    let (status, reply) = server.post("/v1/chat/completions", body);
    assert_eq!(status, 200, "{reply}");
    reply["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn question(text: &str, extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 16, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// `asks` sent together: batched by rank 0, every rank stepping the same batch, each answered and
/// starting as `answers` (greedy rows batched with others keep their tokens up to float rounding).
fn asked_at_once(server: &Server, asks: &[Value], answers: &[String]) {
    let handles: Vec<_> = asks
        .iter()
        .cloned()
        .map(|body| {
            let addr = server.addr.clone();
            std::thread::spawn(move || support::post(&addr, "/v1/chat/completions", &body))
        })
        .collect();
    for (h, want) in handles.into_iter().zip(answers) {
        let (status, reply) = h.join().unwrap();
        assert_eq!(status, 200, "{reply}");
        let got = reply["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(!got.is_empty() && reply["choices"][0]["finish_reason"].is_string(), "{reply}");
        let n = got.len().min(want.len()).min(8);
        assert_eq!(&got[..n], &want[..n], "{reply}");
    }
}

#[test]
fn a_server_split_over_three_ranks_answers_as_one_process() {
    let one = Server::start(&["--warm-up", "off"]);
    let split = Server::launch(3, &["--warm-up", "off"]);
    let asks = [
        question("What is the capital of France?", json!({})),
        question("Name three colours.", json!({"temperature": 0.9, "seed": 7})),
        question("Count to five.", json!({"max_tokens": 24})),
    ];
    let answers: Vec<String> = asks.iter().map(|b| chat(&one, b)).collect();
    for (body, want) in asks.iter().zip(&answers) {
        assert!(!want.is_empty());
        assert_eq!(&chat(&split, body), want, "{body}");
    }
    asked_at_once(&split, &asks, &answers);
    // Structured output: every rank masks with the grammar and ends where it completes.
    let schema = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"]}}});
    let body = question("Name a colour as JSON.", json!({"response_format": schema, "max_tokens": 40}));
    let want = chat(&one, &body);
    let parsed: Value = serde_json::from_str(&want).unwrap_or_else(|e| panic!("{e}: {want}"));
    assert!(parsed["colour"].is_string(), "{want}");
    assert_eq!(chat(&split, &body), want);
    assert_eq!(chat(&split, &asks[0]), answers[0]);
    drop(split);
    // Split by blocks (two runs of 15): the same answers, alone and batched.
    let piped = Server::launch(2, &["--warm-up", "off", "--pipeline"]);
    for (body, want) in asks.iter().zip(&answers) {
        assert_eq!(&chat(&piped, body), want, "{body}");
    }
    asked_at_once(&piped, &asks, &answers);
}
