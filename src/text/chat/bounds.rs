//! The bounds a chat template renders within: fuel, recursion, output
//! bytes, and a budget of the bytes of values it builds, charged by guards
//! that [`guarded_source`] writes into the template before it is compiled.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{bail, Error, Result};
use minijinja::machinery::{self, ast};
use minijinja::value::{Value, ValueKind};
use minijinja::{ErrorKind, State};

use super::OP;

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
pub(super) const GUARD: &str = "__cpa_guard_";

/// Deepest value nesting measured; deeper values count as over the budget.
pub(super) const MAX_VALUE_DEPTH: usize = 64;

/// The bytes of values one rendering may still build.
#[derive(Debug)]
pub(super) struct Budget {
    pub(super) limit: usize,
    pub(super) used: AtomicUsize,
}

impl minijinja::value::Object for Budget {}

impl Budget {
    pub(super) fn left(&self) -> usize {
        self.limit.saturating_sub(self.used.load(Ordering::Relaxed))
    }

    /// Charges `bytes`, or an error when they pass the limit.
    pub(super) fn charge(
        &self,
        what: &str,
        bytes: usize,
    ) -> std::result::Result<(), minijinja::Error> {
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
pub(super) fn budget(state: &State) -> std::result::Result<Arc<Budget>, minijinja::Error> {
    state
        .lookup(&format!("{GUARD}budget"))
        .and_then(|v| v.downcast_object::<Budget>())
        .ok_or_else(|| minijinja::Error::new(ErrorKind::InvalidOperation, "no rendering budget"))
}

/// The size of `v` in bytes (strings) and items (one per item of a
/// sequence, iterable or map, plus theirs; one per other value), counted up
/// to a little past `cap`: a value shared many times, or a lazy one, costs
/// at most that much to measure.
pub(super) fn size(v: &Value, cap: usize) -> usize {
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
pub(super) fn largest_number(s: &str) -> usize {
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
pub(super) fn largest_int(args: &[Value]) -> usize {
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
pub(super) const SCALED_BY_INT: [&str; 5] = ["indent", "tojson", "batch", "slice", "center"];

/// The builtin filters, each charged its arguments' size (see
/// [`filter_estimate`]) before it runs.
pub(super) fn builtin_filters() -> Vec<(&'static str, Value)> {
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
pub(super) fn filter_estimate(name: &str, args: &[Value], cap: usize) -> usize {
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
pub(super) fn method_estimate(value: &Value, method: &str, args: &[Value], cap: usize) -> usize {
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
pub(super) fn binop_estimate(op: &str, a: &Value, b: &Value, cap: usize) -> usize {
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
pub(super) struct BoundedWriter {
    pub(super) buf: Vec<u8>,
    pub(super) max: usize,
    pub(super) overflowed: bool,
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
pub(super) struct Rewriter<'s> {
    pub(super) src: &'s str,
    /// (offset, end of the replaced text, order key, text).
    pub(super) edits: Vec<(usize, usize, i64, String)>,
    /// The next preorder index.
    pub(super) next: i64,
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
        // `start - 1` is read only after `start > 0` (or `start == 0`) is
        // checked: it cannot underflow.
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
pub(super) fn guarded_source(source: &str) -> Result<String> {
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
