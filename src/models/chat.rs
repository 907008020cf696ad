//! Chat prompts: the checkpoint's Jinja chat template rendered with
//! `minijinja` ([`ChatTemplate`]), split into the template's own text and
//! the messages' text ([`ChatTemplate::render_segments`]) so that control
//! tokens come from the template only; and fixed ChatML helpers
//! ([`chatml_prompt`], SmolLM2-Instruct's [`smollm2_chat_prompt`]) for code
//! that needs ChatML without a checkpoint. Tokenising is
//! [`super::tokenizer`]'s job; this module imports nothing of the crate.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{bail, Error, Result};
use minijinja::machinery::{self, ast};
use minijinja::value::{Rest, Value, ValueKind};
use minijinja::{context, Environment, ErrorKind, State};
use serde::Serialize;

const OP: &str = "chat-template";

/// SmolLM2-Instruct's default system prompt, inserted by its chat template
/// when the conversation does not start with a system message.
pub const SMOLLM2_SYSTEM_PROMPT: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A piece of a rendered chat prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptSegment {
    /// Text the template wrote (`<|im_start|>user\n`): its control-token
    /// markers are the model's control tokens.
    Template(String),
    /// Text of a message, as the template inserted it (possibly trimmed):
    /// to be encoded as plain text, whatever markers it writes.
    Message(String),
}

/// The marker standing for message `k` in the probe rendering of
/// [`ChatTemplate::render_segments`]: Unicode noncharacters, which no text
/// is expected to contain (a message that does is refused).
fn placeholder(k: usize) -> String {
    format!("\u{FDD0}{k}\u{FDD1}")
}

/// Days since 1970-01-01 to (year, month 1..=12, day 1..=31), proleptic
/// Gregorian (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// (year, month 1..=12, day) to days since 1970-01-01 (H. Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
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
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats `unix_seconds` (UTC) with the strftime directives chat templates
/// use: `%Y %m %d %e %B %b %A %a %H %M %S %j %%`.
fn strftime(format: &str, unix_seconds: i64) -> std::result::Result<String, minijinja::Error> {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let day_of_year = days - days_from_civil(y, 1, 1) + 1;
    // 1970-01-01 was a Thursday (index 3, Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    // m is in 1..=12 (civil_from_days); weekday is in 0..7 (rem_euclid);
    // the month and weekday names are ASCII, so [..3] cuts at a character.
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------- bounds
//
// A chat template is untrusted input: it comes with the checkpoint. It is
// rendered within these bounds, each an error naming the bound:
//
// * instructions: minijinja's fuel ([`TEMPLATE_FUEL`]);
// * recursion: [`TEMPLATE_RECURSION_LIMIT`] nested macro calls, includes
//   and recursive loops;
// * output: [`MAX_OUTPUT_BASE_BYTES`] plus [`OUTPUT_BYTES_PER_MESSAGE_BYTE`]
//   per byte of the messages, written into a bounded buffer;
// * values built: minijinja bounds neither a string that `~`, `+`, `*` or
//   `%` builds (`s ~ s` sixty-four times is 2^64 bytes) nor what a filter
//   builds (`indent(10**9)`), nor what `{% set %}...{% endset %}` captures.
//   So the template is rewritten before it is compiled, from minijinja's own
//   parse: each `a ~ b`, `a + b`, `a * b` and `a % b` becomes a call of a
//   guard that estimates the result's size from its operands' (sizes are
//   measured up to the bytes left, so a shared or lazy value costs no more
//   than that) and charges it to the render's budget before computing it;
//   each `{{ expr }}` charges its value; each `{% for %}` charges its items
//   times the template text of its body; every filter and Python-style
//   method charges its arguments (times the width, count or replacement
//   that makes its result larger). The budget is
//   [`RENDER_BUDGET_BASE_BYTES`] plus [`RENDER_BUDGET_PER_MESSAGE_BYTE`] per
//   byte of the messages.
//
// What is not charged only reads values (comparisons, `in`, indexing,
// slicing, tests): each such instruction takes time linear in a value of at
// most the budget, and there are at most [`TEMPLATE_FUEL`] of them.

/// Instructions one rendering may execute (minijinja's fuel): real chat
/// templates use a few hundred per message.
pub const TEMPLATE_FUEL: u64 = 1_000_000;

/// Nested macro calls, includes and recursive loops one rendering may make.
pub const TEMPLATE_RECURSION_LIMIT: usize = 64;

/// The longest template source accepted, in bytes.
pub const MAX_TEMPLATE_BYTES: usize = 1 << 20;

/// Rendered output allowed whatever the messages, in bytes (1 MiB).
pub const MAX_OUTPUT_BASE_BYTES: usize = 1 << 20;

/// Rendered output allowed per byte of the messages' roles and contents.
pub const OUTPUT_BYTES_PER_MESSAGE_BYTE: usize = 4;

/// Bytes of values a rendering may build whatever the messages (16 MiB).
pub const RENDER_BUDGET_BASE_BYTES: usize = 16 << 20;

/// Bytes of values a rendering may build per byte of the messages' roles
/// and contents.
pub const RENDER_BUDGET_PER_MESSAGE_BYTE: usize = 16;

/// The prefix of the guard functions and of the budget's context variable;
/// a template that writes it is refused (it could shadow a guard).
const GUARD: &str = "__cpa_guard_";

/// Deepest value nesting measured; deeper values count as over the budget.
const MAX_VALUE_DEPTH: usize = 64;

/// The bytes of values one rendering may still build.
#[derive(Debug)]
struct Budget {
    limit: usize,
    used: AtomicUsize,
}

impl minijinja::value::Object for Budget {}

impl Budget {
    fn left(&self) -> usize {
        self.limit.saturating_sub(self.used.load(Ordering::Relaxed))
    }

    /// Charges `bytes`, or an error when they pass the limit.
    fn charge(&self, what: &str, bytes: usize) -> std::result::Result<(), minijinja::Error> {
        let before = self
            .used
            .fetch_add(bytes.min(usize::MAX / 2), Ordering::Relaxed);
        if before.saturating_add(bytes) > self.limit {
            self.used.store(self.limit, Ordering::Relaxed);
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "{what} would pass the budget of {} bytes of values one rendering may build",
                    self.limit
                ),
            ));
        }
        Ok(())
    }
}

/// The budget of the rendering `state` belongs to.
fn budget(state: &State) -> std::result::Result<Arc<Budget>, minijinja::Error> {
    state
        .lookup(&format!("{GUARD}budget"))
        .and_then(|v| v.downcast_object::<Budget>())
        .ok_or_else(|| minijinja::Error::new(ErrorKind::InvalidOperation, "no rendering budget"))
}

/// The size of `v` in bytes (strings) and items (one per item of a
/// sequence, iterable or map, plus theirs; one per other value), counted up
/// to a little past `cap`: a value shared many times, or a lazy one, costs
/// at most that much to measure.
fn size(v: &Value, cap: usize) -> usize {
    fn walk(v: &Value, cap: usize, depth: usize, total: &mut usize) {
        if *total > cap {
            return;
        }
        if depth > MAX_VALUE_DEPTH {
            *total = usize::MAX;
            return;
        }
        match v.kind() {
            ValueKind::String => *total = total.saturating_add(v.as_str().map_or(0, str::len)),
            ValueKind::Bytes => *total = total.saturating_add(v.as_bytes().map_or(0, <[u8]>::len)),
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
                let is_map = v.kind() == ValueKind::Map;
                let Ok(items) = v.try_iter() else {
                    *total = total.saturating_add(1);
                    return;
                };
                for item in items {
                    *total = total.saturating_add(1);
                    if is_map {
                        if let Ok(value) = v.get_item(&item) {
                            walk(&value, cap, depth + 1, total);
                        }
                    }
                    walk(&item, cap, depth + 1, total);
                    if *total > cap {
                        return;
                    }
                }
            }
            _ => *total = total.saturating_add(1),
        }
    }
    let mut total = 0;
    walk(v, cap, 0, &mut total);
    total
}

/// The largest decimal number written in `s` (a width or precision of a
/// format string makes a result that long), saturating.
fn largest_number(s: &str) -> usize {
    let mut best = 0usize;
    let mut cur: Option<usize> = None;
    for b in s.bytes().chain(std::iter::once(b' ')) {
        if b.is_ascii_digit() {
            let d = usize::from(b - b'0');
            cur = Some(cur.unwrap_or(0).saturating_mul(10).saturating_add(d));
        } else if let Some(n) = cur.take() {
            best = best.max(n);
        }
    }
    best
}

/// The largest non-negative integer among `args` (and the values of a
/// keyword-argument map among them), or 0.
fn largest_int(args: &[Value]) -> usize {
    let mut best = 0usize;
    let mut see = |v: &Value| {
        if v.is_integer() {
            best = best.max(
                v.as_usize()
                    .unwrap_or(if v.as_i64().is_some_and(|i| i < 0) {
                        0
                    } else {
                        usize::MAX
                    }),
            );
        }
    };
    for a in args {
        if a.kind() == ValueKind::Map {
            if let Ok(keys) = a.try_iter() {
                for k in keys.take(16) {
                    if let Ok(v) = a.get_item(&k) {
                        see(&v);
                    }
                }
            }
        } else {
            see(a);
        }
    }
    best
}

/// Filters whose result can be the arguments' size times an integer
/// argument (a width, an indent, a count).
const SCALED_BY_INT: [&str; 5] = ["indent", "tojson", "batch", "slice", "center"];

/// The builtin filters, each charged its arguments' size (see
/// [`filter_estimate`]) before it runs.
fn builtin_filters() -> Vec<(&'static str, Value)> {
    use minijinja::filters as f;
    let mut v: Vec<(&'static str, Value)> = vec![
        ("safe", Value::from_function(f::safe)),
        ("escape", Value::from_function(f::escape)),
        ("e", Value::from_function(f::escape)),
        ("lower", Value::from_function(f::lower)),
        ("upper", Value::from_function(f::upper)),
        ("title", Value::from_function(f::title)),
        ("capitalize", Value::from_function(f::capitalize)),
        ("replace", Value::from_function(f::replace)),
        ("length", Value::from_function(f::length)),
        ("count", Value::from_function(f::length)),
        ("dictsort", Value::from_function(f::dictsort)),
        ("items", Value::from_function(f::items)),
        ("reverse", Value::from_function(f::reverse)),
        ("trim", Value::from_function(f::trim)),
        ("join", Value::from_function(f::join)),
        ("split", Value::from_function(f::split)),
        ("lines", Value::from_function(f::lines)),
        ("default", Value::from_function(f::default)),
        ("d", Value::from_function(f::default)),
        ("round", Value::from_function(f::round)),
        ("abs", Value::from_function(f::abs)),
        ("int", Value::from_function(f::int)),
        ("float", Value::from_function(f::float)),
        ("attr", Value::from_function(f::attr)),
        ("first", Value::from_function(f::first)),
        ("last", Value::from_function(f::last)),
        ("min", Value::from_function(f::min)),
        ("max", Value::from_function(f::max)),
        ("sort", Value::from_function(f::sort)),
        ("list", Value::from_function(f::list)),
        ("string", Value::from_function(f::string)),
        ("bool", Value::from_function(f::bool)),
        ("batch", Value::from_function(f::batch)),
        ("slice", Value::from_function(f::slice)),
        ("sum", Value::from_function(f::sum)),
        ("indent", Value::from_function(f::indent)),
        ("select", Value::from_function(f::select)),
        ("reject", Value::from_function(f::reject)),
        ("selectattr", Value::from_function(f::selectattr)),
        ("rejectattr", Value::from_function(f::rejectattr)),
        ("map", Value::from_function(f::map)),
        ("groupby", Value::from_function(f::groupby)),
        ("unique", Value::from_function(f::unique)),
        ("chain", Value::from_function(f::chain)),
        ("zip", Value::from_function(f::zip)),
        ("pprint", Value::from_function(f::pprint)),
        ("format", Value::from_function(f::format)),
        ("tojson", Value::from_function(f::tojson)),
    ];
    v.shrink_to_fit();
    v
}

/// What filter `name` may build from `args`, in bytes: their size (times 6
/// for escaping and printing, which grow text), times the integer argument
/// of the filters that scale by one, times the replacement of `replace`,
/// plus the widths of a `format` string.
fn filter_estimate(name: &str, args: &[Value], cap: usize) -> usize {
    let inputs = args
        .iter()
        .fold(0usize, |t, a| t.saturating_add(size(a, cap)));
    let mut est = inputs.saturating_mul(6).saturating_add(16);
    if SCALED_BY_INT.contains(&name) {
        est = est.saturating_mul(largest_int(args).saturating_add(1));
    }
    if name == "replace" {
        let new = args.get(2).map_or(0, |a| size(a, cap));
        est = est.saturating_mul(new.saturating_add(1));
    }
    if name == "format" {
        let widths = args
            .first()
            .and_then(Value::as_str)
            .map_or(0, largest_number);
        est = est.saturating_add(widths.saturating_mul(args.len()));
    }
    est
}

/// What Python-style method `method` of `value` may build from `args`.
fn method_estimate(value: &Value, method: &str, args: &[Value], cap: usize) -> usize {
    let own = size(value, cap);
    let inputs = args.iter().fold(own, |t, a| t.saturating_add(size(a, cap)));
    let mut est = inputs.saturating_mul(2).saturating_add(16);
    match method {
        "replace" => {
            let new = args.get(1).map_or(0, |a| size(a, cap));
            est = est.saturating_mul(new.saturating_add(1));
        }
        "join" => {
            let items = args.first().map_or(0, |a| size(a, cap));
            est = est.saturating_add(items.saturating_mul(own.saturating_add(1)));
        }
        "format" | "center" | "ljust" | "rjust" | "zfill" => {
            let widths = value.as_str().map_or(0, largest_number);
            est = est
                .saturating_add(widths.saturating_mul(args.len() + 1))
                .saturating_add(largest_int(args).saturating_mul(2));
        }
        _ => {}
    }
    est
}

/// What `a op b` may build: the operands' sizes, times the count of a
/// repetition, plus the widths of a `%` format string; non-string operands
/// are printed, so their size counts 4 times.
fn binop_estimate(op: &str, a: &Value, b: &Value, cap: usize) -> usize {
    let (sa, sb) = (size(a, cap), size(b, cap));
    let printed = |v: &Value, s: usize| {
        if v.kind() == ValueKind::String {
            s
        } else {
            s.saturating_mul(4).saturating_add(8)
        }
    };
    match op {
        "*" => {
            let repeat = |x: &Value, sx: usize, n: &Value| {
                (matches!(
                    x.kind(),
                    ValueKind::String | ValueKind::Seq | ValueKind::Iterable
                ) && n.is_integer())
                .then(|| sx.saturating_mul(n.as_usize().unwrap_or(0)))
            };
            repeat(a, sa, b)
                .or_else(|| repeat(b, sb, a))
                .unwrap_or_else(|| sa.saturating_add(sb))
        }
        "%" => {
            let widths = a.as_str().map_or(0, largest_number);
            printed(a, sa)
                .saturating_add(printed(b, sb))
                .saturating_add(widths.saturating_mul(sb.saturating_add(1)))
        }
        _ => printed(a, sa).saturating_add(printed(b, sb)),
    }
}

/// A writer into memory that refuses to pass `max` bytes.
struct BoundedWriter {
    buf: Vec<u8>,
    max: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.max {
            self.overflowed = true;
            return Err(std::io::Error::other("output bound reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Edits of a template's source (see the bounds above): insertions and
/// operator replacements at byte offsets of the source.
struct Rewriter<'s> {
    src: &'s str,
    /// (offset, end of the replaced text, order key, text).
    edits: Vec<(usize, usize, i64, String)>,
    /// The next preorder index.
    next: i64,
}

impl<'s> Rewriter<'s> {
    fn span_of(e: &ast::Expr) -> (usize, usize) {
        let s = e.span();
        (s.start_offset as usize, s.end_offset as usize)
    }

    /// The byte range of `e` and everything below it.
    fn extent(e: &ast::Expr) -> (usize, usize) {
        let mut r = Self::span_of(e);
        // The spans of these start at the token before them (minijinja's
        // parser takes the last span); their first token is their first
        // child's.
        if matches!(e, ast::Expr::IfExpr(_) | ast::Expr::Compare(_)) {
            r.0 = usize::MAX;
        }
        let mut join = |c: &ast::Expr| {
            let (s, t) = Self::extent(c);
            r = (r.0.min(s), r.1.max(t));
        };
        Self::children(e, &mut join);
        r
    }

    /// Calls `f` on each expression directly below `e`.
    fn children<'a>(e: &'a ast::Expr<'a>, f: &mut dyn FnMut(&'a ast::Expr<'a>)) {
        let args = |args: &'a [ast::CallArg<'a>], f: &mut dyn FnMut(&'a ast::Expr<'a>)| {
            for a in args {
                match a {
                    ast::CallArg::Pos(x)
                    | ast::CallArg::Kwarg(_, x)
                    | ast::CallArg::PosSplat(x)
                    | ast::CallArg::KwargSplat(x) => f(x),
                }
            }
        };
        match e {
            ast::Expr::Var(_) | ast::Expr::Const(_) => {}
            ast::Expr::Slice(s) => {
                f(&s.expr);
                for x in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    f(x);
                }
            }
            ast::Expr::UnaryOp(u) => f(&u.expr),
            ast::Expr::BinOp(b) => {
                f(&b.left);
                f(&b.right);
            }
            ast::Expr::Compare(c) => {
                f(&c.expr);
                for op in &c.ops {
                    f(&op.expr);
                }
            }
            ast::Expr::IfExpr(i) => {
                f(&i.test_expr);
                f(&i.true_expr);
                if let Some(x) = &i.false_expr {
                    f(x);
                }
            }
            ast::Expr::Filter(x) => {
                if let Some(e) = &x.expr {
                    f(e);
                }
                args(&x.args, f);
            }
            ast::Expr::Test(t) => {
                f(&t.expr);
                args(&t.args, f);
            }
            ast::Expr::GetAttr(g) => f(&g.expr),
            ast::Expr::GetItem(g) => {
                f(&g.expr);
                f(&g.subscript_expr);
            }
            ast::Expr::Call(c) => {
                f(&c.expr);
                args(&c.args, f);
            }
            ast::Expr::List(l) => l.items.iter().for_each(f),
            ast::Expr::Map(m) => {
                for (k, v) in m.keys.iter().zip(&m.values) {
                    f(k);
                    f(v);
                }
            }
        }
    }

    /// The source range of `e` with the parentheses its first operand
    /// opened (a filter's span starts at its name, and a parenthesised
    /// operand's span inside its parentheses).
    fn range(&self, e: &ast::Expr) -> Result<(usize, usize)> {
        let (mut start, end) = Self::extent(e);
        let text = self.src.get(start..end).unwrap_or("");
        // Closing parentheses in `text` with no opening one in it.
        let mut depth = 0usize;
        let mut unmatched = 0usize;
        let mut quote: Option<u8> = None;
        let mut escaped = false;
        for b in text.bytes() {
            if let Some(q) = quote {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == q {
                    quote = None;
                }
                continue;
            }
            match b {
                b'\'' | b'"' => quote = Some(b),
                b'(' => depth += 1,
                b')' if depth == 0 => unmatched += 1,
                b')' => depth -= 1,
                _ => {}
            }
        }
        let bytes = self.src.as_bytes();
        for _ in 0..unmatched {
            while start > 0 && bytes[start - 1].is_ascii_whitespace() {
                start -= 1;
            }
            if start == 0 || bytes[start - 1] != b'(' {
                bail!("{OP}: cannot bound the expression at byte {start} of the template");
            }
            start -= 1;
        }
        Ok((start, end))
    }

    fn wrap(&mut self, (start, end): (usize, usize), open: String, close: String) {
        let key = self.next;
        self.next += 1;
        // Openers at one offset: outer first; closers: inner first.
        self.edits.push((start, start, key, open));
        self.edits.push((end, end, -key, close));
    }

    fn expr(&mut self, e: &ast::Expr) -> Result<()> {
        if let ast::Expr::BinOp(b) = e {
            let op = match b.op {
                ast::BinOpKind::Add => Some('+'),
                ast::BinOpKind::Mul => Some('*'),
                ast::BinOpKind::Concat => Some('~'),
                ast::BinOpKind::Rem => Some('%'),
                _ => None,
            };
            if let Some(op) = op {
                let whole = self.range(e)?;
                let left_end = Self::extent(&b.left).1;
                let right_start = self.range(&b.right)?.0;
                let gap = self.src.get(left_end..right_start).unwrap_or("");
                let Some(at) = gap.find(op) else {
                    bail!("{OP}: cannot find the operator {op} at byte {left_end} of the template");
                };
                let key = self.next;
                self.wrap(whole, format!("{GUARD}binop('{op}', ("), "))".to_string());
                let at = left_end + at;
                self.edits.push((at, at + 1, key, "), (".to_string()));
            }
        }
        let mut result = Ok(());
        Self::children(e, &mut |c| {
            if result.is_ok() {
                result = self.expr(c);
            }
        });
        result
    }

    fn call(&mut self, c: &ast::Call) -> Result<()> {
        self.expr(&c.expr)?;
        for a in &c.args {
            match a {
                ast::CallArg::Pos(x)
                | ast::CallArg::Kwarg(_, x)
                | ast::CallArg::PosSplat(x)
                | ast::CallArg::KwargSplat(x) => self.expr(x)?,
            }
        }
        Ok(())
    }

    /// Bytes of template text in `body`, nested blocks included.
    fn raw_bytes(body: &[ast::Stmt]) -> usize {
        let mut n = 0usize;
        for s in body {
            n = n.saturating_add(match s {
                ast::Stmt::EmitRaw(r) => r.raw.len(),
                ast::Stmt::Template(t) => Self::raw_bytes(&t.children),
                ast::Stmt::ForLoop(f) => {
                    Self::raw_bytes(&f.body).saturating_add(Self::raw_bytes(&f.else_body))
                }
                ast::Stmt::IfCond(i) => {
                    Self::raw_bytes(&i.true_body).saturating_add(Self::raw_bytes(&i.false_body))
                }
                ast::Stmt::WithBlock(w) => Self::raw_bytes(&w.body),
                ast::Stmt::SetBlock(s) => Self::raw_bytes(&s.body),
                ast::Stmt::AutoEscape(a) => Self::raw_bytes(&a.body),
                ast::Stmt::FilterBlock(f) => Self::raw_bytes(&f.body),
                ast::Stmt::Block(b) => Self::raw_bytes(&b.body),
                ast::Stmt::Macro(m) => Self::raw_bytes(&m.body),
                ast::Stmt::CallBlock(c) => Self::raw_bytes(&c.macro_decl.body),
                _ => 0,
            });
        }
        n
    }

    fn stmts(&mut self, body: &[ast::Stmt]) -> Result<()> {
        body.iter().try_for_each(|s| self.stmt(s))
    }

    fn stmt(&mut self, s: &ast::Stmt) -> Result<()> {
        match s {
            ast::Stmt::Template(t) => self.stmts(&t.children),
            ast::Stmt::EmitExpr(e) => {
                let r = self.range(&e.expr)?;
                self.wrap(r, format!("{GUARD}emit("), ")".to_string());
                self.expr(&e.expr)
            }
            ast::Stmt::EmitRaw(_) | ast::Stmt::Continue(_) | ast::Stmt::Break(_) => Ok(()),
            ast::Stmt::ForLoop(f) => {
                let raw = Self::raw_bytes(&f.body).saturating_add(Self::raw_bytes(&f.else_body));
                let r = self.range(&f.iter)?;
                self.wrap(r, format!("{GUARD}iter("), format!(", {raw})"));
                self.expr(&f.iter)?;
                if let Some(x) = &f.filter_expr {
                    self.expr(x)?;
                }
                self.stmts(&f.body)?;
                self.stmts(&f.else_body)
            }
            ast::Stmt::IfCond(i) => {
                self.expr(&i.expr)?;
                self.stmts(&i.true_body)?;
                self.stmts(&i.false_body)
            }
            ast::Stmt::WithBlock(w) => {
                for (_, x) in &w.assignments {
                    self.expr(x)?;
                }
                self.stmts(&w.body)
            }
            ast::Stmt::Set(x) => self.expr(&x.expr),
            ast::Stmt::SetBlock(x) => {
                if let Some(f) = &x.filter {
                    self.expr(f)?;
                }
                self.stmts(&x.body)
            }
            ast::Stmt::AutoEscape(a) => {
                self.expr(&a.enabled)?;
                self.stmts(&a.body)
            }
            ast::Stmt::FilterBlock(f) => {
                self.expr(&f.filter)?;
                self.stmts(&f.body)
            }
            ast::Stmt::Block(b) => self.stmts(&b.body),
            ast::Stmt::Import(i) => {
                self.expr(&i.expr)?;
                self.expr(&i.name)
            }
            ast::Stmt::FromImport(i) => self.expr(&i.expr),
            ast::Stmt::Extends(x) => self.expr(&x.name),
            ast::Stmt::Include(x) => self.expr(&x.name),
            ast::Stmt::Macro(m) => {
                for d in &m.defaults {
                    self.expr(d)?;
                }
                self.stmts(&m.body)
            }
            ast::Stmt::CallBlock(c) => {
                self.call(&c.call)?;
                for d in &c.macro_decl.defaults {
                    self.expr(d)?;
                }
                self.stmts(&c.macro_decl.body)
            }
            ast::Stmt::Do(d) => self.call(&d.call),
        }
    }

    /// The source with the edits applied.
    fn finish(mut self) -> Result<String> {
        self.edits.sort_by_key(|e| (e.0, e.1 > e.0, e.2));
        let mut out = String::with_capacity(self.src.len() * 2);
        let mut pos = 0;
        for (start, end, _, text) in &self.edits {
            if *start < pos {
                bail!("{OP}: overlapping edits at byte {start} of the template");
            }
            match self.src.get(pos..*start) {
                Some(t) => out.push_str(t),
                None => bail!("{OP}: an edit at byte {start} is not at a character boundary"),
            }
            out.push_str(text);
            pos = *end;
        }
        out.push_str(self.src.get(pos..).unwrap_or(""));
        Ok(out)
    }
}

/// The template `source` with the guards of the bounds above inserted.
fn guarded_source(source: &str) -> Result<String> {
    if source.len() > MAX_TEMPLATE_BYTES {
        bail!(
            "{OP}: the template has {} bytes, more than the {MAX_TEMPLATE_BYTES} accepted",
            source.len()
        );
    }
    if source.contains(GUARD) {
        bail!("{OP}: the template writes {GUARD}, a name reserved for the renderer's guards");
    }
    let ws = machinery::WhitespaceConfig {
        keep_trailing_newline: false,
        lstrip_blocks: true,
        trim_blocks: true,
    };
    let ast = machinery::parse(source, "chat", Default::default(), ws)
        .map_err(|e| Error::msg(format!("{OP}: parsing the template: {e:#}")))?;
    let mut rw = Rewriter {
        src: source,
        edits: Vec::new(),
        next: 1,
    };
    rw.stmt(&ast)?;
    rw.finish()
}

/// A checkpoint's chat template (Hugging Face's Jinja format: a
/// `messages` list of `{role, content}`, `add_generation_prompt`,
/// `bos_token`, `eos_token`), rendered with `minijinja` as `transformers`
/// renders it: `trim_blocks` and `lstrip_blocks` on, Python string and dict
/// methods (`.strip()`, `.startswith()`, `.items()`, ...), and the
/// `raise_exception(message)` and `strftime_now(format)` functions (UTC).
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Parses `source`; `bos_token` and `eos_token` are the texts the
    /// template may write for them (`<bos>`, `<|im_end|>`).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let guarded = guarded_source(source)?;
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
        env.set_unknown_method_callback(|state, value, method, args| {
            let budget = budget(state)?;
            let est = method_estimate(value, method, args, budget.left());
            budget.charge(&format!("method {method}"), est)?;
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
        });
        for (name, filter) in builtin_filters() {
            env.add_filter(
                name,
                move |state: &State,
                      args: Rest<Value>|
                      -> std::result::Result<Value, minijinja::Error> {
                    let budget = budget(state)?;
                    let est = filter_estimate(name, &args, budget.left());
                    budget.charge(&format!("filter {name}"), est)?;
                    filter.call(state, &args)
                },
            );
        }
        // The operators' own semantics, run once the guard has charged them.
        let ops = Arc::new(Environment::new());
        env.add_function(
            format!("{GUARD}binop"),
            move |state: &State,
                  op: String,
                  a: Value,
                  b: Value|
                  -> std::result::Result<Value, minijinja::Error> {
                let budget = budget(state)?;
                let est = binop_estimate(&op, &a, &b, budget.left());
                budget.charge(&format!("`{op}`"), est)?;
                let expr = match op.as_str() {
                    "+" => "a + b",
                    "*" => "a * b",
                    "~" => "a ~ b",
                    "%" => "a % b",
                    _ => {
                        return Err(minijinja::Error::new(
                            ErrorKind::InvalidOperation,
                            format!("no guarded operator {op}"),
                        ))
                    }
                };
                ops.compile_expression(expr)?
                    .eval(context! { a => a, b => b })
            },
        );
        env.add_function(
            format!("{GUARD}emit"),
            |state: &State, v: Value| -> std::result::Result<Value, minijinja::Error> {
                let budget = budget(state)?;
                let n = size(&v, budget.left());
                let est = if v.kind() == ValueKind::String {
                    n
                } else {
                    n.saturating_mul(4).saturating_add(8)
                };
                budget.charge("an emitted value", est)?;
                Ok(v)
            },
        );
        env.add_function(
            format!("{GUARD}iter"),
            |state: &State, v: Value, raw: usize| -> std::result::Result<Value, minijinja::Error> {
                let budget = budget(state)?;
                let items = size(&v, budget.left());
                budget.charge("a loop", items.saturating_mul(raw.max(1)))?;
                Ok(v)
            },
        );
        env.add_function(
            "debug",
            || -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "debug() is not available in chat templates",
                ))
            },
        );
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |format: String| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            strftime(&format, now)
        });
        env.add_template_owned("chat", guarded)
            .map_err(|e| Error::msg(format!("{OP}: parsing the template: {e:#}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages`, ending with the assistant's turn opening when
    /// `add_generation_prompt`.
    ///
    /// The rendering is bounded (see [`TEMPLATE_FUEL`],
    /// [`TEMPLATE_RECURSION_LIMIT`], [`MAX_OUTPUT_BASE_BYTES`] and
    /// [`RENDER_BUDGET_BASE_BYTES`]): a template that passes a bound is an
    /// error naming it.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| Error::msg(format!("{OP}: {e:#}")))?;
        let message_bytes = messages.iter().fold(0usize, |t, m| {
            t.saturating_add(m.role.len() + m.content.len())
        });
        let budget = Arc::new(Budget {
            limit: RENDER_BUDGET_BASE_BYTES
                .saturating_add(message_bytes.saturating_mul(RENDER_BUDGET_PER_MESSAGE_BYTE)),
            used: AtomicUsize::new(0),
        });
        let mut out = BoundedWriter {
            buf: Vec::new(),
            max: MAX_OUTPUT_BASE_BYTES
                .saturating_add(message_bytes.saturating_mul(OUTPUT_BYTES_PER_MESSAGE_BYTE)),
            overflowed: false,
        };
        let rendered = template.render_captured_to(
            context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                __cpa_guard_budget => Value::from_dyn_object(budget),
            },
            &mut out,
        );
        let n = messages.len();
        match rendered {
            Ok(_) => {}
            Err(_) if out.overflowed => bail!(
                "{OP}: rendering {n} messages: the output passed its bound of {} bytes",
                out.max
            ),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => bail!(
                "{OP}: rendering {n} messages: the template ran more than {TEMPLATE_FUEL} instructions (out of fuel)"
            ),
            Err(e) => bail!("{OP}: rendering {n} messages: {e:#}"),
        }
        String::from_utf8(out.buf).map_err(|e| {
            Error::msg(format!(
                "{OP}: rendering {n} messages: the output is not UTF-8: {e}"
            ))
        })
    }

    /// Renders `messages` as [`render`](Self::render) does, split into the
    /// template's text and the messages' text, so that markers written in a
    /// message can be encoded as plain text.
    ///
    /// The template is rendered twice: with the messages, and with each
    /// message's content replaced by a placeholder. The placeholders split
    /// the second rendering into the template's pieces; the first rendering
    /// must be those pieces with each message's content in place of its
    /// placeholder, as written or trimmed (templates `| trim` the content).
    /// A template that rewrites content otherwise, or whose output depends
    /// on it, cannot be split and is an error naming the message.
    pub fn render_segments(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<PromptSegment>> {
        if let Some(k) = messages
            .iter()
            .position(|m| m.content.contains(['\u{FDD0}', '\u{FDD1}']))
        {
            bail!("{OP}: message {k} contains the noncharacter U+FDD0 or U+FDD1, which marks message text while rendering");
        }
        let full = self.render(messages, add_generation_prompt)?;
        let probe: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(k, m)| ChatMessage {
                role: m.role.clone(),
                content: placeholder(k),
            })
            .collect();
        let masked = self.render(&probe, add_generation_prompt)?;
        // The probe's pieces: template text, then (message, template text)...
        enum Piece<'a> {
            Text(&'a str),
            Message(usize),
        }
        let mut pieces = Vec::new();
        let mut rest = masked.as_str();
        while let Some(start) = rest.find('\u{FDD0}') {
            pieces.push(Piece::Text(&rest[..start]));
            let after = &rest[start + '\u{FDD0}'.len_utf8()..];
            let Some(end) = after.find('\u{FDD1}') else {
                bail!("{OP}: the template cut a message placeholder apart");
            };
            let k: usize = match after[..end].parse() {
                Ok(k) if k < messages.len() => k,
                _ => bail!("{OP}: the template rewrote a message placeholder"),
            };
            pieces.push(Piece::Message(k));
            rest = &after[end + '\u{FDD1}'.len_utf8()..];
        }
        pieces.push(Piece::Text(rest));
        let mut segments = Vec::new();
        // `pos` only moves past text of `full` that was matched, so it stays
        // a character boundary of `full`, at most its length.
        let mut pos = 0;
        for (i, piece) in pieces.iter().enumerate() {
            match *piece {
                Piece::Text(t) => {
                    if !full[pos..].starts_with(t) {
                        bail!("{OP}: the template writes different text around the messages than around placeholders; it cannot be split into template and message text");
                    }
                    match segments.last_mut() {
                        // After an empty message: one piece of template text.
                        Some(PromptSegment::Template(prev)) => prev.push_str(t),
                        _ if t.is_empty() => {}
                        _ => segments.push(PromptSegment::Template(t.to_string())),
                    }
                    pos += t.len();
                }
                Piece::Message(k) => {
                    let c = messages[k].content.as_str();
                    // Pieces alternate text and messages, text first and last.
                    let next = match pieces.get(i + 1) {
                        Some(Piece::Text(t)) => *t,
                        _ => bail!(
                            "{OP}: the template wrote two placeholders without text between them"
                        ),
                    };
                    let is_final = i + 2 == pieces.len();
                    let fits = |cand: &str| {
                        let after = pos + cand.len();
                        full[pos..].starts_with(cand)
                            && if is_final {
                                full.get(after..) == Some(next)
                            } else {
                                full.get(after..).is_some_and(|r| r.starts_with(next))
                            }
                    };
                    let Some(cand) = [c, c.trim(), c.trim_start(), c.trim_end()]
                        .into_iter()
                        .find(|cand| fits(cand))
                    else {
                        bail!("{OP}: the template rewrites the text of message {k} (role {}) beyond trimming it; it cannot be split into template and message text", messages[k].role);
                    };
                    if !cand.is_empty() {
                        segments.push(PromptSegment::Message(cand.to_string()));
                    }
                    pos += cand.len();
                }
            }
        }
        if pos != full.len() {
            bail!("{OP}: the rendered prompt is longer than its template and message pieces; it cannot be split");
        }
        Ok(segments)
    }
}

/// The concatenated text of `segments`: the rendered prompt.
pub fn segments_text(segments: &[PromptSegment]) -> String {
    segments
        .iter()
        .map(|s| match s {
            PromptSegment::Template(t) | PromptSegment::Message(t) => t.as_str(),
        })
        .collect()
}

/// Formats a conversation as ChatML:
/// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, with
/// `default_system` first when the first message is not a system message,
/// and `<|im_start|>assistant\n` at the end when `add_generation_prompt`.
/// With `default_system = Some(SMOLLM2_SYSTEM_PROMPT)` this is
/// SmolLM2-Instruct's chat template.
pub fn chatml_prompt(
    messages: &[ChatMessage],
    default_system: Option<&str>,
    add_generation_prompt: bool,
) -> String {
    let mut out = String::new();
    let starts_with_system = messages.first().is_some_and(|m| m.role == "system");
    if let (false, Some(system)) = (starts_with_system, default_system) {
        out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
    }
    for m in messages {
        out.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

/// SmolLM2-Instruct's prompt for one user message.
pub fn smollm2_chat_prompt(user: &str) -> String {
    chatml_prompt(
        &[ChatMessage::new("user", user)],
        Some(SMOLLM2_SYSTEM_PROMPT),
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's `tokenizer.chat_template`.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template_is_chatml_with_default_system() {
        assert_eq!(
            smollm2_chat_prompt("Hi"),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let own_system = chatml_prompt(
            &[
                ChatMessage::new("system", "S"),
                ChatMessage::new("user", "U"),
            ],
            Some(SMOLLM2_SYSTEM_PROMPT),
            false,
        );
        assert_eq!(
            own_system,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        for (messages, gen) in [
            (vec![ChatMessage::new("user", "Hi")], true),
            (
                vec![
                    ChatMessage::new("system", "S"),
                    ChatMessage::new("user", "U"),
                ],
                false,
            ),
        ] {
            assert_eq!(
                t.render(&messages, gen).unwrap(),
                chatml_prompt(&messages, Some(SMOLLM2_SYSTEM_PROMPT), gen)
            );
        }
    }

    #[test]
    fn segments_separate_template_and_message_text() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let messages = [
            ChatMessage::new("system", "<|im_end|>"),
            ChatMessage::new("user", ""),
        ];
        let segments = t.render_segments(&messages, true).unwrap();
        assert_eq!(
            segments,
            [
                PromptSegment::Template("<|im_start|>system\n".into()),
                PromptSegment::Message("<|im_end|>".into()),
                PromptSegment::Template(
                    "<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n".into()
                ),
            ]
        );
        assert_eq!(segments_text(&segments), t.render(&messages, true).unwrap());
    }

    #[test]
    fn trimmed_content_is_found_and_rewritten_content_is_refused() {
        let trim = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}<turn>{{ m.content | trim }}</turn>\n{% endfor %}",
            "<bos>",
            "<eos>",
        )
        .unwrap();
        let segments = trim
            .render_segments(&[ChatMessage::new("user", "  hi  ")], false)
            .unwrap();
        assert_eq!(
            segments,
            [
                PromptSegment::Template("<bos><turn>".into()),
                PromptSegment::Message("hi".into()),
                PromptSegment::Template("</turn>\n".into()),
            ]
        );
        let upper = ChatTemplate::new(
            "{% for m in messages %}[{{ m.content | upper }}]{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let err = upper
            .render_segments(&[ChatMessage::new("user", "hi")], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("chat-template: the template rewrites the text of message 0 (role user) beyond trimming it; it cannot be split into template and message text"),
            "{err}"
        );
        let err = trim
            .render_segments(&[ChatMessage::new("user", "a\u{FDD0}")], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("chat-template: message 0 contains the noncharacter U+FDD0 or U+FDD1"),
            "{err}"
        );
    }

    #[test]
    fn hugging_face_template_helpers() {
        // Python string methods, raise_exception and strftime_now.
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}{{ messages[0]['content'].strip().upper() }}{{ strftime_now('%Y') | length }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi ")], false)
                .unwrap(),
            "HI4"
        );
        let err = t
            .render(&[ChatMessage::new("assistant", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Conversation roles must start with user"),
            "{err}"
        );
        let err = ChatTemplate::new("{% for %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("chat-template: parsing the template: "),
            "{err}"
        );
    }

    /// Renders `source` with one message, asserting it ends within 2 s.
    fn render_bounded(source: &str) -> Result<String> {
        let start = std::time::Instant::now();
        let r = ChatTemplate::new(source, "<s>", "</s>")
            .and_then(|t| t.render(&[ChatMessage::new("user", "hi")], true));
        let took = start.elapsed();
        assert!(
            took < std::time::Duration::from_secs(2),
            "{source}: {took:?}"
        );
        r
    }

    /// The error's first line (no backtrace).
    fn first_line(e: Error) -> String {
        e.to_string().lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn hostile_templates_end_in_an_error_naming_the_bound() {
        let budget = "would pass the budget of";
        for (source, want) in [
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
                "out of fuel",
            ),
            (
                "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                budget,
            ),
            (
                "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                budget,
            ),
            ("{% for c in 'x' * 100000000 %}{{ c }}{% endfor %}", budget),
            ("{{ ('x' * 99999999) ~ ('x' * 99999999) }}", budget),
            ("{% set a = 'xxxxxxxxxxxxxxxx' %}{% set b = a~a~a~a %}{% set c = b~b~b~b %}{% set d = c~c~c~c %}{% set e = d~d~d~d %}{% set f = e~e~e~e %}{% set g = f~f~f~f %}{% set h = g~g~g~g %}{% set i = h~h~h~h %}{% set j = i~i~i~i %}{% set k = j~j~j~j %}{{ k | length }}", budget),
            ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l ~ '' }}", budget),
            ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{% set x %}{{ ns.l }}{% endset %}", budget),
            ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set x %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = x %}{% endfor %}", budget),
            ("{{ 'x' | indent(1000000000000) }}", budget),
            ("{{ '%1000000000000s' % 'x' }}", budget),
            ("{{ '{:>1000000000000}'.format('x') }}", budget),
            ("{{ ('x' * 1000) | replace('', 'y' * 100000) }}", budget),
            ("{{ ([1] * 100000000) | list | length }}", budget),
            ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "recursion"),
            ("{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}", "out of fuel"),
            ("{% for i in range(100000) %}{% for j in range(30) %}{% set x = i + j %}{% endfor %}{% endfor %}", "out of fuel"),
        ] {
            let err = match render_bounded(source) {
                Ok(out) => panic!("{source} rendered {} bytes", out.len()),
                Err(e) => first_line(e),
            };
            assert!(err.starts_with("chat-template: rendering 1 messages: "), "{source}: {err}");
            assert!(err.contains(want), "{source}: {err}");
        }
        // A `set` in a loop body is the body's own: `s` does not double.
        assert_eq!(
            render_bounded(
                "{% set s = 'x' %}{% for i in range(64) %}{% set s = s ~ s %}{% endfor %}{{ s | length }}"
            )
            .unwrap(),
            "1"
        );
        // Output past the bound, rendering within the budget.
        let err = first_line(
            render_bounded("{% for i in range(3000) %}{{ 'y' * 1000 }}{% endfor %}").unwrap_err(),
        );
        assert_eq!(
            err,
            format!(
                "chat-template: rendering 1 messages: the output passed its bound of {} bytes",
                MAX_OUTPUT_BASE_BYTES + 6 * OUTPUT_BYTES_PER_MESSAGE_BYTE
            )
        );
        let err = first_line(ChatTemplate::new("{{ __cpa_guard_emit(1) }}", "", "").unwrap_err());
        assert_eq!(
            err,
            "chat-template: the template writes __cpa_guard_, a name reserved for the renderer's guards"
        );
    }

    #[test]
    fn guarded_operators_keep_their_meaning() {
        let t = "{{ 1 + 2 }}|{{ 'a' + 'b' }}|{{ ('a' ~ 1) ~ (2 * 3) }}|{{ 'x' * 3 }}|{{ [1] + [2] }}|{{ ([1, 2] * 2) | list }}|{{ 7 % 3 }}|{{ (messages[0].content ~ '!') | upper }}|{{ ((1 + 2)) * 3 }}|{{ -1 + 1 }}|{% for x in (messages | map(attribute='role')) + ['z'] %}{{ x }}{% endfor %}|{{ 2 ** 3 }}|{{ 1.5 + 1 }}|{{ 'a' if 1 + 1 == 2 else 'b' }}";
        assert_eq!(
            render_bounded(t).unwrap(),
            "3|ab|a16|xxx|[1, 2]|[1, 2, 1, 2]|1|HI!|9|0|userz|8|2.5|a"
        );
        // A long real message renders: the bounds grow with the messages.
        let t = ChatTemplate::new(SMOLLM2, "", "").unwrap();
        let long = "word ".repeat(400_000);
        let out = t.render(&[ChatMessage::new("user", &long)], true).unwrap();
        assert!(out.contains(&long));
    }

    #[test]
    fn strftime_formats_utc_dates() {
        assert_eq!(
            strftime("%d %b %Y %A %j %H:%M:%S %%", 0).unwrap(),
            "01 Jan 1970 Thursday 001 00:00:00 %"
        );
        // 2024-02-29 13:05:09 UTC, a leap day.
        assert_eq!(
            strftime("%Y-%m-%d %e %B %a %j %H:%M:%S", 1_709_211_909).unwrap(),
            "2024-02-29 29 February Thu 060 13:05:09"
        );
        assert_eq!(strftime("%d %b %Y", 1_735_689_600).unwrap(), "01 Jan 2025");
        let err = strftime("%Q", 0).unwrap_err().to_string();
        assert!(
            err.contains("strftime_now: unsupported directive %Q"),
            "{err}"
        );
    }
}
