//! Reading tool calls out of text that is still arriving: a JSON scanner that says how far a
//! value goes (complete, cut short, or not JSON) without building it, and the call objects
//! (`{"name": …, "arguments": …}`) and call lists the tool-call formats write.

/// How far a JSON value reaches from where it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// It ends before this byte offset.
    Complete(usize),
    /// The text ends inside it.
    Incomplete,
    /// It is not JSON.
    Invalid,
}

pub(crate) fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The end of the JSON string starting at `s[i] == '"'`.
fn string_end(s: &[u8], i: usize) -> Reach {
    let mut j = i + 1;
    while j < s.len() {
        match s[j] {
            b'\\' => j += 2,
            b'"' => return Reach::Complete(j + 1),
            _ => j += 1,
        }
    }
    Reach::Incomplete
}

/// The end of the JSON value starting at `s[i]` (no leading whitespace).
pub(crate) fn value_end(s: &[u8], i: usize) -> Reach {
    let Some(&c) = s.get(i) else { return Reach::Incomplete };
    match c {
        b'"' => string_end(s, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < s.len() {
                match s[j] {
                    b'"' => match string_end(s, j) {
                        Reach::Complete(e) => {
                            j = e;
                            continue;
                        }
                        other => return other,
                    },
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Reach::Complete(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Reach::Incomplete
        }
        b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
            let mut j = i;
            while j < s.len() && (s[j].is_ascii_alphanumeric() || matches!(s[j], b'-' | b'+' | b'.')) {
                j += 1;
            }
            // A number or literal is only known to be whole once something follows it.
            if j == s.len() {
                Reach::Incomplete
            } else {
                Reach::Complete(j)
            }
        }
        _ => Reach::Invalid,
    }
}

/// Where a call's arguments lie in the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: usize,
    /// The end so far (the text's end while incomplete).
    pub end: usize,
    pub complete: bool,
}

/// One call object read so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CallScan {
    pub name: Option<String>,
    pub args: Option<Span>,
    /// The byte after the object's `}` once it is complete.
    pub end: Option<usize>,
}

impl CallScan {
    /// Whether the arguments are a JSON string holding the JSON (some templates write them so).
    pub fn args_are_string(&self, s: &[u8]) -> bool {
        self.args.is_some_and(|a| s.get(a.start) == Some(&b'"'))
    }
}

/// The keys a call's name and arguments go by (OpenAI's and Hermes' `arguments`, Llama 3's
/// `parameters`).
const ARG_KEYS: [&str; 2] = ["arguments", "parameters"];

/// Reads the call object starting at `s[i] == '{'`; `Err` when it is not one.
pub(crate) fn scan_call(s: &[u8], i: usize) -> Result<CallScan, ()> {
    let mut call = CallScan::default();
    let mut j = skip_ws(s, i + 1);
    loop {
        match s.get(j) {
            None => return Ok(call),
            Some(b'}') => {
                call.end = Some(j + 1);
                return Ok(call);
            }
            Some(b'"') => {}
            Some(_) => return Err(()),
        }
        let key_end = match string_end(s, j) {
            Reach::Complete(e) => e,
            _ => return Ok(call),
        };
        let key: String = serde_json::from_slice(&s[j..key_end]).map_err(|_| ())?;
        j = skip_ws(s, key_end);
        match s.get(j) {
            None => return Ok(call),
            Some(b':') => j = skip_ws(s, j + 1),
            Some(_) => return Err(()),
        }
        if j == s.len() {
            return Ok(call);
        }
        let reach = value_end(s, j);
        if ARG_KEYS.contains(&key.as_str()) && call.args.is_none() {
            match reach {
                Reach::Complete(e) => call.args = Some(Span { start: j, end: e, complete: true }),
                Reach::Incomplete => {
                    call.args = Some(Span { start: j, end: s.len(), complete: false });
                    return Ok(call);
                }
                Reach::Invalid => return Err(()),
            }
        }
        let end = match reach {
            Reach::Complete(e) => e,
            Reach::Incomplete => return Ok(call),
            Reach::Invalid => return Err(()),
        };
        if key == "name" && call.name.is_none() {
            call.name = Some(serde_json::from_slice::<String>(&s[j..end]).map_err(|_| ())?);
        }
        j = skip_ws(s, end);
        match s.get(j) {
            None => return Ok(call),
            Some(b',') => j = skip_ws(s, j + 1),
            Some(b'}') => {}
            Some(_) => return Err(()),
        }
    }
}

/// The calls of a body holding call objects, separated by commas, semicolons or whitespace and
/// possibly inside one `[...]`; `Err` when the body is not such a list. The last call may be
/// unfinished.
pub(crate) fn scan_calls(s: &[u8]) -> Result<Vec<CallScan>, ()> {
    let mut calls = Vec::new();
    let mut j = skip_ws(s, 0);
    let listed = s.get(j) == Some(&b'[');
    if listed {
        j += 1;
    }
    loop {
        while j < s.len() && (s[j].is_ascii_whitespace() || s[j] == b',' || s[j] == b';') {
            j += 1;
        }
        match s.get(j) {
            None => return Ok(calls),
            Some(b'{') => {
                let call = scan_call(s, j)?;
                let Some(end) = call.end else {
                    calls.push(call);
                    return Ok(calls);
                };
                calls.push(call);
                j = end;
            }
            Some(b']') if listed => {
                return if s[j + 1..].iter().all(u8::is_ascii_whitespace) { Ok(calls) } else { Err(()) };
            }
            Some(_) => return Err(()),
        }
    }
}

/// Mistral's later form, `name[ARGS]{json}` repeated (with `[CALL_ID]id` before `[ARGS]` in some
/// versions): the calls so far, or `Err` when the body is not that.
pub(crate) fn scan_named_args(s: &[u8]) -> Result<Vec<CallScan>, ()> {
    const ARGS: &[u8] = b"[ARGS]";
    const CALL_ID: &[u8] = b"[CALL_ID]";
    let mut calls = Vec::new();
    let mut j = skip_ws(s, 0);
    while j < s.len() {
        // Each call may repeat the opening marker.
        if s[j..].starts_with(b"[TOOL_CALLS]") {
            j = skip_ws(s, j + b"[TOOL_CALLS]".len());
            continue;
        }
        let rest = &s[j..];
        let Some(at) = find(rest, ARGS) else {
            // A name still arriving: only name characters (and a call id) so far.
            let name_like = rest.iter().all(|&c| c.is_ascii_alphanumeric() || b"_-.[]".contains(&c))
                || b"[TOOL_CALLS]".starts_with(rest);
            return if name_like { Ok(calls) } else { Err(()) };
        };
        let head = &rest[..at];
        let name = match find(head, CALL_ID) {
            Some(k) => &head[..k],
            None => head,
        };
        let name = std::str::from_utf8(name).map_err(|_| ())?.trim();
        if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c)) {
            return Err(());
        }
        let start = skip_ws(s, j + at + ARGS.len());
        let mut call = CallScan { name: Some(name.to_string()), ..CallScan::default() };
        match value_end(s, start) {
            Reach::Complete(e) => {
                call.args = Some(Span { start, end: e, complete: true });
                call.end = Some(e);
                calls.push(call);
                j = skip_ws(s, e);
            }
            Reach::Incomplete => {
                if start < s.len() {
                    call.args = Some(Span { start, end: s.len(), complete: false });
                }
                calls.push(call);
                return Ok(calls);
            }
            Reach::Invalid => return Err(()),
        }
    }
    Ok(calls)
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The length of the longest end of `text` that begins one of `markers` (text that must be held
/// back: it may still become a marker).
pub(crate) fn partial_marker(text: &str, markers: &[&str]) -> usize {
    let mut best = 0;
    for m in markers {
        for (k, _) in m.char_indices().skip(1) {
            if k > best && text.ends_with(&m[..k]) {
                best = k;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_reach() {
        assert_eq!(value_end(br#"{"a": [1, "}"]} x"#, 0), Reach::Complete(15));
        assert_eq!(value_end(br#"{"a": "\"}"#, 0), Reach::Incomplete);
        assert_eq!(value_end(b"123", 0), Reach::Incomplete);
        assert_eq!(value_end(b"123}", 0), Reach::Complete(3));
        assert_eq!(value_end(b"}", 0), Reach::Invalid);
    }

    #[test]
    fn calls_read_as_they_arrive() {
        let text = br#"{"name": "f", "arguments": {"x": 1}} ; {"parameters": {}, "name": "g"}"#;
        let calls = scan_calls(text).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name.as_deref(), Some("f"));
        let a = calls[0].args.unwrap();
        assert_eq!(&text[a.start..a.end], br#"{"x": 1}"#);
        assert_eq!(calls[1].name.as_deref(), Some("g"));
        // cut inside the arguments: the name is known, the arguments run to the end
        let cut = &text[..33];
        let calls = scan_calls(cut).unwrap();
        assert_eq!(calls[0].name.as_deref(), Some("f"));
        assert_eq!(calls[0].args, Some(Span { start: 27, end: 33, complete: false }));
        assert_eq!(&cut[27..], br#"{"x": "#);
        assert!(scan_calls(b"{\"name\" 1}").is_err());
        assert!(scan_calls(b"hello").is_err());
        assert_eq!(scan_calls(b"[{\"name\": \"f\"}]").unwrap().len(), 1);
    }

    #[test]
    fn mistral_named_form() {
        let calls = scan_named_args(br#"get_weather[ARGS]{"city": "Paris"}add[CALL_ID]a1[ARGS]{"a": 1"#).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name.as_deref(), Some("get_weather"));
        assert!(calls[0].args.unwrap().complete);
        assert_eq!(calls[1].name.as_deref(), Some("add"));
        assert!(!calls[1].args.unwrap().complete);
        assert!(scan_named_args(b"get_wea").unwrap().is_empty());
        assert!(scan_named_args(b"Sure! here").is_err());
    }

    #[test]
    fn partial_markers() {
        assert_eq!(partial_marker("abc <tool_", &["<tool_call>"]), 6);
        assert_eq!(partial_marker("abc <tool_call>", &["<tool_call>"]), 0);
        assert_eq!(partial_marker("x<", &["<think>", "</think>"]), 1);
    }
}
