//! The Python side of transformers' template environment: `tojson` as `json.dumps` writes it, and
//! `strftime_now`.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`: Python's
/// `json.dumps` with those arguments (positional or keyword), as transformers installs it.
pub(super) fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let ensure_ascii = match kwargs.get::<Option<Value>>("ensure_ascii")?.or(ensure_ascii) {
        Some(v) => v.is_true(),
        None => false,
    };
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(
                i64::try_from(v).map_err(|_| invalid("tojson: indent must be an integer or a string"))?.max(0) as usize,
            )),
        },
    };
    let (mut item_sep, mut key_sep) = if indent.is_some() { (",", ": ") } else { (", ", ": ") };
    let seps = kwargs.get::<Option<Value>>("separators")?;
    let seps_owned: Option<(String, String)> = match seps {
        Some(s) if !s.is_none() && !s.is_undefined() => {
            let a = s.get_item_by_index(0).ok().and_then(|v| v.as_str().map(str::to_owned));
            let b = s.get_item_by_index(1).ok().and_then(|v| v.as_str().map(str::to_owned));
            Some(a.zip(b).ok_or_else(|| invalid("tojson: separators must be two strings"))?)
        }
        _ => None,
    };
    if let Some((a, b)) = &seps_owned {
        item_sep = a;
        key_sep = b;
    }
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let style = JsonStyle { ensure_ascii, indent, item_sep: item_sep.into(), key_sep: key_sep.into(), sort_keys };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(out)
}

fn write_str(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && !(' '..='~').contains(&c)) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (as `json.dumps` writes floats).
pub(super) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // shortest round-trip digits: "1.5e-5", "1e16"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

fn number(v: &Value) -> String {
    if v.is_integer() {
        v.to_string()
    } else {
        py_float(f64::try_from(v.clone()).unwrap_or(f64::NAN))
    }
}

fn key_string(k: &Value) -> String {
    match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
        ValueKind::Number => number(k),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        _ => k.to_string(),
    }
}

fn newline(out: &mut String, style: &JsonStyle, level: usize) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, style: &JsonStyle, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(v)),
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Bytes => {
            write_str(out, &String::from_utf8_lossy(v.as_bytes().unwrap_or_default()), style.ensure_ascii)
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by_key(key_string);
            }
            out.push('{');
            newline(out, style, level + 1);
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                    newline(out, style, level + 1);
                }
                write_str(out, &key_string(k), style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_value(out, &v.get_item(k)?, style, level + 1)?;
            }
            newline(out, style, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            newline(out, style, level + 1);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                    newline(out, style, level + 1);
                }
                write_value(out, item, style, level + 1)?;
            }
            newline(out, style, level);
            out.push(']');
        }
        _ => write_str(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

/// `strftime_now(format)`: the current time (UTC) formatted like Python's `strftime`.
pub(super) fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| invalid(e.to_string()))?
        .as_secs() as i64;
    Ok(strftime(&format, secs))
}

/// Civil date (year, month 1-12, day 1-31) of a day count since 1970-01-01.
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + (m <= 2) as i64, m, d)
}

/// Days since 1970-01-01 of a civil date.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// `strftime` of the UTC time `secs` seconds after the epoch: `%Y %y %m %d %e %j %H %I %M %S %p
/// %b %B %h %a %A %w %u %F %T %D %%`, with glibc's `%-d`-style no-padding flag.
pub(super) fn strftime(format: &str, secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    let (hh, mm, ss) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 0 = Monday (1970-01-01 was a Thursday)
    let doy = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let pad = spec != Some('-');
        if !pad {
            spec = chars.next();
        }
        let num = |v: i64, w: usize| {
            if pad {
                format!("{v:0w$}")
            } else {
                v.to_string()
            }
        };
        let h12 = if hh % 12 == 0 { 12 } else { hh % 12 };
        match spec {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(m as i64, 2)),
            Some('d') => out.push_str(&num(d as i64, 2)),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('j') => out.push_str(&num(doy, 3)),
            Some('H') => out.push_str(&num(hh, 2)),
            Some('I') => out.push_str(&num(h12, 2)),
            Some('M') => out.push_str(&num(mm, 2)),
            Some('S') => out.push_str(&num(ss, 2)),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('b') | Some('h') => out.push_str(&MONTHS[m as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[m as usize - 1]),
            Some('a') => out.push_str(&DAYS[wd][..3]),
            Some('A') => out.push_str(DAYS[wd]),
            Some('w') => out.push_str(&((wd + 1) % 7).to_string()),
            Some('u') => out.push_str(&(wd + 1).to_string()),
            Some('F') => out.push_str(&format!("{y}-{m:02}-{d:02}")),
            Some('T') => out.push_str(&format!("{hh:02}:{mm:02}:{ss:02}")),
            Some('D') => out.push_str(&format!("{m:02}/{d:02}/{:02}", y.rem_euclid(100))),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if !pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_like_python() {
        for (f, s) in [
            (1.0, "1.0"),
            (21.5, "21.5"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (1e-4, "0.0001"),
            (-2.0, "-2.0"),
            (123456789012345.6, "123456789012345.6"),
        ] {
            assert_eq!(py_float(f), s);
        }
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-07-26 13:05:09 UTC was a Friday, day 208 of a leap year.
        let t = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%A %B %-d, %H:%M:%S %p %j %y %I %%", t), "Friday July 26, 13:05:09 PM 208 24 01 %");
        assert_eq!(strftime("%F %T %a %w %u", 0), "1970-01-01 00:00:00 Thu 4 4");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }
}
