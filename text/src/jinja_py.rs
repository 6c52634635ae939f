//! What transformers' chat templates get from Jinja2 and Python that
//! minijinja does differently, redone the Python way:
//!
//! - `tojson`: transformers replaces Jinja2's filter with
//!   `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)`, so `<`, `>`, `&` and `'` stay as they are (minijinja
//!   escapes them for HTML), items are separated by `", "` and keys by
//!   `": "` (minijinja writes `","` and `":"`), and floats are written as
//!   Python writes them; serde_json writes the JSON, through a formatter
//!   with Python's layout;
//! - `trim` and `str.strip()` / `lstrip()` / `rstrip()`: Python strips what
//!   `str.isspace()` calls whitespace, which adds the ASCII separators
//!   U+001C..U+001F to Rust's (Unicode) whitespace.

use std::cell::Cell;
use std::io;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::ser::Formatter;

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
    crate::limits::check_method(value, method, args)?;
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
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

    let shared = Shared {
        sort_keys,
        non_finite: Cell::new(None),
        error: Cell::new(None),
    };
    let formatter = PyFormatter {
        ensure_ascii,
        indent,
        item_separator,
        key_separator,
        level: 0,
        has_value: false,
        non_finite: &shared.non_finite,
    };
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    PyJson {
        value,
        shared: &shared,
    }
    .serialize(&mut serializer)
    .map_err(|e| {
        shared
            .error
            .take()
            .unwrap_or_else(|| invalid(format!("tojson: {e}")))
    })?;
    let text = String::from_utf8(out).map_err(|e| invalid(format!("tojson: {e}")))?;
    Ok(Value::from(text))
}

fn not_serializable(value: &Value) -> Error {
    invalid(format!(
        "tojson: object of type {} is not JSON serializable",
        value.kind()
    ))
}

/// What [`PyJson`] and [`PyFormatter`] share while one value is written.
struct Shared {
    sort_keys: bool,
    /// A NaN or infinite float on its way to [`PyFormatter::write_null`]:
    /// serde_json writes non-finite floats as `null` without asking the
    /// formatter, Python as `NaN`, `Infinity` and `-Infinity`.
    non_finite: Cell<Option<f64>>,
    /// The minijinja error behind a failed serialization, to be returned as
    /// it is rather than as serde_json's text of it.
    error: Cell<Option<Error>>,
}

/// A minijinja value as Python's `json.dumps` sees it, for serde: dict keys
/// turned into strings as Python turns them (and sorted first with
/// `sort_keys`), and what Python cannot serialize (undefined, functions,
/// bytes, iterators, other objects) an error rather than minijinja's own
/// `null` or string for it.
struct PyJson<'a> {
    value: &'a Value,
    shared: &'a Shared,
}

impl PyJson<'_> {
    fn fail<E: serde::ser::Error>(&self, error: Error) -> E {
        let message = error.to_string();
        self.shared.error.set(Some(error));
        E::custom(message)
    }

    fn items(&self) -> Result<Vec<Value>, Error> {
        Ok(self
            .value
            .try_iter()
            .map_err(|_| not_serializable(self.value))?
            .collect())
    }

    fn entries(&self) -> Result<Vec<(String, Value)>, Error> {
        let mut entries = Vec::new();
        for key in self.items()? {
            let item = self.value.get_item(&key)?;
            entries.push((key, item));
        }
        if self.shared.sort_keys {
            // Python sorts the keys before turning them into strings, so
            // numbers sort as numbers.
            entries.sort_by(|a, b| a.0.cmp(&b.0));
        }
        entries
            .into_iter()
            .map(|(key, item)| Ok((key_text(&key)?, item)))
            .collect()
    }
}

impl Serialize for PyJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let value = self.value;
        match value.kind() {
            ValueKind::None | ValueKind::Bool | ValueKind::String => value.serialize(serializer),
            ValueKind::Number => match f64::try_from(value.clone()) {
                Ok(f) if !value.is_integer() && !f.is_finite() => {
                    self.shared.non_finite.set(Some(f));
                    serializer.serialize_unit()
                }
                _ => value.serialize(serializer),
            },
            ValueKind::Seq => {
                let items = self.items().map_err(|e| self.fail(e))?;
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for value in &items {
                    seq.serialize_element(&PyJson {
                        value,
                        shared: self.shared,
                    })?;
                }
                seq.end()
            }
            ValueKind::Map => {
                let entries = self.entries().map_err(|e| self.fail(e))?;
                let mut map = serializer.serialize_map(Some(entries.len()))?;
                for (key, value) in &entries {
                    map.serialize_entry(
                        key,
                        &PyJson {
                            value,
                            shared: self.shared,
                        },
                    )?;
                }
                map.end()
            }
            _ => Err(self.fail(not_serializable(value))),
        }
    }
}

/// A dict key as `json.dumps` turns it into a string: strings as they are,
/// numbers, booleans and None as their JSON text.
fn key_text(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => Ok(py_float(
            f64::try_from(key.clone()).map_err(|_| not_serializable(key))?,
        )),
        _ => Err(invalid(format!(
            "tojson: keys must be str, int, float, bool or None, not {}",
            key.kind()
        ))),
    }
}

/// serde_json's layout made Python's `json.dumps` one: its separators (by
/// default `", "` and `": "`, or `","` at line ends when indenting), its
/// indentation (every item on a line of its own, `[]` and `{}` when empty),
/// floats as Python's `repr` (`NaN` and `Infinity` included) and, with
/// `ensure_ascii`, everything outside printable ASCII as `\uXXXX`.
struct PyFormatter<'a> {
    ensure_ascii: bool,
    /// The indentation of one level; `None` writes everything on one line.
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    /// How many lists and dicts are open.
    level: usize,
    /// Whether the innermost open list or dict has had an item.
    has_value: bool,
    non_finite: &'a Cell<Option<f64>>,
}

impl PyFormatter<'_> {
    fn newline<W: ?Sized + io::Write>(&self, writer: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            writer.write_all(b"\n")?;
            for _ in 0..self.level {
                writer.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + io::Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        writer.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level = self.level.saturating_sub(1);
        if self.has_value {
            self.newline(writer)?;
        }
        writer.write_all(bracket)
    }

    fn item<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if !first {
            writer.write_all(self.item_separator.as_bytes())?;
        }
        self.newline(writer)
    }
}

impl Formatter for PyFormatter<'_> {
    fn write_null<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        match self.non_finite.take() {
            Some(f) => writer.write_all(py_float(f).as_bytes()),
            None => writer.write_all(b"null"),
        }
    }

    fn write_f32<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f32) -> io::Result<()> {
        writer.write_all(py_float(f64::from(value)).as_bytes())
    }

    fn write_f64<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        writer.write_all(py_float(value).as_bytes())
    }

    /// serde_json escapes `"`, `\` and control characters as Python does;
    /// `ensure_ascii` adds everything outside `' '..='~'`, as UTF-16 code
    /// units.
    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if !self.ensure_ascii {
            return writer.write_all(fragment.as_bytes());
        }
        let mut start = 0;
        for (i, c) in fragment.char_indices() {
            if (' '..='~').contains(&c) {
                continue;
            }
            writer.write_all(&fragment.as_bytes()[start..i])?;
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(writer, "\\u{unit:04x}")?;
            }
            start = i + c.len_utf8();
        }
        writer.write_all(&fragment.as_bytes()[start..])
    }

    fn begin_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(writer, first)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(writer, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(self.key_separator.as_bytes())
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
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

/// A dict that keeps its keys in the order given, as Python's do
/// (minijinja's own maps are sorted without its `preserve_order` feature).
#[derive(Debug)]
pub(crate) struct Dict(pub(crate) Vec<(String, Value)>);

impl minijinja::value::Object for Dict {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Map
    }

    fn get_value(self: &std::sync::Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        minijinja::value::Enumerator::Values(
            self.0
                .iter()
                .map(|(k, _)| Value::from(k.as_str()))
                .collect(),
        )
    }
}

/// A JSON value as Python's `json.loads` gives it to a template: objects
/// as dicts in the order of the JSON map, integers as ints, other numbers
/// as floats.
pub(crate) fn json_value(value: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match value {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        J::String(s) => Value::from(s.as_str()),
        J::Array(items) => Value::from(items.iter().map(json_value).collect::<Vec<_>>()),
        J::Object(map) => Value::from_object(Dict(
            map.iter()
                .map(|(k, v)| (k.clone(), json_value(v)))
                .collect(),
        )),
    }
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

    /// A dict that keeps its keys in the order given (minijinja's own maps
    /// are sorted without its `preserve_order` feature).
    #[derive(Debug)]
    struct Dict(Vec<(Value, Value)>);

    impl minijinja::value::Object for Dict {
        fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
            minijinja::value::ObjectRepr::Map
        }

        fn get_value(self: &std::sync::Arc<Self>, key: &Value) -> Option<Value> {
            self.0
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        }

        fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
            minijinja::value::Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
        }
    }

    fn dict(entries: Vec<(Value, Value)>) -> Value {
        Value::from_object(Dict(entries))
    }

    // The expected texts are what Python 3's `json.dumps` writes.
    #[test]
    fn tojson_lays_out_and_escapes_as_python() {
        let nested = dict(vec![
            (
                "b".into(),
                Value::from(vec![
                    Value::from(1),
                    dict(vec![
                        ("c".into(), Value::from(Vec::<Value>::new())),
                        ("d".into(), dict(vec![])),
                    ]),
                    Value::from(vec![Value::from(2), Value::from(vec![3])]),
                ]),
            ),
            ("a".into(), Value::from(())),
        ]);
        let ctx = minijinja::context! {
            nested => nested,
            keys => dict(vec![
                (Value::from(()), 1.into()),
                (true.into(), 2.into()),
                (1.5.into(), 3.into()),
                (1e16.into(), 4.into()),
            ]),
            numbers => dict(vec![(10.into(), 1.into()), (9.into(), 2.into()), (1.5.into(), 3.into())]),
            twice => dict(vec![(1.into(), "a".into()), ("1".into(), "b".into())]),
            s => "é\u{7f}\u{1f}😀\"\\\n\u{8}\u{c}\r\t</script>",
            scalars => vec![
                Value::from(1e16),
                Value::from(0.1),
                Value::from(-0.0),
                Value::from(1.0),
                Value::from(f64::NAN),
                Value::from(f64::INFINITY),
                Value::from(f64::NEG_INFINITY),
                Value::from(true),
                Value::from(false),
                Value::from(()),
                Value::from(1u128 << 70),
                Value::from(-(1i128 << 70)),
                Value::from(u64::MAX),
                Value::from(i64::MIN),
            ],
        };
        // sort_keys=False keeps the dict's order.
        assert_eq!(
            render("{{ nested | tojson }}", ctx.clone()),
            r#"{"b": [1, {"c": [], "d": {}}, [2, [3]]], "a": null}"#
        );
        assert_eq!(
            render("{{ nested | tojson(indent=2) }}", ctx.clone()),
            "{\n  \"b\": [\n    1,\n    {\n      \"c\": [],\n      \"d\": {}\n    },\n    [\n      2,\n      [\n        3\n      ]\n    ]\n  ],\n  \"a\": null\n}"
        );
        assert_eq!(
            render("{{ nested | tojson(sort_keys=true) }}", ctx.clone()),
            r#"{"a": null, "b": [1, {"c": [], "d": {}}, [2, [3]]]}"#
        );
        assert_eq!(
            render(
                "{{ [1, [2]] | tojson(indent='\t', separators=(', ', ' = ')) }}",
                ctx.clone()
            ),
            "[\n\t1, \n\t[\n\t\t2\n\t]\n]"
        );
        assert_eq!(
            render("{{ nested.b | tojson(false, 2) }}", ctx.clone()),
            render("{{ nested.b | tojson(indent=2) }}", ctx.clone())
        );
        assert_eq!(
            render("{{ [[], {}] | tojson(indent=0) }}", ctx.clone()),
            "[\n[],\n{}\n]"
        );
        // Keys become strings as Python makes them; numbers sort as numbers;
        // keys that end up equal are both written.
        assert_eq!(
            render("{{ keys | tojson(indent=0) }}", ctx.clone()),
            "{\n\"null\": 1,\n\"true\": 2,\n\"1.5\": 3,\n\"1e+16\": 4\n}"
        );
        assert_eq!(
            render("{{ numbers | tojson(sort_keys=true) }}", ctx.clone()),
            r#"{"1.5": 3, "9": 2, "10": 1}"#
        );
        assert_eq!(
            render("{{ twice | tojson }}", ctx.clone()),
            r#"{"1": "a", "1": "b"}"#
        );
        // Escapes: controls always, everything outside ' '..='~' with
        // ensure_ascii; never the HTML characters.
        assert_eq!(
            render("{{ s | tojson }}", ctx.clone()),
            "\"é\u{7f}\\u001f😀\\\"\\\\\\n\\b\\f\\r\\t</script>\""
        );
        assert_eq!(
            render("{{ s | tojson(true) }}", ctx.clone()),
            r#""\u00e9\u007f\u001f\ud83d\ude00\"\\\n\b\f\r\t</script>""#
        );
        assert_eq!(
            render("{{ {'é': 'ü'} | tojson(ensure_ascii=true) }}", ctx.clone()),
            r#"{"\u00e9": "\u00fc"}"#
        );
        assert_eq!(
            render("{{ scalars | tojson }}", ctx.clone()),
            "[1e+16, 0.1, -0.0, 1.0, NaN, Infinity, -Infinity, true, false, null, \
             1180591620717411303424, -1180591620717411303424, 18446744073709551615, \
             -9223372036854775808]"
        );
        assert_eq!(render("{{ 2.5 | tojson }}", ctx.clone()), "2.5");
        assert_eq!(render("{{ none | tojson }}", ctx), "null");
    }

    #[test]
    fn tojson_refuses_what_python_cannot_serialize() {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        for (source, message) in [
            (
                "{{ x | tojson }}",
                "type undefined is not JSON serializable",
            ),
            (
                "{{ [1, x] | tojson }}",
                "type undefined is not JSON serializable",
            ),
            (
                "{{ {'a': x} | tojson }}",
                "type undefined is not JSON serializable",
            ),
            ("{{ [range] | tojson }}", "is not JSON serializable"),
            (
                "{{ {'a': [1, range]} | tojson(indent=2) }}",
                "is not JSON serializable",
            ),
            (
                "{{ {(1, 2): 1} | tojson }}",
                "keys must be str, int, float, bool or None",
            ),
        ] {
            let err = env.render_str(source, ()).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidOperation, "{source}");
            assert!(err.to_string().contains(message), "{source}: {err}");
        }
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
