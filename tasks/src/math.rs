//! A verifier for math word problems with a numeric final answer (GSM8K,
//! MATH-style `\boxed{}` answers).
//!
//! [`extract_final_answer`] reads the final answer a text states and
//! normalises it to an exact rational ([`MathAnswer`]);
//! [`math_reward`] is 1 when the completion's answer equals the reference's.
//! The reference is read by the same rules, so a raw GSM8K reference
//! (reasoning, then `#### 72`) works as is.
//!
//! # Which number is the final answer
//!
//! The first rule that applies decides; later rules are not consulted.
//!
//! 1. **GSM8K marker.** When the text holds `####`, the answer is the first
//!    number after the *last* `####`. A marker with no number after it gives
//!    no answer (the marker is an explicit statement; no fallback).
//! 2. **Boxed answer.** Otherwise, when the text holds `\boxed{...}` or
//!    `\fbox{...}` (braces matched, so `\boxed{\frac{3}{4}}` works; `\{` and
//!    `\}` are skipped), the *last* box counts. Its whole content must be one
//!    number, optionally with units after it (`%`, `^\circ`, `\text{ cm}`, or
//!    words set off by a space: `18 dollars`). Otherwise (`\boxed{x+1}`,
//!    `\boxed{2x}`, `\boxed{3\sqrt{2}}`, `\boxed{}`) there is no answer: a
//!    non-numeric box does not fall back to a stray number elsewhere. A box
//!    whose brace is never closed is not a box.
//! 3. **Last number.** Otherwise, the last number in the text.
//!
//! # What a number is
//!
//! - Digits with an optional decimal part (`2.5`, `.5`); a `.` not followed
//!   by a digit ends the sentence (`is 42.`).
//! - Thousands separators: `,`, LaTeX `{,}` and `,\!` (`\!` is dropped
//!   everywhere). A group is taken only when the leading run has 1 to 3
//!   digits, does not start with `0`, and every group has exactly 3 digits
//!   not followed by a fourth: `1,234,567` is one number, `1,2` and
//!   `1,0000` are two.
//! - A sign: `-`, `+` or the Unicode minus `−` (U+2212), counted only when
//!   the character before it is not a letter, a digit or a closing bracket,
//!   so `10-3` reads as `10` and `3` while `= -3` and `{-3}` are negative.
//! - A currency `$` (or LaTeX `\$`) before the digits, with the sign on
//!   either side (`-$5`, `$-5`); what follows the digits (`%`, `\%`,
//!   `dollars`) is ignored, so `25%` is 25, not 0.25.
//! - Fractions: `a/b` with no spaces (`3/4`, `-3/4`, `1.5/3`) and
//!   `\frac{a}{b}` (also `\dfrac`, `\tfrac`, `\frac12`), whose parts are
//!   numbers themselves (nested `\frac` allowed, a few levels deep).
//!
//! Not supported: scientific notation, mixed numbers (`1 1/2` reads as
//! `1/2`), spaces as thousands separators, decimal commas, words
//! (`seventy-two`), and symbolic answers (`\sqrt{2}`, `\pi`).
//!
//! # Normalisation and failure
//!
//! Every number becomes a reduced fraction with a positive denominator, so
//! `3/4 == 0.75`, `2.50 == 2.5`, `3.0 == 3`, `-0 == 0` and `1,000 == 1000`.
//! Trailing zeros of a decimal are dropped before scaling. A number whose
//! numerator or denominator does not fit an `i128` (magnitudes up to
//! `i128::MAX`), or a fraction with a zero denominator, is no answer. When
//! the number a rule picks is such a number, the text has no answer (the
//! rule does not fall back to an earlier number). Nothing here panics on any
//! input, and `\frac` nesting is bounded, so no input can exhaust the stack.
//!
//! [`math_reward`] is 0 whenever either side has no answer, including when
//! both have none.

use std::fmt;

/// A normalised numeric answer: an exact rational, reduced, with a positive
/// denominator, so that equal values compare equal (`3/4 == 0.75`,
/// `1,000 == 1000`, `-0 == 0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MathAnswer {
    numerator: i128,
    denominator: i128,
}

impl MathAnswer {
    /// The numerator (carries the sign).
    pub fn numerator(&self) -> i128 {
        self.numerator
    }

    /// The denominator, always > 0.
    pub fn denominator(&self) -> i128 {
        self.denominator
    }

    /// `num / den`, reduced; None when `den` is 0 or a part overflows. The
    /// numerator is never `i128::MIN`, so negation and printing round-trip.
    fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let (n, d) = (num.unsigned_abs(), den.unsigned_abs());
        let g = gcd(n, d);
        let n = i128::try_from(n / g).ok()?;
        let d = i128::try_from(d / g).ok()?;
        let negative = (num < 0) != (den < 0);
        Some(Self {
            numerator: if negative { -n } else { n },
            denominator: d,
        })
    }

    fn neg(&self) -> Option<Self> {
        Self::new(self.numerator.checked_neg()?, self.denominator)
    }

    fn div(&self, other: &Self) -> Option<Self> {
        Self::new(
            self.numerator.checked_mul(other.denominator)?,
            self.denominator.checked_mul(other.numerator)?,
        )
    }
}

impl fmt::Display for MathAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.denominator == 1 {
            write!(f, "{}", self.numerator)
        } else {
            write!(f, "{}/{}", self.numerator, self.denominator)
        }
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    // gcd(0, 0): only reached with den == 0, which `new` rejects first.
    a.max(1)
}

/// The final answer a text states, normalised; None when it states no
/// number (see the module doc for the rules).
pub fn extract_final_answer(text: &str) -> Option<MathAnswer> {
    let text = preprocess(text);
    if let Some(pos) = text.rfind("####") {
        let tail: Vec<char> = text[pos + "####".len()..].chars().collect();
        return scan(&tail).into_iter().next()?.value;
    }
    let chars: Vec<char> = text.chars().collect();
    if let Some((start, end)) = last_box(&chars) {
        return boxed_value(&chars[start..end]);
    }
    scan(&chars).pop()?.value
}

/// 1.0 when the completion's final answer equals the reference's, else 0.0
/// (also when either states no number). The reference is read the same way
/// (e.g. GSM8K references "... #### 72").
pub fn math_reward(completion: &str, reference: &str) -> f32 {
    match (
        extract_final_answer(completion),
        extract_final_answer(reference),
    ) {
        (Some(got), Some(want)) if got == want => 1.0,
        _ => 0.0,
    }
}

/// Rewrites LaTeX and Unicode spellings to the plain ones the scanner reads.
fn preprocess(text: &str) -> String {
    text.replace('\u{2212}', "-")
        .replace("\\!", "")
        .replace("{,}", ",")
        .replace("\\$", "$")
        .replace("\\%", "%")
        .replace("\\dfrac", "\\frac")
        .replace("\\tfrac", "\\frac")
}

/// How deep `\frac` may nest inside `\frac`.
const MAX_FRAC_DEPTH: u8 = 4;

/// A number found in the text: its value (None when it overflows or divides
/// by zero) and the index just past it.
#[derive(Debug)]
struct Token {
    value: Option<MathAnswer>,
    end: usize,
}

fn starts_with(c: &[char], i: usize, pat: &str) -> bool {
    (i..).zip(pat.chars()).all(|(k, p)| c.get(k) == Some(&p))
}

fn is_digit(c: &[char], i: usize) -> bool {
    c.get(i).is_some_and(|ch| ch.is_ascii_digit())
}

/// Every number in the text, in order.
fn scan(c: &[char]) -> Vec<Token> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        if can_start(c, i)
            && let Some(tok) = parse_token(c, i, 0)
        {
            i = tok.end.max(i + 1);
            out.push(tok);
        } else {
            i += 1;
        }
    }
    out
}

/// Whether a sign or a leading `.` at `i` may begin a number.
fn can_start(c: &[char], i: usize) -> bool {
    let prev = i.checked_sub(1).and_then(|p| c.get(p)).copied();
    match c.get(i) {
        Some('-' | '+') => !prev.is_some_and(|p| p.is_alphanumeric() || ")]}".contains(p)),
        Some('.') => !prev.is_some_and(|p| p.is_alphanumeric()),
        _ => true,
    }
}

/// A number starting exactly at `start`: `[sign] [$ [sign]] unsigned`.
fn parse_token(c: &[char], start: usize, depth: u8) -> Option<Token> {
    let sign = |ch: Option<&char>| match ch {
        Some('-') => Some(true),
        Some('+') => Some(false),
        _ => None,
    };
    let mut i = start;
    let mut negative = false;
    let mut signed = false;
    if let Some(neg) = sign(c.get(i)) {
        negative = neg;
        signed = true;
        i += 1;
    }
    if c.get(i) == Some(&'$') {
        i += 1;
        while c.get(i) == Some(&' ') {
            i += 1;
        }
        if !signed && let Some(neg) = sign(c.get(i)) {
            negative = neg;
            i += 1;
        }
    }
    let tok = parse_unsigned(c, i, depth)?;
    let value = if negative {
        tok.value.and_then(|v| v.neg())
    } else {
        tok.value
    };
    Some(Token {
        value,
        end: tok.end,
    })
}

/// `\frac..`, or a literal with an optional `/literal`.
fn parse_unsigned(c: &[char], i: usize, depth: u8) -> Option<Token> {
    if starts_with(c, i, "\\frac") {
        return parse_frac(c, i + "\\frac".len(), depth);
    }
    let a = parse_literal(c, i)?;
    if c.get(a.end) == Some(&'/')
        && let Some(b) = parse_literal(c, a.end + 1)
    {
        let value = match (a.value, b.value) {
            (Some(x), Some(y)) => x.div(&y),
            _ => None,
        };
        return Some(Token { value, end: b.end });
    }
    Some(a)
}

/// The two arguments of `\frac` (from just after the command name).
fn parse_frac(c: &[char], i: usize, depth: u8) -> Option<Token> {
    if depth >= MAX_FRAC_DEPTH {
        return None;
    }
    let (num, i) = frac_arg(c, i, depth)?;
    let (den, end) = frac_arg(c, i, depth)?;
    let value = match (num, den) {
        (Some(x), Some(y)) => x.div(&y),
        _ => None,
    };
    Some(Token { value, end })
}

/// One `\frac` argument: `{number}` or a single digit. Returns its value
/// and the index after it; None when it is not a number.
fn frac_arg(c: &[char], mut i: usize, depth: u8) -> Option<(Option<MathAnswer>, usize)> {
    while c.get(i).is_some_and(|ch| ch.is_whitespace()) {
        i += 1;
    }
    if c.get(i) == Some(&'{') {
        let close = matching_brace(c, i, MAX_FRAC_ARG_CHARS)?;
        let value = parse_exact(c.get(i + 1..close)?, depth + 1)?;
        Some((value, close + 1))
    } else if is_digit(c, i) {
        let value = parse_exact(c.get(i..i + 1)?, depth + 1)?;
        Some((value, i + 1))
    } else {
        None
    }
}

/// The value when the whole of `c` (bar surrounding whitespace) is one
/// number; None when it is not.
fn parse_exact(c: &[char], depth: u8) -> Option<Option<MathAnswer>> {
    let start = c.iter().position(|ch| !ch.is_whitespace())?;
    let tok = parse_token(c, start, depth)?;
    let rest = c.get(tok.end..)?;
    rest.iter()
        .all(|ch| ch.is_whitespace())
        .then_some(tok.value)
}

/// Digits with optional thousands groups and decimal part, or `.digits`.
fn parse_literal(c: &[char], i: usize) -> Option<Token> {
    let mut digits = String::new();
    let mut j = i;
    while is_digit(c, j) {
        digits.extend(c.get(j));
        j += 1;
    }
    if (1..=3).contains(&digits.len()) && !digits.starts_with('0') {
        while c.get(j) == Some(&',')
            && (j + 1..j + 4).all(|k| is_digit(c, k))
            && !is_digit(c, j + 4)
        {
            digits.extend(c.get(j + 1..j + 4).unwrap_or_default());
            j += 4;
        }
    }
    let mut fraction = String::new();
    if c.get(j) == Some(&'.') && is_digit(c, j + 1) {
        j += 1;
        while is_digit(c, j) {
            fraction.extend(c.get(j));
            j += 1;
        }
    }
    if digits.is_empty() && fraction.is_empty() {
        return None;
    }
    Some(Token {
        value: decimal(&digits, &fraction),
        end: j,
    })
}

/// `int.fraction` as an exact rational; None on overflow.
fn decimal(int: &str, fraction: &str) -> Option<MathAnswer> {
    let fraction = fraction.trim_end_matches('0');
    let mut num: i128 = 0;
    for d in int.chars().chain(fraction.chars()) {
        num = num
            .checked_mul(10)?
            .checked_add(i128::from(d.to_digit(10)?))?;
    }
    let scale = u32::try_from(fraction.len()).ok()?;
    MathAnswer::new(num, 10i128.checked_pow(scale)?)
}

/// The longest `\frac` argument looked at: a numeric one is far shorter, and
/// the bound keeps scanning linear in the text's length.
const MAX_FRAC_ARG_CHARS: usize = 256;

/// The index of the `}` closing the `{` at `open`, looking at most `limit`
/// characters ahead; `\{` and `\}` are skipped.
fn matching_brace(c: &[char], open: usize, limit: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut k = open;
    while let Some(&ch) = c.get(k) {
        if k - open > limit {
            return None;
        }
        match ch {
            '\\' => k += 1,
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
        k += 1;
    }
    None
}

/// For each `{`, the index of its closing `}` (None when never closed);
/// `\{` and `\}` are skipped. One pass, so finding boxes stays linear.
fn brace_pairs(c: &[char]) -> Vec<Option<usize>> {
    let mut close = vec![None; c.len()];
    let mut open = Vec::new();
    let mut k = 0;
    while let Some(&ch) = c.get(k) {
        match ch {
            '\\' => k += 1,
            '{' => open.push(k),
            '}' => {
                if let Some(o) = open.pop()
                    && let Some(slot) = close.get_mut(o)
                {
                    *slot = Some(k);
                }
            }
            _ => {}
        }
        k += 1;
    }
    close
}

/// The content range of the last closed top-level `\boxed{}`/`\fbox{}`.
fn last_box(c: &[char]) -> Option<(usize, usize)> {
    let pairs = brace_pairs(c);
    let mut found = None;
    let mut i = 0;
    while i < c.len() {
        let name = ["\\boxed", "\\fbox"]
            .into_iter()
            .find(|name| starts_with(c, i, name));
        let Some(name) = name else {
            i += 1;
            continue;
        };
        let mut j = i + name.chars().count();
        if c.get(j).is_some_and(|ch| ch.is_alphabetic()) {
            i = j;
            continue;
        }
        while c.get(j).is_some_and(|ch| ch.is_whitespace()) {
            j += 1;
        }
        if c.get(j) == Some(&'{')
            && let Some(&Some(close)) = pairs.get(j)
        {
            found = Some((j + 1, close));
            i = close + 1;
        } else {
            i = j;
        }
    }
    found
}

/// A box's content: one number, optionally followed by units.
fn boxed_value(c: &[char]) -> Option<MathAnswer> {
    let start = c.iter().position(|ch| !ch.is_whitespace())?;
    let tok = parse_token(c, start, 0)?;
    let rest = c.get(tok.end..)?;
    if is_units(rest) { tok.value } else { None }
}

/// Whether what follows a boxed number is only units or punctuation
/// (`%`, `^\circ`, `\text{ cm}`, ` dollars`, `.`): no digits, operators or
/// other commands. Letters right after the number (`2x`) are not units.
fn is_units(rest: &[char]) -> bool {
    let s: String = rest.iter().collect();
    let trimmed = s.trim_start();
    let separated = trimmed.len() != s.len();
    if !separated && trimmed.chars().next().is_some_and(char::is_alphabetic) {
        return false;
    }
    let mut t = trimmed.to_owned();
    for cmd in [
        "\\textrm", "\\textbf", "\\text", "\\mbox", "\\mathrm", "\\circ", "\\quad", "\\,", "\\;",
        "\\ ",
    ] {
        t = t.replace(cmd, " ");
    }
    t.chars()
        .all(|ch| ch.is_alphabetic() || ch.is_whitespace() || "{}%°^.".contains(ch))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(completion: &str, reference: &str, want_reward: f32) {
        assert_eq!(
            math_reward(completion, reference),
            want_reward,
            "{completion:?} vs {reference:?}: got {:?} vs {:?}",
            extract_final_answer(completion).map(|a| a.to_string()),
            extract_final_answer(reference).map(|a| a.to_string()),
        );
    }

    const GSM8K_REFERENCE: &str = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n\
        Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72";

    #[test]
    fn reward_table() {
        let cases: &[(&str, &str, f32)] = &[
            // Thousands separators.
            ("1,000", "1000", 1.0),
            ("The total is 1,000 apples.", "#### 1000", 1.0),
            ("#### 1,234", "1234", 1.0),
            ("It is 1234.", "#### 1,234", 1.0),
            ("\\boxed{1,234,567}", "1234567", 1.0),
            ("\\$1{,}000", "1000", 1.0),
            ("10,\\!000", "10000", 1.0),
            ("$1,000.00", "1000", 1.0),
            ("1,2", "12", 0.0),
            ("1,2", "2", 1.0),
            ("\\boxed{1,2}", "12", 0.0),
            ("1,0000", "10000", 0.0),
            // Signs.
            ("-0", "0", 1.0),
            ("The answer is \\boxed{-0}", "#### 0", 1.0),
            ("+7", "7", 1.0),
            ("The temperature dropped to -5 degrees.", "-5", 1.0),
            ("The temperature dropped to -5 degrees.", "5", 0.0),
            ("The answer is \u{2212}5", "-5", 1.0),
            ("-$5", "-5", 1.0),
            ("10-3", "3", 1.0),
            ("10-3", "-3", 0.0),
            // Fractions and decimals.
            ("3/4", "0.75", 1.0),
            ("-3/4", "-0.75", 1.0),
            ("3/4", "-0.75", 0.0),
            ("0.1 + 0.2 = 0.3", "3/10", 1.0),
            ("So x = .5", "1/2", 1.0),
            ("2.50", "2.5", 1.0),
            ("3.0", "3", 1.0),
            (
                "2.5000000000000000000000000000000000000000000000000",
                "5/2",
                1.0,
            ),
            ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
            ("\\boxed{\\dfrac{3}{4}}", "#### 0.75", 1.0),
            ("\\tfrac{2}{4}", "1/2", 1.0),
            ("\\boxed{-\\frac{3}{4}}", "-3/4", 1.0),
            ("\\boxed{\\frac12}", "0.5", 1.0),
            ("\\boxed{\\frac{\\frac{1}{2}}{2}}", "0.25", 1.0),
            ("3/0", "0", 0.0),
            ("\\boxed{\\frac{1}{0}}", "0", 0.0),
            // Currency, percent, units, sentence ends.
            ("She paid $18.00.", "18", 1.0),
            ("That is 18 dollars", "#### 18", 1.0),
            ("The discount is 25%.", "25", 1.0),
            ("\\boxed{25\\%}", "25", 1.0),
            ("\\boxed{90^\\circ}", "90", 1.0),
            ("\\boxed{5 \\text{ cm}}", "5", 1.0),
            ("The answer is 42.", "42", 1.0),
            // Boxes.
            ("First \\boxed{3}, then corrected: \\boxed{5}", "5", 1.0),
            ("First \\boxed{3}, then corrected: \\boxed{5}", "3", 0.0),
            ("\\boxed{8} because 2 + 6 = 8, not 9", "8", 1.0),
            ("\\fbox{42}", "42", 1.0),
            ("\\boxed{}", "0", 0.0),
            ("\\boxed{x+1}", "1", 0.0),
            ("The value 7 appears, and \\boxed{x+1}", "7", 0.0),
            ("\\boxed{2x}", "2", 0.0),
            ("\\boxed{3\\sqrt{2}}", "3", 0.0),
            ("unclosed \\boxed{5", "5", 1.0),
            // GSM8K references and markers.
            (
                "Natalia sold 48 clips in April and 48 / 2 = 24 in May, \
                 so 48 + 24 = 72. The answer is 72.",
                GSM8K_REFERENCE,
                1.0,
            ),
            ("The answer is 24.", GSM8K_REFERENCE, 0.0),
            ("#### 5 \n but later I think it's 6", "5", 1.0),
            ("#### 3\n#### 4", "4", 1.0),
            ("5 #### ", "5", 0.0),
            // Position of the answer.
            ("We get 12 and then some text after.", "12", 1.0),
            (
                "Tom has 5 boxes of 12 apples. 5 * 12 = 60. So Tom has 60 apples.",
                "#### 60",
                1.0,
            ),
            (
                "Step 1: 4 + 4 = 8\nStep 2: 8 * 2 = 16\nFinal: 16",
                "#### 16",
                1.0,
            ),
            // No answer.
            ("I don't know.", "5", 0.0),
            ("", "5", 0.0),
            ("5", "", 0.0),
            ("", "", 0.0),
            // Overflow: no answer, no panic.
            (
                "123456789012345678901234567890123456789012345678901234567890",
                "123456789012345678901234567890123456789012345678901234567890",
                0.0,
            ),
            ("99999999999999999999999999999999999999999999/3", "1", 0.0),
            ("0.00000000000000000000000000000000000000000001", "0", 0.0),
            (
                "I had 7, then 999999999999999999999999999999999999999999",
                "7",
                0.0,
            ),
        ];
        assert!(cases.len() >= 45, "{}", cases.len());
        for &(completion, reference, want) in cases {
            check(completion, reference, want);
        }
    }

    fn shown(text: &str) -> Option<String> {
        extract_final_answer(text).map(|a| a.to_string())
    }

    #[test]
    fn extraction_normalises() {
        assert_eq!(shown("1,234,567").as_deref(), Some("1234567"));
        assert_eq!(shown("-3/4").as_deref(), Some("-3/4"));
        assert_eq!(shown("\\frac{6}{-3}").as_deref(), Some("-2"));
        assert_eq!(shown("-0").as_deref(), Some("0"));
        assert_eq!(shown("$-2.50").as_deref(), Some("-5/2"));
        let a = extract_final_answer("\\boxed{\\frac{6}{8}}").unwrap();
        assert_eq!((a.numerator(), a.denominator()), (3, 4));
        let a = extract_final_answer("\\frac{3}{-6}").unwrap();
        assert_eq!((a.numerator(), a.denominator()), (-1, 2));
    }

    #[test]
    fn extraction_gives_none() {
        for text in [
            "",
            "no number here",
            "\\boxed{x}",
            "\\boxed{}",
            "#### ",
            "1/0",
            "\\frac{x}{2} and \\boxed{\\frac{x}{2}}",
            "170141183460469231731687303715884105728",
        ] {
            assert_eq!(extract_final_answer(text), None, "{text:?}");
        }
    }

    #[test]
    fn extraction_reaches_i128_limits() {
        let max = i128::MAX.to_string();
        assert_eq!(shown(&max), Some(max.clone()));
        assert_eq!(shown(&format!("-{max}")), Some(format!("-{max}")));
    }

    #[test]
    fn deep_nesting_does_not_overflow_the_stack() {
        let deep = format!("{}1{}", "\\frac{".repeat(10_000), "}{2}".repeat(10_000));
        let _ = extract_final_answer(&deep);
        let boxes = format!("{}5{}", "\\boxed{".repeat(10_000), "}".repeat(10_000));
        assert_eq!(extract_final_answer(&boxes), None);
    }

    /// `n` with a `,` every three digits.
    fn with_separators(n: i64) -> String {
        let digits = n.unsigned_abs().to_string();
        let mut out = String::new();
        for (i, d) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(d);
        }
        if n < 0 { format!("-{out}") } else { out }
    }

    fn pieces() -> impl Strategy<Value = String> {
        let piece = prop::sample::select(vec![
            "\\boxed{",
            "\\fbox{",
            "\\frac",
            "\\dfrac",
            "{",
            "}",
            "####",
            "1",
            "0",
            "7",
            ",",
            ".",
            "/",
            "-",
            "\u{2212}",
            "+",
            "$",
            "\\$",
            "\\!",
            "{,}",
            "%",
            " ",
            "x",
            "\\",
            "99999999999999999999999",
        ]);
        prop::collection::vec(piece, 0..40).prop_map(|v| v.concat())
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_text(c in "\\PC*", r in "\\PC*") {
            let reward = math_reward(&c, &r);
            prop_assert!(reward == 0.0 || reward == 1.0);
        }

        #[test]
        fn answers_are_normalised_and_round_trip(text in pieces(), r in pieces()) {
            let _ = math_reward(&text, &r);
            if let Some(a) = extract_final_answer(&text) {
                prop_assert!(a.denominator() > 0);
                prop_assert_eq!(gcd(a.numerator().unsigned_abs(), a.denominator().unsigned_abs()), 1);
                prop_assert_eq!(extract_final_answer(&a.to_string()), Some(a));
            }
        }

        #[test]
        fn any_integer_matches_its_gsm8k_reference(n in any::<i64>()) {
            let sep = with_separators(n);
            prop_assert_eq!(math_reward(&format!("The answer is {n}"), &format!("#### {n}")), 1.0);
            prop_assert_eq!(math_reward(&format!("The answer is {sep}"), &format!("#### {n}")), 1.0);
            prop_assert_eq!(math_reward(&format!("The answer is {n}."), &format!("#### {sep}")), 1.0);
            prop_assert_eq!(math_reward(&format!("\\boxed{{{sep}}}"), &format!("#### {n}")), 1.0);
        }

        #[test]
        fn fractions_match_their_decimals(n in any::<i32>(), q in 1i32..100_000) {
            let frac = format!("\\boxed{{\\frac{{{n}}}{{{q}}}}}");
            prop_assert_eq!(math_reward(&frac, &format!("{n}/{q}")), 1.0);
            let cents = format!("{}{}.{:02}", if n < 0 { "-" } else { "" }, n.unsigned_abs() / 100, n.unsigned_abs() % 100);
            prop_assert_eq!(math_reward(&cents, &format!("\\frac{{{n}}}{{100}}")), 1.0);
        }
    }
}
