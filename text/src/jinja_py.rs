//! What transformers' chat templates get from Jinja2 and Python that
//! minijinja does differently, redone the Python way:
//!
//! - `tojson`: transformers replaces Jinja2's filter with
//!   `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)`, so `<`, `>`, `&` and `'` stay as they are (minijinja
//!   escapes them for HTML), items are separated by `", "` and keys by
//!   `": "` (minijinja writes `","` and `":"`), and floats are written as
//!   Python writes them;
//! - `trim` and `str.strip()` / `lstrip()` / `rstrip()`: Python strips what
//!   `str.isspace()` calls whitespace, which adds the ASCII separators
//!   U+001C..U+001F to Rust's (Unicode) whitespace.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

/// Whether Python's `str.isspace()` holds for `c`.
pub(crate) fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.into())
}

/// Jinja2's `trim` filter: `str(value).strip(chars)`.
pub(crate) fn trim(value: &Value, chars: Option<Value>) -> Result<Value, Error> {
    let text = match value.as_str() {
        Some(s) => s.to_owned(),
        None => value.to_string(),
    };
    let chars = chars.filter(|c| !c.is_none() && !c.is_undefined());
    Ok(Value::from(match chars {
        None => text.trim_matches(is_py_space).to_owned(),
        Some(chars) => {
            let set: Vec<char> = chars
                .as_str()
                .ok_or_else(|| invalid("trim: the characters to strip must be a string"))?
                .chars()
                .collect();
            text.trim_matches(&set[..]).to_owned()
        }
    }))
}

/// minijinja-contrib's Python methods, with `strip`, `lstrip` and `rstrip`
/// (without characters) stripping Python's whitespace.
pub(crate) fn unknown_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str()
        && matches!(method, "strip" | "lstrip" | "rstrip")
        && args.iter().all(Value::is_none)
        && args.len() <= 1
    {
        return Ok(Value::from(match method {
            "strip" => s.trim_matches(is_py_space),
            "lstrip" => s.trim_start_matches(is_py_space),
            _ => s.trim_end_matches(is_py_space),
        }));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// The options of Python's `json.dumps` that transformers' `tojson` passes
/// on.
struct Dumps {
    ensure_ascii: bool,
    /// The indentation of one level; `None` writes everything on one line.
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// transformers' `tojson` filter: `tojson(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`; `ensure_ascii` and
/// `indent` may be given by position, all by name.
pub(crate) fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let arg = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        match (positional, named) {
            (Some(_), Some(_)) => Err(invalid(format!(
                "tojson: argument {name} given by position and by name"
            ))),
            (p, n) => Ok(p.or(n).filter(|v| !v.is_undefined())),
        }
    };
    let ensure_ascii = arg(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match arg(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = match v.kind() {
                    ValueKind::Bool => i64::from(v.is_true()),
                    _ => i64::try_from(v.clone())
                        .map_err(|_| invalid(format!("tojson: indent {v} is not an integer")))?,
                };
                " ".repeat(usize::try_from(n).unwrap_or(0))
            }
        }),
    };
    let (item_separator, key_separator) = match arg(None, "separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v
                .try_iter()
                .map_err(|_| invalid("tojson: separators must be a pair of strings"))?
                .collect();
            match &parts[..] {
                [a, b] => match (a.as_str(), b.as_str()) {
                    (Some(a), Some(b)) => (a.to_owned(), b.to_owned()),
                    _ => return Err(invalid("tojson: separators must be a pair of strings")),
                },
                _ => return Err(invalid("tojson: separators must be a pair of strings")),
            }
        }
        // Python's defaults: no space at line ends when indenting.
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let sort_keys = arg(None, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let options = Dumps {
        ensure_ascii,
        indent,
        item_separator,
        key_separator,
        sort_keys,
    };
    let mut out = String::new();
    dump(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

fn not_serializable(value: &Value) -> Error {
    invalid(format!(
        "tojson: object of type {} is not JSON serializable",
        value.kind()
    ))
}

fn dump(out: &mut String, value: &Value, o: &Dumps, level: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(value)?),
        ValueKind::String => string(out, value.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq => {
            let items: Vec<Value> = value
                .try_iter()
                .map_err(|_| not_serializable(value))?
                .collect();
            container(out, '[', ']', items.len(), o, level, |out, i| {
                dump(out, &items[i], o, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for key in value.try_iter().map_err(|_| not_serializable(value))? {
                let item = value.get_item(&key)?;
                items.push((key_text(&key)?, item));
            }
            if o.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            container(out, '{', '}', items.len(), o, level, |out, i| {
                let (key, item) = &items[i];
                string(out, key, o.ensure_ascii);
                out.push_str(&o.key_separator);
                dump(out, item, o, level + 1)
            })?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// Writes the items of a list or dict between `open` and `close`, as
/// Python's encoder lays them out.
fn container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    o: &Dumps,
    level: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    newline(out, level + 1);
    for i in 0..len {
        if i > 0 {
            out.push_str(&o.item_separator);
            newline(out, level + 1);
        }
        item(out, i)?;
    }
    newline(out, level);
    out.push(close);
    Ok(())
}

/// A dict key as `json.dumps` writes it: strings as they are, numbers,
/// booleans and None as their JSON text.
fn key_text(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => number(key),
        _ => Err(invalid(format!(
            "tojson: keys must be str, int, float, bool or None, not {}",
            key.kind()
        ))),
    }
}

/// A number as Python's `json.dumps` writes it (`repr` for floats).
fn number(value: &Value) -> Result<String, Error> {
    if value.is_integer() {
        return Ok(value.to_string());
    }
    let f = f64::try_from(value.clone()).map_err(|_| not_serializable(value))?;
    Ok(py_float(f))
}

/// Python's `repr(float)` (as `json.dumps` writes floats): the shortest
/// digits that round-trip, positional for exponents -4..16, else scientific
/// with a signed, two-digit exponent.
pub(crate) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    let n = digits.len() as i32;
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = (exp + 1) as usize;
            if digits.len() <= int_len {
                let zeros = "0".repeat(int_len - digits.len());
                format!("{sign}{digits}{zeros}.0")
            } else {
                format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
            }
        } else {
            let zeros = "0".repeat((-exp - 1) as usize);
            format!("{sign}0.{zeros}{digits}")
        }
    } else {
        let rest = if n > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{rest}e{exp_sign}{:02}", &digits[..1], exp.abs())
    }
}

/// A JSON string as Python's `json.dumps` writes it.
fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    use std::fmt::Write;
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
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.add_filter("trim", trim);
        env.set_unknown_method_callback(unknown_method);
        env.render_str(source, ctx).unwrap()
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let ctx = minijinja::context! {
            x => serde_json::json!({"b": [1, 2.5, null, true], "a": "<'&'> é \u{1f} 😀", "e": {}, "l": []}),
        };
        // Keys in the map's order (serde_json's, sorted).
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"a": "<'&'> é \u001f 😀", "b": [1, 2.5, null, true], "e": {}, "l": []}"#
        );
        assert_eq!(
            render("{{ x.b | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  null,\n  true\n]"
        );
        assert_eq!(
            render("{{ x | tojson(indent=1, sort_keys=true) }}", ctx.clone()),
            "{\n \"a\": \"<'&'> é \\u001f 😀\",\n \"b\": [\n  1,\n  2.5,\n  null,\n  true\n ],\n \"e\": {},\n \"l\": []\n}"
        );
        assert_eq!(
            render("{{ x.a | tojson(ensure_ascii=true) }}", ctx.clone()),
            r#""<'&'> \u00e9 \u001f \ud83d\ude00""#
        );
        assert_eq!(
            render("{{ x.b | tojson(separators=(',', ':')) }}", ctx.clone()),
            "[1,2.5,null,true]"
        );
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        assert!(env.render_str("{{ 1 | tojson(bogus=1) }}", ()).is_err());
        assert!(env.render_str("{{ x | tojson }}", ()).is_err(), "undefined");
    }

    #[test]
    fn floats_are_written_as_python_repr() {
        for (f, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (28.0, "28.0"),
            (21.5, "21.5"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (-2.5e300, "-2.5e+300"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(py_float(f), want, "{f}");
        }
    }

    #[test]
    fn trim_and_strip_remove_python_whitespace() {
        let ctx = minijinja::context! { s => "\u{1f}\u{3000} a b \u{a0}\u{1c}\n" };
        assert_eq!(render("[{{ s | trim }}]", ctx.clone()), "[a b]");
        assert_eq!(render("[{{ s.strip() }}]", ctx.clone()), "[a b]");
        assert_eq!(
            render("[{{ s.lstrip() }}]", ctx.clone()),
            "[a b \u{a0}\u{1c}\n]"
        );
        assert_eq!(
            render("[{{ s.rstrip() }}]", ctx.clone()),
            "[\u{1f}\u{3000} a b]"
        );
        assert_eq!(render("[{{ 'xxaxx' | trim('x') }}]", ctx.clone()), "[a]");
        assert_eq!(render("[{{ 'xxaxx'.strip('x') }}]", ctx.clone()), "[a]");
        assert_eq!(render("{{ 'a,b'.split(',') | length }}", ctx), "2");
    }
}
