//! The Python side of transformers' template environment: `tojson` as `json.dumps` writes it
//! (serde_json with a formatter for Python's separators, indentation, float repr and
//! `ensure_ascii`), and `strftime_now` (chrono, with Python's pass-through of unknown conversions).

use chrono::format::{Item, StrftimeItems};
use chrono::{DateTime, Utc};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};
use serde::ser::{Error as _, SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use std::io::{self, Write};

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
    // Python's defaults: no space after commas when indenting (the line break separates).
    let (mut item_sep, mut key_sep) = match indent {
        Some(_) => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    match kwargs.get::<Option<Value>>("separators")? {
        Some(s) if !s.is_none() && !s.is_undefined() => {
            let part = |i| s.get_item_by_index(i).ok().and_then(|v| v.as_str().map(str::to_owned));
            (item_sep, key_sep) =
                part(0).zip(part(1)).ok_or_else(|| invalid("tojson: separators must be two strings"))?;
        }
        _ => {}
    }
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let formatter = PyFormatter { ensure_ascii, indent, item_sep, key_sep, level: 0, has_value: false };
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    Python { value, sort_keys }.serialize(&mut serializer).map_err(|e| invalid(format!("tojson: {e}")))?;
    String::from_utf8(out).map_err(|e| invalid(format!("tojson: {e}")))
}

/// A template value as Python's `json` module sees it: undefined as `None`, bytes as text, keys
/// as strings (numbers, booleans and `None` converted as `json.dumps` converts them), maps in
/// their order or sorted by key, anything else as its string form.
struct Python<'a> {
    value: &'a Value,
    sort_keys: bool,
}

impl Serialize for Python<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.value;
        let items = || v.try_iter().map_err(S::Error::custom);
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => s.serialize_unit(),
            ValueKind::Bool => s.serialize_bool(v.is_true()),
            ValueKind::Number if v.is_integer() => match i64::try_from(v.clone()) {
                Ok(i) => s.serialize_i64(i),
                Err(_) => s.serialize_i128(i128::try_from(v.clone()).map_err(S::Error::custom)?),
            },
            ValueKind::Number => s.serialize_f64(f64::try_from(v.clone()).unwrap_or(f64::NAN)),
            ValueKind::String => s.serialize_str(v.as_str().unwrap_or_default()),
            ValueKind::Bytes => s.serialize_str(&String::from_utf8_lossy(v.as_bytes().unwrap_or_default())),
            ValueKind::Map => {
                let mut keys: Vec<Value> = items()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(key_string);
                }
                let mut map = s.serialize_map(Some(keys.len()))?;
                for k in &keys {
                    let item = v.get_item(k).map_err(S::Error::custom)?;
                    map.serialize_entry(&key_string(k), &Python { value: &item, sort_keys: self.sort_keys })?;
                }
                map.end()
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = items()?.collect();
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in &items {
                    seq.serialize_element(&Python { value: item, sort_keys: self.sort_keys })?;
                }
                seq.end()
            }
            _ => s.serialize_str(&v.to_string()),
        }
    }
}

/// A map key as `json.dumps` writes it.
fn key_string(k: &Value) -> String {
    match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => py_float(f64::try_from(k.clone()).unwrap_or(f64::NAN)),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        _ => k.to_string(),
    }
}

/// serde_json's output in Python's layout: its separators, an indentation string (a line per
/// element, as `indent=` gives), floats as `repr` writes them, and with `ensure_ascii` every
/// character outside printable ASCII as `\uXXXX` (UTF-16 pairs above the BMP). serde_json's own
/// escapes of quotes, backslashes and control characters are Python's already.
struct PyFormatter {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn line<W: ?Sized + Write>(&self, w: &mut W, level: usize) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..level {
                w.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.line(w, self.level)?;
        }
        w.write_all(bracket)
    }

    fn element<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(self.item_sep.as_bytes())?;
        }
        self.line(w, self.level)
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn write_f64<W: ?Sized + Write>(&mut self, w: &mut W, value: f64) -> io::Result<()> {
        w.write_all(py_float(value).as_bytes())
    }

    fn write_f32<W: ?Sized + Write>(&mut self, w: &mut W, value: f32) -> io::Result<()> {
        self.write_f64(w, value as f64)
    }

    fn write_string_fragment<W: ?Sized + Write>(&mut self, w: &mut W, fragment: &str) -> io::Result<()> {
        if !self.ensure_ascii {
            return w.write_all(fragment.as_bytes());
        }
        for c in fragment.chars() {
            match c {
                ' '..='~' => w.write_all(&[c as u8])?,
                c => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        write!(w, "\\u{unit:04x}")?;
                    }
                }
            }
        }
        Ok(())
    }

    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.element(w, first)
    }

    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.element(w, first)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(self.key_sep.as_bytes())
    }

    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
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

/// `strftime_now(format)`: the current time (UTC) formatted like Python's `strftime`.
pub(super) fn strftime_now(format: String) -> Result<String, Error> {
    Ok(strftime(&format, Utc::now()))
}

/// `strftime` of a UTC time: each conversion chrono knows (`%Y %m %d %e %j %H %I %M %S %p %b %B
/// %a %A %w %u %F %T %D %%` and the others, with `-`/`_`/`0` padding flags) formatted by chrono;
/// any other `%x`, and a `%` that ends the format, written as they are, as glibc's `strftime`
/// (under Python's) writes them, where chrono would fail.
pub(super) fn strftime(format: &str, time: DateTime<Utc>) -> String {
    let mut out = String::new();
    let mut rest = format;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let flag = after.starts_with(['-', '_', '0']) as usize;
        let len = 1 + flag + after[flag..].chars().next().map_or(0, char::len_utf8);
        let spec = &rest[at..at + len];
        match StrftimeItems::new(spec).any(|item| matches!(item, Item::Error)) {
            false => out.push_str(&time.format_with_items(StrftimeItems::new(spec)).to_string()),
            true => out.push_str(spec),
        }
        rest = &rest[at + len..];
    }
    out.push_str(rest);
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
        let at = |secs| DateTime::from_timestamp(secs, 0).unwrap();
        let t = at(1_721_999_109);
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%A %B %-d, %H:%M:%S %p %j %y %I %%", t), "Friday July 26, 13:05:09 PM 208 24 01 %");
        assert_eq!(strftime("%F %T %a %w %u", at(0)), "1970-01-01 00:00:00 Thu 4 4");
        assert_eq!(strftime("%Y-%m-%d %j %e", at(951_782_400)), "2000-02-29 060 29");
        // Unknown conversions and a final `%` pass through, as glibc's strftime leaves them.
        assert_eq!(strftime("%Q|%-Q|%d%", at(0)), "%Q|%-Q|01%");
        assert_eq!(strftime("%é %d", at(0)), "%é 01");
    }
}
