//! The grammar of a FunctionGemma call whose arguments satisfy the function's JSON schema:
//! `call:name{key:<escape>text<escape>,n:1}`. Strings go between `<escape>` tokens, enumerated
//! strings as one of their values; other values (numbers, booleans, arrays, objects) as compact
//! JSON of their own schema, which is how the reply parser reads them back. Required properties
//! come in the schema's order, each optional one may follow them in that order; a schema without
//! properties takes `{}`.

use serde_json::{json, Value as Json};

/// Lark rules for the arguments of call `k` (`args{k}` and what it uses), the `<escape>` token
/// written as `esc` (`<[id]>`).
pub(super) fn argument_rules(k: usize, params: &Json, esc: &str) -> String {
    let lit = |s: &str| serde_json::to_string(s).expect("a string");
    let empty = serde_json::Map::new();
    let properties = params.get("properties").and_then(Json::as_object).unwrap_or(&empty);
    let required: Vec<&str> = params
        .get("required")
        .and_then(Json::as_array)
        .map_or(Vec::new(), |r| r.iter().filter_map(Json::as_str).collect());
    let mut rules = Vec::new();
    let (mut firm, mut optional) = (Vec::new(), Vec::new());
    for (i, (key, schema)) in properties.iter().enumerate() {
        let item = format!("arg{k}_{i}");
        rules.push(format!("{item}: {} {}", lit(&format!("{key}:")), value(schema, esc)));
        if required.contains(&key.as_str()) {
            firm.push(item);
        } else {
            optional.push(item);
        }
    }
    let body = if firm.is_empty() {
        // Any of the optional ones, in order, none at all included.
        let tails: Vec<String> = (0..optional.len())
            .map(|i| {
                let rest: String = optional[i + 1..].iter().map(|o| format!(" (\",\" {o})?")).collect();
                format!("{}{rest}", optional[i])
            })
            .collect();
        if tails.is_empty() {
            String::new()
        } else {
            format!("({})?", tails.join(" | "))
        }
    } else {
        let rest: String = optional.iter().map(|o| format!(" (\",\" {o})?")).collect();
        format!("{}{rest}", firm.join(" \",\" "))
    };
    rules.push(format!("args{k}: \"{{\" {body} \"}}\""));
    rules.join("\n")
}

/// A value of `schema`: between `<escape>` tokens for a string, else compact JSON.
fn value(schema: &Json, esc: &str) -> String {
    let is_string = schema.get("type").and_then(Json::as_str) == Some("string");
    let choices: Option<Vec<&str>> =
        schema.get("enum").and_then(Json::as_array).and_then(|e| e.iter().map(Json::as_str).collect());
    match (is_string, choices) {
        (true, Some(c)) if !c.is_empty() => {
            let c: Vec<String> = c.iter().map(|s| serde_json::to_string(s).expect("a string")).collect();
            format!("{esc} ({}) {esc}", c.join(" | "))
        }
        (true, _) => format!("{esc} /(?s:.*)/ {esc}"),
        _ => {
            let mut s = schema.clone();
            if let Json::Object(o) = &mut s {
                o.insert(
                    "x-guidance".into(),
                    json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"}),
                );
            }
            format!("%json {s}")
        }
    }
}
