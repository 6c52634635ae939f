//! The limits every chat template renders under.
//!
//! A chat template comes from the model folder, that is from whoever
//! published the model, and it runs in the rollout worker, in the
//! coordinator's prompt-length check and in `asyncrl train --check-config`.
//! A template that loops for ever, recurses without end or builds a string
//! of gigabytes must fail that render with an error, not hang or abort the
//! process. Four limits do it:
//!
//! - fuel ([`MAX_FUEL`]): minijinja's instruction budget per render; it stops
//!   loops (a `for` in a `for` over `range(100000)`);
//! - recursion ([`MAX_RECURSION`]): minijinja's depth budget (a macro call
//!   costs 4, an `if` or `for` 1); it stops a macro that calls itself;
//! - size ([`MAX_SIZE`]): no string the template builds and no output may
//!   exceed it, and no list may hold more than [`MAX_ITEMS`] items. Fuel
//!   alone cannot do this: doubling a string 40 times takes a few hundred
//!   instructions and 1 TiB. minijinja checks none of it (`~` and `+` join
//!   strings of any size), so the compiled template is rewritten before it
//!   runs: `~`, `+` and `*` become calls of checked functions (the same
//!   operation after a size check), raw text is written through the
//!   formatter that counts the output, and the filters and Python methods
//!   that can grow a string (`replace`, `join`, `indent`) check first.
//!
//! The defaults leave room: the Qwen3, Qwen2.5 and Llama-3.x templates render
//! a conversation of 1,000 messages with tools in well under a tenth of
//! [`MAX_FUEL`] (see the test `limits_leave_room_for_long_conversations`).
//! A prompt is at most `model.max_seq_len` tokens, a few bytes each, far
//! below [`MAX_SIZE`].

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::OnceLock;

use minijinja::machinery::{CompiledTemplate, Instruction, Instructions, TemplateConfig};
use minijinja::value::{Kwargs, StringInput, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, Value};

/// Instructions one render may run (minijinja's fuel). A long conversation
/// with tools takes tens of thousands on the real templates.
pub const MAX_FUEL: u64 = 10_000_000;

/// minijinja's recursion budget (its own default and maximum is 500; a macro
/// call costs 4): 200 allows macros 50 deep and stays well inside a 2 MiB
/// thread stack.
pub const MAX_RECURSION: usize = 200;

/// The most bytes a render may write, and the longest string it may build:
/// 16 MiB, some 4 million tokens of text.
pub const MAX_SIZE: usize = 16 << 20;

/// The most items a list the template builds may hold.
pub const MAX_ITEMS: usize = 1 << 20;

/// Which limit a template exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateLimit {
    /// [`MAX_FUEL`]: too many instructions (a loop that does not end).
    Fuel,
    /// [`MAX_RECURSION`]: too deep (a macro that calls itself).
    Recursion,
    /// [`MAX_SIZE`] or [`MAX_ITEMS`]: a string, list or output too large.
    Size,
}

impl std::fmt::Display for TemplateLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateLimit::Fuel => write!(f, "fuel limit ({MAX_FUEL} instructions per render)"),
            TemplateLimit::Recursion => {
                write!(f, "recursion limit (depth {MAX_RECURSION})")
            }
            TemplateLimit::Size => write!(
                f,
                "size limit ({} MiB of output or per string, {MAX_ITEMS} items per list)",
                MAX_SIZE >> 20
            ),
        }
    }
}

/// The marker of the size errors this module raises.
const SIZE_MARKER: &str = "exceeds the chat template size limit";

fn too_large(what: &str, size: usize, limit: usize) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("{what} of {size} would be made: {SIZE_MARKER} ({limit})"),
    )
}

/// The limit `err` (or an error it wraps) reports, if any.
pub(crate) fn exceeded(err: &Error) -> Option<TemplateLimit> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(e) = e.downcast_ref::<Error>() {
            if e.kind() == ErrorKind::OutOfFuel {
                return Some(TemplateLimit::Fuel);
            }
            let detail = e.detail().unwrap_or_default();
            if detail.contains("recursion limit exceeded") {
                return Some(TemplateLimit::Recursion);
            }
            if detail.contains(SIZE_MARKER) {
                return Some(TemplateLimit::Size);
            }
        }
        current = e.source();
    }
    None
}

/// Names of the checked functions that replace `~`, `+` and `*`.
const CONCAT: &str = "__asyncrl_concat";
const ADD: &str = "__asyncrl_add";
const MUL: &str = "__asyncrl_mul";

/// Sets the limits on `env` and defines what the rewritten templates call.
pub(crate) fn install(env: &mut Environment<'static>) {
    env.set_fuel(Some(MAX_FUEL));
    env.set_recursion_limit(MAX_RECURSION);
    env.set_formatter(counting_formatter);
    env.add_function(CONCAT, concat);
    env.add_function(ADD, add);
    env.add_function(MUL, mul);
    env.add_filter("replace", replace_filter);
    env.add_filter("join", join_filter);
    env.add_filter("indent", indent_filter);
}

/// How templates are compiled: as transformers' Jinja2 environment
/// (`trim_blocks`, `lstrip_blocks`), no auto-escaping.
pub(crate) fn template_config() -> TemplateConfig {
    TemplateConfig {
        syntax_config: Default::default(),
        ws_config: minijinja::machinery::WhitespaceConfig {
            keep_trailing_newline: false,
            lstrip_blocks: true,
            trim_blocks: true,
        },
        default_auto_escape: std::sync::Arc::new(|_| AutoEscape::None),
    }
}

thread_local! {
    /// Bytes the render running on this thread may still write.
    static OUTPUT_LEFT: Cell<usize> = const { Cell::new(MAX_SIZE) };
}

/// Renders `compiled` (rewritten by [`checked`]) under the limits: the
/// text, and the fuel it took.
pub(crate) fn render(
    env: &Environment<'_>,
    compiled: &CompiledTemplate<'_>,
    root: Value,
) -> Result<(String, u64), Error> {
    let instructions = checked(&compiled.instructions);
    let blocks: BTreeMap<_, _> = compiled
        .blocks
        .iter()
        .map(|(name, block)| (*name, checked(block)))
        .collect();
    let previous = OUTPUT_LEFT.with(|left| left.replace(MAX_SIZE));
    let mut out = String::new();
    let result = minijinja::machinery::Vm::new(env)
        .eval(
            &instructions,
            root,
            &blocks,
            &mut minijinja::machinery::make_string_output(&mut out),
            compiled.initial_auto_escape,
        )
        .map(|(_, state)| state.fuel_levels().map_or(0, |(used, _)| used));
    OUTPUT_LEFT.with(|left| left.set(previous));
    result.map(|fuel| (out, fuel))
}

/// `instructions` with `~`, `+` and `*` replaced by calls of the checked
/// functions, and raw text written through the formatter (so that it is
/// counted); jump targets are moved to match.
fn checked<'s>(instructions: &Instructions<'s>) -> Instructions<'s> {
    let n = instructions.len();
    // Where each instruction (and the end) lands in the new list.
    let mut at = Vec::with_capacity(n + 1);
    let mut next = 0u32;
    for i in 0..n as u32 {
        at.push(next);
        next += match instructions.get(i) {
            Some(Instruction::EmitRaw(_)) => 2,
            _ => 1,
        };
    }
    at.push(next);
    let target = |t: &u32| at.get(*t as usize).copied().unwrap_or(*t);
    let mut out = Instructions::new(instructions.name(), instructions.source());
    for i in 0..n as u32 {
        let Some(instr) = instructions.get(i) else {
            continue;
        };
        let new: Vec<Instruction<'s>> = match instr {
            Instruction::EmitRaw(text) => {
                vec![
                    Instruction::LoadConst(Value::from(*text)),
                    Instruction::Emit,
                ]
            }
            Instruction::StringConcat => vec![Instruction::CallFunction(CONCAT, Some(2))],
            Instruction::Add => vec![Instruction::CallFunction(ADD, Some(2))],
            Instruction::Mul => vec![Instruction::CallFunction(MUL, Some(2))],
            Instruction::Jump(t) => vec![Instruction::Jump(target(t))],
            Instruction::JumpIfFalse(t) => vec![Instruction::JumpIfFalse(target(t))],
            Instruction::JumpIfFalseOrPop(t) => vec![Instruction::JumpIfFalseOrPop(target(t))],
            Instruction::JumpIfTrueOrPop(t) => vec![Instruction::JumpIfTrueOrPop(target(t))],
            Instruction::Iterate(t) => vec![Instruction::Iterate(target(t))],
            Instruction::BuildMacro(name, t, flags) => {
                vec![Instruction::BuildMacro(name, target(t), *flags)]
            }
            other => vec![other.clone()],
        };
        for instr in new {
            match (instructions.get_span(i), instructions.get_line(i)) {
                (Some(span), _) => out.add_with_span(instr, span),
                (None, Some(line)) => out.add_with_line(instr, line as u16),
                (None, None) => out.add(instr),
            };
        }
    }
    out
}

/// Counts what a render writes against [`MAX_SIZE`], then writes it as
/// minijinja does.
fn counting_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    let len = match value.as_str() {
        Some(s) => s.len(),
        None if value.is_undefined() || value.is_none() => 0,
        None => value.to_string().len(),
    };
    OUTPUT_LEFT.with(|left| match left.get().checked_sub(len) {
        Some(rest) => {
            left.set(rest);
            Ok(())
        }
        None => Err(too_large("output", MAX_SIZE - left.get() + len, MAX_SIZE)),
    })?;
    minijinja::escape_formatter(out, state, value)
}

fn text_len(value: &Value) -> usize {
    match value.as_str() {
        Some(s) => s.len(),
        None => value.to_string().len(),
    }
}

fn check_size(size: usize) -> Result<(), Error> {
    if size > MAX_SIZE {
        return Err(too_large("a string", size, MAX_SIZE));
    }
    Ok(())
}

fn check_items(items: usize) -> Result<(), Error> {
    if items > MAX_ITEMS {
        return Err(too_large("a list", items, MAX_ITEMS));
    }
    Ok(())
}

fn is_list(value: &Value) -> bool {
    matches!(value.kind(), ValueKind::Seq | ValueKind::Iterable)
}

/// `a ~ b`: minijinja's string concatenation (`format!("{a}{b}")`), after a
/// size check.
fn concat(a: &Value, b: &Value) -> Result<Value, Error> {
    let (a, b) = (text(a), text(b));
    check_size(a.len() + b.len())?;
    Ok(Value::from([a.as_str(), b.as_str()].concat()))
}

/// The text a value renders as in `~`.
fn text(value: &Value) -> String {
    match value.as_str() {
        Some(s) => s.to_owned(),
        None => value.to_string(),
    }
}

/// minijinja's own `a + b` or `a * b`, evaluated by an environment without
/// the rewrite (for what is not a string or a list).
fn plain(op: &'static str, a: &Value, b: &Value) -> Result<Value, Error> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    static EXPRS: OnceLock<[minijinja::Expression<'static, 'static>; 2]> = OnceLock::new();
    let env = ENV.get_or_init(Environment::empty);
    let exprs = EXPRS.get_or_init(|| {
        #[allow(clippy::expect_used)]
        ["a + b", "a * b"].map(|e| env.compile_expression(e).expect("a valid expression"))
    });
    let expr = if op == "+" { &exprs[0] } else { &exprs[1] };
    expr.eval(minijinja::context! { a => a, b => b })
}

/// `a + b`: strings and lists after a size check, the rest as minijinja
/// adds.
fn add(a: &Value, b: &Value) -> Result<Value, Error> {
    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
        check_size(x.len() + y.len())?;
    } else if is_list(a) && is_list(b) {
        check_items(a.len().unwrap_or(0) + b.len().unwrap_or(0))?;
    }
    plain("+", a, b)
}

/// `a * b`: a string or list repeated after a size check, the rest as
/// minijinja multiplies.
fn mul(a: &Value, b: &Value) -> Result<Value, Error> {
    for (x, n) in [(a, b), (b, a)] {
        let Some(n) = n.as_usize() else { continue };
        if let Some(s) = x.as_str() {
            check_size(s.len().saturating_mul(n))?;
        } else if is_list(x) {
            check_items(x.len().unwrap_or(0).saturating_mul(n))?;
        }
    }
    plain("*", a, b)
}

/// The size of `s` with every `old` replaced by `new` (at most `count`
/// times when given).
fn replaced_size(s: &str, old: &str, new: &str, count: Option<usize>) -> usize {
    if new.len() <= old.len() {
        return s.len();
    }
    let hits = if old.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(old).count()
    };
    let hits = count.map_or(hits, |c| hits.min(c));
    s.len()
        .saturating_add(hits.saturating_mul(new.len() - old.len()))
}

/// The `replace` filter, after a size check.
fn replace_filter(
    state: &State,
    value: StringInput<'_>,
    from: StringInput<'_>,
    to: StringInput<'_>,
) -> Result<Value, Error> {
    check_size(replaced_size(
        value.as_str(),
        from.as_str(),
        to.as_str(),
        None,
    ))?;
    minijinja::filters::replace(state, value, from, to)
}

/// The size of the items of `value` joined by `joiner`.
fn joined_size(value: &Value, joiner: usize) -> Result<usize, Error> {
    let mut size = 0usize;
    for (i, item) in value.try_iter()?.enumerate() {
        check_items(i)?;
        size = size.saturating_add(text_len(&item)).saturating_add(joiner);
        check_size(size)?;
    }
    Ok(size)
}

/// The `join` filter, after a size check.
fn join_filter(
    state: &State,
    value: &Value,
    joiner: Option<StringInput<'_>>,
) -> Result<Value, Error> {
    if !value.is_undefined() && !value.is_none() && value.as_str().is_none() {
        joined_size(value, joiner.as_ref().map_or(0, |j| j.as_str().len()))?;
    }
    minijinja::filters::join(state, value, joiner)
}

/// The `indent` filter, after a size check.
fn indent_filter(
    value: StringInput<'_>,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let pad = match width {
        Some(w) => w,
        None => kwargs.get::<Option<usize>>("width")?.unwrap_or(4),
    };
    let lines = value.as_str().lines().count() + 1;
    check_size(
        value
            .as_str()
            .len()
            .saturating_add(lines.saturating_mul(pad)),
    )?;
    minijinja::filters::indent(value, width, first, blank, kwargs)
}

/// A size check before the Python string methods that grow a string
/// (`str.replace`, `str.join`); `Ok(())` for the others.
pub(crate) fn check_method(value: &Value, method: &str, args: &[Value]) -> Result<(), Error> {
    let Some(s) = value.as_str() else {
        return Ok(());
    };
    match (method, args) {
        ("replace", [old, new, rest @ ..]) => {
            let count = rest
                .first()
                .and_then(|c| i64::try_from(c.clone()).ok())
                .and_then(|c| usize::try_from(c).ok());
            check_size(replaced_size(s, &text(old), &text(new), count))
        }
        ("join", [items]) => joined_size(items, s.len()).map(|_| ()),
        _ => Ok(()),
    }
}

/// Compiles `source` as the template `name` (a path, for errors).
pub(crate) fn compile<'s>(name: &'s str, source: &'s str) -> Result<CompiledTemplate<'s>, Error> {
    CompiledTemplate::new(name, source, &template_config())
}
